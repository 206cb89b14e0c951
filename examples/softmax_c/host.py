"""The seed's softmax in C, end to end on dspx.

softmax_ivp.cc is the seed's DSP code as the seed lists it (only its
includes are dspx's); softmax.h holds what the seed leaves to the user
(TILE_SIZE, hbDSPSoftmaxParam) and register.cc its registration.  This
script builds them with `dspx build-ops`, loads the library (cmd 0x3402)
and runs the seed's host flow: 100,000 floats 1 + i/size, the op without
and with ping-pong, the two results compared within 1e-6 relative.

    python examples/softmax_c/host.py [--size N] [--socket PATH]
"""
import argparse
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

from dspx.host.tasks import Tasks, softmax_param

HERE = Path(__file__).resolve().parent
SOURCES = [HERE / "softmax_ivp.cc", HERE / "register.cc"]
CMD = 0x3402  # SOFTMAX_C_CMD in softmax.h (0x1402 is the firmware's own)


def build(out: Path) -> bytes:
    subprocess.run([sys.executable, "-m", "dspx.cli", "build-ops", *map(str, SOURCES), "-o", str(out)], check=True,
                   stderr=subprocess.DEVNULL)  # the seed's code warns about its 32-bit pointer cast
    return out.read_bytes()


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--size", type=int, default=100_000)
    ap.add_argument("--socket", default=None)
    a = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        lib = build(Path(tmp) / "libsoftmax_c.so")

    with Tasks(socket=a.socket) as ucp:
        handle, _ = ucp.load_ops(lib)
        size = a.size
        input_data = ucp.malloc(size * 4)                        # hbUCPMalloc + hbDSPAddrMap
        input_data.view(np.float32)[:] = 1 + np.arange(size, dtype=np.float32) / np.float32(size)
        output_mem, output_opt_mem = ucp.malloc(size * 4), ucp.malloc(size * 4)
        input_mem = ucp.malloc(24)                               # hbDSPSoftmaxParam

        softmax_param(input_mem, input_data, size, tiled=False)  # run without ping-pong
        direct = ucp.run(CMD, input_mem, output_mem, core=0, priority=0)
        softmax_param(input_mem, input_data, size, tiled=True)   # run with ping-pong
        tiled = ucp.run(CMD, input_mem, output_opt_mem, core=0, priority=0)

        dst, opt = output_mem.view(np.float32), output_opt_mem.view(np.float32)
        print(f"direct (DDR):      {direct.cycles:>12,} cycles")
        print(f"ping-pong (L2):    {tiled.cycles:>12,} cycles  ({tiled.cycles / direct.cycles:.2f} x direct)")
        bad = np.flatnonzero(np.abs(dst - opt) / np.abs(dst) > 1e-6)
        status = 0
        if bad.size:
            i = bad[0]
            print(f"opt vs non-opt result is diff {i}, dst {dst[i]} opt {opt[i]}")
            status = 1
        else:
            print("opt vs non-opt result is same")
        for m in (input_mem, output_mem, output_opt_mem, input_data):
            ucp.free(m)
        ucp.unload_ops(handle)
    return status


if __name__ == "__main__":
    sys.exit(main())
