"""``dspx farm serve-llm``: the OpenAI-compatible server of ``dspx serve-llm``
(``dspx.host.serve_llm``) on Ray Serve, one farm device per replica.

One Serve application, ``dspx-llm``:

- **Replicas**: N deployments ``replica-0 … replica-N-1`` of one replica
  each.  A replica leases a device of the farm on its own Ray node
  (``dspx.farm.lease``, so the device's socket is local), loads the model on
  it and holds serve-llm's own ``LLMService`` and ASGI app
  (``create_app``): every request it is handed runs through that app in the
  replica's process, so answers, errors, streaming and llama-server's
  endpoints are serve-llm's.  Each answer carries ``x-dspx-replica`` (its
  index) and ``x-dspx-device``.
- **Ingress**: one FastAPI deployment behind Serve's HTTP proxy (bound to
  127.0.0.1 unless told otherwise).  It checks the API key, reads the body
  (at most ``max_body``), picks a replica and streams the replica's answer
  back through a ``DeploymentHandle``.

Routing (``Balancer``): a request's conversation key is the
``x-dspx-conversation`` header, else the body's ``user``, else the
conversation's leading messages (every message up to the first user one),
else a completion prompt's first ``PREFIX_CHARS`` characters.  The key's
hash names the conversation's *home* replica, so its next turn finds its
KV prefix there.  A request goes to its home when the home has a free KV
slot, else to the least loaded replica with one (a busy home's KV is being
overwritten anyway), else it waits on one (home first) with fewer than
``max_queue`` waiting; when every replica is full it gets 503 in OpenAI's
shape, ``code: server_busy``, at once.

Why N one-replica deployments rather than one deployment of N replicas with
a Ray request router: Ray 2.60's routers (``ray.serve.request_router``, and
``ray.serve.experimental.consistent_hash_router`` keyed by ``x-session-id``)
are alpha / experimental, name no replica by index, and shed load only
through ``max_queued_requests``, counted per router, where 0 refuses every
request and simultaneous arrivals can be refused while a replica is free
(Ray's own comment in ``router.py``).  The ingress counts what it sends (it
is the only sender: one ingress replica), so its answer is exact.
"""
# (no `from __future__ import annotations`: FastAPI resolves the ingress handlers' Request annotation at
# definition time, and fastapi is imported inside _ingress_app, as serve_llm does)
import asyncio
import hashlib
import json
import logging
import os
import socket
import time
import weakref
from collections.abc import Mapping
from dataclasses import dataclass, field

import ray
from ray import serve

from ..host.serve_llm import APIError, Limits, check_api_key

log = logging.getLogger("dspx.farm.serve")

APP_NAME = "dspx-llm"
CONVERSATION_HEADER = "x-dspx-conversation"
REPLICA_HEADER = "x-dspx-replica"
DEVICE_HEADER = "x-dspx-device"
PREFIX_CHARS = 256       # of a completion prompt: its conversation key (a growing prompt keeps its start)
# Requests that hold a device (an LLMService job); the others (tokenize, props, slots ...) only read state.
GENERATION_PATHS = frozenset({"/v1/chat/completions", "/v1/completions", "/v1/embeddings", "/embeddings"})
SIDE_REQUESTS = 16       # per replica, beyond its jobs: Serve's max_ongoing_requests must leave room for them
INGRESS_REQUESTS = 256   # HTTP requests the ingress handles at once; Serve's proxy queues at most as many more
HOP_BY_HOP = frozenset({b"connection", b"keep-alive", b"transfer-encoding", b"upgrade"})
# Seconds for a replica to start an answer: one request's prefill (or a whole non-streamed answer) behind
# at most max_queue others on a loaded machine; past it, 503 replica_unavailable.
ANSWER_START_TIMEOUT = 300.0
PLAN_TIMEOUT = 30.0      # seconds for the devices to say where they are
NODE_LABEL = "ray.io/node-id"  # the label Ray gives every node: its id (a replica's label_selector)
INFO_TIMEOUT = 30.0      # seconds for every replica's info() (/dspx/replicas)
DOWN_SECONDS = 30.0      # a replica that did not answer is tried last for this long (Serve restarts it)


