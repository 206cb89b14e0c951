"""The normalisation kernels: softmax and layernorm (numpy, exact)."""

from __future__ import annotations

import numpy as np

from .registry import as_numpy, kernel


@kernel("softmax", "numpy")
def softmax(data, axis, out):
    """Softmax along axis (negative counts from the end); exact exp, no fast math."""
    x, o = as_numpy(data), as_numpy(out)
    ax = int(axis)
    np.subtract(x, x.max(axis=ax, keepdims=True), out=o)
    np.exp(o, out=o)
    o /= o.sum(axis=ax, keepdims=True)


@kernel("layernorm", "numpy")
def layernorm(data, gamma, beta, eps, out):
    """out = (data - mean) / sqrt(var + eps) * gamma + beta over the last axis."""
    x, g, b, o = as_numpy(data), as_numpy(gamma), as_numpy(beta), as_numpy(out)
    mu = x.mean(axis=-1, keepdims=True)
    np.subtract(x, mu, out=o)
    var = np.einsum("...i,...i->...", o, o)[..., None] / np.float32(x.shape[-1])
    o *= 1.0 / np.sqrt(var + np.float32(eps))
    o *= g
    o += b


