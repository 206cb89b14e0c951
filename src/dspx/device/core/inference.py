"""INFER on a core: zero-copy input views, the timed entry call, outputs
packed into output_buf (or the KV region), the response.

The front has validated every address, descriptor and the module's
signature and sends the resolved request once (``jobs.InferSpec``); the core
keeps it as a ``PreparedInfer`` call (core/prepared.py) — input views, the
entry's argument list — and runs it for every request with the same bytes.
Output layout in output_buf is abi.layout's: a descriptor region then each
tensor 64-byte aligned.  With KV_RESIDENT every output past the first is written to the KV
region instead, packed the same way from its base, and only the first output
(and its descriptor) reaches output_buf.

A plan with FLAG_PROFILE (or any plan while the core traces, dspx.trace)
runs the entry on a second VM over the same library whose every call is
timed (``TimedVM``); other plans keep the untimed VM and pay nothing.  The
profile rows go to the printf ring (docs/protocol.md, "Profile records").
"""
from __future__ import annotations

import math
import statistics
import time

import numpy as np

from ... import trace
from ...abi import layout, protocol as P
from ...abi.protocol import DType, Status
from .prepared import Outcome


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


class PreparedInfer:
    """One validated INFER, ready to run again and again."""

    def __new__(cls, spec, *args):
        # PROFILE, or a tracing core: the timed run, chosen once per plan (the
        # plain _entry() keeps its path, no per-call test)
        if cls is PreparedInfer and (spec.profile or trace.recorder() is not None):
            cls = TimedPreparedInfer
        return super().__new__(cls)

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
        if spec.profile and spec.printf is None:
            raise InferFailed(Status.ERR_INVALID, "PROFILE needs a printf buffer (SET_PRINTF_BUF): "
                                                  "the profile rows are written there")

    def run(self, core) -> Outcome:
        """Run the entry, place the outputs and write the printf text to the
        core's ring; a result that does not fit fails with its status."""
        try:
            cycles, descs, text = self._entry()
            return Outcome(answer=(cycles, descs, core.write_printf(self.spec.printf, text)))
        except InferFailed as e:
            return Outcome(e.status, str(e), e.numbers)

    def _entry(self) -> tuple[int, list, str]:
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

    def _entry_timed(self) -> tuple[int, list, str]:
        """_entry() on the module's TimedVM: every call of the entry timed; the
        rows go to printf (PROFILE) and to the trace (when the core traces)."""
        spec = self.spec
        timed = timed_vm(self.module)
        rec = trace.recorder()
        per_run, runs = [], []
        outs = None
        if timed.fresh:  # warm it up outside the report
            timed.call(self.args if self.args is not None else self.module.prepare(self.inputs, self.weights)[0])
            timed.take()
            timed.fresh = False
        for _ in range(max(1, spec.repeat)):
            outs = None
            args = self.args if self.args is not None else self.module.prepare(self.inputs, self.weights)[0]
            t0 = time.perf_counter_ns()
            outs = timed.call(args)
            t1 = time.perf_counter_ns()
            per_run.append(t1 - t0)
            calls = timed.take()
            runs.append(calls)
            if rec is not None:
                rec.complete(f"entry {self.module.entry}", t0, t1, "entry")
                for kind, name, shapes, c0, c1 in calls:
                    if kind != "vm":  # built-ins (thousands per LLM step) only in the profile's rows
                        rec.complete(name, c0, c1, kind, {"shapes": shapes})
        cycles = per_run[0] if len(per_run) == 1 else int(statistics.median(per_run))
        text = "".join(f"run {i}: {c} cycles\n" for i, c in enumerate(per_run)) if len(per_run) > 1 else ""
        if spec.profile:
            text += profile_text(runs, sum(per_run), spec.printf[2] - layout.PRINTF_HEADER - len(text.encode()))
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

    def response(self, seq: int, outcome: Outcome, queued_us: int) -> bytes | None:
        """The INFER response (None for a failure: the worker answers it);
        ``queued_us``: not in an INFER response."""
        if outcome.status != Status.SUCCESS:
            return None
        cycles, descs, printf_size = outcome.answer
        resp = self.resp_cls(seq=seq, cycles=cycles, num_outputs=len(descs), printf_size=printf_size)
        if len(descs) <= P.MAX_INLINE_OUTPUTS:
            resp.descs = descs
        else:
            resp.descs_addr = self.spec.result[3]
            resp.descs_size = len(descs) * P.TensorDesc.SIZE
        return resp.encode()


