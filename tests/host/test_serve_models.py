"""dspx serve-models as a user runs it: the command of docs/serve-models.md on a test device,
driven by hand-built HTTP requests (JSON and the binary tensor data extension, bytes written
here) and by Triton's own client (tritonclient.http).  Outputs equal `dspx run`'s and the
VirtualMachine's byte for byte, and onnxruntime's within float tolerance; errors are KServe's
{"error"} with the status and the figures; every example of the doc runs and prints what it
shows; start-up mistakes are one error line before the device is touched."""
from __future__ import annotations

import gzip
import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import numpy as np
import onnxruntime as ort
import pytest

from conftest import Device

pytest.importorskip("fastapi")
httpclient = pytest.importorskip("tritonclient.http")  # the test extra

DOC = Path(__file__).resolve().parents[2] / "docs" / "serve-models.md"
CLI = [sys.executable, "-m", "dspx.cli"]
START_TIMEOUT = 300  # loading ResNet-18 (46 MB) on a loaded machine
X_MODEL = np.arange(64, dtype=np.float32).reshape(2, 32) / 7 - 4  # the input of multi_output ("model")


def _blocks(kind: str) -> list[str]:
    return re.findall(rf"^```{kind}\n(.*?)^```", DOC.read_text(), re.M | re.S)


def _examples(kind: str) -> list[tuple[str, str]]:
    """(code, the text block right after it) for each ```kind block of the doc."""
    return re.findall(rf"^```{kind}\n(.*?)^```\n\n```text\n(.*?)^```", DOC.read_text(), re.M | re.S)


def _wait_for_serving(proc, err_path: Path, timeout: float = START_TIMEOUT) -> str:
    deadline = time.monotonic() + timeout
    while True:
        text = err_path.read_text()
        if "serving" in text:
            return text
        assert proc.poll() is None, f"serve-models exited {proc.returncode}:\n{text}"
        assert time.monotonic() < deadline, f"serve-models did not start within {timeout} s:\n{text}"
        time.sleep(0.1)


class Served:
    """`dspx serve-models ARGS --port 0 --socket DEVICE` in ``cwd``; the port from its serving line."""

    def __init__(self, args, cwd, device_path):
        self.err_path = Path(cwd) / f"serve-{time.monotonic_ns()}.err"
        self.err = open(self.err_path, "w")
        self.proc = subprocess.Popen([*CLI, "serve-models", *args, "--port", "0", "--socket", device_path],
                                     cwd=cwd, stdout=subprocess.DEVNULL, stderr=self.err)
        self.line = _wait_for_serving(self.proc, self.err_path).strip()
        self.port = int(re.search(r"http://127\.0\.0\.1:(\d+)/v2", self.line).group(1))
        self.url = f"http://127.0.0.1:{self.port}"

    def stop(self, sig=signal.SIGINT) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        self.err.close()
        return self.proc.returncode


@pytest.fixture(scope="module")
def workdir(compiled, tmp_path_factory):
    """What the doc's directory holds: build/model (multi_output) and build/resnet18."""
    d = tmp_path_factory.mktemp("serve-models")
    (d / "build").mkdir()
    (d / "build" / "model").symlink_to(compiled("multi_output"))
    (d / "build" / "resnet18").symlink_to(compiled("resnet18", kernels=True))
    return d


@pytest.fixture(scope="module")
def dev():
    # the default carveout: `dspx run` opens its client with the default staging; the DDR pool
    # holds ResNet-18 twice (the server's and `dspx run`'s)
    d = Device("--ddr-pool-size", "160M")
    yield d
    d.stop()


@pytest.fixture(scope="module")
def server(workdir, dev):
    """The doc's start command, as written (plus a free port and the test device)."""
    args = _blocks("sh")[0].split()
    assert args[:2] == ["dspx", "serve-models"]
    s = Served(args[2:], workdir, dev.path)
    yield s
    s.stop()


def _http(url, body: bytes | None = None, headers=None, method=None):
    """(status, headers, body) of one request; errors are answers too."""
    req = urllib.request.Request(url, data=body, headers=headers or {}, method=method)
    try:
        with urllib.request.urlopen(req, timeout=120) as r:
            return r.status, r.headers, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.headers, e.read()


