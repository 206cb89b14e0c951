"""``dspx compile --weights float16|int8``: weights stored small, restored on the
device, outputs against onnxruntime on the float32 model.

The VGG19 case (the onnx wheel's light_vgg19 re-weighted at random, ~550 MB
of float32 weights, which does not fit the board's 468 MiB staging) is built
and compiled once per compiler version, cached under ~/.cache/dspx, in a
session fixture; it runs on a device with the default sizes."""
from __future__ import annotations

import hashlib
import json
import os
import time
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from dspx import memory
from dspx.compiler import examples
from dspx.compiler.onnx import compile_onnx
from dspx.compiler.weights import quantize_int8
from dspx.host.vm import VirtualMachine

from conftest import Device

CACHE = Path(os.environ.get("DSPX_CACHE", Path.home() / ".cache" / "dspx")) / "weights-precision"


def _ort(path, x: np.ndarray) -> np.ndarray:
    sess = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    return sess.run(None, {sess.get_inputs()[0].name: x})[0]


def _small_net(path: Path) -> Path:
    """conv(16) -> relu -> conv(32, stride 2) + residual-free -> flatten -> gemm(10)."""
    rng = np.random.default_rng(1)

    def init(name, shape, fan_in):
        return numpy_helper.from_array((rng.standard_normal(shape) * np.sqrt(2 / fan_in)).astype(np.float32), name)

    inits = [init("w1", (16, 3, 3, 3), 27), init("b1", (16,), 1e4), init("w2", (32, 16, 3, 3), 144),
             init("w3", (10, 32 * 4 * 4), 512), init("b3", (10,), 1e4)]
    nodes = [helper.make_node("Conv", ["x", "w1", "b1"], ["c1"], pads=[1, 1, 1, 1]),
             helper.make_node("Relu", ["c1"], ["r1"]),
             helper.make_node("Conv", ["r1", "w2"], ["c2"], pads=[1, 1, 1, 1], strides=[2, 2]),
             helper.make_node("Relu", ["c2"], ["r2"]),
             helper.make_node("Flatten", ["r2"], ["f"]),
             helper.make_node("Gemm", ["f", "w3", "b3"], ["y"], transB=1)]
    g = helper.make_graph(nodes, "small", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 3, 8, 8])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 10])], inits)
    onnx.save(helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)]), path)
    return path


def _rounded_here(model: onnx.ModelProto, mode: str) -> onnx.ModelProto:
    """The float32 model with its weights (>= 64 elements; the biases are smaller)
    rounded as docs/compiler.md states: float16, or int8 per output channel with
    S = max|W| / 127 (a conv filter's axis 0; Gemm transB=1 matrix's axis 0)."""
    for init in model.graph.initializer:
        w = numpy_helper.to_array(init)
        if w.size < 64:
            continue
        if mode == "float16":
            back = w.astype(np.float16).astype(np.float32)
        else:
            s = (np.abs(w).reshape(len(w), -1).max(1) / np.float32(127)).astype(np.float32)
            s = s.reshape((-1,) + (1,) * (w.ndim - 1))
            back = np.clip(np.rint(w / s), -127, 127).astype(np.int8).astype(np.float32) * s
        init.CopyFrom(numpy_helper.from_array(back, init.name))
    return model


def test_int8_is_per_channel_symmetric():
    w = np.array([[0.5, -1.0, 0.25], [2.0, 0.0, -4.0]], np.float32)
    q, s = quantize_int8(w, 0)
    np.testing.assert_allclose(s.ravel(), [1.0 / 127, 4.0 / 127])
    assert q.dtype == np.int8 and q[0, 1] == -127 and q[1, 2] == -127 and q[1, 1] == 0
    assert np.max(np.abs(q * s - w)) <= s.max() / 2 + 1e-7


