"""Language-model generation on the device: prefill + KV-resident decode.

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

``Generator`` turns prompts into tokens (greedy or temperature / top-k / top-p
sampling with a seed), streams text, stops at ``<|im_end|>``, ``max_tokens``
or a full context, and reports tokens/s.  ``demo_generate`` is the one call
``make demo`` needs.

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
import sys
import time
import warnings
from dataclasses import dataclass, field
from typing import Callable, Iterator, Sequence

import numpy as np

from ..abi import llmpack
from ..errors import CapacityWarning
from ..llm import LLMError

__all__ = ["Chat", "ContextFullError", "DeviceLLM", "GenerationResult", "Generator", "demo_generate", "Traffic"]

log = logging.getLogger(__name__)


class ContextFullError(LLMError):
    """The prompt (or the conversation) does not fit the model's context."""

    def __init__(self, needed: int, context: int, what: str = "prompt"):
        self.needed = needed
        self.context = context
        super().__init__(f"{what} is {needed} tokens; the device model's context holds {context} "
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


class DeviceLLM:
    """A compiled LLM loaded on a device (see the module docstring)."""

    def __init__(self, model_dir=None, *, client=None, gguf=None, socket: str | None = None,
                 progress: bool = True, context: int = llmpack.CONTEXT, kv_dtype: str = "float32",
                 decode_threads: str | None = None):
        from .client import Client

        t0 = time.perf_counter()
        if model_dir is None:  # compile the GGUF on first use (cached)
            from ..compiler.llm import compiled_dir
            model_dir = compiled_dir(gguf, progress=progress, context=context, kv_dtype=kv_dtype)
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
        self.kv_inputs = [(2 + i, off, self.kv_shape, self.kv_dtype) for i, off in enumerate(self.kv_offsets)]
        self.load_warnings: list[str] = []
        self.handles: dict[str, int] = {}
        self._decode_name = "decode"
        try:
            self._load(progress)
        except BaseException:
            self.close()
            raise
        self.host_kv: list[np.ndarray] | None = None  # KV kept by the host (non-resident decode)
        self.kv_on_host = False
        self.traffic = Traffic()
        self.last_traffic = Traffic()
        self.decode_choice = self._choose_decode(decode_threads)
        self.timings = {"load": time.perf_counter() - t0}

    def _load(self, progress: bool) -> None:
        c = self.client
        mods = self.meta["modules"]
        # Prefill first: its declaration (input 11.8 MB + output 24.4 MB) does
        # not fit beside the 480 MiB staging + KV with the default carveout; the
        # load warns (declared vs allocated) and we declare the real figure
        # (KV-resident: only the logits reach output_buf) before any inference.
        for name in [m for m in ("prefill", "decode", "decode_parallel") if m in mods]:
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

    def _choose_decode(self, want: str | None) -> dict:
        """Serial or parallel decode GEMVs: ``want`` ("serial" | "parallel" |
        "auto", default ``$DSPX_LLM_DECODE`` else auto).  Auto times both
        modules on a few KV-resident steps here (the machine as it is now: both
        cores free, or one busy) and keeps the faster; positions 0..7 of the
        KV are scratch (every prefill rewrites them)."""
        import os

        want = want or os.environ.get("DSPX_LLM_DECODE", "auto")
        if want not in ("auto", "serial", "parallel"):
            raise LLMError(f"decode threads {want!r}: use auto, serial or parallel")
        if "decode_parallel" not in self.handles:
            return {"chosen": "serial", "why": "package has no decode_parallel module"}
        if want != "auto":
            self.use_decode(want)
            return {"chosen": want, "why": "asked"}
        ms = {"decode": [], "decode_parallel": []}
        for rnd in range(4):  # alternate, first round is warm-up
            for name in ms:
                self._decode_name = name
                t = time.perf_counter()
                self.decode(1, rnd)
                if rnd:
                    ms[name].append((time.perf_counter() - t) * 1e3)
        med = {k: float(np.median(v)) for k, v in ms.items()}
        self._decode_name = min(med, key=med.get)
        self.traffic, self.last_traffic = Traffic(), Traffic()
        chosen = self.decode_kind
        log.debug("decode: serial %.1f ms, parallel %.1f ms per step -> %s", med["decode"], med["decode_parallel"],
                  chosen)
        return {"chosen": chosen, "serial_ms": round(med["decode"], 2), "parallel_ms": round(med["decode_parallel"], 2)}

    def use_decode(self, kind: str) -> None:
        """Run the following decode steps on the "serial" or "parallel" decode
        module (what the load-time choice sets; for A/B runs and tests)."""
        name = _DECODE_MODULES.get(kind)
        if name is None:
            raise LLMError(f"decode module {kind!r}: use serial or parallel")
        if name not in self.handles:
            raise LLMError(f"this package has no {name} module")
        self._decode_name = name

    @property
    def decode_kind(self) -> str:
        """The decode module the steps run on: "serial" or "parallel"."""
        return next(k for k, v in _DECODE_MODULES.items() if v == self._decode_name)

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

    def prefill(self, ids: Sequence[int], start: int = 0) -> np.ndarray:
        """Run ``ids`` at positions ``start…``; returns the last token's logits (a copy)."""
        ids = [int(i) for i in ids]
        if not ids:
            raise ValueError("prefill needs at least one token")
        if start + len(ids) > self.context:
            raise ContextFullError(start + len(ids), self.context)
        self._to_device_kv()
        last = None
        for s in range(0, len(ids), self.chunk):
            part = ids[s:s + self.chunk]
            idarr = np.zeros((1, self.chunk), np.int64)
            idarr[0, :len(part)] = part
            pos = np.full((1, self.chunk), -1, np.int64)  # padding rows: no KV write, ignored
            pos[0, :len(part)] = np.arange(start + s, start + s + len(part))
            r, t = self._infer("prefill", [idarr, pos], True)
            logits = self.client.output_view(r.descs[0])
            last = logits[0, len(part) - 1].copy()
            t.logits_bytes = last.nbytes
            self._account(t)
        return last

    def decode(self, token: int, pos: int, resident: bool = True) -> np.ndarray:
        """Logits (a copy) of ``token`` at ``pos`` attending to the cache 0…pos."""
        if not 0 <= pos < self.context:
            raise ContextFullError(pos + 1, self.context)
        ids = np.array([[token]], np.int64)
        p = np.array([[pos]], np.int64)
        if resident:
            self._to_device_kv()
            r, t = self._infer(self._decode_name, [ids, p], True)
        else:
            self._to_host_kv()
            r, t = self._infer(self._decode_name, [ids, p] + self.host_kv, False)
            for i, arr in enumerate(self.host_kv):
                np.copyto(arr, self.client.output_view(r.descs[1 + i]))
                t.kv_out_bytes += arr.nbytes
        out = self.client.output_view(r.descs[0])[0, 0].copy()
        t.logits_bytes = out.nbytes
        self._account(t)
        return out

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


def _max_inline() -> int:
    from ..abi.protocol import MAX_INLINE_INPUTS
    return MAX_INLINE_INPUTS


# ---------------------------------------------------------------- sampling

def apply_repeat_penalty(logits: np.ndarray, recent: Sequence[int], penalty: float) -> np.ndarray:
    """llama.cpp's repeat penalty: each distinct token among ``recent`` has its
    logit divided by ``penalty`` when positive, multiplied when negative."""
    if penalty == 1.0 or not len(recent):
        return logits
    out = logits.copy()
    idx = np.unique(np.asarray(recent, np.int64))
    v = out[idx]
    out[idx] = np.where(v > 0, v / np.float32(penalty), v * np.float32(penalty))
    return out


def sample(logits: np.ndarray, temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0,
           rng: np.random.Generator | None = None) -> int:
    """Greedy when temperature <= 0; else softmax(logits / T) over the top-k / top-p set."""
    if temperature <= 0:
        return int(np.argmax(logits))
    z = logits.astype(np.float64) / temperature
    idx = np.argsort(-z)
    if top_k and top_k > 0:
        idx = idx[:top_k]
    p = np.exp(z[idx] - z[idx[0]])
    p /= p.sum()
    if top_p < 1.0:
        keep = int(np.searchsorted(np.cumsum(p), top_p) + 1)
        idx, p = idx[:keep], p[:keep] / p[:keep].sum()
    rng = rng if rng is not None else np.random.default_rng()
    return int(idx[rng.choice(len(idx), p=p)])


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
                 kv_dtype: str = "float32"):
        from ..llm import Tokenizer

        self._llm = llm
        self._llm_args = dict(model_dir=model_dir, gguf=gguf, socket=socket, progress=progress, context=context,
                              kv_dtype=kv_dtype)
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
               should_stop: Callable[[], bool] | None = None) -> Iterator[tuple[int, str]]:
        """Yield ``(token_id, text_piece)`` as tokens are produced; fills ``result``.

        ``stop``: a string, or strings, that end the answer (not included in
        it; text that could begin one is held back until it cannot).  ``repeat_penalty``
        over the last ``repeat_last_n`` ids (prompt included), as llama.cpp.
        ``max_time``: seconds for prefill + decode.  ``should_stop()`` is
        polled between tokens (chat's Ctrl-C): the answer ends "interrupted"
        with the KV cache consistent."""
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
                if repeat_penalty != 1.0:
                    logits = apply_repeat_penalty(logits, self.cached[-repeat_last_n:] if repeat_last_n else [],
                                                  repeat_penalty)
                nxt = sample(logits, temperature, top_k, top_p, rng)
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


