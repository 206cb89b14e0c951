"""Firmware operators, registered before the service starts.

softmax (cmd 0x1402) is the UCP sample operator: its input buffer holds the
seed's ``hbDSPSoftmaxParam`` (24 bytes, see ``dspx.abi.ops``) and the output
buffer receives softmax(data).  It is C, written as the seed writes it
through the operator SDK (src/dspx/sdk/dsp/builtin_softmax.cc), built once
into the SDK cache and loaded as a native library with lib handle 0.

The Python functions below are the same algorithm against the Python
runtime (benchmarks/softmax_device.py measures them); the loadable Python
example is examples/softmax/softmax_ops.py (cmd 0x2402).
"""
from __future__ import annotations

import math

import numpy as np

from ...abi.ops import SOFTMAX_CMD, SOFTMAX_PARAM, read_softmax_param
from .runtime import (TILE_ELEMS, Status, cycles, mem_map, mem_unmap, ping_pong, printf, vecexp_max,
                      vecmax, vecmul)



def softmax_direct(src: np.ndarray, dst: np.ndarray) -> None:
    """Whole-array vector passes over DDR (the seed's dsp_softmax)."""
    m = vecmax(src)
    total = vecexp_max(dst, src, m)
    vecmul(dst, dst, np.float32(1) / total)


def softmax_ping_pong(src: np.ndarray, dst: np.ndarray, tm, tile_elems: int = TILE_ELEMS) -> None:
    """Two ping-pong passes through L2 (online softmax): the first keeps a
    running max and a sum of exp(x - max) rescaled whenever the max grows, so
    each tile is read from DDR once and all its arithmetic stays in L2; the
    second writes exp(x - max) / sum back.  DDR sees 2 reads + 1 write of the
    data, against 5 reads + 3 writes for the whole-array passes of the direct
    path — the point of tiling through fast local memory."""
    n = src.size
    m = np.float32(-np.inf)
    total = 0.0  # float32 tile sums accumulated in double

    def tile_max_sum(tile):
        nonlocal m, total
        tm_ = vecmax(tile)
        if not np.isfinite(tm_):  # NaN/inf propagate exactly as the direct path would
            m = np.float32(tm_) if np.isnan(tm_) or tm_ > m else m
            return
        s = float(vecexp_max(tile, tile, tm_))  # the tile is scratch here: no write-back
        # Rescale factors in double: one per tile, so float32 rounding would compound.
        if tm_ > m:
            total = total * math.exp(float(m) - float(tm_)) + s
            m = tm_
        else:
            total += s * math.exp(float(tm_) - float(m))

    ping_pong(src, None, n, tile_max_sum, tm, tile_elems=tile_elems, write_back=False)
    inv = np.float32(1) / np.float32(total)

    def tile_out(tile):
        vecexp_max(tile, tile, m)
        vecmul(tile, tile, inv)

    ping_pong(src, dst, n, tile_out, tm, tile_elems=tile_elems)


def softmax(input: np.ndarray, output: np.ndarray, tm) -> int:
    if input.nbytes < SOFTMAX_PARAM.size:
        printf("softmax: input holds %d bytes, the parameter struct needs %d\n",
               input.nbytes, SOFTMAX_PARAM.size)
        return Status.ERR_SIZE
    size, addr, tcm = read_softmax_param(input)
    if size < 0 or size % 4:
        printf("softmax: data_size %d is not a whole number of float32s\n", size)
        return Status.ERR_INVALID
    if output.nbytes < size:
        printf("softmax: output holds %d bytes, data_size is %d\n", output.nbytes, size)
        return Status.ERR_SIZE
    if size == 0:
        return 0
    raw = mem_map(addr, size)
    src = raw.view(np.float32)
    dst = output[:size].view(np.float32)
    # NaN/inf inputs give NaN outputs, as in the seed's SIMD code: no warnings.
    with np.errstate(all="ignore"):
        _softmax_paths(src, dst, tcm, tm)
    mem_unmap(raw)
    return 0


def _softmax_paths(src, dst, tcm, tm) -> None:
    start = cycles()
    if tcm:
        softmax_ping_pong(src, dst, tm)
        printf("find softmax ping-pong tcm is %d cycles\n", cycles() - start)
    else:
        softmax_direct(src, dst)
        printf("find softmax ddr tcm is %d cycles\n", cycles() - start)


def register(registry) -> None:
    """Put the firmware operators into an OpRegistry: the C softmax."""
    from ... import sdk
    from . import native

    path = sdk.builtin_softmax(cost=native.cost_on())  # counted when the core has a cost model
    registry.register_native(path.read_bytes(), path.name, names={SOFTMAX_CMD: "softmax"})
