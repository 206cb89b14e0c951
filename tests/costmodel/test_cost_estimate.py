"""Board-time estimates of compiled modules and the LLM (dspx.costmodel.estimate).

Every MAC and byte count below is worked out by hand from the layer shapes
written in the test; the parameters are a dict, not a profile file."""
from __future__ import annotations

import json
from pathlib import Path
import math

import numpy as np
import pytest
from onnx import TensorProto, helper, numpy_helper

from dspx.costmodel import estimate as E

# round numbers so that the hand arithmetic stays exact
P = {"clock_hz": 1e9, "mma_int8_macs_per_cycle": 1024, "vector_fp32_macs_per_cycle": 16,
     "l2_bytes": 2 ** 20, "ddr_bandwidth_bytes_per_cycle": 8, "kernel_call_overhead_cycles": 100}


def _w(name, shape):
    return numpy_helper.from_array(np.full(shape, 0.01, np.float32), name)


def small_model():
    """x (1,3,8,8) -> conv a 3x3 (3->4, pad 1) + Relu = r -> conv b 1x1 (4->4) + Add(r) + Relu
    -> MaxPool 2x2/2 (1,4,4,4) -> Flatten (1,64) -> Gemm (64->10)."""
    nodes = [
        helper.make_node("Conv", ["x", "wa", "ba"], ["ca"], kernel_shape=[3, 3], pads=[1, 1, 1, 1], name="conv_a"),
        helper.make_node("Relu", ["ca"], ["r"]),
        helper.make_node("Conv", ["r", "wb", "bb"], ["cb"], kernel_shape=[1, 1], name="conv_b"),
        helper.make_node("Add", ["cb", "r"], ["s"]),
        helper.make_node("Relu", ["s"], ["sr"]),
        helper.make_node("MaxPool", ["sr"], ["p"], kernel_shape=[2, 2], strides=[2, 2], name="pool"),
        helper.make_node("Flatten", ["p"], ["f"]),
        helper.make_node("Gemm", ["f", "wd", "bd"], ["y"], name="dense"),
    ]
    inits = [_w("wa", (4, 3, 3, 3)), _w("ba", (4,)), _w("wb", (4, 4, 1, 1)), _w("bb", (4,)),
             _w("wd", (64, 10)), _w("bd", (10,))]
    g = helper.make_graph(nodes, "small", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 3, 8, 8])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 10])], inits)
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])


def rows(est):
    return {r["name"]: r for r in est["layers"]}


def test_conv_dense_pool_counted_by_hand():
    est = E.estimate_onnx(small_model(), P, profile="test")
    r = rows(est)
    assert list(r) == ["conv_a", "conv_b", "pool", "dense"]  # Relu/Add fused, Flatten free
    a, b, pool, dense = r["conv_a"], r["conv_b"], r["pool"], r["dense"]
    # conv a: N·M·Ho·Wo·C·kh·kw = 1·4·8·8·3·3·3; weights 108 floats + bias 4; in 192 floats; out 256
    assert (a["kernel"], a["unit"], a["macs"]) == ("conv2d", "vector-fp32", 6912)
    assert (a["weight_bytes"], a["in_bytes"], a["out_bytes"], a["ddr_bytes"]) == (448, 768, 1024, 2240)
    # compute 6912/16 = 432 > memory 2240/8 = 280: compute-bound, + 100 per call
    assert (a["compute_cycles"], a["memory_cycles"], a["cycles"], a["bound"]) == (432, 280, 532, "compute")
    # conv b takes the residual Add (r read again) and the Relu: 1·4·8·8·4 MACs, 16 + 4 weights
    assert (b["kernel"], b["macs"]) == ("conv2d_add", 1024)
    assert (b["weight_bytes"], b["in_bytes"], b["out_bytes"]) == (80, 2048, 1024)
    # max pool: 64 outputs x 4-window; reads 256 floats, writes 64; memory-bound: 1280/8 = 160
    assert (pool["kernel"], pool["macs"], pool["ddr_bytes"]) == ("max_pool2d", 256, 1280)
    assert (pool["compute_cycles"], pool["memory_cycles"], pool["cycles"], pool["bound"]) == (16, 160, 260, "memory")
    # dense: 10 outputs x K=64; weights 640 floats + 10 bias; in 64, out 10 floats
    assert (dense["kernel"], dense["macs"], dense["ddr_bytes"]) == ("dense", 640, 2600 + 256 + 40)
    assert dense["cycles"] == 2896 / 8 + 100 and dense["bound"] == "memory"
    assert est["total_cycles"] == 532 + b["cycles"] + 260 + dense["cycles"]
    assert est["seconds"] == est["total_cycles"] / 1e9 and est["calls"] == 4
    assert est["estimate"] is True and est["profile"] == "test" and est["params"] == P


