"""kernel_rewrite: ONNX graphs compiled with kernel calls agree with onnxruntime.

Each graph is built with onnx.helper, imported with TVM's ONNX frontend,
rewritten, compiled with tvm.compile and run in-process with
relax.VirtualMachine after register_all().
"""
from __future__ import annotations

import numpy as np
import pytest

import onnxruntime as ort  # noqa: E402
import tvm  # noqa: E402
from onnx import TensorProto, helper, numpy_helper  # noqa: E402
from tvm import relax  # noqa: E402
from tvm.relax.frontend.onnx import from_onnx  # noqa: E402

from dspx.compiler import kernel_rewrite  # noqa: E402
from dspx.device.core import kernels  # noqa: E402
from dspx.compiler import examples  # noqa: E402

kernels.register_all()
TARGET = tvm.target.Target({"kind": "llvm", "num-cores": 2})


def make_model(nodes, inputs, outputs, inits):
    g = helper.make_graph(nodes, "t", inputs, outputs,
                          [numpy_helper.from_array(v, k) for k, v in inits.items()])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    m.ir_version = 8
    return m


def vi(name, shape):  # shape None: let the checker infer it
    return helper.make_tensor_value_info(name, TensorProto.FLOAT, shape)


def run_both(model, feeds, layout="NCHW", kernels_on=True, **kw):
    # the kernels own the process-wide onnxruntime pool: share it
    ref = ort.InferenceSession(model.SerializeToString(), kernels.ort_session_options(),
                               providers=["CPUExecutionProvider"]).run(None, feeds)
    mod = from_onnx(model, keep_params_in_input=False)
    imports: list[str] = []
    if kernels_on:
        mod, imports = kernel_rewrite.rewrite(mod, TARGET, layout=layout, **kw)
    vm = relax.VirtualMachine(tvm.compile(mod, TARGET), tvm.cpu())
    out = vm["main"](*[tvm.runtime.tensor(v) for v in feeds.values()])
    outs = [out] if not isinstance(out, (list, tuple)) and hasattr(out, "numpy") else list(out)
    for got, want in zip(outs, ref):
        assert np.abs(got.numpy() - want).max() <= 1e-4, (got.numpy(), want)
    return imports


RNG = np.random.default_rng(7)


def r(*shape, scale=1.0):
    return (RNG.standard_normal(shape) * scale).astype(np.float32)


CONVS = [
    # (C, H, W, O, k, attrs)
    (3, 9, 11, 8, (3, 3), dict(pads=[1, 1, 1, 1])),
    (6, 10, 7, 9, (3, 3), dict(group=3, strides=[2, 2], pads=[1, 0, 1, 2])),
    (4, 12, 12, 8, (3, 3), dict(group=2, dilations=[2, 2], pads=[2, 2, 2, 2])),
    (8, 7, 7, 8, (3, 3), dict(group=8, pads=[1, 1, 1, 1])),  # depthwise
    (16, 5, 5, 12, (1, 1), {}),  # 1x1
    (3, 15, 15, 8, (7, 7), dict(strides=[2, 2], pads=[3, 3, 3, 3])),
]


