"""One simulated DSP core: a process with its own interpreter.

It receives typed records (``dspx.device.jobs``) from the front over a
socketpair, maps dmabufs by buffer id, and runs module loads, inference and
custom operators.  Every job ends with a ``Done`` to the front; a job that
raises ends with the most specific status its exception carries.  INFER and
RPC calls are answered by the core itself on the client's socket (the front
sent it once), right after the ``Done``.
"""
from __future__ import annotations

import argparse
import errno
import gc
import mmap
import os
import signal
import socket
import sys
import traceback

from ... import costmodel, trace
from ...abi import layout
from ...abi.ops import FAULT_INJECTION_ENV
from ...abi import protocol as P
from ...abi.protocol import Status
from ...transport import Endpoint, PeerClosed, peer_cred
from .. import jobs
from . import probe
from .. import sandbox
from .errors import RuntimeBroken
from .ops import clip
from .prepared import Prepared

# Module bytes are loaded once in a forked child before the core maps them
# (see CoreWorker._probe_load); DSPX_LOAD_PROBE=0 turns that off.
LOAD_PROBE_ENV = "DSPX_LOAD_PROBE"
LOAD_PROBE_TIMEOUT_S = 30
_DONTWAIT = int(socket.MSG_DONTWAIT)
EXIT_TORN_IMPORT = 75  # the core ended itself: an abort cut an import short (EX_TEMPFAIL)
EXIT_RUNTIME_BROKEN = jobs.EXIT_RUNTIME_BROKEN  # the core ended itself: user code broke its runtime


class JobAborted(Exception):
    """Raised inside a running job when the front asks it to stop: SIGUSR1,
    its connection closed; SIGUSR2, it ran past its time limit."""

    def __init__(self, message: str, status: int):
        super().__init__(message)
        self.status = status


