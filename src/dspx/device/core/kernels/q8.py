"""The firmware's int8 kernels (``dspx compile --quantize int8``, docs/quantize.md).

Activations arrive and leave as float32; inside, each kernel quantizes its
input with the calibrated per-tensor scale and zero point (uint8), runs the
convolution / matrix product in int8 (uint8 activations x int8 per-channel
weights, int32 accumulation: MLAS' u8s8 kernels where the CPU has VNNI,
its exact u8u8 ones elsewhere, see ``_weights``) and dequantizes.  The backend is onnxruntime (numpy on exact float64
integers when the kernel backend is not onnxruntime, ~10-50x slower): one small session per
weight, ``QuantizeLinear -> QLinearConv -> DequantizeLinear`` (a convolution's
output is requantized with its calibrated range, as onnxruntime's own QDQ
models do) or ``QuantizeLinear -> QGemm`` (float output, no requantization).

Each kernel returns its bound run, so a call site replays it
(registry.site_cached).
"""

from __future__ import annotations

import numpy as np

from ....abi.kernels import ACT_RELU, LAYOUT_NCHW
from ..cpu import host_features
from .backends import OrtOp, backend
from .caches import cached
from .conv import conv_numpy
from .registry import KernelError, as_numpy, ints, kernel

_INT32 = np.iinfo(np.int32)


def _QOp(nodes, inputs, out, inits) -> OrtOp:
    """A float-in, float-out onnxruntime graph (int8 inside) bound to the caller's memory."""
    return OrtOp(nodes, inputs, out, inits, domains=(("com.microsoft", 1),))


def _qparams(scale: float, zero: int, what: str) -> tuple[np.ndarray, np.ndarray]:
    scale, zero = float(scale), int(zero)
    if not scale > 0 or not np.isfinite(scale) or not 0 <= zero <= 255:
        raise KernelError(f"{what}: quantization scale must be > 0 and zero point in [0, 255], "
                          f"got scale {scale} zero point {zero}")
    return np.array(scale, np.float32), np.array(zero, np.uint8)


def exact_u8s8() -> bool:
    """Whether MLAS' u8 x s8 kernels are exact here: with VNNI they accumulate
    in int32; without it (AVX2's vpmaddubsw) they saturate pairs of products
    at int16, which put int8 convolutions ~27 quanta off on an AVX2-only EPYC."""
    return bool({"avx512_vnni", "avx_vnni"} & host_features())


def _weights(w: np.ndarray, channels: int) -> tuple[np.ndarray, np.ndarray]:
    """The weights and their zero points as onnxruntime gets them: int8 where
    u8s8 is exact, else the same integers as uint8 with zero point 128 (MLAS'
    u8u8 kernels widen to int16 first: exact on every x86, a little slower)."""
    if exact_u8s8():
        return w, np.zeros(channels, np.int8)
    return (w.astype(np.int16) + 128).astype(np.uint8), np.full(channels, 128, np.uint8)


def _bias_int32(bias: np.ndarray, in_scale: np.ndarray, wscale: np.ndarray) -> np.ndarray:
    """The float bias in the accumulator's units (in_scale * wscale), as onnxruntime's quantizer does."""
    q = np.rint(bias.astype(np.float64) / (float(in_scale) * wscale.astype(np.float64)))
    return np.clip(q, _INT32.min, _INT32.max).astype(np.int32)


def _centered(x: np.ndarray, scale: np.ndarray, zero: np.ndarray) -> np.ndarray:
    """uint8-quantized x minus its zero point, as float64 (exact integers: the
    numpy fallback's products and sums stay exact where float32's would not)."""
    return np.clip(np.rint(x / scale) + float(zero), 0, 255) - float(zero)


def _requantize(y: np.ndarray, scale: np.ndarray, zero: np.ndarray) -> np.ndarray:
    return ((np.clip(np.rint(y / float(scale)) + float(zero), 0, 255) - float(zero)) * float(scale)).astype(np.float32)


