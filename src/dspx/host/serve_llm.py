"""``dspx serve-llm``: an OpenAI-compatible HTTP API for the device LLM.

FastAPI on uvicorn, Server-Sent Events through sse-starlette.  Endpoints (the
subset llama-server and OpenAI clients use):

- ``GET /v1/models``;
- ``POST /v1/chat/completions`` (messages through the model's chat template)
  and ``POST /v1/completions`` (the prompt as raw text), streaming (SSE,
  ending ``data: [DONE]``) or not, with ``temperature``, ``top_p``,
  ``max_tokens`` (or ``max_completion_tokens``), ``stop``, ``seed``, and
  llama-server's ``top_k`` / ``repeat_penalty``; ``usage`` counts (and
  ``stream_options.include_usage``);
- errors as OpenAI's ``{"error": {"message", "type", "param", "code"}}``;
- llama-server's ``/health`` (503 ``{"status": "loading"}`` until the model is
  loaded, then 200), ``/tokenize``, ``/detokenize``, ``/v1/embeddings``,
  ``/props``, ``/slots``, ``/metrics``, ``logprobs``, a 400 naming any field
  not implemented, and a log line per request (``serve_llm_endpoints``).

Start-up (``serve_llm``): the package and tokenizer are read and the port is
bound before anything loads, so a bad ``--model`` or a port in use is one
error at once; the model then loads while the port answers 503, and
``on_ready`` is called (the CLI's "serving" line) when it answers requests.

One device, one KV cache: requests run one at a time, in arrival order (a
single worker thread takes them FIFO), and at most ``max_queue`` wait; more
get 503 ``server_busy``.  With ``parallel`` N > 1 the KV cache is split into
N slots and N requests run at once, their decode steps batched into one
device call (``dspx.host.llm.batch``).  A client that disconnects mid-stream stops its
answer at the next token.  Chat requests reuse the cached prefix of the
previous request (a client resending a growing conversation prefills only
the new turn).  The model name in a request is not checked: existing clients
send their own.  Binds 127.0.0.1 unless told otherwise; ``--api-key`` (or
``$DSPX_API_KEY``) requires ``Authorization: Bearer <key>``.

What one client may cost the server is bounded (``Limits``; docs/serve-llm.md,
"Limits"): a body over ``max_body`` gets 413 as soon as it
passes the limit (it is never buffered whole); JSON parsing, the chat template
and tokenization run on a worker thread, not the event loop; a connection
gets ``header_timeout`` to send its request headers and ``idle_timeout`` of
silence between requests or body chunks; past ``max_connections`` open
connections a new one is answered 503 and closed at accept, and the old
ones are kept.  Non-finite numbers, bad seeds and JSON nested deeper than
``MAX_JSON_DEPTH`` get OpenAI-shaped 400s; a non-streaming request whose
client disconnects is cancelled (taken off the queue, or stopped at the next
token).
"""

# (no `from __future__ import annotations`: FastAPI resolves the handlers' Request annotation at
# definition time, and fastapi is imported inside create_app so the CLI loads without the extra)
import asyncio
import concurrent.futures
import hmac
import http
import json
import math
import os
import sys
import threading
import time
import uuid
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .llm import Generator  # imported where used: the CLI loads this module without the llm extra

__all__ = ["Limits", "LLMService", "create_app", "serve_llm", "uvicorn_config"]


@dataclass(frozen=True)
class Limits:
    """What one HTTP client may cost the server (the CLI's defaults)."""

    # A full 1,024-token context is a few KiB of text (tens with JSON escaping of every
    # character), so 1 MiB refuses nothing real; 64 connections x 1 MiB bounds body memory.
    max_body: int = 1 << 20
    header_timeout: float = 10.0  # seconds for a request line + headers (slowloris)
    idle_timeout: float = 5.0     # seconds of silence between requests, or between body chunks
    # One device serves one request at a time and at most --max-queue (16) wait; 64 is
    # room for those, /health probes and streaming readers, and stays far below the usual
    # 1,024-fd soft limit, so accept() never fails with EMFILE (that locked everyone out).
    max_connections: int = 64


MAX_JSON_DEPTH = 32   # a chat request nests 4 deep (body, messages, message, content parts)
FD_SPARE = 32         # fds kept beyond max_connections: the listener, the device, logs, the tokenizer's files

