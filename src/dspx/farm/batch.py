"""Batch runs: one module over many inputs, spread across a farm's devices,
results in input order.

Items are checked against the module's inputs on the driver (names, shapes,
dtypes) before any is sent.  Each device keeps ``depth`` calls in flight, so
it never waits for the driver between calls; a device that finishes gets the
next chunk, so a slow or restarted device takes fewer.  A call whose device
was lost is retried by Ray on the restarted device (``actors.py``); its
results carry attempt 2 (or 3), and each is handed to ``on_result`` like any
other (without one, logged as a warning).
"""
from __future__ import annotations

import logging
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np
import ray

from ..errors import InputError
from . import actors
from .cluster import DEFAULT_KEY, Farm, FarmError, use

log = logging.getLogger("dspx.farm")

RESULT_TIMEOUT = 900.0  # seconds without any result before a batch gives up


@dataclass
class Result:
    """One item's outputs (by name) and where they came from."""

    index: int
    outputs: dict = field(repr=False)
    node: str
    device: str
    attempt: int


def _specs(module):
    from ..host.inputs import specs
    from ..host.vm import find_module

    _, meta = find_module(module)
    return specs(meta), specs(meta, "outputs")


def split(module, inputs: Mapping[str, np.ndarray]) -> list[dict]:
    """Stacked inputs (each ``(N, *input_shape)``, named after a module input)
    as N per-call input dicts, refused with one ``InputError`` line when they
    do not fit the module."""
    specs, _ = _specs(module)
    want, given = [s.name for s in specs], list(inputs)
    if set(want) != set(given):
        missing, extra = sorted(set(want) - set(given)), sorted(set(given) - set(want))
        raise InputError(f"the inputs are named {', '.join(given) or '(none)'}; the module's are "
                         f"{', '.join(want)}" + (f" (missing {', '.join(missing)})" if missing else "")
                         + (f" (unknown {', '.join(extra)})" if extra else ""), ",".join(missing or extra))
    counts = set()
    for s in specs:
        a = np.asarray(inputs[s.name])
        if a.ndim != len(s.shape) + 1 or tuple(a.shape[1:]) != s.shape or a.dtype.name != s.dtype:
            raise InputError(f"input {s.name!r}: expected (N, {', '.join(str(d) for d in s.shape)}) of {s.dtype} "
                             f"(N items of {s}); got {a.dtype.name}[{', '.join(str(d) for d in a.shape)}]",
                             s.name, str(s), f"{a.dtype.name}{list(a.shape)}")
        counts.add(a.shape[0])
    if len(counts) != 1:
        raise InputError(f"the inputs hold different numbers of items ({', '.join(str(c) for c in sorted(counts))})",
                         ",".join(want))
    n = counts.pop()
    if n == 0:
        raise InputError("the inputs hold no items (N = 0)", ",".join(want))
    return [{s.name: np.asarray(inputs[s.name])[i] for s in specs} for i in range(n)]


def stack(results: Sequence[Result]) -> dict[str, np.ndarray]:
    """Each output by name, stacked in input order: ``(N, *output_shape)``."""
    return {name: np.stack([r.outputs[name] for r in results]) for name in results[0].outputs}


def _why(e: Exception) -> str:
    """One line for a failed call: the device-side error's own words."""
    cause = getattr(e, "cause", None)
    if isinstance(cause, Exception) and str(cause):
        return f"{type(cause).__name__}: {str(cause).splitlines()[0]}"
    lines = [ln for ln in str(e).splitlines() if ln.strip()]
    return lines[-1] if lines else type(e).__name__


def map(module, inputs: Mapping[str, np.ndarray] | Sequence[dict], *, key: str = DEFAULT_KEY,
        farm: Farm | str | None = None, chunk: int = 1, depth: int = 2,
        on_result: Callable[[Result], None] | None = None, timeout: float = RESULT_TIMEOUT) -> list[Result]:
    """Run ``module`` (a compiled module's directory or .so) once per item on
    the devices under ``key``; the results in input order.

    ``inputs``: stacked arrays ``{name: (N, *input_shape)}``, or a sequence of
    per-call dicts ``{name: array}``.  ``farm``: a ``Farm`` or an address
    (default: the one this process is connected to, else the running one,
    ``cluster.find``).  ``chunk``: items per
    device call (fewer round trips for small items); ``depth``: calls in
    flight per device.  ``on_result(result)`` is called as each item arrives
    (in completion order)."""
    items = split(module, inputs) if isinstance(inputs, Mapping) else list(inputs)
    if not items:
        raise InputError("no items to run", "")
    if chunk < 1 or depth < 1:
        raise ValueError(f"chunk and depth must be at least 1 (got {chunk}, {depth})")
    use(farm)
    devices = actors.find_devices(key)
    if not devices:
        keys = sorted({n.rpartition("-")[0] for n in actors.find_devices()})
        raise FarmError(f"the farm has no device under dspx:{key} (its keys: {', '.join(keys) or 'none'})")
    files = actors.module_files(module)
    digest = actors.files_digest(files)
    box = [ray.put(files)]  # in a list, so a device fetches it only when its node has not cached it
    queue = deque((start, items[start:start + chunk]) for start in range(0, len(items), chunk))
    inflight: dict = {}
    results: list[Result | None] = [None] * len(items)

    def submit(name: str) -> None:
        start, part = queue.popleft()
        inflight[devices[name].run.remote(digest, box, part)] = (name, start, len(part))

    for _ in range(depth):
        for name in devices:
            if queue:
                submit(name)
    while inflight:
        if not ray.wait(list(inflight), num_returns=1, timeout=timeout)[0]:
            raise FarmError(f"no result from any device within {timeout:.0f} s ({len(inflight)} call(s) running)")
        done, _ = ray.wait(list(inflight), num_returns=len(inflight), timeout=0)  # every call back by now
        for ref in done:
            name, start, n = inflight.pop(ref)
            try:
                outs = ray.get(ref)
            except ray.exceptions.RayError as e:
                span = f"item {start}" if n == 1 else f"items {start}..{start + n - 1}"
                raise FarmError(f"{span} failed on {name}: {_why(e)}") from None
            if queue:
                submit(name)  # first: the device gets its next call before the driver reads this one
            for j, o in enumerate(outs):
                r = results[start + j] = Result(start + j, **o)
                if r.attempt > 1 and on_result is None:  # else the caller shows it
                    log.warning("item %d: attempt %d on %s (its device was lost and restarted)", r.index,
                                r.attempt, r.device)
                if on_result is not None:
                    on_result(r)
    return results