@pytest.mark.parametrize("mode", ["float16", "int8"])
def test_small_net_reduced_weights(tmp_path, mode, shared_device):
    from dspx.host.verifier import DeviceVerifier

    src = _small_net(tmp_path / "small.onnx")
    meta = compile_onnx(src, tmp_path / mode, weights=mode, progress=False,
                        verifier=DeviceVerifier(shared_device.path))  # verify on the module's device
    prec = meta["weights_precision"]
    assert meta["weights"]["mode"] == "separate"
    if mode == "int8":
        # the three matrices are int8 (+ float32 scales); biases are too small to be weights
        assert (prec["int8"], prec["float16"]) == (3, 0)
        assert {"dspx.kernels.conv2d_qw", "dspx.kernels.dense_qw"} <= set(meta["kernel_imports"])
    else:
        assert (prec["int8"], prec["float16"]) == (0, 3)
    assert prec["stored_bytes"] < prec["float32_bytes"] * (0.3 if mode == "int8" else 0.55)
    # the weights file is what the device holds: int8/float16 tensors, not float32
    wbytes = (tmp_path / mode / "weights.bin").stat().st_size
    assert wbytes < prec["float32_bytes"] * (0.35 if mode == "int8" else 0.6)
    x = np.random.default_rng(5).standard_normal((1, 3, 8, 8)).astype(np.float32)
    vm = VirtualMachine(tmp_path / mode, socket=shared_device.path, staging_size=4 << 20, kv_size=0)
    try:
        y = np.array(vm["main"](x))
    finally:
        vm.close()
    # exact against the float32 graph with the weights rounded here (not by reduce_weights) ...
    onnx.save(_rounded_here(onnx.load(src), mode), tmp_path / "rounded.onnx")
    np.testing.assert_allclose(y, _ort(tmp_path / "rounded.onnx", x), atol=1e-5)
    # ... and close to float32: the stated error
    ref = _ort(src, x)
    rel = np.max(np.abs(y - ref)) / np.max(np.abs(ref))
    bound = 0.02 if mode == "int8" else 0.002
    print(f"\nsmall net --weights {mode}: {rel:.2e} of max |output| vs float32")
    assert rel < bound, f"{mode}: {rel:.2e} of max |output| vs float32"
    # the compiler states the same kind of figure (on its own random inputs)
    assert 0 < meta["verify"]["error_vs_float32"]["y"]["rel"] < bound


# ---------------------------------------------------------------- VGG19

@pytest.fixture(scope="session")
def vgg19():
    """{mode: (module dir, compile seconds or None when cached)} plus the ONNX path."""
    import tvm

    import dspx.compiler

    CACHE.mkdir(parents=True, exist_ok=True)
    src = examples.light("vgg19", CACHE / f"light-vgg19-{examples.SEED}.onnx")
    h = hashlib.sha256(tvm.__version__.encode())
    root = Path(dspx.compiler.__file__).parent
    for f in [*sorted(root.glob("*.py")), *sorted((root.parent / "abi").glob("*.py"))]:
        h.update(f.read_bytes())
    out = {"onnx": src}
    for mode in ("float16", "int8"):
        d = CACHE / f"vgg19-{mode}-{h.hexdigest()[:16]}"
        took = None
        if not (d / "metadata.json").is_file():
            t0 = time.perf_counter()
            compile_onnx(src, d, weights=mode, progress=False, verify=False)
            took = time.perf_counter() - t0
        out[mode] = (d, took)
    return out


@pytest.mark.parametrize("mode, bound", [("float16", 0.01), ("int8", 0.25)])  # measured 0.12 % and 10 %
def test_vgg19_reduced_weights_on_the_default_device(vgg19, mode, bound):
    d, took = vgg19[mode]
    meta = json.loads((d / "metadata.json").read_text())
    so, wb = (d / "model.so").stat().st_size, (d / "weights.bin").stat().st_size
    assert meta["weights_precision"]["float32_bytes"] > memory.STAGING_SIZE  # float32 does not fit ...
    assert max(so, wb) < memory.STAGING_SIZE  # ... reduced, each staged piece does
    x = np.random.default_rng(7).standard_normal((1, 3, 224, 224)).astype(np.float32)
    dev = Device()  # default sizes: the board's staging and DDR pool
    try:
        vm = VirtualMachine(d, socket=dev.path, kv_size=0)
        try:
            y = np.array(vm["main"](x))
        finally:
            vm.close()
    finally:
        dev.stop()
    ref = _ort(vgg19["onnx"], x)
    err = float(np.max(np.abs(y - ref)))
    rel = err / float(np.max(np.abs(ref)))
    print(f"\nVGG19 --weights {mode}: {so / 2**20:.1f} MiB module + {wb / 2**20:.1f} MiB weights "
          f"(float32 {meta['weights_precision']['float32_bytes'] / 2**20:.0f} MiB); max abs error vs "
          f"onnxruntime float32 {err:.3g} = {100 * rel:.3g} % of max |output|; argmax "
          f"{'agrees' if y.argmax() == ref.argmax() else 'differs'}; compile "
          f"{'cached' if took is None else f'{took:.0f} s'}")
    assert rel < bound, f"{mode}: {rel:.3g} of max |output|"
