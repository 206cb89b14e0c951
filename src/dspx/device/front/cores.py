"""The front's side of a core: its process, its channel, and what it holds.

Every send to a core is non-blocking: a core busy in a long job does not
read its channel, and the front must keep serving everyone else.  What the
channel cannot take now waits in ``outq`` (with its own copies of the fds,
since a buffer may be detached before the send happens) and is flushed when
the channel is writable again.
"""
from __future__ import annotations

import collections
import mmap
import os
import subprocess
import sys

from ...transport import Endpoint, PeerClosed
from .. import jobs


# Jobs that map a connection's buffers or run user code (a library's top
# level, a module's constructors and destructors): the core holds only their
# owner's buffers.
OWNED_JOBS = (jobs.Call, jobs.LoadModule, jobs.UnloadModule, jobs.LoadWeights, jobs.LoadOps)


# Ids of the last jobs sent to a core that a Done may still name (a call that
# ended through the status page may send its Done after the next job started).
MAX_SENT = 4096


# TVM's pool workers sched_yield-spin 300,000 times (some 0.2-0.5 s here)
# after each parallel region before they sleep: on 2 vCPUs that took half
# the CPU from the next call of another core or device (a 37-token LLM
# prefill right after another device's work: 271 against 468 tok/s).  5,000
# keeps them awake across the gaps inside a call and between decode steps
# (docs/llm-internals.md, "TVM's pool spin").  The caller's own value wins.
TVM_SPIN_COUNT = 5000


class CoreProc:
    #: how a core process is started (the benchmarks start an instrumented one)
    COMMAND = (sys.executable, "-m", "dspx.device.core")

    def __init__(self, index: int, threads: int, env: dict | None = None):
        self.index = index
        self.threads = threads
        self.env = env
        self.generation = 0
        self.ep: Endpoint | None = None
        self.proc = None  # spawner.ChildProc: the front's child, started by the spawner
        self.ready = False
        self.lost = False  # it died and cannot be restarted (the spawner is gone)
        self.start_failures = 0  # restarts in a row that could not start a process
        self.retry_at = 0.0
        self._reset()

    def _reset(self) -> None:
        self.known_bufs: set[int] = set()
        self.known_conns: set[int] = set()  # connections whose socket it holds (its owner's, at most)
        # Owner switches sent to it, and the last one it acknowledged (jobs.Switched);
        # the connections a switch dropped -> that switch's number, until acknowledged.
        self.switches = self.switches_acked = 0
        self.dropped_conns: dict[int, int] = {}
        self.sent: dict[int, None] = {}  # ids of the last MAX_SENT jobs sent to it (in order)
        self.plans: dict[int, int] = {}  # plan ids it holds -> their connection
        # whose buffers it maps now (a cid, or None: the device's own copies);
        # a job of another owner makes it drop them all first (jobs.Job.drop_bufs)
        self.bufs_owner: int | None = None
        self.running = None  # the FrontJob it runs
        self.abort_job = None  # the running job an abort was asked for
        self.abort_deadline = 0.0
        self.timed_out = False  # the running job passed its deadline
        self.outq: collections.deque = collections.deque()

    def command(self) -> tuple[list[str], dict]:
        """The argv (without its fds) and environment this core is started with."""
        env = dict(os.environ if self.env is None else self.env)
        if self.threads:
            env.setdefault("OMP_NUM_THREADS", str(self.threads))
        env.setdefault("TVM_THREAD_POOL_SPIN_COUNT", str(TVM_SPIN_COUNT))
        return [*self.COMMAND, "--index", str(self.index), "--threads", str(self.threads)], env

    def start(self, spawner) -> None:
        """Start the core through the spawner (spawner.py: the front itself may not exec)."""
        proc, parent, status_fd = spawner.spawn(self.index)
        try:
            self.status = mmap.mmap(status_fd, jobs.STATUS_SIZE)
        finally:
            os.close(status_fd)
        self.proc = proc
        parent.setblocking(False)
        self.ep = jobs.endpoint(parent)
        self.generation += 1
        self.ready = False
        self._reset()

    def switch_owner(self, job) -> None:
        """Before ``job`` runs: if it is another owner's and runs code or maps
        buffers, the core drops every mapping and plan of the previous owner."""
        if not isinstance(job.rec, OWNED_JOBS):
            return
        owner = job.conn.cid if job.conn is not None else None
        if owner != self.bufs_owner and (self.known_bufs or self.plans or self.known_conns):
            self._drop_bufs(job.rec)
        self.bufs_owner = owner

    def drop_owner(self, rec) -> None:
        """``rec`` goes to the core outside the job queue (a Notify: an
        unload that runs a module's destructors): it drops every buffer first."""
        if isinstance(rec, OWNED_JOBS):
            self._drop_bufs(rec)
            self.bufs_owner = None

    def _drop_bufs(self, rec) -> None:
        """``rec`` tells the core to unmap every buffer, drop every plan and
        close every client socket; the front forgets them too."""
        rec.drop_bufs = True
        self.known_bufs.clear()
        self.plans.clear()
        self.switches += 1
        for cid in self.known_conns:
            self.dropped_conns[cid] = self.switches
        self.known_conns = set()

    def note_sent(self, job: int) -> None:
        self.sent[job] = None
        if len(self.sent) > MAX_SENT:
            del self.sent[next(iter(self.sent))]

    def finished(self) -> bool:
        """Whether the running Call has ended with SUCCESS (the status page says so)."""
        job = self.running
        return job is not None and jobs.STATUS_WORD.unpack_from(self.status, jobs.STATUS_DONE)[0] == job.rec.job

    def retiring(self) -> bool:
        """Whether the core said it ends after its job (user code broke its
        runtime): it gets no more jobs; it is restarted when it exits."""
        return self.ep is not None and jobs.STATUS_WORD.unpack_from(self.status, jobs.STATUS_RESTART)[0] != 0

    def want_done(self, wake: bool) -> None:
        """Ask for (or stop asking for) a Done datagram when the running call succeeds."""
        jobs.STATUS_WORD.pack_into(self.status, jobs.STATUS_WAKE, int(wake))

    @property
    def alive_generation(self) -> int | None:
        return self.generation if self.ready else None

    def send(self, rec, fds=()) -> bool:
        """Send (or queue) a record; False if the channel is closed (the core died)."""
        if self.ep is None:
            return False
        data = jobs.encode(rec)
        if not self.outq:
            try:
                self.ep.send(data, fds)
                return True
            except BlockingIOError:
                pass
            except (PeerClosed, OSError):
                return False
        self.outq.append((data, [os.dup(fd) for fd in fds]))
        return True

    def flush(self) -> bool:
        """Send what is queued; True when the queue is empty."""
        while self.outq:
            data, fds = self.outq[0]
            try:
                self.ep.send(data, fds)
            except BlockingIOError:
                return False
            except (PeerClosed, OSError):
                self._drop_queue()
                return True
            self.outq.popleft()
            for fd in fds:
                os.close(fd)
        return True

    def _drop_queue(self) -> None:
        for _, fds in self.outq:
            for fd in fds:
                os.close(fd)
        self.outq.clear()

    def close_channel(self) -> None:
        self._drop_queue()
        if self.ep:
            self.ep.close()
        self.ep = None
        self.ready = False

    def stop(self, timeout: float = 3.0) -> None:
        self.close_channel()
        if self.proc and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout)
