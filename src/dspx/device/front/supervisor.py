"""The front's supervision of its cores: start them through the spawner,
check every record they send, restart one that dies or misbehaves.

A core runs client code, so each record it sends is checked like a client's
message (docs/containment.md, "The front trusts nothing a core sends"): one that does not decode, comes with file
descriptors, names a job or a connection that is not this core's, or
acknowledges an owner switch out of turn, restarts the core (its running
job fails with ERR_CALL).  After a restart the core gets back, under the
same handles, the modules, weights and op libraries the front has copies of.
"""
from __future__ import annotations

import os
import subprocess
import time

import psutil

from ... import trace
from ...abi.protocol import Status as S
from ...transport import PeerClosed, Timeout
from .. import jobs
from .actions import Forget, Notify
from .cores import CoreProc
from .poller import IN, OUT
from .spawner import Spawner, SpawnerGone
from .state import Conn

_STATUSES = frozenset(int(s) for s in S)


class CoreSupervisor:
    def __init__(self, front, cores: list[CoreProc]):
        self.front = front
        self.st = front.st
        self.cores = cores
        self.spawner: Spawner | None = None  # starts the cores (the front itself may not exec)
        self.cost_jobs: dict[int, int] = {}  # core index -> the job of its last Cost record

    def rss(self) -> int:
        return sum(psutil.Process(c.proc.pid).memory_info().rss for c in self.cores
                   if c.proc and c.proc.poll() is None) + psutil.Process().memory_info().rss

    def start_spawner(self) -> None:
        if self.spawner is None:
            self.spawner = Spawner({c.index: c.command() for c in self.cores})

    def start_core(self, c: CoreProc, wait: bool = True) -> None:
        self.start_spawner()  # started by serve_forever; here for a Service driven in-process
        c.start(self.spawner)
        self.front.poller.register(c.ep.fileno(), trace.timed(self.on_core, "core message", "front", top=True), c)
        if wait:
            # At start-up, block until the core says hello so the device never
            # answers a job before a core exists.  A restart does not block the
            # loop: the hello arrives through on_core, jobs queue meanwhile.
            rec, _ = jobs.recv(c.ep, jobs.CORE_TO_FRONT, timeout=60)
            self._hello(c, rec)

    def stop(self) -> None:
        for c in self.cores:
            c.stop()
        if self.spawner is not None:
            self.spawner.stop()

    def check(self, now: float) -> None:
        """Housekeeping: restart the cores that died or could not start, stop overdue jobs."""
        if self.spawner is not None and (why := self.spawner.check()):
            self.front.log(f"{why}; the device serves on, but a core that dies now cannot be restarted")
        for c in self.cores:
            if c.ep is None:  # a restart that failed (e.g. out of fds): try again
                if now >= c.retry_at:
                    self._restart(c, now)
            elif c.proc and c.proc.poll() is not None:  # died, ready or still starting
                self.died(c)
            else:
                self.front.scheduler.check_running(c, now)

    # ================================================================ to the cores
    def send(self, c: CoreProc, rec) -> None:
        if not c.send(rec):
            return  # a dead core is noticed by housekeeping
        if c.outq:
            self.front.poller.modify(c.ep.fileno(), IN | OUT)

    def notify(self, a: Notify) -> None:
        targets = self.cores if a.core is None else [self.cores[a.core]]
        for c in targets:
            if c.ready and (a.generation is None or c.generation == a.generation):
                c.drop_owner(a.rec)
                self.send(c, a.rec)

    def forget(self, f: Forget) -> None:
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
                    self.send(c, jobs.Forget(plans=plans, conns=conns, bufs=bufs))

    # ================================================================ restarts
    def _hello(self, c: CoreProc, rec) -> None:
        """A core's first record: a Hello from that very process (BadRecord if not)."""
        if not isinstance(rec, jobs.Hello):
            raise jobs.BadRecord(f"a {type(rec).__name__} before its Hello")
        if rec.core != c.index or rec.pid != c.proc.pid:
            raise jobs.BadRecord(f"Hello of core {rec.core}, pid {rec.pid}; this is core {c.index}, pid {c.proc.pid}")
        c.ready = True
        c.start_failures = 0
        for cmd, name, lat in rec.ops:  # the firmware's built-in operators
            self.st.op_table.setdefault(cmd, (name, lat, 0))
        self.front.apply(None, self.front.handlers.replay_ops(c.index))

    def died(self, c: CoreProc, invalid: str = "") -> None:
        """Restart a core that ended (``invalid``: the front killed it for that record)."""
        front, sched = self.front, self.front.scheduler
        if front.stopping:  # shutting down (Ctrl-C reaches the whole process group): no restart, no news
            return
        code = c.proc.poll() if c.proc else None
        why = ": user code broke its runtime" if code == jobs.EXIT_RUNTIME_BROKEN else ""
        front.log(f"core {c.index} died (exit {code}{why}); restarting")
        started = c.ready
        front.poller.unregister(c.ep.fileno())
        c.close_channel()
        job, timed_out = c.running, c.timed_out
        c.running = None
        if job is not None:
            if timed_out:
                sched.fail(job, S.ERR_TIMEOUT, f"job ran past its time limit and did not stop; core {c.index} "
                                               f"was restarted")
            elif invalid:
                sched.fail(job, S.ERR_CALL, f"core {c.index} sent an invalid record while running this job "
                                            f"({invalid}); it was restarted")
            else:
                sched.fail(job, S.ERR_CALL, f"core {c.index} crashed while running this job (exit status "
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
                reloads += front.handlers.reload(rec)
            elif hasattr(rec, "handle"):
                self.st.drop_module(rec)
            else:
                self.st.drop_model(rec)
        for cid in touched:
            conn = self.st.conns.get(cid)
            if conn is not None:
                front.apply(conn, front.handlers.invalidate(conn))
        front.apply(None, reloads)
        if started:
            self._restart(c, time.monotonic())
        else:  # it died before it said hello: do not restart it in a loop
            c.start_failures += 1
            c.retry_at = time.monotonic() + min(5.0, 0.1 * 2 ** c.start_failures)
        sched.schedule()

    def _restart(self, c: CoreProc, now: float) -> None:
        """Start the core again; if it cannot start, retry later with a growing backoff."""
        try:
            self.start_core(c, wait=False)
        except SpawnerGone as e:
            c.ep, c.ready = None, False
            c.retry_at = now + 0.05  # checked again with housekeeping: its jobs keep failing at once
            if not c.lost:
                c.lost = True
                self.front.log(f"core {c.index} cannot be restarted: {e}; its jobs fail with ERR_CALL")
            self.front.scheduler.fail_unrunnable()
        except OSError as e:  # e.g. out of fds
            c.ep, c.ready = None, False
            c.start_failures += 1
            delay = min(5.0, 0.1 * 2 ** c.start_failures)
            c.retry_at = now + delay
            self.front.log(f"core {c.index} could not be restarted ({e}); retrying in {delay:.1f} s")

    # ================================================================ from the cores
    def on_core(self, c: CoreProc, events: int) -> None:
        if events & OUT and c.flush():
            self.front.poller.modify(c.ep.fileno(), IN)
        if events & ~OUT:
            self.drain(c)

    def drain_for(self, conn: Conn) -> None:
        """Before a connection's next request: take what its cores reported,
        so the state the request meets includes its earlier jobs' ends."""
        sched = self.front.scheduler
        ended = False
        for c in self.cores:
            if c.running is not None and c.running.conn is conn:
                self.drain(c)
                ended |= sched.poll_done(c)
        if ended:
            sched.schedule()

    def drain(self, c: CoreProc) -> None:
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
                self.died(c)
                return
            for fd in fds:
                os.close(fd)
            try:
                if fds:
                    raise jobs.BadRecord(f"{type(rec).__name__} came with {len(fds)} file descriptors")
                if not c.ready:  # a restarted core's hello
                    self._hello(c, rec)
                    self.front.scheduler.schedule()
                elif isinstance(rec, jobs.Deliver):
                    self.deliver(c, rec)
                elif isinstance(rec, jobs.Done):
                    self.done(c, rec)
                elif isinstance(rec, jobs.Switched):
                    self.switched(c, rec)
                elif isinstance(rec, jobs.Cost):
                    self.cost(c, rec)
                else:
                    raise jobs.BadRecord(f"a second {type(rec).__name__}")
            except jobs.BadRecord as e:
                self._invalid_record(c, str(e))
                return

    def drain_all(self) -> None:
        """Take what every core has sent: before a GET_COST, whose call's
        Cost went out just before its answer and may not be read yet."""
        for c in self.cores:
            if c.ep is not None:
                self.drain(c)

    def _invalid_record(self, c: CoreProc, why: str) -> None:
        self.front.log(f"core {c.index} sent an invalid record: {why}; restarting it")
        if c.proc:
            try:
                c.proc.kill()
                c.proc.wait(5)
            except (ProcessLookupError, subprocess.TimeoutExpired):
                pass
        self.died(c, invalid=why)

    def deliver(self, c: CoreProc, rec: jobs.Deliver) -> None:
        """A response the core could not send: only to the client whose socket it holds."""
        if rec.cid in c.known_conns:
            conn = self.st.conns.get(rec.cid)
            if conn is not None:
                self.front.connections.send(conn, rec.data)
        elif rec.cid in c.dropped_conns:  # sent before the core took the switch that dropped its socket
            conn = self.st.conns.get(rec.cid)
            if conn is not None:
                self.front.connections.send(conn, rec.data)
        else:
            raise jobs.BadRecord(f"Deliver to connection {rec.cid}, which core {c.index} does not serve")

    def switched(self, c: CoreProc, rec: jobs.Switched) -> None:
        if rec.count != c.switches_acked + 1 or rec.count > c.switches:
            raise jobs.BadRecord(f"Switched #{rec.count}, but core {c.index} was sent {c.switches} owner switches "
                                 f"and acknowledged {c.switches_acked}")
        c.switches_acked = rec.count
        c.dropped_conns = {cid: n for cid, n in c.dropped_conns.items() if n > rec.count}

    def cost(self, c: CoreProc, rec: jobs.Cost) -> None:
        """A call's cost record: kept for its connection (GET_COST) if this
        core has a cost model, ran that job, for a connection it serves, and
        the figures add up; anything else is a bad record."""
        env = c.env if c.env is not None else os.environ
        if not env.get(jobs.COST_MODEL_ENV):
            raise jobs.BadRecord(f"Cost for job {rec.job}, but core {c.index} runs without a cost model")
        if rec.job not in c.sent:
            raise jobs.BadRecord(f"Cost for job {rec.job}, which was never sent to core {c.index}")
        job = c.running
        if job is not None and job.rec.job == rec.job:  # its call still runs for the front: check it exactly
            if not isinstance(job.rec, jobs.Call) or job.conn is None or job.conn.cid != rec.cid \
                    or job.rec.seq != rec.seq:
                raise jobs.BadRecord(f"Cost for job {rec.job} (connection {rec.cid}, seq {rec.seq}), which is "
                                     f"{type(job.rec).__name__} seq {getattr(job.rec, 'seq', 0)} of connection "
                                     f"{job.conn.cid if job.conn else None}")
        elif rec.cid not in c.known_conns and rec.cid not in c.dropped_conns:
            raise jobs.BadRecord(f"Cost for connection {rec.cid}, which core {c.index} does not serve")
        if not rec.profile or not rec.profile.isascii() or not rec.profile.isprintable():
            raise jobs.BadRecord(f"Cost for job {rec.job} names profile {rec.profile!r}, not a printable ASCII name")
        f = rec.figures()
        parts = f["overhead"] + f["compute"] + f["ddr_stall"] + f["dma_wait"]
        if f["cycles"] != parts:
            raise jobs.BadRecord(f"Cost for job {rec.job}: cycles {f['cycles']} != overhead + compute + ddr_stall "
                                 f"+ dma_wait = {parts}")
        if rec.job <= self.cost_jobs.get(c.index, 0):  # a core runs its jobs in order, one Cost each
            raise jobs.BadRecord(f"Cost for job {rec.job} after core {c.index}'s Cost for job "
                                 f"{self.cost_jobs[c.index]}")
        self.cost_jobs[c.index] = rec.job
        conn = self.st.conns.get(rec.cid)
        # the latest call's record (calls of one connection on two cores may end out of order)
        if conn is not None and (conn.last_cost is None or conn.last_cost[1].job < rec.job):
            conn.last_cost = (c.index, rec)

    # What a Done's value must be for each kind of job that succeeded (others: None).
    DONE_VALUES = {jobs.LoadModule: jobs.Loaded, jobs.LoadWeights: jobs.WeightsLoaded, jobs.LoadOps: jobs.OpsLoaded}

    def done(self, c: CoreProc, rec: jobs.Done) -> None:
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
            self.front.connections.send(job.conn, rec.response)
        sched = self.front.scheduler
        sched.finish(job, rec)
        sched.schedule()