FINISH = {"eos": "stop", "stop": "stop", "interrupted": "stop", "max_tokens": "length", "context": "length",
          "time": "length"}


class APIError(Exception):
    """An error answered in OpenAI's JSON shape."""

    def __init__(self, status: int, message: str, type_: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None, close: bool = False):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type_, param, code
        self.close = close  # the connection ends after the answer (e.g. an unread body behind it)

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def raw_response(self) -> bytes:
        """The whole HTTP/1.1 answer, for the protocol layer (before or without a request)."""
        body = json.dumps(self.body()).encode()
        return (f"HTTP/1.1 {self.status} {http.HTTPStatus(self.status).phrase}\r\n"
                f"content-type: application/json\r\ncontent-length: {len(body)}\r\n"
                f"connection: close\r\n\r\n").encode() + body


def _too_deep() -> APIError:
    return APIError(400, f"the request body nests deeper than {MAX_JSON_DEPTH} levels of arrays/objects")


def _depth(value) -> int:
    """Nesting depth of parsed JSON (iterative: the value may be as deep as the parser allowed)."""
    deepest, todo = 0, [(value, 1)]
    while todo:
        v, d = todo.pop()
        if isinstance(v, (dict, list)):
            deepest = max(deepest, d)
            if d > MAX_JSON_DEPTH:
                break
            todo.extend((x, d + 1) for x in (v.values() if isinstance(v, dict) else v))
    return deepest


def parse_json(raw: bytes) -> dict:
    """The request body as a JSON object: strict JSON (no NaN/Infinity), at most MAX_JSON_DEPTH deep."""
    def no_constant(name):
        raise ValueError(f"{name} is not a JSON number")
    try:
        body = json.loads(raw, parse_constant=no_constant)
    except RecursionError:  # deeper than the interpreter's recursion limit
        raise _too_deep() from None
    except ValueError as e:
        raise APIError(400, f"the request body is not JSON: {e}") from None
    if _depth(body) > MAX_JSON_DEPTH:
        raise _too_deep()
    if not isinstance(body, dict):
        raise APIError(400, "the request body must be a JSON object")
    return body


def _number(body: dict, name: str, default, lo: float, hi: float | None = None, kind=float):
    v = body.get(name, default)
    if v is None:
        return default
    ok = not isinstance(v, bool) and (isinstance(v, int) or (  # ints are exact at any size
        isinstance(v, float) and math.isfinite(v) and (kind is float or v.is_integer())))  # 1e999 parses as inf
    if not ok:
        raise APIError(400, f"'{name}' must be {'an integer' if kind is int else 'a finite number'}, "
                            f"got {repr(v)[:40]}", param=name)
    if v < lo or (hi is not None and v > hi):
        rng = f"at least {lo}" if hi is None else f"between {lo} and {hi}"
        raise APIError(400, f"'{name}' must be {rng}, got {v}", param=name)
    return kind(v)


def sampling_params(body: dict) -> dict:
    """The Generator keyword arguments of one request (validated)."""
    stop = body.get("stop")
    if stop is None:
        stop = []
    elif isinstance(stop, str):
        stop = [stop]
    elif not (isinstance(stop, list) and all(isinstance(s, str) for s in stop)) or len(stop) > 4:
        raise APIError(400, "'stop' must be a string or a list of at most 4 strings", param="stop")
    n = body.get("n", 1)
    if n != 1:
        raise APIError(400, f"only n=1 is supported (one device, one KV cache), got {n!r}", param="n")
    # llama-server's -1 means "random", as no seed does; numpy seeds take any unsigned 64-bit value
    seed = _number(body, "seed", None, -1, 2**64 - 1, kind=int)
    if seed == -1:
        seed = None
    max_tokens = body.get("max_completion_tokens", body.get("max_tokens"))
    param = "max_completion_tokens" if "max_completion_tokens" in body else "max_tokens"
    if max_tokens is not None:
        max_tokens = _number({param: max_tokens}, param, None, 1, kind=int)
    return dict(temperature=_number(body, "temperature", 1.0, 0, 2), top_p=_number(body, "top_p", 1.0, 0, 1),
                top_k=_number(body, "top_k", 0, 0, kind=int),
                repeat_penalty=_number(body, "repeat_penalty", 1.0, 0.01, 10), stop=stop,
                seed=seed, max_tokens=max_tokens)


