"""The subgraph kernel (one onnxruntime session for a run of operators) and the
compiler's partition that emits it (dspx.compiler.subgraph, docs/kernels.md).

References: a direct-loop numpy convolution (test_kernels.ref_conv) for the
kernel; onnxruntime on the original ONNX model for compiled modules.
"""
from __future__ import annotations

import json

import numpy as np
import onnx
import pytest
import tvm
from onnx import TensorProto, helper, numpy_helper

from dspx.abi.kernels import SUBGRAPH_WEIGHTS_KEY
from dspx.device.core import kernels as K

from test_kernels import ref_conv

K.register_all()
RNG = np.random.default_rng(7)
KERNEL = K.PREFIX + "onnx_subgraph"


def rand(*shape):
    return RNG.standard_normal(shape).astype(np.float32)


def _graph(nodes, inputs, outputs, n_weights, inits=(), domain_ops=()):
    g = helper.make_graph(nodes, "s", [helper.make_tensor_value_info(n, TensorProto.FLOAT, s) for n, s in inputs],
                          [helper.make_tensor_value_info(n, TensorProto.FLOAT, s) for n, s in outputs], list(inits))
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17), *domain_ops])
    m.ir_version = 8
    helper.set_model_props(m, {SUBGRAPH_WEIGHTS_KEY: str(n_weights)})
    return m


def _conv_relu_add():
    """y1 = relu(conv(x, w) + b), y2 = y1 + x: two outputs, weights w and b."""
    nodes = [helper.make_node("Conv", ["x", "w", "b"], ["c"], pads=[1, 1, 1, 1]),
             helper.make_node("Relu", ["c"], ["y1"]), helper.make_node("Add", ["y1", "x"], ["y2"])]
    return _graph(nodes, [("x", [1, 8, 6, 6]), ("w", [8, 8, 3, 3]), ("b", [8])],
                  [("y1", [1, 8, 6, 6]), ("y2", [1, 8, 6, 6])], 2)


def _u8(model) -> tvm.runtime.Tensor:
    return tvm.runtime.tensor(np.frombuffer(model.SerializeToString(), dtype=np.uint8).copy())


def test_subgraph_kernel_matches_a_reference_and_follows_new_data():
    g = _u8(_conv_relu_add())
    x, w, b = rand(1, 8, 6, 6), rand(8, 8, 3, 3), rand(8)
    tx, tw, tb = (tvm.runtime.tensor(a) for a in (x, w, b))
    o1, o2 = (tvm.runtime.tensor(np.full((1, 8, 6, 6), np.nan, np.float32)) for _ in range(2))
    fn = tvm.get_global_func(KERNEL)
    for _ in range(2):  # the second call replays the bound run: new data in the same buffer
        fn(g, tx, tw, tb, o1, o2)
        want = np.maximum(ref_conv(x, w, b, (1, 1), (1, 1, 1, 1), (1, 1), 1), 0)
        np.testing.assert_allclose(o1.numpy(), want, atol=1e-4, rtol=0)
        np.testing.assert_allclose(o2.numpy(), want + x, atol=1e-4, rtol=0)
        x = rand(1, 8, 6, 6)
        tx.copyfrom(x)
    K.clear_caches()


def _call(model_or_bytes, tensors, n_out=2, shape=(1, 8, 6, 6)):
    g = model_or_bytes if isinstance(model_or_bytes, tvm.runtime.Tensor) else _u8(model_or_bytes)
    outs = [tvm.runtime.tensor(np.zeros(shape, np.float32)) for _ in range(n_out)]
    K.onnx_subgraph(g, *(tvm.runtime.tensor(a) for a in tensors), *outs)


