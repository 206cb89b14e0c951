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
- errors as OpenAI's ``{"error": {"message", "type", "param", "code"}}``.

One device, one KV cache: requests run one at a time, in arrival order (a
single worker thread takes them FIFO), and at most ``max_queue`` wait; more
get 503 ``server_busy``.  A client that disconnects mid-stream stops its
answer at the next token.  Chat requests reuse the cached prefix of the
previous request (a client resending a growing conversation prefills only
the new turn).  The model name in a request is not checked: existing clients
send their own.  Binds 127.0.0.1 unless told otherwise; ``--api-key`` (or
``$DSPX_API_KEY``) requires ``Authorization: Bearer <key>``.
"""

# (no `from __future__ import annotations`: FastAPI resolves the handlers' Request annotation at
# definition time, and fastapi is imported inside create_app so the CLI loads without the extra)
import asyncio
import concurrent.futures
import json
import threading
import time
import uuid
from typing import Any

from .llm import ContextFullError, Generator

__all__ = ["LLMService", "create_app", "serve_llm"]

FINISH = {"eos": "stop", "stop": "stop", "interrupted": "stop", "max_tokens": "length", "context": "length",
          "time": "length"}


class APIError(Exception):
    """An error answered in OpenAI's JSON shape."""

    def __init__(self, status: int, message: str, type_: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type_, param, code

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def _number(body: dict, name: str, default, lo: float, hi: float | None = None, kind=float):
    v = body.get(name, default)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, (int, float)) or (kind is int and not float(v).is_integer()):
        raise APIError(400, f"'{name}' must be {'an integer' if kind is int else 'a number'}, got {v!r}", param=name)
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
    seed = body.get("seed")
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
        raise APIError(400, f"'seed' must be an integer, got {seed!r}", param="seed")
    max_tokens = body.get("max_completion_tokens", body.get("max_tokens"))
    param = "max_completion_tokens" if "max_completion_tokens" in body else "max_tokens"
    if max_tokens is not None:
        max_tokens = _number({param: max_tokens}, param, None, 1, kind=int)
    return dict(temperature=_number(body, "temperature", 1.0, 0, 2), top_p=_number(body, "top_p", 1.0, 0, 1),
                top_k=_number(body, "top_k", 0, 0, kind=int),
                repeat_penalty=_number(body, "repeat_penalty", 1.0, 0.01, 10), stop=stop,
                seed=seed, max_tokens=max_tokens)


class LLMService:
    """The device side of the server: one Generator, one worker thread (FIFO)."""

    def __init__(self, generator: Generator, model_name: str = "smollm2-135m-instruct", max_queue: int = 16):
        self.gen = generator
        self.model = model_name
        self.created = int(time.time())
        self.max_queue = max_queue
        self.pool = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="dspx-llm")
        self.waiting = 0  # requests submitted and not finished
        self._lock = threading.Lock()

    def _admit(self) -> None:
        with self._lock:
            if self.waiting >= self.max_queue + 1:
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
        ctx = self.gen.context
        ids = self.gen.encode(prompt, chat)
        if len(ids) >= ctx:
            raise APIError(400, f"the prompt is {len(ids)} tokens; this model's context holds {ctx} "
                                f"(prompt + answer)", param="messages" if chat else "prompt",
                           code="context_length_exceeded")
        return ids

    def run(self, ids: list[int], params: dict, on_piece=None, cancelled=None):
        """Generate on the worker thread; returns the GenerationResult."""
        from .llm import GenerationResult

        p = dict(params)
        max_tokens = p.pop("max_tokens") or self.gen.context - len(ids) + 1
        res = GenerationResult(len(ids))
        for _, piece in self.gen.stream(ids, max_tokens, result=res, reuse_cache=True, should_stop=cancelled, **p):
            if piece and on_piece is not None:
                on_piece(piece)
        return res

    def close(self) -> None:
        self.pool.shutdown(wait=True, cancel_futures=True)


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


