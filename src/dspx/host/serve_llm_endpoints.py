"""llama-server's surface on ``dspx serve-llm``, beside the OpenAI endpoints of
``serve_llm``: ``/tokenize``, ``/detokenize``, ``/v1/embeddings``, ``/props``,
``/slots``, ``/metrics`` (Prometheus text, llama-server's metric names), the
503 "Loading model" answer while the model loads, a log line per request,
``logprobs``, and a 400 naming any request field serve-llm does not implement.
"""
# (no `from __future__ import annotations`: FastAPI resolves the handlers' Request annotation)
import base64
import logging
import threading
import time
from dataclasses import dataclass, field

import numpy as np

from .serve_llm import APIError, parse_json

__all__ = ["LoadingGate", "Logprobs", "RequestLog", "Stats", "add_routes", "check_fields", "logprob_request"]

request_log = logging.getLogger("dspx.serve_llm.requests")

# Fields each endpoint implements (every spelling that works today) ...
_COMMON = {"model", "stream", "stream_options", "temperature", "top_p", "top_k", "max_tokens",
           "max_completion_tokens", "stop", "seed", "n", "repeat_penalty", "logprobs",
           "user"}  # user: an end-user id for the provider's abuse monitoring; it changes no answer
ACCEPTED = {True: _COMMON | {"messages", "top_logprobs"}, False: _COMMON | {"prompt"}}
# ... and values of the others that ask for nothing (what some clients send by default).
_NEUTRAL = {"frequency_penalty": 0, "presence_penalty": 0, "logit_bias": {}, "tools": [], "tool_choice": "none",
            "response_format": {"type": "text"}, "echo": False, "best_of": 1, "store": False}
MAX_TOP_LOGPROBS = {True: 20, False: 5}  # OpenAI's bounds: chat top_logprobs, completions logprobs
MAX_EMBEDDING_INPUTS = 256


def check_fields(body: dict, chat: bool) -> None:
    """400 naming every field this server would otherwise ignore (null means "not given", as in OpenAI's API)."""
    bad = [k for k, v in body.items()
           if k not in ACCEPTED[chat] and v is not None and not (k in _NEUTRAL and v == _NEUTRAL[k])]
    if bad:
        names = ", ".join(f"'{k}'" for k in bad)
        raise APIError(400, f"unsupported field{'s' if len(bad) > 1 else ''} {names}: dspx serve-llm does not "
                            f"implement {'them' if len(bad) > 1 else 'it'} (docs/serve-llm.md lists the fields "
                            f"it takes)", param=bad[0], code="unsupported_parameter")


def logprob_request(body: dict, chat: bool) -> int | None:
    """How many alternatives per token to report, or None when logprobs are not asked for."""
    if chat:
        want, top = body.get("logprobs"), body.get("top_logprobs")
        if want is not None and not isinstance(want, bool):
            raise APIError(400, f"'logprobs' must be true or false, got {want!r}", param="logprobs")
        if top is not None and not want:
            raise APIError(400, "'top_logprobs' needs 'logprobs': true", param="top_logprobs")
        name, n = "top_logprobs", (top if top is not None else 0) if want else None
    else:
        name, n = "logprobs", body.get("logprobs")
    if n is None:
        return None
    if isinstance(n, bool) or not isinstance(n, int) or not 0 <= n <= MAX_TOP_LOGPROBS[chat]:
        raise APIError(400, f"'{name}' must be an integer between 0 and {MAX_TOP_LOGPROBS[chat]}, got {n!r}",
                       param=name)
    return n


def log_softmax(logits: np.ndarray) -> np.ndarray:
    z = logits.astype(np.float64)
    z -= z.max()
    return z - np.log(np.exp(z).sum())