@dataclass(frozen=True)
class Settings:
    """What every deployment of the application is built from."""

    model_dir: str                   # a compiled LLM package, readable where the replicas run
    replicas: int = 2
    key: str = "sim"                 # the devices' key (dspx:<key>)
    parallel: int = 1                # KV slots per replica
    max_queue: int = 4               # requests that may wait per replica; more get 503
    api_key: str | None = None
    limits: Limits = field(default_factory=Limits)
    lease_timeout: float = 60.0      # seconds a replica waits for a free device
    # decode GEMVs "serial" | "parallel" | "auto" (DeviceLLM's decode_threads; None: $DSPX_LLM_DECODE where the
    # replica runs, else auto).  Auto times both on each replica's device, so replicas may differ in the order
    # they sum, and a long greedy answer with them.
    decode_threads: str | None = None
    model_name: str = "smollm2-135m-instruct"

    def __post_init__(self):
        if self.replicas < 1 or self.parallel < 1 or self.max_queue < 0:
            raise ValueError(f"replicas and parallel must be at least 1 and max_queue at least 0 (got "
                             f"{self.replicas}, {self.parallel}, {self.max_queue})")


# ---------------------------------------------------------------- routing

def _text(content) -> str:
    if isinstance(content, list):  # content parts: their text, as serve-llm reads them
        return "".join(p.get("text", "") for p in content if isinstance(p, dict) and p.get("type") == "text")
    return content if isinstance(content, str) else ""


def conversation_key(headers: Mapping[str, str], body) -> str | None:
    """The key that keeps a conversation on one replica, or None (no
    conversation: any replica will do)."""
    explicit = headers.get(CONVERSATION_HEADER, "")
    if explicit:
        return "header:" + explicit
    if not isinstance(body, dict):
        return None
    user = body.get("user")
    if isinstance(user, str) and user:
        return "user:" + user
    messages = body.get("messages")
    if isinstance(messages, list) and messages:
        # The turns a follow-up resends unchanged: the system prompt(s) and the first user message.
        lead = []
        for m in messages:
            if not isinstance(m, dict):
                return None  # the replica answers the 400
            lead.append([m.get("role"), _text(m.get("content"))])
            if m.get("role") == "user":
                break
        return "messages:" + json.dumps(lead, ensure_ascii=False)
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1:
        prompt = prompt[0]
    if isinstance(prompt, str) and prompt:
        return "prompt:" + prompt[:PREFIX_CHARS]
    return None


def home(key: str, replicas: int) -> int:
    """The replica a conversation key belongs to (sha256: the same in every process and run)."""
    return int.from_bytes(hashlib.sha256(key.encode()).digest()[:8], "big") % replicas


class Balancer:
    """Requests in flight per replica, counted by the one ingress replica
    (which sends every request, so the counts are exact)."""

    def __init__(self, replicas: int, parallel: int, max_queue: int, clock=time.monotonic):
        self.replicas, self.parallel, self.capacity = replicas, parallel, parallel + max_queue
        self.load = [0] * replicas
        self.down_until = [0.0] * replicas
        self.clock = clock

    def order(self, key: str | None) -> list[int]:
        """The replicas in the order a request tries them: its home first,
        then the least loaded (ties: the next ones after home)."""
        start = 0 if key is None else home(key, self.replicas)
        rest = sorted(range(self.replicas), key=lambda i: (self.load[i], (i - start) % self.replicas))
        return rest if key is None else [start] + [i for i in rest if i != start]

    def unavailable(self, i: int, seconds: float = DOWN_SECONDS) -> None:
        """Replica ``i`` did not answer: try it after the others for a while
        (idle as a dead replica looks, it would otherwise take every request)."""
        self.down_until[i] = self.clock() + seconds

    def pick(self, key: str | None, generation: bool) -> int | None:
        """The replica for a request, counted until ``done``; None: every
        replica is full (answer 503).  A request that holds no device goes
        to its home, uncounted."""
        order = self.order(key)
        now = self.clock()
        up = [i for i in order if self.down_until[i] <= now]
        down = [i for i in order if self.down_until[i] > now]
        if not generation:
            return (up or down)[0]
        for group in (up, down):
            for limit in (self.parallel, self.capacity):  # a free KV slot anywhere beats waiting at home
                for i in group:
                    if self.load[i] < limit:
                        self.load[i] += 1
                        return i
        return None

    def answered(self, i: int) -> None:
        self.down_until[i] = 0.0

    def done(self, i: int) -> None:
        self.load[i] -= 1

    def busy_error(self) -> APIError:
        return APIError(503, f"server busy: every replica ({self.replicas}) is answering {self.parallel} "
                             f"request(s) with {self.capacity - self.parallel} waiting (--max-queue); retry later",
                        "server_error", code="server_busy")


