"""The fused dequantize-GEMV kernels: Q4_1 linear layers (q/k/v, o,
gate/up, down) and the Q8_0 LM head, each a decode form (one row, TN
outputs per tile in registers) and a prefill form (M rows)."""
from __future__ import annotations

from ..sizing import TN
from .common import REG, decode_slice


def gemv_q4_1(M: int, K: int, N: int, parallel: bool, batch: bool = False, tile: tuple[int, int] = (6, 64),
              lanes: int = 16):
    """x (M, K) · W (K -> N) + res -> y (M, N); prefill and batch take the positions too.
    ``tile``: the prefill GEMM's register micro-tile (``prefill_tile``, ``tuning``);
    ``lanes``: the target's float32 vector lanes, which size the decode slices (``decode_slice``)."""
    if M == 1:
        return _q4_1_decode(K, N, parallel, decode_slice(lanes))
    return _q4_1_rows(M, K, N, parallel) if batch else _q4_1_prefill(M, K, N, tile)


def gemv_q8_0(M: int, K: int, N: int, parallel: bool, batch: bool = False, lanes: int = 16):
    """The LM head: x (M, K) · W (K -> N) -> logits (1, M, N)."""
    if M == 1:
        return _q8_0_decode(K, N, parallel, decode_slice(lanes))
    return _q8_0_rows(M, K, N, parallel) if batch else _q8_0_prefill(M, K, N, decode_slice(lanes))


