"""The host program's side of the timeline trace (``dspx.trace``).

``DSPX_TRACE=out.json`` traces a host program (read when ``dspx.host`` is
imported; ``dspx run/generate --trace`` call ``start_host`` for you): the
variable stays in the environment so a device the program starts traces
too, and at exit the program merges what every process recorded since it
started into ``out.json`` (``finish``).  The host's spans (client calls,
encode, copy-in, the VM's and the LLM's calls) are recorded where those
calls are, each behind a test of ``trace.on``.

A device process writes a top-level span to its part file only once the span
ends, and that can be after the host already has its answer (a core answers
the client inside its ``call job`` span).  So before it merges — and before
it stops a private device — the host waits (``wait_for_device``, at most
``WAIT_S``) until the device's parts hold the spans of its last requests:
the front's ``receive`` of each connection's last request and the core's
``call job`` of each connection's last call, both tagged with the host's pid
(``peer``) and the seq.
"""
from __future__ import annotations

import atexit
import json
import logging
import os
import time
from pathlib import Path

from .. import trace
from ..abi import protocol as P

_since = 0.0  # µs: the host keeps events from when it started tracing
WAIT_S = 5.0  # at most this long for a device's spans of the last calls (then merged without them, and said)
_POLL_S = 0.01
_awaited: list["Awaited"] = []  # one per connection that sent something while tracing
_finished = False
_private_device_stopped = False  # then finish waits for its processes to end before removing their parts
PARTS_WAIT_S = 2.0


class Awaited:
    """A connection's last request and last call a core answered, each as
    (seq, when it was sent in perf_counter_ns): the device spans the host
    waits for before it merges."""

    __slots__ = ("request", "call")

    def __init__(self):
        self.request: tuple[int, int] | None = None
        self.call: tuple[int, int] | None = None


def sent(sent_at: dict, a: Awaited | None, seq: int, t0: int) -> Awaited:
    """A client sent request ``seq`` at ``t0``: kept in ``sent_at`` (where a
    call's modeled DSP timeline starts, ``last_cost``; the last 256) and as
    the connection's last request in ``a`` (made on its first request)."""
    sent_at[seq] = t0
    if len(sent_at) > 256:
        del sent_at[next(iter(sent_at))]
    if a is None:
        a = Awaited()
        _awaited.append(a)
    a.request = (seq, t0)
    return a


# The answers a core sends (a successful call ran on one): its "call job" span is waited for.
_CALL_ANSWERS = (P.InferResp, P.InferLargeResp, P.RpcResp)


def answered(a: Awaited | None, sent_at: dict, resp: P.Message) -> None:
    """A client took the answer ``resp``: a core's, it is the connection's last call."""
    if a is not None and resp.status == P.Status.SUCCESS and isinstance(resp, _CALL_ANSWERS):
        a.call = (resp.seq, sent_at.get(resp.seq, 0))


def before_device_stops() -> None:
    """A private device's processes end now: let them write the spans of this host's calls first."""
    global _private_device_stopped
    if trace.on:
        wait_for_device()
        _private_device_stopped = True


def start_host(path, process: str = "host") -> trace.Recorder:
    """Trace this host program into ``path``: tell devices it starts (the
    environment), and merge at exit what every process recorded from now on
    (parts of processes that are gone are removed first: they are an older
    run's)."""
    global _since
    path = Path(path).resolve()
    os.environ[trace.ENV] = str(path)
    if trace.recorder() is None:
        _since = trace.clock() / 1000
        parts = trace.parts_dir(path)
        for f in parts.glob("*.jsonl") if parts.is_dir() else ():
            if f.stem.isdigit() and not _alive(f.stem):  # only dspx's <pid>.jsonl parts
                f.unlink()
    rec = trace.start(path, process, 0, "host client")
    atexit.register(finish)
    return rec


