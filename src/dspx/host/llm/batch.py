"""Parallel KV slots with continuous batching (``dspx serve-llm --parallel N``).

``SlotBatcher`` splits a DeviceLLM's KV cache into N slots
(``DeviceLLM.set_slots``) and owns the device: one thread runs every device
call.  Each request runs its own ``Generator`` on a ``SlotLLM``, a stand-in
for the DeviceLLM whose ``prefill``/``decode`` hand the call to that thread
and wait for its answer, so sampling, stop strings, streaming and limits are
the Generator's own, per slot.  The device thread runs a waiting prefill
first (a new request joins at the next decode step after it), else one
decode step for every slot that is decoding — once each of them has handed
in its next token — as one batched device call (``DeviceLLM.decode_batch``).
A request that ends leaves the batch (``SlotBatcher.leave``).

``SlotPool`` hands requests a free slot (the one whose cached tokens share
the longest prefix with the prompt, so a resent conversation prefills only
its new turn) and gives it back when the answer ends.
"""
from __future__ import annotations

import concurrent.futures
import threading
from collections import deque
from contextlib import contextmanager
from typing import Iterator, Sequence

import numpy as np

from ...llm import LLMError
from .device import DeviceLLM, Traffic
from .generator import Generator

__all__ = ["SlotBatcher", "SlotLLM", "SlotPool"]

CALL_TIMEOUT = 600.0  # seconds a slot waits for its device call (a batched step or a prefill)


class SlotLLM:
    """What a Generator uses of a DeviceLLM, for one KV slot: its device calls
    go through the batcher's thread."""

    def __init__(self, batcher: "SlotBatcher", slot: int):
        self.batcher, self.slot = batcher, slot
        self.meta = batcher.llm.meta
        self.context, self.vocab = batcher.llm.slot_tokens, batcher.llm.vocab
        self.traffic = Traffic()  # this slot's share of the bytes moved

    def prefill(self, ids: Sequence[int], start: int = 0) -> np.ndarray:
        return self.batcher.call("prefill", self.slot, (list(ids), start))

    def decode(self, token: int, pos: int, resident: bool = True) -> np.ndarray:
        if not resident:
            raise LLMError("KV slots decode KV-resident only")
        return self.batcher.call("decode", self.slot, (token, pos))

    def close(self) -> None:  # the batcher owns the device
        pass


