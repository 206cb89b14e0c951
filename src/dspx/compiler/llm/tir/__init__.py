"""The hand-scheduled TIR kernels of one entry, one factory per kernel
(fused dequantize-GEMV, RMSNorm, RoPE + in-place KV append, causal GQA
attention over the cache, SiLU-gate); ``kernels`` builds the set."""
from __future__ import annotations

from ..sizing import Dims
from .attention import attention
from .common import PR, REG, decode_slice, vnni_lanes, prefill_tile, vector_lanes, vexp  # noqa: F401  (re-exported)
from .gemv import gemv_q4_1, gemv_q8_0
from .kv import kv_write
from .pointwise import embed, rmsnorm, silu_mul


def kernels(d: Dims, M: int, parallel_gemv: bool, batch: bool = False, tile: tuple[int, int] | None = None, *,
            lanes: int, vnni: int = 0) -> dict:
    """Every kernel for one entry (M = rows per call: 64 prefill, 1 decode,
    BATCH_ROWS a batched decode step: ``batch``), by the name the entry calls it;
    ``tile``: the prefill GEMMs' register micro-tile (default ``prefill_tile(lanes)``), ``lanes``:
    the target's float32 vector lanes (``vector_lanes``); ``vnni``: the int8 decode and batch GEMVs' block
    sums on vpdpbusd of that many int32 lanes (``vnni_lanes``; 0: in int16)."""
    assert d.head_dim == 64, "the attention kernel's q·k is written for head_dim 64"
    D, F, P, B = d.dim, d.ffn, parallel_gemv, batch
    L = dict(tile=tile, lanes=lanes, int8=d.decode_activations == "int8", vnni=vnni)
    return {
        "rmsnorm": rmsnorm(d, M),
        "kv_write": kv_write(d, M),
        "attention": attention(d, M, P, B),
        "silu_mul": silu_mul(d, M),
        "embed": embed(d, M),
        "gemv_qkv": gemv_q4_1(M, D, d.qkv, P, B, **L),
        "gemv_o": gemv_q4_1(M, D, D, P, B, **L),
        "gemv_gate_up": gemv_q4_1(M, D, 2 * F, P, B, **L),
        "gemv_down": gemv_q4_1(M, F, D, P, B, **L),
        "lm_head": gemv_q8_0(M, D, d.vocab, P, B, lanes),
    }
