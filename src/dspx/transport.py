"""Message transport: AF_UNIX SOCK_SEQPACKET, one message per datagram.

The local stand-in for an rpmsg endpoint.  Datagrams keep message boundaries,
file descriptors (dmabufs) travel with SCM_RIGHTS, and the peer's uid is
checked with SO_PEERCRED.  A board backend (rpmsg_char) would provide the
same three calls: send, recv, close.
"""
from __future__ import annotations

import array
import errno
import os
import select
import socket
import struct
import time

from .abi.protocol import MAX_MSG

# Plain ints: socket's IntFlag members go through enum machinery on every use.
_TRUNC = int(socket.MSG_TRUNC)  # MSG_CTRUNC only means fds beyond max_fds were dropped (closed by the kernel)
_CLOEXEC = int(socket.MSG_CMSG_CLOEXEC)
_DONTWAIT = int(socket.MSG_DONTWAIT)
MAX_FDS = 4  # a protocol message carries at most one dmabuf; a few more are tolerated and closed


class TransportError(ConnectionError):
    pass


class PeerClosed(TransportError):
    """The other side closed the channel (or died)."""


class Timeout(TransportError, TimeoutError):
    pass


def recv_exact(s: socket.socket, what: str, n: int) -> bytes:
    """Exactly ``n`` bytes from stream socket ``s`` (EOFError naming ``what`` if it closes first)."""
    chunks, got = [], 0
    while got < n:
        b = s.recv(min(n - got, 1 << 20))
        if not b:
            raise EOFError(f"{what} closed")
        chunks.append(b)
        got += len(b)
    return b"".join(chunks)


def default_socket_path() -> str:
    """``$DSPX_SOCKET``, else ``${XDG_RUNTIME_DIR:-/tmp}/dspx-<uid>/dsp0.sock``."""
    env = os.environ.get("DSPX_SOCKET")
    if env:
        return env
    base = os.environ.get("XDG_RUNTIME_DIR") or "/tmp"
    return os.path.join(base, f"dspx-{os.getuid()}", "dsp0.sock")


def peer_cred(sock: socket.socket) -> tuple[int, int, int]:
    """(pid, uid, gid) of the process at the other end (SO_PEERCRED)."""
    creds = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    return struct.unpack("3i", creds)


def peer_uid(sock: socket.socket) -> int:
    return peer_cred(sock)[1]


class UntrustedPath(TransportError):
    """A socket directory another user could control, or a listener of another uid."""


def socket_dir(path: str, create: bool = True) -> str:
    """The socket's parent directory, checked like a file opened O_NOFOLLOW:
    a real directory (not a symlink), owned by us, mode 0700.  It is created
    (0700) when missing; an existing one is never chmodded or followed —
    anything else is refused (UntrustedPath), so a directory another user
    planted (say a symlinked ``dspx-<uid>`` in sticky /tmp) is not used."""
    d = os.path.dirname(os.path.abspath(path))
    if create:
        os.makedirs(os.path.dirname(d), exist_ok=True)
        try:
            os.mkdir(d, 0o700)
        except FileExistsError:
            pass
    try:
        fd = os.open(d, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as e:
        if e.errno in (errno.ELOOP, errno.ENOTDIR):
            raise UntrustedPath(f"socket directory {d} is a symlink or not a directory; refusing to use it") from None
        raise UntrustedPath(f"cannot open socket directory {d}: {e.strerror}") from None
    try:
        st = os.fstat(fd)
    finally:
        os.close(fd)
    if st.st_uid != os.getuid():
        raise UntrustedPath(f"socket directory {d} is owned by uid {st.st_uid}, not {os.getuid()}; refusing to use it")
    if st.st_mode & 0o777 != 0o700:
        raise UntrustedPath(f"socket directory {d} has mode {st.st_mode & 0o777:04o}, must be 0700; refusing to "
                            f"use it (chmod 700 it if it is yours)")
    return d


def listen(path: str, backlog: int = 64) -> socket.socket:
    """Bind a listening socket: parent directory checked by ``socket_dir``,
    socket 0600.  A stale socket file (nothing listening) is replaced; a
    live one is an error."""
    socket_dir(path)
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        st = None
    if st is not None:
        if is_listening(path):
            raise TransportError(f"a device is already listening on {path}")
        os.unlink(path)
    s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET | socket.SOCK_CLOEXEC)
    old = os.umask(0o177)
    try:
        s.bind(path)
    finally:
        os.umask(old)
    os.chmod(path, 0o600)
    s.listen(backlog)
    return s


def is_listening(path: str) -> bool:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET | socket.SOCK_CLOEXEC)
    s.settimeout(1.0)
    try:
        s.connect(path)
        return True
    except (BlockingIOError, InterruptedError):  # EAGAIN: its backlog is full, but a device listens
        return True
    except OSError:
        return False
    finally:
        s.close()


