"""A base install (``pip install .``, no extras) into a clean venv: it serves,
pings, runs the CLI, and names the missing extra for what needs one.

The venv is a real clean one (no system site-packages); pip's own cache
keeps the download cost to the first run."""
from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from dspx.transport import is_listening

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def base_venv(tmp_path_factory):
    t = tmp_path_factory.mktemp("base-install")
    src = t / "dspx-src"  # the package's own files, so no build output lands in the shared tree
    src.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(REPO / name, src / name)
    shutil.copytree(REPO / "src", src / "src", ignore=shutil.ignore_patterns("__pycache__", "*.egg-info"))
    venv = t / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=120)
    r = subprocess.run([str(venv / "bin" / "python"), "-m", "pip", "install", "-q", "--disable-pip-version-check",
                        str(src)], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    return venv


def _env(tmp_path):
    env = {k: v for k, v in os.environ.items() if k not in ("DSPX_SOCKET", "PYTHONPATH", "VIRTUAL_ENV")}
    env["XDG_RUNTIME_DIR"] = str(tmp_path)
    return env


def test_base_install_has_no_extras(base_venv):
    r = subprocess.run([str(base_venv / "bin" / "python"), "-c",
                        "import importlib.util as u; print([m for m in ('tvm', 'onnx', 'onnxruntime', 'torch', "
                        "'gguf', 'tokenizers', 'jinja2') if u.find_spec(m)])"],
                       capture_output=True, text=True, timeout=60)
    assert r.stdout.strip() == "[]", r.stdout + r.stderr


def test_base_install_serves_and_pings(base_venv, tmp_path):
    dspx = str(base_venv / "bin" / "dspx")
    env = _env(tmp_path)
    sock = str(tmp_path / "dev.sock")
    serve = subprocess.Popen([dspx, "serve", "--socket", sock, "--carveout-size", "64M"], env=env,
                             stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 60
        while not is_listening(sock):
            assert serve.poll() is None and time.monotonic() < deadline, serve.stderr.read() if serve.poll() else ""
            time.sleep(0.05)
        r = subprocess.run([dspx, "ping", "--socket", sock, "--json", "-c", "5"], env=env, capture_output=True,
                           text=True, timeout=60)
        assert r.returncode == 0, r.stderr
        out = json.loads(r.stdout)
        assert out["status"] == "ok" and out["count"] == 5 and out["private_device"] is False
        r = subprocess.run([dspx, "status", "--socket", sock], env=env, capture_output=True, text=True, timeout=60)
        assert r.returncode == 0 and "carveout: 0B / 64M attached" in r.stdout, r.stdout + r.stderr
    finally:
        serve.send_signal(signal.SIGINT)
        serve.wait(15)
    r = subprocess.run([dspx, "ping", "--json"], env=env, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and json.loads(r.stdout)["private_device"] is True, r.stderr  # a private device


@pytest.mark.parametrize("cmd, extra", [
    (["compile", "MODEL", "-o", "OUT"], "tvm"),
    (["compile-llm", "-o", "OUT"], "llm"),
    (["generate", "hello"], "llm"),
    (["farm", "status"], "farm"),
    (["farm", "up", "--devices", "1"], "farm"),
])
def test_base_install_names_the_missing_extra(cmd, extra, base_venv, tmp_path, example_onnx):
    args = [str(example_onnx["multi_input"]) if a == "MODEL" else str(tmp_path / "out") if a == "OUT" else a
            for a in cmd]
    r = subprocess.run([str(base_venv / "bin" / "dspx"), *args], env=_env(tmp_path), capture_output=True,
                       text=True, timeout=60)
    assert r.returncode == 1 and "Traceback" not in r.stderr, r.stderr
    assert r.stderr.strip().splitlines() == [r.stderr.strip()]
    assert f"needs the '{extra}' extra" in r.stderr and f"pip install 'dspx[{extra}]'" in r.stderr, r.stderr
