"""The pooling kernels: max_pool2d, avg_pool2d and global_avg_pool2d.

onnxruntime (a MaxPool/AveragePool session per shape, or its NCHWc kernels
for blocked tensors), torch on channels_last views, or numpy windows
(:func:`pool_numpy`).
"""

from __future__ import annotations

import numpy as np

from ....abi.kernels import IN_BLOCKED, LAYOUT_NCHW, LAYOUT_NHWC, OUT_BLOCKED
from .backends import NchwcOp, OrtOp, backend, get_torch, nchwc_plan, small_threads
from .caches import new_cache
from .registry import KernelError, as_numpy, ints, kernel


def _pool_out(size, k, s, p0, p1, d, ceil):
    eff = d * (k - 1) + 1
    if ceil:
        o = -(-(size + p0 + p1 - eff) // s) + 1
        if (o - 1) * s >= size + p0:  # last window must start inside input or left pad
            o -= 1
        return o
    return (size + p0 + p1 - eff) // s + 1


def pool_numpy(x, kind, pool, strides, pads, dil, ceil, count_include_pad):
    """NCHW pooling in numpy; returns (N,C,Ho,Wo)."""
    n, c, h, w = x.shape
    pt, pl, pb, pr = pads
    ho = _pool_out(h, pool[0], strides[0], pt, pb, dil[0], ceil)
    wo = _pool_out(w, pool[1], strides[1], pl, pr, dil[1], ceil)
    ekh, ekw = dil[0] * (pool[0] - 1) + 1, dil[1] * (pool[1] - 1) + 1
    eb = max(0, (ho - 1) * strides[0] + ekh - (h + pt + pb))
    er = max(0, (wo - 1) * strides[1] + ekw - (w + pl + pr))
    fill = -np.inf if kind == "max" else 0.0
    xp = np.pad(x, ((0, 0), (0, 0), (pt, pb + eb), (pl, pr + er)), constant_values=fill)

    def windows(a):
        v = np.lib.stride_tricks.sliding_window_view(a, (ekh, ekw), axis=(2, 3))
        return v[:, :, ::strides[0], ::strides[1], ::dil[0], ::dil[1]][:, :, :ho, :wo]

    if kind == "max":
        return windows(xp).max(axis=(4, 5))
    total = windows(xp).sum(axis=(4, 5))
    ones = np.zeros((1, 1) + xp.shape[2:], dtype=x.dtype)
    if count_include_pad:
        ones[..., :h + pt + pb, :w + pl + pr] = 1
    else:
        ones[..., pt:pt + h, pl:pl + w] = 1
    return total / windows(ones).sum(axis=(4, 5))


def _pool_impl(kind, x_t, pool, strides, padding, dilation, ceil_mode, count_include_pad,
               layout, out_t):
    x, out = as_numpy(x_t), as_numpy(out_t)
    pool, strides, pads, dil = ints(pool), ints(strides), ints(padding), ints(dilation)
    if len(pads) == 2:
        pads = pads + pads
    layout, ceil, cip = int(layout), bool(ceil_mode), bool(count_include_pad)
    flags, layout = layout & ~3, layout & 3
    be = backend()
    if be == "onnxruntime" and flags and kind == "max" and layout == LAYOUT_NCHW:
        return _pool_nchwc(x, pool, strides, pads, dil, ceil, flags, out)
    if be == "onnxruntime" and (kind == "max" or dil == [1, 1]):
        return _pool_ort(kind, x, pool, strides, pads, dil, ceil, cip, layout, out)
    torch = get_torch() if be == "torch" else None
    pt, pl, pb, pr = pads
    symmetric = pt == pb and pl == pr and 2 * pt <= pool[0] and 2 * pl <= pool[1]
    if torch is not None and symmetric and (kind == "max" or dil == [1, 1]):
        tx, to = torch.from_numpy(x), torch.from_numpy(out)
        if layout == LAYOUT_NHWC:
            tx, to = tx.permute(0, 3, 1, 2), to.permute(0, 3, 1, 2)
        if kind == "max":
            y = torch.nn.functional.max_pool2d(tx, pool, strides, [pt, pl], dil, ceil_mode=ceil)
        else:
            y = torch.nn.functional.avg_pool2d(tx, pool, strides, [pt, pl], ceil_mode=ceil,
                                               count_include_pad=cip)
        to.copy_(y)
        return
    xn = x if layout == LAYOUT_NCHW else x.transpose(0, 3, 1, 2)
    y = pool_numpy(xn, kind, pool, strides, pads, dil, ceil, cip)
    out[...] = y if layout == LAYOUT_NCHW else y.transpose(0, 2, 3, 1)


_pool_ops: dict[tuple, OrtOp] = new_cache()  # sessions by shape and attributes (no weight)


def _pool_ort(kind, x, pool, strides, pads, dil, ceil, cip, layout, out):
    from onnx import helper

    nhwc = layout == LAYOUT_NHWC
    xn = np.ascontiguousarray(x.transpose(0, 3, 1, 2)) if nhwc else np.ascontiguousarray(x)
    on = np.empty(out.transpose(0, 3, 1, 2).shape, np.float32) if nhwc else out
    key = (kind, tuple(pool), tuple(strides), tuple(pads), tuple(dil), ceil, cip, xn.shape)
    op = _pool_ops.get(key)
    if op is None:
        attrs = dict(kernel_shape=pool, strides=strides, pads=pads, ceil_mode=int(ceil))
        if kind == "max":
            node = helper.make_node("MaxPool", ["x"], ["y"], dilations=dil, **attrs)
        else:
            node = helper.make_node("AveragePool", ["x"], ["y"], count_include_pad=int(cip),
                                    **attrs)
        op = _pool_ops[key] = OrtOp([node], [("x", xn.shape)], ("y", on.shape), {},
                                    threads=small_threads(on.size * pool[0] * pool[1]))
    run = op([xn], on)
    if nhwc or xn is not x:
        if nhwc:
            out[...] = on.transpose(0, 2, 3, 1)
        return None
    return run


def _pool_nchwc(x, pool, strides, pads, dil, ceil, flags, out):
    from onnx import helper

    key = ("nchwc-max", tuple(pool), tuple(strides), tuple(pads), tuple(dil), ceil, flags,
           x.shape)
    op = _pool_ops.get(key)
    if op is None:
        node = helper.make_node("MaxPool", ["x"], ["y"], kernel_shape=pool, strides=strides,
                                pads=pads, dilations=dil, ceil_mode=int(ceil))
        plan = nchwc_plan(node, x.shape, out.shape, {})
        if plan is None:
            raise KernelError("max_pool2d: onnxruntime has no NCHWc kernel for this pooling")
        main, inits, reorder_in = plan
        op = _pool_ops[key] = NchwcOp(main, inits, reorder_in, x.shape, out.shape, x.shape[1],
                                      bool(flags & IN_BLOCKED), bool(flags & OUT_BLOCKED),
                                      threads=small_threads(out.size * pool[0] * pool[1]))
    xc = np.ascontiguousarray(x)
    run = op([xc], out)
    return run if xc is x else None


@kernel("max_pool2d", "torch (channels_last) | numpy", site=True)
def max_pool2d(data, pool, strides, padding, dilation, ceil_mode, layout, out):
    """Max pooling. pool (kh, kw); padding (top, left, bottom, right); layout 0 NCHW / 1 NHWC."""
    return _pool_impl("max", data, pool, strides, padding, dilation, ceil_mode, False, layout, out)


@kernel("avg_pool2d", "torch (channels_last) | numpy", site=True)
def avg_pool2d(data, pool, strides, padding, dilation, ceil_mode, count_include_pad, layout, out):
    """Average pooling; count_include_pad 0/1 as in ONNX AveragePool."""
    return _pool_impl("avg", data, pool, strides, padding, dilation, ceil_mode, count_include_pad,
                      layout, out)


@kernel("global_avg_pool2d", "numpy", site=True)
def global_avg_pool2d(data, layout, out):
    """Mean over the spatial axes; out (N,C,1,1) for NCHW or (N,1,1,C) for NHWC (any shape with
    the same element count is accepted, e.g. the flattened (N,C))."""
    x, o = as_numpy(data), as_numpy(out)
    layout = int(layout)
    if layout & IN_BLOCKED and backend() == "onnxruntime":
        from onnx import helper

        key = ("nchwc-gap", x.shape)
        op = _pool_ops.get(key)
        if op is None:
            shape = (x.shape[0], x.shape[1], 1, 1)
            plan = nchwc_plan(helper.make_node("GlobalAveragePool", ["x"], ["y"]), x.shape,
                              shape, {})
            if plan is None:
                raise KernelError("global_avg_pool2d: no NCHWc kernel in onnxruntime")
            op = _pool_ops[key] = NchwcOp(*plan, x.shape, shape, x.shape[1], True, False,
                                          threads=small_threads(x.size))
        return op([x], o.reshape(x.shape[0], x.shape[1], 1, 1))
    axes = (2, 3) if layout & 3 == LAYOUT_NCHW else (1, 2)
    o.reshape(-1)[...] = x.mean(axis=axes, dtype=np.float32).reshape(-1)


