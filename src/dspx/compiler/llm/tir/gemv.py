"""The fused dequantize-GEMV kernels: Q4_1 linear layers (q/k/v, o,
gate/up, down) and the Q8_0 LM head, each a decode form (one row, TN
outputs per tile in registers) and a prefill form (M rows).

Decode's Q4_1 layers (one row, and the batched rows) take their input
quantized per 32-element block to int8 (``int8``, the default
``decode_activations``; float32 on request), as llama.cpp's Q8_1 does:
xd = max|x| / 127, xq = rint(x · (1 / xd)), and each block's dot product is
integer, Σ nibble · xq, in int16 (16 terms of at most 15 · 127 = 1,905 each:
30,480 < 32,767, so it never overflows).  The block's value is
d · xd · Σ(nibble · xq) + m · Σx (Σx exact, in float32).  On a CPU without
integer dot instructions this is still twice the float32 path's speed: a
multiply-add of 16 int16 lanes where the float path converted each weight
to float32 first (decode was bound by that conversion, not by memory).
Where the CPU has VNNI, each block's dot product is one int32 from vpdpbusd
instead (``_vnni_dot``): the same integer, so the same bits.
Prefill and the Q8_0 LM head stay float32."""
from __future__ import annotations

from ..sizing import TN
from .common import REG, decode_slice, prefill_tile


def gemv_q4_1(M: int, K: int, N: int, parallel: bool, batch: bool = False, tile: tuple[int, int] | None = None,
              lanes: int = 16, int8: bool = True, vnni: int = 0):
    """x (M, K) · W (K -> N) + res -> y (M, N); prefill and batch take the positions too.
    ``tile``: the prefill GEMM's register micro-tile (``tuning``; default ``prefill_tile(lanes)``);
    ``lanes``: the target's float32 vector lanes, which size the decode slices (``decode_slice``);
    ``int8``: decode and batch quantize x (the module docstring); ``vnni``: with ``int8``, their block sums
    on vpdpbusd of ``vnni`` int32 lanes (``vnni_lanes``; ``_vnni_dot``: the same integers, so the same bits)."""
    vnni = vnni if int8 else 0
    if M == 1:
        return _q4_1_decode(K, N, parallel, decode_slice(lanes), int8, vnni)
    if batch:
        return _rows_gemv(M, K, N, parallel, True, int8, vnni)
    return _q4_1_prefill(M, K, N, tile or prefill_tile(lanes))


def gemv_q8_0(M: int, K: int, N: int, parallel: bool, batch: bool = False, lanes: int = 16):
    """The LM head: x (M, K) · W (K -> N) -> logits (1, M, N)."""
    if M == 1:
        return _q8_0_decode(K, N, parallel, decode_slice(lanes))
    return _q8_0_rows(M, K, N, parallel) if batch else _q8_0_prefill(M, K, N, decode_slice(lanes))