def _share(t: Traffic, n: int) -> Traffic:
    """One row's share of a call's bytes (the call moved them for n rows)."""
    return Traffic(t.input_bytes // n, t.desc_bytes // n, t.kv_out_bytes // n, t.logits_bytes // n)


def _minus(a: Traffic, b: Traffic) -> Traffic:
    return Traffic(a.input_bytes - b.input_bytes, a.desc_bytes - b.desc_bytes, a.kv_out_bytes - b.kv_out_bytes,
                   a.logits_bytes - b.logits_bytes)


class SlotBatcher:
    """N KV slots of one DeviceLLM, every device call on one thread (see the module docstring)."""

    def __init__(self, llm: DeviceLLM, slots: int):
        self.llm = llm
        self.slot_tokens = llm.set_slots(slots)
        self.views = [SlotLLM(self, s) for s in range(slots)]
        self._cond = threading.Condition()
        self._prefills: deque = deque()  # (slot, (ids, start), future)
        self._decodes: dict = {}         # slot -> ((token, pos), future)
        self._decoding: set = set()      # slots between prefill and leave: each step waits for their token
        self._closed = False
        self.steps = 0          # batched decode steps run
        self.step_rows = 0      # rows they decoded (step_rows / steps = the mean batch)
        self._thread = threading.Thread(target=self._loop, name="dspx-llm-slots", daemon=True)
        self._thread.start()

    @property
    def slots(self) -> int:
        return len(self.views)

    def call(self, kind: str, slot: int, args: tuple):
        """Run a prefill or a decode of ``slot`` on the device thread; returns its logits."""
        fut: concurrent.futures.Future = concurrent.futures.Future()
        with self._cond:
            if self._closed:
                raise LLMError("the KV slots are closed")
            if kind == "prefill":
                self._decoding.discard(slot)  # a new answer: the steps do not wait for it until prefilled
                self._prefills.append((slot, args, fut))
            else:
                self._decodes[slot] = (args, fut)
            self._cond.notify_all()
        try:
            return fut.result(CALL_TIMEOUT)
        except concurrent.futures.TimeoutError:
            raise LLMError(f"KV slot {slot}: no answer from the device thread in {CALL_TIMEOUT:.0f} s") from None

    def leave(self, slot: int) -> None:
        """The slot's answer ended: the next steps do not wait for it."""
        with self._cond:
            self._decoding.discard(slot)
            self._cond.notify_all()

    def _ready(self) -> bool:
        return bool(self._prefills) or (bool(self._decodes) and self._decoding <= self._decodes.keys())

    def _loop(self) -> None:
        while True:
            with self._cond:
                while not self._closed and not self._ready():
                    self._cond.wait(1.0)
                if self._closed:
                    self._fail_pending()
                    return
                prefill = self._prefills.popleft() if self._prefills else None
                if prefill is None:
                    step = sorted((slot, args, fut) for slot, (args, fut) in self._decodes.items())
                    self._decodes = {}
            if prefill is not None:
                self._prefill(*prefill)
            else:
                self._step(step)

    def _prefill(self, slot: int, args: tuple, fut) -> None:
        before = self._snapshot()
        try:
            logits = self.llm.prefill(args[0], args[1], slot=slot)
        except BaseException as e:  # noqa: BLE001 - handed to the waiting slot
            fut.set_exception(e)
            return
        self.views[slot].traffic.add(_minus(self.llm.traffic, before))
        with self._cond:  # decoding before the slot sees its logits: its first decode joins the next step
            self._decoding.add(slot)
        fut.set_result(logits)

    def _step(self, job: list) -> None:
        before = self._snapshot()
        try:
            logits = self.llm.decode_batch([(slot, token, pos) for slot, (token, pos), _ in job])
        except BaseException as e:  # noqa: BLE001 - handed to every waiting slot
            for *_, fut in job:
                fut.set_exception(e)
            return
        share = _share(_minus(self.llm.traffic, before), len(job))
        self.steps += 1
        self.step_rows += len(job)
        for i, (slot, _, fut) in enumerate(job):
            self.views[slot].traffic.add(share)
            fut.set_result(logits[i].copy())

    def _snapshot(self) -> Traffic:
        return _minus(self.llm.traffic, Traffic())

    def _fail_pending(self) -> None:
        err = LLMError("the KV slots were closed")
        for *_, fut in self._prefills:
            fut.set_exception(err)
        for _, fut in self._decodes.values():
            fut.set_exception(err)
        self._prefills.clear()
        self._decodes = {}

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        self._thread.join(CALL_TIMEOUT)


class SlotPool:
    """Generators on the slots of a SlotBatcher, handed out one request at a time."""

    def __init__(self, llm: DeviceLLM, tokenizer, slots: int):
        self.batcher = SlotBatcher(llm, slots)
        self.generators = [Generator(view, tokenizer) for view in self.batcher.views]
        self._free = set(range(slots))
        self._cond = threading.Condition()

    @property
    def slot_tokens(self) -> int:
        return self.batcher.slot_tokens

    @contextmanager
    def acquire(self, ids: Sequence[int], timeout: float = CALL_TIMEOUT) -> Iterator[Generator]:
        """A free slot's Generator (the one whose cache shares the longest
        prefix with ``ids``) for one answer; it leaves the batch after."""
        with self._cond:
            if not self._cond.wait_for(lambda: self._free, timeout):
                raise LLMError(f"no KV slot came free in {timeout:.0f} s")
            slot = max(sorted(self._free), key=lambda s: _common_prefix(self.generators[s].cached, ids))
            self._free.discard(slot)
        try:
            yield self.generators[slot]
        finally:
            self.batcher.leave(slot)
            with self._cond:
                self._free.add(slot)
                self._cond.notify()

    def info(self) -> list[dict]:
        """Per slot: id, tokens it holds, whether it is answering, tokens cached."""
        with self._cond:
            free = set(self._free)
        return [{"id": s, "n_ctx": self.slot_tokens, "is_processing": s not in free,
                 "cached_tokens": len(g.cached)} for s, g in enumerate(self.generators)]

    def close(self) -> None:
        self.batcher.close()


def _common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n
