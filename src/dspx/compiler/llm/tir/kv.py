"""The KV append (RoPE on K, then K and V written at each row's position,
in place on the KV inputs), for each element type and arrangement.  A row's
KV goes to its slot: cache position ``bases[r] + positions[r]``, rotated for
``positions[r]`` (base 0, one slot, is the whole cache)."""
from __future__ import annotations

from ..sizing import KB, Dims
from .common import REG


def kv_write(d: Dims, M: int):
    """The append for ``d``'s KV dtype and layout."""
    if d.kv_layout == "rows" and d.kv_dtype != "int8":
        return _rows(d, M)
    return _via_row(d, M)


def row_elems(d: Dims) -> int:
    """Elements per cached row: an int8 row is 64 values + its float32 scale's 4 bytes."""
    return d.head_dim + 4 if d.kv_dtype == "int8" else d.head_dim


def _rope_k(d: Dims):
    """Macro: KV head g's key of row r, rotated for position p, into row (head_dim,)."""
    from tvm.script import tirx as T

    D, HD, HALF = d.dim, d.head_dim, d.head_dim // 2

    @T.macro
    def rope_k(row, qkv, cos, sin, r, g, p):
        for i in range(HALF):
            row[2 * i] = (qkv[r, D + g * HD + 2 * i] * cos[p, i]
                          - qkv[r, D + g * HD + 2 * i + 1] * sin[p, i])
            row[2 * i + 1] = (qkv[r, D + g * HD + 2 * i] * sin[p, i]
                              + qkv[r, D + g * HD + 2 * i + 1] * cos[p, i])
    return rope_k


def _absmax(d: Dims):
    from tvm.script import tirx as T

    HD = d.head_dim

    @T.macro
    def absmax(row, mx):
        mx[0] = T.float32(0)
        for e in range(HD):
            mx[0] = T.max(mx[0], T.abs(row[e]))
    return absmax


def _rows(d: Dims, M: int):
    """float rows: position p of head g at [0, g, p, :]."""
    from tvm.script import tirx as T

    D, HKV, HD, C, KD = d.dim, d.n_kv, d.head_dim, d.context, d.kv_dtype
    QKV, HALF = d.qkv, d.head_dim // 2

    @T.prim_func(private=True)
    def kv_write(qkv: T.Buffer((M, QKV), "float32"), pos: T.Buffer((1, M), "int64"),
                 bases: T.Buffer((1, M), "int64"),
                 cos: T.Buffer((C, HALF), "float32"), sin: T.Buffer((C, HALF), "float32"),
                 kc: T.Buffer((1, HKV, C, HD), KD), vc: T.Buffer((1, HKV, C, HD), KD)):
        T.func_attr({"tir.noalias": True})
        for r in range(M):
            p = T.Cast("int32", pos[0, r])
            a = T.Cast("int32", bases[0, r]) + p  # the row's cache position
            if p >= 0 and a >= 0 and a < C:
                for g in range(HKV):
                    for i in range(HALF):
                        kc[0, g, a, 2 * i] = T.Cast(KD, qkv[r, D + g * HD + 2 * i] * cos[p, i]
                                                    - qkv[r, D + g * HD + 2 * i + 1] * sin[p, i])
                        kc[0, g, a, 2 * i + 1] = T.Cast(KD, qkv[r, D + g * HD + 2 * i] * sin[p, i]
                                                        + qkv[r, D + g * HD + 2 * i + 1] * cos[p, i])
                    for e in range(HD):
                        vc[0, g, a, e] = T.Cast(KD, qkv[r, D + HKV * HD + g * HD + e])
    return kv_write


