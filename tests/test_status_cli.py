"""CLI paths that had no test: ``dspx run --kv-resident``, ``dspx chat`` and
``dspx compile-llm``, each a small real run as a user runs it (a
subprocess), reusing the suite's cached modules and compiled LLM."""
from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest

from conftest import CACHE


def dspx(*args, stdin=None, timeout=300):
    return subprocess.run([sys.executable, "-m", "dspx.cli", *map(str, args)], input=stdin, capture_output=True,
                          text=True, timeout=timeout)


@pytest.fixture
def big_device(default_device):
    return default_device  # `dspx run` and the LLM want the default staging and KV region


def test_run_kv_resident_hands_back_only_the_first_output(big_device, compiled, example_onnx, tmp_path):
    import onnxruntime as ort

    from dspx.compiler.examples import random_inputs

    d = compiled("multi_output")
    meta = json.loads((d / "metadata.json").read_text())
    x = random_inputs(meta, seed=5)
    paths = []
    for t, a in zip(meta["inputs"], x):
        paths += ["--input", tmp_path / f"{t['name']}.npy"]
        np.save(paths[-1], a)
    out = tmp_path / "out.npz"
    p = dspx("run", d, *paths, "--kv-resident", "--json", "--output", out, "--socket", big_device.path)
    assert p.returncode == 0, (p.stdout, p.stderr)
    res = json.loads(p.stdout)
    assert res["status"] == "ok" and res["num_outputs"] == 1 and len(res["outputs"]) == 1, res
    assert res["outputs"][0]["name"] == meta["outputs"][0]["name"]
    sess = ort.InferenceSession(str(example_onnx["multi_output"]), providers=["CPUExecutionProvider"])
    ref = sess.run(None, {t["name"]: a for t, a in zip(meta["inputs"], x)})
    with np.load(out) as z:
        assert list(z.keys()) == [meta["outputs"][0]["name"]]
        np.testing.assert_allclose(z[meta["outputs"][0]["name"]], ref[0], rtol=0, atol=1e-4)


@pytest.fixture(scope="module")
def llm_dir():
    from dspx.compiler.llm import compiled_dir
    return compiled_dir(cache_dir=CACHE, progress=False)


def test_chat_answers_each_line_and_reset_forgets_the_history(big_device, llm_dir):
    q = "What is the capital of France?"
    p = dspx("chat", "--model", llm_dir, "--socket", big_device.path, "-n", "12", "--temperature", "0",
             stdin=f"{q}\n/reset\n{q}\n/quit\n")
    assert p.returncode == 0, p.stderr
    answers = [ln for ln in p.stdout.splitlines() if ln.strip()]
    assert len(answers) == 2, p.stdout
    # greedy decoding: after /reset the same question gets the same answer
    assert answers[0] == answers[1] and "Paris" in answers[0], answers
    assert "(history cleared)" in p.stderr and "context" in p.stderr


def test_compile_llm_of_a_missing_gguf_is_a_clear_error(tmp_path):
    p = dspx("compile-llm", tmp_path / "none.gguf", "-o", tmp_path / "llm", "--json")
    assert p.returncode == 1
    res = json.loads(p.stdout)
    assert res["error"] == "GGUFNotFoundError" and "none.gguf" in res["message"], res
