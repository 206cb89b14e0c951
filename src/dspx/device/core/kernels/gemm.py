"""The matrix-product kernels: dense (fully connected, float or with a
reduced-precision weight) and matmul (batched, broadcasting).

onnxruntime's Gemm for large dense layers (the weight prepacked once), numpy
on OpenBLAS for the small rest.
"""

from __future__ import annotations

import numpy as np

from ....abi.kernels import ACT_RELU
from .backends import OrtOp, backend, small_threads
from .caches import cached, restore_weight
from .registry import KernelError, as_numpy, kernel


def _act_inplace(y: np.ndarray, act: int) -> None:
    if act == ACT_RELU:
        np.maximum(y, 0, out=y)


@kernel("dense", "onnxruntime Gemm | numpy/OpenBLAS", site=True)
def dense(data, weight, bias, trans_b, act, out):
    """Fully connected: out = act(data @ W + bias).

    data (..., K); weight (N, K) when trans_b=1 (pre-transposed, as stored by
    Linear/Gemm transB=1) or (K, N) when trans_b=0; bias (N,) (pass zeros
    for none); out (..., N).
    """
    return _dense(data, weight, bias, None, trans_b, act, out)


@kernel("dense_qw", "as dense, int8 weight restored once", site=True)
def dense_qw(data, weight, bias, wscale, trans_b, act, out):
    """dense with an int8 weight and its per-output scales (N,): W = q * wscale along N."""
    return _dense(data, weight, bias, wscale, trans_b, act, out)


def _dense(data, weight, bias, wscale, trans_b, act, out):
    x, b, o = as_numpy(data), as_numpy(bias), as_numpy(out)
    tb, act = int(trans_b), int(act)
    w = restore_weight(as_numpy(weight), as_numpy(wscale) if wscale is not None else None, 0 if tb else 1)
    wm = w.T if tb else w
    if x.shape[-1] != wm.shape[0]:
        raise KernelError(f"dense: data {x.shape} does not match weight {w.shape} "
                          f"(trans_b={tb})")
    k, n = wm.shape
    rows = x.size // k
    # Tiny GEMMs: one numpy call beats ORT's dispatch. From 256k MACs ORT's
    # pool wins over single-threaded BLAS (1000x512: 26 vs 56 us; 576x1536:
    # 47 vs 154 us; lm head 49152x576: 4.5 vs 8.9 ms, idle machine).
    if (rows * k * n >= 1 << 18 and backend() == "onnxruntime"
            and x.flags.c_contiguous and o.flags.c_contiguous):
        # ORT prepacks the constant weight once; OpenBLAS' own threads stall
        # when another process holds a core (1.9 ms vs 25 us here).
        x2, o2 = x.reshape(-1, k), o.reshape(-1, n)
        op = cached(w, ("ort-dense", tb, act, x2.shape[0], b.ctypes.data),
                    lambda: _dense_op(w, b, tb, act, x2.shape))
        return op([x2], o2)
    np.matmul(x, wm, out=o)
    o += b
    _act_inplace(o, act)


def _dense_op(w, b, trans_b, act, x_shape):
    from onnx import helper

    nodes = [helper.make_node("Gemm", ["x", "w", "b"], ["g"], transB=trans_b)]
    last = "g"
    if act == ACT_RELU:
        nodes.append(helper.make_node("Relu", ["g"], ["y"]))
        last = "y"
    n = w.shape[0] if trans_b else w.shape[1]
    return OrtOp(nodes, [("x", x_shape)], (last, (x_shape[0], n)), {"w": w, "b": b},
                 threads=small_threads(x_shape[0] * x_shape[1] * n))


@kernel("matmul", "numpy/OpenBLAS")
def matmul(a, b, trans_b, out):
    """(Batched, broadcasting) matmul as numpy.matmul: out = a @ (b or b^T on the last two axes).

    Covers batch matmul (B,M,K)x(B,K,N) and GEMV (1,K)x(K,N).
    """
    x, y, o = as_numpy(a), as_numpy(b), as_numpy(out)
    if int(trans_b):
        y = np.swapaxes(y, -1, -2)
    np.matmul(x, y, out=o)