def _infer(server, model, request: dict, binary: bytes = b"", headers=None):
    head = json.dumps(request).encode()
    h = {"Content-Type": "application/octet-stream", **(headers or {})}
    if binary:
        h["Inference-Header-Content-Length"] = str(len(head))
    return _http(f"{server.url}/v2/models/{model}/infer", head + binary, h)


def _vm_outputs(dev, module_dir, *args):
    from dspx.host.vm import VirtualMachine

    with VirtualMachine(module_dir, socket=dev.path) as vm:
        outs = vm["main"](*args)
    return outs if isinstance(outs, list) else [outs]


# ---------------------------------------------------------------- names and paths (no device)

def test_model_names_dirs_so_stems_name_eq_path_and_repositories(compiled, tmp_path):
    from dspx.host.serve_models import find_models

    mo, mi = compiled("multi_output"), compiled("multi_input")
    repo = tmp_path / "repo"
    repo.mkdir()
    (repo / "first").symlink_to(mo)
    (repo / "second").symlink_to(mi)
    (repo / "notes").mkdir()  # not a module: not served
    names = [s.name for s in find_models([mo, f"renamed={mi}", mi / "model.so", repo])]
    assert names == ["multi_output", "renamed", "model", "first", "second"]


@pytest.mark.parametrize("args, message", [
    (["missing"], "error: missing: no such file or directory"),
    (["mo", "mo"], "error: two models are named 'mo' (mo and mo); name one with NAME=PATH"),
    (["m.onnx"], "error: m.onnx: an ONNX model, not a compiled module; compile it first: "
                 "dspx compile m.onnx -o build/m"),
    (["empty"], "error: empty: neither a compiled module (model.so + metadata.json) nor a directory of them"),
])
def test_start_up_mistakes_are_one_error_line(args, message, compiled, example_onnx, tmp_path):
    (tmp_path / "mo").symlink_to(compiled("multi_output"))
    (tmp_path / "m.onnx").symlink_to(example_onnx["multi_output"])
    (tmp_path / "empty").mkdir()
    env = {**os.environ, "DSPX_SOCKET": str(tmp_path / "no-device.sock")}  # must never be needed
    p = subprocess.run([*CLI, "serve-models", *args, "--port", "0"], cwd=tmp_path, capture_output=True,
                       text=True, timeout=120, env=env)
    assert p.returncode == 1 and p.stderr.splitlines() == [message], p.stderr


def test_a_port_in_use_is_one_error_line_before_the_device(compiled, tmp_path):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        port = taken.getsockname()[1]
        env = {**os.environ, "DSPX_SOCKET": str(tmp_path / "no-device.sock")}  # reached only after binding
        p = subprocess.run([*CLI, "serve-models", str(compiled("multi_output")), "--port", str(port)],
                           capture_output=True, text=True, timeout=120, env=env)
    assert p.returncode == 1
    assert p.stderr.splitlines() == [f"error: cannot listen on 127.0.0.1:{port}: the port is in use "
                                     f"(another server?); pick another with --port"], p.stderr


def test_while_loading_ready_and_infer_are_503_and_live_is_200(compiled):
    from starlette.testclient import TestClient

    from dspx.host.serve_models import ModelServer, create_app, find_models

    srv = ModelServer(find_models([compiled("multi_output")]))  # never loaded: as during start-up
    with TestClient(create_app(srv, max_body=100)) as c:
        assert c.get("/v2/health/live").status_code == 200
        r = c.get("/v2/health/ready")
        assert r.status_code == 503 and "loading" in r.json()["error"]
        r = c.get("/v2/models/multi_output/ready")
        assert r.status_code == 503 and r.json() == {
            "error": "model 'multi_output' is not ready: the models are loading onto the device"}
        assert c.post("/v2/models/multi_output/infer", content=b"{}").status_code == 503
        assert c.get("/v2/models/multi_output").json()["inputs"] == [
            {"name": "x", "datatype": "FP32", "shape": [2, 32]}]  # metadata is known before loading


