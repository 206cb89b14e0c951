"""The integer reference of an int8 module (``quantize.verify``, docs/quantize.md).

The float32 graph the compiler imported is evaluated by onnx's numpy
reference evaluator (``onnx.reference``), with every Conv, Gemm and MatMul
that was lowered to an int8 kernel replaced by the integer arithmetic
docs/quantize.md states.  It is written from those formulas, not from the
compiler's helpers (``quantize.qparams``, ``weights.quantize_int8``) or the
kernels, and it does not run onnxruntime, so neither a wrong scale nor a
saturating int8 kernel can hide in it:

- activations: the calibrated range widened to contain 0,
  ``scale = (max - min) / 255`` (stored as float32, as ONNX does),
  ``zero = round(-min / scale)``; ``q = clip(round(x / scale) + zero, 0, 255)``
  with float32 division and round-half-to-even (ONNX QuantizeLinear);
- weights: per output channel ``S = max|W| / 127``, ``round(W / S)`` in [-127, 127];
- bias: ``round(b / (scale * S))``;
- the product: exact integer sums (float64 BLAS on integers: every partial
  sum is below 2**53);
- Conv: requantized with its output range (a Conv whose only consumer is a
  Relu: output range from 0), ``round(acc * r)`` with onnxruntime's rounding
  by default: ``acc`` as float32 times ``r = scale * S / out_scale`` computed
  in float32 (exact float64 with ``float32_requant=False``: single quanta
  differ where a sum is within float32 precision of a half step, and on a
  deep net those cascade: 0.76 quanta at ResNet-18's logits against 5e-4
  with onnxruntime's rule); then dequantized to float32.
- Gemm/MatMul: ``acc * scale * S`` as float32.
"""
from __future__ import annotations

import numpy as np
import onnx
from onnx import helper, numpy_helper
from onnx.reference.op_run import OpRun

DOMAIN = "dspx.int8ref"
#: the ONNX operators this reference computes in integers (the rest: onnx.reference, float32)
COVERED = ("Conv", "Gemm", "MatMul")


def uint8_params(lo: float, hi: float) -> tuple[np.float32, int]:
    """(scale, zero point) of the range [lo, hi] once it contains 0 (docs/quantize.md)."""
    lo, hi = min(float(lo), 0.0), max(float(hi), 0.0)
    width = hi - lo
    if not (np.isfinite(width) and width > 0):
        return np.float32(1.0), 0
    return np.float32(width / 255.0), int(min(255, max(0, round(-lo / (width / 255.0)))))


def quantize_uint8(x: np.ndarray, scale: np.float32, zero: int) -> np.ndarray:
    """Integer-valued float64 q - zero (ONNX QuantizeLinear: float32 x / scale, half to even)."""
    q = np.rint(np.asarray(x, np.float32) / np.float32(scale)).astype(np.float64) + zero
    return np.clip(q, 0, 255) - zero


def int8_channels(w: np.ndarray, axis: int) -> tuple[np.ndarray, np.ndarray]:
    """(integer-valued float64 weights, float64 scale per channel along ``axis``)."""
    moved = np.moveaxis(np.asarray(w, np.float32), axis, 0)
    s = (np.abs(moved).reshape(len(moved), -1).max(1) / np.float32(127.0)).astype(np.float32)
    s[s == 0] = 1.0
    q = np.clip(np.rint(moved / s.reshape((-1,) + (1,) * (moved.ndim - 1))), -127, 127)
    return np.moveaxis(q, 0, axis).astype(np.float64), s.astype(np.float64)