@pytest.mark.parametrize("layout", ["NHWC", "NCHW"])
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("case", CONVS)
def test_conv_relu(case, bias, layout):
    c, h, w, o, k, attrs = case
    g = attrs.get("group", 1)
    inits = {"w": r(o, c // g, *k, scale=0.3)}
    ins = ["x", "w"]
    if bias:
        inits["b"] = r(o)
        ins.append("b")
    nodes = [helper.make_node("Conv", ins, ["c"], **attrs), helper.make_node("Relu", ["c"], ["y"])]
    m = make_model(nodes, [vi("x", [1, c, h, w])], [vi("y", None)], inits)
    imports = run_both(m, {"x": r(1, c, h, w)}, layout)
    assert imports == ["dspx.kernels.conv2d"]


@pytest.mark.parametrize("layout", ["NHWC", "NCHW"])
def test_resnet_block_pool_gemm_softmax(layout):
    """conv+bias+relu, maxpool, conv+residual+relu, global pool, Gemm, Softmax."""
    inits = {"w1": r(8, 3, 3, 3, scale=0.3), "b1": r(8), "w2": r(8, 8, 3, 3, scale=0.2),
             "b2": r(8), "wg": r(10, 8), "bg": r(10)}
    nodes = [
        helper.make_node("Conv", ["x", "w1", "b1"], ["c1"], pads=[1, 1, 1, 1]),
        helper.make_node("Relu", ["c1"], ["r1"]),
        helper.make_node("MaxPool", ["r1"], ["p1"], kernel_shape=[3, 3], strides=[2, 2],
                         pads=[1, 1, 1, 1]),
        helper.make_node("Conv", ["p1", "w2", "b2"], ["c2"], pads=[1, 1, 1, 1]),
        helper.make_node("Add", ["c2", "p1"], ["a2"]),
        helper.make_node("Relu", ["a2"], ["r2"]),
        helper.make_node("GlobalAveragePool", ["r2"], ["g"]),
        helper.make_node("Flatten", ["g"], ["f"]),
        helper.make_node("Gemm", ["f", "wg", "bg"], ["o"], transB=1),
        helper.make_node("Softmax", ["o"], ["y"], axis=1),
    ]
    m = make_model(nodes, [vi("x", [1, 3, 17, 17])], [vi("y", [1, 10])], inits)
    imports = run_both(m, {"x": r(1, 3, 17, 17)}, layout)
    assert set(imports) == {"dspx.kernels.conv2d", "dspx.kernels.conv2d_add",
                            "dspx.kernels.max_pool2d", "dspx.kernels.global_avg_pool2d",
                            "dspx.kernels.dense", "dspx.kernels.softmax"}


@pytest.mark.parametrize("layout", ["NCHW", "NHWC"])
@pytest.mark.parametrize("vec_shape", [[8], [8, 1, 1], [1, 8, 1, 1], [1, 1, 1, 8]])
def test_add_of_a_vector_is_fused_only_when_it_is_a_channel_bias(vec_shape, layout):
    """Output (1, 8, 8, 8): a (8,) vector broadcasts along W in NCHW, not channels."""
    inits = {"w": r(8, 4, 3, 3), "v": r(*vec_shape)}
    nodes = [helper.make_node("Conv", ["x", "w"], ["c"], pads=[1, 1, 1, 1]),
             helper.make_node("Add", ["c", "v"], ["y"])]
    m = make_model(nodes, [vi("x", [1, 4, 8, 8])], [vi("y", [1, 8, 8, 8])], inits)
    run_both(m, {"x": r(1, 4, 8, 8)}, layout)


@pytest.mark.parametrize("blocked", [True, False])
def test_blocked_chain(blocked):
    """16/32-channel tensors travel kernel to kernel in the backend's blocked layout."""
    inits = {"w1": r(16, 3, 3, 3, scale=0.3), "b1": r(16), "w2": r(16, 16, 3, 3, scale=0.1),
             "b2": r(16), "wd": r(16, 1, 3, 3, scale=0.3), "bd": r(16),
             "w3": r(32, 16, 1, 1, scale=0.3), "b3": r(32), "w4": r(32, 32, 3, 3, scale=0.1),
             "b4": r(32), "wg": r(5, 32), "bg": r(5)}
    nodes = [
        helper.make_node("Conv", ["x", "w1", "b1"], ["c1"], pads=[1, 1, 1, 1]),
        helper.make_node("Relu", ["c1"], ["r1"]),
        helper.make_node("MaxPool", ["r1"], ["p1"], kernel_shape=[3, 3], strides=[2, 2],
                         pads=[1, 1, 1, 1]),
        helper.make_node("Conv", ["p1", "w2", "b2"], ["c2"], pads=[1, 1, 1, 1]),
        helper.make_node("Add", ["p1", "c2"], ["a2"]),  # residual first: either order
        helper.make_node("Relu", ["a2"], ["r2"]),
        helper.make_node("Conv", ["r2", "wd", "bd"], ["cd"], pads=[1, 1, 1, 1], group=16),
        helper.make_node("Conv", ["cd", "w3", "b3"], ["c3"], strides=[2, 2]),
        helper.make_node("Relu", ["c3"], ["r3"]),
        helper.make_node("Conv", ["r3", "w4", "b4"], ["c4"], pads=[1, 1, 1, 1]),
        helper.make_node("Add", ["c4", "r3"], ["a4"]),
        helper.make_node("Relu", ["a4"], ["r4"]),
        helper.make_node("GlobalAveragePool", ["r4"], ["g"]),
        helper.make_node("Flatten", ["g"], ["f"]),
        helper.make_node("Gemm", ["f", "wg", "bg"], ["y"], transB=1),
    ]
    m = make_model(nodes, [vi("x", [1, 3, 21, 19])], [vi("y", [1, 5])], inits)
    run_both(m, {"x": r(1, 3, 21, 19)}, blocked=blocked)


def test_blocked_marks_only_kernel_to_kernel_tensors():
    """A tensor also read by generated code (here a Sigmoid) must stay plain NCHW."""
    inits = {"w1": r(16, 3, 3, 3), "w2": r(16, 16, 3, 3, scale=0.1)}
    nodes = [helper.make_node("Conv", ["x", "w1"], ["c1"], pads=[1, 1, 1, 1]),
             helper.make_node("Conv", ["c1", "w2"], ["c2"], pads=[1, 1, 1, 1]),
             helper.make_node("Sigmoid", ["c1"], ["s"]),
             helper.make_node("Add", ["c2", "s"], ["y"])]
    m = make_model(nodes, [vi("x", [1, 3, 8, 8])], [vi("y", [1, 16, 8, 8])], inits)
    run_both(m, {"x": r(1, 3, 8, 8)})
    mod, _ = kernel_rewrite.rewrite(from_onnx(m, keep_params_in_input=False), TARGET,
                                    schedule=False)
    assert "dspx.kernels.conv2d" in mod["main"].script()
    for flag in (kernel_rewrite.IN_BLOCKED, kernel_rewrite.OUT_BLOCKED):
        assert f", {flag}, 0)" not in mod["main"].script()


@pytest.mark.parametrize("attrs", [
    dict(kernel_shape=[3, 3], strides=[2, 2], pads=[1, 1, 1, 1]),
    dict(kernel_shape=[2, 2], strides=[2, 2], ceil_mode=1),
    dict(kernel_shape=[3, 3], pads=[1, 1, 1, 1], count_include_pad=1),
])
@pytest.mark.parametrize("op", ["MaxPool", "AveragePool"])
def test_pools(op, attrs):
    if op == "MaxPool":
        attrs = {k: v for k, v in attrs.items() if k != "count_include_pad"}
    m = make_model([helper.make_node(op, ["x"], ["y"], **attrs)], [vi("x", [1, 4, 9, 9])],
                   [vi("y", None)], {})
    imports = run_both(m, {"x": r(1, 4, 9, 9)}, "NCHW")
    assert imports == ["dspx.kernels." + ("max_pool2d" if op == "MaxPool" else "avg_pool2d")]


@pytest.mark.parametrize("trans_b", [0, 1])
def test_gemm_and_batched_matmul(trans_b):
    wg = r(12, 7) if trans_b else r(7, 12)
    nodes = [helper.make_node("Gemm", ["x", "wg", "bg"], ["g"], transB=trans_b),
             helper.make_node("Relu", ["g"], ["gr"]),
             helper.make_node("Reshape", ["gr", "shape"], ["g3"]),
             helper.make_node("MatMul", ["g3", "z"], ["y"])]
    inits = {"wg": wg, "bg": r(12), "shape": np.array([2, 3, 12], dtype=np.int64)}
    m = make_model(nodes, [vi("x", [6, 7]), vi("z", [2, 12, 5])], [vi("y", [2, 3, 5])], inits)
    imports = run_both(m, {"x": r(6, 7), "z": r(2, 12, 5)})
    assert imports == ["dspx.kernels.dense", "dspx.kernels.matmul"]


def test_no_kernels_path_still_matches():
    inits = {"w": r(4, 3, 3, 3)}
    m = make_model([helper.make_node("Conv", ["x", "w"], ["y"], pads=[1, 1, 1, 1])],
                   [vi("x", [1, 3, 6, 6])], [vi("y", None)], inits)
    assert run_both(m, {"x": r(1, 3, 6, 6)}, kernels_on=False) == []


def test_scheduled_codegen_without_offload():
    """offload=False: every operator stays generated code, fused and scheduled."""
    inits = {"w": r(4, 3, 3, 3), "b": r(4)}
    nodes = [helper.make_node("Conv", ["x", "w", "b"], ["c"], pads=[1, 1, 1, 1]),
             helper.make_node("Relu", ["c"], ["rl"]),
             helper.make_node("Add", ["rl", "rl"], ["a"]),
             helper.make_node("Softmax", ["a"], ["y"], axis=-1)]
    m = make_model(nodes, [vi("x", [1, 3, 64, 64])], [vi("y", [1, 4, 64, 64])], inits)
    assert run_both(m, {"x": r(1, 3, 64, 64)}, offload=False) == []


def test_fast_math_within_budget():
    mo = examples.multi_output_model()  # has Tanh
    run_both(mo, {"x": r(2, 32)}, fast_math=True)


@pytest.mark.parametrize("layout", ["NCHW", "NHWC"])
def test_example_models_match_onnxruntime(layout):
    x = np.random.default_rng(3).standard_normal((1, 3, 224, 224)).astype(np.float32)
    imports = run_both(examples.resnet18_model(), {"input": x}, layout)
    assert "dspx.kernels.conv2d_add" in imports
    mo = examples.multi_output_model()
    run_both(mo, {"x": r(2, 32)})


def test_unregistered_kernel_fails_at_vm_creation():
    """The loader creates the VM at DYN_LOAD; a missing kernel must fail there (ERR_SYMBOL)."""
    x = relax.Var("x", relax.TensorType((1, 4), "float32"))
    bb = relax.BlockBuilder()
    with bb.function("main", [x]):
        y = bb.emit(relax.call_dps_packed("dspx.kernels.no_such_kernel", [x],
                                          out_ty=relax.TensorType((1, 4), "float32")))
        bb.emit_func_output(y)
    ex = tvm.compile(bb.get(), TARGET)
    with pytest.raises(Exception, match="dspx.kernels.no_such_kernel"):
        relax.VirtualMachine(ex, tvm.cpu())


def test_rewrite_rejects_bad_arguments():
    with pytest.raises(kernel_rewrite.RewriteError):
        kernel_rewrite.rewrite("not a module", TARGET)
    with pytest.raises(kernel_rewrite.RewriteError, match="layout"):
        kernel_rewrite.rewrite(tvm.IRModule(), TARGET, layout="NCWH")


def test_detect_target_names_this_cpu():
    from dspx.compiler.target import detect_target

    t = detect_target(2)
    assert t.attrs["num-cores"] == 2 and str(t.attrs["mcpu"]) not in ("", "generic")


def test_whole_image_average_pool_is_the_blocked_global_pool():
    """An AveragePool whose window is the whole image (light ResNet-50's 7x7)
    becomes global_avg_pool2d, so the conv before it hands its output over
    blocked (no reorder); the result still matches onnxruntime."""
    inits = {"w": r(32, 16, 3, 3, scale=0.1)}
    nodes = [helper.make_node("Conv", ["x", "w"], ["c"], pads=[1, 1, 1, 1]),
             helper.make_node("AveragePool", ["c"], ["y"], kernel_shape=[7, 7])]
    m = make_model(nodes, [vi("x", [1, 16, 7, 7])], [vi("y", [1, 32, 1, 1])], inits)
    imports = run_both(m, {"x": r(1, 16, 7, 7)})
    assert imports == ["dspx.kernels.conv2d", "dspx.kernels.global_avg_pool2d"]
    mod, _ = kernel_rewrite.rewrite(from_onnx(m, keep_params_in_input=False), TARGET, schedule=False)
    assert f", {kernel_rewrite.OUT_BLOCKED}, 0)" in mod["main"].script()  # conv: layout code, act
