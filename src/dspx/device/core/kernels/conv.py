"""The convolution kernels: conv2d and conv2d_add, float or with a
reduced-precision weight (the _qw forms, dspx compile --weights).

onnxruntime (one Conv (+Add) (+Relu) session per weight, or its NCHWc
kernels for blocked tensors), torch's oneDNN with a prepacked weight, or the
numpy im2col (:func:`conv_numpy`, also the int8 family's fallback).
"""

from __future__ import annotations

import numpy as np

from ....abi.kernels import ACT_RELU, IN_BLOCKED, LAYOUT_NCHW, LAYOUT_NHWC, OUT_BLOCKED, RES_BLOCKED
from .backends import NchwcOp, OrtOp, backend, get_torch, nchwc_plan
from .caches import cached, restore_weight
from .registry import KernelError, as_numpy, ints, kernel


def _conv_out(size: int, k: int, s: int, p0: int, p1: int, d: int) -> int:
    return (size + p0 + p1 - d * (k - 1) - 1) // s + 1


def conv_numpy(x, w, b, strides, pads, dil, groups):
    """NCHW im2col + matmul; x (N,C,H,W), w (O,C/g,KH,KW) -> (N,O,Ho,Wo)."""
    n, c, h, wd = x.shape
    o, cg, kh, kw = w.shape
    pt, pl, pb, pr = pads
    xp = np.pad(x, ((0, 0), (0, 0), (pt, pb), (pl, pr)))
    ho = _conv_out(h, kh, strides[0], pt, pb, dil[0])
    wo = _conv_out(wd, kw, strides[1], pl, pr, dil[1])
    ekh, ekw = dil[0] * (kh - 1) + 1, dil[1] * (kw - 1) + 1
    win = np.lib.stride_tricks.sliding_window_view(xp, (ekh, ekw), axis=(2, 3))
    win = win[:, :, ::strides[0], ::strides[1], ::dil[0], ::dil[1]][:, :, :ho, :wo]
    og = o // groups
    cols = win.reshape(n, groups, cg, ho, wo, kh, kw).transpose(0, 1, 3, 4, 2, 5, 6)
    cols = cols.reshape(n, groups, ho * wo, cg * kh * kw)
    wm = w.reshape(groups, og, cg * kh * kw).transpose(0, 2, 1)
    y = np.matmul(cols, wm)  # (n, g, ho*wo, og)
    y = y.transpose(0, 1, 3, 2).reshape(n, o, ho, wo)
    if b is not None:
        y += b.reshape(1, o, 1, 1)
    return y


def _conv2d_impl(x_t, w_t, b_t, r_t, strides, padding, dilation, groups, layout, act, out_t, s_t=None):
    x, out = as_numpy(x_t), as_numpy(out_t)
    w = restore_weight(as_numpy(w_t), as_numpy(s_t) if s_t is not None else None, 0)
    b = as_numpy(b_t) if b_t is not None else None
    res = as_numpy(r_t) if r_t is not None else None
    strides, pads, dil = ints(strides), ints(padding), ints(dilation)
    groups, layout, act = int(groups), int(layout), int(act)
    flags, layout = layout & ~3, layout & 3
    if len(pads) == 2:
        pads = pads + pads
    if x.ndim != 4 or w.ndim != 4 or out.ndim != 4:
        raise KernelError("conv2d expects 4-D data, weight and output")
    if layout not in (LAYOUT_NCHW, LAYOUT_NHWC):
        raise KernelError(f"conv2d: unknown layout code {layout}")
    cin = x.shape[1] if layout == LAYOUT_NCHW else x.shape[3]
    if cin != w.shape[1] * groups or w.shape[0] % groups:
        raise KernelError(f"conv2d: input channels {cin} do not match weight {w.shape} "
                          f"with groups={groups}")
    be = backend()
    if be == "onnxruntime" and flags:
        if layout != LAYOUT_NCHW:
            raise KernelError("conv2d: blocked tensors must be NCHW-shaped")
        return _conv_nchwc(x, w, b, res, strides, pads, dil, groups, act, flags, out)
    if be == "onnxruntime":
        return _conv_ort(x, w, b, res, strides, pads, dil, groups, layout, act, out)
    torch = get_torch() if be == "torch" else None
    if torch is None:
        xn = x if layout == LAYOUT_NCHW else x.transpose(0, 3, 1, 2)
        y = conv_numpy(xn, w, b, strides, pads, dil, groups)
        if layout == LAYOUT_NHWC:
            y = y.transpose(0, 2, 3, 1)
        if res is not None:
            y += res
        if act == ACT_RELU:
            np.maximum(y, 0, out=y)
        out[...] = y
        return
    # NHWC numpy buffers become channels_last torch views: no copies.
    tx = torch.from_numpy(x)
    to = torch.from_numpy(out)
    if layout == LAYOUT_NHWC:
        tx, to = tx.permute(0, 3, 1, 2), to.permute(0, 3, 1, 2)
    pt, pl, pb, pr = pads
    if pt != pb or pl != pr:  # oneDNN takes symmetric padding only
        tx = torch.nn.functional.pad(tx, (pl, pr, pt, pb))
        if layout == LAYOUT_NHWC:
            tx = tx.contiguous(memory_format=torch.channels_last)
        pt = pl = 0
    pad2 = [pt, pl]
    in_shape = list(tx.shape)
    wp = cached(w, ("conv", tuple(pad2), tuple(strides), tuple(dil), groups, tuple(in_shape)),
                lambda: torch._C._nn.mkldnn_reorder_conv2d_weight(
                     torch.from_numpy(w).to_mkldnn(), pad2, strides, dil, groups, in_shape))
    tb = torch.from_numpy(b) if b is not None else None
    unary = "relu" if act == ACT_RELU else None
    if res is not None:
        # out = act(conv(x) + b + res), accumulated by oneDNN straight into out.
        tr = torch.from_numpy(res)
        if layout == LAYOUT_NHWC:
            tr = tr.permute(0, 3, 1, 2)
        to.copy_(tr)
        torch.ops.mkldnn._convolution_pointwise_.binary(
            to, tx, wp, tb, pad2, strides, dil, groups, "add", 1.0, unary, [], "")
        return
    y = torch.ops.mkldnn._convolution_pointwise(
        tx, wp, tb, pad2, strides, dil, groups, unary or "none", [], "")
    to.copy_(y)


