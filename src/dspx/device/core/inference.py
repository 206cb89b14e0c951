"""INFER on a core: zero-copy input views, the timed entry call, outputs
packed into output_buf (or the KV region), the response.

The front has validated every address, descriptor and the module's
signature and sends the resolved request once (``jobs.InferSpec``); the core
keeps it as a ``Prepared`` call — input views, the entry's argument list —
and runs it for every request with the same bytes.  Output layout in
output_buf is abi.layout's: a descriptor region then each tensor 64-byte
aligned.  With KV_RESIDENT every output past the first is written to the KV
region instead, packed the same way from its base, and only the first output
(and its descriptor) reaches output_buf.
"""
from __future__ import annotations

import math
import statistics
import time

import numpy as np

from ...abi import layout, protocol as P
from ...abi.protocol import DType, Status


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


def _desc(addr: int, arr: np.ndarray) -> P.TensorDesc:
    # by np.dtype object: dtype.name is Python code and this runs per output per call
    cb = _CODE_BITS.get(arr.dtype)
    if cb is None:
        cb = _CODE_BITS[arr.dtype] = DType.code_bits(arr.dtype.name)
    return P.TensorDesc(addr, arr.nbytes, arr.ndim, cb[0], cb[1], arr.shape)


class Prepared:
    """One validated INFER, ready to run again and again."""

    def __init__(self, spec, module, weights, bufs: dict):
        self.spec = spec
        self.module = module
        self.inputs = [view(bufs[b], off, shape, dtype) for b, off, shape, dtype in spec.inputs]
        self.weights = weights
        self.out_mm = bufs[spec.result[0]]
        self.kv_mm = bufs[spec.kv[0]] if spec.kv else None
        self.resp_cls = P.message_class(spec.resp_type)
        args, reusable = module.prepare(self.inputs, weights)  # the signature check, once
        self.args = args if reusable else None

    def run(self) -> tuple[int, list, str]:
        """Run the entry (``repeat`` times) and place the outputs; returns
        (cycles, output descriptors, printf text)."""
        spec = self.spec
        repeat = max(1, spec.repeat)
        per_run = []
        outs = None
        for _ in range(repeat):
            outs = None  # drop the previous run's outputs before the next one
            args = self.args if self.args is not None else self.module.prepare(self.inputs, self.weights)[0]
            t0 = time.perf_counter_ns()
            outs = self.module.call(args)
            per_run.append(time.perf_counter_ns() - t0)
        # 1 GHz nominal clock: one cycle per nanosecond.
        cycles = per_run[0] if repeat == 1 else int(statistics.median(per_run))
        text = "".join(f"run {i}: {c} cycles\n" for i, c in enumerate(per_run)) if repeat > 1 else ""
        return cycles, self._place([np.ascontiguousarray(o) for o in outs], cycles), text

    def _place(self, outs: list, cycles: int) -> list:
        res_buf, res_off, res_size, res_addr = self.spec.result
        to_output = outs[:1] if self.spec.kv_resident else outs
        to_kv = outs[1:] if self.spec.kv_resident else []
        descs = []
        pos = layout.desc_region(len(to_output))
        for arr in to_output:
            end = pos + arr.nbytes
            if end > res_size:
                raise InferFailed(Status.ERR_SIZE,
                                  f"output {len(descs)} ({arr.nbytes} bytes) does not fit: output_buf holds "
                                  f"{res_size} bytes, {layout.align(end)} needed through this tensor",
                                  result_required=layout.align(end), cycles=cycles)
            view(self.out_mm, res_off + pos, arr.shape, arr.dtype)[...] = arr
            descs.append(_desc(res_addr + pos, arr))
            pos = layout.align(end)
        if to_kv:
            _, kv_off, kv_size, _ = self.spec.kv
            offsets, end = layout.pack(a.nbytes for a in to_kv)
            if end > kv_size:
                raise InferFailed(Status.ERR_SIZE, f"KV outputs need {end} bytes; the KV region holds {kv_size}",
                                  result_required=0, cycles=cycles)
            for kpos, arr in zip(offsets, to_kv):
                dst = view(self.kv_mm, kv_off + kpos, arr.shape, arr.dtype)
                # A module that updated its KV input in place hands back that very view.
                if not np.shares_memory(dst, arr):
                    dst[...] = arr
        # Descriptors always sit at the front of output_buf; the response also
        # carries them inline when they fit.
        table = P.encode_descs(descs)
        self.out_mm[res_off:res_off + len(table)] = table
        return descs

    def response(self, seq: int, cycles: int, descs: list, printf_size: int) -> bytes:
        resp = self.resp_cls(seq=seq, cycles=cycles, num_outputs=len(descs), printf_size=printf_size)
        if len(descs) <= P.MAX_INLINE_OUTPUTS:
            resp.descs = descs
        else:
            resp.descs_addr = self.spec.result[3]
            resp.descs_size = len(descs) * P.TensorDesc.SIZE
        return resp.encode()