def test_subgraph_kernel_refuses_what_the_firmware_does_not_run():
    x, w, b = rand(1, 8, 6, 6), rand(8, 8, 3, 3), rand(8)
    with pytest.raises(K.KernelError, match="not a serialized ONNX model"):
        _call(tvm.runtime.tensor(np.frombuffer(b"\xff" * 40, np.uint8).copy()), [x, w, b])
    with pytest.raises(K.KernelError, match="1-D uint8"):
        _call(tvm.runtime.tensor(rand(4)), [x, w, b])
    with pytest.raises(K.KernelError, match="3 inputs and 2 outputs, the call passes 3 inputs and 1 outputs"):
        _call(_conv_relu_add(), [x, w, b], n_out=1)
    with pytest.raises(K.KernelError, match=r"input 'w' is \[8, 8, 3, 3\] in the graph, the call passes \[8, 8, 1, 3\]"):
        _call(_conv_relu_add(), [x, rand(8, 8, 1, 3), b])
    with pytest.raises(K.KernelError, match="output 'y1' must be float32"):
        g = _u8(_conv_relu_add())
        outs = [tvm.runtime.tensor(np.zeros((1, 8, 6, 6), np.float64)),
                tvm.runtime.tensor(np.zeros((1, 8, 6, 6), np.float32))]
        K.onnx_subgraph(g, *(tvm.runtime.tensor(a) for a in (x, w, b)), *outs)
    erf = _graph([helper.make_node("Erf", ["x"], ["y"], name="the_erf")], [("x", [1, 8, 6, 6])],
                 [("y", [1, 8, 6, 6])], 0)
    with pytest.raises(K.KernelError, match="node 'the_erf' is ai.onnx.Erf, not an operator the firmware runs"):
        _call(erf, [x], n_out=1)
    custom = _graph([helper.make_node("Relu", ["x"], ["y"], domain="com.example")], [("x", [1, 8, 6, 6])],
                    [("y", [1, 8, 6, 6])], 0, domain_ops=[helper.make_opsetid("com.example", 1)])
    with pytest.raises(K.KernelError, match="domain 'com.example'"):
        _call(custom, [x], n_out=1)
    ext = numpy_helper.from_array(np.ones(8, np.float32), "s")
    ext.data_location = TensorProto.EXTERNAL
    ext.external_data.add(key="location", value="/etc/passwd")
    ext.ClearField("raw_data")
    far = _graph([helper.make_node("Add", ["x", "s"], ["y"])], [("x", [1, 8, 6, 6])], [("y", [1, 8, 6, 6])], 0,
                 inits=[ext])
    with pytest.raises(K.KernelError, match="'s' refers to external data"):
        _call(far, [x], n_out=1)
    bad_count = _conv_relu_add()
    helper.set_model_props(bad_count, {SUBGRAPH_WEIGHTS_KEY: "9"})
    with pytest.raises(K.KernelError, match="is not a count of the graph's 3 inputs"):
        _call(bad_count, [x, w, b])
    # after every refusal the kernel still serves a good call
    test_subgraph_kernel_matches_a_reference_and_follows_new_data()


# ---------------------------------------------------------------- the compiler's partition

def _model(path):
    """conv -> relu -> maxpool -> Erf (not offloadable) -> conv + residual -> relu:
    a subgraph of three operators, then TVM code and op-by-op kernels."""
    w1, b1, w2 = rand(16, 3, 3, 3) * 0.3, rand(16), rand(16, 16, 3, 3) * 0.1
    nodes = [helper.make_node("Conv", ["x", "w1", "b1"], ["c1"], pads=[1, 1, 1, 1]),
             helper.make_node("Relu", ["c1"], ["r1"]),
             helper.make_node("MaxPool", ["r1"], ["p1"], kernel_shape=[2, 2], strides=[2, 2]),
             helper.make_node("Erf", ["p1"], ["e"]),
             helper.make_node("Conv", ["e", "w2"], ["c2"], pads=[1, 1, 1, 1]),
             helper.make_node("Add", ["c2", "p1"], ["a"]), helper.make_node("Relu", ["a"], ["y"])]
    g = helper.make_graph(nodes, "m", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 3, 16, 16])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 16, 8, 8]),
                           helper.make_tensor_value_info("p1", TensorProto.FLOAT, [1, 16, 8, 8])],
                          [numpy_helper.from_array(a, n) for n, a in (("w1", w1), ("b1", b1), ("w2", w2))])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    m.ir_version = 8
    onnx.save(m, path)
    return path


@pytest.fixture(scope="module")
def verifier():
    from dspx.host.verifier import DeviceVerifier

    with DeviceVerifier() as v:
        yield v


@pytest.mark.parametrize("separate", [False, True])
def test_partitioned_module_matches_onnxruntime_on_the_device(tmp_path, separate, verifier):
    import onnxruntime as ort

    from dspx.compiler.onnx import compile_onnx

    src = _model(tmp_path / "m.onnx")
    meta = compile_onnx(src, tmp_path / "out", progress=False, separate_weights=separate, subgraph=True,
                        verifier=verifier)
    (part,) = meta["subgraphs"]
    assert part["ops"] == {"Conv": 1, "Relu": 1, "MaxPool": 1} and part["rest_nodes"] == 4
    assert part["outputs"] == ["p1"] and part["weights"] == 1  # b1 (16 values) stays in the graph
    assert "dspx.kernels.onnx_subgraph" in meta["kernel_imports"]
    assert "dspx.kernels.conv2d_add" in meta["kernel_imports"]  # the rest still gets op-by-op kernels
    assert meta["verify"]["reference"] == "onnxruntime"
    assert json.loads((tmp_path / "out" / "metadata.json").read_text())["subgraphs"] == [part]
    x = rand(1, 3, 16, 16)
    want = ort.InferenceSession(str(src), providers=["CPUExecutionProvider"]).run(None, {"x": x})
    got = verifier.run(tmp_path / "out", [x])
    assert len(got) == 2
    for g, r in zip(got, want):
        assert np.max(np.abs(np.asarray(g) - r)) <= 1e-4


