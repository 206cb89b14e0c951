"""``dspx serve-models``: compiled modules over HTTP, in the KServe v2
inference protocol (Triton's HTTP API), so ``tritonclient.http`` and any
KServe v2 client talk to the device unchanged (docs/serve-models.md).

Endpoints: ``/v2/health/live``, ``/v2/health/ready``, ``/v2`` (server
metadata), ``/v2/models/NAME[/versions/1]`` (model metadata), ``.../ready``,
``.../config`` (Triton's model configuration, the subset a module has) and
``POST .../infer`` with JSON tensors and the binary tensor data extension
(``Inference-Header-Content-Length``; inputs with
``parameters.binary_data_size``; outputs as binary when the request's
``parameters.binary_data_output`` or an output's ``parameters.binary_data``
asks).  Errors are KServe's ``{"error": "..."}``: 404 for an unknown model or
version, 400 for a request that does not match the model (naming what it
expects and what it got), 413 for a body over ``max_body``, 503 while the
models load.

Each model is a module directory (or ``.so``) with its ``metadata.json``; its
name is the directory's name (a ``.so``: the file's stem), or ``NAME=PATH``.
A directory that is not a module but holds module directories is a model
repository (Triton's ``--model-repository``): each of them is served.  Every
model has one device connection of its own (a ``VirtualMachine``) and a
lock: requests to one model run one at a time (its outputs live in that
connection's output buffer until copied out), requests to different models
overlap on the host.
"""

# (no `from __future__ import annotations`: FastAPI resolves the handlers' Request annotation at
# definition time, and fastapi is imported inside create_app so the CLI loads without the extra)
import json
import socket as _socket
import threading
import zlib
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from ..errors import DspxError, InputError
from . import inputs as _inputs

__all__ = ["KServeError", "ModelSource", "ModelServer", "ServedModel", "create_app", "find_models", "listen",
           "serve_models", "DATATYPES"]

# numpy dtype name -> KServe v2 datatype (the tensor types a compiled module can declare)
DATATYPES = {"bool": "BOOL", "uint8": "UINT8", "uint16": "UINT16", "uint32": "UINT32", "uint64": "UINT64",
             "int8": "INT8", "int16": "INT16", "int32": "INT32", "int64": "INT64", "float16": "FP16",
             "float32": "FP32", "float64": "FP64", "bfloat16": "BF16"}
VERSION = "1"  # a module has one version
PLATFORM = "dspx_module"
MAX_BODY = 64 << 20  # a 1x3x224x224 FP32 input is 0.6 MB binary, ~3 MB as JSON text


class KServeError(DspxError):
    """An error answered in KServe's shape, ``{"error": message}``, with an HTTP status."""

    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status


def _shape(shape) -> str:
    return f"[{', '.join(map(str, shape))}]"


# ---------------------------------------------------------------- the models, found before anything binds

@dataclass(frozen=True)
class ModelSource:
    name: str
    path: Path          # what was given (a directory or a .so)
    meta: dict = field(repr=False)


def _is_module_dir(p: Path) -> bool:
    return (p / "model.so").is_file() or (p / "metadata.json").is_file()


def _source(name: str, path: Path) -> ModelSource:
    from .vm import find_module

    if path.is_file() and path.suffix == ".onnx":
        raise DspxError(f"{path}: an ONNX model, not a compiled module; compile it first: "
                        f"dspx compile {path} -o build/{path.stem}")
    if path.is_file():
        with open(path, "rb") as f:
            if f.read(4) != b"\x7fELF":
                raise DspxError(f"{path}: not a compiled module (a module is a directory from `dspx compile`, "
                                f"or its model.so)")
    so, meta = find_module(path)
    if "modules" in meta:
        raise DspxError(f"{path}: an LLM package (several modules); serve it with `dspx serve-llm --model {path}`")
    if not meta.get("inputs") and not meta.get("outputs"):
        raise DspxError(f"{path}: no metadata.json next to {so.name} (its inputs and outputs are what the "
                        f"protocol's metadata and checks need; `dspx compile` writes it)")
    for t in meta.get("inputs", []) + meta.get("outputs", []):
        if np.dtype(t["dtype"]).name not in DATATYPES:
            raise DspxError(f"{path}: tensor {t['name']!r} is {t['dtype']}, which KServe v2 has no datatype for")
    return ModelSource(name, path, meta)


