"""One simulated DSP core: a process with its own interpreter.

It receives jobs from the front over a socketpair, maps dmabufs by buffer
id, and runs module loads, inference and custom operators.  Every job is
answered with ``{"job": id, "status": code, ...}``; a job that raises is
answered with the most specific status its exception carries.
"""
from __future__ import annotations

import argparse
import mmap
import os
import signal
import socket
import struct
import sys
import traceback

from .. import memory
from ..protocol import Status
from ..transport import Endpoint, PeerClosed
from . import jobs

PRINTF_HDR = struct.Struct("<IIII")

# Fault injection (tests only, off by default): with DSPX_FAULT_INJECTION=1 in
# the device's environment, every core registers the built-in operator
# FAULT_CRASH_CMD ("fault.crash") whose handler kills its core process
# (os._exit(70)), so tests can crash a core through the ordinary RPC path.
FAULT_INJECTION_ENV = "DSPX_FAULT_INJECTION"
FAULT_CRASH_CMD = 0xFA01


class JobAborted(Exception):
    """Raised inside a running job when the front asks for an abort (SIGUSR1):
    the connection that submitted it is gone."""

    status = Status.ERR_CALL


class Core:
    def __init__(self, ep: Endpoint, index: int, threads: int):
        self.ep = ep
        self.index = index
        self.threads = threads
        self.bufs: dict[int, mmap.mmap] = {}
        self.modules: dict[int, object] = {}
        self.models: dict[int, object] = {}
        self._ops = None
        self._running_job = None  # id of the job being run, the only thing SIGUSR1 may abort

    def _on_abort(self, signum, frame) -> None:
        # The front sends SIGUSR1 only while it believes one of our jobs runs;
        # between jobs (or during internal messages) it is ignored.
        if self._running_job is not None:
            job, self._running_job = self._running_job, None
            raise JobAborted(f"job {job} aborted: the connection that submitted it closed")

    # ---------------------------------------------------------------- lazies
    @property
    def ops(self):
        if self._ops is None:
            from . import ops_host
            self._ops = ops_host.CoreOps(self)
            if os.environ.get(FAULT_INJECTION_ENV) == "1":
                self._ops.registry.register(FAULT_CRASH_CMD, _fault_crash, 0, "fault.crash")
        return self._ops

    def kernel_names(self) -> set[str]:
        """Register the firmware kernel library (once) and list its names."""
        if not hasattr(self, "_kernels"):
            from . import kernels
            kernels.configure_threads(self.threads or os.cpu_count() or 1)
            kernels.register_all()
            self._kernels = kernels.names()
        return self._kernels

    # ---------------------------------------------------------------- buffers
    def _take_fds(self, msg: dict, fds: list[int]) -> None:
        for buf_id, size in msg.get("new_bufs", ()):
            if not fds:
                raise RuntimeError(f"buffer {buf_id} arrived without its fd (fd limit?)")
            fd = fds.pop(0)
            try:
                self.bufs[buf_id] = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
            finally:
                os.close(fd)
        for fd in fds:
            os.close(fd)

    def drop(self, buf_ids) -> None:
        for b in buf_ids:
            mm = self.bufs.pop(b, None)
            if mm is not None:
                try:
                    mm.close()
                except BufferError:
                    pass  # a view is still alive; the mapping is freed with it

    def write_printf(self, target, text: str) -> int:
        """Append text to the connection's printf ring; return bytes written."""
        if not text or target is None:
            return 0
        buf_id, off, size = target
        mm = self.bufs[buf_id]
        data = text.encode("utf-8", "replace")
        cap = size - memory.PRINTF_HEADER
        magic, widx, rsize, _ = PRINTF_HDR.unpack_from(mm, off)
        if magic != memory.PRINTF_MAGIC or rsize != size or widx >= cap:
            widx = 0  # the host re-initialised (or scribbled on) the ring
        base = off + memory.PRINTF_HEADER
        chunk = data[-cap:] if len(data) > cap else data
        first = min(len(chunk), cap - widx)
        mm[base + widx: base + widx + first] = chunk[:first]
        rest = len(chunk) - first
        if rest:
            mm[base: base + rest] = chunk[first:]
        widx = (widx + len(chunk)) % cap
        PRINTF_HDR.pack_into(mm, off, memory.PRINTF_MAGIC, widx, size, 0)
        return len(data)

    # ---------------------------------------------------------------- jobs
    def handle(self, msg: dict) -> dict | None:
        kind = msg["kind"]
        if kind == "drop":
            self.drop(msg["bufs"])
            return None
        if kind == "ping":
            return {"pid": os.getpid()}
        if kind == "load":
            return self.load(msg)
        if kind == "unload":
            mod = self.modules.pop(msg["handle"], None)
            if mod is not None:
                mod.unload()
                if hasattr(self, "_kernels"):
                    # Prepacked weights are keyed by content: drop them with
                    # the module (others rebuild theirs on their next call).
                    from . import kernels
                    kernels.clear_caches()
            return {}
        if kind == "model_load":
            return self.model_load(msg)
        if kind == "model_unload":
            self.models.pop(msg["model_id"], None)
            return {}
        if kind == "infer":
            return self.infer(msg)
        if kind in ("ops_load", "ops_unload", "rpc", "ops_list"):
            return self.ops.handle(msg)
        if kind == "crash":  # fault injection for tests of the front's supervision
            os._exit(70)

        raise ValueError(f"unknown job kind {kind!r}")

    def load(self, msg: dict) -> dict:
        from . import loader

        mm = self.bufs[msg["buf"]]
        elf = mm[msg["offset"]:msg["offset"] + msg["size"]]
        mod = loader.load_module(elf, self.kernel_names(), ddr_free=msg["ddr_free"])
        self.modules[msg["handle"]] = mod
        self._warm_up(mod)
        return loader.describe(mod)

    @staticmethod
    def _warm_up(mod) -> None:
        """Run a module that calls the kernel library once on zeros, so the
        kernels' per-weight sessions are built at DYN_LOAD, not in the first
        INFER.  (A separate-weights module has no weights yet: its first
        INFER pays.)"""
        sig = mod.signature
        if sig is None or not sig.kernel_imports or sig.weights == "separate":
            return
        import numpy as np
        try:
            mod.run([np.zeros(t.shape, t.dtype) for t in sig.inputs])
        except Exception:
            pass  # a module that cannot run on zeros reports its error at INFER

    def model_load(self, msg: dict) -> dict:
        from . import loader

        mm = self.bufs[msg["buf"]]
        data = mm[msg["offset"]:msg["offset"] + msg["size"]]
        weights = loader.parse_weights(data)
        self.models[msg["model_id"]] = weights
        return {"num_constants": weights.num_constants, "nbytes": weights.nbytes}

    def infer(self, msg: dict) -> dict:
        from . import inference

        mod = self.modules[msg["handle"]]
        weights = self.models[msg["model_id"]] if msg["model_id"] else None
        try:
            out = inference.run(mod, weights, msg, self.bufs)
        except inference.InferFailed as e:
            return {"status": e.status, "error": str(e), **e.numbers}
        out["printf_size"] = self.write_printf(msg.get("printf"), out.pop("printf"))
        return out

    def serve(self) -> None:
        signal.signal(signal.SIGUSR1, self._on_abort)  # before hello: no job can come earlier
        jobs.send(self.ep, {"kind": "hello", "core": self.index, "pid": os.getpid(),
                            "ops": self.ops.op_list(lib=0)})
        while True:
            self._running_job = None
            try:
                msg, fds = jobs.recv(self.ep)
            except PeerClosed:
                return
            job_id = msg.get("job")
            try:
                self._take_fds(msg, fds)
                self._running_job = job_id
                try:
                    result = self.handle(msg)
                finally:
                    self._running_job = None
                if result is None:
                    continue
                result.setdefault("status", Status.SUCCESS)
            except Exception as e:  # every failure becomes a status, the core keeps serving
                status = getattr(e, "status", Status.ERR_GENERIC)
                result = {"status": int(status), "error": f"{type(e).__name__}: {e}" if status ==
                          Status.ERR_GENERIC else str(e)}
                for k in ("oom_requested", "oom_free", "oom_total", "error_line"):
                    if hasattr(e, k):
                        result[k] = getattr(e, k)
                if status == Status.ERR_GENERIC:
                    result["traceback"] = traceback.format_exc()
            if job_id is not None:
                result["job"] = job_id
                jobs.send(self.ep, result)


def _fault_crash(inp, out, tm) -> int:
    os._exit(70)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(prog="dspx-core")
    ap.add_argument("--fd", type=int, required=True)
    ap.add_argument("--index", type=int, default=0)
    ap.add_argument("--threads", type=int, default=0)
    a = ap.parse_args(argv)
    if a.threads:
        # Before numpy/TVM/torch load: each sizes its pool from these once.
        for var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "TVM_NUM_THREADS"):
            os.environ.setdefault(var, str(a.threads))
    sock = socket.socket(fileno=a.fd)
    core = Core(jobs.endpoint(sock), a.index, a.threads)
    try:
        core.serve()
    except KeyboardInterrupt:
        pass
    sys.exit(0)


if __name__ == "__main__":
    main()