def _conv_q8(data, weight, bias, residual, wscale, strides, padding, dilation, groups, layout, act,
             in_scale, in_zero, out_scale, out_zero, out):
    from onnx import helper

    x, w, o = as_numpy(data), as_numpy(weight), as_numpy(out)
    r = as_numpy(residual) if residual is not None else None
    strides, pads, dil = ints(strides), ints(padding), ints(dilation)
    groups, layout, act = int(groups), int(layout), int(act)
    if len(pads) == 2:
        pads = pads + pads
    if layout != LAYOUT_NCHW:
        raise KernelError(f"conv2d_q8: only plain NCHW tensors (layout code 0), got layout code {layout}")
    if x.ndim != 4 or w.ndim != 4 or o.ndim != 4 or w.dtype != np.int8 or x.dtype != np.float32:
        raise KernelError(f"conv2d_q8 expects 4-D float32 data {x.dtype}{list(x.shape)}, int8 OIHW weight "
                          f"{w.dtype}{list(w.shape)} and a 4-D output")
    if x.shape[1] != w.shape[1] * groups or w.shape[0] % groups:
        raise KernelError(f"conv2d_q8: input channels {x.shape[1]} do not match weight {list(w.shape)} "
                          f"with groups={groups}")
    if not (x.flags.c_contiguous and o.flags.c_contiguous and (r is None or r.flags.c_contiguous)):
        raise KernelError("conv2d_q8: data, residual and out must be contiguous")
    xs, xz = _qparams(in_scale, in_zero, "conv2d_q8 input")
    ys, yz = _qparams(out_scale, out_zero, "conv2d_q8 output")
    if backend() != "onnxruntime":
        s = as_numpy(wscale).astype(np.float64)
        acc = conv_numpy(_centered(x, xs, xz), w.astype(np.float64), None, strides, pads, dil, groups)
        acc += _bias_int32(as_numpy(bias), xs, s).reshape(1, -1, 1, 1)
        y = _requantize(acc * (float(xs) * s).reshape(1, -1, 1, 1), ys, yz)
        if r is not None:
            y += r
        if act == ACT_RELU:
            np.maximum(y, 0, out=y)
        o[...] = y
        return None

    def make():
        s = as_numpy(wscale).astype(np.float32)
        wq, wz = _weights(w, w.shape[0])
        inits = {"xs": xs, "xz": xz, "w": wq, "ws": s, "wz": wz, "ys": ys, "yz": yz,
                 "b": _bias_int32(as_numpy(bias), xs, s)}
        nodes = [helper.make_node("QuantizeLinear", ["x", "xs", "xz"], ["xq"]),
                 helper.make_node("QLinearConv", ["xq", "xs", "xz", "w", "ws", "wz", "ys", "yz", "b"], ["yq"],
                                  strides=strides, pads=pads, dilations=dil, group=groups),
                 helper.make_node("DequantizeLinear", ["yq", "ys", "yz"], ["c"])]
        last, inputs = "c", [("x", x.shape)]
        if r is not None:
            nodes.append(helper.make_node("Add", ["c", "r"], ["a"]))
            last = "a"
            inputs.append(("r", r.shape))
        # without a residual, a ReLU is the requantization's clamp at zero point 0
        if act == ACT_RELU and (r is not None or int(yz) != 0):
            nodes.append(helper.make_node("Relu", [last], ["y"]))
            last = "y"
        return _QOp(nodes, inputs, (last, o.shape), inits)

    op = cached(w, ("q8-conv", tuple(strides), tuple(pads), tuple(dil), groups, act, r is not None, x.shape,
                    float(xs), int(xz), float(ys), int(yz), as_numpy(bias).ctypes.data), make)
    return op([x] if r is None else [x, r], o)