def find_models(given) -> list:
    """The ModelSources of ``PATH`` / ``NAME=PATH`` arguments, every path checked; one error line
    for the first that is not a servable module, or for two models of one name."""
    found = []
    for arg in given:
        name, sep, rest = str(arg).partition("=")
        named = bool(sep and name and rest and "/" not in name and not Path(arg).exists())
        path, name = (Path(rest), name) if named else (Path(arg), None)
        if not path.exists():
            raise DspxError(f"{path}: no such file or directory")
        if path.is_dir() and not _is_module_dir(path):
            subs = sorted(p for p in path.iterdir() if p.is_dir() and _is_module_dir(p))
            if not subs:
                raise DspxError(f"{path}: neither a compiled module (model.so + metadata.json) nor a directory "
                                f"of them")
            if name:
                raise DspxError(f"{arg}: NAME=PATH names one module; {path} is a directory of {len(subs)}")
            found += [_source(p.name, p) for p in subs]
            continue
        found.append(_source(name or (path.name if path.is_dir() else path.stem), path))
    seen = {}
    for s in found:
        if s.name in seen:
            raise DspxError(f"two models are named {s.name!r} ({seen[s.name]} and {s.path}); name one with "
                            f"NAME=PATH")
        seen[s.name] = s.path
    if not found:
        raise DspxError("no models given")
    return found


# ---------------------------------------------------------------- one model: requests in, outputs out

def _tensor_meta(spec) -> dict:
    return {"name": spec.name, "datatype": DATATYPES[spec.dtype], "shape": list(spec.shape)}


def _decompress(body: bytes, encoding: str | None, max_body: int) -> bytes:
    if not encoding or encoding == "identity":
        return body
    if encoding not in ("gzip", "deflate"):
        raise KServeError(400, f"Content-Encoding {encoding!r} is not supported (gzip, deflate or none)")
    try:
        d = zlib.decompressobj(31 if encoding == "gzip" else 15)
        out = d.decompress(body, max_body + 1)
    except zlib.error as e:
        raise KServeError(400, f"the {encoding} body does not decompress: {e}") from None
    if len(out) > max_body:
        raise KServeError(413, f"the request body decompresses to more than {max_body} bytes (--max-body)")
    return out


def parse_request(body: bytes, header_length: str | None) -> tuple:
    """(the JSON request, the binary data after it) of an infer body."""
    if header_length is None:
        head, binary = body, b""
    else:
        if not header_length.isdigit() or int(header_length) > len(body):
            raise KServeError(400, f"Inference-Header-Content-Length is {header_length!r}; the body is "
                                   f"{len(body)} bytes")
        n = int(header_length)
        head, binary = body[:n], body[n:]
    try:
        req = json.loads(head)
    except (ValueError, RecursionError) as e:
        raise KServeError(400, f"the inference request is not JSON: {e}") from None
    if not isinstance(req, dict):
        raise KServeError(400, "the inference request must be a JSON object")
    return req, memoryview(binary)


def _parameters(obj: dict, where: str) -> dict:
    p = obj.get("parameters", {})
    if not isinstance(p, dict):
        raise KServeError(400, f"{where}: 'parameters' must be an object")
    return p


def _flag(params: dict, key: str, where: str, default: bool = False) -> bool:
    v = params.get(key, default)
    if not isinstance(v, bool):
        raise KServeError(400, f"{where}: parameters.{key} must be true or false, got {v!r}")
    return v


