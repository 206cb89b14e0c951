"""Batch runs: one module over many inputs, spread across a farm's devices,
results in input order.

Items are checked against the module's inputs on the driver (names, shapes,
dtypes) before any is sent.  Each device keeps ``depth`` calls in flight, so
it never waits for the driver between calls; a device that finishes gets the
next chunk, so a slow or restarted device takes fewer.  A call whose device
was lost is retried by Ray on the restarted device (``actors.py``); its
results carry attempt 2 (or 3), and each is handed to ``on_result`` like any
other (without one, logged as a warning).

A device Ray cannot bring back (its node is lost: Ray's retries end in
``ActorUnavailableError`` or ``ActorDiedError``, or ``ray.nodes()`` marks the
node dead) would hold its calls for ever: its chunks go back to the queue,
for the other devices, and each such move counts one attempt.  The device
takes no more work in this batch unless it answers ``info`` again (a device
that was only restarting).  A chunk that outlives ``MAX_MOVES + 1`` devices
stops the batch: it is more likely the chunk that kills them.
"""
from __future__ import annotations

import logging
import time
from collections import OrderedDict, deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import ray

from ..errors import InputError
from . import actors
from .cluster import DEFAULT_KEY, Farm, FarmError, use

log = logging.getLogger("dspx.farm")
_uploads: OrderedDict = OrderedDict()  # (farm, the files' paths, sizes, mtimes) -> (digest, box): see upload()

RESULT_TIMEOUT = 900.0  # seconds without any result before a batch gives up
POLL = 2.0  # seconds between looks at the probes and the farm's nodes while no call returns
PROBE_TIMEOUT = 120.0  # a device whose call was lost takes work again only if it answers within this (a core start)
ADJUST_PERIOD = 1.0  # seconds between asks to the broker: devices to give back, devices come free
QUEUE_TIMEOUT = 3600.0  # seconds a batch waits for its first device
UPLOADS_KEPT = 4  # modules and op libraries whose bytes stay in the object store between batches
MAX_MOVES = actors.MAX_TASK_RETRIES  # as Ray's retries of a call: a chunk moved this often stops at the next loss


@dataclass
class Result:
    """One item's outputs (by name) and where they came from."""

    index: int
    outputs: dict = field(repr=False)
    node: str
    device: str
    attempt: int


@dataclass
class _Chunk:
    start: int
    items: list
    moves: int = 0  # devices lost under it: each counts one attempt

    def span(self) -> str:
        last = self.start + len(self.items) - 1
        return f"item {self.start}" if last == self.start else f"items {self.start}..{last}"


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
        on_result: Callable[[Result], None] | None = None, timeout: float = RESULT_TIMEOUT,
        user: str | None = None, queue_timeout: float | None = QUEUE_TIMEOUT) -> list[Result]:
    """Run ``module`` (a compiled module's directory or .so) once per item on
    the devices under ``key``; the results in input order.

    ``inputs``: stacked arrays ``{name: (N, *input_shape)}``, or a sequence of
    per-call dicts ``{name: array}``.  ``farm``: a ``Farm`` or an address
    (default: the one this process is connected to, else the running one,
    ``cluster.find``).  ``chunk``: items per
    device call (fewer round trips for small items); ``depth``: calls in
    flight per device.  ``on_result(result)`` is called as each item arrives
    (in completion order).  A device lost for good (its node died) gives
    its chunks to the others (see the module's docstring); ``timeout``:
    seconds without any result before the batch stops.  The devices are
    leased (``spread``) for ``user`` (default ``user@host``), waiting at
    most ``queue_timeout`` s for the first."""
    items = split(module, inputs) if isinstance(inputs, Mapping) else list(inputs)
    if not items:
        raise InputError("no items to run", "")
    return spread("run", actors.module_paths(module), items, key=key, farm=farm, chunk=chunk, depth=depth,
                  on_result=on_result, timeout=timeout, user=user, queue_timeout=queue_timeout)


