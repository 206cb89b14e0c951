"""``dspx compile --weights float16|int8``: weights stored in reduced precision.

The ONNX graph is rewritten before import so that each weight initializer W
becomes a smaller initializer plus the nodes that restore float32 from it:

- int8 (convolution filters, Gemm/MatMul weight matrices): per output channel
  symmetric, ``W ≈ Cast(Wq) * S`` with ``S = max|W| / 127`` over the other
  axes (broadcast shape, 1 on every axis but the channel's);
- float16 (every other weight, and the matrices in ``float16`` mode):
  ``W ≈ Cast(W16)``.

With separate weights these small tensors are what ``weights.bin`` holds,
what the device keeps in its DDR pool and what staging carries.  The kernel
rewrite hands them to the kernels as they are (``conv2d_qw``/``dense_qw`` take
the int8 filter and its scales, the plain kernels take a float16 filter); the
kernels restore float32 once per weight, cached with the prepacked weights
(docs/kernels.md).  Anything else reads the restored float32 from generated
code.  The rewritten graph is also the verification reference: it computes
with exactly the weights the device uses.
"""
from __future__ import annotations

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

MODES = ("float32", "float16", "int8")
# An initializer is a weight (an entry parameter, stored in weights.bin and
# reducible here) from this many elements up: shapes, axes and scalars must
# stay compile-time constants for the importer.
MIN_WEIGHT_ELEMENTS = 64


def rebuild_graph(g, initializers, first_nodes, drop_inputs: set[str]) -> None:
    """Give graph ``g`` these initializers and ``first_nodes`` ahead of its own
    nodes, without the graph inputs named in ``drop_inputs`` (old exporters
    list initializers as inputs)."""
    inputs = [i for i in g.input if i.name not in drop_inputs]
    nodes = list(first_nodes) + list(g.node)
    del g.initializer[:]
    g.initializer.extend(initializers)
    del g.input[:]
    g.input.extend(inputs)
    del g.node[:]
    g.node.extend(nodes)


def _channel_axes(model: onnx.ModelProto) -> dict[str, int | None]:
    """initializer name -> output-channel axis if every consumer is a conv
    filter or a weight matrix with one agreeing axis, else None."""
    axes: dict[str, set] = {}
    for node in model.graph.node:
        for i, name in enumerate(node.input):
            ax = None
            if node.op_type == "Conv" and i == 1:
                ax = 0
            elif node.op_type == "Gemm" and i == 1:
                trans = next((helper.get_attribute_value(a) for a in node.attribute if a.name == "transB"), 0)
                ax = 0 if trans else 1
            elif node.op_type == "MatMul" and i == 1:
                ax = -1
            axes.setdefault(name, set()).add(ax)
    return {k: (next(iter(v)) if len(v) == 1 else None) for k, v in axes.items()}


def quantize_int8(w: np.ndarray, axis: int) -> tuple[np.ndarray, np.ndarray]:
    """Symmetric per-channel int8 along ``axis``: (q int8, scale float32 in broadcast shape)."""
    axis %= w.ndim
    other = tuple(a for a in range(w.ndim) if a != axis)
    amax = np.max(np.abs(w), axis=other, keepdims=True).astype(np.float32)
    scale = np.where(amax > 0, amax / 127.0, 1.0).astype(np.float32)
    q = np.clip(np.rint(w / scale), -127, 127).astype(np.int8)
    return q, scale


def reduce_weights(model: onnx.ModelProto, mode: str) -> tuple[onnx.ModelProto, dict]:
    """A copy of ``model`` whose float32 weight initializers are stored as
    ``mode``; returns it and a report {tensors, float32_bytes, stored_bytes,
    int8: n, float16: n, max_rel_weight_error}."""
    if mode not in MODES:
        raise ValueError(f"weights mode must be one of {', '.join(MODES)}, got {mode!r}")
    model = onnx.ModelProto.FromString(model.SerializeToString())
    g = model.graph
    report = {"mode": mode, "float32_bytes": 0, "stored_bytes": 0, "int8": 0, "float16": 0,
              "max_rel_weight_error": 0.0}
    if mode == "float32":
        return model, report
    axes = _channel_axes(model)
    keep, nodes = [], []
    for init in g.initializer:
        w = numpy_helper.to_array(init)
        if w.dtype != np.float32 or w.size < MIN_WEIGHT_ELEMENTS:
            keep.append(init)
            continue
        name = init.name
        axis = axes.get(name)
        report["float32_bytes"] += w.nbytes
        if mode == "int8" and axis is not None and w.ndim >= 2:
            q, s = quantize_int8(w, axis)
            keep += [numpy_helper.from_array(q, name + "__q"), numpy_helper.from_array(s, name + "__scale")]
            nodes += [helper.make_node("Cast", [name + "__q"], [name + "__qf"], to=TensorProto.FLOAT,
                                       name=name + "__dequant_cast"),
                      helper.make_node("Mul", [name + "__qf", name + "__scale"], [name], name=name + "__dequant")]
            back = q.astype(np.float32) * s
            report["int8"] += 1
            report["stored_bytes"] += q.nbytes + s.nbytes
        else:
            h = w.astype(np.float16)
            keep.append(numpy_helper.from_array(h, name + "__f16"))
            nodes.append(helper.make_node("Cast", [name + "__f16"], [name], to=TensorProto.FLOAT,
                                          name=name + "__dequant_cast"))
            back = h.astype(np.float32)
            report["float16"] += 1
            report["stored_bytes"] += h.nbytes
        denom = float(np.max(np.abs(w))) or 1.0
        report["max_rel_weight_error"] = max(report["max_rel_weight_error"],
                                             float(np.max(np.abs(back - w))) / denom)
    rebuild_graph(g, keep, nodes, {i.name for i in g.initializer})
    return model, report
