"""``dspx compile --quantize int8 --calibrate inputs.npz`` (docs/quantize.md).

References: the int8 kernels against numpy doing the same quantize /
integer-product / dequantize arithmetic; the compiled module, run on a
device, against onnxruntime's own ``quantize_static`` QDQ model of the same
graph calibrated on the same samples, and its top-1 against float32."""
from __future__ import annotations

import json

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from click.testing import CliRunner
from onnx import TensorProto, helper, numpy_helper

from dspx import cache
from dspx.compiler import compiler_digest
from dspx.compiler.checks import CompileError
from dspx.compiler.quantize import load_calibration, qparams
from dspx.device.core import kernels as K
from dspx.device.core.kernels import q8 as Q8
from dspx.host.vm import VirtualMachine

#: module vs onnxruntime's QDQ model: max abs error over max |QDQ logits|
QDQ_TOL = 0.05
SAMPLES = 32


def _net() -> onnx.ModelProto:
    """conv(3->16)+relu -> conv(16->16)+residual+relu -> global pool -> gemm(10)."""
    rng = np.random.default_rng(7)

    def w(*shape, fan):
        return (rng.standard_normal(shape) * np.sqrt(2.0 / fan)).astype(np.float32)

    inits = [numpy_helper.from_array(w(16, 3, 3, 3, fan=27), "w1"),
             numpy_helper.from_array((rng.standard_normal(16) * 0.1).astype(np.float32), "b1"),
             numpy_helper.from_array(w(16, 16, 3, 3, fan=144), "w2"),
             numpy_helper.from_array((rng.standard_normal(16) * 0.1).astype(np.float32), "b2"),
             numpy_helper.from_array(w(10, 16, fan=16) * 4, "wg"),
             numpy_helper.from_array((rng.standard_normal(10) * 0.1).astype(np.float32), "bg")]
    nodes = [helper.make_node("Conv", ["x", "w1", "b1"], ["c1"], pads=[1] * 4, name="conv1"),
             helper.make_node("Relu", ["c1"], ["a"]),
             helper.make_node("Conv", ["a", "w2", "b2"], ["c2"], pads=[1] * 4, name="conv2"),
             helper.make_node("Add", ["c2", "a"], ["s"]),
             helper.make_node("Relu", ["s"], ["r"]),
             helper.make_node("GlobalAveragePool", ["r"], ["p"]),
             helper.make_node("Flatten", ["p"], ["f"]),
             helper.make_node("Gemm", ["f", "wg", "bg"], ["logits"], transB=1, name="fc")]
    g = helper.make_graph(nodes, "q8net", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 3, 16, 16])],
                          [helper.make_tensor_value_info("logits", TensorProto.FLOAT, [1, 10])], inits)
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    m.ir_version = 8
    return m


