"""The host program's side of the timeline trace (``dspx.trace``).

``DSPX_TRACE=out.json`` traces a host program (read when ``dspx.host`` is
imported; ``dspx run/generate --trace`` call ``start_host`` for you): the
variable stays in the environment so a device the program starts traces
too, and at exit the program merges what every process recorded since it
started into ``out.json`` (``finish``).  The host's spans (client calls,
encode, copy-in, the VM's and the LLM's calls) are recorded where those
calls are, each behind a test of ``trace.on``.
"""
from __future__ import annotations

import atexit
import json
import os
from pathlib import Path

from .. import trace

_since = 0.0  # µs: the host keeps events from when it started tracing


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
            if not _alive(f.stem):
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


def finish() -> Path | None:
    """Flush this process and write the merged trace (the host does this at exit)."""
    rec = trace.recorder()
    if rec is None:
        return None
    rec.flush()
    data = merge(rec.path, _since)
    tmp = rec.path.with_name(rec.path.name + ".tmp")
    tmp.write_text(json.dumps(data), encoding="utf-8")
    tmp.replace(rec.path)
    return rec.path


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