def _via_row(d: Dims, M: int):
    """K rotated into a row buffer, then stored: int8 rows (symmetric int8 per
    head and position, scale = max|x| / 127 stored bit for bit after the
    row's values) and the blocked layout (positions in blocks of KB; per
    block and KV head, K transposed, element e of the block's KB positions
    contiguous at [e * KB + j], and V row by row at [j * HD + e]; int8
    blocks end with their KB float32 scales)."""
    from tvm.script import tirx as T

    D, HKV, HD, C, KD = d.dim, d.n_kv, d.head_dim, d.context, d.kv_dtype
    QKV, HALF, RK = d.qkv, d.head_dim // 2, row_elems(d)
    NBK, KBLK = C // KB, KB * RK
    SOFF = KB * HD // 4  # a block's first scale, in float32 elements
    Q8, BLOCKED = KD == "int8", d.kv_layout == "blocked"
    rope_k, absmax = _rope_k(d), _absmax(d)

    @T.macro
    def store_q8(row, c, g, p):
        mx = T.alloc_buffer((1,), "float32", scope=REG)
        absmax(row, mx)
        inv = T.Select(mx[0] > T.float32(0), T.float32(127) / mx[0], T.float32(0))
        for e in range(HD):
            c[0, g, p, e] = T.Cast("int8", T.round(row[e] * inv))
        bits = T.reinterpret("int32", mx[0] / T.float32(127))
        for i in range(4):
            c[0, g, p, HD + i] = T.Cast("int8", T.bitwise_and(T.shift_right(bits, 8 * i), 255))

    @T.macro
    def store_q8_blocked(row, c8, cs, g, p, stride, step):
        # value e of position p at c8[g, p // KB, (p % KB) * step + e * stride]; scale max|x|/127
        mx = T.alloc_buffer((1,), "float32", scope=REG)
        absmax(row, mx)
        inv = T.Select(mx[0] > T.float32(0), T.float32(127) / mx[0], T.float32(0))
        for e in range(HD):
            c8[g, p // KB, (p % KB) * step + e * stride] = T.Cast("int8", T.round(row[e] * inv))
        cs[g, p // KB, SOFF + p % KB] = mx[0] / T.float32(127)

    @T.prim_func(private=True)
    def kv_write(qkv: T.Buffer((M, QKV), "float32"), pos: T.Buffer((1, M), "int64"),
                 bases: T.Buffer((1, M), "int64"),
                 cos: T.Buffer((C, HALF), "float32"), sin: T.Buffer((C, HALF), "float32"),
                 kc: T.Buffer((1, HKV, C, RK), KD), vc: T.Buffer((1, HKV, C, RK), KD)):
        T.func_attr({"tir.noalias": True})
        if BLOCKED:
            kb = T.decl_buffer((HKV, NBK, KBLK), KD, data=kc.data)
            vb = T.decl_buffer((HKV, NBK, KBLK), KD, data=vc.data)
            ksc = T.decl_buffer((HKV, NBK, KBLK // 4), "float32", data=kc.data)
            vsc = T.decl_buffer((HKV, NBK, KBLK // 4), "float32", data=vc.data)
        for r in range(M):
            p = T.Cast("int32", pos[0, r])
            a = T.Cast("int32", bases[0, r]) + p  # the row's cache position; RoPE at p
            if p >= 0 and a >= 0 and a < C:
                for g in range(HKV):
                    row = T.alloc_buffer((HD,), "float32", scope=REG)
                    rope_k(row, qkv, cos, sin, r, g, p)
                    if not BLOCKED:
                        store_q8(row, kc, g, a)
                        for e in range(HD):
                            row[e] = qkv[r, D + HKV * HD + g * HD + e]
                        store_q8(row, vc, g, a)
                    elif Q8:
                        store_q8_blocked(row, kb, ksc, g, a, KB, 1)
                        for e in range(HD):
                            row[e] = qkv[r, D + HKV * HD + g * HD + e]
                        store_q8_blocked(row, vb, vsc, g, a, 1, HD)
                    else:
                        for e in range(HD):
                            kb[g, a // KB, e * KB + a % KB] = T.Cast(KD, row[e])
                        for e in range(HD):
                            vb[g, a // KB, (a % KB) * HD + e] = T.Cast(KD, qkv[r, D + HKV * HD + g * HD + e])
    return kv_write
