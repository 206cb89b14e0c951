"""The seed's softmax sample end to end (Horizon UCP flow, on dspx).

Allocates DSP-visible memory, fills 100,000 floats (1 + i/size), runs the
softmax operator (cmd 0x1402) without and with the ping-pong (TCM/L2) path,
compares the two results within 1e-6 relative and prints the cycles of each.

    python examples/softmax/host.py                 # the built-in op
    python examples/softmax/host.py --library       # the same op as a loadable library (cmd 0x2402)
"""
import argparse
import sys
from pathlib import Path

import numpy as np

from dspx.host.tasks import SOFTMAX_CMD, Tasks, softmax_param

LIBRARY = Path(__file__).with_name("softmax_ops.py")


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--size", type=int, default=100_000)
    ap.add_argument("--library", action="store_true", help="load softmax_ops.py and use its cmd 0x2402")
    ap.add_argument("--socket", default=None)
    a = ap.parse_args()

    with Tasks(socket=a.socket) as ucp:
        cmd = SOFTMAX_CMD
        if a.library:
            handle, _ = ucp.load_ops(LIBRARY)
            cmd = 0x2402
        size = a.size
        input_data = ucp.malloc(size * 4)                        # hbUCPMalloc + hbDSPAddrMap
        input_data.view(np.float32)[:] = 1 + np.arange(size, dtype=np.float32) / np.float32(size)
        output_mem, output_opt_mem = ucp.malloc(size * 4), ucp.malloc(size * 4)
        input_mem = ucp.malloc(24)                               # the packed hbDSPSoftmaxParam

        softmax_param(input_mem, input_data, size, tiled=False)  # run without ping-pong
        direct = ucp.run(cmd, input_mem, output_mem, core=0, priority=0)
        softmax_param(input_mem, input_data, size, tiled=True)   # run with ping-pong
        tiled = ucp.run(cmd, input_mem, output_opt_mem, core=0, priority=0)

        dst, opt = output_mem.view(np.float32), output_opt_mem.view(np.float32)
        rel = np.abs(dst - opt) / np.abs(dst)
        bad = np.flatnonzero(rel > 1e-6)
        print(f"direct (DDR):      {direct.cycles:>12,} cycles")
        print(f"ping-pong (L2):    {tiled.cycles:>12,} cycles  ({tiled.cycles / direct.cycles:.2f} x direct)")
        if bad.size:
            i = bad[0]
            print(f"opt vs non-opt result is diff {i}, dst {dst[i]} opt {opt[i]}")
            return 1
        print("opt vs non-opt result is same")
        for m in (input_mem, output_mem, output_opt_mem, input_data):
            ucp.free(m)
        if a.library:
            ucp.unload_ops(handle)
    return 0


if __name__ == "__main__":
    sys.exit(main())