def _conv_ort(x, w, b, res, strides, pads, dil, groups, layout, act, out):
    """Conv (+Add) (+Relu) as one ORT graph, which ORT fuses into one FusedConv."""
    from onnx import helper

    nhwc = layout == LAYOUT_NHWC
    # ORT convolves NCHW; NHWC data is transposed in and out (correct, slower:
    # compile with layout="NCHW" for this backend).
    xn = np.ascontiguousarray(x.transpose(0, 3, 1, 2)) if nhwc else x
    rn = None
    if res is not None:
        rn = np.ascontiguousarray(res.transpose(0, 3, 1, 2)) if nhwc else res
    on = np.empty(out.transpose(0, 3, 1, 2).shape, np.float32) if nhwc else out
    if not on.flags.c_contiguous or not xn.flags.c_contiguous:
        raise KernelError("conv2d: data and out must be contiguous")

    def make():
        nodes = [helper.make_node("Conv", ["x", "w", "b"], ["c"], strides=strides, pads=
                                  [pads[0], pads[1], pads[2], pads[3]], dilations=dil,
                                  group=groups)]
        last, inputs = "c", [("x", xn.shape)]
        if rn is not None:
            nodes.append(helper.make_node("Add", ["c", "r"], ["a"]))
            last = "a"
            inputs.append(("r", rn.shape))
        if act == ACT_RELU:
            nodes.append(helper.make_node("Relu", [last], ["y"]))
            last = "y"
        bias = b if b is not None else np.zeros(w.shape[0], np.float32)
        return OrtOp(nodes, inputs, (last, on.shape), {"w": w, "b": bias})

    op = cached(w, ("ort-conv", tuple(strides), tuple(pads), tuple(dil), groups, act,
                    rn is not None, xn.shape,
                    b.ctypes.data if b is not None else 0), make)
    run = op([xn] if rn is None else [xn, rn], on)
    if nhwc:
        out[...] = on.transpose(0, 2, 3, 1)
        return None
    return run


def _conv_nchwc(x, w, b, res, strides, pads, dil, groups, act, flags, out):
    from onnx import helper

    def make():
        node = helper.make_node("Conv", ["x", "w", "b"], ["y"], strides=strides, pads=pads,
                                dilations=dil, group=groups)
        bias = b if b is not None else np.zeros(w.shape[0], np.float32)
        plan = nchwc_plan(node, x.shape, out.shape, {"w": w, "b": bias})
        if plan is None:
            raise KernelError("conv2d: onnxruntime has no NCHWc kernel for this convolution; "
                              "compile with blocked=False")
        main, inits, reorder_in = plan
        return NchwcOp(main, inits, reorder_in, x.shape, out.shape, w.shape[0],
                       bool(flags & IN_BLOCKED), bool(flags & OUT_BLOCKED),
                       res.shape if res is not None else None, bool(flags & RES_BLOCKED), act)

    op = cached(w, ("nchwc-conv", tuple(strides), tuple(pads), tuple(dil), groups, act, flags,
                    res is not None, x.shape, b.ctypes.data if b is not None else 0), make)
    return op([x] if res is None else [x, res], out)


@kernel("conv2d", "torch oneDNN (prepacked weights) | numpy im2col", site=True)
def conv2d(data, weight, bias, strides, padding, dilation, groups, layout, act, out):
    """2-D convolution, out = act(conv(data, weight) + bias).

    data NCHW (layout=0) or NHWC (layout=1); weight OIHW (always, I = C/groups);
    bias (O,); strides (sh, sw); padding (top, left, bottom, right);
    dilation (dh, dw); groups int; act 0 = none, 1 = ReLU; out in data's layout.
    """
    return _conv2d_impl(data, weight, bias, None, strides, padding, dilation, groups, layout, act, out)


@kernel("conv2d_add", "torch oneDNN (sum post-op, in place) | numpy im2col", site=True)
def conv2d_add(data, weight, bias, residual, strides, padding, dilation, groups, layout, act, out):
    """Convolution with a fused residual: out = act(conv(data, weight) + bias + residual).

    Same attributes as conv2d; residual has out's shape and layout.
    """
    return _conv2d_impl(data, weight, bias, residual, strides, padding, dilation, groups, layout, act, out)


@kernel("conv2d_qw", "as conv2d, int8 weight restored once", site=True)
def conv2d_qw(data, weight, bias, wscale, strides, padding, dilation, groups, layout, act, out):
    """conv2d with an int8 weight (O, C/groups, KH, KW) and its per-output-channel scales (O,)."""
    return _conv2d_impl(data, weight, bias, None, strides, padding, dilation, groups, layout, act, out, wscale)


@kernel("conv2d_add_qw", "as conv2d_add, int8 weight restored once", site=True)
def conv2d_add_qw(data, weight, bias, residual, wscale, strides, padding, dilation, groups, layout, act, out):
    """conv2d_add with an int8 weight and its per-output-channel scales (O,)."""
    return _conv2d_impl(data, weight, bias, residual, strides, padding, dilation, groups, layout, act, out, wscale)