class LLMService:
    """The device side of the server: one Generator and worker thread (FIFO), or with
    ``parallel`` N KV slots, each a Generator, their decode steps batched."""

    def __init__(self, generator: "Generator", model_name: str = "smollm2-135m-instruct", max_queue: int = 16,
                 loaded: bool = True, parallel: int = 1):
        self.gen = generator
        self.model = model_name
        self.created = int(time.time())
        self.max_queue = max_queue
        self.parallel = parallel
        self.slots = None  # parallel > 1: KV slots, decode steps batched (dspx.host.llm.batch), made by load()
        self.pool = concurrent.futures.ThreadPoolExecutor(max_workers=parallel, thread_name_prefix="dspx-llm")
        # JSON parsing and tokenization (seconds for a MiB prompt), off the event loop; one thread,
        # since the GIL would make more no faster
        self.prep = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="dspx-llm-prep")
        self.waiting = 0  # requests submitted and not finished
        self._lock = threading.Lock()
        from .serve_llm_endpoints import Stats
        self.stats = Stats()
        self.ready = threading.Event()  # the model is loaded (until then: 503 "Loading model")
        if loaded:
            self.load()

    def load(self) -> None:
        """Load the model on the device (compiling it the first time) and split its KV into
        slots; then requests are served."""
        llm = self.gen.llm
        if self.parallel > 1:
            from .llm.batch import SlotPool
            self.slots = SlotPool(llm, self.gen.tok, self.parallel)
        self.ready.set()

    def _admit(self) -> None:
        with self._lock:
            if self.waiting >= self.max_queue + self.parallel:
                raise APIError(503, f"server busy: {self.waiting} requests queued or running for one device "
                                    f"(at most {self.max_queue} wait); retry later", "server_error",
                               code="server_busy")
            self.waiting += 1

    def _done(self, *_):
        with self._lock:
            self.waiting -= 1

    def submit(self, fn, *args) -> concurrent.futures.Future:
        self._admit()
        fut = self.pool.submit(fn, *args)
        fut.add_done_callback(self._done)
        return fut

    def encode(self, prompt, chat: bool) -> list[int]:
        """Token ids of a request, refused (before it queues) when they leave no room for an answer."""
        ctx = self.context
        ids = self.gen.encode(prompt, chat)
        if len(ids) >= ctx:
            raise APIError(400, f"the prompt is {len(ids)} tokens; this model's context holds {ctx} "
                                f"(prompt + answer)", param="messages" if chat else "prompt",
                           code="context_length_exceeded")
        return ids

    @property
    def context(self) -> int:
        """Tokens one request may use (prompt + answer): the context, or one KV slot's share of it."""
        return self.slots.slot_tokens if self.slots is not None else self.gen.context

    def generator(self, ids: list[int]):
        """A context giving the Generator to run ``ids`` on: the one Generator, or with
        --parallel a free KV slot's (the one whose cache shares most of ``ids``)."""
        from contextlib import nullcontext

        return self.slots.acquire(ids) if self.slots is not None else nullcontext(self.gen)

    def run(self, ids: list[int], params: dict, on_piece=None, cancelled=None):
        """Generate on a worker thread (on a free KV slot with --parallel); returns the GenerationResult."""
        from .llm import GenerationResult

        p = dict(params)
        with self.generator(ids) as gen:
            max_tokens = p.pop("max_tokens") or gen.context - len(ids) + 1
            res = GenerationResult(len(ids))
            for _, piece in gen.stream(ids, max_tokens, result=res, reuse_cache=True, should_stop=cancelled, **p):
                if piece and on_piece is not None:
                    on_piece(piece)
        return res

    def close(self) -> None:
        self.prep.shutdown(wait=True, cancel_futures=True)
        self.pool.shutdown(wait=True, cancel_futures=True)
        if self.slots is not None:
            self.slots.close()


def _usage(res) -> dict:
    completion = len(res.ids) - (1 if res.finish_reason == "eos" else 0)  # the end-of-turn token is not text
    return {"prompt_tokens": res.prompt_tokens, "completion_tokens": completion,
            "total_tokens": res.prompt_tokens + completion}