def test_partition_off_and_not_offloadable_models_keep_the_op_by_op_path(tmp_path):
    from dspx.compiler import subgraph

    m = onnx.load(_model(tmp_path / "m.onnx"))
    assert subgraph.partition(m) is not None
    # a graph that starts with an operator outside SUBGRAPH_OPS has no prefix to offload
    m.graph.node.insert(0, helper.make_node("Erf", ["x"], ["x_erf"]))
    m.graph.node[1].input[0] = "x_erf"
    assert subgraph.partition(m) is None
    # elementwise only: nothing heavy, not worth a call
    g = helper.make_graph([helper.make_node("Relu", ["x"], ["y"])], "r",
                          [helper.make_tensor_value_info("x", TensorProto.FLOAT, [4])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, [4])])
    assert subgraph.partition(helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])) is None


def test_one_session_per_graph_and_weights_whatever_the_data():
    """Two address sets of one call site (the VM alternates them) with different
    data share one session: only the weights key it."""
    K.clear_caches()
    g = _u8(_conv_relu_add())
    w, b = (tvm.runtime.tensor(a) for a in (rand(8, 8, 3, 3), rand(8)))
    fn = tvm.get_global_func(KERNEL)
    for _ in range(2):
        x = rand(1, 8, 6, 6)
        o1, o2 = (tvm.runtime.tensor(np.zeros((1, 8, 6, 6), np.float32)) for _ in range(2))
        fn(g, tvm.runtime.tensor(x), w, b, o1, o2)
        np.testing.assert_allclose(o2.numpy(), np.maximum(ref_conv(x, w.numpy(), b.numpy(), (1, 1), (1, 1, 1, 1),
                                                                    (1, 1), 1), 0) + x, atol=1e-4, rtol=0)
    assert sum(isinstance(v[1], K.subgraph.Subgraph) for v in K.caches.weights.values()) == 1
    K.clear_caches()


def test_cli_offloads_by_default_and_op_by_op_keeps_one_call_per_operator(tmp_path, monkeypatch):
    from click.testing import CliRunner

    from dspx.cli import main

    monkeypatch.delenv("DSPX_SUBGRAPH", raising=False)
    src = str(_model(tmp_path / "m.onnx"))
    metas = {}
    for name, extra in (("default", []), ("op-by-op", ["--op-by-op"])):
        r = CliRunner().invoke(main, ["compile", src, "-o", str(tmp_path / name), "--no-verify", "--json", *extra])
        assert r.exit_code == 0, r.output
        metas[name] = json.loads(r.output[r.output.index("{"):])
    (part,) = metas["default"]["subgraphs"]
    assert part["ops"] == {"Conv": 1, "Relu": 1, "MaxPool": 1}
    assert "dspx.kernels.onnx_subgraph" in metas["default"]["kernel_imports"]
    assert metas["op-by-op"]["subgraphs"] == []
    assert "dspx.kernels.onnx_subgraph" not in metas["op-by-op"]["kernel_imports"]
    assert "dspx.kernels.conv2d" in " ".join(metas["op-by-op"]["kernel_imports"])


def test_a_call_site_whose_weight_changed_in_place_rebuilds_its_session():
    """The replayed run holds a copy of the weights; one rewritten in place
    (a weight fed as an input) fails the sample check and is baked in again."""
    K.clear_caches()
    g = _u8(_conv_relu_add())
    x, w, b = rand(1, 8, 6, 6), rand(8, 8, 3, 3), rand(8)
    tx, tw, tb = (tvm.runtime.tensor(a) for a in (x, w, b))
    o1, o2 = (tvm.runtime.tensor(np.zeros((1, 8, 6, 6), np.float32)) for _ in range(2))
    fn = tvm.get_global_func(KERNEL)
    for w in (w, rand(8, 8, 3, 3)):
        tw.copyfrom(w)
        fn(g, tx, tw, tb, o1, o2)
        np.testing.assert_allclose(o1.numpy(), np.maximum(ref_conv(x, w, b, (1, 1), (1, 1, 1, 1), (1, 1), 1), 0),
                                   atol=1e-4, rtol=0)
    K.clear_caches()