@dataclass
class ServedModel:
    source: ModelSource
    inputs: list = field(init=False)
    outputs: list = field(init=False)
    vm: object = None  # the VirtualMachine, once loaded
    lock: threading.Lock = field(default_factory=threading.Lock)

    def __post_init__(self):
        self.inputs = _inputs.specs(self.source.meta)
        self.outputs = _inputs.specs(self.source.meta, "outputs")

    @property
    def name(self) -> str:
        return self.source.name

    def metadata(self) -> dict:
        return {"name": self.name, "versions": [VERSION], "platform": PLATFORM,
                "inputs": [_tensor_meta(s) for s in self.inputs], "outputs": [_tensor_meta(s) for s in self.outputs]}

    def config(self) -> dict:
        """Triton's model configuration, as far as a module has one (no batching: shapes are fixed)."""
        def tensors(specs):
            return [{"name": s.name, "data_type": f"TYPE_{DATATYPES[s.dtype]}",
                     "dims": list(s.shape)} for s in specs]
        return {"name": self.name, "platform": PLATFORM, "backend": "dspx", "max_batch_size": 0,
                "input": tensors(self.inputs), "output": tensors(self.outputs)}

    def _input(self, spec, tensor: dict, binary: memoryview, offset: int) -> tuple:
        """(the array of one request input, the offset past its binary data)."""
        where = f"input {spec.name!r} of model {self.name!r}"
        want = DATATYPES[spec.dtype]
        if tensor.get("datatype") != want:
            raise KServeError(400, f"{where} is {want}; got datatype {tensor.get('datatype')!r}")
        shape = tensor.get("shape")
        if not (isinstance(shape, list) and all(isinstance(d, int) and not isinstance(d, bool) for d in shape)):
            raise KServeError(400, f"{where}: 'shape' must be a list of integers, got {shape!r}")
        if tuple(shape) != spec.shape:
            raise KServeError(400, f"{where} has shape {_shape(spec.shape)}; got {_shape(shape)}")
        nbytes = int(np.prod(spec.shape, dtype=np.int64)) * np.dtype(spec.dtype).itemsize
        size = _parameters(tensor, where).get("binary_data_size")
        if size is not None:
            if size != nbytes:
                raise KServeError(400, f"{where}: binary_data_size is {size} bytes; {want}{_shape(spec.shape)} "
                                       f"is {nbytes}")
            if offset + size > len(binary):
                raise KServeError(400, f"{where}: binary_data_size {size} at offset {offset}, but the body has "
                                       f"{len(binary)} bytes of binary data")
            raw = binary[offset:offset + size]
            return np.frombuffer(raw, dtype=spec.dtype).reshape(spec.shape), offset + size
        if "data" not in tensor:
            raise KServeError(400, f"{where}: no 'data' and no parameters.binary_data_size")
        try:
            a = _inputs.to_array(tensor["data"], spec)
        except InputError as e:
            raise KServeError(400, f"model {self.name!r}: {e}") from None
        if a.size != nbytes // np.dtype(spec.dtype).itemsize:
            raise KServeError(400, f"{where}: shape {_shape(spec.shape)} holds {nbytes // a.itemsize} values; "
                                   f"'data' has {a.size}")
        return a.reshape(spec.shape), offset

    def arrays(self, req: dict, binary: memoryview) -> list:
        """The request's inputs in the module's order, each checked against what it declares."""
        tensors = req.get("inputs")
        if not isinstance(tensors, list) or not all(isinstance(t, dict) for t in tensors):
            raise KServeError(400, "'inputs' must be a list of tensor objects")
        names = ", ".join(s.name for s in self.inputs)
        by_name = {}
        for t in tensors:
            n = t.get("name")
            if n not in {s.name for s in self.inputs}:
                raise KServeError(400, f"model {self.name!r} has no input {n!r} (inputs: {names})")
            if n in by_name:
                raise KServeError(400, f"input {n!r} given twice")
            by_name[n] = t
        missing = [s.name for s in self.inputs if s.name not in by_name]
        if missing:
            raise KServeError(400, f"model {self.name!r} takes {len(self.inputs)} inputs ({names}); missing "
                                   f"{', '.join(map(repr, missing))}")
        # binary data follows the JSON in the order the inputs are listed in the request
        order = {t["name"]: i for i, t in enumerate(tensors)}
        offset, out = 0, {}
        for spec in sorted(self.inputs, key=lambda s: order[s.name]):
            out[spec.name], offset = self._input(spec, by_name[spec.name], binary, offset)
        if offset != len(binary):
            raise KServeError(400, f"the body has {len(binary)} bytes of binary data; the inputs' "
                                   f"binary_data_size add up to {offset}")
        return [out[s.name] for s in self.inputs]

    def _wanted(self, req: dict) -> list:
        """[(output index, as binary)] the request asks for, in its order (all outputs by default)."""
        binary = _flag(_parameters(req, "the request"), "binary_data_output", "the request")
        if _parameters(req, "the request").get("classification") is not None:
            raise KServeError(400, "the classification extension is not supported")
        asked = req.get("outputs")
        if asked is None:
            return [(i, binary) for i in range(len(self.outputs))]
        if not isinstance(asked, list) or not all(isinstance(o, dict) for o in asked):
            raise KServeError(400, "'outputs' must be a list of objects")
        index = {s.name: i for i, s in enumerate(self.outputs)}
        wanted = []
        for o in asked:
            if o.get("name") not in index:
                raise KServeError(400, f"model {self.name!r} has no output {o.get('name')!r} (outputs: "
                                       f"{', '.join(index)})")
            where = f"output {o['name']!r}"
            p = _parameters(o, where)
            if p.get("classification") is not None:
                raise KServeError(400, "the classification extension is not supported")
            wanted.append((index[o["name"]], _flag(p, "binary_data", where, binary)))
        return wanted

    def infer(self, req: dict, binary: memoryview) -> tuple:
        """(the JSON response, the binary blobs after it) of one request."""
        arrays = self.arrays(req, binary)
        wanted = self._wanted(req)
        vm = self.vm
        with self.lock:  # the connection's output buffer holds the outputs until the next call
            outs = vm[vm.entry](*arrays)  # (copies out)
        outs = outs if isinstance(outs, list) else [outs]
        tensors, blobs = [], []
        for i, as_binary in wanted:
            a = np.ascontiguousarray(outs[i])
            t = _tensor_meta(self.outputs[i])
            t["shape"] = list(a.shape)
            if as_binary:
                blobs.append(a.tobytes())
                t["parameters"] = {"binary_data_size": a.nbytes}
            else:
                t["data"] = a.ravel().tolist()
            tensors.append(t)
        res = {"model_name": self.name, "model_version": VERSION, "outputs": tensors}
        if "id" in req:
            res["id"] = req["id"]
        return res, blobs


