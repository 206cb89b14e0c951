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
