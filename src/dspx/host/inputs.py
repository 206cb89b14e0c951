"""Inputs checked on the host against what the module declares.

``metadata.json`` (written by ``dspx compile``) names each input with its
shape and dtype.  ``bind`` turns a call's positional and named arguments into
the arrays to send, in the module's order, and refuses — with ``InputError``
naming the input, what it expects and what it got — anything that would
otherwise reach the device only to fail there (or fail as a capacity error):
a wrong count, an unknown or repeated name, a wrong shape or dtype.

Accepted values: numpy arrays, anything with ``__dlpack__`` or ``.numpy()``
(tvm tensors), torch tensors (``requires_grad`` ones too: their data is
taken with ``.detach()``), and Python lists or scalars, converted when their
values fit the input's dtype.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..errors import InputError


@dataclass(frozen=True)
class TensorSpec:
    name: str
    shape: tuple
    dtype: str

    def __str__(self) -> str:
        return f"{self.dtype}[{', '.join(map(str, self.shape))}]"

    @classmethod
    def from_meta(cls, t: dict) -> "TensorSpec":
        return cls(str(t["name"]), tuple(int(s) for s in t["shape"]), np.dtype(t["dtype"]).name)


def specs(meta: dict, side: str = "inputs") -> list[TensorSpec]:
    return [TensorSpec.from_meta(t) for t in meta.get(side, [])]


def _kind(a: np.ndarray) -> str:
    return f"{a.dtype.name}[{', '.join(map(str, a.shape))}]"


def what(x) -> str:
    """How an error names a value that is not an array: "a list", "a str" …"""
    return "a list" if isinstance(x, (list, tuple)) else f"a {type(x).__name__}"


def to_array(x, spec: TensorSpec | None = None) -> np.ndarray:
    """``x`` as a numpy array (no copy when it already is one or shares memory by DLPack)."""
    if isinstance(x, np.ndarray):
        return x
    if hasattr(x, "detach") and hasattr(x, "requires_grad"):  # torch: no autograd on the device
        x = x.detach()
        if getattr(x, "device", None) is not None and str(x.device) != "cpu":
            x = x.cpu()
    if hasattr(x, "__dlpack__"):
        try:
            return np.from_dlpack(x)
        except (TypeError, RuntimeError, BufferError):
            pass
    if hasattr(x, "numpy"):  # tvm.runtime.Tensor and friends
        return np.asarray(x.numpy())
    if spec is None:
        return np.asarray(x)
    # A Python list or scalar: converted when every value fits the dtype.
    kind = what(x)
    try:
        raw = np.asarray(x)
    except ValueError as e:  # ragged lists
        raise InputError(f"input {spec.name!r}: {kind} that is not a rectangular array ({e})",
                         spec.name, str(spec), kind) from None
    want = np.dtype(spec.dtype)
    if raw.dtype == object or not np.can_cast(raw.dtype, want, "same_kind"):
        raise InputError(f"input {spec.name!r} expects {want.name}; got {kind} of {raw.dtype.name} values "
                         f"(convert it, e.g. np.asarray(x, {want.name!r}))", spec.name, str(spec), raw.dtype.name)
    a = raw.astype(want)
    if raw.dtype.kind in "iu" and want.kind in "iu" and not np.array_equal(a, raw):
        raise InputError(f"input {spec.name!r}: values of {kind} do not fit {want.name}", spec.name,
                         str(spec), raw.dtype.name)
    return a


def bind(specs: list[TensorSpec], args, named: dict, fn: str = "main", skip=()) -> list[np.ndarray]:
    """The arrays for one call, in the module's input order.  ``skip`` are
    input indices supplied another way (the KV region) and not passed here.
    A single dict argument is taken as the named inputs (``f({"x": x})``)."""
    if len(args) == 1 and isinstance(args[0], dict) and not named:
        args, named = (), args[0]
    if not specs:  # no metadata.json: nothing to check against; the device checks
        if named:
            raise InputError(f"{fn}: named inputs need the module's metadata.json (none was found)")
        return [to_array(x) for x in args]
    slots = [i for i in range(len(specs)) if i not in set(skip)]
    names = ", ".join(specs[i].name for i in slots)
    if len(args) > len(slots):
        raise InputError(f"{fn} takes {len(slots)} input{'s' * (len(slots) != 1)} ({names}); "
                         f"{len(args)} given", None, len(slots), len(args))
    given = dict(zip(slots, args))
    index = {specs[i].name: i for i in slots}
    for name, value in named.items():
        i = index.get(name)
        if i is None:
            raise InputError(f"{fn} has no input {name!r} (inputs: {names})", name, names, name)
        if i in given:
            raise InputError(f"{fn}: input {name!r} given twice (by position and by name)", name)
        given[i] = value
    missing = [specs[i].name for i in slots if i not in given]
    if missing:
        raise InputError(f"{fn} takes {len(slots)} input{'s' * (len(slots) != 1)} ({names}); missing "
                         f"{', '.join(map(repr, missing))}", missing[0], len(slots), len(given))
    out = []
    for i in slots:
        spec = specs[i]
        a = to_array(given[i], spec)
        if a.dtype.name != spec.dtype or a.shape != spec.shape:
            hint = f" (convert with .astype({spec.dtype!r}))" if a.shape == spec.shape else ""
            raise InputError(f"input {spec.name!r} of {fn} expects {spec}; got {_kind(a)}{hint}",
                             spec.name, str(spec), _kind(a))
        out.append(a)
    return out


__all__ = ["TensorSpec", "specs", "what", "to_array", "bind"]
