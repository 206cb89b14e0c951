"""A timeline of host and device in Chrome trace-event JSON (Perfetto,
chrome://tracing) — the recorder shared by the host library and the device.

``DSPX_TRACE=out.json`` turns it on for a host program (``dspx run/generate
--trace`` set it for you) and for a device started with it in its environment
(the private device a host program starts inherits it).  Each process keeps
complete ("X") events in memory and appends them as JSON lines to its own
part file, ``out.json.parts/<pid>.jsonl``, after every top-level span (a host
call, a datagram the front handled, a job a core ran); the host program
merges every part into ``out.json`` when it ends (``finish``).

One clock: every event is stamped with ``time.perf_counter_ns()``, which on
Linux is ``clock_gettime(CLOCK_MONOTONIC)`` — one system-wide clock, the same
in every process on the machine (it is also the device's cycle clock), so
host, front, core and DMA tracks line up with no offsets to estimate.

Nothing here runs while tracing is off: ``install_*`` wraps the traced
methods in place only when the variable is set, so an untraced process calls
the original functions.
"""
from __future__ import annotations

import atexit
import functools
import json
import os
import threading
import time
from pathlib import Path

ENV = "DSPX_TRACE"
clock = time.perf_counter_ns  # CLOCK_MONOTONIC on Linux: system-wide

_rec: "Recorder | None" = None
_since = 0.0  # µs: the host keeps events from when it started tracing


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

    def complete(self, name: str, t0: int, t1: int, cat: str = "", args: dict | None = None,
                 tid: int | None = None) -> None:
        """An event from t0 to t1 (perf_counter_ns) on the calling thread (or ``tid``)."""
        ev = {"name": name, "cat": cat, "ph": "X", "ts": t0 / 1000, "dur": (t1 - t0) / 1000,
              "pid": self.pid, "tid": threading.get_native_id() if tid is None else tid}
        if args:
            ev["args"] = args
        self._events.append(ev)  # list.append is atomic: DMA threads record too

    def flush(self) -> None:
        with self._lock:
            events, self._events = self._events, []
            if events:
                self._file.write("".join(json.dumps(e) + "\n" for e in events))
                self._file.flush()


def _wrap(cls, attr: str, name, cat: str, top: bool = False, args=None) -> None:
    """Replace cls.attr with a version recording one event per call.
    ``name``: a string or f(*call args) -> str; ``args``: f(*call args) -> dict;
    ``top``: flush the part file after it (a top-level span)."""
    orig = cls.__dict__.get(attr)
    if orig is None or getattr(orig, "_dspx_traced", False):
        return

    @functools.wraps(orig)
    def traced(*a, **k):
        rec = _rec
        t0 = clock()
        try:
            return orig(*a, **k)
        finally:
            t1 = clock()
            try:
                label, extra = (name(*a, **k) if callable(name) else name), (args(*a, **k) if args else None)
            except Exception:  # noqa: BLE001 - an unexpected call shape must not change the call's outcome
                label, extra = attr, None
            rec.complete(label, t0, t1, cat, extra)
            if top:
                rec.flush()

    traced._dspx_traced = True
    setattr(cls, attr, traced)


def _start(path, process: str, sort_index: int, thread: str) -> "Recorder":
    global _rec
    if _rec is None:
        _rec = Recorder(path, process, sort_index)
        _rec.name_thread(thread)
        atexit.register(_rec.flush)
    return _rec


# ------------------------------------------------------------------ host

def start_host(path, process: str = "host") -> Recorder:
    """Trace this host program into ``path``: tell devices it starts (the
    environment), wrap the client's legs, and merge at exit what every
    process recorded from now on (parts of processes that are gone are
    removed first: they are an older run's)."""
    global _since
    path = Path(path).resolve()
    os.environ[ENV] = str(path)
    if _rec is None:
        _since = clock() / 1000
        parts = parts_dir(path)
        for f in parts.glob("*.jsonl") if parts.is_dir() else ():
            if not _alive(f.stem):
                f.unlink()
    rec = _start(path, process, 0, "host client")
    _install_host()
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
    path = os.environ.get(ENV)
    if path and _rec is None:
        start_host(path)