def _tile_dot(NB: int, q4: bool, DV: int = TN, int8: bool = False):
    """Macro: acc (TN,) = one TN-output tile ``no`` of W times row ``row`` of x.
    Two partial sums per block (s[0], s[1]): 8 independent FMA chains per tile
    instead of 4 (latency, not throughput, bound).  Q4_1 also takes mm and
    xs (the block sums of x, for the m·Σx term); with ``int8``, x quantized
    (xq int16, xd: ``_quantized_rows``) and s int16.  Q8_0 passes None for mm, xs, xd.
    Each block runs in TN/DV slices of DV outputs, s (2, DV) in registers
    (``decode_slice``); every output sums in the same order whatever DV."""
    from tvm.script import tirx as T

    wt = "int16" if int8 else "float32"  # what each weight is converted to

    @T.macro
    def dot(acc, s, x, xd, row, q, dd, mm, xs, no):
        for ni in T.vectorized(TN):
            acc[ni] = T.float32(0)
        for b in range(NB):
            for hv in T.unroll(TN // DV):
                for h in T.unroll(2):
                    for ni in T.vectorized(DV):
                        s[h, ni] = T.Cast(s.dtype, 0)
                if q4:  # low nibbles into s[0], high into s[1]
                    for j in range(16):
                        for ni in T.vectorized(DV):
                            s[0, ni] = s[0, ni] + (T.Cast(wt, T.bitwise_and(q[no, b, j, hv * DV + ni], T.uint8(15)))
                                                   * x[row, b * 32 + j])
                        for ni in T.vectorized(DV):
                            s[1, ni] = s[1, ni] + (T.Cast(wt, T.shift_right(q[no, b, j, hv * DV + ni], T.uint8(4)))
                                                   * x[row, b * 32 + 16 + j])
                    for ni in T.vectorized(DV):
                        acc[hv * DV + ni] = _q4_block(acc[hv * DV + ni], dd[no, b, hv * DV + ni],
                                                      xd[row, b] if int8 else None, s[0, ni], s[1, ni],
                                                      mm[no, b, hv * DV + ni], xs[row, b])
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


def _q4_block(acc, d, xd, lo, hi, m, xs):
    """acc + one Q4_1 block's value from its two partial sums: int16 with xd
    (the quantized input), else float32 (xd None).  One expression for the
    decode and the batched rows: the same bits."""
    from tvm.script import tirx as T

    if xd is None:
        return acc + T.Cast("float32", d) * (lo + hi) + T.Cast("float32", m) * xs
    return _q4_block_sum(acc, d, xd, T.Cast("int32", lo) + T.Cast("int32", hi), m, xs)


def _q4_block_sum(acc, d, xd, isum, m, xs):
    """acc + one Q4_1 block's value from its whole integer dot product ``isum`` (int32) with the quantized input."""
    from tvm.script import tirx as T

    return acc + T.Cast("float32", d) * xd * T.Cast("float32", isum) + T.Cast("float32", m) * xs


def _quantized_rows(NB: int, int8: bool = True):
    """Macro: rows 0 … M-1 of x per 32-element block b: xs[r, b] = Σx (the
    m·Σx term of Q4_1); with ``int8`` also xd[r, b] = max|x| / 127 and
    xq[r, k] = rint(x · (1 / xd)) in xq's type (int16, int8 for VNNI), clamped to ±127 (a NaN in a
    padding row too).  An all-zero block has xd 0 and xq 0."""
    from tvm.script import tirx as T

    @T.macro
    def quantize(xs, xd, xq, x, M):
        for r in range(M):
            for b in range(NB):
                am = T.alloc_buffer((2,), "float32", scope=REG)  # max|x|, then 1 / xd
                xs[r, b] = T.float32(0)
                am[0] = T.float32(0)
                for j in range(32):
                    xs[r, b] = xs[r, b] + x[r, b * 32 + j]
                    if int8:
                        am[0] = T.max(am[0], T.abs(x[r, b * 32 + j]))
                if int8:
                    xd[r, b] = am[0] / T.float32(127)
                    am[1] = T.Select(am[0] > T.float32(0), T.float32(1) / xd[r, b], T.float32(0))
                    for j in T.vectorized(32):
                        xq[r, b * 32 + j] = T.Cast(xq.dtype, T.max(T.min(T.nearbyint(x[r, b * 32 + j] * am[1]),
                                                                        T.float32(127)), T.float32(-127)))
    return quantize


_NIBBLES = 0x0F0F0F0F


def _vnni_weights(q, no, b, jg, qt, high: bool, w: int):
    """Outputs qt·w … qt·w + w - 1 of tile ``no``, elements 4jg … 4jg + 3 (``high``: 16 + those) of block b,
    as vpdpbusd's unsigned operand: dword n = output n's four nibbles.  q holds byte j of output n at
    [no, b, j, n] (low nibble element j, high 16 + j): the four bytes 4jg … 4jg + 3 of w outputs are
    transposed in registers (w = 16, LLVM: two 32-byte loads and one vpermt2b), then masked to one nibble."""
    from tvm.script import tirx as T

    rows = [q.vload([no, b, 4 * jg + i, qt * w], f"uint8x{w}") for i in range(4)]
    order = [i * w + n for n in range(w) for i in range(4)]  # byte 4n + i <- byte n of row i
    dw = T.reinterpret(T.Shuffle(rows, order), dtype=f"int32x{w}")
    if high:
        dw = T.shift_right(dw, T.broadcast(T.int32(4), w))
    return T.reinterpret(T.bitwise_and(dw, T.broadcast(T.int32(_NIBBLES), w)), dtype=f"int8x{4 * w}")


def _vnni_input(xq, r, k, w: int):
    """xq[r, k … k + 3] (int8) in every dword: vpdpbusd's signed operand."""
    from tvm.script import tirx as T

    dword = T.reinterpret(xq.vload([r, k], "int8x4"), dtype="int32")
    return T.reinterpret(T.broadcast(dword, w), dtype=f"int8x{4 * w}")


def _vpdpbusd(acc, u8, s8, w: int):
    """acc (int32 × w) + the four u8 · s8 products of each lane: zmm (w = 16, AVX-512 VNNI) or ymm
    (w = 8: AVX512VL's form, or AVX-VNNI's, which LLVM selects from the same intrinsic)."""
    from tvm.script import tirx as T

    return T.call_llvm_pure_intrin(f"int32x{w}", f"llvm.x86.avx512.vpdpbusd.{32 * w}", acc, u8, s8)


def _vnni_dot(NB: int, rows: int, M: int, w: int):
    """Macro: acc (rows, w) = outputs qt·w … + w - 1 of tile ``no`` for rows min(base + i, M - 1) of the
    int8-quantized x (xq int8, xd, xs: ``_quantized_rows``).  Each block's Σ nibble · xq is one int32
    (vpdpbusd: four u8 · s8 products per lane, eight instructions per block, row and w outputs), the same integer
    as ``_tile_dot``'s two int16 sums, and it scales into acc by the same expression (``_q4_block_sum``),
    so every row's bits are the decode's."""
    from tvm.script import tirx as T

    def row(base, i):
        return T.min(base + i, M - 1)

    @T.macro
    def dot(acc, s, xq, xd, base, q, dd, mm, xs, no, qt):
        for i in T.unroll(rows):
            for n in T.vectorized(w):
                acc[i, n] = T.float32(0)
        for b in range(NB):
            for i in T.unroll(rows):
                for n in T.vectorized(w):
                    s[i, n] = 0
            for jg in T.unroll(4):
                for i in T.unroll(rows):
                    s[i, T.ramp(0, 1, w)] = _vpdpbusd(
                        _vpdpbusd(s.vload([i, 0], f"int32x{w}"), _vnni_weights(q, no, b, jg, qt, False, w),
                                  _vnni_input(xq, row(base, i), b * 32 + 4 * jg, w), w),
                        _vnni_weights(q, no, b, jg, qt, True, w), _vnni_input(xq, row(base, i), b * 32 + 16 + 4 * jg, w),
                        w)
            for i in T.unroll(rows):
                for n in T.vectorized(w):
                    acc[i, n] = _q4_block_sum(acc[i, n], dd[no, b, qt * w + n], xd[row(base, i), b], s[i, n],
                                              mm[no, b, qt * w + n], xs[row(base, i), b])
    return dot


RB = 4   # batched decode: rows per group, sharing each weight's conversion to float32
TH = 32  # batched decode: outputs per half tile (RB rows x 2 partial sums x TH in registers)


def _rows_dot(NB: int, q4: bool, rows: int, int8: bool = False):
    """Macro: ``rows`` (1, 2 or RB) rows r0..r3 of x times half ``hh`` of tile
    ``no``, into acc (rows r0, r1) and acc2 (r2, r3), each (2, TN): each weight is converted once for
    the rows (to int16 with ``int8``, x quantized as in ``_tile_dot``; else to float32), and every row sums exactly
    as ``_tile_dot`` does (same partial sums, same order), so a batched row's logits are bit for bit the decode
    entry's."""
    from tvm.script import tirx as T

    single, quad = rows == 1, rows == RB
    wt = "int16" if int8 else "float32"

    @T.macro
    def one(s, wa, wb, x, ra, ka, kb):  # one row's partial sums s[0] (2, TH) += w * x, as ``pair``'s first row
        for ni in T.vectorized(TH):
            s[0, 0, ni] = s[0, 0, ni] + wa[ni] * x[ra, ka]
        for ni in T.vectorized(TH):
            s[0, 1, ni] = s[0, 1, ni] + wb[ni] * x[ra, kb]

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
    def scale(acc, i, s, si, r, dd, mm, xs, xd, no, b, hh):  # acc[i] += this block's sum of row r (s[si])
        if q4:
            for ni in T.vectorized(TH):
                acc[i, hh * TH + ni] = _q4_block(acc[i, hh * TH + ni], dd[no, b, hh * TH + ni],
                                                 xd[r, b] if int8 else None, s[si, 0, ni], s[si, 1, ni],
                                                 mm[no, b, hh * TH + ni], xs[r, b])
        else:
            for ni in T.vectorized(TH):
                acc[i, hh * TH + ni] = (acc[i, hh * TH + ni]
                                        + T.Cast("float32", dd[no, b, hh * TH + ni]) * (s[si, 0, ni] + s[si, 1, ni]))

    @T.macro
    def dot(acc, acc2, sa, sb, wa, wb, x, xd, r0, r1, r2, r3, q, dd, mm, xs, no):
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
                            sa[i, h, ni] = T.Cast(sa.dtype, 0)
                            sb[i, h, ni] = T.Cast(sb.dtype, 0)
                for j in range(16):
                    if q4:  # low nibbles (element j) into s[., 0], high (element 16 + j) into s[., 1]
                        for ni in T.vectorized(TH):
                            wa[ni] = T.Cast(wt, T.bitwise_and(q[no, b, j, hh * TH + ni], T.uint8(15)))
                            wb[ni] = T.Cast(wt, T.shift_right(q[no, b, j, hh * TH + ni], T.uint8(4)))
                        if single:
                            one(sa, wa, wb, x, r0, b * 32 + j, b * 32 + 16 + j)
                        else:
                            pair(sa, wa, wb, x, r0, r1, b * 32 + j, b * 32 + 16 + j)
                        if quad:
                            pair(sb, wa, wb, x, r2, r3, b * 32 + j, b * 32 + 16 + j)
                    else:  # even and odd elements
                        for ni in T.vectorized(TH):
                            wa[ni] = T.Cast("float32", q[no, b, 2 * j, hh * TH + ni])
                            wb[ni] = T.Cast("float32", q[no, b, 2 * j + 1, hh * TH + ni])
                        if single:
                            one(sa, wa, wb, x, r0, b * 32 + 2 * j, b * 32 + 2 * j + 1)
                        else:
                            pair(sa, wa, wb, x, r0, r1, b * 32 + 2 * j, b * 32 + 2 * j + 1)
                        if quad:
                            pair(sb, wa, wb, x, r2, r3, b * 32 + 2 * j, b * 32 + 2 * j + 1)
                scale(acc, 0, sa, 0, r0, dd, mm, xs, xd, no, b, hh)
                if not single:
                    scale(acc, 1, sa, 1, r1, dd, mm, xs, xd, no, b, hh)
                if quad:
                    scale(acc2, 0, sb, 0, r2, dd, mm, xs, xd, no, b, hh)
                    scale(acc2, 1, sb, 1, r3, dd, mm, xs, xd, no, b, hh)
    return dot


def _rows_gemv(M: int, K: int, N: int, parallel: bool, q4: bool, int8: bool = False, vnni: int = 0):
    """Batched decode GEMV: a lone real row alone, 2 as one pair, more in groups of
    RB (the last group clamps to the last row and computes it again), rows
    after the last real one (position -1) skipped; Q4_1 adds the residual
    (padding rows keep it), the Q8_0 LM head writes logits (1, M, N) (padding
    rows zero).  ``vnni`` (Q4_1 with ``int8``): the block sums on vpdpbusd of that many lanes (``_vnni_dot``)."""
    from tvm.script import tirx as T

    assert M >= 2
    NB = K // 32
    loop = T.parallel if parallel else T.serial
    dot1, dot2, dot4 = (_rows_dot(NB, q4, rows, int8) for rows in (1, 2, RB))
    real_rows = _real_rows(M)
    quantize = _quantized_rows(NB, int8)
    VQ, on_vnni = vnni or 16, bool(vnni)  # outputs per vpdpbusd; TVMScript's `if` takes a bool
    xq_type = "int8" if vnni else "int16"
    vdot1, vdot2, vdot4 = (_vnni_dot(NB, rows, M, VQ) for rows in (1, 2, RB))
    st = "int16" if int8 else "float32"  # the partial sums and the converted weights
    QS = (N // TN, NB, 16, TN) if q4 else (N // TN, NB, 32, TN)

    @T.macro
    def store(y, res, acc, i, r, no):
        for ni in T.vectorized(TN):
            if q4:
                y[r, no * TN + ni] = res[r, no * TN + ni] + acc[i, ni]
            else:
                y[0, r, no * TN + ni] = acc[i, ni]

    @T.macro
    def tile(nr, x, xd, q, dd, mm, xs, res, y, no):
        acc = T.alloc_buffer((2, TN), "float32", scope=REG)
        acc2 = T.alloc_buffer((2, TN), "float32", scope=REG)
        sa = T.alloc_buffer((2, 2, TH), st, scope=REG)
        sb = T.alloc_buffer((2, 2, TH), st, scope=REG)
        wa = T.alloc_buffer((TH,), st, scope=REG)
        wb = T.alloc_buffer((TH,), st, scope=REG)
        if nr[0] == 1:  # a lone row (one slot decoding): its own work only
            dot1(acc, acc2, sa, sb, wa, wb, x, xd, 0, 0, 0, 0, q, dd, mm, xs, no)
            store(y, res, acc, 0, 0, no)
        elif nr[0] == 2:
            dot2(acc, acc2, sa, sb, wa, wb, x, xd, 0, 1, 0, 0, q, dd, mm, xs, no)
            for i in T.unroll(2):
                store(y, res, acc, i, i, no)
        else:
            for ro in range((nr[0] + RB - 1) // RB):
                dot4(acc, acc2, sa, sb, wa, wb, x, xd, T.min(ro * RB, M - 1), T.min(ro * RB + 1, M - 1),
                     T.min(ro * RB + 2, M - 1), T.min(ro * RB + 3, M - 1), q, dd, mm, xs, no)
                for i in T.unroll(2):
                    store(y, res, acc, i, T.min(ro * RB + i, M - 1), no)
                    store(y, res, acc2, i, T.min(ro * RB + 2 + i, M - 1), no)

    @T.macro
    def vnni_tile(nr, xq, xd, q, dd, mm, xs, res, y, no):
        acc = T.alloc_buffer((RB, VQ), "float32", scope=REG)
        s = T.alloc_buffer((RB, VQ), "int32", scope=REG)
        for qt in range(TN // VQ):
            if nr[0] == 1:
                vdot1(acc, s, xq, xd, 0, q, dd, mm, xs, no, qt)
                for n in T.vectorized(VQ):
                    y[0, no * TN + qt * VQ + n] = res[0, no * TN + qt * VQ + n] + acc[0, n]
            elif nr[0] == 2:
                vdot2(acc, s, xq, xd, 0, q, dd, mm, xs, no, qt)
                for i in T.unroll(2):
                    for n in T.vectorized(VQ):
                        y[i, no * TN + qt * VQ + n] = res[i, no * TN + qt * VQ + n] + acc[i, n]
            else:
                for ro in range((nr[0] + RB - 1) // RB):
                    vdot4(acc, s, xq, xd, ro * RB, q, dd, mm, xs, no, qt)
                    for i in T.unroll(RB):
                        for n in T.vectorized(VQ):
                            y[T.min(ro * RB + i, M - 1), no * TN + qt * VQ + n] = (
                                res[T.min(ro * RB + i, M - 1), no * TN + qt * VQ + n] + acc[i, n])

    if q4:
        @T.prim_func(private=True)
        def f(x: T.Buffer((M, K), "float32"), pos: T.Buffer((1, M), "int64"), q: T.Buffer(QS, "uint8"),
              dd: T.Buffer((N // TN, NB, TN), "float16"), mm: T.Buffer((N // TN, NB, TN), "float16"),
              res: T.Buffer((M, N), "float32"), y: T.Buffer((M, N), "float32")):
            T.func_attr({"tir.noalias": True})
            nr = T.alloc_buffer((1,), "int32", scope=REG)
            real_rows(nr, pos, 0)
            xs = T.alloc_buffer((M, NB), "float32")
            xd = T.alloc_buffer((M, NB), "float32")
            xq = T.alloc_buffer((M, K), xq_type)
            quantize(xs, xd, xq, x, M)
            for no in loop(N // TN):
                for r in range(M):
                    for ni in T.vectorized(TN):
                        y[r, no * TN + ni] = res[r, no * TN + ni]
                if on_vnni:
                    vnni_tile(nr, xq, xd, q, dd, mm, xs, res, y, no)
                else:
                    tile(nr, xq if int8 else x, xd, q, dd, mm, xs, res, y, no)
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
            tile(nr, x, None, q, dd, None, None, None, y, no)
    return g


def _q8_0_rows(M: int, K: int, N: int, parallel: bool):
    return _rows_gemv(M, K, N, parallel, False)


def _q4_1_decode(K: int, N: int, parallel: bool, DV: int = TN, int8: bool = True, vnni: int = 0):
    """Decode's Q4_1 GEMV: each tile in slices of DV outputs (``_tile_dot``), or with ``vnni`` (int8 x) its
    block sums on vpdpbusd of that many lanes (``_vnni_dot``, one row): the same bits."""
    from tvm.script import tirx as T

    NB = K // 32
    loop = T.parallel if parallel else T.serial
    dot, quantize = _tile_dot(NB, True, DV, int8), _quantized_rows(NB, int8)
    VQ, on_vnni = vnni or 16, bool(vnni)  # TVMScript's `if` takes a bool
    vdot = _vnni_dot(NB, 1, 1, VQ)
    xq_type = "int8" if vnni else "int16"
    st = "int16" if int8 else "float32"

    @T.prim_func(private=True)
    def f(x: T.Buffer((1, K), "float32"), q: T.Buffer((N // TN, NB, 16, TN), "uint8"),
          dd: T.Buffer((N // TN, NB, TN), "float16"), mm: T.Buffer((N // TN, NB, TN), "float16"),
          res: T.Buffer((1, N), "float32"), y: T.Buffer((1, N), "float32")):
        T.func_attr({"tir.noalias": True})
        xs = T.alloc_buffer((1, NB), "float32")
        xd = T.alloc_buffer((1, NB), "float32")
        xq = T.alloc_buffer((1, K), xq_type)
        quantize(xs, xd, xq, x, 1)
        for no in loop(N // TN):
            if on_vnni:
                va = T.alloc_buffer((1, VQ), "float32", scope=REG)
                vs = T.alloc_buffer((1, VQ), "int32", scope=REG)
                for qt in range(TN // VQ):
                    vdot(va, vs, xq, xd, 0, q, dd, mm, xs, no, qt)
                    for n in T.vectorized(VQ):
                        y[0, no * TN + qt * VQ + n] = res[0, no * TN + qt * VQ + n] + va[0, n]
            else:
                acc = T.alloc_buffer((TN,), "float32", scope=REG)
                s = T.alloc_buffer((2, DV), st, scope=REG)
                dot(acc, s, xq if int8 else x, xd, 0, q, dd, mm, xs, no)
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
            dot(acc, s, x, None, 0, q, dd, None, None, no)
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
            dot(acc, s, x, None, last, q, dd, None, None, no)
            for r in range(M):
                for ni in T.vectorized(TN):
                    y[0, r, no * TN + ni] = T.Select(r == last, acc[ni], T.float32(0))
    return f
