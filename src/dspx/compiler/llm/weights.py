"""The weights file: the GGUF's quantized blocks repacked tile-major (same
bits) and the RoPE tables, in the order both entries take them."""
from __future__ import annotations

import numpy as np

from .sizing import TN, Dims, LLMCompileError


def _q4_1(t) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Q4_1 raw (N, K/32*20) -> tile-major q (N/TN, K/32, 16, TN) uint8 and
    d, m (N/TN, K/32, TN) float16: one GEMV tile's bytes are contiguous."""
    n = t.shape[0]
    blocks = np.ascontiguousarray(t.raw).reshape(n // TN, TN, -1, 20)
    d = blocks[..., 0:2].copy().view(np.float16)[..., 0]  # (N/TN, TN, NB)
    m = blocks[..., 2:4].copy().view(np.float16)[..., 0]
    q = blocks[..., 4:20]  # (N/TN, TN, NB, 16)
    return (np.ascontiguousarray(q.transpose(0, 2, 3, 1)), np.ascontiguousarray(d.transpose(0, 2, 1)),
            np.ascontiguousarray(m.transpose(0, 2, 1)))


def _q8_0(t) -> tuple[np.ndarray, np.ndarray]:
    """Q8_0 raw (N, K/32*34) -> tile-major q (N/TN, K/32, 32, TN) int8, d (N/TN, K/32, TN) float16."""
    n = t.shape[0]
    blocks = np.ascontiguousarray(t.raw).reshape(n // TN, TN, -1, 34)
    d = blocks[..., 0:2].copy().view(np.float16)[..., 0]
    q = blocks[..., 2:34].view(np.int8)
    return np.ascontiguousarray(q.transpose(0, 2, 3, 1)), np.ascontiguousarray(d.transpose(0, 2, 1))


def _f32(t) -> np.ndarray:
    if t.type_name not in ("F32", "F16"):
        raise LLMCompileError(f"tensor {t.name} is {t.type_name}; norms must be F32 or F16")
    return np.ascontiguousarray(t.dequantize().astype(np.float32))


def _need(t, kind: str):
    if t.type_name != kind:
        raise LLMCompileError(f"tensor {t.name} is stored as {t.type_name}; the device kernels take {kind} "
                              f"(this compiler supports SmolLM2-style GGUFs: Q4_1 linear layers, Q8_0 embedding)")


def rope_tables(d: Dims) -> tuple[np.ndarray, np.ndarray]:
    """cos/sin (context, head_dim/2), computed in float64 then rounded (as the reference)."""
    inv = d.theta ** (-np.arange(0, d.head_dim, 2, dtype=np.float64) / d.head_dim)
    ang = np.arange(d.context, dtype=np.float64)[:, None] * inv[None, :]
    return np.cos(ang).astype(np.float32), np.sin(ang).astype(np.float32)


def pack_weights(model, d: Dims, progress=None) -> list[tuple[str, np.ndarray]]:
    """The weights file's tensors, in the order both entries take them."""
    out: list[tuple[str, np.ndarray]] = []
    cos, sin = rope_tables(d)
    out += [("rope.cos", cos), ("rope.sin", sin)]
    emb = model.raw("token_embd.weight")
    _need(emb, "Q8_0")
    eq, ed = _q8_0(emb)
    out += [("token_embd.q", eq), ("token_embd.d", ed)]
    if "output.weight" in model:
        head = model.raw("output.weight")
        _need(head, "Q8_0")
        hq, hd = _q8_0(head)
        out += [("output.q", hq), ("output.d", hd)]
    out.append(("output_norm", _f32(model.raw("output_norm.weight"))))
    for i in range(d.n_layers):
        b = f"blk.{i}."
        ts = {k: model.raw(b + k + ".weight") for k in ("attn_q", "attn_k", "attn_v", "attn_output",
                                                           "ffn_gate", "ffn_up", "ffn_down")}
        for t in ts.values():
            _need(t, "Q4_1")
        out.append((b + "attn_norm", _f32(model.raw(b + "attn_norm.weight"))))
        parts = [_q4_1(ts[k]) for k in ("attn_q", "attn_k", "attn_v")]
        for j, suffix in enumerate("qdm"):
            out.append((b + "qkv." + suffix, np.ascontiguousarray(np.concatenate([p[j] for p in parts], axis=0))))
        for j, a in enumerate(_q4_1(ts["attn_output"])):
            out.append((b + "o." + "qdm"[j], a))
        out.append((b + "ffn_norm", _f32(model.raw(b + "ffn_norm.weight"))))
        parts = [_q4_1(ts[k]) for k in ("ffn_gate", "ffn_up")]
        for j, suffix in enumerate("qdm"):
            out.append((b + "gate_up." + suffix, np.ascontiguousarray(np.concatenate([p[j] for p in parts], axis=0))))
        for j, a in enumerate(_q4_1(ts["ffn_down"])):
            out.append((b + "down." + "qdm"[j], a))
        if progress:
            progress()
    return out


def dequantized_weights(named: list[tuple[str, np.ndarray]]) -> dict[str, np.ndarray]:
    """Float32 (out, in) matrices from the packed tensors (for tests: must equal
    ``gguf.quants.dequantize`` of the original blocks)."""
    w = dict(named)
    res = {}
    for key in [k[:-2] for k in w if k.endswith(".q")]:
        q = w[key + ".q"]
        dd = w[key + ".d"].astype(np.float32)
        if q.dtype == np.int8:  # Q8_0 (N/TN, NB, 32, TN)
            vals = q.astype(np.float32) * dd[:, :, None, :]
        else:  # Q4_1 (N/TN, NB, 16, TN)
            lo, hi = (q & 15).astype(np.float32), (q >> 4).astype(np.float32)
            vals = (np.concatenate([lo, hi], axis=2) * dd[:, :, None, :]
                    + w[key + ".m"].astype(np.float32)[:, :, None, :])
        nt, nb, _, tn = vals.shape
        res[key] = np.ascontiguousarray(vals.transpose(0, 3, 1, 2).reshape(nt * tn, nb * 32))
    return res