def test_int8_layers_go_to_the_mma_and_turn_memory_bound():
    r = rows(E.estimate_onnx(small_model(), P, profile="test", quantize="int8"))
    a = r["conv_a"]
    # 1-byte weights (bias stays 4-byte) and activations: 108 + 16, in 192, out 256
    assert (a["kernel"], a["unit"], a["ddr_bytes"]) == ("conv2d_q8", "mma-int8", 124 + 192 + 256)
    # compute 6912/1024 = 6.75 < memory 572/8 = 71.5: the max picks memory
    assert (a["compute_cycles"], a["memory_cycles"], a["cycles"], a["bound"]) == (6.75, 71.5, 171.5, "memory")
    assert r["pool"]["unit"] == "vector-fp32" and r["dense"]["kernel"] == "dense_q8"


def test_l2_spill_rule():
    assert E.ddr_bytes(3000, 5000, 100, l2_bytes=8000) == 8100  # the smaller (3000) fits in half of L2
    # 3000 > 4000/2: re-read once per 2000-byte chunk of the 5000: 100 + 5000 + 3000 * 3
    assert E.ddr_bytes(3000, 5000, 100, l2_bytes=4000) == 14_100
    assert E.ddr_bytes(5000, 3000, 100, l2_bytes=4000) == 14_100  # whichever operand is the smaller
    # conv a under a 800-byte L2: weights 448 > 400, in 768 -> 1024 + 768 + 448 * ceil(768/400)
    a = rows(E.estimate_onnx(small_model(), dict(P, l2_bytes=800), profile="test"))["conv_a"]
    assert a["ddr_bytes"] == 1024 + 768 + 448 * 2


def test_the_later_of_two_convs_meeting_in_an_add_takes_it():
    """ResNet's downsampling block: main conv p, then shortcut conv q, Add(p, q), Relu. When p
    runs, q's output does not exist yet, so q's call takes the Add with p's output as residual."""
    nodes = [helper.make_node("Conv", ["x", "wp"], ["p"], kernel_shape=[1, 1], name="main"),
             helper.make_node("Conv", ["x", "wq"], ["q"], kernel_shape=[1, 1], name="shortcut"),
             helper.make_node("Add", ["p", "q"], ["s"]), helper.make_node("Relu", ["s"], ["y"])]
    g = helper.make_graph(nodes, "block", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 4, 8, 8])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 4, 8, 8])],
                          [_w("wp", (4, 4, 1, 1)), _w("wq", (4, 4, 1, 1))])
    r = rows(E.estimate_onnx(helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)]), P, profile="t"))
    assert list(r) == ["main", "shortcut"]
    assert (r["main"]["kernel"], r["main"]["in_bytes"]) == ("conv2d", 1024)
    assert (r["shortcut"]["kernel"], r["shortcut"]["in_bytes"]) == ("conv2d_add", 2048)  # x + residual p


def test_subgraph_and_no_kernel_rows_say_so():
    est = E.estimate_onnx(small_model(), P, profile="test", offloaded=["ca", "cb", "p"])
    assert [r["kernel"] for r in est["layers"]] == ["onnx_subgraph:Conv", "onnx_subgraph:Conv",
                                                   "onnx_subgraph:MaxPool", "dense"]
    est = E.estimate_onnx(small_model(), P, profile="test", kernels=False)
    assert {r["kernel"] for r in est["layers"]} == {"tvm:Conv", "tvm:MaxPool", "tvm:Gemm"}


TINY = {"n_layers": 2, "dim": 64, "n_heads": 2, "n_kv": 1, "head_dim": 32, "ffn": 128, "vocab": 256,
        "chunk": 16, "kv_dtype": "float32"}