def _connect(s: socket.socket, path: str, timeout: float) -> None:
    """connect() that waits while the listener's backlog is full: on AF_UNIX
    a socket with a timeout gets EAGAIN at once instead of waiting (another
    client flooding the device must not make it look absent)."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            s.connect(path)
            return
        except (BlockingIOError, InterruptedError):
            if time.monotonic() >= deadline:
                raise TimeoutError(errno.ETIMEDOUT, "the device's accept backlog stayed full") from None
            time.sleep(0.005)


def check_peer_uid(uid: int, path: str, expected: int | None = None) -> None:
    """Refuse a listener that runs as another user: it could be anyone's
    stand-in for the device, and would receive our dmabufs."""
    expected = os.getuid() if expected is None else expected
    if uid != expected:
        raise UntrustedPath(f"the process listening on {path} runs as uid {uid}, not {expected}; refusing to "
                            f"talk to it (it is not your device)")


def connect(path: str, timeout: float = 5.0) -> "Endpoint":
    """Connect to a device, checking (SO_PEERCRED) that it runs as our uid."""
    s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET | socket.SOCK_CLOEXEC)
    s.settimeout(timeout)
    try:
        _connect(s, path, timeout)
        check_peer_uid(peer_uid(s), path)
    except UntrustedPath:
        s.close()
        raise
    except OSError as e:
        s.close()
        raise TransportError(f"cannot connect to device socket {path}: {e.strerror or e}") from None
    s.setblocking(True)
    s.settimeout(None)
    return Endpoint(s)


class Endpoint:
    """One end of a message channel."""

    def __init__(self, sock: socket.socket, max_msg: int = MAX_MSG, max_fds: int = MAX_FDS):
        self.sock = sock
        self.max_msg = max_msg
        self._cmsg_space = socket.CMSG_SPACE(max_fds * array.array("i").itemsize)
        self._rbuf = memoryview(bytearray(max_msg + 1))
        self._poll = select.poll()
        self._poll.register(sock, select.POLLIN | select.POLLHUP | select.POLLRDHUP)
        self._rcvtimeo = None  # SO_RCVTIMEO last set, in seconds

    def fileno(self) -> int:
        return self.sock.fileno()

    def send(self, data: bytes, fds=()) -> None:
        try:
            if fds:
                socket.send_fds(self.sock, [data], list(fds))
            else:
                self.sock.send(data)
        except (BrokenPipeError, ConnectionResetError) as e:
            raise PeerClosed(f"peer closed the channel ({e.strerror})") from None

    def recv(self, timeout: float | None = None, bufsize: int | None = None):
        """Receive one datagram: (data, fds, truncated).  ``truncated`` is set
        when the datagram was longer than ``bufsize`` (max_msg + 1 by
        default, so an oversized message is visible as such).  Raises
        PeerClosed on EOF and Timeout when nothing arrives in time."""
        if timeout is None or self.sock.gettimeout() == 0.0:  # non-blocking socket: wait in poll
            if timeout is not None and not self._poll.poll(0):
                deadline = time.monotonic() + timeout
                while not self._poll.poll(max(0, int((deadline - time.monotonic()) * 1000) + 1)):
                    if time.monotonic() >= deadline:
                        raise Timeout(f"no message within {timeout:.3g} s")
            return self.recv_ready(bufsize)
        if timeout <= 0:
            return self.recv_ready(bufsize, _DONTWAIT)
        # Block in recvmsg itself with a kernel timeout: one syscall per
        # message, like a bare ping-pong (a poll first costs a second wake-up).
        if timeout != self._rcvtimeo:
            sec, usec = int(timeout), int((timeout - int(timeout)) * 1e6)
            # struct timeval; {0, 0} would mean "wait for ever"
            self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, struct.pack("ll", sec, usec or (not sec)))
            self._rcvtimeo = timeout
        try:
            return self.recv_ready(bufsize)
        except Timeout:
            raise Timeout(f"no message within {timeout:.3g} s") from None

    def recv_ready(self, bufsize: int | None = None, flags: int = 0):
        size = bufsize or self.max_msg + 1
        if len(self._rbuf) < size:
            self._rbuf = memoryview(bytearray(size))
        try:
            # Into a buffer kept for the endpoint's life: a fresh 1 MiB bytes
            # object per internal job message cost an mmap/munmap each time.
            n, anc, flags, _ = self.sock.recvmsg_into((self._rbuf[:size],), self._cmsg_space, _CLOEXEC | flags)
            data = self._rbuf[:n].tobytes()
        except (ConnectionResetError, BrokenPipeError):
            raise PeerClosed("peer reset the channel") from None
        except OSError as e:
            if e.errno in (errno.EAGAIN, errno.EWOULDBLOCK):
                raise Timeout("no message ready") from None
            raise
        fds: list[int] = []
        for level, ctype, cdata in anc or ():
            if level == socket.SOL_SOCKET and ctype == socket.SCM_RIGHTS:
                a = array.array("i")
                a.frombytes(cdata[: len(cdata) - (len(cdata) % a.itemsize)])
                fds.extend(a)
        truncated = bool(flags & _TRUNC)
        if not data and not fds and not truncated and self._hung_up():
            raise PeerClosed("peer closed the channel")
        return data, fds, truncated

    def _hung_up(self) -> bool:
        # A zero-length datagram and EOF both read as b"": ask poll which it was.
        p = select.poll()
        p.register(self.sock, select.POLLIN | select.POLLRDHUP | select.POLLHUP)
        return any(ev & (select.POLLRDHUP | select.POLLHUP) for _, ev in p.poll(0))

    def close(self) -> None:
        try:
            self.sock.close()
        except OSError:
            pass
