"""A compiled language model on the device: prefill + KV-resident decode.

``DeviceLLM`` loads a directory written by ``dspx compile-llm`` (prefill.so,
decode.so, one shared weights.bin) onto a :class:`~dspx.host.client.Client`
with the device's default sizes, and runs:

- ``prefill(ids, start)``: chunks of 64 tokens, KV_RESIDENT: the 60 KV inputs
  are the KV region itself (tensor i at ``i × 196,608``), the module appends the
  new rows in place and only the logits come back through output_buf;
- ``decode(token, pos, resident=True)``: one token.  Resident, the host copies
  16 bytes of ids/positions plus the 4,960-byte descriptor table into input_buf
  and reads the logits; non-resident, the KV goes both ways through
  input_buf/output_buf (the host keeps it in its own arrays).

Traffic ("bytes moved") is counted by this module as it copies: bytes the
host writes into input_buf (tensors + the descriptor table when it does not
fit in the message) plus KV bytes it copies out of output_buf.  Reading the
last position's logits (196,608 bytes) is the same in both modes and is
counted apart.  (The dmabufs' ``synced`` counters count whole buffers per
sync — DMA_BUF_IOCTL_SYNC has no range — so they show *which* buffers a call
touched: a resident decode never syncs the staging buffer holding the KV
region.)
"""
from __future__ import annotations

import logging
import time
import warnings
from dataclasses import dataclass
from typing import Sequence

import numpy as np

from ... import trace
from ...abi import llmpack
from ...errors import CapacityWarning
from ...llm import LLMError

__all__ = ["ContextFullError", "DeviceLLM", "Traffic"]

log = logging.getLogger("dspx.host.llm")


class ContextFullError(LLMError):
    """The prompt (or the conversation) does not fit the model's context (or its KV slot)."""

    def __init__(self, needed: int, context: int, what: str = "prompt", slots: int = 1):
        self.needed = needed
        self.context = context
        holder = "the device model's context" if slots == 1 else f"each of the {slots} KV slots"
        super().__init__(f"{what} is {needed} tokens; {holder} holds {context} "
                         f"(prompt + answer): shorten it" + (" or start a new chat" if what != "prompt" else ""))


@dataclass
class Traffic:
    """Bytes the host moved for one call (see the module docstring)."""

    input_bytes: int = 0    # tensors copied into input_buf
    desc_bytes: int = 0     # descriptor table written into input_buf (INFER_LARGE)
    kv_out_bytes: int = 0   # KV copied out of output_buf (non-resident)
    logits_bytes: int = 0   # logits read (same in both modes)

    @property
    def moved(self) -> int:
        return self.input_bytes + self.desc_bytes + self.kv_out_bytes

    def add(self, o: "Traffic") -> None:
        self.input_bytes += o.input_bytes
        self.desc_bytes += o.desc_bytes
        self.kv_out_bytes += o.kv_out_bytes
        self.logits_bytes += o.logits_bytes

    def to_json(self) -> dict:
        return {"input_bytes": self.input_bytes, "desc_bytes": self.desc_bytes, "kv_out_bytes": self.kv_out_bytes,
                "moved_bytes": self.moved, "logits_bytes": self.logits_bytes}


def _status(progress: bool, text: str):
    if not progress:
        from contextlib import nullcontext
        return nullcontext()
    from rich.console import Console
    return Console(stderr=True).status(text)


_DECODE_MODULES = {"serial": "decode", "parallel": "decode_parallel"}  # decode kind -> the package's module
_BATCH_MODULES = {"serial": "decode_batch", "parallel": "decode_batch_parallel"}  # the same for a batched step


