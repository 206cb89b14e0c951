"""The firmware's LLM kernels: quantized GEMV, RMSNorm, SiLU-gate, RoPE,
decode attention and the KV update.

The SmolLM2 device model does not call these: its kernels are scheduled TIR
inside the modules (docs/llm-internals.md); these serve modules compiled from ONNX
graphs that use the ops.
"""

from __future__ import annotations

import logging

import numpy as np

from ....abi.kernels import ROPE_HALF
from .backends import ort_session_options, state
from .caches import cached, clear_caches, new_cache
from .registry import KernelError, as_numpy, kernel

log = logging.getLogger(__name__)


# Quantized GEMV. Weights are stored row-major per output row (N, K):
#   q8:   int8 (N, K), scales float32 (N, K // block): w = q * s
#   q4:   uint8 (N, K // 2), element 2j in the low nibble, 2j+1 in the high
#         nibble; scales (N, K // block): w = (q - 8) * s             (Q4_0-like)
#   q4_1: as q4 plus mins (N, K // block):       w = q * s + m       (Q4_1-like)
# This is onnxruntime MatMulNBits' layout, so those bytes go in unchanged.

def _unpack4(q: np.ndarray) -> np.ndarray:
    n, half = q.shape
    out = np.empty((n, half * 2), dtype=np.uint8)
    out[:, 0::2] = q & 0x0F
    out[:, 1::2] = q >> 4
    return out


def dequant(kind: str, q: np.ndarray, scales: np.ndarray, mins: np.ndarray | None,
            block: int) -> np.ndarray:
    if kind == "q8":
        n, k = q.shape
        vals = q.astype(np.float32)
    else:
        vals = _unpack4(q).astype(np.float32)
        n, k = vals.shape
        if kind == "q4":
            vals -= 8.0
    vals = vals.reshape(n, k // block, block) * scales.reshape(n, k // block, 1)
    if mins is not None:
        vals += mins.reshape(n, k // block, 1)
    return np.ascontiguousarray(vals.reshape(n, k).T)  # (K, N) for x @ W


# MatMulNBits accuracy_level=4 quantizes the activation to int8 per block (as
# llama.cpp does for its dot products): ~0.5 % of the output's magnitude, 3-10x
# faster than exact. configure_gemv(exact=True) dequantizes once to float32
# instead (exact, 4-8x the weight memory): state.gemv_exact.
def configure_gemv(exact: bool) -> None:
    """Choose exact (float32 dequantized once) or fast (int8 activations) quantized GEMV."""
    state.gemv_exact = bool(exact)
    clear_caches()


def _ort_session(kind: str, q, scales, block: int, n: int, k: int):
    """A single-op MatMulNBits session holding this weight, or None if it cannot."""
    try:
        import onnxruntime as ort
        from onnx import TensorProto, helper, numpy_helper
    except ImportError:
        return None
    bits = 8 if kind == "q8" else 4
    # q4_1's float zero points take a slow exact path in ORT (2.6 ms vs 45 us)
    if state.gemv_exact or kind == "q4_1" or block < 16 or block & (block - 1) or k % block:
        return None
    nb = k // block
    if kind == "q8":
        b = (q.astype(np.int16) + 128).astype(np.uint8).reshape(n, nb, block)
    else:
        b = q.reshape(n, nb, block // 2)
    inits = [numpy_helper.from_array(np.ascontiguousarray(b), "B"),
             numpy_helper.from_array(np.ascontiguousarray(scales, dtype=np.float32)
                                     .reshape(-1), "S")]
    ins = ["A", "B", "S"]
    node = helper.make_node("MatMulNBits", ins, ["Y"], domain="com.microsoft", K=k, N=n,
                            bits=bits, block_size=block, accuracy_level=4)
    g = helper.make_graph([node], "gemv",
                          [helper.make_tensor_value_info("A", TensorProto.FLOAT, [None, k])],
                          [helper.make_tensor_value_info("Y", TensorProto.FLOAT, [None, n])],
                          inits)
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17),
                                            helper.make_opsetid("com.microsoft", 1)])
    m.ir_version = 8
    so = ort_session_options()
    try:
        sess = ort.InferenceSession(m.SerializeToString(), so, providers=["CPUExecutionProvider"])
    except Exception as e:  # older ORT without float zero points, etc.
        log.debug("MatMulNBits unavailable (%s); numpy fallback", e)
        return None
    return sess