def _messages(body: dict) -> list[dict]:
    msgs = body.get("messages")
    if not isinstance(msgs, list) or not msgs:
        raise APIError(400, "'messages' must be a non-empty list", param="messages")
    out = []
    for i, m in enumerate(msgs):
        if not isinstance(m, dict) or m.get("role") not in ("system", "user", "assistant", "developer"):
            raise APIError(400, f"messages[{i}] needs a role of system, user or assistant", param=f"messages[{i}]")
        content = m.get("content")
        if isinstance(content, list):  # content parts: the text ones
            content = "".join(p.get("text", "") for p in content if isinstance(p, dict) and p.get("type") == "text")
        if not isinstance(content, str):
            raise APIError(400, f"messages[{i}].content must be a string", param=f"messages[{i}].content")
        out.append({"role": "system" if m["role"] == "developer" else m["role"], "content": content})
    return out


def _prompt(body: dict, chat: bool):
    if chat:
        return _messages(body)
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
        prompt = prompt[0]
    if not isinstance(prompt, str) or not prompt:
        raise APIError(400, "'prompt' must be a non-empty string", param="prompt")
    return prompt


def _error_handlers(app) -> None:
    """Every error in OpenAI's JSON shape."""
    from fastapi.exceptions import RequestValidationError
    from fastapi.responses import JSONResponse
    from starlette.exceptions import HTTPException

    @app.exception_handler(APIError)
    async def api_error(_req, e: APIError):
        return JSONResponse(e.body(), status_code=e.status, headers={"connection": "close"} if e.close else None)

    @app.exception_handler(HTTPException)
    async def http_error(_req, e: HTTPException):
        code = {404: "not_found", 405: "method_not_allowed"}.get(e.status_code)
        return JSONResponse(APIError(e.status_code, str(e.detail), code=code).body(), status_code=e.status_code)

    @app.exception_handler(RequestValidationError)
    async def validation_error(_req, e: RequestValidationError):
        return JSONResponse(APIError(400, f"invalid request: {e.errors()}").body(), status_code=400)

    @app.exception_handler(Exception)
    async def server_error(_req, e: Exception):  # a bug: still OpenAI's shape, never a plain-text 500
        return JSONResponse(APIError(500, f"{type(e).__name__}: {e}", "server_error").body(), status_code=500)


async def _read_body(request, limits: Limits) -> bytes:
    """The body, refused with 413 as soon as it passes max_body (so it is never held whole)."""
    from starlette.requests import ClientDisconnect

    def too_large(size: str) -> APIError:
        return APIError(413, f"the request body is {size} bytes; this server takes at most {limits.max_body} "
                             f"(--max-body)", code="request_too_large", close=True)
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limits.max_body:
        raise too_large(declared)
    buf = bytearray()
    chunks = request.stream().__aiter__()
    while True:
        try:
            chunk = await asyncio.wait_for(chunks.__anext__(), limits.idle_timeout)
        except StopAsyncIteration:
            return bytes(buf)
        except asyncio.TimeoutError:
            raise APIError(408, f"no request body bytes for {limits.idle_timeout} s (--idle-timeout)",
                           code="request_timeout", close=True) from None
        except ClientDisconnect:
            raise APIError(400, "the client disconnected while sending the body", close=True) from None
        buf += chunk
        if len(buf) > limits.max_body:
            raise too_large(f"more than {limits.max_body}")