def _inputs(n: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((n, 1, 3, 16, 16)).astype(np.float32)


@pytest.fixture(scope="module")
def q8(shared_device):
    """(model path, calibration path, compiled int8 module dir), cached by content hash;
    verified on the module's shared device."""
    from dspx.compiler.onnx import compile_onnx
    from dspx.host.verifier import DeviceVerifier

    model = _net()
    calib = _inputs(SAMPLES, 1)

    def build(d):
        onnx.save(model, str(d / "net.onnx"))
        np.savez(d / "calib.npz", x=calib)
        compile_onnx(d / "net.onnx", d / "q8", progress=False, quantize="int8", calibrate=d / "calib.npz",
                     verifier=DeviceVerifier(socket=shared_device.path))
    root = cache.area("quantize") / cache.digest((), model.SerializeToString(), calib.tobytes(), compiler_digest())
    cache.publish(root, build, complete="q8/metadata.json")
    return root / "net.onnx", root / "calib.npz", root / "q8"


# ---------------------------------------------------------------- kernels vs numpy

def _q(v, scale, zero):
    return np.clip(np.rint(v / scale) + zero, 0, 255)


def _dq(v, scale, zero):
    return ((_q(v, scale, zero) - zero) * scale).astype(np.float32)


def test_int8_kernels_match_numpy_arithmetic():
    rng = np.random.default_rng(3)
    x = rng.standard_normal((1, 16, 9, 9)).astype(np.float32)
    w = rng.integers(-127, 128, (32, 16, 3, 3)).astype(np.int8)
    ws = rng.uniform(5e-4, 1e-3, 32).astype(np.float32)
    b = (rng.standard_normal(32) * 0.1).astype(np.float32)
    xs, xz = qparams(x.min(), x.max())
    conv = K.conv.conv_numpy(_dq(x, xs, xz), w.astype(np.float32) * ws[:, None, None, None], b,
                         [2, 2], [1, 1, 1, 1], [1, 1], 1)
    ys, yz = qparams(conv.min(), conv.max())
    out = np.empty(conv.shape, np.float32)
    K.conv2d_q8(x, w, b, ws, (2, 2), (1, 1, 1, 1), (1, 1), 1, 0, 0, xs, xz, ys, yz, out)
    # one quantum: the reference's float rounding may land on the other side of a half step
    assert np.abs(out - _dq(conv, ys, yz)).max() <= ys * 1.001
    res = rng.standard_normal(conv.shape).astype(np.float32)
    K.conv2d_add_q8(x, w, b, res, ws, (2, 2), (1, 1, 1, 1), (1, 1), 1, 0, 1, xs, xz, ys, yz, out)
    assert np.abs(out - np.maximum(_dq(conv, ys, yz) + res, 0)).max() <= ys * 1.001
    rs, rz = qparams(0.0, conv.max())  # ReLU as the requantization's clamp at zero point 0
    K.conv2d_q8(x, w, b, ws, (2, 2), (1, 1, 1, 1), (1, 1), 1, 0, 1, xs, xz, rs, rz, out)
    assert rz == 0 and out.min() == 0.0 and np.abs(out - _dq(conv, rs, 0)).max() <= rs * 1.001

    # depthwise (groups = channels), as in ShuffleNet / MobileNet
    wg = rng.integers(-127, 128, (16, 1, 3, 3)).astype(np.int8)
    gs = rng.uniform(5e-3, 1e-2, 16).astype(np.float32)
    dw = K.conv.conv_numpy(_dq(x, xs, xz), wg.astype(np.float32) * gs[:, None, None, None], b[:16],
                       [1, 1], [1, 1, 1, 1], [1, 1], 16)
    ds_, dz_ = qparams(dw.min(), dw.max())
    og = np.empty(dw.shape, np.float32)
    K.conv2d_q8(x, wg, b[:16], gs, (1, 1), (1, 1, 1, 1), (1, 1), 16, 0, 0, xs, xz, ds_, dz_, og)
    assert np.abs(og - _dq(dw, ds_, dz_)).max() <= ds_ * 1.001

    xd = rng.standard_normal((3, 64)).astype(np.float32)
    wd = rng.integers(-127, 128, (10, 64)).astype(np.int8)
    wds = rng.uniform(5e-3, 1e-2, 10).astype(np.float32)
    bd = rng.standard_normal(10).astype(np.float32)
    ds, dz = qparams(xd.min(), xd.max())
    ref = _dq(xd, ds, dz) @ (wd.astype(np.float32) * wds[:, None]).T + bd
    od = np.empty((3, 10), np.float32)
    K.dense_q8(xd, wd, bd, wds, 1, 0, ds, dz, od)
    np.testing.assert_allclose(od, ref, atol=1e-4 * np.abs(ref).max())
    K.dense_q8(xd, np.ascontiguousarray(wd.T), bd, wds, 0, 1, ds, dz, od)
    np.testing.assert_allclose(od, np.maximum(ref, 0), atol=1e-4 * np.abs(ref).max())
    with pytest.raises(K.KernelError, match="zero point in"):
        K.dense_q8(xd, wd, bd, wds, 1, 0, ds, 300, od)
    with pytest.raises(K.KernelError, match="layout code 4"):
        K.conv2d_q8(x, w, b, ws, (2, 2), (1, 1, 1, 1), (1, 1), 1, 4, 0, xs, xz, ys, yz, out)


@pytest.mark.parametrize("weights", ["this CPU's choice", "uint8"])
def test_int8_kernels_numpy_fallback_matches_onnxruntime(weights, monkeypatch):
    """Without onnxruntime as the kernel backend the int8 kernels compute on exact
    integers in numpy: the same result within one output quantum.  onnxruntime
    gets int8 weights only where its u8s8 kernels are exact (VNNI); "uint8"
    forces the other path, so both are checked on a VNNI machine (the int8 one
    saturates without VNNI: ~27 quanta off on an AVX2-only EPYC)."""
    if weights == "uint8":
        monkeypatch.setattr(Q8, "exact_u8s8", lambda: False)
    rng = np.random.default_rng(4 if weights == "uint8" else 5)  # other weights: no cached session of the other path
    x = rng.standard_normal((1, 16, 8, 8)).astype(np.float32)
    w = rng.integers(-127, 128, (16, 16, 3, 3)).astype(np.int8)
    ws = rng.uniform(5e-4, 1e-3, 16).astype(np.float32)
    b = (rng.standard_normal(16) * 0.1).astype(np.float32)
    res = rng.standard_normal((1, 16, 8, 8)).astype(np.float32)
    xd, wd = rng.standard_normal((2, 48)).astype(np.float32), rng.integers(-127, 128, (5, 48)).astype(np.int8)
    xs, xz = qparams(x.min(), x.max())
    ys, yz = 0.02, 100

    def run():
        outs = [np.empty((1, 16, 8, 8), np.float32) for _ in range(2)] + [np.empty((2, 5), np.float32)]
        K.conv2d_q8(x, w, b, ws, (1, 1), (1, 1, 1, 1), (1, 1), 1, 0, 1, xs, xz, ys, yz, outs[0])
        K.conv2d_add_q8(x, w, b, res, ws, (1, 1), (1, 1, 1, 1), (1, 1), 1, 0, 1, xs, xz, ys, yz, outs[1])
        K.dense_q8(xd, wd, b[:5], ws[:5] * 10, 1, 1, xs, xz, outs[2])
        return outs

    assert K.backend() == "onnxruntime"
    fast = run()
    try:
        K.configure_backend("numpy")
        slow = run()
    finally:
        K.configure_backend("auto")
    assert np.abs(fast[0] - slow[0]).max() <= ys * 1.001 and np.abs(fast[1] - slow[1]).max() <= ys * 1.001
    np.testing.assert_allclose(fast[2], slow[2], atol=1e-5 * np.abs(slow[2]).max())
    assert np.abs(fast[0]).max() > 0 and np.abs(slow[2]).max() > 0


# ---------------------------------------------------------------- the compiled module

def test_int8_module_on_device_agrees_with_onnxruntime_qdq(q8, shared_device, tmp_path):
    from onnxruntime.quantization import CalibrationMethod, QuantFormat, QuantType, quantize_static

    onnx_path, npz, out = q8
    meta = json.loads((out / "metadata.json").read_text())
    assert meta["quantize"]["kernels"] == {"dspx.kernels.conv2d_q8": 1, "dspx.kernels.conv2d_add_q8": 1,
                                           "dspx.kernels.dense_q8": 1}
    assert not {"dspx.kernels.conv2d", "dspx.kernels.conv2d_add", "dspx.kernels.dense"} & set(meta["kernel_imports"])

    calib = np.load(npz)["x"]

    class Reader:
        def __init__(self):
            self.it = iter(calib)

        def get_next(self):
            x = next(self.it, None)
            return None if x is None else {"x": x}

    qdq = tmp_path / "net.qdq.onnx"
    quantize_static(str(onnx_path), str(qdq), Reader(), quant_format=QuantFormat.QDQ, per_channel=True,
                    op_types_to_quantize=["Conv", "Gemm", "MatMul"], activation_type=QuantType.QUInt8,
                    weight_type=QuantType.QInt8, calibrate_method=CalibrationMethod.MinMax)
    s_q = ort.InferenceSession(str(qdq), providers=["CPUExecutionProvider"])
    s_f = ort.InferenceSession(str(onnx_path), providers=["CPUExecutionProvider"])
    xs = np.concatenate([calib[:8], _inputs(8, 99)])  # calibration and held-out samples
    vm = VirtualMachine(out, socket=shared_device.path)
    try:
        got = np.stack([np.array(vm["main"](x)) for x in xs])
    finally:
        vm.close()
    ref_q = np.stack([s_q.run(None, {"x": x})[0] for x in xs])
    ref_f = np.stack([s_f.run(None, {"x": x})[0] for x in xs])
    rel = np.abs(got - ref_q).max() / np.abs(ref_q).max()
    assert rel <= QDQ_TOL, f"int8 module vs onnxruntime QDQ: {100 * rel:.2f} % of max |logits|"
    top1 = np.mean(got.argmax(-1) == ref_f.argmax(-1))
    assert top1 >= 0.75, f"top-1 agreement with float32 {top1:.2f}"
    # int8, not float32 run under another name: the error against float32 is a quantization error
    assert np.abs(got - ref_f).max() > 1e-4 * np.abs(ref_f).max()
    v = meta["verify"]
    assert v["samples"] == 16 and v["vs_qdq"]["logits"]["rel"] <= QDQ_TOL


# ---------------------------------------------------------------- calibration files

def test_bad_calibration_files_give_one_line_errors(tmp_path):
    model = _net()
    cases = {
        "missing": ({"y": _inputs(2, 0)}, r"no array for model input 'x' \(the file has y"),
        "extra": ({"x": _inputs(2, 0), "z": _inputs(2, 0)}, r"array 'z' is not a model input \(inputs: x\)"),
        "shape": ({"x": np.zeros((2, 1, 3, 8, 8), np.float32)},
                  r"array 'x' has shape \[2, 1, 3, 8, 8\]; input 'x' is 1x3x16x16, so the array must be "
                  r"\(samples, 1, 3, 16, 16\)"),
        "dtype": ({"x": np.zeros((2, 1, 3, 16, 16), np.int64)}, r"array 'x' is int64, input 'x' is float32"),
        "empty": ({"x": np.zeros((0, 1, 3, 16, 16), np.float32)}, r"array 'x' has 0 samples"),
        "nan": ({"x": np.full((2, 1, 3, 16, 16), np.nan, np.float32)}, r"array 'x' has 1536 NaN or infinite"),
    }
    for name, (arrays, pattern) in cases.items():
        p = tmp_path / f"{name}.npz"
        np.savez(p, **arrays)
        with pytest.raises(CompileError, match=pattern) as e:
            load_calibration(p, model)
        assert "\n" not in str(e.value)
    (tmp_path / "text.npz").write_text("not numpy")
    with pytest.raises(CompileError, match=r"text.npz: not a readable .npz of arrays"):
        load_calibration(tmp_path / "text.npz", model)
    with pytest.raises(CompileError, match=r"nothere.npz: no such file"):
        load_calibration(tmp_path / "nothere.npz", model)
    # samples stacked on the batch axis of a batch-1 input are accepted too
    np.savez(tmp_path / "flat.npz", x=_inputs(3, 0)[:, 0])
    assert load_calibration(tmp_path / "flat.npz", model)["x"].shape == (3, 1, 3, 16, 16)


def test_cli_quantize(q8, tmp_path):
    from dspx.cli import main

    onnx_path, npz, _ = q8
    r = CliRunner().invoke(main, ["compile", str(onnx_path), "-o", str(tmp_path / "m"), "--quantize", "int8",
                                  "--calibrate", str(npz), "--no-verify", "--json"])
    assert r.exit_code == 0, r.output
    meta = json.loads(r.stdout.strip().splitlines()[-1])
    assert meta["status"] == "ok" and meta["quantize"]["samples"] == SAMPLES
    assert meta["quantize"]["kernels"]["dspx.kernels.dense_q8"] == 1 and meta["verify"] is None
    r = CliRunner().invoke(main, ["compile", str(onnx_path), "-o", str(tmp_path / "n"), "--quantize", "int8"])
    assert r.exit_code == 1
    assert r.stderr.strip().splitlines()[-1] == ("error: --quantize int8 needs --calibrate inputs.npz: representative inputs, one "
                                "array per model input with the samples along the first axis")


def test_qdq_reference_of_an_old_ir3_graph_with_folded_batchnorm():
    """Caffe2-era models (IR 3, opset 9: the onnx wheel's light ResNet-50) once BatchNorm
    is folded have initializers that are not graph inputs; onnxruntime's quantizer must
    still produce the verification reference (it refused them before)."""
    from dspx.compiler.checks import fold_batchnorm
    from dspx.compiler.quantize import ort_outputs, qdq_model, samples

    m = _net()
    g = m.graph
    c = np.full(16, 1.0, np.float32)
    g.initializer.extend([numpy_helper.from_array(c * s, n) for n, s in
                          (("bn_s", 1.1), ("bn_b", 0.05), ("bn_m", 0.02), ("bn_v", 0.9))])
    nodes = list(g.node)
    nodes[0].output[0] = "c0"
    nodes.insert(1, helper.make_node("BatchNormalization", ["c0", "bn_s", "bn_b", "bn_m", "bn_v"], ["c1"]))
    del g.node[:]
    g.node.extend(nodes)
    g.input.extend(helper.make_tensor_value_info(i.name, i.data_type, list(i.dims)) for i in g.initializer)
    m.ir_version, m.opset_import[0].version = 3, 9
    float_out = ort_outputs(m, list(samples({"x": _inputs(4, 5)})))
    assert fold_batchnorm(m) == 1
    arrays = {"x": _inputs(4, 5)}
    got = ort_outputs(qdq_model(m, arrays), list(samples(arrays)))
    ref = np.stack([o[0] for o in float_out])
    err = np.abs(np.stack([o[0] for o in got]) - ref).max() / np.abs(ref).max()
    assert err < 0.05, f"QDQ vs float32 {100 * err:.2f} %"