def conv_sums(x: np.ndarray, w: np.ndarray, strides, pads, dilations, groups: int) -> np.ndarray:
    """NCHW x OIHW convolution of integer-valued float64 arrays, exact (im2col + matmul)."""
    n, c, h, wd = x.shape
    o, cg, kh, kw = w.shape
    (sh, sw), (dh, dw) = strides, dilations
    xp = np.pad(x, ((0, 0), (0, 0), (pads[0], pads[2]), (pads[1], pads[3])))
    oh = (xp.shape[2] - dh * (kh - 1) - 1) // sh + 1
    ow = (xp.shape[3] - dw * (kw - 1) - 1) // sw + 1
    cols = np.stack([xp[:, :, i * dh:i * dh + sh * (oh - 1) + 1:sh, j * dw:j * dw + sw * (ow - 1) + 1:sw]
                     for i in range(kh) for j in range(kw)], axis=2)  # n, c, kh*kw, oh, ow
    cols = cols.reshape(n, groups, cg * kh * kw, oh * ow)
    acc = w.reshape(groups, o // groups, cg * kh * kw) @ cols  # n, groups, o/groups, oh*ow
    return acc.reshape(n, o, oh, ow)


def _auto_pads(auto_pad: str, x_shape, w_shape, strides, dilations) -> list[int]:
    """Explicit [top, left, bottom, right] pads for ONNX's SAME_UPPER / SAME_LOWER / VALID."""
    if auto_pad == "VALID":
        return [0, 0, 0, 0]
    begin, end = [], []
    for size, k, s, d in zip(x_shape[2:], w_shape[2:], strides, dilations):
        total = max(0, (-(-size // s) - 1) * s + (k - 1) * d + 1 - size)
        small = total // 2
        begin.append(small if auto_pad == "SAME_UPPER" else total - small)
        end.append(total - begin[-1])
    return begin + end


class QConv(OpRun):
    op_domain = DOMAIN

    def _run(self, x, w, b=None, strides=None, pads=None, dilations=None, group=None, auto_pad=None,
             in_scale=None, in_zero=None, out_scale=None, out_zero=None, float32_requant=1, **_):
        strides, dilations = strides or [1, 1], dilations or [1, 1]
        if auto_pad and auto_pad not in ("NOTSET", b"NOTSET"):
            pads = _auto_pads(auto_pad.decode() if isinstance(auto_pad, bytes) else auto_pad, x.shape, w.shape,
                              strides, dilations)
        xs, ys = np.float32(in_scale), np.float32(out_scale)
        wq, ws = int8_channels(w, 0)
        acc = conv_sums(quantize_uint8(x, xs, in_zero), wq, strides, pads or [0, 0, 0, 0], dilations, group or 1)
        if b is not None:
            acc += np.rint(b.astype(np.float64) / (float(xs) * ws)).reshape(1, -1, 1, 1)
        if float32_requant:  # onnxruntime's QLinearConv (MLAS): float32 sum times a float32 ratio
            y = acc.astype(np.float32) * ((xs * ws.astype(np.float32)) / ys).reshape(1, -1, 1, 1)
        else:
            y = acc * (float(xs) * ws / float(ys)).reshape(1, -1, 1, 1)
        yq = np.clip(np.rint(y) + out_zero, 0, 255)
        return ((yq - out_zero) * float(ys)).astype(np.float32),


class QDense(OpRun):
    """Gemm (transA 0, alpha = beta = 1) or MatMul with a 2-D weight."""
    op_domain = DOMAIN

    def _run(self, x, w, b=None, transB=0, in_scale=None, in_zero=None, **_):
        xs = np.float32(in_scale)
        wq, ws = int8_channels(w, 0 if transB else 1)
        k = wq.shape[1] if transB else wq.shape[0]
        acc = quantize_uint8(x, xs, in_zero).reshape(-1, k) @ (wq.T if transB else wq)
        if b is not None:
            acc += np.rint(np.broadcast_to(b, ws.shape).astype(np.float64) / (float(xs) * ws))
        y = (acc * (float(xs) * ws)).astype(np.float32)
        return y.reshape(x.shape[:-1] + (y.shape[-1],)),


def _covered(node, inits) -> str | None:
    """Why the integer reference cannot stand for this lowered node, or None."""
    w = inits.get(node.input[1]) if len(node.input) > 1 else None
    attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
    if w is None or (node.op_type == "Conv" and w.ndim != 4) or (node.op_type != "Conv" and w.ndim != 2):
        return f"{node.op_type} {node.name or node.output[0]}: weight shape"
    if node.op_type == "Gemm" and (attrs.get("transA", 0) or attrs.get("alpha", 1.0) != 1.0
                                   or attrs.get("beta", 1.0) != 1.0):
        return f"Gemm {node.name or node.output[0]}: transA/alpha/beta"
    return None


def reference_model(model: onnx.ModelProto, lowered: dict[str, dict], digest,
                    float32_requant: bool = True) -> tuple[onnx.ModelProto, list]:
    """``model`` with each Conv/Gemm/MatMul whose weight (by ``digest``) is in
    ``lowered`` ({digest: {input: (lo, hi), output: (lo, hi)}}) made an integer
    op; returns it and the lowered nodes it could not cover."""
    model = onnx.ModelProto.FromString(model.SerializeToString())
    g = model.graph
    inits = {i.name: numpy_helper.to_array(i) for i in g.initializer}
    consumers: dict[str, list] = {}
    for node in g.node:
        for name in node.input:
            consumers.setdefault(name, []).append(node)
    outputs = {o.name for o in g.output}
    nodes, missed = [], []
    for node in g.node:
        w = inits.get(node.input[1]) if node.op_type in COVERED and len(node.input) > 1 else None
        entry = lowered.get(digest(w)) if w is not None and w.dtype == np.float32 else None
        if entry is None:
            nodes.append(node)
            continue
        why = _covered(node, inits)
        if why:
            missed.append(why)
            nodes.append(node)
            continue
        xs, xz = uint8_params(*entry["input"])
        attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
        if node.op_type == "Conv":
            lo, hi = entry["output"]
            users = consumers.get(node.output[0], [])
            if len(users) == 1 and users[0].op_type == "Relu" and node.output[0] not in outputs:
                lo = 0.0  # the kernel's ReLU is the requantization's clamp
            ys, yz = uint8_params(lo, hi)
            keep = {k: attrs[k] for k in ("strides", "pads", "dilations", "group", "auto_pad") if k in attrs}
            new = helper.make_node("QConv", list(node.input), list(node.output), domain=DOMAIN, **keep,
                                   in_scale=float(xs), in_zero=xz, out_scale=float(ys), out_zero=yz,
                                   float32_requant=int(float32_requant))
        else:
            new = helper.make_node("QDense", list(node.input), list(node.output), domain=DOMAIN,
                                   transB=int(attrs.get("transB", 0)), in_scale=float(xs), in_zero=xz)
        nodes.append(new)
    del g.node[:]
    g.node.extend(nodes)
    model.opset_import.append(helper.make_opsetid(DOMAIN, 1))
    return model, missed


def run(model: onnx.ModelProto, feeds: list[dict]) -> list[list[np.ndarray]]:
    """The reference model's outputs for each feed."""
    from onnx.reference import ReferenceEvaluator

    ev = ReferenceEvaluator(model, new_ops=[QConv, QDense])
    return [list(ev.run(None, f)) for f in feeds]