def replica_nodes(device_nodes: Mapping[str, str], held: set, replicas: int) -> list[str]:
    """The Ray node of each replica, given each device's node and the
    devices leased now: never more replicas on a node than it has devices,
    free devices first, spread over the nodes (one per node in turn)."""
    from .cluster import FarmError

    if replicas > len(device_nodes):
        raise FarmError(f"{replicas} replica(s) need as many devices; the key has {len(device_nodes)}")
    per_node: dict[str, list[bool]] = {}
    for device in sorted(device_nodes):
        per_node.setdefault(device_nodes[device], []).append(device not in held)
    order: list[str] = []
    for want_free in (True, False):
        left = {n: sum(1 for f in flags if f == want_free) for n, flags in per_node.items()}
        while any(left.values()):
            for n in sorted(left, key=lambda n: (-left[n], n)):
                if left[n]:
                    order.append(n)
                    left[n] -= 1
    return order[:replicas]


def _plan(key: str) -> tuple[dict, set]:
    """Each device's node, and the devices leased now (``replica_nodes``'s arguments)."""
    from . import actors, status

    handles = actors.find_devices(key)
    where = ray.get([h.endpoint.remote() for h in handles.values()], timeout=PLAN_TIMEOUT)
    held = {h["device"] for h in status()["holders"]}
    return {e["device"]: e["node"] for e in where}, held


# ---------------------------------------------------------------- a replica

