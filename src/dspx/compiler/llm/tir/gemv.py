"""The fused dequantize-GEMV kernels: Q4_1 linear layers (q/k/v, o,
gate/up, down) and the Q8_0 LM head, each a decode form (one row, TN
outputs per tile in registers) and a prefill form (M rows)."""
from __future__ import annotations

from ..sizing import TN
from .common import PR, REG


def gemv_q4_1(M: int, K: int, N: int, parallel: bool):
    """x (M, K) · W (K -> N) + res -> y (M, N); prefill takes the positions too."""
    return _q4_1_decode(K, N, parallel) if M == 1 else _q4_1_prefill(M, K, N)


def gemv_q8_0(M: int, K: int, N: int, parallel: bool):
    """The LM head: x (M, K) · W (K -> N) -> logits (1, M, N)."""
    return _q8_0_decode(K, N, parallel) if M == 1 else _q8_0_prefill(M, K, N)


def _tile_dot(NB: int, q4: bool):
    """Macro: acc (TN,) = one TN-output tile ``no`` of W times row ``row`` of x.
    Two partial sums per block (s[0], s[1]): 8 independent FMA chains per tile
    instead of 4 (latency, not throughput, bound).  Q4_1 also takes mm and
    xs (the block sums of x, for the m·Σx term); Q8_0 passes None for them."""
    from tvm.script import tirx as T

    @T.macro
    def dot(acc, s, x, row, q, dd, mm, xs, no):
        for ni in T.vectorized(TN):
            acc[ni] = T.float32(0)
        for b in range(NB):
            for h in T.unroll(2):
                for ni in T.vectorized(TN):
                    s[h, ni] = T.float32(0)
            if q4:  # low nibbles into s[0], high into s[1]
                for j in range(16):
                    for ni in T.vectorized(TN):
                        s[0, ni] = s[0, ni] + (T.Cast("float32", T.bitwise_and(q[no, b, j, ni], T.uint8(15)))
                                               * x[row, b * 32 + j])
                    for ni in T.vectorized(TN):
                        s[1, ni] = s[1, ni] + (T.Cast("float32", T.shift_right(q[no, b, j, ni], T.uint8(4)))
                                               * x[row, b * 32 + 16 + j])
                for ni in T.vectorized(TN):
                    acc[ni] = (acc[ni] + T.Cast("float32", dd[no, b, ni]) * (s[0, ni] + s[1, ni])
                               + T.Cast("float32", mm[no, b, ni]) * xs[b])
            else:  # even and odd elements
                for j in range(16):
                    for h in T.unroll(2):
                        for ni in T.vectorized(TN):
                            s[h, ni] = s[h, ni] + T.Cast("float32", q[no, b, 2 * j + h, ni]) * x[row, b * 32 + 2 * j + h]
                for ni in T.vectorized(TN):
                    acc[ni] = acc[ni] + T.Cast("float32", dd[no, b, ni]) * (s[0, ni] + s[1, ni])
    return dot


def _real_rows(M: int):
    """Macro: nr[0] = 1 + the last row with a position (padding has -1), at least ``first``."""
    from tvm.script import tirx as T

    @T.macro
    def count(nr, pos, first):
        nr[0] = first
        for r in range(M):
            if pos[0, r] >= 0:
                nr[0] = r + 1
    return count


