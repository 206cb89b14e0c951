"""The model's shape as the device kernels see it: dimensions, context and
prefill chunk, and what the KV cache takes (its element type, arrangement
and bytes in the device's KV region)."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from dspx.abi import llmpack
from dspx.abi.llmpack import CHUNK, CONTEXT
from dspx.llm import LLMError  # the llm extra: gguf, tokenizers

TN = 64  # output rows per GEMV tile (4 AVX-512 vectors)


class LLMCompileError(LLMError):
    """The GGUF cannot be compiled for the device; the message says why."""


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
    decode_activations: str = "int8"

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
# How a KV tensor's bytes are arranged (docs/llm-internals.md, "The KV layout"): "blocked" (16-position
# blocks, K transposed within a block) or "rows" (one row per position, the earlier layout,
# kept for A/B: compile_llm(kv_layout="rows"), DSPX_LLM_KV_LAYOUT=rows).
KV_LAYOUTS = ("blocked", "rows")
# What decode's Q4_1 layers multiply their weights with (tir/gemv.py): the input quantized per
# 32-element block to int8 (llama.cpp's Q8_1; integer dot products, ~1.7x the float GEMV on AVX2),
# or float32 as it is (prefill's arithmetic: decode's logits within 2e-3 of a float32 reference).
DECODE_ACTIVATIONS = ("int8", "float32")
KB = llmpack.KV_BLOCK  # positions per KV block (one AVX-512 vector of float32 scores)


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


def check_kv_layout(kv_layout: str) -> None:
    if kv_layout not in KV_LAYOUTS:
        raise LLMCompileError(f"KV layout {kv_layout!r} is not one of {', '.join(KV_LAYOUTS)}")


def check_decode_activations(decode_activations: str) -> None:
    if decode_activations not in DECODE_ACTIVATIONS:
        raise LLMCompileError(f"decode activations {decode_activations!r} is not one of "
                              f"{', '.join(DECODE_ACTIVATIONS)}")


def dims_of(config, context: int = CONTEXT, chunk: int = CHUNK, kv_dtype: str = "float32",
            kv_layout: str = "blocked", decode_activations: str = "int8") -> Dims:
    c = config
    if kv_dtype not in KV_DTYPES:
        raise LLMCompileError(f"KV dtype {kv_dtype!r} is not one of {', '.join(KV_DTYPES)}")
    check_kv_layout(kv_layout)
    check_decode_activations(decode_activations)
    d = Dims(c.n_layers, c.hidden_size, c.n_heads, c.n_kv_heads, c.head_dim, c.ffn_size, c.vocab_size,
             float(c.rope_theta), float(c.rms_eps), context, chunk, kv_dtype, kv_layout, decode_activations)
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
