"""Causal GQA attention over the KV cache: one KV head and its G query
heads at a time (each cached K/V row widened to float32 once for the G
heads), for the "rows" and the "blocked" KV layout (kv.py writes both).  Row
r attends to its slot's cache positions ``bases[r] … bases[r] + positions[r]``
(a base is a multiple of the KV block)."""
from __future__ import annotations

from ..sizing import KB, Dims
from .common import REG, rope_q, vexp
from .kv import row_elems


def attention(d: Dims, M: int, parallel: bool, batch: bool = False):
    """(qkv, positions, bases, cos, sin, K, V) -> out (M, dim) for ``d``'s KV layout
    (``batch``: M decode rows, parallel only if ``parallel``)."""
    par = parallel or (M > 1 and not batch)
    return _blocked(d, M, par) if d.kv_layout == "blocked" else _rows(d, M, par)


def _parts(M: int, parallel: bool):
    """The loop over (row, KV head) items: parallel in prefill and decode_parallel."""
    from tvm.script import tirx as T

    return T.parallel if parallel else T.serial


def _rows(d: Dims, M: int, parallel: bool):
    """One row per position; int8 rows carry their scale in 4 trailing bytes."""
    from tvm.script import tirx as T

    D, HKV, HD, C, KD = d.dim, d.n_kv, d.head_dim, d.context, d.kv_dtype
    QKV, G, HALF, RK = d.qkv, d.n_heads // d.n_kv, d.head_dim // 2, row_elems(d)
    rows, rotate = _parts(M, parallel), rope_q(d)

    def row_scale(c, g, t):
        """An int8 row's float32 scale (its 4 trailing bytes); 1 for float rows."""
        if KD != "int8":
            return T.float32(1)
        return T.reinterpret("float32", (
            T.bitwise_and(T.Cast("int32", c[0, g, t, HD]), 255)
            | T.shift_left(T.bitwise_and(T.Cast("int32", c[0, g, t, HD + 1]), 255), 8)
            | T.shift_left(T.bitwise_and(T.Cast("int32", c[0, g, t, HD + 2]), 255), 16)
            | T.shift_left(T.Cast("int32", c[0, g, t, HD + 3]), 24)))

    @T.prim_func(private=True)
    def attention(qkv: T.Buffer((M, QKV), "float32"), pos: T.Buffer((1, M), "int64"),
                  bases: T.Buffer((1, M), "int64"),
                  cos: T.Buffer((C, HALF), "float32"), sin: T.Buffer((C, HALF), "float32"),
                  kc: T.Buffer((1, HKV, C, RK), KD), vc: T.Buffer((1, HKV, C, RK), KD),
                  out: T.Buffer((M, D), "float32")):
        T.func_attr({"tir.noalias": True})
        # One KV head and its G query heads at a time: each cached K/V row is widened to
        # float32 once for the G heads; the softmax's exp is vectorized (vexp).
        for rg in rows(M * HKV):
            qr = T.alloc_buffer((G, HD), "float32", scope=REG)
            kf = T.alloc_buffer((HD,), "float32", scope=REG)
            pp = T.alloc_buffer((16,), "float32", scope=REG)
            o = T.alloc_buffer((G, HD), "float32", scope=REG)
            st = T.alloc_buffer((2, G), "float32", scope=REG)  # max, sum per head
            sv = T.alloc_buffer((16,), "float32", scope=REG)
            sc = T.alloc_buffer((G, C), "float32", scope="local")
            r = rg // HKV
            g = rg % HKV
            p = T.Cast("int32", pos[0, r])
            b = T.Cast("int32", bases[0, r])
            if p >= 0 and b >= 0 and b + p < C:
                for h in T.unroll(G):
                    rotate(qr, qkv, cos, sin, r, g, h, p)
                    st[0, h] = T.float32(-3.0e38)
                for t in range(p + 1):
                    for e in T.vectorized(HD):
                        kf[e] = T.Cast("float32", kc[0, g, b + t, e])
                    ks_ = row_scale(kc, g, b + t)
                    for h in T.unroll(G):
                        for e in T.vectorized(16):
                            pp[e] = (qr[h, e] * kf[e] + qr[h, 16 + e] * kf[16 + e]
                                     + qr[h, 32 + e] * kf[32 + e] + qr[h, 48 + e] * kf[48 + e])
                        # lane sum as a halving tree (vector adds and shuffles, not 15 scalar adds)
                        for e in T.vectorized(8):
                            pp[e] = pp[e] + pp[8 + e]
                        for e in T.vectorized(4):
                            pp[e] = pp[e] + pp[4 + e]
                        sc[h, t] = ((pp[0] + pp[2]) + (pp[1] + pp[3])) * ks_
                        st[0, h] = T.max(st[0, h], sc[h, t])
                for h in T.unroll(G):
                    for e in T.vectorized(16):
                        sv[e] = T.float32(0)
                    for tb in range((p + 16) // 16):
                        for e in T.vectorized(16):
                            sc[h, tb * 16 + e] = T.Select(tb * 16 + e <= p, vexp(sc[h, tb * 16 + e] - st[0, h]),
                                                          T.float32(0))
                            sv[e] = sv[e] + sc[h, tb * 16 + e]
                    for e in T.vectorized(8):
                        sv[e] = sv[e] + sv[8 + e]
                    for e in T.vectorized(4):
                        sv[e] = sv[e] + sv[4 + e]
                    st[1, h] = (sv[0] + sv[2]) + (sv[1] + sv[3])
                    for e in T.vectorized(HD):
                        o[h, e] = T.float32(0)
                for t in range(p + 1):
                    vs_ = row_scale(vc, g, b + t)
                    for e in T.vectorized(HD):
                        kf[e] = T.Cast("float32", vc[0, g, b + t, e]) * vs_
                    for h in T.unroll(G):
                        for e in T.vectorized(HD):
                            o[h, e] = o[h, e] + sc[h, t] * kf[e]
                for h in T.unroll(G):
                    for e in T.vectorized(HD):
                        out[r, (g * G + h) * HD + e] = o[h, e] / st[1, h]
            else:
                for e in range(G * HD):
                    out[r, g * G * HD + e] = T.float32(0)
    return attention


def _blocked(d: Dims, M: int, parallel: bool):
    """The "blocked" layout: q·k runs KB positions per vector (no lane sums),
    and the int8 scales are vector loads folded into the scores (K) and the
    softmax weights (V)."""
    from tvm.script import tirx as T

    D, HKV, HD, C, KD = d.dim, d.n_kv, d.head_dim, d.context, d.kv_dtype
    QKV, G, HALF, RK = d.qkv, d.n_heads // d.n_kv, d.head_dim // 2, row_elems(d)
    NBK, KBLK = C // KB, KB * RK  # blocks; elements per block (int8: KB*64 values + KB*4 scale bytes)
    rows, rotate = _parts(M, parallel), rope_q(d)
    # decode_parallel splits each KV head's positions in NS parts (3 heads x 2 parts = 3
    # items per core on 2 cores, instead of 2 heads on one and 1 on the other), merged after
    NS = 2 if M == 1 and parallel else 1
    qk, softmax, merge = _blocked_qk(d), _blocked_softmax(d), _merge_parts(d, M, NS)

    @T.prim_func(private=True)
    def attention_blocked(qkv: T.Buffer((M, QKV), "float32"), pos: T.Buffer((1, M), "int64"),
                          bases: T.Buffer((1, M), "int64"),
                          cos: T.Buffer((C, HALF), "float32"), sin: T.Buffer((C, HALF), "float32"),
                          kc: T.Buffer((1, HKV, C, RK), KD), vc: T.Buffer((1, HKV, C, RK), KD),
                          out: T.Buffer((M, D), "float32")):
        T.func_attr({"tir.noalias": True})
        kb = T.decl_buffer((HKV, NBK, KBLK), KD, data=kc.data)
        vb = T.decl_buffer((HKV, NBK, KBLK), KD, data=vc.data)
        ksc = T.decl_buffer((HKV, NBK, KBLK // 4), "float32", data=kc.data)
        vsc = T.decl_buffer((HKV, NBK, KBLK // 4), "float32", data=vc.data)
        part = T.alloc_buffer((M * HKV * NS if NS > 1 else 1, G, HD + 2), "float32")  # o, max, sum of each part
        for it in rows(M * HKV * NS):
            qr = T.alloc_buffer((G, HD), "float32", scope=REG)
            acc = T.alloc_buffer((G, 4, KB), "float32", scope=REG)  # 4 partial sums: 12 FMA chains
            kf = T.alloc_buffer((HD,), "float32", scope=REG)
            mv = T.alloc_buffer((G, KB), "float32", scope=REG)
            o = T.alloc_buffer((G, HD), "float32", scope=REG)
            st = T.alloc_buffer((2, G), "float32", scope=REG)  # max, sum per head
            sv = T.alloc_buffer((G, KB), "float32", scope=REG)
            sc = T.alloc_buffer((G, C), "float32", scope="local")
            r = it // (HKV * NS)
            g = it // NS % HKV
            p = T.Cast("int32", pos[0, r])
            bo = T.Cast("int32", bases[0, r]) // KB  # the slot's first block
            b0 = it % NS * ((p + KB) // KB) // NS  # this part's blocks b0 <= tb < b1
            b1 = (it % NS + 1) * ((p + KB) // KB) // NS
            for h in T.unroll(G):
                for e in T.vectorized(HD):
                    o[h, e] = T.float32(0)
                st[0, h] = T.float32(-3.0e38)
                st[1, h] = T.float32(0)
            if p >= 0 and bo >= 0 and bo * KB + p < C and b0 < b1:
                for h in T.unroll(G):
                    rotate(qr, qkv, cos, sin, r, g, h, p)
                    for j in T.vectorized(KB):
                        mv[h, j] = T.float32(-3.0e38)
                qk(sc, mv, acc, kf, qr, kb, ksc, g, p, bo, b0, b1)
                softmax(sc, st, mv, sv, vsc, g, p, bo, b0, b1)
                for t in range(b0 * KB, T.min(b1 * KB, p + 1)):
                    for e in T.vectorized(HD):
                        kf[e] = T.Cast("float32", vb[g, bo + t // KB, (t % KB) * HD + e])
                    for h in T.unroll(G):
                        for e in T.vectorized(HD):
                            o[h, e] = o[h, e] + sc[h, t] * kf[e]
            for h in T.unroll(G):
                if NS == 1:
                    for e in T.vectorized(HD):
                        out[r, (g * G + h) * HD + e] = T.Select(st[1, h] > T.float32(0), o[h, e] / st[1, h],
                                                                T.float32(0))
                else:
                    for e in T.vectorized(HD):
                        part[it, h, e] = o[h, e]
                    part[it, h, HD] = st[0, h]
                    part[it, h, HD + 1] = st[1, h]
        if NS > 1:
            merge(out, part)
    return attention_blocked


def _blocked_qk(d: Dims):
    """Macro: the scores sc (G, C) of blocks b0 <= tb < b1 (-inf past p), KB
    positions per vector, each widened K column shared by the G heads; mv
    keeps each lane's running max."""
    from tvm.script import tirx as T

    G, HD = d.n_heads // d.n_kv, d.head_dim
    SOFF = KB * HD // 4  # a block's first scale, in float32 elements
    Q8 = d.kv_dtype == "int8"

    @T.macro
    def qk(sc, mv, acc, kf, qr, kb, ksc, g, p, bo, b0, b1):
        for tb in range(b0, b1):
            for h in T.unroll(G):
                for u in T.unroll(4):
                    for j in T.vectorized(KB):
                        acc[h, u, j] = T.float32(0)
            for eo in range(HD // 4):
                for u in T.unroll(4):
                    for j in T.vectorized(KB):
                        kf[u * KB + j] = T.Cast("float32", kb[g, bo + tb, (eo * 4 + u) * KB + j])
                    for h in T.unroll(G):
                        for j in T.vectorized(KB):
                            acc[h, u, j] = acc[h, u, j] + qr[h, eo * 4 + u] * kf[u * KB + j]
            for h in T.unroll(G):
                for j in T.vectorized(KB):
                    if Q8:
                        sc[h, tb * KB + j] = T.Select(
                            tb * KB + j <= p,
                            ((acc[h, 0, j] + acc[h, 1, j]) + (acc[h, 2, j] + acc[h, 3, j])) * ksc[g, bo + tb, SOFF + j],
                            T.float32(-3.0e38))
                    else:
                        sc[h, tb * KB + j] = T.Select(
                            tb * KB + j <= p, (acc[h, 0, j] + acc[h, 1, j]) + (acc[h, 2, j] + acc[h, 3, j]),
                            T.float32(-3.0e38))
                    mv[h, j] = T.max(mv[h, j], sc[h, tb * KB + j])
    return qk


def _blocked_softmax(d: Dims):
    """Macro: st[0] = each head's max, sc = exp(sc - max) (times V's int8
    scale), st[1] = their sum; the G heads side by side."""
    from tvm.script import tirx as T

    G, HD = d.n_heads // d.n_kv, d.head_dim
    SOFF = KB * HD // 4
    Q8 = d.kv_dtype == "int8"

    @T.macro
    def softmax(sc, st, mv, sv, vsc, g, p, bo, b0, b1):
        for h in T.unroll(G):
            for e in T.vectorized(8):
                mv[h, e] = T.max(mv[h, e], mv[h, 8 + e])
            for e in T.vectorized(4):
                mv[h, e] = T.max(mv[h, e], mv[h, 4 + e])
            st[0, h] = T.max(T.max(mv[h, 0], mv[h, 2]), T.max(mv[h, 1], mv[h, 3]))
            for e in T.vectorized(KB):
                sv[h, e] = T.float32(0)
        for tb in range(b0, b1):
            for h in T.unroll(G):
                for e in T.vectorized(KB):
                    sc[h, tb * KB + e] = T.Select(tb * KB + e <= p, vexp(sc[h, tb * KB + e] - st[0, h]),
                                                  T.float32(0))
                    sv[h, e] = sv[h, e] + sc[h, tb * KB + e]
                    if Q8:  # V's scale folded into the weight (after the sum: it is not normalized)
                        sc[h, tb * KB + e] = sc[h, tb * KB + e] * vsc[g, bo + tb, SOFF + e]
        for h in T.unroll(G):
            for e in T.vectorized(8):
                sv[h, e] = sv[h, e] + sv[h, 8 + e]
            for e in T.vectorized(4):
                sv[h, e] = sv[h, e] + sv[h, 4 + e]
            st[1, h] = (sv[h, 0] + sv[h, 2]) + (sv[h, 1] + sv[h, 3])
    return softmax


def _merge_parts(d: Dims, M: int, NS: int):
    """Macro: out = the NS parts of each (row, KV head) combined, each part's
    o weighted by exp(its max - the max) and its share of the sum."""
    from tvm.script import tirx as T

    HKV, G, HD = d.n_kv, d.n_heads // d.n_kv, d.head_dim

    @T.macro
    def merge(out, part):
        for rg in range(M * HKV):
            for h in range(G):
                w = T.alloc_buffer((NS + 1,), "float32", scope=REG)  # each part's weight, their sum
                mx = T.alloc_buffer((1,), "float32", scope=REG)
                mx[0] = T.float32(-3.0e38)
                for s_ in range(NS):
                    mx[0] = T.max(mx[0], part[rg * NS + s_, h, HD])
                w[NS] = T.float32(0)
                for s_ in range(NS):
                    w[s_] = vexp(part[rg * NS + s_, h, HD] - mx[0])
                    w[NS] = w[NS] + w[s_] * part[rg * NS + s_, h, HD + 1]
                for e in T.vectorized(HD):
                    out[rg // HKV, (rg % HKV * G + h) * HD + e] = T.float32(0)
                for s_ in range(NS):
                    for e in T.vectorized(HD):
                        out[rg // HKV, (rg % HKV * G + h) * HD + e] = (
                            out[rg // HKV, (rg % HKV * G + h) * HD + e]
                            + T.Select(w[NS] > T.float32(0), part[rg * NS + s_, h, e] * w[s_] / w[NS], T.float32(0)))
    return merge
