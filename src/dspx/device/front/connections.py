"""The front's clients: accept or refuse them, send each its responses in
order without blocking, and close them.

A connection past a limit is refused politely (its requests answered
ERR_BUSY for a while); one whose peer does not read its responses keeps
them in its outbox and is not read meanwhile; closing one drops its queued
jobs, asks its core to abort the running one, and frees what it held once no
job of it runs any more.
"""
from __future__ import annotations

import errno
import os
import socket
import time

from ... import trace
from ...abi import protocol as P
from ...abi.protocol import Status as S
from ...transport import Endpoint, file_id, listen, peer_cred, unlink_if
from .actions import Forget
from .poller import IN, OUT
from .state import MAX_PENDING_PER_CONN, Conn

# Responses the peer's socket could not take yet (it is not reading).  While a
# connection has any, the front stops reading its requests, so the queue is
# bounded by its jobs in flight; this is a safety net above that.
MAX_OUTBOX = MAX_PENDING_PER_CONN + 64
# A connection refused at the limits is answered (ERR_BUSY, and GET_ERROR's
# text says which limit) for this long, then closed; at most this many wait.
REFUSED_LINGER_S = 2.0
MAX_REFUSED = 16


class Connections:
    def __init__(self, front, receive):
        """``receive(conn, events)``: the loop's callback for a connection's socket."""
        self.front = front
        self.st = front.st
        self.receive = receive
        self.lsock = None
        self._accept_paused = 0.0  # when accept() ran out of fds: retry after this time
        self._refused: dict[int, list] = {}  # fd -> [socket, close-by time, text, seq of the last refusal]
        self._spare_fd = -1  # given up when accept() runs out of fds, to refuse the newcomer

    def listen(self, path: str) -> None:
        lsock = listen(path)
        self.lsock = lsock
        self.bound = lsock.getsockname()  # where the socket really is (transport.socket_path)
        self._bound_id = file_id(self.bound)
        lsock.setblocking(False)
        self.front.poller.register(self.lsock.fileno(), self._accept, None)
        self._spare_fd = os.open(os.devnull, os.O_RDONLY | os.O_CLOEXEC)

    def housekeeping(self, now: float) -> None:
        for fd, (_, until, *_) in list(self._refused.items()):
            if now >= until:
                self._drop_refused(fd)
        if self._accept_paused and now >= self._accept_paused:
            self._accept_paused = 0.0
            self.front.poller.register(self.lsock.fileno(), self._accept, None)

    def shutdown(self) -> None:
        for s, *_ in self._refused.values():
            s.close()
        for conn in list(self.st.conns.values()):
            self.close(conn, notify_cores=False)
        if self.lsock is None:  # never bound: the path is not ours to remove
            return
        self.lsock.close()
        # Only our own socket: after an idle exit a new device may already be bound there.
        unlink_if(self.bound, self._bound_id)

    # ================================================================ accept, refuse
    def _accept(self, _arg, _events) -> None:
        log = self.front.log
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
                log(f"refused a connection: out of file descriptors ({e.strerror})")
                try:
                    self._spare_fd = os.open(os.devnull, os.O_RDONLY | os.O_CLOEXEC)
                except OSError:
                    pass
                return
            # ENOMEM or no spare: stop accepting for a moment instead of spinning or dying
            log(f"accept failed ({e}); pausing new connections for 100 ms")
            self.front.poller.unregister(self.lsock.fileno())
            self._accept_paused = time.monotonic() + 0.1
            return
        self.front.last_activity = time.monotonic()  # even a probe that closes at once: not idle
        pid, uid, _ = peer_cred(s)
        if uid != os.getuid():
            # Another user's process: refuse before reading anything from it.
            log(f"refused a peer of uid {uid}")
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
        self.front.poller.register(s.fileno(), self.receive, conn)  # the loop traces it ("receive")

    # A connection past a limit: its requests are answered ERR_BUSY (GET_ERROR
    # says which limit, with the numbers) until it closes or REFUSED_LINGER_S
    # pass; everyone already connected keeps their connection.
    def _refuse(self, s: socket.socket, why: str) -> None:
        self.front.log(f"refused a connection: {why}")
        if len(self._refused) >= MAX_REFUSED:
            s.close()
            return
        s.setblocking(False)
        fd = s.fileno()
        self._refused[fd] = [s, time.monotonic() + REFUSED_LINGER_S, why, 0]
        self.front.poller.register(fd, self._on_refused, fd)

    def _drop_refused(self, fd: int) -> None:
        s = self._refused.pop(fd)[0]
        self.front.poller.unregister(fd)
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

    # ================================================================ output
    def send(self, conn: Conn, data: bytes) -> None:
        t0 = trace.clock() if trace.on else 0
        try:
            self._send(conn, data)
        finally:
            if t0:
                trace.complete("respond", t0, "front")

    def _send(self, conn: Conn, data: bytes) -> None:
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
            self.front.poller.modify(conn.ep.fileno(), OUT)
        except OSError:
            self.close(conn)

    def _queue_out(self, conn: Conn, data: bytes) -> None:
        if len(conn.outbox) >= MAX_OUTBOX:
            self.front.log(f"connection {conn.cid} does not read its responses ({len(conn.outbox)} queued); "
                           f"closing it")
            self.close(conn)
            return
        conn.outbox.append(data)

    def flush(self, conn: Conn) -> None:
        while conn.outbox and not conn.closed:
            try:
                conn.ep.sock.send(conn.outbox[0], socket.MSG_DONTWAIT)
            except BlockingIOError:
                return
            except OSError:
                self.close(conn)
                return
            conn.outbox.pop(0)
        if not conn.closed:
            self.front.poller.modify(conn.ep.fileno(), IN)

    # ================================================================ close
    def close(self, conn: Conn, notify_cores: bool = True) -> None:
        if conn.closed:
            return
        conn.closed = True
        conn.outbox.clear()
        self.front.poller.unregister(conn.ep.fileno())
        try:
            # Cores that answer this client hold copies of its socket: shut it
            # down for all of them, so the peer sees the close now.
            conn.ep.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        conn.ep.close()
        self.front.scheduler.drop_queued(conn)  # they will never be answered
        if conn.inflight == 0:
            self.release(conn, notify_cores)
        else:  # its job still runs on a core: ask the core to abort it now
            self.front.scheduler.abort_running(conn)

    def release(self, conn: Conn, notify_cores: bool = True) -> None:
        """Free everything the connection held: models, modules, its own op libraries, buffers."""
        h = self.front.handlers
        actions = h.invalidate(conn)
        for mid in list(conn.models):
            actions += h.unload_model(self.st.models[mid])
        for handle in list(conn.modules):
            actions += h.unload_module(self.st.modules[handle])
        for handle in list(conn.oplibs):
            actions += h.unload_ops(self.st.modules[handle])
        for addr in list(conn.bufs):
            actions += h.detach(conn, addr)
        actions.append(Forget(conns=[conn.cid]))
        self.st.conns.pop(conn.cid, None)
        if notify_cores:
            self.front.apply(None, actions)