def test_llm_decode_is_weight_bytes_over_bandwidth():
    est = E.estimate_llm(TINY, dict(P, kernel_call_overhead_cycles=0), profile="test", position=0)
    d = est["decode"]
    # per layer, Q4_1 (20 B per 32 weights): qkv 64x128, o 64x64, gate_up 64x256, down 128x64
    linear = (64 * 128 + 64 * 64 + 64 * 256 + 128 * 64) * 20 / 32
    head = 256 * 64 * 34 / 32  # Q8_0 LM head
    norms = (2 * 2 + 1) * 64 * 4  # float32 norm weights
    weights = 2 * linear + head + norms
    assert weights == 64_768 and d["weight_bytes_per_token"] == weights
    # float32 activations per layer: norm 256+256 (x2), qkv 256+512, attention (KV of 1 position
    # 256 + q/k/v 512 in; 256 out + 256 KV append), o 256+256, gate_up 256+1024, down 512+256
    acts = 2 * (2 * 512 + 768 + 1280 + 512 + 1280 + 768) + 512 + (256 + 1024)
    assert acts == 13_056
    assert all(r["bound"] == "memory" for r in d["layers"])
    assert d["tok_per_s"] == pytest.approx(8 * 1e9 / (weights + acts), rel=1e-12)
    assert d["tok_per_s"] < 8 * 1e9 / weights  # the weight-bytes bound


