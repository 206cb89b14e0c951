"""Sentence embeddings from the device model: the final hidden state (after the
output norm), mean-pooled over the input's tokens and L2-normalised.

The device entries return logits, not hidden states.  The LM head is linear
(``logits_t = W h_t``, W the vocab × dim head, no bias) and W has full column
rank (vocab 49,152 ≫ dim 576), so the hidden states are exactly the
least-squares solution of the logits; and since the mean is linear too, the
mean hidden state is the solution for the mean logits row.  Every token's
logits are needed, and the prefill entry computes only the last row's, so an
input runs as one decode step per token (as long as generating that many).  The host reads W
from the GGUF it already reads the tokenizer from (the same Q8_0 blocks the
compiler repacked for the device), so no extra device entry is compiled.
"""
from __future__ import annotations

import threading
from typing import Sequence

import numpy as np

from .device import DeviceLLM

__all__ = ["Embedder"]

_GRAM_ROWS = 4096  # rows of W per float64 block while forming WᵀW (bounds the float64 copy)


class Embedder:
    """Mean-pooled, normalised hidden states of token sequences on a DeviceLLM."""

    def __init__(self, gguf_path):
        self.gguf_path = gguf_path
        self._head: np.ndarray | None = None   # W, float32 (vocab, dim)
        self._gram: np.ndarray | None = None   # WᵀW, float64 (dim, dim)
        self._lock = threading.Lock()

    def _solver(self) -> tuple[np.ndarray, np.ndarray]:
        with self._lock:  # built once, at the first embedding request (about a second)
            if self._head is None:
                from ...llm import read_gguf

                model = read_gguf(self.gguf_path, progress=False)
                name = "output.weight" if "output.weight" in model else "token_embd.weight"  # tied head
                head = np.ascontiguousarray(model.dequantize(name), np.float32)
                gram = np.zeros((head.shape[1], head.shape[1]), np.float64)
                for s in range(0, len(head), _GRAM_ROWS):
                    block = head[s:s + _GRAM_ROWS].astype(np.float64)
                    gram += block.T @ block
                self._head, self._gram = head, gram
            return self._head, self._gram

    def hidden(self, mean_logits: np.ndarray) -> np.ndarray:
        """The hidden state h with W h = mean_logits (least squares; exact when the logits came from W)."""
        head, gram = self._solver()
        rhs = np.zeros(len(gram), np.float64)
        for s in range(0, len(head), _GRAM_ROWS):  # Wᵀ·logits in float64, a block of W at a time
            rhs += head[s:s + _GRAM_ROWS].astype(np.float64).T @ mean_logits[s:s + _GRAM_ROWS]
        return np.linalg.solve(gram, rhs)

    def embed(self, llm: DeviceLLM, ids: Sequence[int]) -> np.ndarray:
        """The unit-length mean hidden state of ``ids`` (float32, the model's dim).  One
        decode step per token from position 0 (it overwrites the KV cache's first rows):
        the prefill entry computes only its last row's logits, a decode step its one row."""
        total = np.zeros(llm.vocab, np.float64)
        for pos, token in enumerate(ids):
            total += llm.decode(int(token), pos)
        h = self.hidden(total / len(ids))
        return (h / np.linalg.norm(h)).astype(np.float32)
