"""The device service front: receive → validate → dispatch → respond.

One epoll loop owns the listening socket, every connection and the
channels to the cores.  It decodes and validates each message, keeps
per-connection state (SPEC §9: a connection's buffers, printf ring, modules
and models are its own) and the device-wide accounting (carveout window, DDR
pool).  Work that runs module or operator code is a job for a core process;
the loop stays responsive while cores compute.
"""
from __future__ import annotations

import heapq
import itertools
import os
import select
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field

from ... import memory
from ...abi import layout, protocol as P
from ...memory import AddressError, AddressSpace, Region
from ...abi.protocol import Status
from ...transport import Endpoint, PeerClosed, Timeout, listen, peer_uid
from .. import jobs

S = Status
MAX_PENDING_PER_CONN = 256
MAX_PENDING = 4096
# The source travels to every core inside one internal job message, which
# must fit a socket buffer: op libraries are small Python files.
MAX_OPLIB_SOURCE = 128 << 10
# Resource limits (docs/reliability.md).  Past them a request is refused with
# a status instead of exhausting the front's file descriptors or the job
# channel (SCM_RIGHTS carries at most 253 fds per message).
MAX_CONNS = 512  # a connection past this is accepted and closed at once
MAX_BUFS_PER_CONN = 128  # BUF_ATTACH past this is ERR_NOMEM
# Responses the peer's socket could not take yet (it is not reading).  While a
# connection has any, the front stops reading its requests, so the queue is
# bounded by its jobs in flight; this is a safety net above that.
MAX_OUTBOX = MAX_PENDING_PER_CONN + 64
# A connection that closes while a core runs one of its jobs: the core is
# asked to abort the job (SIGUSR1, raised in the job's Python code); if the job
# has not ended after this grace the core is killed and restarted, so the
# connection's memory is freed within a second whatever the job does.
ABORT_GRACE_S = 0.3


class Reject(Exception):
    """A request refused with a status; ``numbers`` fill response fields."""

    def __init__(self, status: int, message: str, **numbers):
        super().__init__(message)
        self.status = status
        self.numbers = numbers


@dataclass
class Buffer:
    buf_id: int
    fd: int
    region: Region
    staging: bool = False
    kv_size: int = 0
    busy: int = 0  # jobs in flight that use it


@dataclass
class Conn:
    cid: int
    ep: Endpoint
    uid: int
    space: AddressSpace = field(default_factory=AddressSpace)
    bufs: dict = field(default_factory=dict)  # addr -> Buffer
    printf: tuple | None = None  # (addr, size)
    modules: set = field(default_factory=set)
    models: set = field(default_factory=set)
    last_error: tuple = (0, 0, "")
    inflight: int = 0
    closed: bool = False
    outbox: list = field(default_factory=list)  # encoded responses waiting for room in the socket

    @property
    def staging(self) -> Buffer | None:
        for b in self.bufs.values():
            if b.staging:
                return b
        return None

    def kv_region(self):
        st = self.staging
        if st is None or st.kv_size == 0:
            return None
        return st, st.region.end() - st.kv_size, st.kv_size


@dataclass
class ModuleRec:
    handle: int
    cid: int
    core: int
    generation: int
    kind: str  # "module" | "oplib"
    ddr_bytes: int = 0
    signature: dict | None = None
    info: dict = field(default_factory=dict)


@dataclass
class ModelRec:
    model_id: int
    cid: int
    core: int
    generation: int
    ddr_bytes: int
    num_constants: int


@dataclass(order=True)
class Job:
    sort_key: tuple
    msg: dict = field(compare=False)
    conn: Conn | None = field(compare=False, default=None)
    req: P.Message | None = field(compare=False, default=None)
    core: int = field(compare=False, default=P.CORE_ANY)
    bufs: list = field(compare=False, default_factory=list)
    on_done: object = field(compare=False, default=None)
    deadline: float | None = field(compare=False, default=None)
    queued_at: float = field(compare=False, default=0.0)


class CoreProc:
    def __init__(self, index: int, threads: int):
        self.index = index
        self.threads = threads
        self.generation = 0
        self.known_bufs: set[int] = set()
        self.running: Job | None = None
        self.ep: Endpoint | None = None
        self.proc: subprocess.Popen | None = None
        self.ready = False
        self.restarts = 0
        self.abort_job: "Job | None" = None  # the running job an abort was asked for
        self.abort_deadline = 0.0

    def start(self) -> None:
        parent, child = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        env = dict(os.environ)
        if self.threads:
            env.setdefault("OMP_NUM_THREADS", str(self.threads))
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "dspx.device.core.worker", "--fd", str(child.fileno()),
             "--index", str(self.index), "--threads", str(self.threads)],
            pass_fds=[child.fileno()], env=env, stdin=subprocess.DEVNULL)
        child.close()
        parent.setblocking(True)
        self.ep = jobs.endpoint(parent)
        self.generation += 1
        self.known_bufs = set()
        self.running = None
        self.ready = False
        self.abort_job = None

    def stop(self, timeout: float = 3.0) -> None:
        if self.ep:
            self.ep.close()
        if self.proc and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout)


