"""Softmax as a loadable op library (cmd 0x2402).

Load it into a running device (``dspx load-ops examples/softmax/softmax_ops.py``
or ``OpRegistry.load_library``); it may import only numpy, math and the
runtime's export table.  The input buffer holds the UCP sample's
parameter struct ``int32 data_size; uint64 input; uint8 run_tcm_opt`` as C
lays it out (24 bytes, data_size in bytes); the output buffer receives the
softmax of the float32 array at DSP address ``input``.
"""
import numpy as np

from dspx.device.core.runtime import (Status, cycles, mem_map, mem_unmap, ping_pong, printf, register_op,
                                      vecexp_max, vecmax, vecmul)

PARAM = np.dtype({"names": ["data_size", "input", "run_tcm_opt"], "formats": ["<i4", "<u8", "u1"],
                  "offsets": [0, 8, 16], "itemsize": 24})  # C layout, 24 bytes


@register_op(0x2402, latency_us=0)
def softmax_lib(input, output, tm):
    if input.nbytes < PARAM.itemsize:
        return Status.ERR_SIZE
    p = np.frombuffer(input, PARAM, count=1)[0]
    size = int(p["data_size"])
    if size <= 0 or size % 4 or output.nbytes < size:
        printf("softmax_lib: bad data_size %d (output holds %d bytes)\n", size, output.nbytes)
        return Status.ERR_INVALID
    raw = mem_map(int(p["input"]), size)
    src, dst = raw.view(np.float32), output[:size].view(np.float32)
    start = cycles()
    if p["run_tcm_opt"]:
        m = np.float32(-np.inf)
        total = 0.0

        def tile_max(tile):
            nonlocal m
            m = np.maximum(m, vecmax(tile))

        def tile_exp_sum(tile):
            nonlocal total
            total += float(vecexp_max(tile, tile, m))

        ping_pong(src, None, src.size, tile_max, tm, write_back=False)
        ping_pong(src, dst, src.size, tile_exp_sum, tm)
        inv = np.float32(1) / np.float32(total)
        ping_pong(dst, dst, dst.size, lambda tile: vecmul(tile, tile, inv), tm)
        printf("softmax_lib ping-pong: %d cycles\n", cycles() - start)
    else:
        vecmul(dst, dst, np.float32(1) / vecexp_max(dst, src, vecmax(src)))
        printf("softmax_lib ddr: %d cycles\n", cycles() - start)
    mem_unmap(raw)
    return 0