class CoreWorker:
    def __init__(self, ep: Endpoint, index: int, threads: int, status: mmap.mmap | None = None,
                 cost: costmodel.Profile | None = None):
        self.ep = ep
        self.cost = cost  # the timing model's profile ($DSPX_COST_MODEL), None: off
        self.status = status if status is not None else mmap.mmap(-1, jobs.STATUS_SIZE)
        self.index = index
        self.switches = 0  # owner switches taken (jobs.Switched)
        self.threads = threads
        self.bufs: dict[int, mmap.mmap] = _Buffers()
        self.clients: dict[int, socket.socket] = {}  # cid -> the client's socket, for direct answers
        self.plans: dict[int, object] = {}  # plan id -> a prepared.Prepared (its spec until it is built)
        self.modules: dict[int, object] = {}
        self.models: dict[int, object] = {}
        self._ops = None
        self._running_job = None  # id of the job being run, the only thing an abort may interrupt
        self._aborted = None  # (job, status) of the last abort signalled
        self.planner = None  # planner.Planner once the sandbox is on
        self._broken_why = ""  # set when user code broke the runtime: the core ends after answering

    def _on_abort(self, signum, frame) -> None:
        # The front signals only while it believes one of our jobs runs;
        # between jobs (or during internal messages) it is ignored.
        if self._running_job is not None:
            job, self._running_job = self._running_job, None
            status = Status.ERR_TIMEOUT if signum == signal.SIGUSR2 else Status.ERR_CALL
            # remembered apart: raised inside TVM or a kernel, the exception reaches
            # the job wrapped (the FFI turns it into a CallError), and its status with it
            self._aborted = (job, status)
            torn = _importing(frame)
            if torn:
                # Stopped inside an import, the package stays half-initialized
                # (its submodules in sys.modules, torch's C state registered):
                # every later import of it fails.  End the core instead; the
                # front fails the job with the abort's reason, restarts the
                # core and reloads its modules.
                os.write(2, f"dspx-core {self.index}: job {job} was stopped while importing {torn}; "
                            f"ending this core so that it restarts clean\n".encode())
                os._exit(EXIT_TORN_IMPORT)
            if signum == signal.SIGUSR2:
                raise JobAborted(f"job {job} ran past its time limit and was stopped", status)
            raise JobAborted(f"job {job} aborted: the connection that submitted it closed", status)

    def _abort_status(self, job: int, status: int) -> int:
        """The abort's status for a call (INFER, RPC) that failed after the front stopped it."""
        if status != Status.SUCCESS and self._aborted is not None and self._aborted[0] == job:
            return self._aborted[1]
        return status

    # ---------------------------------------------------------------- lazies
    @property
    def ops(self):
        if self._ops is None:
            from . import rpc
            self._ops = rpc.CoreOps(self.index, os.environ.get(FAULT_INJECTION_ENV) == "1", cost=self.cost)
        return self._ops

    def kernel_names(self) -> set[str]:
        """Register the firmware kernel library (once) and list its names."""
        if not hasattr(self, "_kernels"):
            from . import kernels
            if self.planner is not None:
                kernels.configure(optimize=self.planner.optimize)
            kernels.configure_threads(self.threads or os.cpu_count() or 1)
            kernels.register_all()
            self._kernels = kernels.names()
        return self._kernels

    # ---------------------------------------------------------------- buffers and clients
    def _take_fds(self, rec: jobs.Job, fds: list[int]) -> None:
        if rec.drop_bufs:
            self.switches += 1  # before the new owner's code runs: the front now knows late answers from forged ones
            jobs.send(self.ep, jobs.Switched(self.switches))
            self.drop_buffers()
        if isinstance(rec, jobs.Call) and rec.new_conn:
            if not fds:
                raise RuntimeError("a client socket was announced without its fd")
            fd = fds.pop(0)
            cid = (rec.spec or _spec(self.plans[rec.plan])).cid
            old = self.clients.pop(cid, None)
            if old is not None:
                old.close()
            self.clients[cid] = socket.socket(fileno=fd)
        failed = None
        for buf_id, size in rec.new_bufs:
            fd = fds.pop(0) if fds else None
            try:
                if fd is None:
                    raise OSError("it arrived without its fd (fd limit?)")
                self.bufs[buf_id] = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
            except (OSError, ValueError) as e:  # the job fails with this status; later jobs naming it too
                self.bufs.failed[buf_id] = failed = BufferMapError(buf_id, size, e)
            finally:
                if fd is not None:
                    os.close(fd)
        for fd in fds:
            os.close(fd)
        if failed is not None:
            raise failed

    def _peer(self, rec: jobs.Call) -> int:
        """The pid of the client a call answers (SO_PEERCRED of its socket), 0 if
        unknown: what a traced host finds its calls' spans by (host/tracing.py)."""
        spec = rec.spec or _spec(self.plans.get(rec.plan))
        client = self.clients.get(spec.cid) if spec is not None else None
        try:
            return peer_cred(client)[0] if client is not None else 0
        except OSError:
            return 0

    def drop_buffers(self) -> None:
        """Close every client socket, unmap every buffer and drop every plan
        (they hold views of them): the next job is another connection's, and
        its code must find no page of this one's memory and no socket to
        answer anyone but its own client on.  A mapping whose view escaped (user code kept
        one) cannot be closed; its pages are replaced by an inaccessible
        anonymous mapping instead, so nothing can read them (a stale view
        faults its core)."""
        for s in self.clients.values():
            s.close()
        self.clients.clear()
        self.plans.clear()
        kept = []
        for mm in self.bufs.values():
            try:
                mm.close()
            except BufferError:
                kept.append(mm)
        self.bufs.clear()
        self.bufs.failed.clear()
        if kept:
            gc.collect()  # views in reference cycles (a plan's, a traceback's)
            for mm in kept:
                try:
                    mm.close()
                except BufferError:
                    _blank(mm)

    def forget(self, rec: jobs.Forget) -> None:
        for p in rec.plans:
            self.plans.pop(p, None)
        for cid in rec.conns:
            s = self.clients.pop(cid, None)
            if s is not None:
                s.close()
        if rec.conns:  # a closed connection's plans go too, also any the front no longer tracks
            gone = set(rec.conns)
            for p in [p for p, plan in self.plans.items() if _spec(plan).cid in gone]:
                del self.plans[p]
        for b in rec.bufs:
            self.bufs.failed.pop(b, None)
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
    def handle(self, rec):
        """Run one record; return the Done value (or None), raise on failure."""
        if isinstance(rec, jobs.Forget):
            self.forget(rec)
        elif isinstance(rec, jobs.LoadModule):
            return self.load(rec)
        elif isinstance(rec, jobs.UnloadModule):
            mod = self.modules.pop(rec.handle, None)
            if mod is not None:
                if hasattr(self, "_kernels"):
                    # Prepacked weights are keyed by content: drop them with
                    # the module (others rebuild theirs on their next call),
                    # before unload() trims the heap.
                    from . import kernels
                    kernels.clear_caches()
                mod.unload()
        elif isinstance(rec, jobs.LoadWeights):
            from . import loader
            data = self.bufs[rec.buf][:rec.size]
            weights = loader.parse_weights(data)
            self.models[rec.model_id] = weights
            return jobs.WeightsLoaded(weights.num_constants, weights.nbytes)
        elif isinstance(rec, jobs.UnloadWeights):
            self.models.pop(rec.model_id, None)
        elif isinstance(rec, jobs.LoadOps):
            h = self.ops.registry.load_library(rec.source, rec.filename, handle=rec.handle)
            return jobs.OpsLoaded(self.ops.op_list(h))
        elif isinstance(rec, jobs.UnloadOps):
            self.ops.registry.unload_library(rec.handle)
        else:
            raise ValueError(f"unknown record {type(rec).__name__}")
        return None

    def load(self, rec: jobs.LoadModule) -> jobs.Loaded:
        from . import loader

        elf = self.bufs[rec.buf][:rec.size]
        if os.environ.get(LOAD_PROBE_ENV, "1") != "0":
            self._probe_load(elf, rec.ddr_free)
        mod = loader.load_module(elf, self.kernel_names(), ddr_free=rec.ddr_free)
        self.modules[rec.handle] = mod
        self._warm_up(mod)
        io, sig = mod.io_meta, mod.signature
        return jobs.Loaded(mod.text_size, mod.data_size, mod.workspace_bytes,
                           None if io is None else (io.num_inputs, io.num_outputs, io.input_bytes,
                                                    io.output_bytes, io.flags),
                           None if sig is None else jobs.ModuleSig(
                               sig.weights == "separate",
                               [jobs.TensorSig(t.name, tuple(t.shape), t.dtype) for t in sig.inputs]))

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

    def _probe_load(self, elf: bytes, ddr_free: int) -> None:
        """Load untrusted module bytes once in a throwaway child first.

        The checks before mapping (ELF identity, imports, blobs) cannot see
        everything: a damaged module tree inside an otherwise well-formed ELF
        makes TVM's deserializer abort the whole process (found by the
        fuzzer: a truncated module spliced with older staging bytes).  A
        throwaway child (forked by the core's probe zygote) takes that hit instead of the core; ordinary refusals
        (an exception) are left to the real load, which reports them
        precisely.  Costs one fork (copy-on-write) per load; set
        DSPX_LOAD_PROBE=0 in the device's environment to skip it."""
        from . import loader
        from .errors import LoadError

        loader._check_ident(memoryview(elf).cast("B"))  # not an ELF at all: refused here, no fork
        self.kernel_names()  # the real load's set-up, not the probe's
        out = probe.run_module(elf, ddr_free, LOAD_PROBE_TIMEOUT_S)
        if out.hung:
            raise LoadError(f"loading the module hung (no result within {LOAD_PROBE_TIMEOUT_S:.0f} s); "
                            f"it is damaged or not a module for this device")
        if out.signal == signal.SIGSYS:
            raise LoadError("loading the module tried a system call the device does not allow (exec, sockets, "
                            "writing files, signalling others …: SIGSYS); refused before the core ran it")
        if out.signal:
            raise LoadError(f"the module crashed the loader ({out.signal_name}); "
                            f"it is damaged or not a module for this device")
        if out.exit_code not in (0, 1) or not out.returned:
            raise LoadError(f"the module ended the loading process (exit status {out.exit_code}) before the "
                            f"load returned; it is damaged or not a module for this device")

    # ---------------------------------------------------------------- calls (INFER, RPC)
    def _plan(self, rec: jobs.Call) -> Prepared:
        plan = self.plans.get(rec.plan)
        if plan is None or isinstance(plan, (jobs.InferSpec, jobs.RpcSpec)):
            spec = rec.spec or plan
            if spec is None:
                raise RuntimeError(f"plan {rec.plan} is unknown on core {self.index}")
            # Kept before it is built: a plan that cannot be built (a buffer this
            # core cannot map) fails each of its calls the same way.
            self.plans[rec.plan] = spec
            plan = self._prepare(spec)
            self.plans[rec.plan] = plan
        return plan

    def _prepare(self, spec) -> Prepared:
        if isinstance(spec, jobs.RpcSpec):
            from .rpc import PreparedRpc
            return PreparedRpc(spec, self.bufs)
        from .errors import HandleError
        from .inference import PreparedInfer
        mod = self.modules.get(spec.handle)
        weights = self.models.get(spec.model_id) if spec.model_id else None
        if mod is None or (spec.model_id and weights is None):
            raise HandleError(f"module {spec.handle} (model {spec.model_id}) is not loaded on core "
                              f"{self.index}: it could not be loaded again after the core restarted")
        return PreparedInfer(spec, mod, weights, self.bufs)

    def call(self, rec: jobs.Call, failed: BaseException | None = None) -> None:
        """Run a call, tell the front it ended, then answer the client.
        ``failed``: why it cannot run (its buffers could not be mapped); it
        is answered with that status all the same."""
        status, error, numbers, resp, spec = Status.SUCCESS, "", {}, None, rec.spec
        try:
            if failed is not None:
                if spec is not None:  # its later calls come without it: they fail the same way
                    self.plans.setdefault(rec.plan, spec)
                spec = _spec(self.plans.get(rec.plan))
                raise failed
            plan = self._plan(rec)
            spec = plan.spec
            outcome = plan.run(self)
            resp = plan.response(rec.seq, outcome, rec.queued_us)
            status, error, numbers = outcome.status, outcome.error, outcome.numbers
            if outcome.cost is not None:  # a cost model is on: the front holds it before the client can ask
                self._send_cost(rec, spec.cid, outcome.cost)
        except BaseException as e:  # KeyboardInterrupt, SystemExit …: a status for this caller, not the core's end
            e = _named_extra(e, "running a compiled module on the device", Status.ERR_CALL)
            status = _status_of(e)
            if isinstance(e, SystemExit):
                status, e = Status.ERR_CALL, RuntimeError(f"call raised SystemExit({e.code!r}); the core keeps running")
            error = f"{type(e).__name__}: {e}" if status == Status.ERR_GENERIC else str(e)
            if status == Status.ERR_GENERIC:
                error += "\n" + traceback.format_exc()
            error = clip(error)
            if isinstance(e, RuntimeBroken):
                self._broken(str(e))
        status = self._abort_status(rec.job, status)
        if resp is None:
            req_type = P.MsgType.RPC if isinstance(spec, jobs.RpcSpec) else (
                spec.resp_type & ~P.RESPONSE_BIT if spec is not None else P.MsgType.INFER)
            resp = P.failure_response(req_type, rec.seq, status, **numbers).encode()
        client = self.clients.get(spec.cid) if spec is not None else None
        # The front learns of the end before the client can act on the answer:
        # a success through the status page, a failure (with its text) by a Done.
        wake = False
        if status == Status.SUCCESS and client is not None:
            jobs.STATUS_WORD.pack_into(self.status, jobs.STATUS_DONE, rec.job)
            wake = jobs.STATUS_WORD.unpack_from(self.status, jobs.STATUS_WAKE)[0] != 0
        else:
            self.reply(jobs.Done(rec.job, int(status), error, rec.seq, numbers,
                                 response=None if client is not None else resp))
        if client is not None:
            try:
                client.send(resp, _DONTWAIT)
            except BlockingIOError:  # the client is not reading: the front keeps it in its outbox
                jobs.send(self.ep, jobs.Deliver(spec.cid, resp))
            except OSError:
                pass  # the client is gone
        if wake:  # the front has work queued behind this call
            jobs.send(self.ep, jobs.Done(rec.job, int(status), seq=rec.seq))

    def _send_cost(self, rec: jobs.Call, cid: int, cost: dict) -> None:
        """Tell the front the call's cost record; one that does not make a
        valid record is left out (and said), the call is answered all the same."""
        try:
            jobs.send(self.ep, jobs.Cost.of(rec.job, cid, rec.seq, cost))
        except (jobs.BadRecord, KeyError, TypeError, ValueError) as e:
            os.write(2, f"dspx-core {self.index}: the cost record of job {rec.job} is not sent: "
                        f"{type(e).__name__}: {e}\n".encode())

    def _contain(self) -> None:
        """Drop what no job needs before the first one: the SDK shim is built
        and loaded now, while exec is still allowed; every capability goes
        and the core becomes non-dumpable (sandbox.drop_privileges); the
        planner (the kernel library's one use of files) and the probe zygote
        (the only process that forks for this core) are forked; then Landlock
        (reads beneath the interpreter's and libraries' trees, no writes, no
        signals outside) and the core's seccomp filter."""
        if not sandbox.enabled():
            return
        from . import native, planner
        from ...log import setup  # the host's logging setup, level from $DSPX_LOG_LEVEL
        log = setup(prefix="dspx-core")
        native.shim()
        in_force = []
        try:
            sandbox.drop_privileges()
            in_force.append("capabilities dropped, non-dumpable")
        except OSError as e:
            log.warning("capabilities not dropped (%s)", e)
        self.planner = planner.Planner()
        status = self.status
        readable = _read_paths()  # before any import runs under the filters: sys.path as it is now

        def confine_zygote():
            status.close()  # the front's status page is no business of a probe
            sys.dont_write_bytecode = True
            sandbox.landlock(readable)
            sandbox.install_zygote()
        probe.zygote = probe.Zygote(confine_zygote)
        sys.dont_write_bytecode = True  # imports after this read .pyc files, never write them
        try:
            abi = sandbox.landlock(readable)
            in_force.append(f"Landlock ABI {abi} (reads beneath {len(readable)} trees, no writes, "
                            f"no signals outside)" if abi else "no Landlock (the kernel has none)")
        except OSError as e:
            log.warning("Landlock not applied (%s)", e)
        try:
            sandbox.install_core(log_only=sandbox.log_only())
            in_force.append("seccomp allow-list" + (" (log only)" if sandbox.log_only() else ""))
        except OSError as e:
            log.warning("seccomp filter not installed (%s); running without it", e)
        if self.index == 0:
            # One line per device start (core 0's, at every log level), saying what holds its cores.
            in_force.insert(1, f"uid {os.getuid()} as the front (no separate uid or user namespace: "
                               f"docs/containment.md)")
            os.write(2, f"dspx-core 0: containment of cores and probes: {'; '.join(in_force)}\n".encode())

    def serve(self) -> None:
        for sig in (signal.SIGUSR1, signal.SIGUSR2):
            signal.signal(sig, self._on_abort)  # before hello: no job can come earlier
        jobs.send(self.ep, jobs.Hello(self.index, os.getpid(), self.ops.op_list(lib=0)))
        self._contain()
        while True:
            self._running_job = None
            try:
                rec, fds = jobs.recv(self.ep, jobs.FRONT_TO_CORE)
            except PeerClosed:
                return
            failed = None
            try:
                self._take_fds(rec, fds)
            except Exception as e:  # noqa: BLE001 - the job fails with a status, the core keeps serving
                failed = e
            if isinstance(rec, jobs.Call):  # answered like any call: one answer, to the client
                self._running_job = rec.job
                try:
                    if trace.on:
                        args = {"job": rec.job, "seq": rec.seq, "peer": self._peer(rec)}
                        with trace.span("call job", "core", args, top=True):
                            self.call(rec, failed)
                    else:
                        self.call(rec, failed)
                except JobAborted:
                    pass  # the abort landed after the answer went out
                finally:
                    self._running_job = None
                self._restart_if_broken()
                continue
            if failed is not None:
                if rec.job:
                    status = _status_of(failed)
                    self.reply(jobs.Done(rec.job, int(status), clip(f"{type(failed).__name__}: {failed}"
                                                                    if status == Status.ERR_GENERIC else str(failed))))
                continue
            done = jobs.Done(rec.job)
            try:
                self._running_job = rec.job
                try:
                    if trace.on:
                        with trace.span(f"job {type(rec).__name__}", "core", top=True):
                            done.value = self.handle(rec)
                    else:
                        done.value = self.handle(rec)
                finally:
                    self._running_job = None
            except BaseException as e:  # every failure becomes a status, the core keeps serving
                # (SystemExit and KeyboardInterrupt too: an op library's code may raise them)
                if isinstance(rec, (jobs.LoadModule, jobs.LoadWeights)):
                    e = _named_extra(e, "loading a compiled module on the device", Status.ERR_LOAD)
                else:
                    e = _named_extra(e, f"{type(rec).__name__} on the device",
                                     Status.ERR_LOAD if isinstance(rec, jobs.LoadOps) else Status.ERR_CALL)
                status = _status_of(e)
                if isinstance(e, SystemExit):  # user code tried to end the core
                    status = Status.ERR_LOAD if isinstance(rec, (jobs.LoadModule, jobs.LoadOps)) else Status.ERR_CALL
                    e = RuntimeError(f"{type(rec).__name__} code raised SystemExit({e.code!r}); the core keeps running")
                done.status = int(status)  # a load stopped at its limit stays ERR_LOAD, naming the limit
                done.error = f"{type(e).__name__}: {e}" if status == Status.ERR_GENERIC else str(e)
                if status == Status.ERR_GENERIC:
                    done.error += "\n" + traceback.format_exc()
                done.error = clip(done.error)
                done.numbers = {k: v for k in ("oom_requested", "oom_free", "oom_total", "error_line")
                                if isinstance(v := getattr(e, k, None), int)}
            broken = self._ops.rt.broken() if self._ops is not None else ""  # a library's init, a constructor
            if broken:
                done.status, done.error = int(Status.ERR_CALL), f"{type(rec).__name__} broke the core's runtime: " \
                                                                 f"{broken}; the core restarts"
                done.value = None  # a failure carries no result (the front refuses a Done that does)
                self._broken(done.error)
            if rec.job:
                self.reply(done)
            self._restart_if_broken()

    def _broken(self, why: str) -> None:
        """User code broke the runtime: the front learns it (status page)
        before the job's end, so it gives this core nothing more."""
        self._broken_why = why
        jobs.STATUS_WORD.pack_into(self.status, jobs.STATUS_RESTART, 1)

    def _restart_if_broken(self) -> None:
        """After the job's answer: end the core so that it restarts clean."""
        if self._broken_why:
            os.write(2, f"dspx-core {self.index}: {self._broken_why}; exiting with status "
                        f"{EXIT_RUNTIME_BROKEN} to restart\n".encode())
            os._exit(EXIT_RUNTIME_BROKEN)

    def reply(self, done: jobs.Done) -> None:
        """Send a Done; one too large for the channel becomes a failure that fits."""
        try:
            jobs.send(self.ep, done)
        except jobs.BadRecord as e:  # too large, or a figure out of range
            jobs.send(self.ep, jobs.Done(done.job, int(Status.ERR_GENERIC),
                                         clip(f"the result could not be reported: {e}"), done.seq))


