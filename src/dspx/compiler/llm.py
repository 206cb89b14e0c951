"""A Llama GGUF (SmolLM2-135M by default) -> two dspx device modules.

``compile_llm(gguf, outdir)`` writes

- ``prefill.so``: ``ids (1,64) int64, positions (1,64) int64, k0, v0, …, k29,
  v29 (1,3,256,64) float32, <weights>`` -> ``logits (1,64,49152), k0', v0', …``
- ``decode.so``: the same with ``(1,1)`` ids/positions and ``(1,1,49152)`` logits
- ``weights.bin``: ONE weights file both modules take (MODEL_LOAD once; both
  signatures carry its digest)
- ``metadata.json``: both modules' io tables and ``io_reserve``, the KV
  layout, the model config and a pointer to the GGUF the tokenizer comes from.

Weights stay quantized exactly as stored in the GGUF: Q4_1 blocks (f16 d,
f16 m, 32 nibbles) for every linear layer and Q8_0 blocks (f16 d, 32 int8)
for the tied embedding / LM head.  They are only *repacked* (same bits): the
nibbles of a block go into a ``(K/32, 16, N)`` uint8 array and the scales into
``(K/32, N)`` float16 arrays, so that the GEMV kernels stream 64 output rows
at a time with contiguous vector loads.  q/k/v are concatenated into one
``(576 -> 960)`` weight and gate/up into one ``(576 -> 3072)`` weight.

Every operator is a hand-scheduled TIR kernel (fused dequantize-GEMV, RMSNorm,
RoPE + in-place KV append, causal GQA attention over the cache, SiLU-gate)
compiled into the module: no default-legalized TVM codegen on the hot path.
Accumulation is float32 with the exact dequantized weight values (d·q + m), so
the float32 numpy reference over ``gguf.quants.dequantize`` is the oracle.

KV in place: the KV append is ``call_tir_inplace`` on the KV inputs and the
entry returns those very tensors as its KV outputs.  Driven KV_RESIDENT with
the KV inputs at the offsets the device packs KV outputs to (tensor i at
``i × 196,608`` from the KV base), the device sees that each output already
is its destination and copies nothing.
"""
from __future__ import annotations

import hashlib
import json
import os
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from dspx.compiler.module import (IO_META_NAME, SIGNATURE_NAME, Signature, TensorSpec, export_module,
                                  make_io_meta, write_metadata, write_weights)
from dspx.abi import llmpack
from dspx.abi.layout import align, desc_region, side_bytes
from dspx.abi.llmpack import (CHUNK, CONTEXT, DECODE_FILE, DECODE_PARALLEL_FILE, FORMAT, METADATA_FILE, PREFILL_FILE,
                              WEIGHTS_FILE)

TN = 64  # output rows per GEMV tile (4 AVX-512 vectors)
PR = 6  # prefill GEMM micro-tile: 6 rows x 64 outputs = 24 AVX-512 accumulators
# Scope of the kernels' small scratch buffers (< 1 KiB). TVM serves every
# "local" allocation with TVMBackendAllocWorkspace (heap), which LLVM cannot
# keep in registers: the accumulators went to memory on every FMA (prefill
# GEMM at ~20 GFLOP/s). A "global" allocation under 1 KiB is a stack alloca
# that LLVM promotes to registers (~55 GFLOP/s per core, OpenBLAS sgemm level).
REG = "global"
# The modules are built for the machine they run on, like llama.cpp's
# GGML_NATIVE: AVX-512 here runs the prefill GEMMs ~1.4x faster than the
# portable x86-64-v3 (AVX2) that `dspx compile` defaults to.
LLM_TARGET = "native"


from dspx.llm import LLMError  # noqa: E402  (needs the llm extra: gguf, tokenizers)


class LLMCompileError(LLMError):
    """The GGUF cannot be compiled for the device; the message says why."""


# ---------------------------------------------------------------- model shape

@dataclass(frozen=True)
class Dims:
    n_layers: int
    dim: int
    n_heads: int
    n_kv: int
    head_dim: int
    ffn: int
    vocab: int
    theta: float
    eps: float
    context: int = CONTEXT
    chunk: int = CHUNK
    kv_dtype: str = "float32"
    kv_layout: str = "blocked"

    @property
    def qkv(self) -> int:
        return (self.n_heads + 2 * self.n_kv) * self.head_dim

    @property
    def kv_shape(self) -> tuple[int, int, int, int]:
        return (1, self.n_kv, self.context, kv_row(self.head_dim, self.kv_dtype))

    @property
    def kv_bytes(self) -> int:
        return int(np.prod(self.kv_shape)) * KV_DTYPES[self.kv_dtype]


KV_DTYPES = {"float32": 4, "float16": 2, "int8": 1}  # KV cache element type -> bytes
# How a KV tensor's bytes are arranged (docs/llm.md, "KV layout"): "blocked" (16-position
# blocks, K transposed within a block) or "rows" (one row per position, the earlier layout,
# kept for A/B: compile_llm(kv_layout="rows"), DSPX_LLM_KV_LAYOUT=rows).
KV_LAYOUTS = ("blocked", "rows")
KB = 16  # positions per KV block (one AVX-512 vector of float32 scores)


def kv_row(head_dim: int, kv_dtype: str) -> int:
    """Elements per cached row of one head: int8 rows carry their float32
    scale in 4 trailing bytes (one scale per head and position)."""
    return head_dim + 4 if kv_dtype == "int8" else head_dim


def kv_region_bytes(n_layers: int, n_kv: int, head_dim: int, context: int, kv_dtype: str) -> int:
    """Bytes the 2 × layers KV tensors take in the KV region (packed, aligned)."""
    row = kv_row(head_dim, kv_dtype) * KV_DTYPES[kv_dtype]
    return llmpack.kv_offsets(2 * n_layers, n_kv * context * row)[1]