# ---------------------------------------------------------------- all models, on one device

class ModelServer:
    """The models and their device connections: one VirtualMachine each, all on one device."""

    def __init__(self, sources: list):
        self.models = {s.name: ServedModel(s) for s in sources}
        self.loading: str | None = None
        self.ready = False
        self.closed = threading.Event()

    def load(self, socket: str | None = None) -> None:
        """Load every model; the first connection picks the device (``socket``, the default one, or a
        private one it starts), the others join it."""
        from .vm import VirtualMachine

        for m in self.models.values():
            if self.closed.is_set():
                return
            self.loading = m.name
            try:
                m.vm = VirtualMachine(m.source.path, socket=socket)
            except DspxError as e:  # which model, in the one error line (the type and status are kept)
                e.args = (f"model {m.name!r} ({m.source.path}): {e}",)
                raise
            socket = m.vm.client.socket_path
        self.loading, self.ready = None, True

    def model(self, name: str, version: str | None = None) -> ServedModel:
        m = self.models.get(name)
        if m is None:
            raise KServeError(404, f"unknown model {name!r} (models: {', '.join(self.models)})")
        if version not in (None, "", VERSION):
            raise KServeError(404, f"model {name!r} has no version {version!r} (versions: {VERSION})")
        return m

    def loaded(self, name: str, version: str | None = None) -> ServedModel:
        m = self.model(name, version)
        if m.vm is None:
            raise KServeError(503, f"model {name!r} is not ready: the models are loading onto the device")
        return m

    def close(self) -> None:
        """Close every connection, the first (which may own a private device) last."""
        self.closed.set()
        for m in reversed(list(self.models.values())):
            if m.vm is not None:
                with m.lock:
                    m.vm.close()
                    m.vm = None
        self.ready = False


# ---------------------------------------------------------------- HTTP

async def _read_body(request, max_body: int) -> bytes:
    """The body, refused with 413 as soon as it passes max_body."""
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > max_body:
        raise KServeError(413, f"the request body is {declared} bytes; this server takes at most {max_body} "
                               f"(--max-body)")
    buf = bytearray()
    async for chunk in request.stream():
        buf += chunk
        if len(buf) > max_body:
            raise KServeError(413, f"the request body is over {max_body} bytes (--max-body)")
    return bytes(buf)