def test_a_body_over_max_body_is_413(compiled):
    from starlette.testclient import TestClient

    from dspx.host.serve_models import ModelServer, create_app, find_models

    srv = ModelServer(find_models([compiled("multi_output")]))
    srv.models["multi_output"].vm = object()  # "loaded": the body is refused before it is used
    with TestClient(create_app(srv, max_body=100)) as c:
        r = c.post("/v2/models/multi_output/infer", content=b" " * 101)
        bomb = c.post("/v2/models/multi_output/infer", content=gzip.compress(b" " * 10_000),
                      headers={"Content-Encoding": "gzip"})  # 40 bytes that inflate past the limit
        brotli = c.post("/v2/models/multi_output/infer", content=b"{}", headers={"Content-Encoding": "br"})
    assert r.status_code == 413 and r.json() == {
        "error": "the request body is 101 bytes; this server takes at most 100 (--max-body)"}
    assert bomb.status_code == 413 and bomb.json() == {
        "error": "the request body decompresses to more than 100 bytes (--max-body)"}
    assert brotli.status_code == 400 and brotli.json() == {
        "error": "Content-Encoding 'br' is not supported (gzip, deflate or none)"}


# ---------------------------------------------------------------- the running server

def test_serving_line_health_and_server_metadata(server):
    start_text = _examples("sh")[0][1].strip()
    assert server.line == start_text.replace(":8000/", f":{server.port}/")
    assert _http(server.url + "/v2/health/live")[0] == 200
    assert _http(server.url + "/v2/health/ready")[0] == 200
    status, _, body = _http(server.url + "/v2")
    assert status == 200 and json.loads(body) == {"name": "dspx", "version": "0.1.0",
                                                  "extensions": ["binary_tensor_data"]}


def test_model_metadata_and_config_are_the_modules_declaration(server):
    status, _, body = _http(server.url + "/v2/models/resnet18")
    assert status == 200 and json.loads(body) == {
        "name": "resnet18", "versions": ["1"], "platform": "dspx_module",
        "inputs": [{"name": "input", "datatype": "FP32", "shape": [1, 3, 224, 224]}],
        "outputs": [{"name": "logits", "datatype": "FP32", "shape": [1, 1000]}]}
    meta = json.loads(_http(server.url + "/v2/models/model/versions/1")[2])
    assert meta["outputs"][2] == {"name": "argmax", "datatype": "INT64", "shape": [2]}
    assert [o["name"] for o in meta["outputs"]] == ["relu", "softmax", "argmax", "rowsum", "transposed", "scaled",
                                                     "tanh"]
    cfg = json.loads(_http(server.url + "/v2/models/model/config")[2])
    assert cfg["max_batch_size"] == 0 and cfg["input"] == [{"name": "x", "data_type": "TYPE_FP32", "dims": [2, 32]}]
    assert cfg["output"][2] == {"name": "argmax", "data_type": "TYPE_INT64", "dims": [2]}
    assert _http(server.url + "/v2/models/model/ready")[0] == 200


def test_json_infer_equals_the_vm_and_onnxruntime(server, dev, workdir, example_onnx):
    status, headers, body = _infer(server, "model", {"id": "a-1", "inputs": [
        {"name": "x", "shape": [2, 32], "datatype": "FP32", "data": X_MODEL.ravel().tolist()}]})
    assert status == 200 and headers["content-type"] == "application/json"
    res = json.loads(body)
    assert res["model_name"] == "model" and res["model_version"] == "1" and res["id"] == "a-1"
    sess = ort.InferenceSession(str(example_onnx["multi_output"]), providers=["CPUExecutionProvider"])
    ref = sess.run(None, {"x": X_MODEL})
    vm = _vm_outputs(dev, workdir / "build" / "model", X_MODEL)
    assert [o["name"] for o in res["outputs"]] == [o.name for o in sess.get_outputs()]
    for out, r, v in zip(res["outputs"], ref, vm):
        got = np.array(out["data"], dtype=r.dtype).reshape(out["shape"])
        assert out["datatype"] == {"float32": "FP32", "int64": "INT64"}[r.dtype.name]
        assert got.shape == r.shape and got.tobytes() == v.tobytes(), out["name"]
        np.testing.assert_allclose(got, r, rtol=0, atol=1e-4, err_msg=out["name"])