class TimedPreparedInfer(PreparedInfer):
    _entry = PreparedInfer._entry_timed


# ------------------------------------------------------------------ timed calls (PROFILE, trace)

def _kind(symbol: str) -> str:
    if symbol.startswith("dspx.kernels."):
        return "kernel"
    return "vm" if symbol.startswith("vm.") else "tvm"


class TimedVM:
    """A second Relax VM over a mapped module's library with an instrument
    timing every call instruction: firmware kernels (call_dps_packed), the
    module's compiled TVM functions and the VM's built-ins."""

    def __init__(self, module):
        import tvm
        from tvm import relax

        self.vm = relax.VirtualMachine(module._lib, tvm.cpu())
        self._func = self.vm[module.entry]
        self._calls: list = []  # (symbol, t0, t1, args) in order of completion
        self._last = None
        starts, calls, clock, tensor = [], self._calls, time.perf_counter_ns, tvm.runtime.Tensor

        def instrument(func, symbol, before, ret, *args):
            if before:
                starts.append(clock())
            else:
                calls.append((symbol, starts.pop(), clock(), [a for a in args if isinstance(a, tensor)]))
            return 0

        self.vm.set_instrument(instrument)
        self.fresh = True  # its first call pays the allocator's first allocations

    def call(self, args: list) -> list:
        import tvm_ffi
        self._last = None
        out = self._func(*args)
        outs = list(out) if isinstance(out, (list, tuple, tvm_ffi.Array)) else [out]
        self._last = outs  # numpy views below stay valid until the next call
        return [np.from_dlpack(o) for o in outs]

    def take(self) -> list:
        """The last run's calls as (kind, symbol, shapes, t0, t1), started-first order."""
        calls = sorted(self._calls, key=lambda c: c[1])
        self._calls.clear()
        return [(_kind(s), s, ",".join("x".join(map(str, a.shape)) for a in args), t0, t1)
                for s, t0, t1, args in calls]


def timed_vm(module) -> TimedVM:
    """The module's TimedVM, made on first use and kept on the module, whose
    unload drops it: it holds the library, which must be unmapped with the
    module (a library still mapped under a reused /proc/self/fd path would be
    what the next load's dlopen returns)."""
    t = getattr(module, "timed", None)
    if t is None:
        if module._lib is None:
            from .errors import CallError
            raise CallError("module is unloaded")
        t = module.timed = TimedVM(module)
    return t


def profile_rows(runs: list) -> list:
    """[kind, name, shapes, calls, cycles]: one row per call site of a kernel or
    TVM function (call order), one per VM built-in name; summed over runs."""
    rows: dict = {}
    for calls in runs:
        site = 0
        for kind, name, shapes, t0, t1 in calls:
            if kind == "vm":
                key = ("vm", name)
            else:
                key, site = (site, name), site + 1
            row = rows.get(key)
            if row is None:
                row = rows[key] = [kind, name, shapes if kind != "vm" else "", 0, 0]
            row[3] += 1
            row[4] += t1 - t0  # 1 GHz nominal clock: ns == cycles
    return list(rows.values())


def profile_text(runs: list, entry_cycles: int, room: int) -> str:
    """The profile records (docs/protocol.md) in at most ``room`` bytes;
    rows that do not fit are dropped smallest first."""
    rows = [f"{P.PROFILE_PREFIX}-row\t{k}\t{n}\t{s}\t{c}\t{cy}\n" for k, n, s, c, cy in profile_rows(runs)]
    cycles = [int(r.rsplit("\t", 1)[1]) for r in rows]
    keep = list(range(len(rows)))

    def head(dropped):
        return f"{P.PROFILE_PREFIX}\t1\truns={len(runs)}\tentry_cycles={entry_cycles}\t" \
               f"rows={len(rows) - dropped}\tdropped={dropped}\n"

    size = len(head(0)) + 4 + sum(len(r) for r in rows)
    for i in sorted(keep, key=lambda i: cycles[i]):
        if size <= room:
            break
        keep.remove(i)
        size -= len(rows[i])
    return head(len(rows) - len(keep)) + "".join(rows[i] for i in keep)
