"""An op library's test cases spread over a farm: ``dspx farm ops LIB
--cases CASES.npz``.

CASES.npz holds N cases (``docs/farm.md``, "Operator cases"):

- ``input``: ``(N, ...)``, any dtype: case i's input buffer is ``input[i]``'s bytes;
- ``cmd``: the command id, one for all (a scalar) or one per case ``(N,)``;
- ``expected``: ``(N, ...)``, any dtype: case i passes when its output buffer
  holds exactly ``expected[i]``'s bytes and it returned its expected code;
  without it, ``output_bytes`` (a scalar) sizes the output buffer;
- ``return_value``: ``(N,)`` expected return codes (default 0);
- ``timeout_ms``: a scalar, each case's time limit on the device (default 30 000).

Each device loads the library once (it comes to a node once, into the
node's cache, by content digest, as modules do) and runs its share.
"""
from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..errors import InputError
from .batch import Result, spread
from .cluster import DEFAULT_KEY, Farm

TIMEOUT_MS = 30_000
KNOWN = {"input", "cmd", "expected", "output_bytes", "return_value", "timeout_ms"}


@dataclass
class Cases:
    """Cases as read from CASES.npz, checked: per case, what to send and what to expect."""

    calls: list[dict]
    expected: np.ndarray | None      # (N, ...) or None
    return_values: np.ndarray        # (N,) expected codes
    output_shape: tuple
    output_dtype: np.dtype

    def __len__(self) -> int:
        return len(self.calls)


def _int_array(name: str, a: np.ndarray, n: int) -> np.ndarray:
    if a.dtype.kind not in "iu":
        raise InputError(f"cases: {name!r} must hold integers (got {a.dtype.name})", name)
    if a.ndim == 0:
        return np.full(n, int(a), np.int64)
    if a.shape != (n,):
        raise InputError(f"cases: {name!r} must be a scalar or one per case, shape ({n},) "
                         f"(got {list(a.shape)})", name)
    return a.astype(np.int64)


def read_cases(data: Mapping[str, np.ndarray]) -> Cases:
    """The cases of a CASES.npz's arrays, or one ``InputError`` line saying what is wrong."""
    unknown = sorted(set(data) - KNOWN)
    if unknown:
        raise InputError(f"cases: unknown array(s) {', '.join(unknown)} (known: {', '.join(sorted(KNOWN))})",
                         unknown[0])
    for name in ("input", "cmd"):
        if name not in data:
            raise InputError(f"cases: no {name!r} array (the cases need 'input' (N, ...) and 'cmd')", name)
    inp = np.asarray(data["input"])
    if inp.ndim < 1 or inp.shape[0] == 0:
        raise InputError(f"cases: 'input' must be (N, ...) with N >= 1 (got {list(inp.shape)})", "input")
    n = inp.shape[0]
    cmd = _int_array("cmd", np.asarray(data["cmd"]), n)
    expected = np.asarray(data["expected"]) if "expected" in data else None
    if expected is not None:
        if expected.ndim < 1 or expected.shape[0] != n:
            raise InputError(f"cases: 'expected' must be (N, ...) with N = {n} as 'input' "
                             f"(got {list(expected.shape)})", "expected")
        if "output_bytes" in data and int(data["output_bytes"]) != expected[0].nbytes:
            raise InputError(f"cases: output_bytes {int(data['output_bytes'])} but each 'expected' holds "
                             f"{expected[0].nbytes} bytes (give one of them)", "output_bytes")
        shape, dtype = expected.shape[1:], expected.dtype
    elif "output_bytes" in data:
        nbytes = int(data["output_bytes"])
        if nbytes < 0:
            raise InputError(f"cases: output_bytes must be >= 0 (got {nbytes})", "output_bytes")
        shape, dtype = (nbytes,), np.dtype(np.uint8)
    else:
        raise InputError("cases: give 'expected' (N, ...) or 'output_bytes' (how big each output buffer is)",
                         "expected")
    want_rv = _int_array("return_value", np.asarray(data["return_value"]), n) if "return_value" in data \
        else np.zeros(n, np.int64)
    timeout = int(data["timeout_ms"]) if "timeout_ms" in data else TIMEOUT_MS
    if timeout <= 0:
        raise InputError(f"cases: timeout_ms must be > 0 (got {timeout})", "timeout_ms")
    nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    calls = [{"cmd": int(cmd[i]), "input": np.frombuffer(np.ascontiguousarray(inp[i]).tobytes(), np.uint8),
              "output_bytes": nbytes, "timeout_ms": timeout} for i in range(n)]
    return Cases(calls, expected, want_rv, tuple(shape), dtype)


@dataclass
class CaseResult:
    """One case: its output (as the expected array's dtype and shape), its
    return code, cycles, the device's error if it had one, whether it
    passed, and where it ran."""

    index: int
    output: np.ndarray
    return_value: int | None
    cycles: int
    error: str | None
    passed: bool | None
    node: str
    device: str
    attempt: int


def _judge(r: Result, cases: Cases) -> CaseResult:
    o = r.outputs
    out = np.frombuffer(o["output"].tobytes(), cases.output_dtype).reshape(cases.output_shape)
    passed = None
    if o["error"] is not None:
        passed = False
    elif cases.expected is not None:
        passed = bool(o["return_value"] == cases.return_values[r.index]
                      and out.tobytes() == np.ascontiguousarray(cases.expected[r.index]).tobytes())
    elif o["return_value"] != cases.return_values[r.index]:
        passed = False
    return CaseResult(r.index, out, o["return_value"], o["cycles"], o["error"], passed, r.node, r.device, r.attempt)


def run_cases(library, cases: Cases, *, key: str = DEFAULT_KEY, farm: Farm | str | None = None, chunk: int = 8,
              depth: int = 2, on_result: Callable[[CaseResult], None] | None = None,
              user: str | None = None) -> list[CaseResult]:
    """Run ``cases`` (``read_cases``) of the op library ``library`` (a path:
    a LIB.so from ``dspx build-ops``, or a .py op library) on the devices
    under ``key``; the results in case order."""
    judged: list[CaseResult] = []

    def each(r: Result) -> None:
        c = _judge(r, cases)
        judged.append(c)
        if on_result is not None:
            on_result(c)

    spread("run_ops", [Path(library)], cases.calls, key=key, farm=farm, chunk=chunk, depth=depth, on_result=each,
           user=user)
    return sorted(judged, key=lambda c: c.index)