def test_binary_infer_by_hand(server, dev, workdir):
    """Inputs as bytes after the JSON, outputs asked for binary except one (its own parameter wins)."""
    request = {"inputs": [{"name": "x", "shape": [2, 32], "datatype": "FP32",
                           "parameters": {"binary_data_size": 256}}],
               "parameters": {"binary_data_output": True},
               "outputs": [{"name": "tanh"}, {"name": "argmax", "parameters": {"binary_data": False}},
                           {"name": "relu"}]}
    status, headers, body = _infer(server, "model", request, X_MODEL.tobytes())
    assert status == 200 and headers["content-type"] == "application/octet-stream"
    n = int(headers["Inference-Header-Content-Length"])
    res, blob = json.loads(body[:n]), body[n:]
    tanh, argmax, relu = res["outputs"]
    assert [o["name"] for o in res["outputs"]] == ["tanh", "argmax", "relu"]
    assert tanh["parameters"] == {"binary_data_size": 2 * 24 * 4} == relu["parameters"] and "data" not in tanh
    assert len(blob) == 2 * 2 * 24 * 4 and "parameters" not in argmax
    want = dict(zip(["relu", "softmax", "argmax", "rowsum", "transposed", "scaled", "tanh"],
                    _vm_outputs(dev, workdir / "build" / "model", X_MODEL)))
    assert blob[:192] == want["tanh"].tobytes() and blob[192:] == want["relu"].tobytes()
    assert argmax["data"] == want["argmax"].tolist() and argmax["shape"] == [2]
    # a gzip body (tritonclient's request_compression_algorithm) is the same request
    body2 = gzip.compress(json.dumps(request).encode() + X_MODEL.tobytes())
    status, headers, again = _http(f"{server.url}/v2/models/model/infer", body2, {
        "Content-Encoding": "gzip", "Inference-Header-Content-Length": str(len(json.dumps(request)))})
    assert status == 200 and again == body


X_FIELD = {"name": "x", "shape": [2, 32], "datatype": "FP32"}


@pytest.mark.parametrize("model, request_, binary, status, error", [
    ("nope", {"inputs": []}, b"", 404, "unknown model 'nope' (models: model, resnet18)"),
    ("model/versions/2", {"inputs": []}, b"", 404, "model 'model' has no version '2' (versions: 1)"),
    ("model", {"inputs": [{**X_FIELD, "shape": [2, 31], "data": [0]}]}, b"", 400,
     "input 'x' of model 'model' has shape [2, 32]; got [2, 31]"),
    ("model", {"inputs": [{**X_FIELD, "datatype": "INT64", "data": [0]}]}, b"", 400,
     "input 'x' of model 'model' is FP32; got datatype 'INT64'"),
    ("model", {"inputs": [{**X_FIELD, "name": "y", "data": [0]}]}, b"", 400,
     "model 'model' has no input 'y' (inputs: x)"),
    ("model", {"inputs": []}, b"", 400, "model 'model' takes 1 inputs (x); missing 'x'"),
    ("model", {"inputs": [{**X_FIELD, "data": [0] * 63}]}, b"", 400,
     "input 'x' of model 'model': shape [2, 32] holds 64 values; 'data' has 63"),
    ("model", {"inputs": [{**X_FIELD, "data": [0] * 64}], "outputs": [{"name": "sum"}]}, b"", 400,
     "model 'model' has no output 'sum' (outputs: relu, softmax, argmax, rowsum, transposed, scaled, tanh)"),
    ("model", {"inputs": [{**X_FIELD, "parameters": {"binary_data_size": 255}}]}, b"\0" * 255, 400,
     "input 'x' of model 'model': binary_data_size is 255 bytes; FP32[2, 32] is 256"),
    ("model", {"inputs": [{**X_FIELD, "parameters": {"binary_data_size": 256}}]}, b"\0" * 100, 400,
     "input 'x' of model 'model': binary_data_size 256 at offset 0, but the body has 100 bytes of binary data"),
    ("model", {"inputs": [{**X_FIELD, "parameters": {"binary_data_size": 256}}]}, b"\0" * 260, 400,
     "the body has 260 bytes of binary data; the inputs' binary_data_size add up to 256"),
])
def test_errors_in_kserves_shape_with_the_figures(server, model, request_, binary, status, error):
    got, headers, body = _infer(server, model, request_, binary)
    assert (got, json.loads(body)) == (status, {"error": error})
    assert headers["content-type"] == "application/json"