@kernel("conv2d_q8", "onnxruntime QuantizeLinear + QLinearConv + DequantizeLinear", site=True)
def conv2d_q8(data, weight, bias, wscale, strides, padding, dilation, groups, layout, act,
              in_scale, in_zero, out_scale, out_zero, out):
    """int8 convolution, out = act(dq(q(conv(q(data), weight) + bias))).

    data float32 NCHW, quantized with (in_scale, in_zero) to uint8; weight int8
    OIHW with per-output-channel scales wscale (O,); bias float32 (O,); the
    result is requantized with (out_scale, out_zero) and returned as float32.
    """
    return _conv_q8(data, weight, bias, None, wscale, strides, padding, dilation, groups, layout, act,
             in_scale, in_zero, out_scale, out_zero, out)


@kernel("conv2d_add_q8", "as conv2d_q8, residual added in float32", site=True)
def conv2d_add_q8(data, weight, bias, residual, wscale, strides, padding, dilation, groups, layout, act,
                  in_scale, in_zero, out_scale, out_zero, out):
    """out = act(dq(q(conv + bias)) + residual): the int8 convolution's float result plus the residual."""
    return _conv_q8(data, weight, bias, residual, wscale, strides, padding, dilation, groups, layout, act,
             in_scale, in_zero, out_scale, out_zero, out)


@kernel("dense_q8", "onnxruntime QuantizeLinear + QGemm (float output)", site=True)
def dense_q8(data, weight, bias, wscale, trans_b, act, in_scale, in_zero, out):
    """int8 fully connected: out = act(q(data) @ W + bias) with W = weight * wscale along N.

    data float32 (..., K); weight int8 (N, K) if trans_b=1 else (K, N); wscale,
    bias float32 (N,); the product is accumulated in int32 and returned as float32.
    """
    from onnx import helper

    x, w, o = as_numpy(data), as_numpy(weight), as_numpy(out)
    tb, act = int(trans_b), int(act)
    if w.ndim != 2 or w.dtype != np.int8:
        raise KernelError(f"dense_q8: weight must be 2-D int8, got {w.dtype}{list(w.shape)}")
    k, n = (w.shape[1], w.shape[0]) if tb else w.shape
    if x.shape[-1] != k or o.shape[-1] != n or x.size // k != o.size // n:
        raise KernelError(f"dense_q8: data {list(x.shape)}, weight {list(w.shape)} (trans_b={tb}) and out "
                          f"{list(o.shape)} do not match")
    if not (x.flags.c_contiguous and o.flags.c_contiguous):
        raise KernelError("dense_q8: data and out must be contiguous")
    xs, xz = _qparams(in_scale, in_zero, "dense_q8 input")
    x2, o2 = x.reshape(-1, k), o.reshape(-1, n)
    if backend() != "onnxruntime":
        s = as_numpy(wscale).astype(np.float64)
        acc = _centered(x2, xs, xz) @ (w.T if tb else w).astype(np.float64) + _bias_int32(as_numpy(bias), xs, s)
        o2[...] = acc * (float(xs) * s)
        if act == ACT_RELU:
            np.maximum(o2, 0, out=o2)
        return None

    def make():
        s = as_numpy(wscale).astype(np.float32)
        wq, wz = _weights(w, n)
        inits = {"xs": xs, "xz": xz, "w": wq, "ws": s, "wz": wz, "b": _bias_int32(as_numpy(bias), xs, s)}
        nodes = [helper.make_node("QuantizeLinear", ["x", "xs", "xz"], ["xq"]),
                 helper.make_node("QGemm", ["xq", "xs", "xz", "w", "ws", "wz", "b"], ["g"], domain="com.microsoft",
                                  transB=tb)]
        last = "g"
        if act == ACT_RELU:
            nodes.append(helper.make_node("Relu", ["g"], ["y"]))
            last = "y"
        return _QOp(nodes, [("x", x2.shape)], (last, o2.shape), inits)

    op = cached(w, ("q8-dense", tb, act, x2.shape, float(xs), int(xz), as_numpy(bias).ctypes.data), make)
    return op([x2], o2)