def upload(paths: Sequence[Path]) -> tuple[str, list]:
    """The files' content digest, and a box holding the object ref of their
    bytes: put into Ray's object store once per farm while they are
    unchanged (a ResNet-50's weights are ~100 MB to read, hash and put)."""
    from . import cluster

    stats = tuple((str(p), st.st_size, st.st_mtime_ns) for p, st in ((p, Path(p).stat()) for p in paths))
    mark = (cluster._connected, stats)
    hit = _uploads.get(mark)
    if hit is None:
        files = {Path(p).name: Path(p).read_bytes() for p in paths}
        # In a list, so a device fetches the bytes only when its node has not cached them.
        hit = _uploads[mark] = (actors.files_digest(files), [ray.put(files)])
        while len(_uploads) > UPLOADS_KEPT:
            _uploads.popitem(last=False)
    _uploads.move_to_end(mark)
    return hit


def spread(method: str, paths: Sequence[Path], items: list, *, key: str = DEFAULT_KEY,
           farm: Farm | str | None = None, chunk: int = 1, depth: int = 2,
           on_result: Callable[[Result], None] | None = None, timeout: float = RESULT_TIMEOUT,
           user: str | None = None, queue_timeout: float | None = QUEUE_TIMEOUT) -> list[Result]:
    """Items over the devices under ``key`` through their actors' ``method``
    (``run``: a module's inputs; ``run_ops``: op cases) with the files at
    ``paths`` (what they run, cached on each node by content digest); the
    results in item order.

    The devices are the batch's leases: one waited for (at most
    ``queue_timeout`` s), then every other one free, and more as they come
    free; a device the broker asks back (its user over the cap while
    another waits) takes no new call and is released when its calls are
    back."""
    from . import broker as _broker, leases as _leases

    if chunk < 1 or depth < 1:
        raise ValueError(f"chunk and depth must be at least 1 (got {chunk}, {depth})")
    use(farm)
    devices = actors.find_devices(key)
    if not devices:
        keys = sorted({n.rpartition("-")[0] for n in actors.find_devices()})
        raise FarmError(f"the farm has no device under dspx:{key} (its keys: {', '.join(keys) or 'none'})")
    digest, box = upload(paths)
    held: dict[str, object] = {}  # device -> its lease
    giving_back: set[str] = set()
    adjusted = time.monotonic()

    def grow(wait: float | None = 0) -> None:
        """Lease devices until none is free (the first waited for ``wait`` s):
        the broker knows devices that joined since the batch started."""
        while True:
            try:
                lease = _leases.acquire(key, timeout=None, queue_timeout=wait, user=user, kind="batch")
            except _leases.QueueTimeout:
                if wait:
                    raise
                return
            wait = 0
            held[lease.device] = lease
            if lease.device not in devices:  # it joined the farm after this batch started
                devices.update(actors.find_devices(key))
            if lease.device not in usable and lease.device not in lost:
                usable.append(lease.device)

    def give_back(name: str) -> None:
        if name in usable:
            usable.remove(name)
        giving_back.add(name)
        if not any(d == name for d, _ in calls.values()):
            giving_back.discard(name)
            held.pop(name).release()

    def adjust() -> None:
        """Once a second: give back what the broker asks for, release what
        has drained, take what came free."""
        nonlocal adjusted
        if time.monotonic() - adjusted < ADJUST_PERIOD:
            return
        adjusted = time.monotonic()
        by_id = {lease.id: name for name, lease in held.items()}
        for lid in ray.get(_broker.get().adjust.remote(list(by_id)), timeout=_leases.CALL_TIMEOUT):
            give_back(by_id[lid])
        for name in list(giving_back):
            give_back(name)
        if queue and not giving_back:
            grow()

    queue = deque(_Chunk(start, items[start:start + chunk]) for start in range(0, len(items), chunk))
    calls: dict = {}  # ref -> (device, chunk)
    probes: dict = {}  # ref of an info call -> (device, deadline): devices whose call was lost
    usable: list[str] = []  # the devices that take new calls: leased, not lost, not being given back
    lost: dict[str, str] = {}  # device -> why, for this batch
    node_of: dict[str, str] = {}  # device -> its node, as its results or its info said
    results: list[Result | None] = [None] * len(items)

    def submit(name: str) -> None:
        c = queue.popleft()
        calls[getattr(devices[name], method).remote(digest, box, c.items)] = (name, c)

    def fill() -> None:
        """Every usable device ``depth`` calls deep, while there is work."""
        for _ in range(depth):
            for name in usable:
                if queue and sum(d == name for d, _ in calls.values()) < depth:
                    submit(name)

    def requeue(name: str, c: _Chunk, why: str) -> None:
        if c.moves >= MAX_MOVES:
            raise FarmError(f"{c.span()}: lost {c.moves + 1} devices (the last {name}: {why})")
        c.moves += 1
        queue.appendleft(c)  # first: its items are the oldest

    def suspect(name: str) -> None:
        """A call of ``name`` was lost: no more work for it until it answers."""
        if name in usable:
            usable.remove(name)
            probes[devices[name].info.remote()] = (name, time.monotonic() + PROBE_TIMEOUT)

    def lose(name: str, why: str) -> None:
        """``name`` is gone for this batch: its calls go to the other devices."""
        if name in lost:
            return
        lost[name] = why
        if name in usable:
            usable.remove(name)
        for ref in [r for r, (d, _) in probes.items() if d == name]:
            del probes[ref]
        moved = [ref for ref, (d, _) in calls.items() if d == name]
        for ref in moved:
            requeue(name, calls.pop(ref)[1], why)
        if name in held:
            held.pop(name).release()
        log.warning("device %s lost (%s): %d call(s) moved to the other devices", name, why, len(moved))

    def watch() -> None:
        """No call returned for a while: give up on probes past their time and
        on devices whose node the farm says is dead."""
        now = time.monotonic()
        for name, deadline in list(probes.values()):
            if now > deadline:
                lose(name, f"no answer within {PROBE_TIMEOUT:.0f} s")
        dead = {n["NodeID"] for n in ray.nodes() if not n["Alive"]}
        for name in {d for d, _ in [*calls.values(), *probes.values()]}:
            if node_of.get(name) in dead:
                lose(name, "its node died")

    grow(queue_timeout)
    try:
        fill()
        last = time.monotonic()
        while calls or queue:
            if not calls and not probes:
                left = sum(len(c.items) for c in queue)
                raise FarmError(f"every device under dspx:{key} was lost, {left} item(s) not run ("
                                + "; ".join(f"{d}: {why}" for d, why in lost.items()) + ")")
            waiting = [*calls, *probes]
            if not ray.wait(waiting, num_returns=1, timeout=POLL)[0]:
                if time.monotonic() - last > timeout:
                    raise FarmError(f"no result from any device within {timeout:.0f} s "
                                    f"({len(calls)} call(s) running)")
                watch()
                adjust()
                fill()
                continue
            done, _ = ray.wait(waiting, num_returns=len(waiting), timeout=0)  # every call back by now
            for ref in done:
                if ref in probes:
                    name, _ = probes.pop(ref)
                    try:
                        node_of[name] = ray.get(ref)["node"]
                        if name in held and name not in giving_back:
                            usable.append(name)  # it answers: it was restarting, not lost
                    except ray.exceptions.RayError as e:
                        lose(name, _why(e))
                    continue
                if ref not in calls:
                    continue  # moved off its lost device meanwhile
                name, c = calls.pop(ref)
                try:
                    outs = ray.get(ref)
                except ray.exceptions.RayActorError as e:  # its device or its node, lost after Ray's own retries
                    requeue(name, c, _why(e))
                    suspect(name)
                    continue
                except ray.exceptions.RayError as e:
                    raise FarmError(f"{c.span()} failed on {name}: {_why(e)}") from None
                last = time.monotonic()
                if queue and name in usable:
                    submit(name)  # first: the device gets its next call before the driver reads this one
                for j, o in enumerate(outs):
                    node_of[name] = o["node"]
                    r = results[c.start + j] = Result(c.start + j, **{**o, "attempt": o["attempt"] + c.moves})
                    if r.attempt > 1 and on_result is None:  # else the caller shows it
                        log.warning("item %d: attempt %d on %s (an earlier attempt lost its device)", r.index,
                                    r.attempt, r.device)
                    if on_result is not None:
                        on_result(r)
            for name in list(giving_back):
                give_back(name)  # released once its last call is back
            adjust()
            fill()
        return results
    finally:
        for lease in held.values():
            try:
                lease.release()
            except (ray.exceptions.RayError, FarmError):  # the farm went away: nothing left to give back
                pass
