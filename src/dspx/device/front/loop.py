"""The front's event loop: receive → validate → dispatch → respond.

One epoll loop owns the listening socket, every connection and the channels
to the cores.  It decodes each message, hands it to the handlers
(``handlers.py``) and carries out the actions they return: answer, queue a
job, tell the cores.  It supervises the cores: schedules jobs by priority
and core choice, restarts a core that dies, aborts a job whose connection
closed or whose time ran out.  Nothing it does blocks: every send to a
client or a core is non-blocking with a queue behind it.
"""
from __future__ import annotations

import errno
import heapq
import itertools
import os
import resource
import select
import signal
import socket
import subprocess
import time

import psutil

from ... import memory, trace
from ...abi import protocol as P
from ...abi.protocol import Status as S
from ...transport import Endpoint, PeerClosed, Timeout, listen, peer_cred
from .. import jobs
from ..core import sandbox
from .cores import CoreProc
from .spawner import Spawner, SpawnerGone
from .handlers import Cores, Forget, FrontJob, Handlers, Notify, Respond, Submit, _NoRoom, _To, failure
from ...abi.protocol import DEFAULT_JOB_TIMEOUT_S
from .state import MAX_PENDING, MAX_PENDING_PER_CONN, Conn, DeviceState, Limits, Reject

# Responses the peer's socket could not take yet (it is not reading).  While a
# connection has any, the front stops reading its requests, so the queue is
# bounded by its jobs in flight; this is a safety net above that.
MAX_OUTBOX = MAX_PENDING_PER_CONN + 64
# A job whose connection closed, or whose time ran out, is asked to stop
# (SIGUSR1 / SIGUSR2, raised in the job's Python code); if it has not ended
# after this grace its core is killed and restarted, so the memory it holds
# is freed within a second whatever the job does.
ABORT_GRACE_S = 0.3
# A connection refused at the limits is answered (ERR_BUSY, and GET_ERROR's
# text says which limit) for this long, then closed; at most this many wait.
REFUSED_LINGER_S = 2.0
MAX_REFUSED = 16
_STATUSES = frozenset(int(s) for s in S)
PLANNED = frozenset((P.MsgType.INFER, P.MsgType.INFER_LARGE, P.MsgType.RPC))
_EPOLLIN, _EPOLLOUT = int(select.EPOLLIN), int(select.EPOLLOUT)