@serve.deployment(ray_actor_options={"num_cpus": 0})
class Replica:
    """One device's serve-llm: a leased device, the model on it, and
    serve-llm's app, run in process for each forwarded request."""

    def __init__(self, settings: Settings, index: int):
        from ..host.llm import DeviceLLM, Generator
        from ..host.serve_llm import LLMService, create_app
        from . import acquire  # the farm's lease API (dspx.farm.acquire)

        self.index = index
        self.lease = self.llm = self.service = None
        self._tasks: set = set()
        if not os.path.isdir(settings.model_dir):
            from .cluster import FarmError

            raise FarmError(f"replica {index}: the model package {settings.model_dir} is not on this machine "
                            f"({socket.gethostname()}): it is read at the same path where every replica runs")
        node = ray.get_runtime_context().get_node_id()
        # No run limit: the replica holds its device while it serves, gives it back in __del__, and the broker
        # frees it if the replica dies without that.
        self.lease = acquire(settings.key, timeout=None, queue_timeout=settings.lease_timeout, node=node)
        try:
            self.llm = DeviceLLM(settings.model_dir, client=self.lease.client, progress=False,
                                 decode_threads=settings.decode_threads)
            self.service = LLMService(Generator(self.llm), model_name=settings.model_name,
                                      max_queue=settings.max_queue, parallel=settings.parallel)
        except BaseException:
            self._close()
            raise
        self.app = create_app(self.service, api_key=None, limits=settings.limits)  # the ingress checks the key
        self.tag = [(REPLICA_HEADER.encode(), str(index).encode()),
                    (DEVICE_HEADER.encode(), self.lease.device.encode())]
        log.info("replica %d on %s (node %s)", index, self.lease.device, node[:12])

    def info(self) -> dict:
        """Which device, and what this replica has done (the /metrics
        counters: prompt tokens actually prefilled, a reused KV prefix not)."""
        s, svc = self.service.stats, self.service
        cached = ([r["cached_tokens"] for r in svc.slots.info()] if svc.slots is not None
                  else [len(svc.gen.cached)])
        return {"replica": self.index, "device": self.lease.device, "node": self.lease.node, "lease": self.lease.id,
                "waiting": svc.waiting, "requests": s.requests, "prompt_tokens": s.prompt_tokens,
                "tokens_predicted": s.tokens_predicted, "cached_tokens": cached}

    async def forward(self, method: str, path: str, query: bytes, headers: list, body: bytes, client):
        """Run one HTTP request through serve-llm's app; yields ``("start",
        status, headers)``, then ``("body", bytes)`` pieces as the app sends them."""
        out: asyncio.Queue = asyncio.Queue()
        gone = asyncio.Event()  # set when the answer is over or its reader left: the app sees a disconnect
        delivered = False

        async def receive():
            nonlocal delivered
            if not delivered:
                delivered = True
                return {"type": "http.request", "body": body, "more_body": False}
            await gone.wait()
            return {"type": "http.disconnect"}

        async def send(message):
            await out.put(message)

        scope = {"type": "http", "asgi": {"version": "3.0", "spec_version": "2.3"}, "http_version": "1.1",
                 "method": method, "scheme": "http", "path": path, "raw_path": path.encode(),
                 "query_string": query, "root_path": "", "headers": headers,
                 "client": tuple(client) if client else None, "server": ("127.0.0.1", 0), "state": {}}
        task = asyncio.ensure_future(self.app(scope, receive, send))
        self._tasks.add(task)  # kept until it ends: a client gone mid-answer leaves it to stop at its next token
        task.add_done_callback(self._tasks.discard)
        task.add_done_callback(lambda _: out.put_nowait(None))
        try:
            while True:
                message = await out.get()
                if message is None:  # the app returned without finishing an answer
                    task.result()
                    raise RuntimeError(f"{method} {path}: the app sent no complete answer")
                if message["type"] == "http.response.start":
                    kept = [(k, v) for k, v in message.get("headers", []) if k.lower() not in HOP_BY_HOP]
                    yield ("start", message["status"], kept + self.tag)
                elif message["type"] == "http.response.body":
                    if message.get("body"):
                        yield ("body", message["body"])
                    if not message.get("more_body", False):
                        return
        finally:
            gone.set()

    def _close(self) -> None:
        """Stop answering, unload the model, give the device back (once)."""
        service, llm, self.service, self.llm = self.service, self.llm, None, None
        for part in (service, llm):
            try:
                if part is not None:
                    part.close()
            except Exception as e:  # noqa: BLE001 - the device may be gone; the lease must still go back
                log.warning("replica %d: %s while stopping", self.index, e)
        if self.lease is not None:
            try:
                self.lease.release()
            except Exception as e:  # noqa: BLE001
                log.warning("replica %d: the lease on %s was not released: %s", self.index, self.lease.device, e)
            self.lease = None

    def __del__(self):  # Serve calls it when the replica stops: the device goes back to the farm
        self._close()


# ---------------------------------------------------------------- the ingress

def _json_or_none(raw: bytes):
    from ..host.serve_llm import parse_json

    try:
        return parse_json(raw)
    except APIError:
        return None  # no key from it; the replica answers the 400


@serve.deployment(ray_actor_options={"num_cpus": 0})
@serve.ingress()
class Ingress:
    """The HTTP side: the API key, the body limit, the replica, the answer streamed back."""

    def __init__(self, settings: Settings, *replicas):
        self.settings = settings
        self.replicas = replicas
        self.balancer = Balancer(len(replicas), settings.parallel, settings.max_queue)

    def __serve_build_asgi_app__(self):
        return _ingress_app(self)