def test_a_body_that_is_not_json_and_an_unknown_endpoint(server):
    status, _, body = _http(f"{server.url}/v2/models/model/infer", b"{not json")
    assert status == 400 and json.loads(body)["error"].startswith("the inference request is not JSON: ")
    status, _, body = _http(f"{server.url}/v2/nothing")
    assert (status, json.loads(body)) == (404, {"error": "no endpoint GET /v2/nothing"})


def test_tritonclient_resnet18_equals_dspx_run_byte_for_byte(server, dev, workdir, tmp_path):
    x = np.random.default_rng(7).standard_normal((1, 3, 224, 224)).astype(np.float32)
    np.save(tmp_path / "x.npy", x)
    p = subprocess.run([*CLI, "run", str(workdir / "build" / "resnet18"), "-i", str(tmp_path / "x.npy"),
                        "-o", str(tmp_path / "out.npz"), "--socket", dev.path, "--json"],
                       capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr
    with np.load(tmp_path / "out.npz") as z:
        want = z["logits"]
    client = httpclient.InferenceServerClient(f"127.0.0.1:{server.port}", network_timeout=300)
    assert client.is_server_live() and client.is_server_ready() and client.is_model_ready("resnet18")
    assert client.get_model_metadata("resnet18")["inputs"] == [
        {"name": "input", "datatype": "FP32", "shape": [1, 3, 224, 224]}]
    for binary in (True, False):
        inp = httpclient.InferInput("input", [1, 3, 224, 224], "FP32")
        inp.set_data_from_numpy(x, binary_data=binary)
        out = httpclient.InferRequestedOutput("logits", binary_data=binary)
        got = client.infer("resnet18", [inp], outputs=[out]).as_numpy("logits")
        assert got.dtype == want.dtype and got.shape == want.shape == (1, 1000)
        assert got.tobytes() == want.tobytes(), f"binary_data={binary}"
    got = client.infer("resnet18", [inp]).as_numpy("logits")  # no outputs named: all, binary
    assert got.tobytes() == want.tobytes()
    from tritonclient.utils import InferenceServerException

    bad = httpclient.InferInput("input", [1, 3, 224, 225], "FP32")
    bad.set_data_from_numpy(np.zeros((1, 3, 224, 225), np.float32))
    with pytest.raises(InferenceServerException) as e:
        client.infer("resnet18", [bad])
    assert e.value.status() == "400"
    assert e.value.message() == "input 'input' of model 'resnet18' has shape [1, 3, 224, 224]; got [1, 3, 224, 225]"
    client.close()


def test_concurrent_requests_each_get_their_own_outputs(server, dev, workdir):
    rng = np.random.default_rng(11)
    xs = [rng.standard_normal((2, 32)).astype(np.float32) for _ in range(6)]
    want = [_vm_outputs(dev, workdir / "build" / "model", x)[0].tobytes() for x in xs]  # relu
    r18 = rng.standard_normal((1, 3, 224, 224)).astype(np.float32)
    got, errors = {}, []

    def small(i):
        try:
            for _ in range(3):
                req = {"inputs": [{**X_FIELD, "parameters": {"binary_data_size": 256}}],
                       "outputs": [{"name": "relu", "parameters": {"binary_data": True}}]}
                status, headers, body = _infer(server, "model", req, xs[i].tobytes())
                assert status == 200, body
                got.setdefault(i, set()).add(body[int(headers["Inference-Header-Content-Length"]):])
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    def big():
        try:
            req = {"inputs": [{"name": "input", "shape": [1, 3, 224, 224], "datatype": "FP32",
                               "parameters": {"binary_data_size": r18.nbytes}}]}
            assert _infer(server, "resnet18", req, r18.tobytes())[0] == 200
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=small, args=(i,)) for i in range(len(xs))] + [threading.Thread(target=big)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    assert not errors and not any(t.is_alive() for t in threads), errors
    assert {i: s for i, s in got.items()} == {i: {w} for i, w in enumerate(want)}


def test_every_example_of_the_doc_runs_and_prints_what_it_shows(server, workdir):
    examples = _examples("sh")[1:] + _examples("python")
    assert len(examples) == 5
    for code, shown in examples:
        code = code.replace("localhost:8000", f"127.0.0.1:{server.port}")
        cmd = ["bash", "-c", code] if "curl" in code else [sys.executable, "-c", code]
        p = subprocess.run(cmd, cwd=workdir, capture_output=True, text=True, timeout=300)
        assert p.returncode == 0, p.stderr
        assert p.stdout.strip() == shown.strip(), code  # (curl prints no final newline)


def test_ctrl_c_stops_with_130_and_closes_the_connections(workdir, dev):
    s = Served(["build/model"], workdir, dev.path)
    assert _http(s.url + "/v2/health/ready")[0] == 200
    assert s.stop(signal.SIGINT) == 130
    assert "Traceback" not in s.err_path.read_text()


def test_a_module_the_device_refuses_ends_the_server_with_its_error(compiled, dev, tmp_path):
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "metadata.json").write_text((compiled("multi_output") / "metadata.json").read_text())
    (bad / "model.so").write_bytes(b"\x7fELF" + b"\0" * 60)  # an ELF header and nothing behind it
    p = subprocess.run([*CLI, "serve-models", str(bad), "--port", "0", "--socket", dev.path],
                       capture_output=True, text=True, timeout=120)
    lines = p.stderr.strip().splitlines()
    assert p.returncode == 1 and len(lines) == 1, p.stderr
    assert lines[0].startswith(f"error: model 'bad' ({bad}): ERR_LOAD"), p.stderr
    assert "serving" not in p.stderr and "Traceback" not in p.stderr