def create_app(server: ModelServer, max_body: int = MAX_BODY):
    from fastapi import FastAPI, Request
    from fastapi.concurrency import run_in_threadpool
    from fastapi.responses import JSONResponse, Response
    from starlette.exceptions import HTTPException

    from .. import __version__

    app = FastAPI(title="dspx serve-models", docs_url=None, redoc_url=None, openapi_url=None)

    @app.exception_handler(KServeError)
    async def kserve_error(_req, e: KServeError):
        return JSONResponse({"error": str(e)}, status_code=e.status)

    @app.exception_handler(HTTPException)
    async def http_error(req, e: HTTPException):
        text = f"no endpoint {req.method} {req.url.path}" if e.status_code in (404, 405) else str(e.detail)
        return JSONResponse({"error": text}, status_code=e.status_code)

    @app.exception_handler(Exception)
    async def server_error(_req, e: Exception):  # still KServe's shape, never a plain-text 500
        return JSONResponse({"error": f"{type(e).__name__}: {e}"}, status_code=500)

    @app.get("/v2/health/live")
    async def live():
        return Response(status_code=200)

    @app.get("/v2/health/ready")
    async def ready():
        if not server.ready:
            return JSONResponse({"error": f"loading {server.loading or 'the models'} onto the device"},
                                status_code=503)
        return Response(status_code=200)

    @app.get("/v2")
    async def server_metadata():
        return {"name": "dspx", "version": __version__, "extensions": ["binary_tensor_data"]}

    @app.get("/v2/models/{name}")
    @app.get("/v2/models/{name}/versions/{version}")
    async def model_metadata(name: str, version: str | None = None):
        return server.model(name, version).metadata()

    @app.get("/v2/models/{name}/config")
    @app.get("/v2/models/{name}/versions/{version}/config")
    async def model_config(name: str, version: str | None = None):
        return server.model(name, version).config()

    @app.get("/v2/models/{name}/ready")
    @app.get("/v2/models/{name}/versions/{version}/ready")
    async def model_ready(name: str, version: str | None = None):
        server.loaded(name, version)
        return Response(status_code=200)

    @app.post("/v2/models/{name}/infer")
    @app.post("/v2/models/{name}/versions/{version}/infer")
    async def infer(name: str, request: Request, version: str | None = None):
        model = server.loaded(name, version)
        body = await _read_body(request, max_body)

        def work():  # JSON parsing, the device call and encoding: off the event loop
            raw = _decompress(body, request.headers.get("content-encoding"), max_body)
            req, binary = parse_request(raw, request.headers.get("inference-header-content-length"))
            return model.infer(req, binary)
        res, blobs = await run_in_threadpool(work)
        if not blobs:
            return JSONResponse(res)
        head = json.dumps(res).encode()
        return Response(b"".join([head, *blobs]), media_type="application/octet-stream",
                        headers={"Inference-Header-Content-Length": str(len(head))})

    return app


def listen(host: str, port: int) -> _socket.socket:
    """A listening socket on host:port, or one clear error (a port in use, an unknown host)."""
    try:
        family, kind, proto, _, addr = _socket.getaddrinfo(host, port, type=_socket.SOCK_STREAM,
                                                           flags=_socket.AI_PASSIVE)[0]
    except _socket.gaierror as e:
        raise DspxError(f"cannot listen on {host}:{port}: {e.strerror}") from None
    sock = _socket.socket(family, kind, proto)
    try:
        sock.setsockopt(_socket.SOL_SOCKET, _socket.SO_REUSEADDR, 1)  # uvicorn's own choice: restarts rebind
        sock.bind(addr)
        sock.listen(128)
    except OSError as e:
        sock.close()
        why = "the port is in use (another server?); pick another with --port" if e.errno == 98 else e.strerror
        raise DspxError(f"cannot listen on {host}:{port}: {why}") from None
    sock.set_inheritable(True)
    return sock


def serve_models(sources: list, sock: _socket.socket, *, socket: str | None = None, max_body: int = MAX_BODY,
                 on_ready=None, log_level: str = "warning") -> None:
    """Serve ``sources`` on the listening ``sock`` until interrupted.  The models load onto the
    device while the server already answers (``/v2/health/ready`` 503 until they are in); then
    ``on_ready(host, port)`` is called.  A model that fails to load stops the server with its error."""
    import uvicorn

    server = ModelServer(sources)
    config = uvicorn.Config(create_app(server, max_body), log_level=log_level, ws="none", lifespan="off",
                            timeout_keep_alive=5)
    http = uvicorn.Server(config)
    failed: list = []

    def load():
        try:
            server.load(socket)
        except BaseException as e:  # noqa: BLE001 - reported by the main thread, which ends the server
            failed.append(e)
            http.should_exit = True
            return
        for _ in range(600):  # uvicorn starts serving its socket within moments of run()
            if http.started or http.should_exit:
                break
            server.closed.wait(0.1)
        if on_ready is not None and http.started and not server.closed.is_set():
            host, port = sock.getsockname()[:2]
            on_ready(host, port)

    loader = threading.Thread(target=load, name="dspx-serve-models-load", daemon=True)
    loader.start()
    try:
        http.run(sockets=[sock])
    finally:
        server.closed.set()
        loader.join(120)  # a load under way finishes (its connection is then closed below)
        server.close()
        sock.close()
    if failed:
        raise failed[0]