def _ingress_app(ing: Ingress):
    from fastapi import FastAPI, Request
    from fastapi.responses import JSONResponse, StreamingResponse

    from ..host.serve_llm import _read_body

    settings, balancer = ing.settings, ing.balancer
    app = FastAPI(title="dspx farm serve-llm", docs_url=None, redoc_url=None, openapi_url=None)

    def error(e: APIError, headers: dict | None = None):
        return JSONResponse(e.body(), status_code=e.status, headers=headers)

    @app.exception_handler(APIError)
    async def api_error(_request, e: APIError):
        return error(e, {"connection": "close"} if e.close else None)

    @app.exception_handler(Exception)
    async def server_error(_request, e: Exception):  # a bug: still OpenAI's shape, as serve-llm's
        return error(APIError(500, f"{type(e).__name__}: {e}", "server_error"))

    @app.get("/health")
    async def health():  # no key, as serve-llm's: the replicas and what each is answering
        return {"status": "ok", "replicas": [{"replica": i, "requests": n, "capacity": balancer.capacity}
                                             for i, n in enumerate(balancer.load)]}

    @app.get("/dspx/replicas")
    async def replicas(request: Request):
        check_api_key(settings.api_key, request.headers.get("authorization", ""))
        try:
            return await asyncio.wait_for(asyncio.gather(*[r.info.remote() for r in ing.replicas]), INFO_TIMEOUT)
        except asyncio.TimeoutError:
            raise APIError(503, f"a replica did not say how it is within {INFO_TIMEOUT:g} s", "server_error",
                           code="replica_unavailable") from None

    @app.api_route("/{path:path}", methods=["GET", "POST", "PUT", "DELETE", "PATCH", "OPTIONS", "HEAD"])
    async def forward(request: Request, path: str):
        check_api_key(settings.api_key, request.headers.get("authorization", ""))
        raw = await _read_body(request, settings.limits)
        body = await asyncio.to_thread(_json_or_none, raw) if raw else None  # off the event loop: up to max_body
        generation = request.method == "POST" and request.url.path in GENERATION_PATHS
        i = balancer.pick(conversation_key(request.headers, body), generation)
        if i is None:
            return error(balancer.busy_error(), {"retry-after": "1"})
        answer = None
        try:
            client = request.client and (request.client.host, request.client.port)
            answer = ing.replicas[i].options(stream=True).forward.remote(
                request.method, request.url.path, request.url.query.encode(), list(request.headers.raw), raw, client)
            # bounded: a replica being restarted by Serve would hold the request in its handle's queue
            _, status, headers = await asyncio.wait_for(answer.__anext__(), ANSWER_START_TIMEOUT)
            balancer.answered(i)
        except BaseException as e:
            if answer is not None:
                answer.cancel()
            if generation:
                balancer.done(i)
            if isinstance(e, (ray.exceptions.RayError, StopAsyncIteration, RuntimeError, asyncio.TimeoutError)):
                log.warning("replica %d: %s", i, e)
                balancer.unavailable(i)
                return error(APIError(503, f"replica {i} is not answering ({type(e).__name__}); retry later",
                                      "server_error", code="replica_unavailable"), {"retry-after": "1"})
            raise

        state = {"ended": False, "finished": False}

        def end():  # once: the request no longer counts on its replica
            if not state["ended"]:
                state["ended"] = True
                if not state["finished"]:
                    answer.cancel()  # the client left: the replica stops at its next token
                if generation:
                    balancer.done(i)

        async def rest():
            try:
                async for _, piece in answer:
                    yield piece
                state["finished"] = True
            finally:
                end()

        response = StreamingResponse(rest(), status_code=status)
        response.raw_headers = headers
        # A client gone before the body is read leaves rest() never started (its finally never runs): the
        # response's end then ends the count, else a replica would look busy for ever.
        weakref.finalize(response, end)
        return response

    return app


# ---------------------------------------------------------------- the application

