"""The row-wise kernels: the token embedding lookup (Q8_0 rows dequantized),
RMSNorm and the SiLU gate."""
from __future__ import annotations

import numpy as np

from ..sizing import TN, Dims
from .common import REG, vexp


def embed(d: Dims, M: int):
    """ids (1, M) -> x (M, dim): each token's Q8_0 embedding row, dequantized."""
    from tvm.script import tirx as T

    D, V = d.dim, d.vocab
    NB = D // 32

    @T.prim_func(private=True)
    def f(ids: T.Buffer((1, M), "int64"), q: T.Buffer((V // TN, NB, 32, TN), "int8"),
          dd: T.Buffer((V // TN, NB, TN), "float16"), x: T.Buffer((M, D), "float32")):
        T.func_attr({"tir.noalias": True})
        for r in range(M):
            tok = T.Cast("int32", T.max(T.min(ids[0, r], T.int64(V - 1)), T.int64(0)))
            for b in range(NB):
                for j in range(32):
                    x[r, b * 32 + j] = (T.Cast("float32", q[tok // TN, b, j, tok % TN])
                                        * T.Cast("float32", dd[tok // TN, b, tok % TN]))
    return f


def rmsnorm(d: Dims, M: int):
    from tvm.script import tirx as T

    D = d.dim
    eps = float(np.float32(d.eps))

    @T.prim_func(private=True)
    def rmsnorm(x: T.Buffer((M, D), "float32"), w: T.Buffer((D,), "float32"), y: T.Buffer((M, D), "float32")):
        T.func_attr({"tir.noalias": True})
        for r in range(M):
            acc = T.alloc_buffer((1,), "float32", scope=REG)
            acc[0] = T.float32(0)
            for i in range(D):
                acc[0] = acc[0] + x[r, i] * x[r, i]
            inv = T.float32(1) / T.sqrt(acc[0] / T.float32(D) + T.float32(eps))
            for i in range(D):
                y[r, i] = x[r, i] * inv * w[i]
    return rmsnorm


def silu_mul(d: Dims, M: int):
    """gate_up (M, 2·ffn) -> silu(gate) · up (M, ffn)."""
    from tvm.script import tirx as T

    F = d.ffn

    @T.prim_func(private=True)
    def silu_mul(gu: T.Buffer((M, 2 * F), "float32"), y: T.Buffer((M, F), "float32")):
        T.func_attr({"tir.noalias": True})
        for r in range(M):
            for io in range(F // 16):
                for ii in T.vectorized(16):
                    y[r, io * 16 + ii] = (gu[r, io * 16 + ii] / (T.float32(1) + vexp(T.float32(0) - gu[r, io * 16 + ii]))
                                          * gu[r, F + io * 16 + ii])
    return silu_mul