async def _disconnected(request) -> None:
    """Returns when the client has gone (the body is read: the next message is the disconnect)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


def check_api_key(api_key: str | None, authorization: str) -> None:
    """Refuse a request whose Authorization header is not ``Bearer <api_key>``
    (compared in constant time: a key must not leak through how long a
    refusal takes); no key, no check."""
    if api_key is not None and not hmac.compare_digest(authorization.encode(), f"Bearer {api_key}".encode()):
        raise APIError(401, "Incorrect API key provided: send 'Authorization: Bearer <key>' with the key "
                            "serve-llm was started with", code="invalid_api_key")


def create_app(service: LLMService, api_key: str | None = None, limits: Limits = Limits()):
    from fastapi import FastAPI, Request
    from fastapi.responses import JSONResponse, Response
    from sse_starlette.sse import EventSourceResponse

    from .llm import ContextFullError
    from .serve_llm_endpoints import (LoadingGate, Logprobs, RequestLog, add_routes, check_fields, finished,
                                      logprob_request)

    app = FastAPI(title="dspx serve-llm", docs_url=None, redoc_url=None)
    _error_handlers(app)
    app.add_middleware(LoadingGate, ready=service.ready)
    app.add_middleware(RequestLog)  # added last: outermost, so it logs the gate's 503s too

    def authorize(request: Request) -> None:
        check_api_key(api_key, request.headers.get("authorization", ""))

    @app.get("/v1/models")
    async def models(request: Request):
        authorize(request)
        return {"object": "list", "data": [{"id": service.model, "object": "model", "created": service.created,
                                            "owned_by": "dspx"}]}

    @app.get("/health")
    async def health():
        if not service.ready.is_set():
            return JSONResponse({"status": "loading"}, status_code=503)  # llama-server's answer while loading
        return {"status": "ok", "waiting": service.waiting}

    add_routes(app, service, authorize, lambda request: _read_body(request, limits))

    def prepare(raw: bytes, chat: bool):
        """Parse, validate and tokenize (CPU-heavy for big bodies: runs on the prep thread)."""
        body = parse_json(raw)
        check_fields(body, chat)
        prompt = _prompt(body, chat)
        params = sampling_params(body)
        return body, params, service.encode(prompt, chat)

    async def complete(request: Request, chat: bool):
        authorize(request)
        loop = asyncio.get_running_loop()
        body, params, ids = await loop.run_in_executor(service.prep, prepare, await _read_body(request, limits), chat)
        stream = bool(body.get("stream", False))
        opts = body.get("stream_options") or {}
        include_usage = bool(opts.get("include_usage")) if isinstance(opts, dict) else False
        rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]
        obj = "chat.completion" if chat else "text_completion"
        created = int(time.time())
        base = {"id": rid, "created": created, "model": body.get("model") or service.model}
        cancelled = threading.Event()
        top = logprob_request(body, chat)
        logprobs = None if top is None else Logprobs(service.gen.tok, top, service.gen.eos_id)
        if logprobs is not None:
            params = {**params, "on_logits": logprobs}

        if not stream:
            fut = service.submit(service.run, ids, params, None, cancelled.is_set)

            async def cancel_when_gone():  # nobody to answer: off the queue, or stopped at the next token
                await _disconnected(request)
                cancelled.set()
                fut.cancel()
            watcher = asyncio.create_task(cancel_when_gone())
            try:
                res = await asyncio.wrap_future(fut)
            except asyncio.CancelledError:
                if not fut.cancelled():
                    raise
                res = None
            except ContextFullError as e:
                raise APIError(400, str(e), code="context_length_exceeded") from None
            finally:
                watcher.cancel()
            if res is None or cancelled.is_set():
                return Response(status_code=499)  # nginx's "client closed request": no one reads it
            usage = _usage(res)
            finished(service, request, res, usage["completion_tokens"])
            lp = None if logprobs is None else logprobs.shape(chat, logprobs.take())
            choice = ({"index": 0, "message": {"role": "assistant", "content": res.text},
                       "logprobs": lp, "finish_reason": FINISH[res.finish_reason]} if chat else
                      {"index": 0, "text": res.text, "logprobs": lp, "finish_reason": FINISH[res.finish_reason]})
            return {**base, "object": obj, "choices": [choice], "usage": usage}

        queue: asyncio.Queue = asyncio.Queue()

        def on_piece(piece: str) -> None:  # on the generating thread: the logprobs of the tokens up to this piece
            taken = None if logprobs is None else logprobs.take()
            loop.call_soon_threadsafe(queue.put_nowait, ("piece", (piece, taken)))

        fut = service.submit(service.run, ids, params, on_piece, cancelled.is_set)
        fut.add_done_callback(lambda f: loop.call_soon_threadsafe(queue.put_nowait, ("done", f)))
        cobj = "chat.completion.chunk" if chat else "text_completion"

        def chunk(delta: Any, finish=None, entries=None) -> str:
            lp = None if not entries else logprobs.shape(chat, entries)
            c = ({"index": 0, "delta": delta, "logprobs": lp, "finish_reason": finish} if chat else
                 {"index": 0, "text": delta, "logprobs": lp, "finish_reason": finish})
            return json.dumps({**base, "object": cobj, "choices": [c]})

        async def events():
            try:
                if chat:
                    yield {"data": chunk({"role": "assistant", "content": ""})}
                while True:
                    kind, val = await queue.get()
                    if kind == "piece":
                        piece, entries = val
                        yield {"data": chunk({"content": piece} if chat else piece, entries=entries)}
                        continue
                    try:
                        res = val.result()
                    except APIError as e:
                        yield {"data": json.dumps(e.body())}
                        break
                    except Exception as e:  # noqa: BLE001 - the stream has begun: report in-band
                        yield {"data": json.dumps(APIError(500, f"{type(e).__name__}: {e}", "server_error").body())}
                        break
                    usage = _usage(res)
                    finished(service, request, res, usage["completion_tokens"])
                    rest = None if logprobs is None else logprobs.take()
                    yield {"data": chunk({} if chat else "", FINISH[res.finish_reason], rest)}
                    if include_usage:
                        yield {"data": json.dumps({**base, "object": cobj, "choices": [], "usage": usage})}
                    break
                yield {"data": "[DONE]"}
            finally:
                cancelled.set()  # a client gone mid-answer stops it at the next token
                fut.cancel()     # or before it starts, if it is still queued

        return EventSourceResponse(events(), ping=15)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await complete(request, True)

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await complete(request, False)

    return app


def _protocol(limits: Limits):
    """uvicorn's h11 protocol with serve-llm's connection cap and header timeout (uvicorn has neither:
    its limit_concurrency answers only once a request's headers are in, which a slowloris never sends)."""
    import h11
    from uvicorn.protocols.http.h11_impl import H11Protocol

    shed = APIError(503, f"server busy: {limits.max_connections} connections are open (--max-connections); "
                         f"retry later", "server_error", code="server_busy").raw_response()
    bad = APIError(400, "invalid HTTP request").raw_response()

    class LimitedH11Protocol(H11Protocol):
        head_timer: asyncio.TimerHandle | None = None

        def connection_made(self, transport):
            super().connection_made(transport)
            if len(self.connections) > limits.max_connections:  # shed the newcomer, keep those being served
                self.logger.warning("serve-llm: %d connections open; refusing a new one", len(self.connections) - 1)
                transport.write(shed)
                transport.close()
                return
            self._arm_head_timer()

        def _arm_head_timer(self):
            self._disarm_head_timer()
            self.head_timer = self.loop.call_later(limits.header_timeout, self._head_too_slow)

        def _disarm_head_timer(self):
            if self.head_timer is not None:
                self.head_timer.cancel()
                self.head_timer = None

        def _head_too_slow(self):
            self.head_timer = None
            if self.conn.their_state is h11.IDLE and not self.transport.is_closing():
                self.logger.info("serve-llm: closing a connection that sent no complete request headers in %s s",
                                 limits.header_timeout)
                self.transport.close()

        def handle_events(self):
            super().handle_events()
            if self.conn.their_state is not h11.IDLE:  # the request's headers are in
                self._disarm_head_timer()

        def on_response_complete(self):
            super().on_response_complete()
            if not self.transport.is_closing() and self.conn.their_state is h11.IDLE:  # kept alive: the next head
                self._arm_head_timer()

        def connection_lost(self, exc):
            self._disarm_head_timer()
            super().connection_lost(exc)

        def send_400_response(self, msg: str) -> None:  # unparsable HTTP: OpenAI's shape, not plain text
            self.transport.write(bad)
            self.transport.close()

    return LimitedH11Protocol


def uvicorn_config(app, host: str, port: int, limits: Limits = Limits(), log_level: str = "info"):
    import uvicorn

    return uvicorn.Config(app, host=host, port=port, log_level=log_level, http=_protocol(limits), ws="none",
                          timeout_keep_alive=limits.idle_timeout)


def check_fd_room(max_connections: int) -> None:
    """Refuse to start when the fd limit cannot hold max_connections (accept() would fail with EMFILE)."""
    import resource

    from ..errors import DspxError

    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    need = len(os.listdir("/proc/self/fd")) + max_connections + FD_SPARE
    if soft != resource.RLIM_INFINITY and need > soft:
        raise DspxError(f"--max-connections {max_connections} needs {need} file descriptors (those open now, "
                        f"the connections and {FD_SPARE} spare); the limit is {soft}: lower --max-connections "
                        f"or raise `ulimit -n`")


def bind(host: str, port: int):
    """A listening socket on host:port, or one error line (before any model loads)."""
    import errno
    import socket as socketlib

    from ..errors import DspxError

    family = socketlib.AF_INET6 if ":" in host else socketlib.AF_INET  # as uvicorn chooses
    sock = socketlib.socket(family, socketlib.SOCK_STREAM)
    try:
        sock.setsockopt(socketlib.SOL_SOCKET, socketlib.SO_REUSEADDR, 1)  # as uvicorn: TIME_WAIT is no conflict
        sock.bind((host, port))
        sock.listen(2048)
    except OSError as e:
        sock.close()
        hint = {errno.EADDRINUSE: ": another server listens there; stop it or choose another --port",
                errno.EACCES: ": ports below 1024 need privileges; choose another --port",
                errno.EADDRNOTAVAIL: ": this host has no such address (--host)"}.get(e.errno, "")
        raise DspxError(f"cannot listen on {host}:{port}: {e.strerror}{hint}") from None
    except (OverflowError, socketlib.gaierror) as e:
        sock.close()
        raise DspxError(f"cannot listen on {host}:{port}: {e}") from None
    return sock


def _log_requests() -> None:
    """The request log lines on stderr (llama-server logs every request), unless logging is set up already."""
    import logging

    from .serve_llm_endpoints import request_log

    if not request_log.handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("%(asctime)s %(message)s", "%H:%M:%S"))
        request_log.addHandler(handler)
        request_log.setLevel(logging.INFO)
        request_log.propagate = False


