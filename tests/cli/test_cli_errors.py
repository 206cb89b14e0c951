"""Every user mistake through the real CLI (a subprocess, as a user runs it):
a non-zero exit, one ``error: …`` line on stderr naming the problem (with
``--json``: one JSON error object on stdout), and never a traceback."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from conftest import SMALL, Device

DSPX = [sys.executable, "-m", "dspx.cli"]


@pytest.fixture(scope="module")
def dev():
    d = Device(*SMALL)
    yield d
    d.stop()


@pytest.fixture(scope="module")
def files(tmp_path_factory, compiled, example_onnx):
    """Paths the cases use: a module, inputs right and wrong, a directory that
    is no LLM package, a shim that hides the tvm package (an install without
    the tvm extra), a broken op library, a model with an operator the compiler lacks."""
    import onnx
    from onnx import TensorProto, helper

    t = tmp_path_factory.mktemp("cli-errors")
    np.save(t / "x.npy", np.zeros((2, 32), np.float32))
    np.save(t / "wrong.npy", np.zeros((32, 2), np.float32))
    np.save(t / "f64.npy", np.zeros((2, 32), np.float64))
    (t / "empty").mkdir()
    (t / "notvm").mkdir()
    (t / "notvm" / "tvm.py").write_text("raise ModuleNotFoundError(\"No module named 'tvm'\", name='tvm')\n")
    (t / "broken_ops.py").write_text("def op(:\n")
    g = helper.make_graph([helper.make_node("Det", ["x"], ["y"], name="det0")], "g",
                          [helper.make_tensor_value_info("x", TensorProto.FLOAT, [3, 3])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, [])])
    onnx.save(helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)]), t / "det.onnx")
    return {"dir": t, "module": compiled("multi_output"), "onnx": example_onnx["multi_input"]}


def dspx(*args, env=None, timeout=60):
    full_env = {k: v for k, v in os.environ.items() if k != "DSPX_SOCKET"}
    full_env.update(env or {})
    return subprocess.run([*DSPX, *map(str, args)], capture_output=True, text=True, timeout=timeout, env=full_env)


def _cases(f, dev, tmp):
    t, m = f["dir"], f["module"]
    no_tvm = {"PYTHONPATH": str(t / "notvm"), "XDG_RUNTIME_DIR": str(tmp)}  # and no device running: private
    s = ("--socket", dev.path)
    return {
        "ping -c 0": (("ping", "-c", "0", *s), None, 2, ["--count", "0 is not in the range"]),
        "generate -n 0": (("generate", "hi", "-n", "0"), None, 2, ["--max-tokens", "0 is not in the range"]),
        "generate --model (no package)": (("generate", "hi", "--model", t / "empty", *s), None, 1, [str(t / "empty")]),
        "generate --model (a module dir)": (("generate", "hi", "--model", m, *s), None, 1, [str(m), "LLM"]),
        "serve on a busy socket": (("serve", "--socket", dev.path), None, 1, ["already listening", dev.path]),
        "serve --carveout-size lots": (("serve", "--socket", tmp / "s.sock", "--carveout-size", "lots"), None, 2,
                                       ["--carveout-size", "'lots' is not a size"]),
        "compile without tvm": (("compile", f["onnx"], "-o", tmp / "out"), no_tvm, 1,
                                ["dspx compile", "'tvm' extra", "pip install 'dspx[tvm]'"]),
        "compile an unsupported operator": (("compile", t / "det.onnx", "-o", tmp / "out"), None, 1, ["Det"]),
        "run without tvm": (("run", m, "-i", t / "x.npy"), no_tvm, 1, ["'tvm' extra", "pip install 'dspx[tvm]'"]),
        "run wrong shape": (("run", m, "-i", t / "wrong.npy", *s), None, 1,
                            ["input 'x'", "expects float32[2, 32]", "got float32[32, 2]"]),
        "run float64": (("run", m, "-i", t / "f64.npy", *s), None, 1, ["got float64[2, 32]", "astype"]),
        "run two inputs to one": (("run", m, "-i", t / "x.npy", "-i", t / "x.npy", *s), None, 1,
                                  ["takes 1 input (x); 2 given"]),
        "run missing file": (("run", m, "-i", t / "nope.npy", *s), None, 1, ["nope.npy", "No such file"]),
        "run no module": (("run", t / "nothing", "-i", t / "x.npy"), None, 2, ["MODULE", "does not exist"]),
        "run not a module": (("run", t / "empty", "-i", t / "x.npy", *s), None, 1, ["no compiled module"]),
        "no device on --socket": (("ping", "--socket", tmp / "nothing.sock"), None, 1, ["no device is listening"]),
        "status on a dead socket": (("status",), {"DSPX_SOCKET": str(tmp / "nothing.sock")}, 1,
                                    ["no device is listening"]),
        "load-ops broken source": (("load-ops", t / "broken_ops.py", *s), None, 1, ["ERR_"]),
        "unknown command": (("servee",), None, 2, ["No such command 'servee'"]),
    }


CASES = ["ping -c 0", "generate -n 0", "generate --model (no package)", "generate --model (a module dir)",
         "serve on a busy socket", "serve --carveout-size lots", "compile without tvm",
         "compile an unsupported operator", "run without tvm",
         "run wrong shape", "run float64", "run two inputs to one", "run missing file", "run no module",
         "run not a module", "no device on --socket", "status on a dead socket", "load-ops broken source",
         "unknown command"]
JSON_CASES = ["ping -c 0", "generate --model (a module dir)", "compile without tvm", "compile an unsupported operator",
              "run without tvm", "run wrong shape", "no device on --socket"]


@pytest.mark.parametrize("case", CASES)
def test_a_mistake_is_one_line_and_an_exit_code(case, files, dev, tmp_path):
    args, env, code, words = _cases(files, dev, tmp_path)[case]
    r = dspx(*args, env=env)
    assert "Traceback" not in r.stdout + r.stderr, r.stderr
    assert r.returncode == code, (r.returncode, r.stdout, r.stderr)
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), r.stderr
    for w in words:
        assert w in lines[0], (w, lines[0])
    assert dev.alive()


@pytest.mark.parametrize("case", JSON_CASES)
def test_with_json_a_mistake_is_one_json_object(case, files, dev, tmp_path):
    args, env, code, words = _cases(files, dev, tmp_path)[case]
    r = dspx(*args, "--json", env=env)
    assert "Traceback" not in r.stdout + r.stderr, r.stderr
    assert r.returncode == code, (r.returncode, r.stdout, r.stderr)
    out = json.loads(r.stdout)  # exactly one JSON document
    assert out["status"] == "error" and out["error"] and out["message"]
    for w in words:
        assert w in out["message"], (w, out)


def test_missing_extra_names_the_extra_in_json(files, dev, tmp_path):
    args, env, _, _ = _cases(files, dev, tmp_path)["compile without tvm"]
    out = json.loads(dspx(*args, "--json", env=env).stdout)
    assert (out["error"], out["extra"], out["module"]) == ("MissingExtra", "tvm", "tvm")


def test_a_compile_error_is_its_own_words_and_names_its_operators(files, dev, tmp_path):
    # the group's policy, not a block of the compile command's own: no type name in
    # the line, and the operators and node in the JSON object
    args, env, _, _ = _cases(files, dev, tmp_path)["compile an unsupported operator"]
    r = dspx(*args, env=env)
    assert r.stderr.startswith("error: ") and not r.stderr.startswith("error: CompileError"), r.stderr
    out = json.loads(dspx(*args, "--json", env=env).stdout)
    assert (out["error"], out["operators"], out["code"]) == ("CompileError", ["Det"], -1) and "node" in out, out


def test_ctrl_c_exits_130_without_a_traceback(dev):
    # SIGINT back to its default in the child: a suite started in the background by a
    # non-interactive shell inherits SIGINT ignored, and Python then never raises KeyboardInterrupt
    p = subprocess.Popen([*DSPX, "ping", "-c", "100000000", "--socket", dev.path], stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True,
                         preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        deadline = time.monotonic() + 30
        while not _connections(dev) and time.monotonic() < deadline:  # pinging: its connection is open
            time.sleep(0.05)
        p.send_signal(signal.SIGINT)
        out, err = p.communicate(timeout=30)
    finally:
        if p.poll() is None:
            p.kill()
    assert p.returncode == 130 and "Traceback" not in out + err, err
    assert err.strip().splitlines() == ["interrupted"]


def _connections(dev) -> int:
    from dspx.host.client import Client

    with Client(dev.path, staging_size=0, printf_size=0) as c:
        return c.pools()["connections"] - 1


def test_every_command_has_the_shared_options():
    """-v/--verbose and --log-level on every command; --socket documented wherever it is taken."""
    from dspx.cli import main

    assert {"serve", "ping", "status", "run", "compile", "ops", "load-ops", "info", "devices"} <= set(main.commands)
    for name, cmd in main.commands.items():
        opts = {o for p in cmd.params for o in getattr(p, "opts", [])}
        assert {"-v", "--verbose", "--log-level"} <= opts, name
        for p in cmd.params:
            if p.name == "socket":
                assert p.help, name


def test_log_level_reaches_the_logger():
    r = subprocess.run([*DSPX, "ping", "--log-level", "debug", "--socket", "/nonexistent/x.sock"],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 1 and "dspx: DEBUG: traceback of the error below" in r.stderr
    assert r.stderr.strip().splitlines()[-1].startswith("error: no device is listening")


@pytest.mark.parametrize("level, shown", [(None, True), ("warning", False)])
def test_log_level_reaches_the_device(level, shown, tmp_path):
    """One logging setup: `dspx serve --log-level` sets the device's level too."""
    from dspx.transport import is_listening

    sock = str(tmp_path / "dev.sock")
    os.chmod(tmp_path, 0o700)
    extra = ["--log-level", level] if level else []
    env = {k: v for k, v in os.environ.items() if k != "DSPX_LOG_LEVEL"}
    p = subprocess.Popen([*DSPX, "serve", "--socket", sock, "--carveout-size", "64M", *extra], env=env,
                         stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 60
        while not is_listening(sock) and p.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert is_listening(sock)
    finally:
        p.send_signal(signal.SIGINT)
        _, err = p.communicate(timeout=30)
    assert ("dspx-device: listening on" in err) is shown, err
    assert "Traceback" not in err