class Logprobs:
    """Collects each answer token's log-probability (and the top alternatives) from the
    model's logits, on the generating thread; ``take()`` hands over the new ones."""

    def __init__(self, tokenizer, top: int, eos_id: int):
        self.tok, self.top, self.eos_id = tokenizer, top, eos_id
        self.entries: list[tuple[int, float, list[tuple[int, float]]]] = []
        self._taken = 0
        self._offset = 0  # characters of answer text before the next entry (completions' text_offset)

    def __call__(self, logits: np.ndarray, token: int) -> None:
        if token == self.eos_id:  # the end-of-turn token is not part of the answer
            return
        lp = log_softmax(logits)
        best = np.argsort(-lp, kind="stable")[:self.top] if self.top else []
        self.entries.append((int(token), float(lp[token]), [(int(i), float(lp[i])) for i in best]))

    def take(self) -> list:
        new = self.entries[self._taken:]
        self._taken = len(self.entries)
        return new

    def _text(self, token: int) -> tuple[str, bytes]:
        raw = self.tok.token_bytes(token)
        return raw.decode("utf-8", errors="replace"), raw

    def chat(self, entries) -> dict:
        """OpenAI's chat shape: {"content": [{"token", "logprob", "bytes", "top_logprobs"}], "refusal"}."""
        def one(t, lp):
            s, raw = self._text(t)
            return {"token": s, "logprob": lp, "bytes": list(raw)}
        return {"content": [{**one(t, lp), "top_logprobs": [one(i, v) for i, v in top]} for t, lp, top in entries],
                "refusal": None}

    def completion(self, entries) -> dict:
        """OpenAI's completions shape: tokens, token_logprobs, top_logprobs, text_offset."""
        out = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        for t, lp, top in entries:
            s = self._text(t)[0]
            out["tokens"].append(s)
            out["token_logprobs"].append(lp)
            out["top_logprobs"].append({self._text(i)[0]: v for i, v in top})
            out["text_offset"].append(self._offset)
            self._offset += len(s)
        return out

    def shape(self, chat: bool, entries) -> dict:
        return self.chat(entries) if chat else self.completion(entries)


