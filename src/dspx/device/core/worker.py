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
import sys
import time
import traceback

from ...abi import layout
from ...abi.ops import FAULT_CRASH_CMD, FAULT_INJECTION_ENV
from ...abi.protocol import Status
from ...transport import Endpoint, PeerClosed
from .. import jobs



# Module bytes are loaded once in a forked child before the core maps them
# (see Core._probe_load); DSPX_LOAD_PROBE=0 turns that off.
LOAD_PROBE_ENV = "DSPX_LOAD_PROBE"
LOAD_PROBE_TIMEOUT_S = 30.0


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
            from . import rpc
            self._ops = rpc.CoreOps(self)
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
        data = text.encode("utf-8", "replace")
        layout.ring_write(self.bufs[buf_id], off, size, data)
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
                if hasattr(self, "_kernels"):
                    # Prepacked weights are keyed by content: drop them with
                    # the module (others rebuild theirs on their next call),
                    # before unload() trims the heap.
                    from . import kernels
                    kernels.clear_caches()
                mod.unload()
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
        if os.environ.get(LOAD_PROBE_ENV, "1") != "0":
            self._probe_load(elf, msg)
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

    def _probe_load(self, elf: bytes, msg: dict) -> None:
        """Load untrusted module bytes once in a throwaway child first.

        The checks before mapping (ELF identity, imports, blobs) cannot see
        everything: a damaged module tree inside an otherwise well-formed ELF
        makes TVM's deserializer abort the whole process (found by the
        fuzzer: a truncated module spliced with older staging bytes).  A
        forked child takes that hit instead of the core; ordinary refusals
        (an exception) are left to the real load, which reports them
        precisely.  Costs one fork (copy-on-write) per load; set
        DSPX_LOAD_PROBE=0 in the device's environment to skip it."""
        from . import loader
        from .errors import LoadError

        loader._check_ident(memoryview(elf).cast("B"))  # not an ELF at all: refused here, no fork
        names = self.kernel_names()  # before the fork: the child must not do first-time set-up
        pid = os.fork()
        if pid == 0:  # the child: never returns, never talks to the front
            code = 0
            try:
                # A native exit() in the child (TVM's way of failing) would run
                # the parent's C++ static destructors, which wait for thread
                # pools that do not exist here: leave at once instead.
                import ctypes
                self._exit_hook = ctypes.CFUNCTYPE(None, ctypes.c_void_p)(lambda _: os._exit(3))
                ctypes.CDLL(None).__cxa_atexit(self._exit_hook, None, None)
            except (OSError, AttributeError):
                pass
            # A watchdog no Python code can block: SIGALRM's default action
            # ends the child even when it is stuck in native code.
            signal.signal(signal.SIGALRM, signal.SIG_DFL)
            signal.alarm(int(LOAD_PROBE_TIMEOUT_S))
            try:
                loader.load_module(elf, names, ddr_free=msg["ddr_free"]).unload()
            except BaseException:
                code = 1
            os._exit(code)
        deadline = time.monotonic() + LOAD_PROBE_TIMEOUT_S + 5
        done, status = 0, 0
        try:
            while True:
                done, status = os.waitpid(pid, os.WNOHANG)
                if done:
                    break
                if time.monotonic() > deadline:
                    raise LoadError(f"loading the module did not finish within {LOAD_PROBE_TIMEOUT_S:.0f} s")
                time.sleep(0.001)
        finally:
            if not done:
                os.kill(pid, signal.SIGKILL)
                os.waitpid(pid, 0)
        if os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGALRM:
            raise LoadError(f"loading the module hung (no result within {LOAD_PROBE_TIMEOUT_S:.0f} s); "
                            f"it is damaged or not a module for this device")
        if os.WIFSIGNALED(status):
            raise LoadError(f"the module crashed the loader ({signal.Signals(os.WTERMSIG(status)).name}); "
                            f"it is damaged or not a module for this device")
        if os.WEXITSTATUS(status) not in (0, 1):
            raise LoadError(f"the module aborted the loader (exit status {os.WEXITSTATUS(status)}); "
                            f"it is damaged or not a module for this device")

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
            except (Exception, SystemExit) as e:  # every failure becomes a status, the core keeps serving
                # (SystemExit too: an op library's top level or handler may raise it)
                status = getattr(e, "status", Status.ERR_GENERIC)
                if isinstance(e, SystemExit):  # user code tried to end the core
                    status = Status.ERR_LOAD if msg.get("kind") in ("load", "ops_load") else Status.ERR_CALL
                    e = RuntimeError(f"{msg.get('kind')} code raised SystemExit({e.code!r}); the core keeps running")
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


def _die_with_parent() -> None:
    """A core must not outlive its front (SIGKILLed device, say) while it
    finishes a long job: ask the kernel to kill it when the parent dies."""
    try:
        import ctypes
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, int(signal.SIGKILL), 0, 0, 0)  # PR_SET_PDEATHSIG
        if os.getppid() == 1:  # the parent died before we got here
            os._exit(0)
    except (OSError, AttributeError):
        pass


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
    _die_with_parent()
    sock = socket.socket(fileno=a.fd)
    core = Core(jobs.endpoint(sock), a.index, a.threads)
    try:
        core.serve()
    except KeyboardInterrupt:
        pass
    sys.exit(0)


if __name__ == "__main__":
    main()