def _install_host() -> None:
    from . import memory
    from .host import client, session, tasks, vm

    C = client.Client
    _wrap(C, "infer", "infer", "host", top=True,
          args=lambda self, handle, inputs, *a, **k: {"module": handle, "input_bytes": sum(x.nbytes for x in inputs),
                                                      "kv_resident": bool(k.get("kv_resident"))})
    _wrap(C, "request", lambda self, msg, *a, **k: f"request {msg.NAME}", "host", top=True)
    _wrap(C, "load_module", "load module", "host", top=True)
    _wrap(C, "load_weights", "load weights", "host", top=True)
    _wrap(C, "_send_bytes", "send", "host")
    _wrap(C, "wait", "wait", "host", args=lambda self, seq, *a, **k: {"seq": seq})
    _wrap(tasks.Tasks, "submit", "submit task", "host", top=True)
    _wrap(tasks.Tasks, "wait", "wait task", "host", top=True)
    _wrap(session.Session, "start_bytes", "encode", "host")
    _wrap(session.IoCapacity, "plan_infer", "encode (layout)", "host")
    # copy-in: between the input buffer's begin and end of CPU access for writing
    begin, end = memory.DmaBuf.begin_cpu_access, memory.DmaBuf.end_cpu_access
    if not getattr(begin, "_dspx_traced", False):
        def traced_begin(self, direction):
            self._trace_t0 = clock()
            return begin(self, direction)

        def traced_end(self, direction):
            r = end(self, direction)
            t0 = getattr(self, "_trace_t0", None)
            if t0 is not None and _rec is not None:
                _rec.complete("copy-in" if direction == memory.SYNC_WRITE else "sync read", t0, clock(),
                              "host")
            return r
        traced_begin._dspx_traced = True
        memory.DmaBuf.begin_cpu_access, memory.DmaBuf.end_cpu_access = traced_begin, traced_end
    # copy-out: a VM call copies its outputs out of output_buf after the infer
    _install_llm()
    orig_getitem = vm.VirtualMachine.__getitem__
    if getattr(orig_getitem, "_dspx_traced", False):
        return

    def getitem(self, name):
        fn = orig_getitem(self, name)

        @functools.wraps(fn)
        def call(*a, **k):
            t0 = clock()
            try:
                return fn(*a, **k)
            finally:
                _rec.complete(f"vm[{name!r}] (infer + copy-out)", t0, clock(), "host")
                _rec.flush()
        return call
    getitem._dspx_traced = True
    vm.VirtualMachine.__getitem__ = getitem


def _install_llm() -> None:
    """DeviceLLM.prefill / decode as spans with the bytes the host moved."""
    try:
        from .host import llm
    except Exception:  # noqa: BLE001 - without the llm extra there is nothing to trace
        return

    def traced(orig, what):
        @functools.wraps(orig)
        def call(self, *a, **k):
            before = self.traffic.to_json()
            t0 = clock()
            try:
                return orig(self, *a, **k)
            finally:
                after = self.traffic.to_json()
                args = {key: after[key] - before[key] for key in after}
                if what == "prefill":
                    args.update(tokens=len(a[0]) if a else len(k.get("ids", ())), start=a[1] if len(a) > 1 else
                                k.get("start", 0))
                else:
                    args.update(pos=a[1] if len(a) > 1 else k.get("pos"),
                                resident=a[2] if len(a) > 2 else k.get("resident", True))
                _rec.complete(what, t0, clock(), "host", args)
                _rec.flush()
        call._dspx_traced = True
        return call

    for what in ("prefill", "decode"):
        orig = llm.DeviceLLM.__dict__.get(what)
        if orig is not None and not getattr(orig, "_dspx_traced", False):
            setattr(llm.DeviceLLM, what, traced(orig, what))


