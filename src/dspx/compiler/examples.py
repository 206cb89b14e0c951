"""Example ONNX models built here with ``onnx.helper``: fixed seeds, no downloads.

- ``resnet18``: the real ResNet-18 topology (1x3x224x224 float32 -> 1x1000),
  BatchNorm folded into the convolutions the way an inference export does it,
  He-initialised weights so activations stay in a sane range.
- ``multi_input``: 7 inputs of different shapes and dtypes (one int64), combined.
- ``multi_output``: 7 outputs of different shapes and dtypes (one int64).
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

OPSET = 17
SEED = 20260101


class _Graph:
    """Collects nodes and initializers; names values sequentially."""

    def __init__(self, seed: int):
        self.rng = np.random.default_rng(seed)
        self.nodes: list[onnx.NodeProto] = []
        self.inits: list[onnx.TensorProto] = []
        self._n = 0

    def name(self, prefix: str) -> str:
        self._n += 1
        return f"{prefix}_{self._n}"

    def const(self, prefix: str, value: np.ndarray) -> str:
        n = self.name(prefix)
        self.inits.append(numpy_helper.from_array(value, n))
        return n

    def op(self, op_type: str, inputs: list[str], **attrs) -> str:
        out = self.name(op_type.lower())
        self.nodes.append(helper.make_node(op_type, inputs, [out], **attrs))
        return out

    def model(self, name: str, inputs, outputs) -> onnx.ModelProto:
        graph = helper.make_graph(self.nodes, name, inputs, outputs, self.inits)
        model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET)],
                                  producer_name="dspx.compiler.examples")
        onnx.checker.check_model(model, full_check=True)
        return model


def _conv_bn(g: _Graph, x: str, cin: int, cout: int, k: int, stride: int, gain: float = 1.0) -> str:
    """Conv + BatchNorm folded into weight and bias (He init scaled by ``gain``)."""
    std = gain * np.sqrt(2.0 / (cin * k * k))
    w = (g.rng.standard_normal((cout, cin, k, k)) * std).astype(np.float32)
    # BN with random statistics, folded: w' = w * gamma/sqrt(var+eps), b' = beta - mean*gamma/sqrt(var+eps)
    gamma = g.rng.uniform(0.8, 1.2, cout)
    beta = g.rng.uniform(-0.1, 0.1, cout)
    mean = g.rng.uniform(-0.1, 0.1, cout)
    var = g.rng.uniform(0.8, 1.2, cout)
    scale = gamma / np.sqrt(var + 1e-5)
    wf = (w * scale[:, None, None, None]).astype(np.float32)
    bf = (beta - mean * scale).astype(np.float32)
    p = k // 2
    return g.op("Conv", [x, g.const("w", wf), g.const("b", bf)], kernel_shape=[k, k],
                strides=[stride, stride], pads=[p, p, p, p])


def _basic_block(g: _Graph, x: str, cin: int, cout: int, stride: int) -> str:
    y = g.op("Relu", [_conv_bn(g, x, cin, cout, 3, stride)])
    # The second conv of a residual branch starts small (like zero-init-residual,
    # but not zero) so the sum over 8 blocks does not blow up.
    y = _conv_bn(g, y, cout, cout, 3, 1, gain=0.5)
    shortcut = _conv_bn(g, x, cin, cout, 1, stride) if (stride != 1 or cin != cout) else x
    return g.op("Relu", [g.op("Add", [y, shortcut])])


def resnet18_model(seed: int = SEED) -> onnx.ModelProto:
    g = _Graph(seed)
    x = g.op("Relu", [_conv_bn(g, "input", 3, 64, 7, 2)])
    x = g.op("MaxPool", [x], kernel_shape=[3, 3], strides=[2, 2], pads=[1, 1, 1, 1])
    cin = 64
    for cout, stride in ((64, 1), (128, 2), (256, 2), (512, 2)):
        x = _basic_block(g, x, cin, cout, stride)
        x = _basic_block(g, x, cout, cout, 1)
        cin = cout
    x = g.op("Flatten", [g.op("GlobalAveragePool", [x])], axis=1)
    w = (g.rng.standard_normal((512, 1000)) * np.sqrt(1.0 / 512)).astype(np.float32)
    b = (g.rng.uniform(-0.01, 0.01, 1000)).astype(np.float32)
    y = g.op("Add", [g.op("MatMul", [x, g.const("fc_w", w)]), g.const("fc_b", b)])
    g.nodes.append(helper.make_node("Identity", [y], ["logits"]))
    return g.model("resnet18",
                   [helper.make_tensor_value_info("input", TensorProto.FLOAT, [1, 3, 224, 224])],
                   [helper.make_tensor_value_info("logits", TensorProto.FLOAT, [1, 1000])])


def multi_input_model(seed: int = SEED) -> onnx.ModelProto:
    """7 inputs -> one (1, 16) float32 output: every input reaches the result."""
    g = _Graph(seed)
    f32 = TensorProto.FLOAT
    specs = [("a", f32, [1, 16]), ("b", f32, [1, 16]), ("c", f32, [4, 4]), ("d", f32, [2, 8]),
             ("e", f32, [16]), ("idx", TensorProto.INT64, [1, 16]), ("s", TensorProto.FLOAT16, [1])]
    flat = g.const("shape", np.array([1, 16], dtype=np.int64))
    w = g.const("w", (g.rng.standard_normal((16, 16)) * 0.25).astype(np.float32))
    ab = g.op("Mul", ["a", "b"])
    cd = g.op("Sub", [g.op("Reshape", ["c", flat]), g.op("Reshape", ["d", flat])])
    x = g.op("Relu", [g.op("MatMul", [g.op("Add", [ab, cd]), w])])
    x = g.op("Add", [x, "e"])
    scale = g.op("Cast", ["s"], to=f32)
    x = g.op("Add", [x, g.op("Mul", [g.op("Cast", ["idx"], to=f32), scale])])
    g.nodes.append(helper.make_node("Identity", [x], ["y"]))
    return g.model("multi_input", [helper.make_tensor_value_info(n, t, s) for n, t, s in specs],
                   [helper.make_tensor_value_info("y", f32, [1, 16])])


def multi_output_model(seed: int = SEED) -> onnx.ModelProto:
    """One (2, 32) float32 input -> 7 outputs of different shapes/dtypes."""
    g = _Graph(seed)
    f32 = TensorProto.FLOAT
    w = g.const("w", (g.rng.standard_normal((32, 24)) * 0.2).astype(np.float32))
    h = g.op("MatMul", ["x", w])
    outs = {
        "relu": (g.op("Relu", [h]), f32, [2, 24]),
        "softmax": (g.op("Softmax", [h], axis=-1), f32, [2, 24]),
        "argmax": (g.op("ArgMax", [h], axis=1, keepdims=0), TensorProto.INT64, [2]),
        "rowsum": (g.op("ReduceSum", ["x", g.const("axes", np.array([1], dtype=np.int64))], keepdims=1),
                   f32, [2, 1]),
        "transposed": (g.op("Transpose", ["x"], perm=[1, 0]), f32, [32, 2]),
        "scaled": (g.op("Mul", ["x", g.const("k", np.array(0.5, dtype=np.float32))]), f32, [2, 32]),
        "tanh": (g.op("Tanh", [h]), f32, [2, 24]),
    }
    for name, (value, _, _) in outs.items():
        g.nodes.append(helper.make_node("Identity", [value], [name]))
    return g.model("multi_output", [helper.make_tensor_value_info("x", f32, [2, 32])],
                   [helper.make_tensor_value_info(n, t, s) for n, (_, t, s) in outs.items()])


def wide_model() -> onnx.ModelProto:
    """x (1, 64) -> small (1, 64), mid (96, 64), big (192, 64): outputs past
    one page, for capacity tests (output over capacity, result_required)."""
    f32 = TensorProto.FLOAT
    nodes = [helper.make_node("Mul", ["x", "two"], ["small"]),
             helper.make_node("Expand", ["x", "s1"], ["mid"]),
             helper.make_node("Expand", ["x", "s2"], ["big"])]
    inits = [numpy_helper.from_array(np.array(2, np.float32), "two"),
             numpy_helper.from_array(np.array([96, 64], np.int64), "s1"),
             numpy_helper.from_array(np.array([192, 64], np.int64), "s2")]
    outs = [helper.make_tensor_value_info(n, f32, s) for n, s in
            (("small", [1, 64]), ("mid", [96, 64]), ("big", [192, 64]))]
    g = helper.make_graph(nodes, "wide", [helper.make_tensor_value_info("x", f32, [1, 64])], outs, inits)
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])


def _save(model: onnx.ModelProto, path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    onnx.save(model, path)
    return path


def resnet18(path) -> Path:
    return _save(resnet18_model(), path)


def multi_input(path) -> Path:
    return _save(multi_input_model(), path)


def multi_output(path) -> Path:
    return _save(multi_output_model(), path)


def wide(path) -> Path:
    return _save(wide_model(), path)


EXAMPLES = {"resnet18": resnet18, "multi_input": multi_input, "multi_output": multi_output}


def build_all(directory) -> dict[str, Path]:
    """Write every example as ``<directory>/<name>.onnx``, skipping existing files."""
    directory = Path(directory)
    out = {}
    for name, build in EXAMPLES.items():
        path = directory / f"{name}.onnx"
        out[name] = path if path.exists() else build(path)
    return out


def random_inputs(meta: dict, seed: int = 0) -> list[np.ndarray]:
    """Inputs for a compiled module from its metadata.json: small integers
    for integer tensors (valid indices), standard normal otherwise."""
    rng = np.random.default_rng(seed)
    out = []
    for t in meta["inputs"]:
        if np.issubdtype(np.dtype(t["dtype"]), np.integer):
            out.append(rng.integers(-3, 4, t["shape"]).astype(t["dtype"]))
        else:
            out.append(rng.standard_normal(t["shape"]).astype(t["dtype"]))
    return out


# ---------------------------------------------------------------- the onnx wheel's "light" models

LIGHT_DIR = Path(onnx.__file__).parent / "backend" / "test" / "data" / "light"


def light_model(name: str, seed: int = SEED) -> onnx.ModelProto:
    """One of the onnx wheel's real architectures (``light_<name>.onnx``:
    vgg19, resnet50, shufflenet, densenet121, inception_v1/v2, squeezenet,
    bvlc_alexnet, zfnet512) with random weights in place of its
    ``ConstantOfShape(X__SHAPE)`` placeholders: He-initialised filters and
    matrices (so activations keep their scale through deep nets), small
    biases, BatchNorm statistics near identity."""
    model = onnx.load(str(LIGHT_DIR / f"light_{name}.onnx"))
    g = model.graph
    rng = np.random.default_rng(seed)
    shapes = {i.name: numpy_helper.to_array(i) for i in g.initializer if i.name.endswith("__SHAPE")}
    consumers: dict[str, list] = {}
    for node in g.node:
        for i, inp in enumerate(node.input):
            consumers.setdefault(inp, []).append((node.op_type, i))
    nodes, inits = [], [i for i in g.initializer if not i.name.endswith("__SHAPE")]
    for node in g.node:
        if node.op_type == "ConstantOfShape" and node.input[0] in shapes:
            out = node.output[0]
            shape = [int(d) for d in shapes[node.input[0]]]
            use = consumers.get(out, [("", 0)])[0]
            if len(shape) >= 2:  # filter or weight matrix: fan-in is all but the output axis
                fan_in = int(np.prod(shape[1:])) if use != ("Gemm", 1) or len(shape) != 2 else shape[1]
                value = rng.standard_normal(shape) * np.sqrt(2.0 / max(fan_in, 1))
            elif use[0] == "BatchNormalization" and use[1] in (1, 4):  # scale, variance
                value = rng.uniform(0.8, 1.2, shape)
            else:  # biases, BN shift and mean
                value = rng.uniform(-0.05, 0.05, shape)
            inits.append(numpy_helper.from_array(value.astype(np.float32), out))
            continue
        nodes.append(node)
    names = {i.name for i in inits}
    del g.node[:]
    g.node.extend(nodes)
    del g.initializer[:]
    g.initializer.extend(inits)
    kept = [i for i in g.input if i.name in names or not i.name.endswith("__SHAPE")]
    del g.input[:]
    g.input.extend(kept)
    return model


def light(name: str, path, seed: int = SEED) -> Path:
    """Save :func:`light_model` to ``path`` (built once: an existing file is kept)."""
    path = Path(path)
    if not path.is_file():
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        onnx.save(light_model(name, seed), tmp)
        tmp.replace(path)
    return path