_STATUSES = frozenset(int(s) for s in Status)


def _named_extra(e: BaseException, what: str, status: int) -> BaseException:
    """An optional dependency this core lacks (tvm, onnxruntime …) as one line
    naming the extra to install, with ``status``, instead of a traceback;
    any other exception as it is."""
    from ...errors import missing_extra

    extra = missing_extra(e, what) if isinstance(e, ImportError) else None
    if extra is None:
        return e
    extra.status = status
    return extra


def _status_of(e: BaseException) -> int:
    """The status an exception carries, if it is one the protocol has (user
    code may raise anything with a ``status``); else ERR_GENERIC."""
    status = getattr(e, "status", Status.ERR_GENERIC)
    return status if isinstance(status, int) and status in _STATUSES else Status.ERR_GENERIC


def _read_paths() -> list[str]:
    """The trees a core may read files beneath (Landlock): the interpreter,
    its libraries and sys.path (lazy imports of TVM, torch, onnxruntime),
    the system's libraries and configuration (dlopen, ld.so.cache), /proc,
    /sys and /dev (its own /proc/self, CPU topology for thread pools,
    /dev/urandom), and the SDK's cache (kernel libraries built at start)."""
    from ... import cache
    paths = ["/usr", "/lib", "/lib64", "/etc", "/proc", "/sys", "/dev", sys.prefix, sys.base_prefix,
             sys.exec_prefix, str(cache.area("sdk"))]
    paths += [os.path.realpath(p or ".") for p in sys.path]
    return sorted(set(paths))