def raise_fd_limit() -> int:
    """Raise the soft RLIMIT_NOFILE to the hard limit (cores inherit it); return it."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = hard if hard != resource.RLIM_INFINITY else max(soft, 1 << 20)
    if soft != resource.RLIM_INFINITY and soft < want:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))
            soft = want
        except (ValueError, OSError):
            pass
    return soft if soft != resource.RLIM_INFINITY else 1 << 20


class Service:
    def __init__(self, socket_path: str, carveout_size: int = memory.CARVEOUT_SIZE,
                 ddr_pool_size: int = memory.DDR_POOL_SIZE, cores: int = 1, threads: int = 0,
                 parent_pid: int | None = None, log=None, job_timeout_s: float = DEFAULT_JOB_TIMEOUT_S,
                 conn_bytes: int | None = None):
        self.path = socket_path
        self.st = DeviceState(carveout_size, ddr_pool_size)
        self.st.limits = Limits.for_device(raise_fd_limit(), carveout_size, conn_bytes, ddr_pool_size)
        threads = threads or max(1, (os.cpu_count() or 1) // max(1, cores))
        self.cores = [CoreProc(i, threads) for i in range(cores)]
        self.handlers = Handlers(self.st, Cores(cores, lambda i: self.cores[i].alive_generation, self._rss),
                                 job_timeout_s)
        self.pending: list = []  # heap of (-priority, order, FrontJob)
        self._order = itertools.count()
        self._job_ids = itertools.count(1)
        self.parent_pid = parent_pid
        self.epoll = select.epoll()
        self._watch: dict[int, tuple] = {}  # fd -> (callback, arg)
        self.running = False
        self.stopping = False  # set once a signal or shutdown began: cores that end now are not restarted
        self.log = log or (lambda *a: None)
        self._accept_paused = 0.0  # when accept() ran out of fds: retry after this time
        self._refused: dict[int, list] = {}  # fd -> [socket, close-by time, text, seq of the last refusal]
        self._spare_fd = -1  # given up when accept() runs out of fds, to refuse the newcomer
        self.spawner: Spawner | None = None  # starts the cores (the front itself may not exec)

    # ================================================================ lifecycle
    def serve_forever(self) -> None:
        self.lsock = None
        self.running = True
        # Nothing else of this uid (a core) may open /proc/<front>/fd or /mem,
        # ptrace it or read its memory; the spawner inherits it.
        sandbox.set_non_dumpable()
        self._start_spawner()  # before any client, any socket but its own, and the filter
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, self._on_signal)
        lsock = listen(self.path)
        self.lsock = lsock
        lsock.setblocking(False)
        self._register(self.lsock.fileno(), self._accept, None)
        self._spare_fd = os.open(os.devnull, os.O_RDONLY | os.O_CLOEXEC)
        for c in self.cores:
            self._start_core(c)
        if sandbox.enabled():
            # From here on: no exec, no new sockets (sandbox.front_program).
            sandbox.install_front(self.lsock.fileno(), sandbox.log_only())
        lim = self.st.limits
        self.log(f"listening on {self.path} with {len(self.cores)} core(s); window {self.st.window.size >> 20} MiB "
                 f"({lim.conn_bytes >> 20} MiB per connection, {lim.peer_bytes >> 20} MiB per process), DDR pool "
                 f"{self.st.ddr.size >> 20} MiB ({lim.peer_ddr >> 20} MiB per process); limits: {lim.conns} "
                 f"connections ({lim.conns_per_peer} per process), the last {lim.conns_reserved} kept for new processes, "
                 f"{lim.bufs_total} buffers "
                 f"({lim.bufs_per_conn} per connection), fd limit {lim.nofile}")
        next_check = 0.0
        try:
            while self.running:
                for fd, ev in self.epoll.poll(0.05):
                    w = self._watch.get(fd)
                    if w is not None:
                        try:
                            w[0](w[1], ev)
                        except Exception as e:  # a bug in one callback must not take the device down
                            self.log(f"internal error (device keeps serving): {e!r}")
                now = time.monotonic()
                if now >= next_check:  # off the per-message path
                    try:
                        self._housekeeping(now)
                    except Exception as e:
                        self.log(f"internal error in housekeeping (device keeps serving): {e!r}")
                    next_check = now + 0.05
        finally:
            self.shutdown()

    def _register(self, fd: int, callback, arg, events: int = _EPOLLIN) -> None:
        self._watch[fd] = (callback, arg)
        self.epoll.register(fd, events)

    def _unregister(self, fd: int) -> None:
        if self._watch.pop(fd, None) is not None:
            try:
                self.epoll.unregister(fd)
            except (OSError, ValueError):
                pass

    def _modify(self, fd: int, events: int) -> None:
        try:
            self.epoll.modify(fd, events)
        except (OSError, ValueError):
            pass

    def _on_signal(self, *_):
        self.running = False
        self.stopping = True

    def shutdown(self) -> None:
        self.running = False
        self.stopping = True
        for c in self.cores:
            c.stop()
        if self.spawner is not None:
            self.spawner.stop()
        for s, *_ in self._refused.values():
            s.close()
        for conn in list(self.st.conns.values()):
            self._close_conn(conn, notify_cores=False)
        if self.lsock is None:  # never bound: the path is not ours to remove
            return
        self.lsock.close()
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass

    def _housekeeping(self, now: float) -> None:
        if self.parent_pid and os.getppid() != self.parent_pid:
            self.log("parent process is gone; stopping")
            self.running = False
        expired = [e for e in self.pending if e[2].deadline and e[2].deadline < now]
        if expired:
            self.pending = [e for e in self.pending if e not in expired]
            heapq.heapify(self.pending)
            for _, _, job in expired:
                self._fail(job, S.ERR_TIMEOUT, "task timed out before a core could start it")
        if self.spawner is not None and (why := self.spawner.check()):
            self.log(f"{why}; the device serves on, but a core that dies now cannot be restarted")
        for c in self.cores:
            if c.ep is None:  # a restart that failed (e.g. out of fds): try again
                if now >= c.retry_at:
                    self._restart(c, now)
            elif c.proc and c.proc.poll() is not None:  # died, ready or still starting
                self._core_died(c)
            else:
                self._check_running(c, now)
        for fd, (_, until, *_) in list(self._refused.items()):
            if now >= until:
                self._drop_refused(fd)
        if self._accept_paused and now >= self._accept_paused:
            self._accept_paused = 0.0
            self._register(self.lsock.fileno(), self._accept, None)

    # ================================================================ cores
    def _rss(self) -> int:
        return sum(psutil.Process(c.proc.pid).memory_info().rss for c in self.cores
                   if c.proc and c.proc.poll() is None) + psutil.Process().memory_info().rss

    def _start_spawner(self) -> None:
        if self.spawner is None:
            self.spawner = Spawner({c.index: c.command() for c in self.cores})

    def _start_core(self, c: CoreProc, wait: bool = True) -> None:
        self._start_spawner()  # started by serve_forever; here for a Service driven in-process
        c.start(self.spawner)
        self._register(c.ep.fileno(), trace.timed(self._on_core, "core message", "front", top=True), c)
        if wait:
            # At start-up, block until the core says hello so the device never
            # answers a job before a core exists.  A restart does not block the
            # loop: the hello arrives through _on_core, jobs queue meanwhile.
            rec, _ = jobs.recv(c.ep, jobs.CORE_TO_FRONT, timeout=60)
            self._core_hello(c, rec)

    def _core_hello(self, c: CoreProc, rec) -> None:
        """A core's first record: a Hello from that very process (BadRecord if not)."""
        if not isinstance(rec, jobs.Hello):
            raise jobs.BadRecord(f"a {type(rec).__name__} before its Hello")
        if rec.core != c.index or rec.pid != c.proc.pid:
            raise jobs.BadRecord(f"Hello of core {rec.core}, pid {rec.pid}; this is core {c.index}, pid {c.proc.pid}")
        c.ready = True
        c.start_failures = 0
        for cmd, name, lat in rec.ops:  # the firmware's built-in operators
            self.st.op_table.setdefault(cmd, (name, lat, 0))
        self._apply(None, self.handlers.replay_ops(c.index))

    def _core_died(self, c: CoreProc, invalid: str = "") -> None:
        """Restart a core that ended (``invalid``: the front killed it for that record)."""
        if self.stopping:  # shutting down (Ctrl-C reaches the whole process group): no restart, no news
            return
        code = c.proc.poll() if c.proc else None
        why = ": user code broke its runtime" if code == jobs.EXIT_RUNTIME_BROKEN else ""
        self.log(f"core {c.index} died (exit {code}{why}); restarting")
        started = c.ready
        self._unregister(c.ep.fileno())
        c.close_channel()
        job, timed_out = c.running, c.timed_out
        c.running = None
        if job is not None:
            if timed_out:
                self._fail(job, S.ERR_TIMEOUT, f"job ran past its time limit and did not stop; core {c.index} "
                                               f"was restarted")
            elif invalid:
                self._fail(job, S.ERR_CALL, f"core {c.index} sent an invalid record while running this job "
                                            f"({invalid}); it was restarted")
            else:
                self._fail(job, S.ERR_CALL, f"core {c.index} crashed while running this job (exit status "
                                            f"{code}); it was restarted")
        # Modules and weights on that core are loaded again from the front's
        # copies before anything else runs there, under the same handles; one
        # without a copy dies with the core (later use is ERR_HANDLE).
        touched, reloads = set(), []
        lost = [r for r in self.st.modules.values() if r.core == c.index and r.kind == "module"]
        lost += [r for r in self.st.models.values() if r.core == c.index]
        for rec in lost:
            touched.add(rec.cid)
            if rec.image is not None:
                reloads += self.handlers.reload(rec)
            elif hasattr(rec, "handle"):
                self.st.drop_module(rec)
            else:
                self.st.drop_model(rec)
        for cid in touched:
            conn = self.st.conns.get(cid)
            if conn is not None:
                self._apply(conn, self.handlers.invalidate(conn))
        self._apply(None, reloads)
        if started:
            self._restart(c, time.monotonic())
        else:  # it died before it said hello: do not restart it in a loop
            c.start_failures += 1
            c.retry_at = time.monotonic() + min(5.0, 0.1 * 2 ** c.start_failures)
        self._schedule()

    def _restart(self, c: CoreProc, now: float) -> None:
        """Start the core again; if it cannot start, retry later with a growing backoff."""
        try:
            self._start_core(c, wait=False)
        except SpawnerGone as e:
            c.ep, c.ready = None, False
            c.retry_at = now + 0.05  # checked again with housekeeping: its jobs keep failing at once
            if not c.lost:
                c.lost = True
                self.log(f"core {c.index} cannot be restarted: {e}; its jobs fail with ERR_CALL")
            self._fail_unrunnable()
        except OSError as e:  # e.g. out of fds
            c.ep, c.ready = None, False
            c.start_failures += 1
            delay = min(5.0, 0.1 * 2 ** c.start_failures)
            c.retry_at = now + delay
            self.log(f"core {c.index} could not be restarted ({e}); retrying in {delay:.1f} s")

    def _fail_unrunnable(self) -> None:
        """Fail the queued jobs no core can run any more (their cores are lost with the spawner)."""
        live = [c.index for c in self.cores if not c.lost]
        dead = [e for e in self.pending if not (live and (e[2].core == P.CORE_ANY or e[2].core in live))]
        if dead:
            self.pending = [e for e in self.pending if e not in dead]
            heapq.heapify(self.pending)
            for _, _, job in dead:
                self._fail(job, S.ERR_CALL, "no core can run this job: its core died and the core spawner "
                                            "is gone, so it cannot be restarted")

    def _on_core(self, c: CoreProc, events: int) -> None:
        if events & _EPOLLOUT and c.flush():
            self._modify(c.ep.fileno(), _EPOLLIN)
        if events & ~_EPOLLOUT:
            self._drain_core(c)

    def _drain_core(self, c: CoreProc) -> None:
        """Take every record the core has sent.  A core runs client code, so
        each record is checked like a client's message: one that does not
        decode, or names a job or a connection that is not this core's,
        restarts the core (its running job fails with ERR_CALL)."""
        while c.ep is not None:
            try:
                rec, fds = jobs.recv(c.ep, jobs.CORE_TO_FRONT)
            except Timeout:
                return
            except jobs.BadRecord as e:
                self._invalid_record(c, str(e))
                return
            except (PeerClosed, OSError, EOFError):
                if c.proc:
                    try:
                        c.proc.wait(2)
                    except subprocess.TimeoutExpired:
                        c.proc.kill()
                        c.proc.wait()
                self._core_died(c)
                return
            for fd in fds:
                os.close(fd)
            try:
                if fds:
                    raise jobs.BadRecord(f"{type(rec).__name__} came with {len(fds)} file descriptors")
                if not c.ready:  # a restarted core's hello
                    self._core_hello(c, rec)
                    self._schedule()
                elif isinstance(rec, jobs.Deliver):
                    self._core_deliver(c, rec)
                elif isinstance(rec, jobs.Done):
                    self._core_done(c, rec)
                elif isinstance(rec, jobs.Switched):
                    self._core_switched(c, rec)
                else:
                    raise jobs.BadRecord(f"a second {type(rec).__name__}")
            except jobs.BadRecord as e:
                self._invalid_record(c, str(e))
                return

    def _invalid_record(self, c: CoreProc, why: str) -> None:
        self.log(f"core {c.index} sent an invalid record: {why}; restarting it")
        if c.proc:
            try:
                c.proc.kill()
                c.proc.wait(5)
            except (ProcessLookupError, subprocess.TimeoutExpired):
                pass
        self._core_died(c, invalid=why)

    def _core_deliver(self, c: CoreProc, rec: jobs.Deliver) -> None:
        """A response the core could not send: only to the client whose socket it holds."""
        if rec.cid in c.known_conns:
            conn = self.st.conns.get(rec.cid)
            if conn is not None:
                self._send(conn, rec.data)
        elif rec.cid in c.dropped_conns:  # sent before the core took the switch that dropped its socket
            conn = self.st.conns.get(rec.cid)
            if conn is not None:
                self._send(conn, rec.data)
        else:
            raise jobs.BadRecord(f"Deliver to connection {rec.cid}, which core {c.index} does not serve")

    def _core_switched(self, c: CoreProc, rec: jobs.Switched) -> None:
        if rec.count != c.switches_acked + 1 or rec.count > c.switches:
            raise jobs.BadRecord(f"Switched #{rec.count}, but core {c.index} was sent {c.switches} owner switches "
                                 f"and acknowledged {c.switches_acked}")
        c.switches_acked = rec.count
        c.dropped_conns = {cid: n for cid, n in c.dropped_conns.items() if n > rec.count}

    # What a Done's value must be for each kind of job that succeeded (others: None).
    DONE_VALUES = {jobs.LoadModule: jobs.Loaded, jobs.LoadWeights: jobs.WeightsLoaded, jobs.LoadOps: jobs.OpsLoaded}

    def _core_done(self, c: CoreProc, rec: jobs.Done) -> None:
        if rec.job not in c.sent:
            raise jobs.BadRecord(f"Done for job {rec.job}, which was never sent to core {c.index}")
        if rec.status not in _STATUSES:
            raise jobs.BadRecord(f"Done for job {rec.job} with unknown status {rec.status}")
        job = c.running
        if job is None or job.rec.job != rec.job:
            return  # a call that ended through the status page already
        want = self.DONE_VALUES.get(type(job.rec)) if rec.status == S.SUCCESS else None
        if type(rec.value) is not (want or type(None)):
            raise jobs.BadRecord(f"Done for job {rec.job} ({type(job.rec).__name__}, status {rec.status}) carries "
                                 f"{type(rec.value).__name__}, not {want.__name__ if want else 'nothing'}")
        if rec.response is not None and not isinstance(job.rec, jobs.Call):
            raise jobs.BadRecord(f"Done for job {rec.job} ({type(job.rec).__name__}) carries a client response")
        c.running = None
        c.abort_job = None
        c.timed_out = False
        if rec.response is not None and job.conn is not None:  # the core could not answer it itself
            self._send(job.conn, rec.response)
        self._finish(job, rec)
        self._schedule()

    def _drain_for(self, conn: Conn) -> None:
        """Before a connection's next request: take what its cores reported,
        so the state the request meets includes its earlier jobs' ends."""
        ended = False
        for c in self.cores:
            if c.running is not None and c.running.conn is conn:
                self._drain_core(c)
                ended |= self._poll_done(c)
        if ended:
            self._schedule()

    def _poll_done(self, c: CoreProc) -> bool:
        """End the core's running call if its status page says it succeeded."""
        if not c.finished():
            return False
        job = c.running
        c.running, c.abort_job, c.timed_out = None, None, False
        self._finish(job, jobs.Done(job.rec.job, S.SUCCESS, seq=job.rec.seq))
        return True

    def _check_running(self, c: CoreProc, now: float) -> None:
        if self._poll_done(c):
            self._schedule()
        job = c.running
        if job is None:
            return
        if c.abort_job is None:
            why = None
            if job.conn is not None and job.conn.closed:
                why = signal.SIGUSR1
            elif job.deadline and now > job.deadline:
                why, c.timed_out = signal.SIGUSR2, True
            if why is not None:
                c.abort_job, c.abort_deadline = job, now + ABORT_GRACE_S
                try:
                    os.kill(c.proc.pid, why)
                except (ProcessLookupError, AttributeError):
                    pass
        elif c.abort_job is job and now >= c.abort_deadline:
            self._drain_core(c)  # it may have ended just now
            if c.running is not job:
                return
            self.log(f"core {c.index}: job did not stop within {ABORT_GRACE_S} s of being asked; killing the core")
            c.abort_job = None
            try:
                c.proc.kill()
                c.proc.wait(5)
            except (ProcessLookupError, subprocess.TimeoutExpired):
                pass
            self._core_died(c)

    # ================================================================ jobs
    def submit(self, job: FrontJob) -> None:
        # The device's own jobs (unloads, reloads after a restart) always queue.
        if job.conn is not None and len(self.pending) >= MAX_PENDING:
            raise Reject(S.ERR_BUSY, f"device queue is full ({MAX_PENDING} jobs)")
        conn = job.conn
        if conn is not None:
            if conn.inflight >= MAX_PENDING_PER_CONN:
                raise Reject(S.ERR_BUSY, f"connection has {conn.inflight} jobs in flight "
                                         f"(limit {MAX_PENDING_PER_CONN})")
            conn.inflight += 1
        for b in job.bufs:
            b.busy += 1
        job.rec.job = next(self._job_ids)
        job.queued_at = time.monotonic()
        heapq.heappush(self.pending, (-job.priority, next(self._order), job))
        self._schedule()

    def _schedule(self) -> None:
        if not self.pending:
            return
        for c in self.cores:
            if isinstance(getattr(c.running, "rec", None), jobs.Call):
                self._poll_done(c)
        idle = [c for c in self.cores if c.ready and c.running is None and not c.retiring()]
        if not idle:
            # Work waits behind running calls: have them say when they end.
            for c in self.cores:
                if c.running is not None:
                    c.want_done(True)
            if any(self._poll_done(c) for c in self.cores):  # one ended just before it saw the flag
                self._schedule()
            return
        rest = []
        while self.pending and idle:
            entry = heapq.heappop(self.pending)
            job = entry[2]
            c = next((c for c in idle if job.core in (P.CORE_ANY, c.index)), None)
            if c is None:
                rest.append(entry)
                continue
            idle.remove(c)
            if trace.on:
                with trace.span("to core", "front", {"core": c.index}):
                    self._start_job(c, job)
            else:
                self._start_job(c, job)
        for entry in rest:
            heapq.heappush(self.pending, entry)

    def _start_job(self, c: CoreProc, job: FrontJob) -> None:
        rec = job.rec
        fds = []
        c.switch_owner(job)
        if isinstance(rec, jobs.Call):
            if job.plan.plan_id not in c.plans:
                rec.spec = job.plan.spec
                c.plans[job.plan.plan_id] = job.conn.cid
            if job.conn.cid not in c.known_conns:
                rec.new_conn = True
                fds.append(job.conn.ep.fileno())
                c.known_conns.add(job.conn.cid)
            rec.queued_us = int((time.monotonic() - job.queued_at) * 1e6)
        new = [b for b in {b.buf_id: b for b in job.bufs}.values() if b.buf_id not in c.known_bufs]
        rec.new_bufs = [(b.buf_id, b.region.size) for b in new]
        fds += [b.fd for b in new]
        c.known_bufs.update(b.buf_id for b in new)
        c.running = job
        if job.run_limit_s:
            job.deadline = time.monotonic() + job.run_limit_s
        c.want_done(bool(self.pending))
        c.note_sent(rec.job)
        if not c.send(rec, fds):
            self._core_died(c)
        elif c.outq:
            self._modify(c.ep.fileno(), _EPOLLIN | _EPOLLOUT)

    def _finish(self, job: FrontJob, res: jobs.Done) -> None:
        for b in job.bufs:
            b.busy -= 1
        conn = job.conn
        if conn is not None:
            conn.inflight -= 1
        if not isinstance(job.rec, (jobs.UnloadModule, jobs.UnloadWeights)):
            if res.status == S.SUCCESS:
                self.st.jobs_completed += 1
            else:
                self.st.jobs_failed += 1
        if job.on_done is not None:
            try:
                actions = job.on_done(res)
            except _NoRoom as e:
                actions = [e.undo] + failure(conn, job.req, e)
            except Reject as e:
                actions = failure(conn, job.req, e)
            except Exception as e:  # a bug here must not take the device down
                actions = failure(conn, job.req, Reject(S.ERR_GENERIC, f"internal error: {e!r}")) if job.req else []
            self._apply(conn, actions)
        if conn is not None and conn.closed and conn.inflight == 0:
            self._release_conn(conn)

    def _fail(self, job: FrontJob, status: int, message: str, **numbers) -> None:
        """End a job the core will not answer (it died, was never reached, or timed out)."""
        if job.req is None and isinstance(job.rec, jobs.Call) and job.conn is not None:
            self._send(job.conn, P.failure_response(job.req_type, job.rec.seq, status, **numbers).encode())
        self._finish(job, jobs.Done(job.rec.job, status, message, seq=getattr(job.rec, "seq", 0), numbers=numbers))

    # ================================================================ actions
    def _apply(self, conn: Conn | None, actions) -> None:
        for a in actions:
            if isinstance(a, Respond):
                if conn is not None:
                    self._send(conn, a.msg.encode())
            elif isinstance(a, Submit):
                try:
                    if trace.on:
                        with trace.span("queue", "front"):
                            self.submit(a.job)
                    else:
                        self.submit(a.job)
                except Reject as e:
                    if a.job.req is not None:
                        self._apply(conn, failure(conn, a.job.req, e))
                    else:
                        conn.last_error = (a.job.rec.seq, int(e.status), str(e))
                        self._send(conn, P.failure_response(a.job.req_type, a.job.rec.seq, e.status,
                                                            **e.numbers).encode())
            elif isinstance(a, Forget):
                self._forget(a)
            elif isinstance(a, Notify):
                targets = self.cores if a.core is None else [self.cores[a.core]]
                for c in targets:
                    if c.ready and (a.generation is None or c.generation == a.generation):
                        c.drop_owner(a.rec)
                        self._send_core(c, a.rec)
            elif isinstance(a, _To):
                if not a.conn.closed:
                    self._send(a.conn, a.msg.encode())

    def _send_core(self, c: CoreProc, rec) -> None:
        if not c.send(rec):
            return  # a dead core is noticed by housekeeping
        if c.outq:
            self._modify(c.ep.fileno(), _EPOLLIN | _EPOLLOUT)

    def _forget(self, f: Forget) -> None:
        for c in self.cores:
            plans = [p for p in f.plans if p in c.plans]
            conns = [x for x in f.conns if x in c.known_conns]
            bufs = [b for b in f.bufs if b in c.known_bufs]
            if plans or conns or bufs:
                for p in plans:
                    del c.plans[p]
                if conns:  # the core drops a closed connection's plans itself (also ones replayed after a Forget)
                    for p in [p for p, cid in c.plans.items() if cid in f.conns]:
                        del c.plans[p]
                c.known_conns.difference_update(conns)
                c.known_bufs.difference_update(bufs)
                if c.ready:
                    self._send_core(c, jobs.Forget(plans=plans, conns=conns, bufs=bufs))

    # ================================================================ connections
    def _accept(self, _arg, _events) -> None:
        try:
            s, _ = self.lsock.accept()
        except (BlockingIOError, InterruptedError):
            return
        except OSError as e:
            if e.errno in (errno.EMFILE, errno.ENFILE) and self._spare_fd >= 0:
                # Out of fds: use the spare one to take the newcomer off the
                # backlog and close it, so it is refused now instead of waiting.
                os.close(self._spare_fd)
                self._spare_fd = -1
                try:
                    self.lsock.accept()[0].close()
                except OSError:
                    pass
                self.log(f"refused a connection: out of file descriptors ({e.strerror})")
                try:
                    self._spare_fd = os.open(os.devnull, os.O_RDONLY | os.O_CLOEXEC)
                except OSError:
                    pass
                return
            # ENOMEM or no spare: stop accepting for a moment instead of spinning or dying
            self.log(f"accept failed ({e}); pausing new connections for 100 ms")
            self._unregister(self.lsock.fileno())
            self._accept_paused = time.monotonic() + 0.1
            return
        pid, uid, _ = peer_cred(s)
        if uid != os.getuid():
            # Another user's process: refuse before reading anything from it.
            self.log(f"refused a peer of uid {uid}")
            s.close()
            return
        lim = self.st.limits
        why = None
        if len(self.st.conns) >= lim.conns:
            why = f"device has {len(self.st.conns)} connections open (limit {lim.conns}); try again later"
        else:
            mine = sum(1 for c in self.st.conns.values() if c.pid == pid)
            if mine >= lim.conns_per_peer:
                why = f"process {pid} has {mine} connections open to this device (limit {lim.conns_per_peer} " \
                      f"per process)"
            elif mine and len(self.st.conns) >= lim.conns - lim.conns_reserved:
                why = f"process {pid} has {mine} connections open and the device {len(self.st.conns)} of " \
                      f"{lim.conns}: the last {lim.conns_reserved} are kept for processes with none"
        if why is not None:
            self._refuse(s, why)
            return
        s.setblocking(False)
        conn = Conn(self.st.new_id(), Endpoint(s), uid, pid=pid)
        self.st.conns[conn.cid] = conn
        self._register(s.fileno(), trace.timed(self._on_conn, "receive", "front", top=True), conn)

    # A connection past a limit: its requests are answered ERR_BUSY (GET_ERROR
    # says which limit, with the numbers) until it closes or REFUSED_LINGER_S
    # pass; everyone already connected keeps their connection.
    def _refuse(self, s: socket.socket, why: str) -> None:
        self.log(f"refused a connection: {why}")
        if len(self._refused) >= MAX_REFUSED:
            s.close()
            return
        s.setblocking(False)
        fd = s.fileno()
        self._refused[fd] = [s, time.monotonic() + REFUSED_LINGER_S, why, 0]
        self._register(fd, self._on_refused, fd)

    def _drop_refused(self, fd: int) -> None:
        s = self._refused.pop(fd)[0]
        self._unregister(fd)
        s.close()

    def _on_refused(self, fd: int, _events) -> None:
        entry = self._refused[fd]
        s, why = entry[0], entry[2]
        try:
            data, fds = socket.recv_fds(s, P.MAX_MSG + 1, 4)[:2]
        except BlockingIOError:
            return
        except OSError:
            self._drop_refused(fd)
            return
        for f in fds:
            os.close(f)
        if not data:
            self._drop_refused(fd)
            return
        try:
            req = P.decode(data)
        except P.ProtocolError as e:
            resp = P.error_response(e.msg_type, e.seq, S.ERR_BUSY)
        else:
            if isinstance(req, P.GetError):
                resp = P.GetErrorResp(seq=req.seq, error_seq=entry[3], error_status=int(S.ERR_BUSY),
                                      payload=why.encode()[:P.GetErrorResp.MAX_TEXT]).encode()
            else:
                entry[3] = req.seq
                resp = P.failure(req, S.ERR_BUSY).encode()
        try:
            s.send(resp, socket.MSG_DONTWAIT)
        except OSError:
            self._drop_refused(fd)

    def _on_conn(self, conn: Conn, events: int) -> None:
        if conn.outbox:
            # Writable again (or hung up): drain first.  Its requests are read
            # again only once every response it is owed has been taken.
            self._flush(conn)
            return
        try:
            data, fds, truncated = conn.ep.recv_ready()
        except PeerClosed:
            self._close_conn(conn)
            return
        except (BlockingIOError, InterruptedError, Timeout):
            return
        except OSError:
            self._close_conn(conn)
            return
        try:
            if conn.inflight:
                self._drain_for(conn)
            self._dispatch(conn, data, fds, truncated)
        except Exception as e:  # a bug on one connection must not take the device down
            self.log(f"internal error on connection {conn.cid}: {e!r}")
            self._close_conn(conn)
        finally:
            for fd in fds:  # handlers take the fds they keep out of this list
                try:
                    os.close(fd)
                except OSError:
                    pass

    def _dispatch(self, conn: Conn, data: bytes, fds: list, truncated: bool) -> None:
        hdr = P.peek_header(data)
        if truncated:
            conn.last_error = (hdr[1] if hdr else 0, S.ERR_INVALID, f"datagram longer than {P.MAX_MSG} bytes")
            self._send(conn, P.error_response(hdr[0] if hdr else 0, hdr[1] if hdr else 0, S.ERR_INVALID))
            return
        key = None
        if hdr is not None and hdr[0] in PLANNED and not fds:
            key = Handlers.plan_key(conn, hdr[0], data)
            plan = conn.plans.get(key) if key is not None else None
            if plan is not None:
                if trace.on:
                    with trace.span("validate (plan hit)", "front"):
                        actions = self.handlers.replay(conn, plan, hdr[1])
                else:
                    actions = self.handlers.replay(conn, plan, hdr[1])
                if actions is not None:
                    self._apply(conn, actions)
                    return
        try:
            if hdr and hdr[0] & P.RESPONSE_BIT and hdr[2] == len(data):
                raise P.ProtocolError(f"0x{hdr[0]:04X} is not a request type", S.ERR_OP, hdr[1], hdr[0])
            req = P.decode(data)
        except P.ProtocolError as e:
            conn.last_error = (e.seq or 0, int(e.status), str(e))
            self._send(conn, P.error_response(e.msg_type, e.seq, e.status))
            return
        if trace.on:
            with trace.span(f"validate {req.NAME}", "front"):
                actions = self.handlers.handle(conn, req, fds, key)
        else:
            actions = self.handlers.handle(conn, req, fds, key)
        self._apply(conn, actions)

    def _send(self, conn: Conn, data: bytes) -> None:
        t0 = trace.clock() if trace.on else 0
        try:
            if conn.closed:
                return
            if conn.outbox:  # keep the order of responses
                self._queue_out(conn, data)
                return
            try:
                conn.ep.sock.send(data, socket.MSG_DONTWAIT)
            except BlockingIOError:
                # The peer is not reading: keep the response and stop reading its
                # requests until it does (EPOLLOUT tells us when).
                self._queue_out(conn, data)
                self._modify(conn.ep.fileno(), _EPOLLOUT)
            except OSError:
                self._close_conn(conn)
        finally:
            if t0:
                trace.complete("respond", t0, "front")

    def _queue_out(self, conn: Conn, data: bytes) -> None:
        if len(conn.outbox) >= MAX_OUTBOX:
            self.log(f"connection {conn.cid} does not read its responses ({len(conn.outbox)} queued); closing it")
            self._close_conn(conn)
            return
        conn.outbox.append(data)

    def _flush(self, conn: Conn) -> None:
        while conn.outbox and not conn.closed:
            try:
                conn.ep.sock.send(conn.outbox[0], socket.MSG_DONTWAIT)
            except BlockingIOError:
                return
            except OSError:
                self._close_conn(conn)
                return
            conn.outbox.pop(0)
        if not conn.closed:
            self._modify(conn.ep.fileno(), _EPOLLIN)

    def _close_conn(self, conn: Conn, notify_cores: bool = True) -> None:
        if conn.closed:
            return
        conn.closed = True
        conn.outbox.clear()
        self._unregister(conn.ep.fileno())
        try:
            # Cores that answer this client hold copies of its socket: shut it
            # down for all of them, so the peer sees the close now.
            conn.ep.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        conn.ep.close()
        # Queued jobs of a closed connection will never be answered: drop them.
        mine = [e for e in self.pending if e[2].conn is conn]
        if mine:
            self.pending = [e for e in self.pending if e[2].conn is not conn]
            heapq.heapify(self.pending)
            for _, _, j in mine:
                for b in j.bufs:
                    b.busy -= 1
                conn.inflight -= 1
        if conn.inflight == 0:
            self._release_conn(conn, notify_cores)
        else:  # its job still runs on a core: ask the core to abort it now
            now = time.monotonic()
            for c in self.cores:
                if c.running is not None and c.running.conn is conn:
                    self._check_running(c, now)

    def _release_conn(self, conn: Conn, notify_cores: bool = True) -> None:
        """Free everything the connection held: models, modules, buffers."""
        h = self.handlers
        actions = h.invalidate(conn)
        for mid in list(conn.models):
            actions += h.unload_model(self.st.models[mid])
        for handle in list(conn.modules):
            actions += h.unload_module(self.st.modules[handle])
        for addr in list(conn.bufs):
            actions += h.detach(conn, addr)
        actions.append(Forget(conns=[conn.cid]))
        self.st.conns.pop(conn.cid, None)
        if notify_cores:
            self._apply(None, actions)