def largest_context(n_layers: int, n_kv: int, head_dim: int, kv_dtype: str, chunk: int = CHUNK,
                    region: int | None = None) -> int:
    """The longest context (a multiple of the prefill chunk) whose KV fits the region."""
    from dspx.memory import KV_SIZE

    region = KV_SIZE if region is None else region
    n = 0
    while kv_region_bytes(n_layers, n_kv, head_dim, n + chunk, kv_dtype) <= region:
        n += chunk
    return n


def dims_of(config, context: int = CONTEXT, chunk: int = CHUNK, kv_dtype: str = "float32",
            kv_layout: str = "blocked") -> Dims:
    c = config
    if kv_dtype not in KV_DTYPES:
        raise LLMCompileError(f"KV dtype {kv_dtype!r} is not one of {', '.join(KV_DTYPES)}")
    if kv_layout not in KV_LAYOUTS:
        raise LLMCompileError(f"KV layout {kv_layout!r} is not one of {', '.join(KV_LAYOUTS)}")
    d = Dims(c.n_layers, c.hidden_size, c.n_heads, c.n_kv_heads, c.head_dim, c.ffn_size, c.vocab_size,
             float(c.rope_theta), float(c.rms_eps), context, chunk, kv_dtype, kv_layout)
    from dspx.memory import KV_SIZE

    need = kv_region_bytes(d.n_layers, d.n_kv, d.head_dim, context, kv_dtype)
    if context < chunk or need > KV_SIZE:
        most = largest_context(d.n_layers, d.n_kv, d.head_dim, kv_dtype, chunk)
        raise LLMCompileError(
            f"context {context} does not fit: its {kv_dtype} KV cache takes {need:,} bytes and the KV region "
            f"holds {KV_SIZE:,}; the largest context that fits with {kv_dtype} KV is {most}"
            + (" (a multiple of the prefill chunk)" if context < chunk else "")
            + (" (float16 KV holds twice as many)" if kv_dtype == "float32" else ""))
    problems = []
    if d.head_dim * d.n_heads != d.dim:
        problems.append(f"head_dim {d.head_dim} × heads {d.n_heads} != hidden {d.dim}")
    if d.head_dim != 64:
        problems.append(f"head_dim {d.head_dim} (the attention kernel is written for 64)")
    if c.rope_dim != d.head_dim:
        problems.append(f"partial RoPE ({c.rope_dim} of {d.head_dim} dims)")
    for name, v in (("hidden", d.dim), ("ffn", d.ffn)):
        if v % 32:
            problems.append(f"{name} size {v} is not a multiple of 32 (quantization block)")
    for name, v in (("q rows", d.dim), ("k/v rows", d.n_kv * d.head_dim), ("ffn", d.ffn), ("vocab", d.vocab)):
        if v % TN:
            problems.append(f"{name} {v} is not a multiple of the {TN}-row GEMV tile")
    if chunk % KB:
        problems.append(f"prefill chunk {chunk} is not a multiple of {KB} (the KV block)")
    if context % chunk:
        problems.append(f"context {context} is not a multiple of the prefill chunk {chunk}")
    if problems:
        raise LLMCompileError("model shape not supported by the device kernels: " + "; ".join(problems))
    return d


# ---------------------------------------------------------------- weights (repacked GGUF blocks)

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


# ---------------------------------------------------------------- TIR kernels

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