class _QGemv:
    def __init__(self, kind, q, scales, mins, block, n, k):
        self.sess = _ort_session(kind, q, scales, block, n, k) if mins is None else None
        self.w = None if self.sess is not None else dequant(kind, q, scales, mins, block)

    def __call__(self, x2: np.ndarray, o2: np.ndarray) -> None:
        if self.sess is not None:
            o2[...] = self.sess.run(None, {"A": x2})[0]
        else:
            np.matmul(x2, self.w, out=o2)


def _qgemv(kind, data, qweight, scales, mins, block, out):
    x, q, s, o = as_numpy(data), as_numpy(qweight), as_numpy(scales), as_numpy(out)
    m = as_numpy(mins) if mins is not None else None
    block = int(block)
    n = q.shape[0]
    k = q.shape[1] * (1 if kind == "q8" else 2)
    if block <= 0 or k % block or s.size != n * (k // block) or x.shape[-1] != k:
        raise KernelError(f"gemv_{kind}: data {x.shape}, weight {q.shape}, scales {s.shape}, "
                          f"block {block} are inconsistent")
    if o.shape[-1] != n:
        raise KernelError(f"gemv_{kind}: out {o.shape} must end in N={n}")
    op = cached(q, (kind, block, s.ctypes.data),
                lambda: _QGemv(kind, q, s, m, block, n, k))
    x2 = np.ascontiguousarray(x.reshape(-1, k), dtype=np.float32)
    op(x2, o.reshape(-1, n))


@kernel("gemv_q8", "onnxruntime MatMulNBits | numpy")
def gemv_q8(data, qweight, scales, block, out):
    """out = data @ dequant(W)^T with int8 W (N, K), scales (N, K/block) (block=K: per row)."""
    _qgemv("q8", data, qweight, scales, None, block, out)


@kernel("gemv_q4", "onnxruntime MatMulNBits | numpy")
def gemv_q4(data, qweight, scales, block, out):
    """4-bit blocks, w = (q - 8) * scale; qweight uint8 (N, K/2) low nibble first."""
    _qgemv("q4", data, qweight, scales, None, block, out)


@kernel("gemv_q4_1", "onnxruntime MatMulNBits | numpy")
def gemv_q4_1(data, qweight, scales, mins, block, out):
    """4-bit blocks with a minimum, w = q * scale + min (Q4_1-like)."""
    _qgemv("q4_1", data, qweight, scales, mins, block, out)


@kernel("rmsnorm", "numpy")
def rmsnorm(data, weight, eps, out):
    """out = data / sqrt(mean(data^2, last axis) + eps) * weight."""
    x, w, o = as_numpy(data), as_numpy(weight), as_numpy(out)
    ms = np.einsum("...i,...i->...", x, x)[..., None] / np.float32(x.shape[-1])
    np.multiply(x, 1.0 / np.sqrt(ms + np.float32(eps)), out=o)
    o *= w


@kernel("silu_mul", "numpy")
def silu_mul(gate, up, out):
    """out = silu(gate) * up = gate * sigmoid(gate) * up (the SwiGLU MLP middle)."""
    g, u, o = as_numpy(gate), as_numpy(up), as_numpy(out)
    np.negative(g, out=o)
    np.exp(o, out=o)
    o += 1.0
    np.divide(g, o, out=o)
    o *= u


_rope_tables: dict[tuple, tuple[np.ndarray, np.ndarray]] = new_cache()


def _rope_table(theta: float, dim: int, npos: int):
    key = (theta, dim)
    t = _rope_tables.get(key)
    if t is None or t[0].shape[0] < npos:
        size = max(npos, 2048)
        inv = 1.0 / (theta ** (np.arange(0, dim, 2, dtype=np.float64) / dim))
        ang = np.arange(size, dtype=np.float64)[:, None] * inv[None, :]
        t = (np.cos(ang).astype(np.float32), np.sin(ang).astype(np.float32))
        _rope_tables[key] = t
    return t


@kernel("rope", "numpy")
def rope(data, positions, theta, mode, out):
    """Rotary position embedding on data (..., S, H, D) with positions int (S,).

    mode 0 = rotate-half (HF Llama: pairs (i, i + D/2)), 1 = interleaved
    pairs (2i, 2i+1). Angles pos * theta^(-2i/D), tables cached per (theta, D).
    """
    x, p, o = as_numpy(data), as_numpy(positions).astype(np.int64).reshape(-1), as_numpy(out)
    d = x.shape[-1]
    if x.shape[-3] != p.shape[0] or d % 2:
        raise KernelError(f"rope: data {x.shape} needs (..., S={p.shape[0]}, H, even D)")
    cos_t, sin_t = _rope_table(float(theta), d, int(p.max()) + 1 if p.size else 1)
    cos = cos_t[p][:, None, :]  # (S, 1, D/2)
    sin = sin_t[p][:, None, :]
    if int(mode) == ROPE_HALF:
        x1, x2 = x[..., : d // 2], x[..., d // 2:]
        o1, o2 = o[..., : d // 2], o[..., d // 2:]
    else:
        x1, x2 = x[..., 0::2], x[..., 1::2]
        o1, o2 = o[..., 0::2], o[..., 1::2]
    r1 = x1 * cos - x2 * sin
    o2[...] = x2 * cos + x1 * sin
    o1[...] = r1


@kernel("attention_decode", "numpy/OpenBLAS")
def attention_decode(q, k_cache, v_cache, length, scale, out):
    """One decode step of grouped-query attention over a KV cache.

    q (B, Hq, D); k_cache, v_cache (B, Hkv, T, D) with the first ``length``
    positions valid (length = pos + 1 after writing the new token); Hq a
    multiple of Hkv; out (B, Hq, D) = softmax(q k^T * scale) v.
    """
    qa, k, v, o = as_numpy(q), as_numpy(k_cache), as_numpy(v_cache), as_numpy(out)
    n = int(length)
    bsz, hq, d = qa.shape
    hkv, t = k.shape[1], k.shape[2]
    if hq % hkv or n < 1 or n > t:
        raise KernelError(f"attention_decode: Hq={hq} Hkv={hkv} length={n} T={t}")
    qg = qa.reshape(bsz, hkv, hq // hkv, d)
    s = np.matmul(qg, np.swapaxes(k[:, :, :n], -1, -2))  # (B, Hkv, G, n)
    s *= np.float32(scale)
    s -= s.max(axis=-1, keepdims=True)
    np.exp(s, out=s)
    s /= s.sum(axis=-1, keepdims=True)
    np.matmul(s, v[:, :, :n], out=o.reshape(bsz, hkv, hq // hkv, d))


@kernel("kv_update", "numpy")
def kv_update(cache, new, pos, out):
    """out = cache with ``new`` written at positions pos.. along axis -2.

    cache, out (B, H, T, D); new (B, H, S, D). When out is the cache's own
    memory (KV-resident decode hands the same buffer in and out) only the S
    new rows are written; otherwise the cache is copied first.
    """
    c, n, o = as_numpy(cache), as_numpy(new), as_numpy(out)
    p, s = int(pos), n.shape[-2]
    if c.shape != o.shape or n.shape[:-2] != c.shape[:-2] or n.shape[-1] != c.shape[-1]:
        raise KernelError(f"kv_update: cache {c.shape}, new {n.shape}, out {o.shape}")
    if p < 0 or p + s > c.shape[-2]:
        raise KernelError(f"kv_update: positions {p}..{p + s - 1} outside T={c.shape[-2]}")
    if o.ctypes.data != c.ctypes.data:
        np.copyto(o, c)
    o[..., p:p + s, :] = n