def _alive(pid: str) -> bool:
    try:
        os.kill(int(pid), 0)
    except (ValueError, ProcessLookupError):
        return False
    except PermissionError:
        pass
    try:  # a zombie (a core nobody reaped yet) writes nothing more
        with open(f"/proc/{int(pid)}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[1].split()[0] != b"Z"
    except (OSError, IndexError):
        return True


def host_from_env() -> None:
    """``DSPX_TRACE`` set for a host program: trace it (called on import of dspx.host)."""
    path = os.environ.get(trace.ENV)
    if path and trace.recorder() is None:
        start_host(path)


def merge(path, since: float = 0.0) -> dict:
    """Every part of the trace at ``path`` (events from ``since`` µs on) as
    one Chrome trace-event object."""
    events = []
    for f in sorted(trace.parts_dir(path).glob("*.jsonl")):
        for line in f.read_text(encoding="utf-8").splitlines():
            if line.strip():
                try:
                    e = json.loads(line)
                except ValueError:
                    continue  # a line cut short by a killed process
                if e.get("ph") == "M" or e.get("ts", 0) >= since:
                    events.append(e)
    events.sort(key=lambda e: (e.get("ph") != "M", e.get("ts", 0)))
    return {"traceEvents": events, "displayTimeUnit": "ms",
            "otherData": {"clock": "CLOCK_MONOTONIC (time.perf_counter_ns), microseconds", "producer": "dspx"}}


def _wanted() -> list[tuple[str, int, int]]:
    """(span name, seq, sent at) of every device span the host waits for."""
    want = set()
    for a in _awaited:
        if a.request is not None:
            want.add(("receive", *a.request))
        if a.call is not None:
            want.add(("call job", *a.call))
    return sorted(want)


class _Tail:
    """The spans of this host's requests that the other parts hold, read as
    the parts grow (only what was appended since the last look)."""

    def __init__(self, parts: Path, own_pid: int):
        self.parts, self.own = parts, own_pid
        self.offsets: dict[Path, int] = {}
        self.seen: set[tuple[str, int, float]] = set()  # (name, seq, ts µs) with peer == this host

    def read(self) -> bool:
        """Take what was appended; True while some other part's process lives (it may still write)."""
        live = False
        for f in self.parts.glob("*.jsonl") if self.parts.is_dir() else ():
            if f.stem == str(self.own):
                continue
            live = live or _alive(f.stem)
            with open(f, "rb") as fh:
                fh.seek(self.offsets.get(f, 0))
                data = fh.read()
            end = data.rfind(b"\n") + 1  # a line being written is taken next time
            self.offsets[f] = self.offsets.get(f, 0) + end
            for line in data[:end].splitlines():
                try:
                    e = json.loads(line)
                except ValueError:
                    continue
                args = e.get("args") or {}
                if e.get("ph") == "X" and args.get("peer") == self.own and "seq" in args:
                    self.seen.add((e["name"], args["seq"], e["ts"]))
        return live

    def has(self, name: str, seq: int, sent_ns: int) -> bool:
        # the span started after the host sent the request: not an older one of the same seq
        return any(n == name and s == seq and ts >= sent_ns / 1000 - 1e-3 for n, s, ts in self.seen)


def wait_for_device(timeout: float = WAIT_S) -> list[str]:
    """Wait until the device's part files hold the spans of this host's last
    requests (see the module's docstring), at most ``timeout`` s, and not at
    all once no other part's process is alive; what is still missing, said."""
    rec = trace.recorder()
    want = _wanted()
    if rec is None or not want:
        return []
    tail = _Tail(trace.parts_dir(rec.path), os.getpid())
    deadline = time.monotonic() + timeout
    while True:
        live = tail.read()
        want = [w for w in want if not tail.has(*w)]
        if not want or not live or time.monotonic() >= deadline:
            break
        time.sleep(_POLL_S)
    return [f"the device's {name!r} span of seq {seq}" for name, seq, _ in want]


def finish() -> Path | None:
    """Wait for the device's spans of this host's calls, flush this process
    and write the merged trace (the host does this at exit; once).  The
    parts are removed after (``_remove_parts``), except those another live
    process still writes (a shared device, another host program)."""
    global _finished
    rec = trace.recorder()
    if rec is None or _finished:
        return None if rec is None else rec.path
    missing = wait_for_device()
    parts = trace.parts_dir(rec.path)
    if missing and not any(f.stem != str(rec.pid) for f in parts.glob("*.jsonl")):
        # no other process wrote a part: the device it used was started without DSPX_TRACE
        logging.getLogger("dspx").warning("trace %s: host events only: the device does not trace (a running "
                                          "device traces when started with DSPX_TRACE=%s)", rec.path, rec.path)
    elif missing:
        logging.getLogger("dspx").warning("trace %s: merged without %s (not written within %.0f s, or their "
                                          "process ended first)", rec.path, ", ".join(missing), WAIT_S)
    rec.flush()
    data = merge(rec.path, _since)
    if missing:
        data["otherData"]["missing"] = missing
    tmp = rec.path.with_name(rec.path.name + ".tmp")
    tmp.write_text(json.dumps(data), encoding="utf-8")
    tmp.replace(rec.path)
    _finished = True
    _remove_parts(parts, rec.pid)
    return rec.path


def _remove_parts(parts: Path, own_pid: int) -> None:
    """After the merge: this program's part and those of processes that are
    gone (a private device's, once it has exited: waited for, at most
    PARTS_WAIT_S), then the directory once it is empty.  Only ``<pid>.jsonl``
    files, the ones dspx writes; a live process's part stays (a shared device
    still writes there), and so does anything else a user put there."""
    deadline = time.monotonic() + (PARTS_WAIT_S if _private_device_stopped else 0)
    while True:
        mine = [f for f in parts.glob("*.jsonl") if f.stem.isdigit()] if parts.is_dir() else []
        live = [f for f in mine if f.stem != str(own_pid) and _alive(f.stem)]
        if not live or time.monotonic() >= deadline:
            break
        time.sleep(_POLL_S)
    for f in mine:
        if f not in live:
            f.unlink(missing_ok=True)
    try:
        parts.rmdir()
    except OSError:  # not empty (a live part, a user's file) or gone already
        pass


# The modeled DSP timeline's track group: not a process of this machine (pids
# stay below 2^22), one per host program.
MODELED_PID_BASE = 1 << 22
MODELED_SORT_INDEX = 90  # below host, front and cores
_DMA_TID = 1000  # a core's iDMA channel tracks: _DMA_TID + 10 * core + channel


def modeled_call(record: dict, t0: int, clock_hz: float) -> None:
    """Draw one call's cost record (Client.last_cost) as the modeled DSP
    timeline, its own process "modeled DSP (<profile>)" beside host time,
    starting when the host sent the call (``t0``, perf_counter_ns), cycles
    at ``clock_hz``.  On the core's track: overhead, compute, DDR stall and
    DMA wait as consecutive spans (the record holds their totals, not when
    each happened); on each iDMA channel's track one span, as long as the
    call, carrying the channel's bytes and transfers (the record has no
    per-transfer times)."""
    rec = trace.recorder()
    pid = MODELED_PID_BASE + os.getpid()
    rec.name_process(pid, f"modeled DSP ({record['profile']})", MODELED_SORT_INDEX)
    core = record.get("core", 0)
    rec.name_track(pid, core, f"core {core} (modeled)")
    ns = 1e9 / clock_hz
    args = {"estimate": True, "profile": record["profile"], "seq": record["seq"], "cycles": record["cycles"],
            "clock_hz": clock_hz}
    t, end = t0, t0 + round(record["cycles"] * ns)
    rec.complete(f"call seq {record['seq']} (estimate)", t0, end, "modeled", args, tid=core, pid=pid)
    for part in ("overhead", "compute", "ddr_stall", "dma_wait"):
        if record[part]:
            t1 = t + round(record[part] * ns)
            rec.complete(part.replace("_", " "), t, t1, "modeled", {"cycles": record[part]}, tid=core, pid=pid)
            t = t1
    for ch, (nbytes, count) in enumerate(zip(record["dma_bytes"], record["dma_transfers"])):
        if count:
            tid = _DMA_TID + 10 * core + ch
            rec.name_track(pid, tid, f"core {core} iDMA ch{ch} (modeled)")
            rec.complete(f"ch{ch}: {count} transfers, {nbytes} bytes", t0, end, "modeled",
                         {"bytes": nbytes, "transfers": count, "placement": "totals: no per-transfer times"},
                         tid=tid, pid=pid)
    rec.flush()