def merge(path, since: float = 0.0) -> dict:
    """Every part of the trace at ``path`` (events from ``since`` µs on) as
    one Chrome trace-event object."""
    events = []
    for f in sorted(parts_dir(path).glob("*.jsonl")):
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
    if _rec is None:
        return None
    _rec.flush()
    data = merge(_rec.path, _since)
    tmp = _rec.path.with_name(_rec.path.name + ".tmp")
    tmp.write_text(json.dumps(data), encoding="utf-8")
    tmp.replace(_rec.path)
    return _rec.path


# ------------------------------------------------------------------ device

def install_front() -> None:
    """The device front traces when DSPX_TRACE is set (one call from the service)."""
    path = os.environ.get(ENV)
    if not path:
        return
    from .device.front import connections, handlers, loop, scheduler, supervisor
    from .device.front.handlers import calls

    _start(path, "device front", 1, "front loop")
    _wrap(loop.Service, "_on_conn", "receive", "front", top=True)
    _wrap(supervisor.CoreSupervisor, "on_core", "core message", "front", top=True)
    _wrap(handlers.Handlers, "handle", lambda self, conn, req, *a, **k: f"validate {req.NAME}", "front")
    _wrap(calls.CallHandlers, "replay", "validate (plan hit)", "front")
    _wrap(scheduler.Scheduler, "submit", "queue", "front")
    _wrap(scheduler.Scheduler, "_start_job", "to core", "front", args=lambda self, c, job: {"core": c.index})
    _wrap(connections.Connections, "send", "respond", "front")


def install_core(index: int) -> None:
    """A core traces when DSPX_TRACE is set (one call from the core's main):
    jobs, entry calls and every call inside them (core/inference.py), custom
    op tiles (runtime.ping_pong) and every DMA transfer on its channel's track."""
    path = os.environ.get(ENV)
    if not path:
        return
    from .device.core import native, rpc, runtime, worker

    _start(path, f"device core {index}", 2 + index, f"core {index}")
    W = worker.CoreWorker
    _wrap(W, "call", lambda self, rec, *_: "call job", "core", top=True,
          args=lambda self, rec, *_: {"job": rec.job, "seq": rec.seq})
    _wrap(W, "handle", lambda self, rec: f"job {type(rec).__name__}", "core", top=True)
    _wrap(rpc.PreparedRpc, "run", lambda self, core: f"op 0x{self.spec.cmd:04x}", "core")
    D = runtime.DmaEngine
    copy = D._do_copy

    def do_copy(self, src, dst):
        t0 = clock()
        try:
            return copy(self, src, dst)
        finally:
            t = threading.current_thread().name  # dspx-dma<N>
            _rec.name_thread(f"dma channel {t.removeprefix('dspx-dma')}")
            _rec.complete("dma copy", t0, clock(), "dma", {"bytes": int(dst.nbytes)})
    D._do_copy = do_copy
    _wrap(D, "wait", lambda self, ch, *a, **k: f"dma wait ch{ch}", "dma")
    # Native (C) op libraries: the shim's DMA threads record their transfers
    # when DSPX_TRACE is set (sdk/dsp/runtime.c); read them after each task.
    run = native.Context.run

    def native_run(self, *a, **k):
        try:
            return run(self, *a, **k)
        finally:
            _native_dma(native.shim(), self.ptr)
    native.Context.run = native_run


def _native_dma(rt, ptr) -> None:
    import ctypes

    if not hasattr(rt, "_dspx_take_dma"):
        f = rt.dspx_rt_take_dma
        f.argtypes = [ctypes.c_void_p, ctypes.c_int32, ctypes.POINTER(ctypes.c_uint64), ctypes.c_size_t,
                      ctypes.POINTER(ctypes.c_int64)]
        f.restype = ctypes.c_size_t
        rt._dspx_take_dma, rt._dspx_buf = f, (ctypes.c_uint64 * (3 * 4096))()
    buf, tid = rt._dspx_buf, ctypes.c_int64()
    for ch in range(2):
        n = rt._dspx_take_dma(ptr, ch, buf, 4096, ctypes.byref(tid))
        if n:
            _rec.name_thread(f"dma channel {ch} (native)", tid.value)
        for i in range(n):
            _rec.complete("dma copy", buf[3 * i], buf[3 * i + 1], "dma", {"bytes": buf[3 * i + 2]}, tid.value)