def _spec(plan):
    """The spec of a plan (one not built yet is its spec)."""
    return getattr(plan, "spec", plan)


class BufferMapError(OSError):
    """A buffer the front sent that this core cannot map (MAP_SHARED,
    read-write): every job naming it is answered with this, never left
    unanswered."""

    def __init__(self, buf_id: int, size: int, cause: BaseException):
        super().__init__(f"core cannot map buffer {buf_id} ({size} bytes) shared read-write: {cause}")
        self.status = Status.ERR_NOMEM if getattr(cause, "errno", None) == errno.ENOMEM else Status.ERR_INVALID


class _Buffers(dict):
    """The mapped buffers by id; one whose mapping failed raises why."""

    def __init__(self):
        super().__init__()
        self.failed: dict[int, BufferMapError] = {}

    def __missing__(self, buf_id):
        if buf_id in self.failed:
            raise self.failed[buf_id]
        raise KeyError(buf_id)


def _importing(frame) -> str:
    """The outermost module an import statement on this stack is loading, or ""."""
    name = ""
    while frame is not None:
        if frame.f_code.co_name == "_find_and_load" and frame.f_code.co_filename == "<frozen importlib._bootstrap>":
            name = str(frame.f_locals.get("name", "?"))
        frame = frame.f_back
    return name


