"""What the TIR kernels share: the register scope, the prefill micro-tile,
a vectorizable exp, and the RoPE rotation of one head."""
from __future__ import annotations

from ..sizing import Dims

PR = 6  # prefill GEMM micro-tile rows


def prefill_tile(lanes: int) -> tuple[int, int]:
    """(rows, outputs) of the prefill GEMM's register micro-tile for vectors of
    ``lanes`` float32: 6 x 64 = 24 of AVX-512's 32 zmm; 6 x 16 = 12 of AVX2's
    16 ymm (6 x 64 would take 48 ymm and spill every accumulator, ~21 GFLOP/s on
    a Zen 3 core)."""
    return (PR, 64) if lanes >= 16 else (PR, 2 * lanes)


def decode_slice(lanes: int) -> int:
    """Outputs per slice of a decode GEMV tile: its two partial sums in registers take
    8 of AVX-512's 32 zmm at 64, 8 of AVX2's 16 ymm at 32 (at 64, 16: every one spilled)."""
    return min(64, 4 * lanes)


def vector_lanes(features) -> int:
    """float32 lanes of the widest vectors a target's CPU features give: 16 with AVX-512, else 8 (AVX2)."""
    return 16 if "avx512f" in features else 8


def vnni_lanes(features) -> int:
    """int32 lanes of the vpdpbusd a target's CPU features give the int8 GEMVs' block sums: 16 with
    AVX-512 VNNI (zmm), 8 with AVX-VNNI (ymm, client CPUs without AVX-512), 0 without either."""
    if "avx512_vnni" in features and "avx512bw" in features:
        return 16
    return 8 if "avx_vnni" in features else 0
# Scope of the kernels' small scratch buffers (< 1 KiB). TVM serves every
# "local" allocation with TVMBackendAllocWorkspace (heap), which LLVM cannot
# keep in registers: the accumulators went to memory on every FMA (prefill
# GEMM at ~20 GFLOP/s). A "global" allocation under 1 KiB is a stack alloca
# that LLVM promotes to registers (~55 GFLOP/s per core, OpenBLAS sgemm level).
REG = "global"


def vexp(x):
    """float32 exp as a TIR expression LLVM vectorizes (libm expf is scalar: at
    position 1,000 the softmax alone was ~270k calls per token). Cephes' expf:
    x = n·ln2 + r, a degree-6 polynomial in r, times 2^n from the exponent
    bits; relative error ~2 ulp, inputs clamped to [-87.3, 88.3]."""
    from tvm.script import tirx as T

    x = T.max(T.min(x, T.float32(88.3)), T.float32(-87.3))
    n = T.floor(x * T.float32(1.44269504) + T.float32(0.5))
    r = x - n * T.float32(0.693359375) + n * T.float32(2.12194440e-4)
    p = T.float32(1.9875691500e-4)
    for c in (1.3981999507e-3, 8.3334519073e-3, 4.1665795894e-2, 1.6666665459e-1, 5.0000001201e-1):
        p = p * r + T.float32(c)
    return (p * r * r + r + T.float32(1)) * T.reinterpret(
        "float32", T.shift_left(T.Cast("int32", n) + 127, 23))


def rope_q(d: Dims):
    """Macro: the G query heads of KV head g in row r, rotated for position p
    and scaled by 1/sqrt(head_dim), into qr (G, head_dim)."""
    import numpy as np
    from tvm.script import tirx as T

    G, HD, HALF = d.n_heads // d.n_kv, d.head_dim, d.head_dim // 2
    scale = float(np.float32(1.0 / np.sqrt(HD)))

    @T.macro
    def rotate(qr, qkv, cos, sin, r, g, h, p):
        for i in range(HALF):
            qr[h, 2 * i] = (qkv[r, (g * G + h) * HD + 2 * i] * cos[p, i]
                            - qkv[r, (g * G + h) * HD + 2 * i + 1] * sin[p, i]) * T.float32(scale)
            qr[h, 2 * i + 1] = (qkv[r, (g * G + h) * HD + 2 * i] * sin[p, i]
                                + qkv[r, (g * G + h) * HD + 2 * i + 1] * cos[p, i]) * T.float32(scale)
    return rotate
