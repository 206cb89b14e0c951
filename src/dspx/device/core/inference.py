"""INFER on a core: zero-copy input views, the timed entry call, outputs
packed 64-byte aligned into output_buf (or the KV region), printf.

The front has already validated every address, descriptor and the module's
signature; this module only turns the resolved job into numpy views and
writes results.  Output layout in output_buf (matches io_meta's formula):
a descriptor region (80 × outputs, rounded up to 64) then each tensor
rounded up to 64 bytes.  With KV_RESIDENT every output past the first is
written to the KV region instead, packed the same way from its base, and
only the first output (and its descriptor) reaches output_buf.
"""
from __future__ import annotations

import math
import statistics
import time

import numpy as np

from ...abi.layout import ALIGN, align, desc_region
from ...abi.protocol import DType, Status, TensorDesc



class InferFailed(Exception):
    def __init__(self, status: int, message: str, **numbers):
        super().__init__(message)
        self.status = status
        self.numbers = numbers


def view(mm, offset: int, shape, dtype) -> np.ndarray:
    dt = np.dtype(dtype)
    count = math.prod(shape)  # not np.prod: ~10x slower on a tuple, and this runs per tensor per call
    return np.frombuffer(mm, dtype=dt, count=count, offset=offset).reshape(shape)


_CODE_BITS: dict[np.dtype, tuple[int, int]] = {}


def _desc(addr: int, arr: np.ndarray) -> TensorDesc:
    # by np.dtype object: dtype.name is Python code and this runs per output per call
    cb = _CODE_BITS.get(arr.dtype)
    if cb is None:
        cb = _CODE_BITS[arr.dtype] = DType.code_bits(arr.dtype.name)
    return TensorDesc(addr, arr.nbytes, arr.ndim, cb[0], cb[1], arr.shape)


def run(module, weights, job: dict, bufs: dict) -> dict:
    """Execute one resolved INFER job; return the response fields."""
    inputs = [view(bufs[b], off, shape, dtype) for b, off, shape, dtype in job["inputs"]]
    repeat = max(1, job["repeat"])
    per_run = []
    outs = None
    for _ in range(repeat):
        outs = None  # drop the previous run's outputs before the next one
        t0 = time.perf_counter_ns()
        outs = module.run(inputs, weights)
        per_run.append(time.perf_counter_ns() - t0)
    # 1 GHz nominal clock: one cycle per nanosecond.
    cycles = per_run[0] if repeat == 1 else int(statistics.median(per_run))
    lines = []
    if repeat > 1:
        lines = [f"run {i}: {c} cycles\n" for i, c in enumerate(per_run)]
    outs = [np.ascontiguousarray(o) for o in outs]

    res_buf, res_off, res_size, res_addr = job["result"]
    to_output = outs[:1] if job["kv_resident"] else outs
    to_kv = outs[1:] if job["kv_resident"] else []

    descs = []
    pos = desc_region(len(to_output))
    out_mm = bufs[res_buf]
    for arr in to_output:
        end = pos + arr.nbytes
        if end > res_size:
            raise InferFailed(Status.ERR_SIZE,
                              f"output {len(descs)} ({arr.nbytes} bytes) does not fit: output_buf holds "
                              f"{res_size} bytes, {align(end, ALIGN)} needed through this tensor",
                              result_required=align(end, ALIGN), cycles=cycles)
        view(out_mm, res_off + pos, arr.shape, arr.dtype)[...] = arr
        descs.append(_desc(res_addr + pos, arr))
        pos = align(end, ALIGN)
    if to_kv:
        kv_buf, kv_off, kv_size, kv_addr = job["kv"]
        kv_mm = bufs[kv_buf]
        kpos = 0
        for i, arr in enumerate(to_kv):
            end = kpos + arr.nbytes
            if end > kv_size:
                raise InferFailed(Status.ERR_SIZE,
                                  f"KV output {i + 1} does not fit the {kv_size}-byte KV region "
                                  f"({end} bytes needed)", result_required=0, cycles=cycles)
            dst = view(kv_mm, kv_off + kpos, arr.shape, arr.dtype)
            # A module that updated its KV input in place hands back that very view.
            if not np.shares_memory(dst, arr):
                dst[...] = arr
            kpos = align(end, ALIGN)
    # Descriptors always sit at the front of output_buf; the response also
    # carries them inline when they fit.
    table = b"".join(d.encode() for d in descs)
    out_mm[res_off:res_off + len(table)] = table
    return {"cycles": cycles, "descs": descs, "desc_addr": res_addr, "printf": "".join(lines)}