def test_llm_prefill_is_macs_when_memory_is_free():
    est = E.estimate_llm(TINY, dict(P, kernel_call_overhead_cycles=0, ddr_bandwidth_bytes_per_cycle=1e12),
                         profile="test")
    p = est["prefill"]
    mma = 16 * (2 * (64 * 128 + 64 * 64 + 64 * 256 + 128 * 64) + 64 * 256) / 1024  # 16 tokens
    norms = 16 * 64 * 5 / 16
    attention = 2 * (2 * 2 * 32 * (16 * 17 // 2)) / 16  # token i attends to i + 1 positions
    assert p["total_cycles"] == pytest.approx(mma + norms + attention, rel=1e-6)
    assert p["tok_per_s"] == pytest.approx(16 / (p["total_cycles"] / 1e9))
    assert est["decode"]["position"] == 16  # decode one chunk into the context by default


def test_missing_params_are_named():
    with pytest.raises(E.EstimateError, match="l2_bytes, ddr_bandwidth"):
        E.rates({"clock_hz": 1e9, "mma_int8_macs_per_cycle": 1, "mma_fp32_macs_per_cycle": 1,
                 "kernel_call_overhead_cycles": 0})


def test_reprice_and_format():
    est = E.estimate_onnx(small_model(), P, profile="test")
    other = dict(P, ddr_bandwidth_bytes_per_cycle=1)
    again = E.reprice(json.loads(json.dumps(est)), other, "other")
    assert again["total_cycles"] == E.estimate_onnx(small_model(), other, profile="other")["total_cycles"]
    text = E.format_estimate(est)
    assert "ESTIMATE on test" in text and "not a measurement" in text and "assumed:" in text
    for word in ("clock 1,000,000,000 Hz", "MMA int8 1,024", "vector fp32 16", "L2 1,048,576", "DDR 8",
                 "per call 100", "conv_a", "conv2d_add", "est. cycles", "(estimate)"):
        assert word in text
    llm = E.format_estimate(E.estimate_llm(TINY, P, profile="test"))
    assert "estimated decode" in llm and "estimated prefill" in llm and "tok/s" in llm


@pytest.fixture
def fake_profile(monkeypatch, tmp_path):
    """A user's profile file, ``c7x-test`` in the working directory: the shipped
    c7x-j722s with P's values (all assumed) and no MMA float32 rate."""
    shipped = json.loads((Path(E.__file__).parent / "profiles" / "c7x-j722s.json").read_text())
    params = {k: v for k, v in shipped["params"].items() if k != "mma_fp32_macs_per_cycle"}
    for k, v in P.items():
        params[k] = {"value": v, "unit": "-", "status": "assumed", "source": "test", "range": [v, v]}
    (tmp_path / "c7x-test").write_text(json.dumps(dict(shipped, name="c7x-test", params=params)))
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv(E.ENV, raising=False)


def test_when_requested(fake_profile, monkeypatch):
    def make(params, **kw):
        return {"params": dict(params), **kw}

    assert E.when_requested(None, make) is None  # off
    got = E.when_requested("c7x-test", make)
    assert got["profile"] == "c7x-test" and got["params"] == P and got["status"]["l2_bytes"] == "assumed"
    with pytest.raises(E.EstimateError, match="cost model 'nope': no such profile"):
        E.when_requested("nope", make)
    monkeypatch.setenv(E.ENV, "nope")  # only the device's switch: skipped, not an error
    assert E.when_requested(None, make) is None
    monkeypatch.setenv(E.ENV, "c7x-test")
    assert E.when_requested(None, make)["profile"] == "c7x-test"


def test_module_estimate_for_run_info_and_generate(fake_profile):
    est = E.estimate_onnx(small_model(), dict(P, ddr_bandwidth_bytes_per_cycle=1), profile="old")
    assert E.module_estimate({"cost_estimate": est}) is est  # dspx info: as recorded
    again = E.module_estimate({"cost_estimate": est}, "c7x-test")  # dspx run --cost-model: repriced
    assert again["profile"] == "c7x-test" and again["param_status"]["clock_hz"] == "assumed"
    assert again["total_cycles"] == E.estimate_onnx(small_model(), P, profile="x")["total_cycles"]
    assert E.module_estimate({"entry": "main"}, "c7x-test") is None  # compiled without a cost model
    llm = E.module_estimate({"model": dict(TINY, name="tiny")}, "c7x-test")  # dspx generate, from dims
    assert llm["decode"]["tok_per_s"] == E.estimate_llm(TINY, P, profile="x")["decode"]["tok_per_s"]


def test_compile_metadata_unchanged_without_and_recorded_with_a_cost_model(fake_profile, tmp_path):
    from dspx.compiler.onnx import compile_onnx

    src = tmp_path / "small.onnx"
    src.write_bytes(small_model().SerializeToString())
    plain = compile_onnx(src, tmp_path / "plain", verify=False, progress=False)
    costed = compile_onnx(src, tmp_path / "costed", verify=False, progress=False, cost_model="c7x-test")
    on_disk = json.loads((tmp_path / "plain" / "metadata.json").read_text())
    assert "cost_estimate" not in on_disk and "cost_estimate" not in plain
    recorded = json.loads((tmp_path / "costed" / "metadata.json").read_text())
    est = recorded.pop("cost_estimate")
    assert recorded == on_disk  # nothing else differs
    assert costed["cost_estimate"] == est
    assert est["profile"] == "c7x-test" and est["estimate"] is True and est["params"] == P
    assert est["total_cycles"] == sum(r["cycles"] for r in est["layers"]) and math.isclose(
        est["seconds"], est["total_cycles"] / 1e9)
    assert [r["name"] for r in est["layers"]] == ["conv_a", "conv_b", "pool", "dense"]


def test_the_shipped_c7x_profile_gives_an_estimate():
    """The shipped c7x-j722s carries every parameter an estimate needs."""
    name, params, _ = E.load_params("c7x-j722s")
    est = E.estimate_onnx(small_model(), params, profile=name)
    assert est["profile"] == "c7x-j722s" and est["total_cycles"] > 0


def test_llm_package_hook(fake_profile):
    """compile_llm's hook: nothing without a cost model, the prefill/decode estimate with one."""
    from dspx.compiler.llm.build import _cost_estimate
    from dspx.compiler.llm.sizing import Dims, LLMCompileError

    d = Dims(n_layers=2, dim=64, n_heads=2, n_kv=1, head_dim=32, ffn=128, vocab=256, theta=1e4, eps=1e-5,
             context=64, chunk=16)
    assert _cost_estimate(d, None) is None
    est = _cost_estimate(d, "c7x-test")
    assert est["profile"] == "c7x-test" and est["estimate"] is True
    assert est["decode"]["tok_per_s"] == E.estimate_llm(TINY, P, profile="x", position=16)["decode"]["tok_per_s"]
    with pytest.raises(LLMCompileError, match="cost model 'nope': no such profile"):
        _cost_estimate(d, "nope")