def application(settings: Settings, nodes: list[str]):
    """The Serve application: ``settings.replicas`` replicas, replica i on
    Ray node ``nodes[i]`` (its lease is for a device there), behind one ingress."""
    jobs = settings.parallel + settings.max_queue
    replicas = [Replica.options(name=f"replica-{i}", num_replicas=1, max_ongoing_requests=jobs + SIDE_REQUESTS,
                                max_constructor_retry_count=1,
                                ray_actor_options={"num_cpus": 0, "label_selector": {NODE_LABEL: nodes[i]}},
                                ).bind(settings, i)
                for i in range(settings.replicas)]
    return Ingress.options(name="ingress", num_replicas=1, max_ongoing_requests=INGRESS_REQUESTS,
                           max_queued_requests=INGRESS_REQUESTS).bind(settings, *replicas)


def start(settings: Settings, host: str = "127.0.0.1", port: int = 8080, timeout: float = 600.0) -> str:
    """Deploy the application on the farm this process is connected to
    (``cluster.connect``) and serve it on http://host:port; returns that URL
    once every replica answers.  Serve's proxy keeps its address until
    ``stop()`` shuts Serve down."""
    import threading

    from .cluster import FarmError

    running = serve.status()
    if APP_NAME in running.applications:
        raise FarmError(f"the farm already serves {APP_NAME} (stop that `dspx farm serve-llm` first)")
    if running.applications:
        # Serve's HTTP address is fixed when it starts, for every application of the cluster.
        raise FarmError(f"Ray Serve on this farm runs other applications ({', '.join(sorted(running.applications))}) "
                        f"on its own HTTP address: stop them first")
    nodes = replica_nodes(*_plan(settings.key), settings.replicas)
    if running.proxies:
        serve.shutdown()  # a Serve left without applications: started again, on this host and port
    serve.start(http_options={"host": host, "port": port}, proxy_location="HeadOnly")
    failed: list[BaseException] = []

    def deploy():
        try:
            serve.run(application(settings, nodes), name=APP_NAME, route_prefix="/")
        except BaseException as e:  # noqa: BLE001 - re-raised below, in the caller's thread
            failed.append(e)

    # serve.run waits for ever for a replica that neither starts nor fails: bounded here.
    t = threading.Thread(target=deploy, name="dspx-serve-deploy", daemon=True)
    t.start()
    t.join(timeout)
    if t.is_alive() or failed:
        why = f"the replicas did not start within {timeout:.0f} s" if t.is_alive() else _last_line(failed[0])
        details = _deployment_errors()
        stop()
        raise FarmError(f"dspx farm serve-llm did not start: {why}" + "".join(f"\n  {d}" for d in details))
    shown = f"[{host}]" if ":" in host else host
    return f"http://{shown}:{port}"


def _last_line(e: BaseException) -> str:
    lines = [ln for ln in str(e).splitlines() if ln.strip()]
    return lines[-1].strip() if lines else type(e).__name__


def _deployment_errors() -> list[str]:
    """Why each deployment that is not healthy is not (a replica's constructor error, as Serve recorded it)."""
    app = serve.status().applications.get(APP_NAME)
    if app is None:
        return []
    return [f"{name}: {_last_line(RuntimeError(d.message)) if d.message else d.status}"
            for name, d in sorted(app.deployments.items()) if d.status != "HEALTHY"]


def stop() -> None:
    """Delete the application (its replicas give their devices back) and,
    when no other application is left, shut Serve down (its proxy frees the port)."""
    status = serve.status()
    if APP_NAME in status.applications:
        serve.delete(APP_NAME)
    if not serve.status().applications:
        serve.shutdown()


def replicas_info(timeout: float = 30.0) -> list[dict]:
    """Each replica's ``info()`` (its device, node and counters), in index order."""
    names = sorted((n for n in serve.status().applications[APP_NAME].deployments if n.startswith("replica-")),
                   key=lambda n: int(n.rpartition("-")[2]))
    return [serve.get_deployment_handle(n, APP_NAME).info.remote().result(timeout_s=timeout) for n in names]