@dataclass
class Stats:
    """What /metrics reports: llama-server's counters, summed over finished requests."""

    prompt_tokens: int = 0        # prompt tokens run through the model (a reused KV prefix is not)
    prompt_seconds: float = 0.0
    tokens_predicted: int = 0
    predicted_seconds: float = 0.0
    n_decode: int = 0             # device forward calls (prefill chunks + decode steps)
    requests: int = 0
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def record(self, res, chunk: int) -> None:
        with self._lock:
            self.prompt_tokens += res.prefilled
            self.prompt_seconds += res.prefill_s
            self.tokens_predicted += len(res.ids)
            self.predicted_seconds += res.decode_s
            self.n_decode += -(-res.prefilled // chunk) + res.decode_tokens
            self.requests += 1


def finished(service, request, res, completion_tokens: int) -> None:
    """Counts a finished generation in /metrics and in the request's log line."""
    service.stats.record(res, service.gen.llm.chunk)
    request.state.tokens = (res.prompt_tokens, completion_tokens)


def _processing(service) -> int:
    return min(service.waiting, service.parallel)


def _slot_rows(service) -> list[dict]:
    """Per KV slot: id, tokens it holds, whether it answers, tokens cached (one row without --parallel)."""
    if service.slots is not None:
        return service.slots.info()
    return [{"id": 0, "n_ctx": service.gen.context, "is_processing": service.waiting > 0,
             "cached_tokens": len(service.gen.cached)}]


def _collector(service):
    from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

    class Collector:
        def collect(self):
            s = service.stats
            with s._lock:
                counters = [("prompt_tokens", "Number of prompt tokens processed.", s.prompt_tokens),
                            ("prompt_seconds", "Prompt process time", s.prompt_seconds),
                            ("tokens_predicted", "Number of generation tokens processed.", s.tokens_predicted),
                            ("tokens_predicted_seconds", "Predict process time", s.predicted_seconds),
                            ("n_decode", "Total number of device forward calls (prefill chunks and decode steps).",
                             s.n_decode)]
                rates = (s.prompt_tokens / s.prompt_seconds if s.prompt_seconds else 0.0,
                         s.tokens_predicted / s.predicted_seconds if s.predicted_seconds else 0.0)
            for name, doc, value in counters:
                yield CounterMetricFamily(f"llamacpp:{name}", doc, value=value)
            rows = _slot_rows(service)
            cached = sum(r["cached_tokens"] for r in rows)
            gauges = [("prompt_tokens_seconds", "Average prompt throughput in tokens/s.", rates[0]),
                      ("predicted_tokens_seconds", "Average generation throughput in tokens/s.", rates[1]),
                      ("kv_cache_usage_ratio", "KV-cache usage. 1 means 100 percent usage.", cached / sum(r["n_ctx"] for r in rows)),
                      ("kv_cache_tokens", "KV-cache tokens.", cached),
                      ("requests_processing", "Number of requests processing.", _processing(service)),
                      ("requests_deferred", "Number of requests deferred.", service.waiting - _processing(service))]
            for name, doc, value in gauges:
                yield GaugeMetricFamily(f"llamacpp:{name}", doc, value=value)

    return Collector()


class LoadingGate:
    """ASGI: until ``ready`` is set, every path but /health gets llama-server's 503 "Loading model"."""

    def __init__(self, app, ready: threading.Event):
        self.app, self.ready = app, ready

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and not self.ready.is_set() and scope["path"] != "/health":
            from fastapi.responses import JSONResponse

            e = APIError(503, "Loading model", "unavailable_error", code="model_loading")
            return await JSONResponse(e.body(), status_code=503)(scope, receive, send)
        await self.app(scope, receive, send)


class RequestLog:
    """ASGI: one log line per request, written just before its last byte is sent (a stream's at its
    end), so a client holding its answer can always find the line: client, method, path, status,
    prompt+completion tokens and wall time."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        t0, status, logged = time.perf_counter(), ["-"], [False]
        state = scope.setdefault("state", {})

        def log_once():
            if logged[0]:
                return
            logged[0] = True
            tokens = state.get("tokens")
            client = scope.get("client") or ("-", 0)
            request_log.info("%s %s %s %s %s %.3f s", client[0], scope["method"], scope["path"], status[0],
                             f"{tokens[0]}+{tokens[1]} tokens" if tokens else "-", time.perf_counter() - t0)

        async def send_logged(msg):
            if msg["type"] == "http.response.start":
                status[0] = msg["status"]
            elif msg["type"] == "http.response.body" and not msg.get("more_body", False):
                log_once()
            await send(msg)
        try:
            await self.app(scope, receive, send_logged)
        finally:
            log_once()  # an app that failed before its last byte


def _token_list(v, vocab: int, name: str) -> list[int]:
    if not isinstance(v, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in v):
        raise APIError(400, f"'{name}' must be a list of token ids", param=name)
    bad = [t for t in v if not 0 <= t < vocab]
    if bad:
        raise APIError(400, f"'{name}': token id {bad[0]} is outside this model's vocabulary (0..{vocab - 1})",
                       param=name)
    return v


def _embedding_inputs(body: dict, tok, context: int, vocab: int) -> list[list[int]]:
    """The request's inputs as token id lists: a string, strings, token ids, or lists of them."""
    x = body.get("input")
    if isinstance(x, str) or (isinstance(x, list) and x and all(isinstance(i, int) for i in x)):
        x = [x]
    if not isinstance(x, list) or not x:
        raise APIError(400, "'input' must be a non-empty string, list of strings, or list(s) of token ids",
                       param="input")
    if len(x) > MAX_EMBEDDING_INPUTS:
        raise APIError(400, f"'input' has {len(x)} items; at most {MAX_EMBEDDING_INPUTS}", param="input")
    out = []
    for i, item in enumerate(x):
        ids = tok.encode(item) if isinstance(item, str) else _token_list(item, vocab, f"input[{i}]")
        if not ids:
            raise APIError(400, f"input[{i}] is empty", param="input")
        if len(ids) > context:
            raise APIError(400, f"input[{i}] is {len(ids)} tokens; this model's context holds {context}",
                           param="input", code="context_length_exceeded")
        out.append(ids)
    return out


def _embedding_json(vec: np.ndarray, encoding: str):
    # base64: float32 little-endian, what the openai client asks for by default and decodes
    return base64.b64encode(vec.astype("<f4").tobytes()).decode() if encoding == "base64" else vec.tolist()


def _decode_modules(llm, slots: bool) -> dict:
    """Which decode module a lone row and the slots' batched step run on
    ("serial" | "parallel"), with the timings that chose them."""
    out = {"decode": getattr(llm, "decode_kind", None), "decode_timing": getattr(llm, "decode_choice", None)}
    if slots:
        out.update(batch=llm.batch_kind, batch_timing=llm.batch_choice)
    return out


def add_routes(app, service, authorize, read_body) -> None:
    """llama-server's endpoints on ``app`` (``authorize(request)`` raises without the API key;
    ``await read_body(request)`` is the body, bounded as the completion endpoints' are)."""
    import asyncio

    from fastapi import Request
    from fastapi.responses import Response
    from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

    from .llm import Embedder

    registry = CollectorRegistry(auto_describe=False)
    registry.register(_collector(service))
    embedder: list = []  # made at the first embedding request (it reads the LM head from the GGUF)

    async def json_body(request: Request) -> dict:
        authorize(request)
        return parse_json(await read_body(request))

    @app.post("/tokenize")
    async def tokenize(request: Request):
        body = await json_body(request)
        content = body.get("content")
        if not isinstance(content, str):
            raise APIError(400, "'content' must be a string", param="content")
        # add_special: llama-server adds BOS where the model asks for it; no GGUF dspx loads does
        ids = service.gen.tok.encode(content)
        if body.get("with_pieces"):
            return {"tokens": [{"id": i, "piece": service.gen.tok.token_bytes(i).decode("utf-8", errors="replace")}
                               for i in ids]}
        return {"tokens": ids}

    @app.post("/detokenize")
    async def detokenize(request: Request):
        body = await json_body(request)
        ids = _token_list(body.get("tokens"), service.gen.tok.vocab_size, "tokens")
        return {"content": service.gen.tok.decode(ids)}

    def embed_all(inputs: list[list[int]]) -> list[np.ndarray]:
        if not embedder:
            embedder.append(Embedder(service.gen.llm.meta["gguf"]["path"]))
        with service.generator([]) as gen:  # with --parallel, a KV slot of its own
            try:
                return [embedder[0].embed(gen.llm, ids) for ids in inputs]
            finally:
                gen.cached = []  # the decode steps overwrote the KV's first rows: no prefix to reuse

    @app.post("/v1/embeddings")
    @app.post("/embeddings")
    async def embeddings(request: Request):
        body = await json_body(request)
        unknown = [k for k in body if k not in ("input", "model", "encoding_format", "user") and body[k] is not None]
        if unknown:
            raise APIError(400, f"unsupported field '{unknown[0]}' for embeddings", param=unknown[0],
                           code="unsupported_parameter")
        encoding = body.get("encoding_format") or "float"
        if encoding not in ("float", "base64"):
            raise APIError(400, f"'encoding_format' must be float or base64, got {encoding!r}",
                           param="encoding_format")
        gen = service.gen
        inputs = _embedding_inputs(body, gen.tok, gen.context, gen.tok.vocab_size)
        vecs = await asyncio.wrap_future(service.submit(embed_all, inputs))
        n = sum(len(i) for i in inputs)
        request.state.tokens = (n, 0)
        return {"object": "list", "model": body.get("model") or service.model,
                "data": [{"object": "embedding", "index": i, "embedding": _embedding_json(v, encoding)}
                         for i, v in enumerate(vecs)],
                "usage": {"prompt_tokens": n, "total_tokens": n}}

    @app.get("/props")
    async def props(request: Request):
        authorize(request)
        gen = service.gen
        from .. import __version__
        return {"default_generation_settings": {
                    "n_ctx": service.context, "model": service.model,
                    "params": {"temperature": 1.0, "top_k": 0, "top_p": 1.0, "repeat_penalty": 1.0,
                               "repeat_last_n": 64, "n_predict": -1, "seed": -1}},
                "total_slots": service.parallel, "model_path": str(gen.llm.dir),
                "chat_template": gen.tok.chat_template or "", "eos_token": gen.tok.id_to_token(gen.eos_id),
                "build_info": f"dspx {__version__}", "modalities": {"vision": False, "audio": False},
                "dspx": _decode_modules(gen.llm, service.slots is not None)}

    @app.get("/slots")
    async def slots(request: Request):
        authorize(request)
        return [{"id": r["id"], "n_ctx": r["n_ctx"], "is_processing": r["is_processing"],
                 "n_past": r["cached_tokens"]} for r in _slot_rows(service)]

    @app.get("/metrics")
    async def metrics(request: Request):
        authorize(request)
        return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)