class Service:
    def __init__(self, socket_path: str, carveout_size: int = memory.CARVEOUT_SIZE,
                 ddr_pool_size: int = memory.DDR_POOL_SIZE, cores: int = 1, threads: int = 0,
                 parent_pid: int | None = None, log=None):
        self.path = socket_path
        self.window = memory.FirstFit(memory.CARVEOUT_BASE, carveout_size)
        self.ddr = memory.Pool("ddr", memory.DDR_POOL_BASE, ddr_pool_size)
        self.started = time.monotonic()
        self.jobs_completed = 0
        self.jobs_failed = 0
        self.conns: dict[int, Conn] = {}
        self.modules: dict[int, ModuleRec] = {}
        self.models: dict[int, ModelRec] = {}
        self.op_table: dict[int, tuple] = {}  # cmd -> (name, latency_us, lib_handle)
        self.op_sources: dict[int, tuple[str, str]] = {}  # lib handle -> (source, filename)
        self.pending: list[Job] = []
        self._ids = itertools.count(1)
        self._job_ids = itertools.count(1)
        self._inflight: dict[int, Job] = {}
        threads = threads or max(1, (os.cpu_count() or 1) // max(1, cores))
        self.cores = [CoreProc(i, threads) for i in range(cores)]
        self.parent_pid = parent_pid
        self.epoll = select.epoll()
        self._watch: dict[int, tuple] = {}  # fd -> (callback, arg)
        self._handlers = {t.value: getattr(self, "_h_" + t.name.lower()) for t in P.MsgType}
        self.running = False
        self.log = log or (lambda *a: None)
        self._accept_paused = 0.0  # when accept() ran out of fds: retry after this time

    # ================================================================ lifecycle
    def serve_forever(self) -> None:
        self.running = True
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, self._on_signal)
        self.lsock = listen(self.path)
        self.lsock.setblocking(False)
        self._register(self.lsock, self._accept, None)
        for c in self.cores:
            self._start_core(c)
        next_check = 0.0
        try:
            while self.running:
                for fd, _ in self.epoll.poll(0.1):
                    w = self._watch.get(fd)
                    if w is not None:
                        try:
                            w[0](w[1])
                        except Exception as e:  # a bug in one callback must not take the device down
                            import traceback
                            self.log(f"internal error (device keeps serving): {e!r}\n{traceback.format_exc()}")
                now = time.monotonic()
                if now >= next_check:  # off the per-message path
                    try:
                        self._housekeeping()
                    except Exception as e:
                        import traceback
                        self.log(f"internal error in housekeeping (device keeps serving): {e!r}\n"
                                 f"{traceback.format_exc()}")
                    next_check = now + 0.05
        finally:
            self.shutdown()

    def _register(self, sock, callback, arg) -> None:
        self._watch[sock.fileno()] = (callback, arg)
        self.epoll.register(sock.fileno(), select.EPOLLIN)

    def _unregister(self, sock) -> None:
        fd = sock.fileno()
        if self._watch.pop(fd, None) is not None:
            try:
                self.epoll.unregister(fd)
            except (OSError, ValueError):
                pass

    def _on_signal(self, *_):
        self.running = False

    def shutdown(self) -> None:
        for c in self.cores:
            c.stop()
        for conn in list(self.conns.values()):
            self._close_conn(conn, notify_cores=False)
        try:
            self.lsock.close()
        except Exception:
            pass
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass

    def _housekeeping(self) -> None:
        if self.parent_pid and os.getppid() != self.parent_pid:
            self.log("parent process is gone; stopping")
            self.running = False
        now = time.monotonic()
        for job in [j for j in self.pending if j.deadline and j.deadline < now]:
            self.pending.remove(job)
            heapq.heapify(self.pending)
            self._finish(job, {"status": S.ERR_TIMEOUT, "error": "task timed out before a core could start it"})
        for c in self.cores:
            if c.proc and c.proc.poll() is not None and c.ready:
                self._core_died(c)
        self._check_aborts()
        if self._accept_paused and now >= self._accept_paused:
            self._accept_paused = 0.0
            self._register(self.lsock, self._accept, None)

    # ================================================================ cores
    def _start_core(self, c: CoreProc, wait: bool = True) -> None:
        c.start()
        self._register(c.ep.sock, self._on_core, c)
        if wait:
            # At start-up, block until the core says hello so the device never
            # answers a job before a core exists.  A restart does not block the
            # loop: the hello arrives through _on_core, jobs queue meanwhile.
            msg, _ = jobs.recv(c.ep, timeout=60)
            self._core_hello(c, msg)

    def _core_hello(self, c: CoreProc, msg: dict) -> None:
        if msg.get("kind") != "hello":
            raise RuntimeError(f"core {c.index} did not start: {msg}")
        c.ready = True
        for cmd, name, lat in msg.get("ops", ()):  # the firmware's built-in operators
            self.op_table.setdefault(cmd, (name, lat, 0))
        for handle, (src, fname) in sorted(self.op_sources.items()):
            jobs.send(c.ep, {"kind": "ops_load", "handle": handle, "source": src, "filename": fname,
                             "broadcast": True})

    def _core_died(self, c: CoreProc) -> None:
        code = c.proc.poll() if c.proc else None
        self.log(f"core {c.index} died (exit {code}); restarting")
        self._unregister(c.ep.sock)
        c.ep.close()
        job = c.running
        c.running = None
        c.ready = False
        c.known_bufs = set()  # its mappings died with it
        c.abort_job = None
        if job is not None:
            self._finish(job, {"status": S.ERR_CALL, "error": f"core {c.index} crashed while running this job "
                                                                f"(exit status {code}); it was restarted"})
        # Handles on that core die with it: later use is ERR_HANDLE, not misuse.
        for h, rec in list(self.modules.items()):
            if rec.core == c.index and rec.kind == "module":
                self._drop_module(rec)
        for mid, rec in list(self.models.items()):
            if rec.core == c.index:
                self._drop_model(rec)
        c.restarts += 1
        self._start_core(c, wait=False)
        self._schedule()

    def _on_core(self, c: CoreProc) -> None:
        try:
            msg, fds = jobs.recv(c.ep)  # epoll said readable: no poll needed
        except (PeerClosed, OSError, ValueError, EOFError):
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
        if not c.ready:  # a restarted core's hello
            try:
                self._core_hello(c, msg)
            except (RuntimeError, PeerClosed, OSError) as e:
                self.log(f"core {c.index} failed to restart: {e}")
                c.proc.kill()
                return
            self._schedule()
            return
        job = self._inflight.pop(msg.get("job"), None)
        if job is None:
            return
        c.running = None
        c.abort_job = None
        self._finish(job, msg)
        self._schedule()

    def _abort_jobs_of(self, conn: Conn) -> None:
        """Ask every core running a job of (closed) ``conn`` to abort it."""
        for c in self.cores:
            if c.running is not None and c.running.conn is conn and c.abort_job is not c.running:
                c.abort_job = c.running
                c.abort_deadline = time.monotonic() + ABORT_GRACE_S
                try:
                    os.kill(c.proc.pid, signal.SIGUSR1)
                except (ProcessLookupError, AttributeError):
                    pass

    def _check_aborts(self) -> None:
        now = time.monotonic()
        for c in self.cores:
            if c.abort_job is not None and c.running is c.abort_job and now >= c.abort_deadline:
                self.log(f"core {c.index}: job of a closed connection did not abort within "
                         f"{ABORT_GRACE_S} s; killing the core")
                c.abort_job = None
                try:
                    c.proc.kill()
                    c.proc.wait(5)
                except (ProcessLookupError, subprocess.TimeoutExpired):
                    pass
                self._core_died(c)

    def _send_to_core(self, c: CoreProc, msg: dict, bufs=()) -> None:
        new = list({b.buf_id: b for b in bufs if b.buf_id not in c.known_bufs}.values())
        msg["new_bufs"] = [(b.buf_id, b.region.size) for b in new]
        jobs.send(c.ep, msg, [b.fd for b in new])
        c.known_bufs.update(b.buf_id for b in new)

    def submit(self, job: Job) -> None:
        if len(self.pending) >= MAX_PENDING:
            raise Reject(S.ERR_BUSY, f"device queue is full ({MAX_PENDING} jobs)")
        if job.conn is not None:
            if job.conn.inflight >= MAX_PENDING_PER_CONN:
                raise Reject(S.ERR_BUSY, f"connection has {job.conn.inflight} jobs in flight "
                                         f"(limit {MAX_PENDING_PER_CONN})")
            job.conn.inflight += 1
        for b in job.bufs:
            b.busy += 1
        job.msg["job"] = next(self._job_ids)
        job.queued_at = time.monotonic()
        heapq.heappush(self.pending, job)
        self._schedule()

    def _schedule(self) -> None:
        idle = [c for c in self.cores if c.ready and c.running is None]
        if not idle or not self.pending:
            return
        rest = []
        while self.pending and idle:
            job = heapq.heappop(self.pending)
            c = next((c for c in idle if job.core in (P.CORE_ANY, c.index)), None)
            if c is None:
                rest.append(job)
                continue
            idle.remove(c)
            c.running = job
            job.msg["core_started_us"] = int((time.monotonic() - job.queued_at) * 1e6)
            self._inflight[job.msg["job"]] = job
            try:
                self._send_to_core(c, job.msg, job.bufs)
            except PeerClosed:
                self._core_died(c)
            except (OSError, ValueError) as e:  # e.g. too many fds for one message: fail the job, not the core
                c.running = None
                self.log(f"could not send a job to core {c.index}: {e!r}")
                self._finish(job, {"status": S.ERR_GENERIC, "error": f"could not hand the job to core "
                                                                      f"{c.index}: {e}"})
                idle.append(c)
        for job in rest:
            heapq.heappush(self.pending, job)

    def _finish(self, job: Job, result: dict) -> None:
        self._inflight.pop(job.msg.get("job"), None)
        for b in job.bufs:
            b.busy -= 1
        conn = job.conn
        if conn is not None:
            conn.inflight -= 1
        ok = result.get("status", S.ERR_GENERIC) == S.SUCCESS
        if job.msg["kind"] in ("infer", "rpc", "load", "model_load", "ops_load"):
            if ok:
                self.jobs_completed += 1
            else:
                self.jobs_failed += 1
        if job.on_done is not None:
            try:
                job.on_done(job, result)
            except Reject as e:
                self._respond_error(conn, job.req, e)
            except Exception as e:  # a bug here must not take the device down
                self._respond_error(conn, job.req, Reject(S.ERR_GENERIC, f"internal error: {e!r}"))
        if conn is not None and conn.closed and conn.inflight == 0:
            self._release_conn(conn)

    # ================================================================ connections
    def _accept(self, _=None) -> None:
        try:
            s, _ = self.lsock.accept()
        except (BlockingIOError, InterruptedError):
            return
        except OSError as e:  # EMFILE/ENFILE/ENOMEM: stop accepting for a moment instead of spinning or dying
            self.log(f"accept failed ({e}); pausing new connections for 100 ms")
            self._unregister(self.lsock)
            self._accept_paused = time.monotonic() + 0.1
            return
        if len(self.conns) >= MAX_CONNS:
            self.log(f"refused a connection: {len(self.conns)} open (limit {MAX_CONNS})")
            s.close()
            return
        uid = peer_uid(s)
        if uid != os.getuid():
            # Another user's process: refuse before reading anything from it.
            self.log(f"refused a peer of uid {uid}")
            s.close()
            return
        s.setblocking(False)
        conn = Conn(next(self._ids), Endpoint(s), uid)
        self.conns[conn.cid] = conn
        self._register(s, self._on_conn, conn)

    def _on_conn(self, conn: Conn) -> None:
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

    def _send(self, conn: Conn, data: bytes) -> None:
        if conn.closed:
            return
        if conn.outbox:  # keep the order of responses
            self._queue_out(conn, data)
            return
        try:
            conn.ep.sock.send(data)
        except BlockingIOError:
            # The peer is not reading: keep the response and stop reading its
            # requests until it does (EPOLLOUT tells us when).
            self._queue_out(conn, data)
            self._watch_events(conn, select.EPOLLOUT)
        except OSError:
            self._close_conn(conn)

    def _queue_out(self, conn: Conn, data: bytes) -> None:
        if len(conn.outbox) >= MAX_OUTBOX:
            self.log(f"connection {conn.cid} does not read its responses ({len(conn.outbox)} queued); closing it")
            self._close_conn(conn)
            return
        conn.outbox.append(data)

    def _flush(self, conn: Conn) -> None:
        while conn.outbox and not conn.closed:
            try:
                conn.ep.sock.send(conn.outbox[0])
            except BlockingIOError:
                return
            except OSError:
                self._close_conn(conn)
                return
            conn.outbox.pop(0)
        if not conn.closed:
            self._watch_events(conn, select.EPOLLIN)

    def _watch_events(self, conn: Conn, events: int) -> None:
        try:
            self.epoll.modify(conn.ep.sock.fileno(), events)
        except (OSError, ValueError):
            pass

    def _respond(self, conn: Conn, msg: P.Message) -> None:
        self._send(conn, msg.encode())

    def _respond_error(self, conn: Conn, req: P.Message, e: Reject) -> None:
        if conn is None:
            return
        conn.last_error = (req.seq, int(e.status), str(e))
        resp = P.failure(req, e.status)
        widths = dict(zip(resp.FIELDS, resp.BODY.format.lstrip("<")))
        for k, v in e.numbers.items():
            if k in widths:
                # Saturate: a figure from a damaged module (e.g. a 2^63-byte
                # segment) must not make the response unencodable.
                bits = 32 if widths[k] in "Ii" else 64
                lo, hi = (0, (1 << bits) - 1) if widths[k] in "IQ" else (-(1 << bits - 1), (1 << bits - 1) - 1)
                setattr(resp, k, min(max(int(v), lo), hi))
        self._respond(conn, resp)

    def _dispatch(self, conn: Conn, data: bytes, fds: list, truncated: bool) -> None:
        if truncated:
            hdr = P.peek_header(data)
            conn.last_error = (hdr[1] if hdr else 0, S.ERR_INVALID, f"datagram longer than {P.MAX_MSG} bytes")
            self._send(conn, P.error_response(hdr[0] if hdr else 0, hdr[1] if hdr else 0, S.ERR_INVALID))
            return
        try:
            hdr = P.peek_header(data)
            if hdr and hdr[0] & P.RESPONSE_BIT and hdr[2] == len(data):
                raise P.ProtocolError(f"0x{hdr[0]:04X} is not a request type", S.ERR_OP, hdr[1], hdr[0])
            req = P.decode(data)
        except P.ProtocolError as e:
            conn.last_error = (e.seq or 0, int(e.status), str(e))
            self._send(conn, P.error_response(e.msg_type, e.seq, e.status))
            return
        handler = self._handlers[req.TYPE]
        try:
            resp = handler(conn, req, fds)
        except Reject as e:
            self._respond_error(conn, req, e)
            return
        except Exception as e:  # never let one request take the service down
            self._respond_error(conn, req, Reject(S.ERR_GENERIC, f"internal error: {e!r}"))
            return
        if resp is not None:
            self._respond(conn, resp)

    def _close_conn(self, conn: Conn, notify_cores: bool = True) -> None:
        if conn.closed:
            return
        conn.closed = True
        conn.outbox.clear()
        self._unregister(conn.ep.sock)
        conn.ep.close()
        # Queued jobs of a closed connection will never be answered: drop them.
        mine = [j for j in self.pending if j.conn is conn]
        if mine:
            self.pending = [j for j in self.pending if j.conn is not conn]
            heapq.heapify(self.pending)
            for j in mine:
                for b in j.bufs:
                    b.busy -= 1
                conn.inflight -= 1
        if conn.inflight == 0:
            self._release_conn(conn, notify_cores)
        elif notify_cores:
            # Its job still runs on a core: abort it so the memory is freed now.
            self._abort_jobs_of(conn)

    def _release_conn(self, conn: Conn, notify_cores: bool = True) -> None:
        """Free everything the connection held: models, modules, buffers."""
        for mid in list(conn.models):
            self._unload_model(self.models[mid], notify_cores)
        for h in list(conn.modules):
            self._unload_module(self.modules[h], notify_cores)
        for addr in list(conn.bufs):
            self._detach(conn, addr, notify_cores)
        self.conns.pop(conn.cid, None)

    # ================================================================ memory
    def _detach(self, conn: Conn, addr: int, notify_cores: bool = True) -> None:
        b = conn.bufs.pop(addr)
        conn.space.remove(addr)
        if conn.printf and b.region.addr <= conn.printf[0] < b.region.end():
            conn.printf = None
        if notify_cores:
            for c in self.cores:
                if b.buf_id in c.known_bufs:
                    c.known_bufs.discard(b.buf_id)
                    try:
                        jobs.send(c.ep, {"kind": "drop", "bufs": [b.buf_id]})
                    except OSError:  # PeerClosed included: a dead core has no mapping to drop
                        pass
        try:
            b.region.mm.close()
        except BufferError:
            pass
        os.close(b.fd)
        self.window.free(addr)

    def _resolve(self, conn: Conn, addr: int, size: int, what: str) -> tuple[Buffer, int]:
        """Buffer and offset of [addr, addr+size) inside one of conn's buffers."""
        try:
            r = conn.space.find(addr, size)
        except AddressError:
            raise Reject(S.ERR_ADDR, f"{what} 0x{addr:x}+{size} is not inside a buffer of this connection") from None
        return conn.bufs[r.addr], addr - r.addr

    # ================================================================ handlers
    def _h_ping(self, conn, req, fds):
        return P.PingResp(seq=req.seq, version=P.VERSION, uptime_ms=self._uptime_ms())

    def _uptime_ms(self) -> int:
        return int((time.monotonic() - self.started) * 1000) & 0xFFFFFFFF

    def _h_get_status(self, conn, req, fds):
        return P.StatusResp(seq=req.seq, version=P.VERSION, uptime_ms=self._uptime_ms(),
                            jobs_completed=self.jobs_completed & 0xFFFFFFFF,
                            jobs_failed=self.jobs_failed & 0xFFFFFFFF)

    def _h_pool_status(self, conn, req, fds):
        import psutil

        return P.PoolStatusResp(
            seq=req.seq, ddr_total=self.ddr.size, ddr_used=self.ddr.used, ddr_peak=self.ddr.peak,
            carveout_total=self.window.size, carveout_used=self.window.used,
            l2_total=memory.L2_SIZE, l2_used=0, connections=len(self.conns),
            modules=sum(1 for m in self.modules.values() if m.kind == "module"),
            cores=len(self.cores), op_count=len(self.op_table),
            rss_bytes=sum(psutil.Process(c.proc.pid).memory_info().rss for c in self.cores
                          if c.proc and c.proc.poll() is None) + psutil.Process().memory_info().rss)

    def _h_get_error(self, conn, req, fds):
        seq, status, text = conn.last_error
        return P.GetErrorResp(seq=req.seq, error_seq=seq, error_status=status,
                              payload=text.encode()[:P.GetErrorResp.MAX_TEXT])

    def _h_buf_attach(self, conn, req, fds):
        if len(fds) != 1:
            raise Reject(S.ERR_INVALID, f"BUF_ATTACH needs exactly one fd, got {len(fds)}")
        if req.flags & ~P.ATTACH_STAGING:
            raise Reject(S.ERR_INVALID, f"unknown attach flags 0x{req.flags:x}")
        if len(conn.bufs) >= MAX_BUFS_PER_CONN:
            raise Reject(S.ERR_NOMEM, f"connection has {len(conn.bufs)} buffers attached (limit "
                                      f"{MAX_BUFS_PER_CONN})")
        staging = bool(req.flags & P.ATTACH_STAGING)
        if staging and conn.staging is not None:
            raise Reject(S.ERR_INVALID, "this connection already has a staging buffer")
        kv = req.kv_size if staging else 0
        if req.kv_size and not staging:
            raise Reject(S.ERR_INVALID, "kv_size must be zero unless attaching a staging buffer")
        if kv % 64 or kv > req.size:
            raise Reject(S.ERR_INVALID, f"KV region of {kv} bytes does not fit a {req.size}-byte staging buffer")
        fd = fds[0]
        try:
            mm = memory.map_attached(fd, req.size)
        except (ValueError, OSError) as e:
            raise Reject(S.ERR_INVALID, f"cannot attach: {e}") from None
        try:
            addr = self.window.alloc(req.size)
        except memory.WindowFull as e:
            mm.close()
            raise Reject(S.ERR_NOMEM, str(e)) from None
        fds.remove(fd)  # ours now
        region = Region(next(self._ids), addr, req.size, mm)
        conn.space.add(region)
        conn.bufs[addr] = Buffer(region.buf_id, fd, region, staging, kv)
        return P.BufAttachResp(seq=req.seq, dsp_addr=addr, size=req.size)

    def _h_buf_detach(self, conn, req, fds):
        b = conn.bufs.get(req.dsp_addr)
        if b is None:
            raise Reject(S.ERR_ADDR, f"0x{req.dsp_addr:x} is not the address of a buffer of this connection")
        if b.busy:
            raise Reject(S.ERR_BUSY, f"buffer 0x{req.dsp_addr:x} is in use by {b.busy} job(s)")
        self._detach(conn, req.dsp_addr)
        return P.BufDetachResp(seq=req.seq)

    def _h_set_printf_buf(self, conn, req, fds):
        if req.reserved:
            raise Reject(S.ERR_INVALID, "reserved must be zero")
        if req.printf_size < layout.PRINTF_MIN_SIZE:
            raise Reject(S.ERR_INVALID, f"printf buffer of {req.printf_size} bytes is too small")
        b, off = self._resolve(conn, req.printf_dsp_addr, req.printf_size, "printf buffer")
        conn.printf = (req.printf_dsp_addr, req.printf_size)
        import struct
        layout.ring_init(b.region.mm, off, req.printf_size)
        return P.SetPrintfBufResp(seq=req.seq)

    def _printf_target(self, conn: Conn, used: list):
        if conn.printf is None:
            return None
        b, off = self._resolve(conn, conn.printf[0], conn.printf[1], "printf buffer")
        used.append(b)
        return (b.buf_id, off, conn.printf[1])

    # ---------------------------------------------------------------- modules
    def _staged(self, conn: Conn, size: int, what: str) -> Buffer:
        st = conn.staging
        if st is None:
            raise Reject(S.ERR_INVALID, f"{what}: this connection has no staging buffer attached")
        room = st.region.size - st.kv_size
        if size == 0 or size > room:
            raise Reject(S.ERR_SIZE, f"{what}: {size} bytes staged but the staging area holds {room}")
        return st

    def _h_dyn_load(self, conn, req, fds):
        if req.reserved0 or req.reserved1:
            raise Reject(S.ERR_INVALID, "reserved fields must be zero")
        if req.flags & ~P.DYN_LOAD_OP_LIBRARY:
            raise Reject(S.ERR_INVALID, f"unknown DYN_LOAD flags 0x{req.flags:x}")
        st = self._staged(conn, req.elf_size, "DYN_LOAD")
        if req.flags & P.DYN_LOAD_OP_LIBRARY:
            src = bytes(st.region.mm[:req.elf_size])
            return self._load_ops(conn, req, src, "<staging>")
        handle = next(self._ids)
        core = 0
        msg = {"kind": "load", "handle": handle, "buf": st.buf_id, "offset": 0, "size": req.elf_size,
               "ddr_free": self.ddr.free, "ddr_total": self.ddr.size}

        def done(job, res):
            if res["status"] != S.SUCCESS:
                # the core knows requested/free; the pool's total is the front's
                total = res.get("oom_total") or (self.ddr.size if res["status"] == S.ERR_NOMEM else 0)
                raise Reject(res["status"], res.get("error", ""), oom_requested=res.get("oom_requested", 0),
                             oom_free=res.get("oom_free", 0), oom_total=total)
            need = res["text_size"] + res["data_size"] + res.get("workspace_bytes", 0)
            if not self.ddr.take(need):
                jobs.send(self.cores[core].ep, {"kind": "unload", "handle": handle})
                raise Reject(S.ERR_NOMEM, f"module needs {need} bytes of the DDR pool; {self.ddr.free} of "
                                          f"{self.ddr.size} free", oom_requested=need,
                             oom_free=self.ddr.free, oom_total=self.ddr.size)
            rec = ModuleRec(handle, conn.cid, core, self.cores[core].generation, "module", need,
                            res.get("signature"), res)
            self.modules[handle] = rec
            conn.modules.add(handle)
            io = res.get("io_meta") or {}
            self._respond(conn, P.DynLoadResp(
                seq=req.seq, module_handle=handle, text_size=res["text_size"], data_size=res["data_size"],
                io_input_bytes=io.get("input_bytes", 0), io_output_bytes=io.get("output_bytes", 0),
                io_num_inputs=io.get("num_inputs", 0), io_num_outputs=io.get("num_outputs", 0),
                io_flags=io.get("flags", 0)))

        self.submit(Job((0, next(self._job_ids)), msg, conn, req, core, [st], done))
        return None

    def _module(self, conn: Conn, handle: int, kind: str = "module") -> ModuleRec:
        rec = self.modules.get(handle)
        if rec is None or rec.kind != kind or (kind == "module" and rec.cid != conn.cid):
            raise Reject(S.ERR_HANDLE, f"unknown {'op library' if kind == 'oplib' else 'module'} handle {handle}")
        return rec

    def _h_dyn_unload(self, conn, req, fds):
        rec = self.modules.get(req.module_handle)
        if rec is not None and rec.kind == "oplib":
            self._unload_ops(rec)
            return P.DynUnloadResp(seq=req.seq)
        rec = self._module(conn, req.module_handle)
        self._drop_module(rec)  # the handle is dead from now on
        return self._answer_after_core(conn, req, rec, {"kind": "unload", "handle": rec.handle},
                                       P.DynUnloadResp(seq=req.seq))

    def _answer_after_core(self, conn, req, rec, msg: dict, resp: P.Message):
        """Answer an unload only once the core has freed what it held, so a
        POOL_STATUS that follows sees the memory back (queued behind the
        jobs already running there)."""
        c = self.cores[rec.core]
        if not (c.generation == rec.generation and c.ready):
            return resp  # the core that held it is gone, and its memory with it
        # Not tied to the connection: if it closes first, the unload still runs.
        self.submit(Job((0, next(self._job_ids)), msg, None, req, rec.core, [],
                        lambda job, res: self._respond(conn, resp)))
        return None

    def _unload_module(self, rec: ModuleRec, notify_cores: bool = True) -> None:
        if notify_cores:
            c = self.cores[rec.core]
            if c.generation == rec.generation and c.ready:
                jobs.send(c.ep, {"kind": "unload", "handle": rec.handle})
        self._drop_module(rec)

    def _drop_module(self, rec: ModuleRec) -> None:
        self.modules.pop(rec.handle, None)
        conn = self.conns.get(rec.cid)
        if conn:
            conn.modules.discard(rec.handle)
        self.ddr.give(rec.ddr_bytes)
        self._maybe_reset_pool()

    def _maybe_reset_pool(self) -> None:
        # SPEC §5: pools are reset when nothing is loaded, so back-to-back
        # load cycles start from the same figures.
        if not any(m.kind == "module" for m in self.modules.values()) and not self.models:
            self.ddr.used = 0

    def _h_model_load(self, conn, req, fds):
        if req.reserved0 or req.reserved1 or req.flags:
            raise Reject(S.ERR_INVALID, "flags and reserved fields must be zero")
        st = self._staged(conn, req.weights_size, "MODEL_LOAD")
        model_id = next(self._ids)
        core = 0
        msg = {"kind": "model_load", "model_id": model_id, "buf": st.buf_id, "offset": 0,
               "size": req.weights_size}

        def done(job, res):
            if res["status"] != S.SUCCESS:
                raise Reject(res["status"], res.get("error", ""))
            need = res["nbytes"]
            if not self.ddr.take(need):
                jobs.send(self.cores[core].ep, {"kind": "model_unload", "model_id": model_id})
                raise Reject(S.ERR_NOMEM, f"weights need {need} bytes of the DDR pool; {self.ddr.free} of "
                                          f"{self.ddr.size} free", oom_requested=need,
                             oom_free=self.ddr.free, oom_total=self.ddr.size)
            self.models[model_id] = ModelRec(model_id, conn.cid, core, self.cores[core].generation, need,
                                             res["num_constants"])
            conn.models.add(model_id)
            self._respond(conn, P.ModelLoadResp(seq=req.seq, model_id=model_id,
                                                num_constants=res["num_constants"]))

        self.submit(Job((0, next(self._job_ids)), msg, conn, req, core, [st], done))
        return None

    def _h_model_unload(self, conn, req, fds):
        rec = self.models.get(req.model_id)
        if rec is None or rec.cid != conn.cid:
            raise Reject(S.ERR_HANDLE, f"unknown model id {req.model_id}")
        self._drop_model(rec)
        return self._answer_after_core(conn, req, rec, {"kind": "model_unload", "model_id": rec.model_id},
                                       P.ModelUnloadResp(seq=req.seq))

    def _unload_model(self, rec: ModelRec, notify_cores: bool = True) -> None:
        c = self.cores[rec.core]
        if notify_cores and c.generation == rec.generation and c.ready:
            jobs.send(c.ep, {"kind": "model_unload", "model_id": rec.model_id})
        self._drop_model(rec)

    def _drop_model(self, rec: ModelRec) -> None:
        self.models.pop(rec.model_id, None)
        conn = self.conns.get(rec.cid)
        if conn:
            conn.models.discard(rec.model_id)
        self.ddr.give(rec.ddr_bytes)
        self._maybe_reset_pool()

    # ---------------------------------------------------------------- inference
    def _h_infer(self, conn, req, fds):
        if len(req.descs) != req.num_inputs:
            raise Reject(S.ERR_INVALID, f"num_inputs {req.num_inputs} but {len(req.descs)} descriptors inline")
        return self._infer(conn, req, req.descs)

    def _h_infer_large(self, conn, req, fds):
        if req.reserved:
            raise Reject(S.ERR_INVALID, "reserved must be zero")
        if req.num_inputs > 4096:
            raise Reject(S.ERR_INVALID, f"num_inputs {req.num_inputs} is beyond any module")
        if req.descs_size != req.num_inputs * P.TensorDesc.SIZE:
            raise Reject(S.ERR_INVALID, f"descs_size {req.descs_size} != num_inputs {req.num_inputs} x 80")
        b, off = self._resolve(conn, req.descs_addr, req.descs_size, "descriptor table")
        descs = P.decode_descs(b.region.mm, req.num_inputs, off)
        return self._infer(conn, req, descs)

    def _infer(self, conn: Conn, req, descs) -> None:
        rec = self._module(conn, req.module_handle)
        if req.flags & P.INFER_FLAGS_RESERVED:
            raise Reject(S.ERR_INVALID, f"INFER flags 0x{req.flags:08x} set reserved bits 17-31")
        kv_resident = bool(req.flags & P.FLAG_KV_RESIDENT)
        if req.model_id:
            m = self.models.get(req.model_id)
            if m is None or m.cid != conn.cid:
                raise Reject(S.ERR_HANDLE, f"unknown model id {req.model_id}")
        elif (rec.signature or {}).get("weights") == "separate":
            raise Reject(S.ERR_WEIGHTS, "module was compiled with separate weights: load them with "
                                        "MODEL_LOAD and pass the model id")
        used: list[Buffer] = []
        in_buf, in_off = self._resolve(conn, req.input_dsp_addr, req.input_size, "input range")
        res_buf, res_off = self._resolve(conn, req.result_dsp_addr, req.result_size, "result range")
        used += [in_buf, res_buf]
        kv = conn.kv_region()
        if kv_resident and kv is None:
            raise Reject(S.ERR_INVALID, "KV_RESIDENT needs a staging buffer with a KV region")
        sig_inputs = (rec.signature or {}).get("inputs")
        if sig_inputs is not None and len(sig_inputs) != len(descs):
            raise Reject(S.ERR_TENSOR, f"module takes {len(sig_inputs)} inputs, {len(descs)} given")
        inputs = []
        for i, d in enumerate(descs):
            why = d.check()
            if why:
                raise Reject(S.ERR_TENSOR, f"input {i}: {why}")
            if memory.in_range(d.data_addr, d.data_size, req.input_dsp_addr, req.input_dsp_addr + req.input_size):
                b, off = in_buf, in_off + (d.data_addr - req.input_dsp_addr)
            elif kv is not None and memory.in_range(d.data_addr, d.data_size, kv[1], kv[1] + kv[2]):
                b, off = kv[0], d.data_addr - kv[0].region.addr
            else:
                raise Reject(S.ERR_ADDR, f"input {i} data 0x{d.data_addr:x}+{d.data_size} is outside the input "
                                         f"range and the KV region")
            if sig_inputs is not None:
                want = sig_inputs[i]
                if list(want["shape"]) != list(d.shape) or want["dtype"] != d.dtype:
                    raise Reject(S.ERR_TENSOR, f"input {i} ({want.get('name', i)}): module expects "
                                               f"{want['dtype']}{list(want['shape'])}, got {d.dtype}{list(d.shape)}")
            used.append(b)
            inputs.append((b.buf_id, off, tuple(d.shape), d.dtype))
        msg = {"kind": "infer", "handle": rec.handle, "model_id": req.model_id, "inputs": inputs,
               "result": (res_buf.buf_id, res_off, req.result_size, req.result_dsp_addr),
               "kv": (kv[0].buf_id, kv[1] - kv[0].region.addr, kv[2], kv[1]) if kv else None,
               "kv_resident": kv_resident, "repeat": req.flags & P.REPEAT_MASK,
               "printf": self._printf_target(conn, used)}
        if kv:
            used.append(kv[0])
        resp_cls = P.InferResp if req.TYPE == P.MsgType.INFER else P.InferLargeResp

        def done(job, res):
            if res["status"] != S.SUCCESS:
                raise Reject(res["status"], res.get("error", ""), result_required=res.get("result_required", 0),
                             cycles=res.get("cycles", 0))
            descs_out = res["descs"]
            resp = resp_cls(seq=req.seq, cycles=res["cycles"], num_outputs=len(descs_out),
                            printf_size=res.get("printf_size", 0))
            if len(descs_out) <= P.MAX_INLINE_OUTPUTS:
                resp.descs = descs_out
            else:
                resp.descs_addr = res["desc_addr"]
                resp.descs_size = len(descs_out) * P.TensorDesc.SIZE
            self._respond(conn, resp)

        self.submit(Job((0, next(self._job_ids)), msg, conn, req, rec.core, used, done))
        return None

    # ---------------------------------------------------------------- custom ops
    def _h_ops_load(self, conn, req, fds):
        if req.flags or req.reserved:
            raise Reject(S.ERR_INVALID, "flags and reserved must be zero")
        if req.src_size == 0 or req.src_size > MAX_OPLIB_SOURCE:
            raise Reject(S.ERR_SIZE, f"op library source of {req.src_size} bytes (1..{MAX_OPLIB_SOURCE})")
        b, off = self._resolve(conn, req.src_dsp_addr, req.src_size, "op library source")
        return self._load_ops(conn, req, bytes(b.region.mm[off:off + req.src_size]), "<oplib>")

    def _load_ops(self, conn, req, src: bytes, filename: str):
        if len(src) > MAX_OPLIB_SOURCE:
            raise Reject(S.ERR_SIZE, f"op library source of {len(src)} bytes (1..{MAX_OPLIB_SOURCE})")
        try:
            source = src.decode("utf-8")
        except UnicodeDecodeError as e:
            raise Reject(S.ERR_LOAD, f"op library is not UTF-8 text (byte {e.start})") from None
        handle = next(self._ids)
        msg = {"kind": "ops_load", "handle": handle, "source": source, "filename": filename}

        def done(job, res):
            if res["status"] != S.SUCCESS:
                raise Reject(res["status"], res.get("error", ""), error_line=res.get("error_line", 0))
            self.op_sources[handle] = (source, filename)
            self.modules[handle] = ModuleRec(handle, conn.cid, 0, self.cores[0].generation, "oplib")
            for cmd, name, lat in res["ops"]:
                self.op_table[cmd] = (name, lat, handle)
            for c in self.cores[1:]:
                if c.ready:
                    jobs.send(c.ep, {"kind": "ops_load", "handle": handle, "source": source,
                                     "filename": filename, "broadcast": True})
            resp = P.OpsLoadResp(seq=req.seq, lib_handle=handle, num_ops=len(res["ops"]))
            if isinstance(req, P.DynLoad):
                resp = P.DynLoadResp(seq=req.seq, module_handle=handle)
            self._respond(conn, resp)

        self.submit(Job((0, next(self._job_ids)), msg, conn, req, 0, [], done))
        return None

    def _unload_ops(self, rec: ModuleRec) -> None:
        for c in self.cores:
            if c.ready:
                jobs.send(c.ep, {"kind": "ops_unload", "handle": rec.handle})
        for cmd in [c for c, v in self.op_table.items() if v[2] == rec.handle]:
            del self.op_table[cmd]
        self.op_sources.pop(rec.handle, None)
        self.modules.pop(rec.handle, None)

    def _h_ops_list(self, conn, req, fds):
        entries = sorted((cmd, lat, lib, 0, name) for cmd, (name, lat, lib) in self.op_table.items())
        page = entries[req.start:req.start + P.OpsListResp.MAX_ENTRIES]
        return P.OpsListResp(seq=req.seq, total=len(entries), count=len(page),
                             payload=P.OpsListResp.pack_entries(page))

    def _h_rpc(self, conn, req, fds):
        if req.cmd not in self.op_table:
            raise Reject(S.ERR_OP, f"no operator registered for command 0x{req.cmd:x}")
        if not (req.core == P.CORE_ANY or 0 <= req.core < len(self.cores)):
            raise Reject(S.ERR_INVALID, f"core {req.core} does not exist (device has {len(self.cores)})")
        if req.priority > 255:
            raise Reject(S.ERR_INVALID, f"priority {req.priority} outside 0..255")
        used: list[Buffer] = []
        in_buf, in_off = self._resolve(conn, req.input_dsp_addr, req.input_size, "task input")
        out_buf, out_off = self._resolve(conn, req.output_dsp_addr, req.output_size, "task output")
        used += [in_buf, out_buf]
        # The handler may map any other buffer of this connection (mem_map):
        # send the core the whole address space.
        used += [b for b in conn.bufs.values() if b not in used]
        regions = [(b.buf_id, b.region.addr, b.region.size) for b in conn.bufs.values()]
        msg = {"kind": "rpc", "cmd": req.cmd, "input": (in_buf.buf_id, in_off, req.input_size),
               "output": (out_buf.buf_id, out_off, req.output_size), "regions": regions,
               "printf": self._printf_target(conn, [])}
        deadline = time.monotonic() + req.timeout_ms / 1000 if req.timeout_ms else None

        def done(job, res):
            if res["status"] != S.SUCCESS:
                raise Reject(res["status"], res.get("error", ""), cycles=res.get("cycles", 0),
                             printf_size=res.get("printf_size", 0), return_value=res.get("return_value", 0))
            self._respond(conn, P.RpcResp(seq=req.seq, return_value=res["return_value"], core=res["core"],
                                          cycles=res["cycles"], printf_size=res.get("printf_size", 0),
                                          queued_us=job.msg.get("core_started_us", 0)))

        self.submit(Job((-req.priority, next(self._job_ids)), msg, conn, req, req.core, used, done, deadline))
        return None
