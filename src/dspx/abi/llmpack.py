"""The LLM package format: what ``dspx compile-llm`` writes and
``dspx.host.llm`` reads.

A package is a directory: ``prefill.so`` and ``decode.so`` (two modules of
the ordinary module format; optionally ``decode_parallel.so``, the same
decode entry with multi-threaded GEMVs, chosen by timing at load, and
``decode_batch.so``, one decode step for up to ``BATCH_ROWS`` rows of
different KV slots, with ``decode_batch_parallel.so``, the same step on all
threads, chosen by timing when slots are set; every entry takes ids, positions and bases — each row's
slot's first cache position — then the KV), one ``weights.bin`` all take through
MODEL_LOAD, and ``metadata.json`` with ``format: dspx-llm/1``, the model's
dimensions, the context and prefill chunk, the tokenizer's source, and the
KV layout: ``2 × layers`` float32 tensors k0, v0, k1, v1, … packed 64-byte
aligned from the KV region's base (abi.layout.pack).
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from .layout import pack

FORMAT = "dspx-llm/1"
METADATA_FILE = "metadata.json"
PREFILL_FILE = "prefill.so"
DECODE_FILE = "decode.so"
DECODE_PARALLEL_FILE = "decode_parallel.so"  # the same entry with its GEMVs on all threads (optional)
DECODE_BATCH_FILE = "decode_batch.so"  # one decode step for up to BATCH_ROWS slots (optional)
DECODE_BATCH_PARALLEL_FILE = "decode_batch_parallel.so"  # the same step on all threads (optional)
BATCH_ROWS = 4  # decode rows per batched call (a step of more active slots takes several calls)
WEIGHTS_FILE = "weights.bin"
CONTEXT = 256  # tokens: the float32 KV of 30 layers fills the 12 MiB KV region
CHUNK = 64     # prefill tokens per call
KV_BLOCK = 16  # cache positions per KV block: a KV slot starts on a block
# The longest context whose KV fits the 12 MiB KV region for SmolLM2-135M, per
# KV dtype (int8 rows carry a float32 scale: 68 bytes per head and position).
DEFAULT_CONTEXT = {"float32": 256, "float16": 512, "int8": 1024}


class PackageError(ValueError):
    """A directory that is not an LLM package this code reads."""


def kv_offsets(count: int, tensor_bytes: int) -> tuple[list[int], int]:
    """Offsets of ``count`` KV tensors in the KV region, and the bytes they take."""
    return pack([tensor_bytes] * count)


@dataclass(frozen=True)
class Package:
    dir: Path
    meta: dict
    context: int
    chunk: int
    vocab: int
    kv_shape: tuple[int, ...]
    kv_offsets: list[int]
    kv_total: int


def read(directory) -> Package:
    d = Path(directory)
    path = d / METADATA_FILE
    if not path.exists():
        raise PackageError(f"{d} is not a compiled LLM (no {METADATA_FILE}): run dspx compile-llm")
    try:
        meta = json.loads(path.read_text())
    except ValueError as e:
        raise PackageError(f"{path}: not JSON ({e})") from None
    if meta.get("format") != FORMAT:
        raise PackageError(f"{path}: format {meta.get('format')!r}, expected {FORMAT!r} (not an LLM package)")
    try:
        kv = meta["kv"]
        return Package(d, meta, int(meta["context"]), int(meta["prefill_chunk"]), int(meta["model"]["vocab"]),
                       tuple(kv["shape"]), [int(t["offset"]) for t in kv["tensors"]], int(kv["total_bytes"]))
    except (KeyError, TypeError, ValueError) as e:
        raise PackageError(f"{path}: malformed LLM metadata ({type(e).__name__}: {e})") from None
