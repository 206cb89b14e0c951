"""What the kernel library keeps between calls: prepacked weights and
per-weight sessions, and the other families' tables, all dropped together by
:func:`clear_caches` (the loader calls it on DYN_UNLOAD).

Prepacked weights are keyed by the constant's address and shape. Module
constants live as long as the module, so the address is stable; a
fingerprint of sampled values guards against a later module reusing the
address.
"""

from __future__ import annotations

import threading
from typing import Any, Callable

import numpy as np

lock = threading.Lock()
weights: dict[tuple, tuple[bytes, Any]] = {}  # key -> (fingerprint, prepacked weight or session)
_tables: list[dict] = []  # every other cache, from new_cache()


def new_cache() -> dict:
    """A dict that clear_caches() empties with the weights (call-site runs, pooling sessions, RoPE tables)."""
    table: dict = {}
    _tables.append(table)
    return table


def fingerprint(a: np.ndarray) -> bytes:
    flat = a.reshape(-1)
    step = max(1, flat.size // 16)
    return flat[::step][:16].tobytes()


def cached(a: np.ndarray, extra: tuple, make: Callable[[], Any]) -> Any:
    """make()'s value for the weight ``a`` (and the call's ``extra`` key), built once."""
    key = (a.ctypes.data, a.shape, a.dtype.str) + extra
    fp = fingerprint(a)
    hit = weights.get(key)
    if hit is not None and hit[0] == fp:
        return hit[1]
    with lock:
        value = make()
        weights[key] = (fp, value)
    return value


def restore_weight(w: np.ndarray, scale: np.ndarray | None, axis: int) -> np.ndarray:
    """A reduced-precision weight as float32 (dspx compile --weights): float16
    cast, or int8 times its per-channel scale along ``axis``.  Done once per
    weight and cached beside the prepacked weights (the stored weight lives as
    long as its module, so its address is a stable key)."""
    if w.dtype == np.float32 and scale is None:
        return w

    def make():
        f = w.astype(np.float32)
        if scale is not None:
            shape = [1] * f.ndim
            shape[axis] = -1
            f *= scale.reshape(shape)
        return f
    return cached(w, ("restore", axis), make)


def clear_caches() -> None:
    """Drop every prepacked weight and per-weight session (call on DYN_UNLOAD)."""
    with lock:
        weights.clear()
        for table in _tables:
            table.clear()


def cache_size() -> int:
    return len(weights)
