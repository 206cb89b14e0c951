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


def _tiny_llama_gguf(path) -> None:
    """The smallest SmolLM2-style GGUF the device kernels take: one layer,
    hidden 64 (one 64-wide head, one KV head), FFN 128, vocab 128; Q4_1
    linear layers, Q8_0 tied embedding, F32 norms; random weights."""
    import gguf
    from gguf import GGMLQuantizationType as Q, quants

    rng = np.random.default_rng(18)
    dim, ffn, vocab = 64, 128, 128
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_name("tiny")
    w.add_token_list([f"t{i}" for i in range(vocab)])
    w.add_block_count(1)
    w.add_context_length(64)
    w.add_embedding_length(dim)
    w.add_feed_forward_length(ffn)
    w.add_head_count(1)
    w.add_head_count_kv(1)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_freq_base(10000.0)
    w.add_vocab_size(vocab)
    w.add_rope_dimension_count(64)

    def quantized(name, shape, kind):
        w.add_tensor(name, quants.quantize((rng.standard_normal(shape) * 0.2).astype(np.float32), kind),
                     raw_dtype=kind)

    quantized("token_embd.weight", (vocab, dim), Q.Q8_0)
    w.add_tensor("output_norm.weight", (1 + 0.1 * rng.standard_normal(dim)).astype(np.float32))
    for norm in ("attn_norm", "ffn_norm"):
        w.add_tensor(f"blk.0.{norm}.weight", (1 + 0.1 * rng.standard_normal(dim)).astype(np.float32))
    for name, shape in (("attn_q", (dim, dim)), ("attn_k", (64, dim)), ("attn_v", (64, dim)),
                        ("attn_output", (dim, dim)), ("ffn_gate", (ffn, dim)), ("ffn_up", (ffn, dim)),
                        ("ffn_down", (dim, ffn))):
        quantized(f"blk.0.{name}.weight", shape, Q.Q4_1)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def test_compile_llm_writes_a_package_that_runs_like_the_reference(big_device, tmp_path):
    """`dspx compile-llm` succeeding, as a user runs it: a tiny Llama GGUF ->
    prefill/decode modules + weights + metadata, which then load on the device
    and give the numpy reference's logits (prefill, then a decode step)."""
    from llm_reference import ReferenceLlama, load_gguf

    from dspx.host.llm import DeviceLLM

    src, out = tmp_path / "tiny.gguf", tmp_path / "llm"
    _tiny_llama_gguf(src)
    # float32 decode activations: the reference's logits to 2e-3 (the default int8 ones: test_llm_int8_decode.py)
    p = dspx("compile-llm", src, "-o", out, "--context", 64, "--decode-activations", "float32", "--json", timeout=600)
    assert p.returncode == 0, (p.stdout[-2000:], p.stderr[-2000:])
    res = json.loads(p.stdout)
    assert res["status"] == "ok" and res["outdir"] == str(out), res
    m = res["model"]
    assert (m["name"], m["n_layers"], m["dim"], m["n_heads"], m["n_kv"], m["ffn"], m["vocab"]) == \
        ("tiny", 1, 64, 1, 1, 128, 128), m
    assert m["decode_activations"] == "float32"
    assert res["context"] == 64 and res["kv"]["count"] == 2 and res["kv"]["shape"] == [1, 1, 64, 64], res["kv"]
    for name in ("prefill", "decode", "decode_parallel", "decode_batch", "decode_batch_parallel"):
        assert (out / res["modules"][name]["module"]).is_file(), name
    assert json.loads((out / "metadata.json").read_text())["weights"] == res["weights"]

    ref = ReferenceLlama(loaded=load_gguf(src), max_seq=64)
    ids = [3, 77, 5, 127, 0, 64, 9]
    with DeviceLLM(out, socket=big_device.path, progress=False, decode_threads="serial") as llm:
        want = ref.prefill(ids)[-1]
        got = llm.prefill(ids)
        np.testing.assert_allclose(got, want, rtol=0, atol=2e-3 * np.abs(want).max())
        want = ref.decode(11, len(ids))
        got = llm.decode(11, len(ids))
        np.testing.assert_allclose(got, want, rtol=0, atol=2e-3 * np.abs(want).max())


@pytest.mark.parametrize("layout", ["blocked", "rows"])
def test_int8_kv_packages_of_both_layouts_run_like_the_reference(big_device, tmp_path, layout):
    """The int8 KV cache in either layout (the rows one is kept for A/B): the
    tiny GGUF's prefill and decode logits against the float32 reference, at
    the int8 tolerance (per-row scales: a few percent of the largest logit)."""
    from llm_reference import ReferenceLlama, load_gguf

    from dspx.host.llm import DeviceLLM

    src, out = tmp_path / "tiny.gguf", tmp_path / "llm"
    _tiny_llama_gguf(src)
    p = dspx("compile-llm", src, "-o", out, "--context", 64, "--kv-dtype", "int8", "--kv-layout", layout, "--json",
             timeout=600)
    assert p.returncode == 0, (p.stdout[-2000:], p.stderr[-2000:])
    ref = ReferenceLlama(loaded=load_gguf(src), max_seq=64)
    ids = [3, 77, 5, 127, 0, 64, 9]
    with DeviceLLM(out, socket=big_device.path, progress=False, decode_threads="serial") as llm:
        assert llm.kv_dtype == "int8"
        for want, got in ((ref.prefill(ids)[-1], llm.prefill(ids)), (ref.decode(11, len(ids)), llm.decode(11, len(ids)))):
            # measured: 4.1 % (prefill) and 0.8 % (decode) of the largest logit, the same in both layouts
            np.testing.assert_allclose(got, want, rtol=0, atol=6e-2 * np.abs(want).max())