def _q4_1_decode(K: int, N: int, parallel: bool):
    from tvm.script import tirx as T

    NB = K // 32
    loop = T.parallel if parallel else T.serial
    dot = _tile_dot(NB, True)

    @T.prim_func(private=True)
    def f(x: T.Buffer((1, K), "float32"), q: T.Buffer((N // TN, NB, 16, TN), "uint8"),
          dd: T.Buffer((N // TN, NB, TN), "float16"), mm: T.Buffer((N // TN, NB, TN), "float16"),
          res: T.Buffer((1, N), "float32"), y: T.Buffer((1, N), "float32")):
        T.func_attr({"tir.noalias": True})
        xs = T.alloc_buffer((NB,), "float32")
        for b in range(NB):
            xs[b] = T.float32(0)
            for j in range(32):
                xs[b] = xs[b] + x[0, b * 32 + j]
        for no in loop(N // TN):
            acc = T.alloc_buffer((TN,), "float32", scope=REG)
            s = T.alloc_buffer((2, TN), "float32", scope=REG)
            dot(acc, s, x, 0, q, dd, mm, xs, no)
            for ni in T.vectorized(TN):
                y[0, no * TN + ni] = res[0, no * TN + ni] + acc[ni]
    return f


def _q4_1_prefill(M: int, K: int, N: int):
    """Each tile's block dequantized once, then PR-row micro-tiles over the real rows."""
    from tvm.script import tirx as T

    NB = K // 32
    real_rows = _real_rows(M)

    @T.prim_func(private=True)
    def f(x: T.Buffer((M, K), "float32"), pos: T.Buffer((1, M), "int64"),
          q: T.Buffer((N // TN, NB, 16, TN), "uint8"),
          dd: T.Buffer((N // TN, NB, TN), "float16"), mm: T.Buffer((N // TN, NB, TN), "float16"),
          res: T.Buffer((M, N), "float32"), y: T.Buffer((M, N), "float32")):
        T.func_attr({"tir.noalias": True})
        # real rows come first (padding has position -1): compute only their PR-row groups
        nr = T.alloc_buffer((1,), "int32", scope=REG)
        real_rows(nr, pos, 0)
        for no in T.parallel(N // TN):
            w = T.alloc_buffer((32, TN), "float32", scope="local")  # this block's tile, dequantized once
            for r in range(M):
                for ni in T.vectorized(TN):
                    y[r, no * TN + ni] = res[r, no * TN + ni]
            for b in range(NB):
                for j in range(16):
                    for ni in T.vectorized(TN):
                        w[j, ni] = (T.Cast("float32", T.bitwise_and(q[no, b, j, ni], T.uint8(15)))
                                    * T.Cast("float32", dd[no, b, ni]) + T.Cast("float32", mm[no, b, ni]))
                        w[j + 16, ni] = (T.Cast("float32", T.shift_right(q[no, b, j, ni], T.uint8(4)))
                                         * T.Cast("float32", dd[no, b, ni]) + T.Cast("float32", mm[no, b, ni]))
                # PR rows x 64 outputs held in registers (two stack buffers of PR/2 rows,
                # each under TVM's 1 KiB stack limit); rows past M clamp to M-1 and
                # compute that row's same value again
                for ro in range((nr[0] + PR - 1) // PR):
                    a = T.alloc_buffer((PR // 2, TN), "float32", scope=REG)
                    c = T.alloc_buffer((PR // 2, TN), "float32", scope=REG)
                    for ri in T.unroll(PR // 2):
                        for ni in T.vectorized(TN):
                            a[ri, ni] = y[T.min(ro * PR + ri, M - 1), no * TN + ni]
                            c[ri, ni] = y[T.min(ro * PR + PR // 2 + ri, M - 1), no * TN + ni]
                    for k in range(32):
                        for ri in T.unroll(PR // 2):
                            for ni in T.vectorized(TN):
                                a[ri, ni] = a[ri, ni] + w[k, ni] * x[T.min(ro * PR + ri, M - 1), b * 32 + k]
                        for ri in T.unroll(PR // 2):
                            for ni in T.vectorized(TN):
                                c[ri, ni] = (c[ri, ni]
                                             + w[k, ni] * x[T.min(ro * PR + PR // 2 + ri, M - 1), b * 32 + k])
                    for ri in T.unroll(PR // 2):
                        for ni in T.vectorized(TN):
                            y[T.min(ro * PR + ri, M - 1), no * TN + ni] = a[ri, ni]
                            y[T.min(ro * PR + PR // 2 + ri, M - 1), no * TN + ni] = c[ri, ni]
    return f


def _q8_0_decode(K: int, N: int, parallel: bool):
    from tvm.script import tirx as T

    NB = K // 32
    # Decode runs serial by default: on 2 CPUs shared with the host and the
    # device's front process, a parallel LM head was no faster (TVM's
    # workers spin on the CPU the IPC needs).
    loop = T.parallel if parallel else T.serial
    dot = _tile_dot(NB, False)
    M = 1  # one row, in the (1, M, N) logits of both forms

    @T.prim_func(private=True)
    def f(x: T.Buffer((M, K), "float32"), q: T.Buffer((N // TN, NB, 32, TN), "int8"),
          dd: T.Buffer((N // TN, NB, TN), "float16"), y: T.Buffer((1, M, N), "float32")):
        T.func_attr({"tir.noalias": True})
        for no in loop(N // TN):
            acc = T.alloc_buffer((TN,), "float32", scope=REG)
            s = T.alloc_buffer((2, TN), "float32", scope=REG)
            dot(acc, s, x, 0, q, dd, None, None, no)
            for ni in T.vectorized(TN):
                y[0, 0, no * TN + ni] = acc[ni]
    return f


def _q8_0_prefill(M: int, K: int, N: int):
    """The host reads only the last real row's logits, so only that row is
    computed (one GEMV, parallel over tiles); the other rows are zero."""
    from tvm.script import tirx as T

    NB = K // 32
    dot = _tile_dot(NB, False)
    real_rows = _real_rows(M)

    @T.prim_func(private=True)
    def f(x: T.Buffer((M, K), "float32"), pos: T.Buffer((1, M), "int64"),
          q: T.Buffer((N // TN, NB, 32, TN), "int8"),
          dd: T.Buffer((N // TN, NB, TN), "float16"), y: T.Buffer((1, M, N), "float32")):
        T.func_attr({"tir.noalias": True})
        nr = T.alloc_buffer((1,), "int32", scope=REG)
        real_rows(nr, pos, 1)
        for no in T.parallel(N // TN):
            acc = T.alloc_buffer((TN,), "float32", scope=REG)
            s = T.alloc_buffer((2, TN), "float32", scope=REG)
            last = nr[0] - 1
            dot(acc, s, x, last, q, dd, None, None, no)
            for r in range(M):
                for ni in T.vectorized(TN):
                    y[0, r, no * TN + ni] = T.Select(r == last, acc[ni], T.float32(0))
    return f