def _tile_dot(NB: int, q4: bool, DV: int = TN):
    """Macro: acc (TN,) = one TN-output tile ``no`` of W times row ``row`` of x.
    Two partial sums per block (s[0], s[1]): 8 independent FMA chains per tile
    instead of 4 (latency, not throughput, bound).  Q4_1 also takes mm and
    xs (the block sums of x, for the m·Σx term); Q8_0 passes None for them.
    Each block runs in TN/DV slices of DV outputs, s (2, DV) in registers
    (``decode_slice``); every output sums in the same order whatever DV."""
    from tvm.script import tirx as T

    @T.macro
    def dot(acc, s, x, row, q, dd, mm, xs, no):
        for ni in T.vectorized(TN):
            acc[ni] = T.float32(0)
        for b in range(NB):
            for hv in T.unroll(TN // DV):
                for h in T.unroll(2):
                    for ni in T.vectorized(DV):
                        s[h, ni] = T.float32(0)
                if q4:  # low nibbles into s[0], high into s[1]
                    for j in range(16):
                        for ni in T.vectorized(DV):
                            s[0, ni] = s[0, ni] + (T.Cast("float32", T.bitwise_and(q[no, b, j, hv * DV + ni],
                                                                                   T.uint8(15)))
                                                   * x[row, b * 32 + j])
                        for ni in T.vectorized(DV):
                            s[1, ni] = s[1, ni] + (T.Cast("float32", T.shift_right(q[no, b, j, hv * DV + ni],
                                                                                   T.uint8(4)))
                                                   * x[row, b * 32 + 16 + j])
                    for ni in T.vectorized(DV):
                        acc[hv * DV + ni] = (acc[hv * DV + ni]
                                             + T.Cast("float32", dd[no, b, hv * DV + ni]) * (s[0, ni] + s[1, ni])
                                             + T.Cast("float32", mm[no, b, hv * DV + ni]) * xs[row, b])
                else:  # even and odd elements
                    for j in range(16):
                        for h in T.unroll(2):
                            for ni in T.vectorized(DV):
                                s[h, ni] = (s[h, ni] + T.Cast("float32", q[no, b, 2 * j + h, hv * DV + ni])
                                            * x[row, b * 32 + 2 * j + h])
                    for ni in T.vectorized(DV):
                        acc[hv * DV + ni] = (acc[hv * DV + ni]
                                             + T.Cast("float32", dd[no, b, hv * DV + ni]) * (s[0, ni] + s[1, ni]))
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


def _block_sums(NB: int):
    """Macro: xs[r, b] = the sum of block b of row r of x (the m·Σx term of Q4_1), rows 0 … M-1."""
    from tvm.script import tirx as T

    @T.macro
    def block_sums(xs, x, M):
        for r in range(M):
            for b in range(NB):
                xs[r, b] = T.float32(0)
                for j in range(32):
                    xs[r, b] = xs[r, b] + x[r, b * 32 + j]
    return block_sums


RB = 4   # batched decode: rows per group, sharing each weight's conversion to float32
TH = 32  # batched decode: outputs per half tile (RB rows x 2 partial sums x TH in registers)


def _rows_dot(NB: int, q4: bool, rows: int):
    """Macro: ``rows`` (2 or RB) rows r0..r3 of x times half ``hh`` of tile
    ``no``, into acc (rows r0, r1) and acc2 (r2, r3), each (2, TN): each weight is converted to float32 once for
    the rows, and every row sums exactly as ``_tile_dot`` does (same partial
    sums, same order), so a batched row's logits are bit for bit the decode
    entry's."""
    from tvm.script import tirx as T

    quad = rows == RB

    @T.macro
    def pair(s, wa, wb, x, ra, rb, ka, kb):  # two rows' partial sums s (2, 2, TH) += w * x
        for ni in T.vectorized(TH):
            s[0, 0, ni] = s[0, 0, ni] + wa[ni] * x[ra, ka]
        for ni in T.vectorized(TH):
            s[0, 1, ni] = s[0, 1, ni] + wb[ni] * x[ra, kb]
        for ni in T.vectorized(TH):
            s[1, 0, ni] = s[1, 0, ni] + wa[ni] * x[rb, ka]
        for ni in T.vectorized(TH):
            s[1, 1, ni] = s[1, 1, ni] + wb[ni] * x[rb, kb]

    @T.macro
    def scale(acc, i, s, si, r, dd, mm, xs, no, b, hh):  # acc[i] += this block's sum of row r (s[si])
        if q4:
            for ni in T.vectorized(TH):
                acc[i, hh * TH + ni] = (acc[i, hh * TH + ni]
                                        + T.Cast("float32", dd[no, b, hh * TH + ni]) * (s[si, 0, ni] + s[si, 1, ni])
                                        + T.Cast("float32", mm[no, b, hh * TH + ni]) * xs[r, b])
        else:
            for ni in T.vectorized(TH):
                acc[i, hh * TH + ni] = (acc[i, hh * TH + ni]
                                        + T.Cast("float32", dd[no, b, hh * TH + ni]) * (s[si, 0, ni] + s[si, 1, ni]))

    @T.macro
    def dot(acc, acc2, sa, sb, wa, wb, x, r0, r1, r2, r3, q, dd, mm, xs, no):
        # acc (2, TN): rows r0, r1; acc2: r2, r3.  Both halves of a block back to back (its bytes
        # stay in L1 and the weights stream from memory in order)
        for i in T.unroll(2):
            for ni in T.vectorized(TN):
                acc[i, ni] = T.float32(0)
                acc2[i, ni] = T.float32(0)
        for b in range(NB):
            for hh in T.unroll(TN // TH):
                for i in T.unroll(2):
                    for h in T.unroll(2):
                        for ni in T.vectorized(TH):
                            sa[i, h, ni] = T.float32(0)
                            sb[i, h, ni] = T.float32(0)
                for j in range(16):
                    if q4:  # low nibbles (element j) into s[., 0], high (element 16 + j) into s[., 1]
                        for ni in T.vectorized(TH):
                            wa[ni] = T.Cast("float32", T.bitwise_and(q[no, b, j, hh * TH + ni], T.uint8(15)))
                            wb[ni] = T.Cast("float32", T.shift_right(q[no, b, j, hh * TH + ni], T.uint8(4)))
                        pair(sa, wa, wb, x, r0, r1, b * 32 + j, b * 32 + 16 + j)
                        if quad:
                            pair(sb, wa, wb, x, r2, r3, b * 32 + j, b * 32 + 16 + j)
                    else:  # even and odd elements
                        for ni in T.vectorized(TH):
                            wa[ni] = T.Cast("float32", q[no, b, 2 * j, hh * TH + ni])
                            wb[ni] = T.Cast("float32", q[no, b, 2 * j + 1, hh * TH + ni])
                        pair(sa, wa, wb, x, r0, r1, b * 32 + 2 * j, b * 32 + 2 * j + 1)
                        if quad:
                            pair(sb, wa, wb, x, r2, r3, b * 32 + 2 * j, b * 32 + 2 * j + 1)
                scale(acc, 0, sa, 0, r0, dd, mm, xs, no, b, hh)
                scale(acc, 1, sa, 1, r1, dd, mm, xs, no, b, hh)
                if quad:
                    scale(acc2, 0, sb, 0, r2, dd, mm, xs, no, b, hh)
                    scale(acc2, 1, sb, 1, r3, dd, mm, xs, no, b, hh)
    return dot


def _rows_gemv(M: int, K: int, N: int, parallel: bool, q4: bool):
    """Batched decode GEMV: up to 2 real rows as one pair, more in groups of
    RB (the last group clamps to the last row and computes it again), rows
    after the last real one (position -1) skipped; Q4_1 adds the residual
    (padding rows keep it), the Q8_0 LM head writes logits (1, M, N) (padding
    rows zero)."""
    from tvm.script import tirx as T

    assert M >= 2
    NB = K // 32
    loop = T.parallel if parallel else T.serial
    dot2, dot4, block_sums, real_rows = _rows_dot(NB, q4, 2), _rows_dot(NB, q4, RB), _block_sums(NB), _real_rows(M)
    QS = (N // TN, NB, 16, TN) if q4 else (N // TN, NB, 32, TN)

    @T.macro
    def store(y, res, acc, i, r, no):
        for ni in T.vectorized(TN):
            if q4:
                y[r, no * TN + ni] = res[r, no * TN + ni] + acc[i, ni]
            else:
                y[0, r, no * TN + ni] = acc[i, ni]

    @T.macro
    def tile(nr, x, q, dd, mm, xs, res, y, no):
        acc = T.alloc_buffer((2, TN), "float32", scope=REG)
        acc2 = T.alloc_buffer((2, TN), "float32", scope=REG)
        sa = T.alloc_buffer((2, 2, TH), "float32", scope=REG)
        sb = T.alloc_buffer((2, 2, TH), "float32", scope=REG)
        wa = T.alloc_buffer((TH,), "float32", scope=REG)
        wb = T.alloc_buffer((TH,), "float32", scope=REG)
        if nr[0] <= 2:
            dot2(acc, acc2, sa, sb, wa, wb, x, 0, 1, 0, 0, q, dd, mm, xs, no)
            for i in T.unroll(2):
                store(y, res, acc, i, i, no)
        else:
            for ro in range((nr[0] + RB - 1) // RB):
                dot4(acc, acc2, sa, sb, wa, wb, x, T.min(ro * RB, M - 1), T.min(ro * RB + 1, M - 1),
                     T.min(ro * RB + 2, M - 1), T.min(ro * RB + 3, M - 1), q, dd, mm, xs, no)
                for i in T.unroll(2):
                    store(y, res, acc, i, T.min(ro * RB + i, M - 1), no)
                    store(y, res, acc2, i, T.min(ro * RB + 2 + i, M - 1), no)

    if q4:
        @T.prim_func(private=True)
        def f(x: T.Buffer((M, K), "float32"), pos: T.Buffer((1, M), "int64"), q: T.Buffer(QS, "uint8"),
              dd: T.Buffer((N // TN, NB, TN), "float16"), mm: T.Buffer((N // TN, NB, TN), "float16"),
              res: T.Buffer((M, N), "float32"), y: T.Buffer((M, N), "float32")):
            T.func_attr({"tir.noalias": True})
            nr = T.alloc_buffer((1,), "int32", scope=REG)
            real_rows(nr, pos, 0)
            xs = T.alloc_buffer((M, NB), "float32")
            block_sums(xs, x, M)
            for no in loop(N // TN):
                for r in range(M):
                    for ni in T.vectorized(TN):
                        y[r, no * TN + ni] = res[r, no * TN + ni]
                tile(nr, x, q, dd, mm, xs, res, y, no)
        return f

    @T.prim_func(private=True)
    def g(x: T.Buffer((M, K), "float32"), pos: T.Buffer((1, M), "int64"), q: T.Buffer(QS, "int8"),
          dd: T.Buffer((N // TN, NB, TN), "float16"), y: T.Buffer((1, M, N), "float32")):
        T.func_attr({"tir.noalias": True})
        nr = T.alloc_buffer((1,), "int32", scope=REG)
        real_rows(nr, pos, 0)
        for no in loop(N // TN):
            for r in range(M):
                for ni in T.vectorized(TN):
                    y[0, r, no * TN + ni] = T.float32(0)
            tile(nr, x, q, dd, None, None, None, y, no)
    return g


def _q4_1_rows(M: int, K: int, N: int, parallel: bool):
    return _rows_gemv(M, K, N, parallel, True)


def _q8_0_rows(M: int, K: int, N: int, parallel: bool):
    return _rows_gemv(M, K, N, parallel, False)


def _q4_1_decode(K: int, N: int, parallel: bool, DV: int = TN):
    from tvm.script import tirx as T

    NB = K // 32
    loop = T.parallel if parallel else T.serial
    dot, block_sums = _tile_dot(NB, True, DV), _block_sums(NB)

    @T.prim_func(private=True)
    def f(x: T.Buffer((1, K), "float32"), q: T.Buffer((N // TN, NB, 16, TN), "uint8"),
          dd: T.Buffer((N // TN, NB, TN), "float16"), mm: T.Buffer((N // TN, NB, TN), "float16"),
          res: T.Buffer((1, N), "float32"), y: T.Buffer((1, N), "float32")):
        T.func_attr({"tir.noalias": True})
        xs = T.alloc_buffer((1, NB), "float32")
        block_sums(xs, x, 1)
        for no in loop(N // TN):
            acc = T.alloc_buffer((TN,), "float32", scope=REG)
            s = T.alloc_buffer((2, DV), "float32", scope=REG)
            dot(acc, s, x, 0, q, dd, mm, xs, no)
            for ni in T.vectorized(TN):
                y[0, no * TN + ni] = res[0, no * TN + ni] + acc[ni]
    return f


def _q4_1_prefill(M: int, K: int, N: int, tile: tuple[int, int], parallel: bool = True):
    """Each tile's block dequantized once, then ``tile`` = (PR rows, NV outputs)
    register micro-tiles over the real rows (``prefill_tile``); ``parallel``
    False only for timing one core (``tuning``)."""
    from tvm.script import tirx as T

    NB = K // 32
    loop = T.parallel if parallel else T.serial
    PR, NV = tile
    assert PR % 2 == 0 and TN % NV == 0
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
        for no in loop(N // TN):
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
                # PR rows x NV outputs held in registers (two stack buffers of PR/2 rows, each
                # under TVM's 1 KiB stack limit), TN/NV of them across the tile; rows past M
                # clamp to M-1 and compute that row's same value again.  Each output sums in
                # the same order whatever the micro-tile, so every tile gives the same bits
                for ro in range((nr[0] + PR - 1) // PR):
                    for nc in range(TN // NV):
                        a = T.alloc_buffer((PR // 2, NV), "float32", scope=REG)
                        c = T.alloc_buffer((PR // 2, NV), "float32", scope=REG)
                        for ri in T.unroll(PR // 2):
                            for ni in T.vectorized(NV):
                                a[ri, ni] = y[T.min(ro * PR + ri, M - 1), no * TN + nc * NV + ni]
                                c[ri, ni] = y[T.min(ro * PR + PR // 2 + ri, M - 1), no * TN + nc * NV + ni]
                        for k in range(32):
                            for ri in T.unroll(PR // 2):
                                for ni in T.vectorized(NV):
                                    a[ri, ni] = (a[ri, ni]
                                                 + w[k, nc * NV + ni] * x[T.min(ro * PR + ri, M - 1), b * 32 + k])
                            for ri in T.unroll(PR // 2):
                                for ni in T.vectorized(NV):
                                    c[ri, ni] = (c[ri, ni] + w[k, nc * NV + ni]
                                                 * x[T.min(ro * PR + PR // 2 + ri, M - 1), b * 32 + k])
                        for ri in T.unroll(PR // 2):
                            for ni in T.vectorized(NV):
                                y[T.min(ro * PR + ri, M - 1), no * TN + nc * NV + ni] = a[ri, ni]
                                y[T.min(ro * PR + PR // 2 + ri, M - 1), no * TN + nc * NV + ni] = c[ri, ni]
    return f


def _q8_0_decode(K: int, N: int, parallel: bool, DV: int = TN):
    from tvm.script import tirx as T

    NB = K // 32
    # Decode runs serial by default: on 2 CPUs shared with the host and the
    # device's front process, a parallel LM head was no faster (TVM's
    # workers spin on the CPU the IPC needs).
    loop = T.parallel if parallel else T.serial
    dot = _tile_dot(NB, False, DV)
    M = 1  # one row, in the (1, M, N) logits of both forms

    @T.prim_func(private=True)
    def f(x: T.Buffer((M, K), "float32"), q: T.Buffer((N // TN, NB, 32, TN), "int8"),
          dd: T.Buffer((N // TN, NB, TN), "float16"), y: T.Buffer((1, M, N), "float32")):
        T.func_attr({"tir.noalias": True})
        for no in loop(N // TN):
            acc = T.alloc_buffer((TN,), "float32", scope=REG)
            s = T.alloc_buffer((2, DV), "float32", scope=REG)
            dot(acc, s, x, 0, q, dd, None, None, no)
            for ni in T.vectorized(TN):
                y[0, 0, no * TN + ni] = acc[ni]
    return f


def _q8_0_prefill(M: int, K: int, N: int, DV: int = TN):
    """The host reads only the last real row's logits, so only that row is
    computed (one GEMV, parallel over tiles); the other rows are zero."""
    from tvm.script import tirx as T

    NB = K // 32
    dot = _tile_dot(NB, False, DV)
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
            s = T.alloc_buffer((2, DV), "float32", scope=REG)
            last = nr[0] - 1
            dot(acc, s, x, last, q, dd, None, None, no)
            for r in range(M):
                for ni in T.vectorized(TN):
                    y[0, r, no * TN + ni] = T.Select(r == last, acc[ni], T.float32(0))
    return f
