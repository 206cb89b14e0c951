"""Prompts to tokens on a DeviceLLM.

``Generator`` turns prompts into tokens (greedy or temperature / top-k / top-p
sampling with a seed), streams text, stops at ``<|im_end|>``, a stop string,
``max_tokens``, a time limit or a full context, and reports tokens/s and the
bytes the host moved (``GenerationResult``).
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable, Iterator, Sequence

import numpy as np

from ...abi import llmpack
from ...llm import LLMError
from .device import ContextFullError, DeviceLLM, Traffic
from .sampling import apply_repeat_penalty, sample

__all__ = ["GenerationResult", "Generator"]


def _find_stop(text: str, stops: Sequence[str], shown: int) -> int | None:
    """Where the earliest stop string begins in ``text`` (searching only what
    could include new text), or None."""
    best = None
    for st in stops:
        i = text.find(st, max(0, shown - len(st) + 1))
        if i >= 0 and (best is None or i < best):
            best = i
    return best


def _held_back(text: str, stops: Sequence[str]) -> int:
    """Length of the longest tail of ``text`` that begins some stop string."""
    n = 0
    for st in stops:
        for k in range(min(len(st) - 1, len(text)), n, -1):
            if st.startswith(text[-k:]):
                n = k
                break
    return n


def _snapshot(t: Traffic) -> Traffic:
    s = Traffic()
    s.add(t)
    return s


def _diff(a: Traffic, b: Traffic) -> Traffic:
    return Traffic(*(getattr(a, k) - getattr(b, k) for k in ("input_bytes", "desc_bytes", "kv_out_bytes",
                                                               "logits_bytes")))



@dataclass
class GenerationResult:
    prompt_tokens: int
    ids: list[int] = field(default_factory=list)
    prefilled: int = 0        # prompt tokens actually run (chat reuses the cached prefix)
    text: str = ""
    finish_reason: str = ""   # "eos" | "stop" (a stop string) | "max_tokens" | "context" | "time" | "interrupted"
    prefill_s: float = 0.0
    decode_s: float = 0.0
    decode_tokens: int = 0
    traffic: Traffic = field(default_factory=Traffic)          # decode calls only
    prefill_traffic: Traffic = field(default_factory=Traffic)

    @property
    def bytes_per_token(self) -> float:
        """Bytes moved per decode call (see Traffic)."""
        return self.traffic.moved / self.decode_tokens if self.decode_tokens else 0.0

    @property
    def decode_tok_s(self) -> float:
        return self.decode_tokens / self.decode_s if self.decode_s > 0 else 0.0

    @property
    def prefill_tok_s(self) -> float:
        return self.prefilled / self.prefill_s if self.prefill_s > 0 else 0.0

    def to_json(self) -> dict:
        return {"text": self.text, "ids": self.ids, "prompt_tokens": self.prompt_tokens, "prefilled_tokens": self.prefilled,
                "new_tokens": len(self.ids), "finish_reason": self.finish_reason,
                "prefill_s": round(self.prefill_s, 4), "decode_s": round(self.decode_s, 4),
                "prefill_tok_s": round(self.prefill_tok_s, 1), "decode_tok_s": round(self.decode_tok_s, 1),
                "decode_traffic": self.traffic.to_json(), "prefill_traffic": self.prefill_traffic.to_json(),
                "bytes_moved_per_token": round(self.bytes_per_token, 1)}


class Generator:
    """Prompt -> tokens on the device."""

    def __init__(self, llm: DeviceLLM | None = None, tokenizer=None, *, model_dir=None, gguf=None,
                 socket: str | None = None, progress: bool = True, context: int = llmpack.CONTEXT,
                 kv_dtype: str = "float32", decode_activations: str = "int8"):
        from ...llm import Tokenizer

        self._llm = llm
        self._llm_args = dict(model_dir=model_dir, gguf=gguf, socket=socket, progress=progress, context=context,
                              kv_dtype=kv_dtype, decode_activations=decode_activations)
        self._context = context
        pkg = None
        if model_dir is not None and llm is None:
            try:
                pkg = llmpack.read(model_dir)
            except llmpack.PackageError as e:
                raise LLMError(str(e)) from None
            self._context = pkg.context
        if tokenizer is None:
            src = gguf
            if src is None and pkg is not None:
                try:
                    src = pkg.meta["tokenizer"]["gguf"]
                except (KeyError, TypeError) as e:
                    raise LLMError(f"{model_dir}: {e}") from None
            if src is None and llm is not None:
                src = llm.meta["tokenizer"]["gguf"]
            tokenizer = Tokenizer.from_gguf(src)
        self.tok = tokenizer
        self.eos_id = tokenizer.eos_id
        self.cached: list[int] = []  # ids whose KV is in the cache, in order

    @property
    def llm(self) -> DeviceLLM:
        """Loaded on first use, so bad input is refused before anything is staged."""
        if self._llm is None:
            self._llm = DeviceLLM(**self._llm_args)
        return self._llm

    @property
    def context(self) -> int:
        if self._llm is not None:
            return self._llm.context
        return self._context

    def encode(self, prompt, chat: bool = True) -> list[int]:
        if isinstance(prompt, str):
            return self.tok.encode_chat([{"role": "user", "content": prompt}]) if chat else self.tok.encode(prompt)
        if prompt and isinstance(prompt[0], dict):
            return self.tok.encode_chat(list(prompt))
        return [int(i) for i in prompt]

    def stream(self, prompt, max_tokens: int = 128, *, temperature: float = 0.0, top_k: int = 0,
               top_p: float = 1.0, seed: int | None = None, resident: bool = True, chat: bool = True,
               result: GenerationResult | None = None, reuse_cache: bool = False,
               stop: str | Sequence[str] = (), repeat_penalty: float = 1.0, repeat_last_n: int = 64,
               max_time: float | None = None,
               should_stop: Callable[[], bool] | None = None,
               on_logits: Callable[[np.ndarray, int], None] | None = None) -> Iterator[tuple[int, str]]:
        """Yield ``(token_id, text_piece)`` as tokens are produced; fills ``result``.

        ``stop``: a string, or strings, that end the answer (not included in
        it; text that could begin one is held back until it cannot).  ``repeat_penalty``
        over the last ``repeat_last_n`` ids (prompt included), as llama.cpp.
        ``max_time``: seconds for prefill + decode.  ``should_stop()`` is
        polled between tokens (chat's Ctrl-C): the answer ends "interrupted"
        with the KV cache consistent.  ``on_logits(logits, token)`` sees each step's
        logits as the model gave them (before the repeat penalty) and the token drawn
        (serve-llm's logprobs)."""
        if max_tokens < 1:
            raise ValueError(f"max_tokens must be at least 1, got {max_tokens}")
        if repeat_penalty <= 0:
            raise ValueError(f"repeat_penalty must be positive, got {repeat_penalty}")
        stops = [x for x in ([stop] if isinstance(stop, str) else stop) if x]  # a string is one stop
        ids = self.encode(prompt, chat)
        ctx = self.context
        if len(ids) > ctx:
            raise ContextFullError(len(ids), ctx)
        res = result if result is not None else GenerationResult(len(ids))
        res.prompt_tokens = len(ids)
        llm = self.llm
        rng = np.random.default_rng(seed)
        deadline = None if max_time is None else time.perf_counter() + max_time
        # Reuse the cached prefix (chat: the history is rendered identically each turn).
        keep = 0
        if reuse_cache:
            while keep < min(len(self.cached), len(ids) - 1) and self.cached[keep] == ids[keep]:
                keep += 1
        traffic0 = _snapshot(llm.traffic)
        t0 = time.perf_counter()
        self.cached = self.cached[:keep]
        logits = llm.prefill(ids[keep:], keep)
        res.prefill_s = time.perf_counter() - t0
        res.prefill_traffic = _diff(llm.traffic, traffic0)
        res.prefilled = len(ids) - keep
        traffic0 = _snapshot(llm.traffic)
        self.cached = list(ids)
        sd = self.tok.stream(skip_special_tokens=True)
        pos = len(ids)
        t_dec = 0.0
        full, shown = "", 0  # all decoded text; how much of it was yielded
        try:
            while True:
                model_logits = logits
                if repeat_penalty != 1.0:
                    logits = apply_repeat_penalty(logits, self.cached[-repeat_last_n:] if repeat_last_n else [],
                                                  repeat_penalty)
                nxt = sample(logits, temperature, top_k, top_p, rng)
                if on_logits is not None:
                    on_logits(model_logits, nxt)
                res.ids.append(nxt)
                if nxt == self.eos_id:
                    res.finish_reason = "eos"
                    break
                full += sd.push(nxt)
                cut = _find_stop(full, stops, shown)
                if cut is not None:
                    full = full[:cut]
                    yield nxt, full[shown:]
                    shown = len(full)
                    res.finish_reason = "stop"
                    break
                safe = len(full) - _held_back(full, stops)
                yield nxt, full[shown:safe]
                shown = max(shown, safe)
                if len(res.ids) >= max_tokens:
                    res.finish_reason = "max_tokens"
                    break
                if pos >= ctx:
                    res.finish_reason = "context"
                    break
                if deadline is not None and time.perf_counter() >= deadline:
                    res.finish_reason = "time"
                    break
                if should_stop is not None and should_stop():
                    res.finish_reason = "interrupted"
                    break
                t1 = time.perf_counter()
                logits = llm.decode(nxt, pos, resident=resident)
                t_dec += time.perf_counter() - t1
                res.decode_tokens += 1
                self.cached.append(nxt)
                pos += 1
        finally:
            if res.finish_reason != "stop":
                full += sd.flush()
            res.text = full
            res.decode_s = t_dec
            res.traffic = _diff(llm.traffic, traffic0)
        if len(full) > shown:
            yield -1, full[shown:]

    def generate(self, prompt, max_tokens: int = 128, *, on_text: Callable[[str], None] | None = None,
                 **kw) -> GenerationResult:
        res = GenerationResult(0)
        for _, piece in self.stream(prompt, max_tokens, result=res, **kw):
            if on_text is not None and piece:
                on_text(piece)
        return res

    def close(self) -> None:
        if self._llm is not None:
            self._llm.close()
            self._llm = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

