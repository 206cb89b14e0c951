"""dspx serve-llm's start-up: a bad --model and a port in use are one error line
and exit 1 before anything loads; while the model loads, /health answers 503
{"status": "loading"} (llama-server's answer) and every other path 503 "Loading
model"; "serving" comes only once requests are answered.  The loading model is a
stand-in that blocks until the test lets it finish (no device needed)."""
from __future__ import annotations

import json
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
from conftest import CACHE  # noqa: E402

pytest.importorskip("fastapi")


def dspx(*args, timeout=120):
    return subprocess.run([sys.executable, "-m", "dspx.cli", *map(str, args)], capture_output=True, text=True,
                          timeout=timeout)


def _get(url: str) -> tuple[int, dict]:
    try:
        with urllib.request.urlopen(url, timeout=30) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def _one_error_line(p) -> str:
    lines = [ln for ln in p.stderr.splitlines() if ln.strip()]
    assert p.returncode == 1 and len(lines) == 1 and lines[0].startswith("error: "), (p.returncode, p.stderr)
    assert "serving" not in p.stderr
    return lines[0]


def test_a_bad_model_is_one_error_line_before_serving(tmp_path):
    line = _one_error_line(dspx("serve-llm", "--model", tmp_path / "no-such-model", "--port", 0))
    assert "no-such-model is not a compiled LLM (no metadata.json)" in line


def test_a_port_in_use_is_one_error_line_before_the_model_loads():
    from dspx.compiler.llm import compiled_dir

    model = compiled_dir(cache_dir=CACHE, progress=False)  # the suite's cached package: a model that would load
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        port = taken.getsockname()[1]
        line = _one_error_line(dspx("serve-llm", "--model", model, "--port", port))
    assert f"cannot listen on 127.0.0.1:{port}: Address already in use" in line and "--port" in line


class _SlowGenerator:
    """Stands in for Generator: the model 'loads' until ``release`` is set."""

    def __init__(self, **_):
        self.release = threading.Event()
        self.loaded = False
        self.cached: list[int] = []
        _SlowGenerator.last = self

    @property
    def llm(self):
        assert self.release.wait(120), "the test never released the load"
        self.loaded = True
        return self

    def close(self):
        pass


def test_health_is_503_while_loading_then_200_and_serving_comes_after(monkeypatch):
    import uvicorn

    import dspx.host.llm
    from dspx.host import serve_llm

    servers = []
    init = uvicorn.Server.__init__

    def remember(self, *a, **kw):
        init(self, *a, **kw)
        servers.append(self)
    monkeypatch.setattr(uvicorn.Server, "__init__", remember)
    monkeypatch.setattr(dspx.host.llm, "Generator", _SlowGenerator)
    monkeypatch.setattr(serve_llm, "_log_requests", lambda: None)  # keep the log where pytest captures it
    events: dict[str, tuple[str, float]] = {}
    health_at_ready = []

    def ready(url):
        health_at_ready.append(_get(url + "/health"))  # "serving" is said only when this is 200
        events["ready"] = (url, time.monotonic())
    t = threading.Thread(target=serve_llm.serve_llm, kwargs=dict(
        host="127.0.0.1", port=0, log_level="warning", on_loading=lambda url: events.setdefault("loading", (url, 0)),
        on_ready=ready), daemon=True)
    t.start()
    deadline = time.monotonic() + 60
    while not (servers and servers[0].started):
        assert t.is_alive() and time.monotonic() < deadline, "the server did not start"
        time.sleep(0.05)
    url = events["loading"][0]
    try:
        assert _get(url + "/health") == (503, {"status": "loading"})
        status, body = _get(url + "/v1/models")
        assert status == 503 and body["error"]["message"] == "Loading model"
        assert body["error"]["type"] == "unavailable_error"
        assert "ready" not in events and not _SlowGenerator.last.loaded
        _SlowGenerator.last.release.set()
        while "ready" not in events:
            assert t.is_alive() and time.monotonic() < deadline, "never ready"
            time.sleep(0.05)
        assert health_at_ready[0][0] == 200 and health_at_ready[0][1]["status"] == "ok"
        assert _get(url + "/health")[0] == 200
    finally:
        _SlowGenerator.last.release.set()
        servers[0].should_exit = True
        t.join(30)
    assert not t.is_alive()