def create_app(service: LLMService, api_key: str | None = None):
    from fastapi import FastAPI, Request
    from fastapi.exceptions import RequestValidationError
    from fastapi.responses import JSONResponse
    from sse_starlette.sse import EventSourceResponse
    from starlette.exceptions import HTTPException

    app = FastAPI(title="dspx serve-llm", docs_url=None, redoc_url=None)

    @app.exception_handler(APIError)
    async def api_error(_req, e: APIError):
        return JSONResponse(e.body(), status_code=e.status)

    @app.exception_handler(HTTPException)
    async def http_error(_req, e: HTTPException):
        code = {404: "not_found", 405: "method_not_allowed"}.get(e.status_code)
        return JSONResponse(APIError(e.status_code, str(e.detail), code=code).body(), status_code=e.status_code)

    @app.exception_handler(RequestValidationError)
    async def validation_error(_req, e: RequestValidationError):
        return JSONResponse(APIError(400, f"invalid request: {e.errors()}").body(), status_code=400)

    @app.middleware("http")
    async def check_key(request: Request, call_next):
        if api_key is not None and request.url.path.startswith("/v1/"):
            if request.headers.get("authorization", "") != f"Bearer {api_key}":
                e = APIError(401, "Incorrect API key provided: send 'Authorization: Bearer <key>' with the key "
                                  "serve-llm was started with", code="invalid_api_key")
                return JSONResponse(e.body(), status_code=401)
        return await call_next(request)

    async def json_body(request: Request) -> dict:
        try:
            body = json.loads(await request.body())
        except ValueError as e:
            raise APIError(400, f"the request body is not JSON: {e}") from None
        if not isinstance(body, dict):
            raise APIError(400, "the request body must be a JSON object")
        return body

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": service.model, "object": "model", "created": service.created,
                                            "owned_by": "dspx"}]}

    @app.get("/health")
    async def health():
        return {"status": "ok", "waiting": service.waiting}

    async def complete(request: Request, chat: bool):
        body = await json_body(request)
        if chat:
            prompt = _messages(body)
        else:
            prompt = body.get("prompt")
            if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
                prompt = prompt[0]
            if not isinstance(prompt, str) or not prompt:
                raise APIError(400, "'prompt' must be a non-empty string", param="prompt")
        params = sampling_params(body)
        ids = service.encode(prompt, chat)
        stream = bool(body.get("stream", False))
        opts = body.get("stream_options") or {}
        include_usage = bool(opts.get("include_usage")) if isinstance(opts, dict) else False
        rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]
        obj = "chat.completion" if chat else "text_completion"
        created = int(time.time())
        base = {"id": rid, "created": created, "model": body.get("model") or service.model}
        loop = asyncio.get_running_loop()

        if not stream:
            fut = service.submit(service.run, ids, params)
            try:
                res = await asyncio.wrap_future(fut)
            except ContextFullError as e:
                raise APIError(400, str(e), code="context_length_exceeded") from None
            choice = ({"index": 0, "message": {"role": "assistant", "content": res.text},
                       "logprobs": None, "finish_reason": FINISH[res.finish_reason]} if chat else
                      {"index": 0, "text": res.text, "logprobs": None, "finish_reason": FINISH[res.finish_reason]})
            return {**base, "object": obj, "choices": [choice], "usage": _usage(res)}

        queue: asyncio.Queue = asyncio.Queue()
        cancelled = threading.Event()

        def on_piece(piece: str) -> None:
            loop.call_soon_threadsafe(queue.put_nowait, ("piece", piece))

        fut = service.submit(service.run, ids, params, on_piece, cancelled.is_set)
        fut.add_done_callback(lambda f: loop.call_soon_threadsafe(queue.put_nowait, ("done", f)))
        cobj = "chat.completion.chunk" if chat else "text_completion"

        def chunk(delta: Any, finish=None, **extra) -> str:
            c = ({"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish} if chat else
                 {"index": 0, "text": delta, "logprobs": None, "finish_reason": finish})
            return json.dumps({**base, "object": cobj, "choices": [c], **extra})

        async def events():
            try:
                if chat:
                    yield {"data": chunk({"role": "assistant", "content": ""})}
                while True:
                    kind, val = await queue.get()
                    if kind == "piece":
                        yield {"data": chunk({"content": val} if chat else val)}
                        continue
                    try:
                        res = val.result()
                    except APIError as e:
                        yield {"data": json.dumps(e.body())}
                        break
                    except Exception as e:  # noqa: BLE001 - the stream has begun: report in-band
                        yield {"data": json.dumps(APIError(500, f"{type(e).__name__}: {e}", "server_error").body())}
                        break
                    yield {"data": chunk({} if chat else "", FINISH[res.finish_reason])}
                    if include_usage:
                        yield {"data": json.dumps({**base, "object": cobj, "choices": [], "usage": _usage(res)})}
                    break
                yield {"data": "[DONE]"}
            finally:
                cancelled.set()  # a client gone mid-answer stops it at the next token

        return EventSourceResponse(events(), ping=15)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await complete(request, True)

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await complete(request, False)

    return app


def serve_llm(host: str = "127.0.0.1", port: int = 8080, api_key: str | None = None, *, model_dir=None, gguf=None,
              socket: str | None = None, context: int = 256, kv_dtype: str = "float32", max_queue: int = 16,
              log_level: str = "info") -> None:
    """Load the model on the device and serve until interrupted."""
    import uvicorn

    gen = Generator(model_dir=model_dir, gguf=gguf, socket=socket, progress=True, context=context, kv_dtype=kv_dtype)
    gen.llm  # compile (first time) and load before accepting requests
    svc = LLMService(gen, max_queue=max_queue)
    try:
        uvicorn.run(create_app(svc, api_key), host=host, port=port, log_level=log_level)
    finally:
        svc.close()
        gen.close()


def _command():
    import click

    @click.command("serve-llm")
    @click.option("--host", default="127.0.0.1", show_default=True,
                  help="address to bind (localhost only by default; use --api-key before opening it wider)")
    @click.option("--port", default=8080, show_default=True, type=click.IntRange(0, 65535))
    @click.option("--api-key", default=None, envvar="DSPX_API_KEY",
                  help="require 'Authorization: Bearer KEY' (default: $DSPX_API_KEY, else none)")
    @click.option("--model", "model_dir", default=None, type=click.Path(file_okay=False),
                  help="directory from `dspx compile-llm` (default: compile the GGUF into .cache/dspx/llm once)")
    @click.option("--gguf", default=None, type=click.Path(dir_okay=False))
    @click.option("--context", default=None, type=click.IntRange(min=1),
                  help="context to compile for when --model is not given (default: the most that fits: 256 float32, 512 float16, 1024 int8)")
    @click.option("--kv-dtype", default="float32", show_default=True, type=click.Choice(["float32", "float16", "int8"]))
    @click.option("--max-queue", default=16, show_default=True, type=click.IntRange(min=0),
                  help="requests that may wait for the device; more get 503")
    @click.option("--socket", default=None, envvar="DSPX_SOCKET")
    def serve_llm_cmd(host, port, api_key, model_dir, gguf, context, kv_dtype, max_queue, socket):
        """OpenAI-compatible HTTP API (/v1/models, /v1/chat/completions, /v1/completions) for the device LLM."""
        import ipaddress
        import logging

        from ..errors import DspxError

        for mod in ("fastapi", "uvicorn", "sse_starlette"):
            try:
                __import__(mod)
            except ImportError:
                raise DspxError(f"dspx serve-llm needs the 'serve' extra ({mod} is not installed): "
                                f"pip install 'dspx[serve,llm]'") from None
        try:
            loopback = host == "localhost" or ipaddress.ip_address(host).is_loopback
        except ValueError:
            loopback = False
        if not loopback and api_key is None:
            logging.getLogger("dspx").warning("serve-llm listens on %s without --api-key: anyone who can reach "
                                              "it can use the device", host)
        if context is None:
            from ..abi.llmpack import DEFAULT_CONTEXT
            context = DEFAULT_CONTEXT[kv_dtype]
        click.echo(f"serving the device LLM on http://{host}:{port}/v1 (OpenAI API"
                   f"{', API key required' if api_key else ''}); Ctrl-C stops", err=True)
        serve_llm(host, port, api_key, model_dir=model_dir, gguf=gguf, socket=socket, context=context,
                  kv_dtype=kv_dtype, max_queue=max_queue, log_level="warning")

    return serve_llm_cmd


command = _command()