def _kernels(d: Dims, M: int, parallel_gemv: bool):
    """Hand-scheduled TIR for one entry (M = rows per call: 64 prefill, 1 decode)."""
    from tvm.script import tirx as T

    D, H, HKV, HD, C, KD = d.dim, d.n_heads, d.n_kv, d.head_dim, d.context, d.kv_dtype
    assert HD == 64, "the attention kernel's q·k is written for head_dim 64"
    QKV, G, HALF = d.qkv, d.n_heads // d.n_kv, d.head_dim // 2
    eps = float(np.float32(d.eps))
    scale = float(np.float32(1.0 / np.sqrt(HD)))
    ks = {}

    def embed(V):
        NB = D // 32

        @T.prim_func(private=True)
        def f(ids: T.Buffer((1, M), "int64"), q: T.Buffer((V // TN, NB, 32, TN), "int8"), dd: T.Buffer((V // TN, NB, TN), "float16"),
              x: T.Buffer((M, D), "float32")):
            T.func_attr({"tir.noalias": True})
            for r in range(M):
                tok = T.Cast("int32", T.max(T.min(ids[0, r], T.int64(V - 1)), T.int64(0)))
                for b in range(NB):
                    for j in range(32):
                        x[r, b * 32 + j] = (T.Cast("float32", q[tok // TN, b, j, tok % TN])
                                            * T.Cast("float32", dd[tok // TN, b, tok % TN]))
        return f

    @T.prim_func(private=True)
    def rmsnorm(x: T.Buffer((M, D), "float32"), w: T.Buffer((D,), "float32"), y: T.Buffer((M, D), "float32")):
        T.func_attr({"tir.noalias": True})
        for r in range(M):
            acc = T.alloc_buffer((1,), "float32", scope=REG)
            acc[0] = T.float32(0)
            for i in range(D):
                acc[0] = acc[0] + x[r, i] * x[r, i]
            inv = T.float32(1) / T.sqrt(acc[0] / T.float32(D) + T.float32(eps))
            for i in range(D):
                y[r, i] = x[r, i] * inv * w[i]
    ks["rmsnorm"] = rmsnorm

    def gemv_q4_1(K, N, residual: bool):
        NB = K // 32
        loop = T.parallel if parallel_gemv else T.serial
        if M == 1:
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
                    for ni in T.vectorized(TN):
                        acc[ni] = T.float32(0)
                    for b in range(NB):
                        # low and high nibbles in separate accumulators: 8 independent
                        # FMA chains per tile instead of 4 (latency, not throughput, bound)
                        for h in T.unroll(2):
                            for ni in T.vectorized(TN):
                                s[h, ni] = T.float32(0)
                        for j in range(16):
                            for ni in T.vectorized(TN):
                                s[0, ni] = s[0, ni] + (T.Cast("float32", T.bitwise_and(q[no, b, j, ni], T.uint8(15)))
                                                       * x[0, b * 32 + j])
                            for ni in T.vectorized(TN):
                                s[1, ni] = s[1, ni] + (T.Cast("float32", T.shift_right(q[no, b, j, ni], T.uint8(4)))
                                                       * x[0, b * 32 + 16 + j])
                        for ni in T.vectorized(TN):
                            acc[ni] = (acc[ni] + T.Cast("float32", dd[no, b, ni]) * (s[0, ni] + s[1, ni])
                                       + T.Cast("float32", mm[no, b, ni]) * xs[b])
                    for ni in T.vectorized(TN):
                        y[0, no * TN + ni] = res[0, no * TN + ni] + acc[ni]
        else:
            @T.prim_func(private=True)
            def f(x: T.Buffer((M, K), "float32"), pos: T.Buffer((1, M), "int64"),
                  q: T.Buffer((N // TN, NB, 16, TN), "uint8"),
                  dd: T.Buffer((N // TN, NB, TN), "float16"), mm: T.Buffer((N // TN, NB, TN), "float16"),
                  res: T.Buffer((M, N), "float32"), y: T.Buffer((M, N), "float32")):
                T.func_attr({"tir.noalias": True})
                # real rows come first (padding has position -1): compute only their PR-row groups
                nr = T.alloc_buffer((1,), "int32", scope=REG)
                nr[0] = 0
                for r in range(M):
                    if pos[0, r] >= 0:
                        nr[0] = r + 1
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

    def gemv_q8_0(K, N):
        NB = K // 32
        # Decode runs serial by default: on 2 CPUs shared with the host and the
        # device's front process, a parallel LM head was no faster (TVM's
        # workers spin on the CPU the IPC needs).
        loop = T.parallel if parallel_gemv else T.serial
        if M == 1:
            @T.prim_func(private=True)
            def f(x: T.Buffer((M, K), "float32"), q: T.Buffer((N // TN, NB, 32, TN), "int8"),
                  dd: T.Buffer((N // TN, NB, TN), "float16"), y: T.Buffer((1, M, N), "float32")):
                T.func_attr({"tir.noalias": True})
                for no in loop(N // TN):
                    acc = T.alloc_buffer((TN,), "float32", scope=REG)
                    s = T.alloc_buffer((2, TN), "float32", scope=REG)
                    for ni in T.vectorized(TN):
                        acc[ni] = T.float32(0)
                    for b in range(NB):
                        for h in T.unroll(2):
                            for ni in T.vectorized(TN):
                                s[h, ni] = T.float32(0)
                        for j in range(16):
                            for h in T.unroll(2):
                                for ni in T.vectorized(TN):
                                    s[h, ni] = s[h, ni] + T.Cast("float32", q[no, b, 2 * j + h, ni]) * x[0, b * 32 + 2 * j + h]
                        for ni in T.vectorized(TN):
                            acc[ni] = acc[ni] + T.Cast("float32", dd[no, b, ni]) * (s[0, ni] + s[1, ni])
                    for ni in T.vectorized(TN):
                        y[0, 0, no * TN + ni] = acc[ni]
        else:
            # Prefill: the host reads only the last real row's logits, so only that row is
            # computed (one GEMV, parallel over tiles); the other rows are zero.
            @T.prim_func(private=True)
            def f(x: T.Buffer((M, K), "float32"), pos: T.Buffer((1, M), "int64"),
                  q: T.Buffer((N // TN, NB, 32, TN), "int8"),
                  dd: T.Buffer((N // TN, NB, TN), "float16"), y: T.Buffer((1, M, N), "float32")):
                T.func_attr({"tir.noalias": True})
                nr = T.alloc_buffer((1,), "int32", scope=REG)
                nr[0] = 1
                for r in range(M):
                    if pos[0, r] >= 0:
                        nr[0] = r + 1
                for no in T.parallel(N // TN):
                    acc = T.alloc_buffer((TN,), "float32", scope=REG)
                    s = T.alloc_buffer((2, TN), "float32", scope=REG)
                    last = nr[0] - 1
                    for ni in T.vectorized(TN):
                        acc[ni] = T.float32(0)
                    for b in range(NB):
                        for h in T.unroll(2):
                            for ni in T.vectorized(TN):
                                s[h, ni] = T.float32(0)
                        for j in range(16):
                            for h in T.unroll(2):
                                for ni in T.vectorized(TN):
                                    s[h, ni] = s[h, ni] + T.Cast("float32", q[no, b, 2 * j + h, ni]) * x[last, b * 32 + 2 * j + h]
                        for ni in T.vectorized(TN):
                            acc[ni] = acc[ni] + T.Cast("float32", dd[no, b, ni]) * (s[0, ni] + s[1, ni])
                    for r in range(M):
                        for ni in T.vectorized(TN):
                            y[0, r, no * TN + ni] = T.Select(r == last, acc[ni], T.float32(0))
        return f

    @T.prim_func(private=True)
    def kv_write(qkv: T.Buffer((M, QKV), "float32"), pos: T.Buffer((1, M), "int64"),
                 cos: T.Buffer((C, HALF), "float32"), sin: T.Buffer((C, HALF), "float32"),
                 kc: T.Buffer((1, HKV, C, HD), KD), vc: T.Buffer((1, HKV, C, HD), KD)):
        T.func_attr({"tir.noalias": True})
        for r in range(M):
            p = T.Cast("int32", pos[0, r])
            if p >= 0 and p < C:
                for g in range(HKV):
                    for i in range(HALF):
                        kc[0, g, p, 2 * i] = T.Cast(KD, qkv[r, D + g * HD + 2 * i] * cos[p, i]
                                                    - qkv[r, D + g * HD + 2 * i + 1] * sin[p, i])
                        kc[0, g, p, 2 * i + 1] = T.Cast(KD, qkv[r, D + g * HD + 2 * i] * sin[p, i]
                                                        + qkv[r, D + g * HD + 2 * i + 1] * cos[p, i])
                    for e in range(HD):
                        vc[0, g, p, e] = T.Cast(KD, qkv[r, D + HKV * HD + g * HD + e])
    ks["kv_write"] = kv_write
    RW = HD + 4  # int8 row: 64 values + the float32 scale's 4 bytes

    @T.macro
    def rope_k(row, qkv, cos, sin, r, g, p):
        # KV head g's key of row r, rotated for position p
        for i in range(HALF):
            row[2 * i] = (qkv[r, D + g * HD + 2 * i] * cos[p, i]
                          - qkv[r, D + g * HD + 2 * i + 1] * sin[p, i])
            row[2 * i + 1] = (qkv[r, D + g * HD + 2 * i] * sin[p, i]
                              + qkv[r, D + g * HD + 2 * i + 1] * cos[p, i])

    @T.macro
    def absmax(row, mx):
        mx[0] = T.float32(0)
        for e in range(HD):
            mx[0] = T.max(mx[0], T.abs(row[e]))

    @T.macro
    def store_q8(row, c, g, p):
        # symmetric int8 per (head, position): scale = max|x| / 127, stored bit for bit after the values
        mx = T.alloc_buffer((1,), "float32", scope=REG)
        absmax(row, mx)
        inv = T.Select(mx[0] > T.float32(0), T.float32(127) / mx[0], T.float32(0))
        for e in range(HD):
            c[0, g, p, e] = T.Cast("int8", T.round(row[e] * inv))
        bits = T.reinterpret("int32", mx[0] / T.float32(127))
        for i in range(4):
            c[0, g, p, HD + i] = T.Cast("int8", T.bitwise_and(T.shift_right(bits, 8 * i), 255))

    @T.prim_func(private=True)
    def kv_write_q8(qkv: T.Buffer((M, QKV), "float32"), pos: T.Buffer((1, M), "int64"),
                    cos: T.Buffer((C, HALF), "float32"), sin: T.Buffer((C, HALF), "float32"),
                    kc: T.Buffer((1, HKV, C, RW), "int8"), vc: T.Buffer((1, HKV, C, RW), "int8")):
        T.func_attr({"tir.noalias": True})
        for r in range(M):
            p = T.Cast("int32", pos[0, r])
            if p >= 0 and p < C:
                for g in range(HKV):
                    row = T.alloc_buffer((HD,), "float32", scope=REG)
                    rope_k(row, qkv, cos, sin, r, g, p)
                    store_q8(row, kc, g, p)
                    for e in range(HD):
                        row[e] = qkv[r, D + HKV * HD + g * HD + e]
                    store_q8(row, vc, g, p)
    if KD == "int8":
        ks["kv_write"] = kv_write_q8

    rows = T.parallel if M > 1 or parallel_gemv else T.serial  # decode_parallel: KV heads over threads too
    RK = RW if KD == "int8" else HD  # elements per cached row

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
            if p >= 0 and p < C:
                for h in T.unroll(G):
                    for i in range(HALF):
                        qr[h, 2 * i] = (qkv[r, (g * G + h) * HD + 2 * i] * cos[p, i]
                                        - qkv[r, (g * G + h) * HD + 2 * i + 1] * sin[p, i]) * T.float32(scale)
                        qr[h, 2 * i + 1] = (qkv[r, (g * G + h) * HD + 2 * i] * sin[p, i]
                                            + qkv[r, (g * G + h) * HD + 2 * i + 1] * cos[p, i]) * T.float32(scale)
                    st[0, h] = T.float32(-3.0e38)
                for t in range(p + 1):
                    for e in T.vectorized(HD):
                        kf[e] = T.Cast("float32", kc[0, g, t, e])
                    ks_ = row_scale(kc, g, t)
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
                    vs_ = row_scale(vc, g, t)
                    for e in T.vectorized(HD):
                        kf[e] = T.Cast("float32", vc[0, g, t, e]) * vs_
                    for h in T.unroll(G):
                        for e in T.vectorized(HD):
                            o[h, e] = o[h, e] + sc[h, t] * kf[e]
                for h in T.unroll(G):
                    for e in T.vectorized(HD):
                        out[r, (g * G + h) * HD + e] = o[h, e] / st[1, h]
            else:
                for e in range(G * HD):
                    out[r, g * G * HD + e] = T.float32(0)
    ks["attention"] = attention

    # ---- "blocked" KV layout (the default): positions in blocks of KB. Per block and
    # KV head, K is stored transposed (element e of the block's KB positions contiguous,
    # [e * KB + j]) and V row by row ([j * HD + e]); int8 blocks end with their KB float32
    # scales. q·k then runs KB positions per vector (no lane sums), and the int8 scales
    # are vector loads folded into the scores (K) and the softmax weights (V).
    NBK = C // KB
    KBLK = KB * RK  # elements per block (int8: KB*64 values + KB*4 scale bytes)
    SOFF = KB * HD // 4  # a block's first scale, in float32 elements
    Q8 = KD == "int8"

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
    def kv_write_blocked(qkv: T.Buffer((M, QKV), "float32"), pos: T.Buffer((1, M), "int64"),
                         cos: T.Buffer((C, HALF), "float32"), sin: T.Buffer((C, HALF), "float32"),
                         kc: T.Buffer((1, HKV, C, RK), KD), vc: T.Buffer((1, HKV, C, RK), KD)):
        T.func_attr({"tir.noalias": True})
        kb = T.decl_buffer((HKV, NBK, KBLK), KD, data=kc.data)
        vb = T.decl_buffer((HKV, NBK, KBLK), KD, data=vc.data)
        ksc = T.decl_buffer((HKV, NBK, KBLK // 4), "float32", data=kc.data)
        vsc = T.decl_buffer((HKV, NBK, KBLK // 4), "float32", data=vc.data)
        for r in range(M):
            p = T.Cast("int32", pos[0, r])
            if p >= 0 and p < C:
                for g in range(HKV):
                    row = T.alloc_buffer((HD,), "float32", scope=REG)
                    rope_k(row, qkv, cos, sin, r, g, p)
                    if Q8:
                        store_q8_blocked(row, kb, ksc, g, p, KB, 1)
                        for e in range(HD):
                            row[e] = qkv[r, D + HKV * HD + g * HD + e]
                        store_q8_blocked(row, vb, vsc, g, p, 1, HD)
                    else:
                        for e in range(HD):
                            kb[g, p // KB, e * KB + p % KB] = T.Cast(KD, row[e])
                        for e in range(HD):
                            vb[g, p // KB, (p % KB) * HD + e] = T.Cast(KD, qkv[r, D + HKV * HD + g * HD + e])

    # decode_parallel splits each KV head's positions in NS parts (3 heads x 2 parts = 3
    # items per core on 2 cores, instead of 2 heads on one and 1 on the other), merged after
    NS = 2 if M == 1 and parallel_gemv else 1

    @T.prim_func(private=True)
    def attention_blocked(qkv: T.Buffer((M, QKV), "float32"), pos: T.Buffer((1, M), "int64"),
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
            b0 = it % NS * ((p + KB) // KB) // NS  # this part's blocks b0 <= tb < b1
            b1 = (it % NS + 1) * ((p + KB) // KB) // NS
            for h in T.unroll(G):
                for e in T.vectorized(HD):
                    o[h, e] = T.float32(0)
                st[0, h] = T.float32(-3.0e38)
                st[1, h] = T.float32(0)
            if p >= 0 and p < C and b0 < b1:
                for h in T.unroll(G):
                    for i in range(HALF):
                        qr[h, 2 * i] = (qkv[r, (g * G + h) * HD + 2 * i] * cos[p, i]
                                        - qkv[r, (g * G + h) * HD + 2 * i + 1] * sin[p, i]) * T.float32(scale)
                        qr[h, 2 * i + 1] = (qkv[r, (g * G + h) * HD + 2 * i] * sin[p, i]
                                            + qkv[r, (g * G + h) * HD + 2 * i + 1] * cos[p, i]) * T.float32(scale)
                    for j in T.vectorized(KB):
                        mv[h, j] = T.float32(-3.0e38)
                # q·k: KB positions per vector, each widened K column shared by the G heads
                for tb in range(b0, b1):
                    for h in T.unroll(G):
                        for u in T.unroll(4):
                            for j in T.vectorized(KB):
                                acc[h, u, j] = T.float32(0)
                    for eo in range(HD // 4):
                        for u in T.unroll(4):
                            for j in T.vectorized(KB):
                                kf[u * KB + j] = T.Cast("float32", kb[g, tb, (eo * 4 + u) * KB + j])
                            for h in T.unroll(G):
                                for j in T.vectorized(KB):
                                    acc[h, u, j] = acc[h, u, j] + qr[h, eo * 4 + u] * kf[u * KB + j]
                    for h in T.unroll(G):
                        for j in T.vectorized(KB):
                            if Q8:
                                sc[h, tb * KB + j] = T.Select(
                                    tb * KB + j <= p,
                                    ((acc[h, 0, j] + acc[h, 1, j]) + (acc[h, 2, j] + acc[h, 3, j])) * ksc[g, tb, SOFF + j],
                                    T.float32(-3.0e38))
                            else:
                                sc[h, tb * KB + j] = T.Select(
                                    tb * KB + j <= p, (acc[h, 0, j] + acc[h, 1, j]) + (acc[h, 2, j] + acc[h, 3, j]),
                                    T.float32(-3.0e38))
                            mv[h, j] = T.max(mv[h, j], sc[h, tb * KB + j])
                for h in T.unroll(G):
                    for e in T.vectorized(8):
                        mv[h, e] = T.max(mv[h, e], mv[h, 8 + e])
                    for e in T.vectorized(4):
                        mv[h, e] = T.max(mv[h, e], mv[h, 4 + e])
                    st[0, h] = T.max(T.max(mv[h, 0], mv[h, 2]), T.max(mv[h, 1], mv[h, 3]))
                    for e in T.vectorized(KB):
                        sv[h, e] = T.float32(0)
                # softmax weights, the G heads side by side
                for tb in range(b0, b1):
                    for h in T.unroll(G):
                        for e in T.vectorized(KB):
                            sc[h, tb * KB + e] = T.Select(tb * KB + e <= p, vexp(sc[h, tb * KB + e] - st[0, h]),
                                                          T.float32(0))
                            sv[h, e] = sv[h, e] + sc[h, tb * KB + e]
                            if Q8:  # V's scale folded into the weight (after the sum: it is not normalized)
                                sc[h, tb * KB + e] = sc[h, tb * KB + e] * vsc[g, tb, SOFF + e]
                for h in T.unroll(G):
                    for e in T.vectorized(8):
                        sv[h, e] = sv[h, e] + sv[h, 8 + e]
                    for e in T.vectorized(4):
                        sv[h, e] = sv[h, e] + sv[h, 4 + e]
                    st[1, h] = (sv[h, 0] + sv[h, 2]) + (sv[h, 1] + sv[h, 3])
                for t in range(b0 * KB, T.min(b1 * KB, p + 1)):
                    for e in T.vectorized(HD):
                        kf[e] = T.Cast("float32", vb[g, t // KB, (t % KB) * HD + e])
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

    if d.kv_layout == "blocked":
        ks["kv_write"], ks["attention"] = kv_write_blocked, attention_blocked

    F = d.ffn

    @T.prim_func(private=True)
    def silu_mul(gu: T.Buffer((M, 2 * F), "float32"), y: T.Buffer((M, F), "float32")):
        T.func_attr({"tir.noalias": True})
        for r in range(M):
            for io in range(F // 16):
                for ii in T.vectorized(16):
                    y[r, io * 16 + ii] = (gu[r, io * 16 + ii] / (T.float32(1) + vexp(T.float32(0) - gu[r, io * 16 + ii]))
                                          * gu[r, F + io * 16 + ii])
    ks["silu_mul"] = silu_mul

    ks["embed"] = embed(d.vocab)
    ks["gemv_qkv"] = gemv_q4_1(D, QKV, False)
    ks["gemv_o"] = gemv_q4_1(D, D, True)
    ks["gemv_gate_up"] = gemv_q4_1(D, 2 * F, False)
    ks["gemv_down"] = gemv_q4_1(F, D, True)
    ks["lm_head"] = gemv_q8_0(D, d.vocab)
    return ks


# ---------------------------------------------------------------- relax entry

def _entry(d: Dims, M: int, weights: list[tuple[str, np.ndarray]], parallel_gemv: bool):
    """IRModule whose ``main`` is one forward pass over M tokens."""
    from tvm import relax

    def ty(shape, dtype):
        return relax.TensorType(shape, dtype)

    ks = _kernels(d, M, parallel_gemv)
    bb = relax.BlockBuilder()
    gv = {name: bb.add_func(f, name) for name, f in ks.items()}
    ids = relax.Var("ids", ty((1, M), "int64"))
    pos = relax.Var("positions", ty((1, M), "int64"))
    kv = []
    for i in range(d.n_layers):
        kv += [relax.Var(f"k{i}", ty(d.kv_shape, d.kv_dtype)), relax.Var(f"v{i}", ty(d.kv_shape, d.kv_dtype))]
    wv = {n: relax.Var(n.replace(".", "_"), ty(a.shape, str(a.dtype))) for n, a in weights}
    params = [ids, pos] + kv + list(wv.values())
    xd = ty((M, d.dim), "float32")
    P = [pos] if M > 1 else []  # prefill GEMMs skip the padding rows
    with bb.function("main", params):
        with bb.dataflow():
            x = bb.emit(relax.call_tir(gv["embed"], [ids, wv["token_embd.q"], wv["token_embd.d"]], xd))
            new_kv = []
            for i in range(d.n_layers):
                b = f"blk.{i}."
                h = bb.emit(relax.call_tir(gv["rmsnorm"], [x, wv[b + "attn_norm"]], xd))
                qkv = bb.emit(relax.call_tir(gv["gemv_qkv"], [h, *P, wv[b + "qkv.q"], wv[b + "qkv.d"], wv[b + "qkv.m"],
                                                                zeros_of(bb, relax, M, d.qkv, "zq")],
                                             ty((M, d.qkv), "float32")))
                kvo = bb.emit(relax.call_tir_inplace(
                    gv["kv_write"], [qkv, pos, wv["rope.cos"], wv["rope.sin"], kv[2 * i], kv[2 * i + 1]],
                    [4, 5], [ty(d.kv_shape, d.kv_dtype), ty(d.kv_shape, d.kv_dtype)]))
                kc = bb.emit(relax.TupleGetItem(kvo, 0))
                vc = bb.emit(relax.TupleGetItem(kvo, 1))
                new_kv += [kc, vc]
                att = bb.emit(relax.call_tir(gv["attention"], [qkv, pos, wv["rope.cos"], wv["rope.sin"], kc, vc], xd))
                x = bb.emit(relax.call_tir(gv["gemv_o"], [att, *P, wv[b + "o.q"], wv[b + "o.d"], wv[b + "o.m"], x], xd))
                h = bb.emit(relax.call_tir(gv["rmsnorm"], [x, wv[b + "ffn_norm"]], xd))
                gu = bb.emit(relax.call_tir(gv["gemv_gate_up"], [h, *P, wv[b + "gate_up.q"], wv[b + "gate_up.d"],
                                                                    wv[b + "gate_up.m"],
                                                                    zeros_of(bb, relax, M, 2 * d.ffn, "zf")],
                                            ty((M, 2 * d.ffn), "float32")))
                a = bb.emit(relax.call_tir(gv["silu_mul"], [gu], ty((M, d.ffn), "float32")))
                x = bb.emit(relax.call_tir(gv["gemv_down"], [a, *P, wv[b + "down.q"], wv[b + "down.d"], wv[b + "down.m"], x],
                                           xd))
            h = bb.emit(relax.call_tir(gv["rmsnorm"], [x, wv["output_norm"]], xd))
            hq, hd = ("output.q", "output.d") if "output.q" in wv else ("token_embd.q", "token_embd.d")
            logits = bb.emit(relax.call_tir(gv["lm_head"], [h, *P, wv[hq], wv[hd]], ty((1, M, d.vocab), "float32")))
            out = bb.emit_output(relax.Tuple([logits] + new_kv))
        bb.emit_func_output(out)
    return bb.get()


def zeros_of(bb, relax, M, N, name):
    """A zero residual for the GEMVs without one (a module constant, 4·M·N bytes)."""
    return relax.const(np.zeros((M, N), np.float32))


# ---------------------------------------------------------------- compile

def _llm_pipeline(target, record: dict):
    """The CPU pipeline minus legalization and fusion (every call is already a
    scheduled TIR kernel; TVM's op-pattern analysis wants block-form TIR), with
    the same workspace probe as the ONNX compiler."""
    import tvm
    from tvm import relax
    from tvm.relax.backend.cpu_generic import pipeline as cpu_generic
    from dspx.compiler.onnx import _pipeline

    probe = [p for p in _pipeline(target, record).passes if p.info.name == "dspx.RecordWorkspace"]
    finalize = cpu_generic.finalize_passes(target)
    passes = ([relax.transform.ToNonDataflow(), relax.transform.RemovePurityChecking(),
               relax.transform.CallTIRRewrite()] + finalize[:1] + probe + finalize[1:])
    return tvm.transform.Sequential(passes, name="dspx.llm_pipeline")


def _signature(d: Dims, M: int, weights, digest) -> Signature:
    kv_in = []
    for i in range(d.n_layers):
        kv_in += [TensorSpec(f"k{i}", d.kv_shape, d.kv_dtype), TensorSpec(f"v{i}", d.kv_shape, d.kv_dtype)]
    inputs = [TensorSpec("ids", (1, M), "int64"), TensorSpec("positions", (1, M), "int64")] + kv_in
    outputs = [TensorSpec("logits", (1, M, d.vocab), "float32")] + [
        TensorSpec(t.name + "_out", t.shape, t.dtype) for t in kv_in]
    return Signature(entry="main", inputs=inputs, outputs=outputs, kernel_imports=[], workspace_bytes=0,
                     weights="separate", num_weights=len(weights), weights_digest=digest)


def kv_resident_reserve(sig: Signature) -> dict:
    """What a KV-resident call really uses: the non-KV inputs (KV inputs live in
    the KV region, but their descriptors still sit in input_buf) and only the
    first output (logits)."""
    n_in = len(sig.inputs)
    return {"input_bytes": desc_region(n_in) + sum(align(t.nbytes) for t in sig.inputs[:2]),
            "output_bytes": side_bytes([sig.outputs[0].nbytes])}


def compiler_digest() -> str:
    """Digest of this compiler's source, TVM's version and the CPU the
    default target resolves to here (cache key)."""
    import tvm
    from dspx.compiler.onnx import resolve_cpu

    h = hashlib.sha256((tvm.__version__ + resolve_cpu(LLM_TARGET)).encode())
    abi = Path(__file__).parent.parent / "abi"
    for f in (Path(__file__).with_name("llm.py"), Path(__file__).with_name("module.py"),
              abi / "modformat.py", abi / "llmpack.py", abi / "layout.py"):
        h.update(f.read_bytes())
    return h.hexdigest()[:16]


def gguf_identity(path: Path) -> dict:
    st = path.stat()
    return {"path": str(path.resolve()), "size": st.st_size, "mtime_ns": st.st_mtime_ns}


def compile_llm(gguf_path=None, outdir="build/llm", *, progress: bool = True, parallel_decode_gemv: bool = False,
                context: int = CONTEXT, chunk: int = CHUNK, kv_dtype: str = "float32", target: str = LLM_TARGET,
                kv_layout: str = "blocked") -> dict:
    """Compile a Llama GGUF into ``outdir`` (prefill.so, decode.so, weights.bin,
    metadata.json); returns the metadata (plus ``"timings"``). ``target`` as
    ``dspx compile --target`` (default: this machine); ``kv_layout`` one of
    KV_LAYOUTS (the arrangement inside the KV tensors; both modules share it)."""
    from dspx.compiler.onnx import _Progress, cpu_features, make_target
    from dspx.llm import read_gguf

    outdir = Path(outdir)
    prog = _Progress(progress)
    t_all = time.perf_counter()
    model = read_gguf(gguf_path, progress=progress)  # raises GGUFNotFoundError / UnsupportedArchitectureError
    d = dims_of(model.config, context, chunk, kv_dtype, kv_layout)
    with prog.stage("pack", f"repack {model.path.name} quantized blocks ({len(model.tensors)} tensors)"):
        weights = pack_weights(model, d)
    import tvm

    target_dict = make_target(target)
    features = cpu_features(target_dict["mcpu"])
    target = tvm.target.Target(target_dict)
    outdir.mkdir(parents=True, exist_ok=True)
    with prog.stage("weights", f"write {WEIGHTS_FILE}"):
        digest = write_weights(outdir / WEIGHTS_FILE, weights)
    entries = {}
    # Decode twice: GEMVs on one thread and on all of them; the host times both
    # at load and keeps the faster on that machine (two threads lose when the
    # other CPU is busy: TVM's workers spin on the CPU the IPC needs).
    builds = [("prefill", chunk, PREFILL_FILE, True), ("decode", 1, DECODE_FILE, parallel_decode_gemv)]
    if not parallel_decode_gemv:
        builds.append(("decode_parallel", 1, DECODE_PARALLEL_FILE, True))
    for name, M, fname, parallel in builds:
        with prog.stage(f"build_{name}", f"build {name} (M={M}) for {target_dict['mcpu']}"):
            mod = _entry(d, M, weights, parallel)
            record: dict = {}
            with target:
                mod = _llm_pipeline(target, record)(mod)
            ex = tvm.compile(mod, target, relax_pipeline=None)
        with prog.stage(f"export_{name}", f"export {outdir / fname}"):
            sig = _signature(d, M, weights, digest)
            sig.cpu_features = features  # the device refuses the module where one is missing
            sig.target_cpu = target_dict["mcpu"]
            sig.workspace_bytes = record.get("workspace_bytes", 0)
            io_meta = make_io_meta(sig.inputs, sig.outputs)
            export_module(ex, outdir / fname, {IO_META_NAME: io_meta.encode(), SIGNATURE_NAME: sig.encode()})
            reserve = kv_resident_reserve(sig)
            meta = write_metadata(outdir / f"{name}.json", sig, io_meta, target=target_dict,
                                  tvm_version=tvm.__version__, module_file=fname, weights_file=WEIGHTS_FILE,
                                  io_reserve=reserve)
            entries[name] = meta
    offsets, kv_end = llmpack.kv_offsets(2 * d.n_layers, d.kv_bytes)
    kv_tensors = [{"name": f"{kind}{i}", "layer": i, "kind": kind, "offset": offsets[2 * i + j]}
                  for i in range(d.n_layers) for j, kind in enumerate("kv")]
    meta = {
        "format": FORMAT,
        "model": {"name": model.config.name, "architecture": "llama", **asdict(d)},
        "gguf": gguf_identity(model.path),
        "tokenizer": {"source": "gguf", "gguf": str(model.path.resolve()),
                      "eos_id": int(model.metadata("tokenizer.ggml.eos_token_id", 2)),
                      "chat_template": "tokenizer.chat_template"},
        "context": d.context, "prefill_chunk": d.chunk,
        "weights": {"file": WEIGHTS_FILE, "digest": digest, "count": len(weights),
                    "bytes": (outdir / WEIGHTS_FILE).stat().st_size,
                    "storage": "GGUF blocks repacked: Q4_1 linear layers (f16 d, f16 m, 4-bit q), "
                               "Q8_0 embedding/LM head (f16 d, int8 q), F32 norms, F32 RoPE tables"},
        "kv": {"order": "k0, v0, k1, v1, ...", "shape": list(d.kv_shape), "dtype": d.kv_dtype,
               "arrangement": d.kv_layout,
               "tensor_bytes": d.kv_bytes, "count": len(kv_tensors),
               "total_bytes": kv_end,
               "layout": "KV region base + i * tensor_bytes (the device packs KV outputs there, 64-aligned)",
               "tensors": kv_tensors, "k_rope": "pairwise (GGUF row order), applied before caching"},
        "modules": entries,
        "compiler": {"digest": compiler_digest(), "tvm_version": tvm.__version__, "target": target_dict},
    }
    (outdir / METADATA_FILE).write_text(json.dumps(meta, indent=2) + "\n")
    meta["timings"] = dict(prog.times, total=time.perf_counter() - t_all)
    return meta


def default_cache_dir() -> Path:
    """``$DSPX_CACHE``, else the checkout's ignored .cache/dspx, else ~/.cache/dspx."""
    if os.environ.get("DSPX_CACHE"):
        return Path(os.environ["DSPX_CACHE"])
    root = Path(__file__).resolve().parents[3]
    if (root / "pyproject.toml").exists():
        return root / ".cache" / "dspx"
    return Path.home() / ".cache" / "dspx"


def compiled_dir(gguf_path=None, cache_dir=None, progress: bool = True, *, context: int = CONTEXT,
                 kv_dtype: str = "float32", kv_layout: str | None = None) -> Path:
    """A compiled copy of ``gguf_path`` under the cache (compiled once per
    compiler digest, GGUF identity, context, KV dtype and KV layout; the
    layout defaults to ``$DSPX_LLM_KV_LAYOUT``, else "blocked")."""
    from dspx.llm import find_default_gguf

    kv_layout = kv_layout or os.environ.get("DSPX_LLM_KV_LAYOUT") or "blocked"
    if kv_layout not in KV_LAYOUTS:
        raise LLMCompileError(f"KV layout {kv_layout!r} is not one of {', '.join(KV_LAYOUTS)}")

    path = find_default_gguf() if gguf_path is None else Path(gguf_path)
    if not path.is_file():
        from dspx.llm import GGUFNotFoundError
        raise GGUFNotFoundError(f"GGUF file not found: {path}")
    ident = gguf_identity(path)
    build = {"context": context, "kv_dtype": kv_dtype}
    if kv_layout != "blocked":
        build["kv_layout"] = kv_layout
    key = hashlib.sha256((compiler_digest() + json.dumps(ident, sort_keys=True)
                          + ("" if build == {"context": CONTEXT, "kv_dtype": "float32"} else json.dumps(build))
                          ).encode()).hexdigest()[:16]
    root = Path(cache_dir or default_cache_dir()) / "llm"
    out = root / key
    if not (out / METADATA_FILE).exists():
        import shutil
        for stale in root.glob("*"):  # builds by an older compiler (~95 MB each)
            try:
                old = json.loads((stale / METADATA_FILE).read_text())["compiler"]["digest"]
            except (OSError, ValueError, KeyError):
                continue
            if old != compiler_digest():
                shutil.rmtree(stale, ignore_errors=True)
        # one temporary directory per process: two processes compiling the same key at
        # once (tests and a benchmark) must not delete each other's half-written build
        tmp = root / f"{key}.tmp{os.getpid()}"
        shutil.rmtree(tmp, ignore_errors=True)
        compile_llm(path, tmp, progress=progress, context=context, kv_dtype=kv_dtype, kv_layout=kv_layout)
        if out.exists() and not (out / METADATA_FILE).exists():
            shutil.rmtree(out, ignore_errors=True)
        try:
            os.replace(tmp, out)
        except OSError:  # another process finished first: keep its build
            if not (out / METADATA_FILE).exists():
                raise
            shutil.rmtree(tmp, ignore_errors=True)
    return out