@dataclass
class Turn:
    user: str
    assistant: str


class Chat:
    """A conversation on one Generator with llama.cpp-style context shift.

    Before each answer the history is rendered with the chat template; while
    the prompt plus ``answer_room`` tokens do not fit the context, the oldest
    turn (user + assistant) is dropped and recorded in ``dropped``.  The
    system prompt (the given one, or the template's default) is always kept.
    The cache is kept right by **recomputation**: the shifted conversation
    shares only the system prompt's tokens with what is cached, so the
    Generator's prefix reuse keeps those and re-prefills the kept turns at
    their new positions (no re-rotation of cached keys).
    """

    def __init__(self, gen: Generator, system: str | None = None, answer_room: int | None = None):
        self.gen = gen
        self.system = system
        self.turns: list[Turn] = []
        self.dropped: list[Turn] = []
        self.answer_room = answer_room

    def messages(self, user: str | None = None, turns: list[Turn] | None = None) -> list[dict]:
        msgs = [{"role": "system", "content": self.system}] if self.system else []
        for t in (self.turns if turns is None else turns):
            msgs += [{"role": "user", "content": t.user}, {"role": "assistant", "content": t.assistant}]
        if user is not None:
            msgs.append({"role": "user", "content": user})
        return msgs

    def reset(self) -> None:
        self.turns, self.dropped = [], []

    def ask(self, text: str, max_tokens: int = 256, *, on_text: Callable[[str], None] | None = None,
            **kw) -> GenerationResult:
        """Answer ``text`` in the conversation; shifts the context when needed."""
        ctx = self.gen.context
        room = min(max_tokens, self.answer_room if self.answer_room is not None else ctx // 4)
        while True:
            ids = self.gen.encode(self.messages(text))
            if len(ids) + room <= ctx or not self.turns:
                break
            self.dropped.append(self.turns.pop(0))
        if len(ids) > ctx:  # the question alone (with the system prompt) is too long
            raise ContextFullError(len(ids), ctx, "the question")
        res = self.gen.generate(ids, max_tokens, on_text=on_text, reuse_cache=True, **kw)
        self.turns.append(Turn(text, res.text))
        return res


def demo_generate(question: str = "What is the capital of France?", max_tokens: int = 64,
                  stream=None) -> GenerationResult:
    """For ``make demo``: compile SmolLM2 once (cached under .cache/dspx/llm),
    load it on a private simulated device and stream a greedy answer."""
    out = stream or sys.stdout
    with Generator(progress=True) as g:
        g.llm  # compile (first time) and load before printing the question
        out.write(f"Q: {question}\nA: ")
        out.flush()

        def show(piece: str) -> None:
            out.write(piece)
            out.flush()

        res = g.generate(question, max_tokens, on_text=show)
        out.write("\n")
        out.write(f"[{res.prompt_tokens} prompt tokens: prefill {res.prefill_tok_s:.0f} tok/s; "
                  f"{len(res.ids)} new tokens: decode {res.decode_tok_s:.1f} tok/s, KV-resident, "
                  f"{res.bytes_per_token:,.0f} bytes moved per decoded token]\n")
        out.flush()
        return res
