"""The front's job queue: jobs by priority and core choice, placed on idle
cores, stopped when their time runs out or their connection closes.

A queued job waits in one heap (highest priority first, then in order); a
job names a core or any core.  A running job whose connection closed, or
whose time ran out, is asked to stop (SIGUSR1 / SIGUSR2, raised in the job's
Python code); if it has not ended after ABORT_GRACE_S its core is killed and
restarted, so the memory it holds is freed within a second whatever the job
does.  Every job ends through ``finish``: its buffers and its connection's
count are released and its ``on_done`` actions applied.
"""
from __future__ import annotations

import heapq
import itertools
import os
import signal
import subprocess
import time

from ... import trace
from ...abi import protocol as P
from ...abi.protocol import Status as S
from .. import jobs
from .actions import FrontJob, NoRoom, failure
from .cores import CoreProc
from .poller import IN, OUT
from .state import MAX_PENDING, MAX_PENDING_PER_CONN, Conn, Reject

ABORT_GRACE_S = 0.3


class Scheduler:
    def __init__(self, front):
        self.front = front
        self.cores: list[CoreProc] = front.cores
        self.pending: list = []  # heap of (-priority, order, FrontJob)
        self._order = itertools.count()
        self._job_ids = itertools.count(1)

    # ================================================================ the queue
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
        self.schedule()

    def schedule(self) -> None:
        if not self.pending:
            return
        for c in self.cores:
            if isinstance(getattr(c.running, "rec", None), jobs.Call):
                self.poll_done(c)
        idle = [c for c in self.cores if c.ready and c.running is None and not c.retiring()]
        if not idle:
            # Work waits behind running calls: have them say when they end.
            for c in self.cores:
                if c.running is not None:
                    c.want_done(True)
            if any(self.poll_done(c) for c in self.cores):  # one ended just before it saw the flag
                self.schedule()
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
            self.front.supervisor.died(c)
        elif c.outq:
            self.front.poller.modify(c.ep.fileno(), IN | OUT)

    def _remove(self, entries: list) -> None:
        self.pending = [e for e in self.pending if e not in entries]
        heapq.heapify(self.pending)

    def expire(self, now: float) -> None:
        """Fail the queued jobs whose time ran out before a core could start them."""
        expired = [e for e in self.pending if e[2].deadline and e[2].deadline < now]
        if expired:
            self._remove(expired)
            for _, _, job in expired:
                self.fail(job, S.ERR_TIMEOUT, "task timed out before a core could start it")

    def fail_unrunnable(self) -> None:
        """Fail the queued jobs no core can run any more (their cores are lost with the spawner)."""
        live = [c.index for c in self.cores if not c.lost]
        dead = [e for e in self.pending if not (live and (e[2].core == P.CORE_ANY or e[2].core in live))]
        if dead:
            self._remove(dead)
            for _, _, job in dead:
                self.fail(job, S.ERR_CALL, "no core can run this job: its core died and the core spawner "
                                           "is gone, so it cannot be restarted")

    def drop_queued(self, conn: Conn) -> None:
        """Drop the queued jobs of a closed connection: they will never be answered."""
        mine = [e for e in self.pending if e[2].conn is conn]
        if mine:
            self.pending = [e for e in self.pending if e[2].conn is not conn]
            heapq.heapify(self.pending)
            for _, _, j in mine:
                for b in j.bufs:
                    b.busy -= 1
                conn.inflight -= 1

    # ================================================================ ends
    def finish(self, job: FrontJob, res: jobs.Done) -> None:
        for b in job.bufs:
            b.busy -= 1
        conn = job.conn
        if conn is not None:
            conn.inflight -= 1
        st = self.front.st
        if not isinstance(job.rec, (jobs.UnloadModule, jobs.UnloadWeights)):
            if res.status == S.SUCCESS:
                st.jobs_completed += 1
            else:
                st.jobs_failed += 1
        if job.on_done is not None:
            try:
                actions = job.on_done(res)
            except NoRoom as e:
                actions = [e.undo] + failure(conn, job.req, e)
            except Reject as e:
                actions = failure(conn, job.req, e)
            except Exception as e:  # a bug here must not take the device down
                actions = failure(conn, job.req, Reject(S.ERR_GENERIC, f"internal error: {e!r}")) if job.req else []
            self.front.apply(conn, actions)
        if conn is not None and conn.closed and conn.inflight == 0:
            self.front.connections.release(conn)

    def fail(self, job: FrontJob, status: int, message: str, **numbers) -> None:
        """End a job the core will not answer (it died, was never reached, or timed out)."""
        if job.req is None and isinstance(job.rec, jobs.Call) and job.conn is not None:
            self.front.connections.send(job.conn, P.failure_response(job.req_type, job.rec.seq, status,
                                                                     **numbers).encode())
        self.finish(job, jobs.Done(job.rec.job, status, message, seq=getattr(job.rec, "seq", 0), numbers=numbers))

    def poll_done(self, c: CoreProc) -> bool:
        """End the core's running call if its status page says it succeeded."""
        if not c.finished():
            return False
        job = c.running
        c.running, c.abort_job, c.timed_out = None, None, False
        self.finish(job, jobs.Done(job.rec.job, S.SUCCESS, seq=job.rec.seq))
        return True

    # ================================================================ time limits, aborts
    def abort_running(self, conn: Conn) -> None:
        """The connection closed: ask the cores that run its jobs to stop them now."""
        now = time.monotonic()
        for c in self.cores:
            if c.running is not None and c.running.conn is conn:
                self.check_running(c, now)

    def check_running(self, c: CoreProc, now: float) -> None:
        if self.poll_done(c):
            self.schedule()
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
            supervisor = self.front.supervisor
            supervisor.drain(c)  # it may have ended just now
            if c.running is not job:
                return
            self.front.log(f"core {c.index}: job did not stop within {ABORT_GRACE_S} s of being asked; "
                           f"killing the core")
            c.abort_job = None
            try:
                c.proc.kill()
                c.proc.wait(5)
            except (ProcessLookupError, subprocess.TimeoutExpired):
                pass
            supervisor.died(c)