def test_int64_and_fp16_inputs_as_json_and_binary(compiled, dev):
    """multi_input takes FP32, INT64 and FP16 inputs: each datatype in JSON and as bytes."""
    from starlette.testclient import TestClient

    from dspx.host.serve_models import ModelServer, create_app, find_models

    d = compiled("multi_input")
    meta = json.loads((d / "metadata.json").read_text())
    rng = np.random.default_rng(5)
    xs = {t["name"]: (rng.integers(0, 16, t["shape"]) if t["dtype"] == "int64" else
                      rng.standard_normal(t["shape"])).astype(t["dtype"]) for t in meta["inputs"]}
    kinds = {"float32": "FP32", "int64": "INT64", "float16": "FP16"}
    want = _vm_outputs(dev, d, *xs.values())[0]
    srv = ModelServer(find_models([d]))
    srv.load(dev.path)
    try:
        with TestClient(create_app(srv)) as c:
            def tensor(name, **extra):
                return {"name": name, "shape": list(xs[name].shape), "datatype": kinds[xs[name].dtype.name], **extra}
            as_json = {"inputs": [tensor(n, data=x.tolist()) for n, x in xs.items()]}  # nested lists
            r = c.post("/v2/models/multi_input/infer", json=as_json)
            assert r.status_code == 200, r.text
            y = r.json()["outputs"][0]
            assert np.array(y["data"], np.float32).reshape(y["shape"]).tobytes() == want.tobytes()
            order = ["s", "idx", "a", "b", "c", "d", "e"]  # bytes follow the request's order, not the module's
            head = json.dumps({"inputs": [tensor(n, parameters={"binary_data_size": xs[n].nbytes}) for n in order],
                               "outputs": [{"name": "y", "parameters": {"binary_data": True}}]}).encode()
            r = c.post("/v2/models/multi_input/infer", content=head + b"".join(xs[n].tobytes() for n in order),
                       headers={"Inference-Header-Content-Length": str(len(head))})
            assert r.status_code == 200, r.text
            n = int(r.headers["Inference-Header-Content-Length"])
            assert r.content[n:] == want.tobytes()
            bad = {"inputs": [t if t["name"] != "idx" else {**t, "data": [0.5] * 16} for t in as_json["inputs"]]}
            r = c.post("/v2/models/multi_input/infer", json=bad)
            assert r.status_code == 400 and r.json()["error"].startswith(
                "model 'multi_input': input 'idx' expects int64; got a list of float64 values")
    finally:
        srv.close()
