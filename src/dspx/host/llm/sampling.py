"""Choosing the next token from a step's logits (llama.cpp's rules)."""
from __future__ import annotations

from typing import Sequence

import numpy as np

__all__ = ["apply_repeat_penalty", "sample"]


def apply_repeat_penalty(logits: np.ndarray, recent: Sequence[int], penalty: float) -> np.ndarray:
    """llama.cpp's repeat penalty: each distinct token among ``recent`` has its
    logit divided by ``penalty`` when positive, multiplied when negative."""
    if penalty == 1.0 or not len(recent):
        return logits
    out = logits.copy()
    idx = np.unique(np.asarray(recent, np.int64))
    v = out[idx]
    out[idx] = np.where(v > 0, v / np.float32(penalty), v * np.float32(penalty))
    return out


def sample(logits: np.ndarray, temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0,
           rng: np.random.Generator | None = None) -> int:
    """Greedy when temperature <= 0; else softmax(logits / T) over the top-k / top-p set."""
    if temperature <= 0:
        return int(np.argmax(logits))
    z = logits.astype(np.float64) / temperature
    idx = np.argsort(-z)
    if top_k and top_k > 0:
        idx = idx[:top_k]
    p = np.exp(z[idx] - z[idx[0]])
    p /= p.sum()
    if top_p < 1.0:
        keep = int(np.searchsorted(np.cumsum(p), top_p) + 1)
        idx, p = idx[:keep], p[:keep] / p[:keep].sum()
    rng = rng if rng is not None else np.random.default_rng()
    return int(idx[rng.choice(len(idx), p=p)])