class DeviceLLM:
    """A compiled LLM loaded on a device (see the module docstring)."""

    def __init__(self, model_dir=None, *, client=None, gguf=None, socket: str | None = None,
                 progress: bool = True, context: int = llmpack.CONTEXT, kv_dtype: str = "float32",
                 decode_threads: str | None = None, decode_activations: str = "int8"):
        from ..client import Client

        t0 = time.perf_counter()
        if model_dir is None:  # compile the GGUF on first use (cached)
            from ...compiler.llm import compiled_dir
            model_dir = compiled_dir(gguf, progress=progress, context=context, kv_dtype=kv_dtype,
                                     decode_activations=decode_activations)
        try:
            pkg = llmpack.read(model_dir)
        except llmpack.PackageError as e:
            raise LLMError(str(e)) from None
        self.dir, self.meta = pkg.dir, pkg.meta
        self.context, self.chunk, self.vocab = pkg.context, pkg.chunk, pkg.vocab
        self.kv_shape, self.kv_offsets, self.kv_total = pkg.kv_shape, pkg.kv_offsets, pkg.kv_total
        self._own_client = client is None
        self.client = client if client is not None else Client(socket)
        if self.client.kv_size < self.kv_total:
            raise LLMError(f"the model's KV cache needs {self.kv_total} bytes; this client's KV region holds "
                           f"{self.client.kv_size}")
        self.kv_dtype = self.meta["kv"].get("dtype", "float32")
        # inputs: ids, positions, bases, then the KV tensors
        self.kv_inputs = [(3 + i, off, self.kv_shape, self.kv_dtype) for i, off in enumerate(self.kv_offsets)]
        self.slots, self.slot_tokens = 1, self.context  # KV slots (set_slots) and the positions each holds
        self.load_warnings: list[str] = []
        self.handles: dict[str, int] = {}
        self._decode_name = "decode"
        self._batch_name = "decode_batch"
        self._threads = decode_threads  # "serial" | "parallel" | "auto" | None: _threads_wanted
        self.batch_choice: dict | None = None  # serial or parallel batched step: chosen by the first set_slots(n > 1)
        try:
            self._load(progress)
        except BaseException:
            self.close()
            raise
        self.host_kv: list[np.ndarray] | None = None  # KV kept by the host (non-resident decode)
        self.kv_on_host = False
        self.traffic = Traffic()
        self.last_traffic = Traffic()
        self.decode_choice = self._choose_decode()
        self.timings = {"load": time.perf_counter() - t0}

    def _load(self, progress: bool) -> None:
        c = self.client
        mods = self.meta["modules"]
        # Prefill first: its declaration (input 11.8 MB + output 24.4 MB) does
        # not fit beside the 480 MiB staging + KV with the default carveout; the
        # load warns (declared vs allocated) and we declare the real figure
        # (KV-resident: only the logits reach output_buf) before any inference.
        for name in [m for m in ("prefill", *_DECODE_MODULES.values(), *_BATCH_MODULES.values()) if m in mods]:
            elf = (self.dir / mods[name]["module"]).read_bytes()
            with _status(progress, f"loading {name} module ({len(elf) / 1e6:.1f} MB) …"):
                with warnings.catch_warnings(record=True) as rec:
                    warnings.simplefilter("always", CapacityWarning)
                    self.handles[name] = c.load_module(elf).handle
            for w in rec:
                if issubclass(w.category, CapacityWarning):
                    self.load_warnings.append(str(w.message))
                else:
                    warnings.warn_explicit(w.message, w.category, w.filename, w.lineno)
            if name == "prefill":
                res = mods["prefill"]["io_reserve"]
                if not c.io_locked:
                    c.reserve_io(res["input_bytes"], res["output_bytes"], mods["prefill"]["io"]["num_inputs"])
        if self.load_warnings:
            res = mods["prefill"]["io_reserve"]
            io = mods["prefill"]["io"]
            log.debug("the prefill module declares %s input + %s output bytes, more than the carveout has left "
                      "beside staging + KV (the load warned: declared vs allocated); reserved its KV-resident "
                      "figure from metadata.json instead: output %s bytes",
                      f"{io['input_bytes']:,}", f"{io['output_bytes']:,}", f"{res['output_bytes']:,}")
        wpath = self.dir / self.meta["weights"]["file"]
        data = wpath.read_bytes()
        with _status(progress, f"loading weights ({len(data) / 2**20:.1f} MiB, MODEL_LOAD once for both modules) …"):
            self.model_id, self.num_constants = c.load_weights(data)

    def _threads_wanted(self) -> str:
        """"serial" | "parallel" | "auto": the ``decode_threads`` argument, else ``$DSPX_LLM_DECODE``, else auto."""
        import os

        want = self._threads or os.environ.get("DSPX_LLM_DECODE", "auto")
        if want not in ("auto", "serial", "parallel"):
            raise LLMError(f"decode threads {want!r}: use auto, serial or parallel")
        return want

    def _time_kinds(self, modules: dict, attr: str, step) -> dict:
        """Median ms of ``step(round)`` on each kind's module (``modules``: kind ->
        module; ``attr``: the attribute naming the module a step runs), three
        alternating rounds after a warm-up; the traffic counters start again after."""
        ms: dict = {kind: [] for kind in modules}
        for rnd in range(4):
            for kind, name in modules.items():
                setattr(self, attr, name)
                t = time.perf_counter()
                step(rnd)
                if rnd:
                    ms[kind].append((time.perf_counter() - t) * 1e3)
        self.traffic, self.last_traffic = Traffic(), Traffic()
        return {kind: round(float(np.median(v)), 2) for kind, v in ms.items()}

    def _choose_decode(self) -> dict:
        """Serial or parallel decode GEMVs (``_threads_wanted``).  Auto times both
        modules on a few KV-resident steps here (the machine as it is now: both
        cores free, or one busy) and keeps the faster; positions 0..7 of the
        KV are scratch (every prefill rewrites them)."""
        want = self._threads_wanted()
        if "decode_parallel" not in self.handles:
            return {"chosen": "serial", "why": "package has no decode_parallel module"}
        if want != "auto":
            self.use_decode(want)
            return {"chosen": want, "why": "asked"}
        med = self._time_kinds(_DECODE_MODULES, "_decode_name", lambda rnd: self.decode(1, rnd))
        self._decode_name = _DECODE_MODULES[min(med, key=med.get)]
        log.debug("decode: serial %.1f ms, parallel %.1f ms per step -> %s", med["serial"], med["parallel"],
                  self.decode_kind)
        return {"chosen": self.decode_kind, "serial_ms": med["serial"], "parallel_ms": med["parallel"]}

    def _choose_batch(self) -> dict:
        """Serial or parallel batched step, as ``_choose_decode``: auto times both
        on a 4-row step at cache positions 0..3, and puts those KV bytes back
        after (the slots' caches may hold conversations by now)."""
        want = self._threads_wanted()
        if "decode_batch_parallel" not in self.handles:
            return {"chosen": "serial", "why": "package has no decode_batch_parallel module"}
        if want != "auto":
            self.use_batch(want)
            return {"chosen": want, "why": "asked"}
        n = int(self.meta.get("batch_rows", llmpack.BATCH_ROWS))
        arr = np.zeros((3, 1, n), np.int64)  # ids 0, positions 0..n-1, bases 0
        arr[1, 0] = np.arange(n)
        self._to_device_kv()
        views = [self.client.kv_view(off, self.kv_shape, self.kv_dtype) for off in self.kv_offsets]
        saved = [v.copy() for v in views]
        try:
            med = self._time_kinds(_BATCH_MODULES, "_batch_name",
                                   lambda rnd: self._infer(self._batch_name, [arr[0], arr[1], arr[2]], True))
        finally:
            for v, b in zip(views, saved):
                v[...] = b
        self._batch_name = _BATCH_MODULES[min(med, key=med.get)]
        log.debug("batched step: serial %.1f ms, parallel %.1f ms -> %s", med["serial"], med["parallel"],
                  self.batch_kind)
        return {"chosen": self.batch_kind, "serial_ms": med["serial"], "parallel_ms": med["parallel"]}

    def _module(self, modules: dict, kind: str, what: str) -> str:
        """The package's module for ``kind`` ("serial" | "parallel") of ``modules``."""
        name = modules.get(kind)
        if name is None:
            raise LLMError(f"{what} module {kind!r}: use serial or parallel")
        if name not in self.handles:
            raise LLMError(f"this package has no {name} module")
        return name

    def use_decode(self, kind: str) -> None:
        """Run the following decode steps on the "serial" or "parallel" decode
        module (what the load-time choice sets; for A/B runs and tests)."""
        self._decode_name = self._module(_DECODE_MODULES, kind, "decode")

    def use_batch(self, kind: str) -> None:
        """Run the following batched steps on the "serial" or "parallel" batch
        module (what the choice at the first ``set_slots(n > 1)`` sets)."""
        self._batch_name = self._module(_BATCH_MODULES, kind, "batch")

    @property
    def decode_kind(self) -> str:
        """The decode module the steps run on: "serial" or "parallel"."""
        return next(k for k, v in _DECODE_MODULES.items() if v == self._decode_name)

    @property
    def batch_kind(self) -> str:
        """The batch module the batched steps run on: "serial" or "parallel"."""
        return next(k for k, v in _BATCH_MODULES.items() if v == self._batch_name)

    def set_slots(self, n: int) -> int:
        """Split the KV cache into ``n`` slots of ``slot_tokens`` positions each
        (the context divided by n, down to a whole KV block): slot s holds cache
        positions s·slot_tokens onwards, and its rows attend only to those.
        Returns slot_tokens.  1 slot is the whole context (the default)."""
        if n < 1:
            raise LLMError(f"KV slots must be at least 1, got {n}")
        per = self.context // n // llmpack.KV_BLOCK * llmpack.KV_BLOCK
        if per < llmpack.KV_BLOCK:
            raise LLMError(f"{n} KV slots do not fit a {self.context}-token context: each needs at least "
                           f"{llmpack.KV_BLOCK} positions (at most {self.context // llmpack.KV_BLOCK} slots)")
        if n > 1 and "decode_batch" not in self.handles:
            raise LLMError(f"{self.dir} has no decode_batch module (compiled by an older dspx): "
                           f"compile it again for KV slots")
        if n > 1:  # the batch sums each row in the serial decode's order: a lone row must run it too
            self.use_decode("serial")
            if self.batch_choice is None:
                self.batch_choice = self._choose_batch()
        self.slots, self.slot_tokens = n, per
        return per

    def _base(self, slot: int, end: int) -> int:
        """The slot's first cache position, once positions up to ``end`` are known to fit it."""
        if not 0 <= slot < self.slots:
            raise LLMError(f"KV slot {slot} does not exist ({self.slots} slots)")
        if end > self.slot_tokens:
            raise ContextFullError(end, self.slot_tokens, slots=self.slots)
        return slot * self.slot_tokens

    # ---------------------------------------------------------------- calls
    def _infer(self, name: str, inputs: list[np.ndarray], resident: bool):
        c = self.client
        n = len(inputs) + (len(self.kv_inputs) if resident else 0)
        t = Traffic(input_bytes=sum(a.nbytes for a in inputs if c.in_input_buf(a) is None),
                    desc_bytes=80 * n if n > _max_inline() else 0)
        r = c.infer(self.handles[name], inputs, self.model_id, kv_resident=resident,
                    kv_inputs=self.kv_inputs if resident else ())
        return r, t

    def _account(self, t: Traffic) -> None:
        self.last_traffic = t
        self.traffic.add(t)

    def _to_device_kv(self) -> None:
        """Non-resident -> resident: put the host's KV back in the KV region."""
        if self.kv_on_host:
            for arr, off in zip(self.host_kv, self.kv_offsets):
                self.client.kv_view(off, self.kv_shape, self.kv_dtype)[...] = arr
            self.kv_on_host = False

    def _to_host_kv(self) -> None:
        if not self.kv_on_host:
            self.host_kv = [self.client.kv_view(off, self.kv_shape, self.kv_dtype).copy() for off in self.kv_offsets]
            self.kv_on_host = True

    def prefill(self, ids: Sequence[int], start: int = 0, slot: int = 0) -> np.ndarray:
        """Run ``ids`` at positions ``start…`` of KV ``slot``; returns the last token's logits (a copy)."""
        ids = [int(i) for i in ids]
        t0, before = (trace.clock(), self.traffic.to_json()) if trace.on else (0, None)
        try:
            if not ids:
                raise ValueError("prefill needs at least one token")
            bases = np.full((1, self.chunk), self._base(slot, start + len(ids)), np.int64)
            self._to_device_kv()
            last = None
            for s in range(0, len(ids), self.chunk):
                part = ids[s:s + self.chunk]
                idarr = np.zeros((1, self.chunk), np.int64)
                idarr[0, :len(part)] = part
                pos = np.full((1, self.chunk), -1, np.int64)  # padding rows: no KV write, ignored
                pos[0, :len(part)] = np.arange(start + s, start + s + len(part))
                r, t = self._infer("prefill", [idarr, pos, bases], True)
                logits = self.client.output_view(r.descs[0])
                last = logits[0, len(part) - 1].copy()
                t.logits_bytes = last.nbytes
                self._account(t)
            return last
        finally:
            if t0:
                self._trace_step("prefill", t0, before, tokens=len(ids), start=start)

    def decode(self, token: int, pos: int, resident: bool = True, slot: int = 0) -> np.ndarray:
        """Logits (a copy) of ``token`` at ``pos`` of KV ``slot``, attending to the slot's positions 0…pos."""
        t0, before = (trace.clock(), self.traffic.to_json()) if trace.on else (0, None)
        try:
            if pos < 0:
                raise ValueError(f"decode position must be at least 0, got {pos}")
            ids = np.array([[token]], np.int64)
            p = np.array([[pos]], np.int64)
            b = np.array([[self._base(slot, pos + 1)]], np.int64)
            if resident:
                self._to_device_kv()
                r, t = self._infer(self._decode_name, [ids, p, b], True)
            else:
                self._to_host_kv()
                r, t = self._infer(self._decode_name, [ids, p, b] + self.host_kv, False)
                for i, arr in enumerate(self.host_kv):
                    np.copyto(arr, self.client.output_view(r.descs[1 + i]))
                    t.kv_out_bytes += arr.nbytes
            out = self.client.output_view(r.descs[0])[0, 0].copy()
            t.logits_bytes = out.nbytes
            self._account(t)
            return out
        finally:
            if t0:
                self._trace_step("decode", t0, before, pos=pos, resident=resident)

    def decode_batch(self, rows: Sequence[tuple[int, int, int]]) -> np.ndarray:
        """One decode step of several slots: ``rows`` of (slot, token, pos), at
        most one per slot; returns their logits (len(rows), vocab) in that
        order.  More than one row run on the batch module, ``batch_rows`` per
        call (unused rows have position -1 and write no KV); one row as
        ``decode`` (the serial one, with slots) unless the batch module is the
        parallel one: it runs a lone row on both cores with the serial
        decode's sums, computing that row alone.  KV-resident."""
        if len(rows) == 1 and not (self.slots > 1 and self.batch_kind == "parallel"):
            slot, token, pos = rows[0]
            return self.decode(token, pos, slot=slot)[None]
        if len({r[0] for r in rows}) != len(rows):
            raise LLMError("a batched decode step takes at most one row per KV slot")
        t0, before = (trace.clock(), self.traffic.to_json()) if trace.on else (0, None)
        n = int(self.meta.get("batch_rows", llmpack.BATCH_ROWS))
        out = np.empty((len(rows), self.vocab), np.float32)
        try:
            for s in range(0, len(rows), n):
                part = rows[s:s + n]
                arr = np.zeros((3, 1, n), np.int64)  # ids, positions, bases
                arr[1] = -1
                for i, (slot, token, pos) in enumerate(part):
                    if pos < 0:
                        raise ValueError(f"decode position must be at least 0, got {pos}")
                    arr[:, 0, i] = token, pos, self._base(slot, pos + 1)
                self._to_device_kv()
                r, t = self._infer(self._batch_name, [arr[0], arr[1], arr[2]], True)
                out[s:s + len(part)] = self.client.output_view(r.descs[0])[0, :len(part)]
                t.logits_bytes = len(part) * self.vocab * 4
                self._account(t)
            return out
        finally:
            if t0:
                self._trace_step("decode_batch", t0, before, rows=len(rows))

    def _trace_step(self, what: str, t0: int, before: dict, **args) -> None:
        """A prefill or decode span with the bytes the host moved for it."""
        after = self.traffic.to_json()
        trace.complete(what, t0, "host", {**{k: after[k] - before[k] for k in after}, **args}, top=True)

    def close(self) -> None:
        c = getattr(self, "client", None)
        if c is None:
            return
        if self._own_client:
            c.close()
        else:
            try:
                if getattr(self, "model_id", None):
                    c.unload_weights(self.model_id)
                for h in self.handles.values():
                    c.unload_module(h)
            except Exception:  # noqa: BLE001 - best effort on a client we do not own
                pass
        self.client = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()



def _max_inline() -> int:
    from ...abi.protocol import MAX_INLINE_INPUTS
    return MAX_INLINE_INPUTS

