"""A timeline of host and device in Chrome trace-event JSON (Perfetto,
chrome://tracing): the recorder and the clock every process of dspx shares.

Each process that traces keeps complete ("X") events in memory and appends
them as JSON lines to its own part file, ``out.json.parts/<pid>.jsonl``,
after every top-level span (a host call, a datagram the front handled, a job
a core ran).  Who traces, and which spans it records, is each side's own
business: the host library (``host/tracing.py``: ``DSPX_TRACE``, merging the
parts into ``out.json`` at exit), the device front (``device/__main__.py``)
and each core (``device/core/worker.py``'s ``main``) start their recorder
from their entry point; the spans are written where the traced code is.

One clock: every event is stamped with ``time.perf_counter_ns()``, which on
Linux is ``clock_gettime(CLOCK_MONOTONIC)`` — one system-wide clock, the same
in every process on the machine (it is also the device's cycle clock), so
host, front, core and DMA tracks line up with no offsets to estimate.

Off costs nothing: every span's site tests ``trace.on`` first, so a process
that does not trace runs no tracing code, e.g. ::

    if trace.on:
        with trace.span("to core", "front", {"core": c.index}):
            self._start_job(c, job)
    else:
        self._start_job(c, job)

or, for a whole method, ``t0 = trace.clock() if trace.on else 0`` at its
start and ``if t0: trace.complete(name, t0, cat)`` in a ``finally``, or,
for a callback registered once, ``trace.timed(callback, name, cat)``.
This module imports nothing else of dspx.
"""
from __future__ import annotations

import atexit
import json
import os
import threading
import time
from pathlib import Path

ENV = "DSPX_TRACE"
clock = time.perf_counter_ns  # CLOCK_MONOTONIC on Linux: system-wide

on = False  # this process records: what every span's site tests (never set it, call start)
_rec: "Recorder | None" = None


def recorder() -> "Recorder | None":
    """The process's recorder while it traces, else None."""
    return _rec


def parts_dir(path) -> Path:
    return Path(str(path) + ".parts")


class Recorder:
    def __init__(self, path, process: str, sort_index: int = 0):
        self.path = Path(path)
        self.pid = os.getpid()
        parts = parts_dir(self.path)
        parts.mkdir(parents=True, exist_ok=True)
        self._file = open(parts / f"{self.pid}.jsonl", "a", encoding="utf-8")
        self._events: list = []
        self._named: set = set()
        self._lock = threading.Lock()
        self._meta("process_name", {"name": process})
        self._meta("process_sort_index", {"sort_index": sort_index})

    def _meta(self, what: str, args: dict, tid: int = 0) -> None:
        self._events.append({"name": what, "ph": "M", "pid": self.pid, "tid": tid, "args": args})

    def name_thread(self, name: str, tid: int | None = None) -> None:
        tid = threading.get_native_id() if tid is None else tid
        if tid not in self._named:
            self._named.add(tid)
            self._meta("thread_name", {"name": name}, tid)

    def name_process(self, pid: int, name: str, sort_index: int = 0) -> None:
        """Name a track group of its own (``pid``: not a process's, e.g. a modeled timeline)."""
        if ("pid", pid) not in self._named:
            self._named.add(("pid", pid))
            self._events.append({"name": "process_name", "ph": "M", "pid": pid, "tid": 0, "args": {"name": name}})
            self._events.append({"name": "process_sort_index", "ph": "M", "pid": pid, "tid": 0,
                                 "args": {"sort_index": sort_index}})

    def name_track(self, pid: int, tid: int, name: str) -> None:
        """Name track ``tid`` of the group ``pid`` (name_process)."""
        if (pid, tid) not in self._named:
            self._named.add((pid, tid))
            self._events.append({"name": "thread_name", "ph": "M", "pid": pid, "tid": tid, "args": {"name": name}})

    def complete(self, name: str, t0: int, t1: int, cat: str = "", args: dict | None = None,
                 tid: int | None = None, pid: int | None = None) -> None:
        """An event from t0 to t1 (perf_counter_ns) on the calling thread (or ``tid``, of ``pid``)."""
        ev = {"name": name, "cat": cat, "ph": "X", "ts": t0 / 1000, "dur": (t1 - t0) / 1000,
              "pid": self.pid if pid is None else pid, "tid": threading.get_native_id() if tid is None else tid}
        if args:
            ev["args"] = args
        self._events.append(ev)  # list.append is atomic: DMA threads record too

    def flush(self) -> None:
        with self._lock:
            events, self._events = self._events, []
            if events:
                self._file.write("".join(json.dumps(e) + "\n" for e in events))
                self._file.flush()


def start(path, process: str, sort_index: int = 0, thread: str = "main") -> Recorder:
    """Record this process (named ``process`` on the timeline, its calling
    thread ``thread``) into ``path``'s part file from now on."""
    global _rec, on
    if _rec is None:
        _rec = Recorder(path, process, sort_index)
        _rec.name_thread(thread)
        atexit.register(_rec.flush)
    on = True
    return _rec


def start_from_env(process: str, sort_index: int, thread: str) -> Recorder | None:
    """``start`` into the path ``DSPX_TRACE`` names, when it is set (how the
    device's front and cores learn to trace: from their environment)."""
    path = os.environ.get(ENV)
    return start(path, process, sort_index, thread) if path else None


def complete(name: str, t0: int, cat: str, args: dict | None = None, top: bool = False) -> None:
    """An event from ``t0`` to now on the calling thread; ``top``: a
    top-level span ended, so the part file gets what was recorded."""
    _rec.complete(name, t0, clock(), cat, args)
    if top:
        _rec.flush()


class span:
    """``with trace.span(name, cat):`` one event around the block (enter it
    only while ``trace.on``)."""

    __slots__ = ("name", "cat", "args", "top", "t0")

    def __init__(self, name: str, cat: str, args: dict | None = None, top: bool = False):
        self.name, self.cat, self.args, self.top = name, cat, args, top

    def __enter__(self) -> "span":
        self.t0 = clock()
        return self

    def __exit__(self, *exc) -> None:
        complete(self.name, self.t0, self.cat, self.args, self.top)


def timed(fn, name: str, cat: str, top: bool = False):
    """``fn`` itself while this process does not trace, else ``fn`` recording
    one event per call: for a callback chosen once, when it is registered
    (an epoll handler), after the process's entry point called ``start``."""
    if not on:
        return fn

    def call(*a, **k):
        with span(name, cat, top=top):
            return fn(*a, **k)
    return call
