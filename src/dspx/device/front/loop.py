"""The front's event loop: receive → validate → dispatch → respond.

One epoll loop (``poller.py``) owns the listening socket, every connection
and the channels to the cores.  It decodes each message, hands it to the
handlers (``handlers/``) and carries out the actions they return
(``actions.py``): answer, queue a job, tell the cores.  Its rooms:
``connections.py`` accepts, refuses, answers and closes clients;
``scheduler.py`` queues jobs by priority and core choice, places them and
stops them at their time limit or when their connection closed;
``supervisor.py`` starts the cores, checks what they send and restarts one
that dies.  Nothing it does blocks: every send to a client or a core is
non-blocking with a queue behind it.
"""
from __future__ import annotations

import os
import resource
import signal
import time

from ... import memory, trace
from ...abi import protocol as P
from ...abi.protocol import DEFAULT_JOB_TIMEOUT_S, Status as S
from ...transport import PeerClosed, Timeout
from .. import sandbox
from .actions import Forget, Notify, Respond, RespondTo, Submit, failure
from .connections import Connections
from .cores import CoreProc
from .handlers import Handlers
from .poller import Poller
from .scheduler import Scheduler
from .state import Conn, Cores, DeviceState, Limits, Reject
from .supervisor import CoreSupervisor

PLANNED = frozenset((P.MsgType.INFER, P.MsgType.INFER_LARGE, P.MsgType.RPC))


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
                 conn_bytes: int | None = None, idle_exit_s: float = 0.0):
        """``idle_exit_s``: stop after that long with no connection (0: never)."""
        self.path = socket_path
        self.st = DeviceState(carveout_size, ddr_pool_size)
        self.st.limits = Limits.for_device(raise_fd_limit(), carveout_size, conn_bytes, ddr_pool_size)
        threads = threads or max(1, (os.cpu_count() or 1) // max(1, cores))
        self.cores = [CoreProc(i, threads) for i in range(cores)]
        self.parent_pid = parent_pid
        self.running = False
        self.stopping = False  # set once a signal or shutdown began: cores that end now are not restarted
        self.stopped_by: int | None = None  # the signal that stopped the service
        self.idle_exit_s = idle_exit_s
        self.last_activity = time.monotonic()  # a connection open or accepted (Connections._accept)
        self.log = log or (lambda *a: None)
        self.poller = Poller()
        self.supervisor = CoreSupervisor(self, self.cores)
        self.scheduler = Scheduler(self)
        self.connections = Connections(self, self._on_conn)
        self.handlers = Handlers(self.st, Cores(cores, lambda i: self.cores[i].alive_generation,
                                                self.supervisor.rss), job_timeout_s)

    # ================================================================ lifecycle
    def serve_forever(self) -> None:
        self.running = True
        # Nothing else of this uid (a core) may open /proc/<front>/fd or /mem,
        # ptrace it or read its memory; the spawner inherits it.
        sandbox.set_non_dumpable()
        self.supervisor.start_spawner()  # before any client, any socket but its own, and the filter
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, self._on_signal)
        self.connections.listen(self.path)
        self.path = self.connections.bound  # a shared directory's socket lives in its dspx-<uid> (transport)
        for c in self.cores:
            self.supervisor.start_core(c)
        if sandbox.enabled():
            # From here on: no exec, no new sockets (sandbox.front_program).
            sandbox.install_front(self.connections.lsock.fileno(), sandbox.log_only())
        lim = self.st.limits
        self.log(f"listening on {self.path} with {len(self.cores)} core(s); window {self.st.window.size >> 20} MiB "
                 f"({lim.conn_bytes >> 20} MiB per connection, {lim.peer_bytes >> 20} MiB per process), DDR pool "
                 f"{self.st.ddr.size >> 20} MiB ({lim.peer_ddr >> 20} MiB per process); limits: {lim.conns} "
                 f"connections ({lim.conns_per_peer} per process), the last {lim.conns_reserved} kept for new processes, "
                 f"{lim.bufs_total} buffers "
                 f"({lim.bufs_per_conn} per connection), fd limit {lim.nofile}")
        next_check = 0.0
        watch = self.poller.watch
        try:
            while self.running:
                for fd, ev in self.poller.epoll.poll(0.05):
                    w = watch.get(fd)
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
            if self.stopped_by is not None:
                self.log(f"{signal.Signals(self.stopped_by).name}: stopping")
            self.shutdown()

    def _on_signal(self, signum, _frame):
        self.stopped_by = signum
        self.running = False
        self.stopping = True

    def shutdown(self) -> None:
        self.running = False
        self.stopping = True
        self.supervisor.stop()
        self.connections.shutdown()

    def _housekeeping(self, now: float) -> None:
        if self.parent_pid and os.getppid() != self.parent_pid:
            self.log("parent process is gone; stopping")
            self.running = False
        if self.st.conns:
            self.last_activity = now
        elif self.idle_exit_s and now - self.last_activity >= self.idle_exit_s:
            self.log(f"no connection for {self.idle_exit_s:g} s; stopping (idle exit)")
            self.running = False
        self.scheduler.expire(now)
        self.supervisor.check(now)
        self.connections.housekeeping(now)

    # ================================================================ requests
    def _on_conn(self, conn: Conn, events: int) -> None:
        if not trace.on:
            self._receive(conn)
            return
        t0, hdr = trace.clock(), None
        try:
            hdr = self._receive(conn)
        finally:
            # peer and seq: the span a traced host waits for before it merges (host/tracing.py)
            trace.complete("receive", t0, "front", {"peer": conn.pid, "seq": hdr[1]} if hdr else None, top=True)

    def _receive(self, conn: Conn):
        """Handle what the connection's socket has; the header of the request read, if one was."""
        if conn.outbox:
            # Writable again (or hung up): drain first.  Its requests are read
            # again only once every response it is owed has been taken.
            self.connections.flush(conn)
            return None
        try:
            data, fds, truncated = conn.ep.recv_ready()
        except PeerClosed:
            self.connections.close(conn)
            return None
        except (BlockingIOError, InterruptedError, Timeout):
            return None
        except OSError:
            self.connections.close(conn)
            return None
        try:
            if conn.inflight:
                self.supervisor.drain_for(conn)
            self._dispatch(conn, data, fds, truncated)
            return P.peek_header(data) if trace.on else None
        except Exception as e:  # a bug on one connection must not take the device down
            self.log(f"internal error on connection {conn.cid}: {e!r}")
            self.connections.close(conn)
        finally:
            for fd in fds:  # handlers take the fds they keep out of this list
                try:
                    os.close(fd)
                except OSError:
                    pass

    def _dispatch(self, conn: Conn, data: bytes, fds: list, truncated: bool) -> None:
        send = self.connections.send
        hdr = P.peek_header(data)
        if truncated:
            conn.last_error = (hdr[1] if hdr else 0, S.ERR_INVALID, f"datagram longer than {P.MAX_MSG} bytes")
            send(conn, P.error_response(hdr[0] if hdr else 0, hdr[1] if hdr else 0, S.ERR_INVALID))
            return
        if hdr is not None and hdr[0] == P.MsgType.GET_COST:
            self.supervisor.drain_all()  # the Cost of the call just answered may still be in its core's channel
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
                    self.apply(conn, actions)
                    return
        try:
            if hdr and hdr[0] & P.RESPONSE_BIT and hdr[2] == len(data):
                raise P.ProtocolError(f"0x{hdr[0]:04X} is not a request type", S.ERR_OP, hdr[1], hdr[0])
            req = P.decode(data)
        except P.ProtocolError as e:
            conn.last_error = (e.seq or 0, int(e.status), str(e))
            send(conn, P.error_response(e.msg_type, e.seq, e.status))
            return
        if trace.on:
            with trace.span(f"validate {req.NAME}", "front"):
                actions = self.handlers.handle(conn, req, fds, key)
        else:
            actions = self.handlers.handle(conn, req, fds, key)
        self.apply(conn, actions)

    # ================================================================ actions
    def apply(self, conn: Conn | None, actions) -> None:
        """Carry out what the handlers asked for (actions.py)."""
        for a in actions:
            if isinstance(a, Respond):
                if conn is not None:
                    self.connections.send(conn, a.msg.encode())
            elif isinstance(a, Submit):
                try:
                    if trace.on:
                        with trace.span("queue", "front"):
                            self.scheduler.submit(a.job)
                    else:
                        self.scheduler.submit(a.job)
                except Reject as e:
                    if a.job.req is not None:
                        self.apply(conn, failure(conn, a.job.req, e))
                    else:
                        conn.last_error = (a.job.rec.seq, int(e.status), str(e))
                        self.connections.send(conn, P.failure_response(a.job.req_type, a.job.rec.seq, e.status,
                                                                       **e.numbers).encode())
            elif isinstance(a, Forget):
                self.supervisor.forget(a)
            elif isinstance(a, Notify):
                self.supervisor.notify(a)
            elif isinstance(a, RespondTo):
                if not a.conn.closed:
                    self.connections.send(a.conn, a.msg.encode())