def serve_llm(host: str = "127.0.0.1", port: int = 8080, api_key: str | None = None, *, model_dir=None, gguf=None,
              socket: str | None = None, context: int = 256, kv_dtype: str = "float32", max_queue: int = 16,
              limits: Limits = Limits(), log_level: str = "info", on_loading=None, on_ready=None,
              parallel: int = 1, decode_activations: str = "int8") -> None:
    """Serve until interrupted: check the model and bind the port first (each a DspxError at
    once), then ``on_loading(url)`` and load the model while /health answers 503
    (``parallel``: KV slots);
    ``on_ready(url)`` once it serves."""
    import uvicorn

    from .llm import Generator

    # reads the package's metadata and the tokenizer; the device model loads later, in load()
    gen = Generator(model_dir=model_dir, gguf=gguf, socket=socket, progress=True, context=context, kv_dtype=kv_dtype,
                    decode_activations=decode_activations)
    check_fd_room(limits.max_connections)
    sock = bind(host, port)
    svc = LLMService(gen, max_queue=max_queue, loaded=False, parallel=parallel)
    server = uvicorn.Server(uvicorn_config(create_app(svc, api_key, limits), host, port, limits, log_level))
    failed: list[BaseException] = []

    def load() -> None:
        try:
            svc.load()
        except BaseException as e:  # noqa: BLE001 - re-raised on the main thread, after the server stops
            failed.append(e)
            server.should_exit = True
            return
        deadline = time.monotonic() + 60
        while not server.started and not server.should_exit and time.monotonic() < deadline:
            time.sleep(0.05)  # uvicorn accepts from the bound socket once its loop runs
        if server.started and parallel > 1:
            print(f"{parallel} KV slots of {svc.context} tokens ({gen.llm.kv_dtype} KV, context {gen.llm.context})",
                  file=sys.stderr)
        if server.started and on_ready is not None:
            on_ready(url)

    where = sock.getsockname()
    url = f"http://{f'[{where[0]}]' if ':' in where[0] else where[0]}:{where[1]}"
    if on_loading is not None:
        on_loading(url)
    _log_requests()
    loader = threading.Thread(target=load, name="dspx-llm-load", daemon=True)
    loader.start()
    try:
        server.run(sockets=[sock])
    finally:
        sock.close()
        svc.close()
        if not loader.is_alive():  # interrupted while loading: the process exit ends the load
            gen.close()
    if failed:
        raise failed[0]