def _blank(mm: mmap.mmap) -> None:
    """Replace a mapping's pages with PROT_NONE anonymous memory in place
    (MAP_FIXED): the mmap object lives on (a view of it escaped), its data
    is gone from this process."""
    import ctypes
    probe_view = ctypes.c_char.from_buffer(mm)
    addr = ctypes.addressof(probe_view)
    del probe_view
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long)
    prot_none, map_private, map_anonymous, map_fixed = 0, 0x02, 0x20, 0x10
    if libc.mmap(addr, len(mm), prot_none, map_private | map_anonymous | map_fixed, -1, 0) != addr:
        os._exit(71)  # cannot take the pages back: end the core rather than serve the next owner with them


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


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(prog="dspx-core")
    ap.add_argument("--fd", type=int, required=True)
    ap.add_argument("--status-fd", type=int, default=None)
    ap.add_argument("--index", type=int, default=0)
    ap.add_argument("--threads", type=int, default=0)
    a = ap.parse_args(argv)
    if a.threads:
        # Before numpy/TVM/torch load: each sizes its pool from these once.
        for var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "TVM_NUM_THREADS"):
            os.environ.setdefault(var, str(a.threads))
    _die_with_parent()
    # onnxruntime's telemetry keeps a database under ~/.cache/Microsoft (and
    # would send it): a core creates no files and opens no sockets.
    os.environ["ORT_DISABLE_TELEMETRY"] = "1"
    trace.start_from_env(f"device core {a.index}", 2 + a.index, f"core {a.index}")  # DSPX_TRACE (docs/profiling.md)
    # Ctrl-C reaches the whole process group: the front decides when cores stop.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    sock = socket.socket(fileno=a.fd)
    status = None
    if a.status_fd is not None:
        status = mmap.mmap(a.status_fd, jobs.STATUS_SIZE)
        os.close(a.status_fd)
    try:
        # Read once, now, before the sandbox: a name (a file of the package),
        # a path, or the profile's JSON text (what the front passes: costmodel.resolve_env).
        cost = costmodel.from_env()
    except costmodel.ProfileError as e:
        raise SystemExit(f"dspx-core {a.index}: {e}") from None
    if cost is not None:  # before anything loads the SDK shim: the core and its probe zygote load the cost build
        from . import native
        try:
            native.configure_cost(cost.values(), cost.name)
        except ValueError as e:  # a profile without a vector DSP's parameters: C ops run on the host clock
            os.write(2, f"dspx-core {a.index}: native ops not counted: {e}\n".encode())
    core = CoreWorker(jobs.endpoint(sock), a.index, a.threads, status, cost=cost)
    core.serve()
    sys.exit(0)


if __name__ == "__main__":
    main()
