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
import stat
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


def peer_cred(sock: socket.socket) -> tuple[int, int, int]:
    """(pid, uid, gid) of the process at the other end (SO_PEERCRED)."""
    creds = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    return struct.unpack("3i", creds)


def peer_uid(sock: socket.socket) -> int:
    return peer_cred(sock)[1]


class UntrustedPath(TransportError):
    """A socket directory another user could control, or a listener of another uid."""


def default_socket_dir() -> str:
    """The per-user socket directory: ``${XDG_RUNTIME_DIR:-/tmp}/dspx-<uid>``."""
    base = os.environ.get("XDG_RUNTIME_DIR") or "/tmp"
    return os.path.join(base, f"dspx-{os.getuid()}")


def user_socket_path() -> str:
    """The per-user default socket: ``${XDG_RUNTIME_DIR:-/tmp}/dspx-<uid>/dsp0.sock``."""
    return os.path.join(default_socket_dir(), "dsp0.sock")


def default_socket_path() -> str:
    """``$DSPX_SOCKET``, else the per-user socket (``user_socket_path``)."""
    return os.environ.get("DSPX_SOCKET") or user_socket_path()


def _shared(st: os.stat_result) -> bool:
    """A directory others may write to, sticky like /tmp (they cannot remove what is ours)."""
    return bool(st.st_mode & stat.S_ISVTX) and bool(st.st_mode & 0o022)


def socket_path(path: str) -> str:
    """Where the socket named ``path`` really lives: in a shared directory
    (sticky and writable by others, like /tmp) that is the private
    subdirectory ``dspx-<uid>`` of it, so ``--socket /tmp/x.sock`` means
    ``/tmp/dspx-<uid>/x.sock`` for the device and for every client alike."""
    path = os.path.abspath(path)
    d, name = os.path.split(path)
    try:
        st = os.stat(d)
    except OSError:
        return path
    return os.path.join(d, f"dspx-{os.getuid()}", name) if _shared(st) else path


def _check_dir(d: str, st: os.stat_result, last: bool) -> None:
    """One directory on the socket's way: ours or root's, and nobody else may
    write to it (a sticky one like /tmp is fine above the socket's own)."""
    uid = os.getuid()
    what = "socket directory" if last else "directory"  # else one above the socket's
    if not stat.S_ISDIR(st.st_mode):
        raise UntrustedPath(f"{d} is not a directory")
    if st.st_uid not in ((uid,) if last else (uid, 0)):
        raise UntrustedPath(f"{what} {d} is owned by uid {st.st_uid}, not {uid}: that user could replace the "
                            f"socket")
    if st.st_mode & 0o022 and not (stat.S_ISVTX & st.st_mode and not last):
        raise UntrustedPath(f"{what} {d} has mode {st.st_mode & 0o7777:04o}: others can write to it and could "
                            f"replace the socket")


def _walk(d: str, final: bool) -> str:
    """``d`` (absolute) with its symlinks resolved, each directory on the way
    checked by ``_check_dir`` (``final``: ``d`` is the socket's own directory);
    a symlink in a shared directory is followed only if it is ours (anyone may
    plant one there).  FileNotFoundError when a directory is missing."""
    todo, cur, hops = [p for p in d.split("/") if p], "/", 0
    cur_st = os.stat("/")
    _check_dir("/", cur_st, False)
    while todo:
        name = todo.pop(0)
        if name == ".":
            continue
        if name == "..":
            cur = os.path.dirname(cur)
            cur_st = os.stat(cur)
            continue
        nxt = os.path.join(cur, name)
        st = os.lstat(nxt)
        if stat.S_ISLNK(st.st_mode):
            hops += 1
            if hops > 40:
                raise UntrustedPath(f"too many symlinks on the way to {d}")
            if _shared(cur_st) and st.st_uid != os.getuid():
                raise UntrustedPath(f"{nxt} is a symlink of uid {st.st_uid} in shared {cur}; refusing to follow it")
            target = os.readlink(nxt)
            todo[:0] = [p for p in target.split("/") if p]
            if target.startswith("/"):
                cur, cur_st = "/", os.stat("/")
            continue
        _check_dir(nxt, st, final and not todo)
        cur, cur_st = nxt, st
    if final:  # where the path ended up, however it got there (a symlink to "..")
        _check_dir(cur, cur_st, True)
    return cur


def socket_dir(path: str, create: bool = True) -> str:
    """The checked, real directory of the socket ``path`` (as ``socket_path``
    places it): every directory from / down to it is yours or root's and
    nobody else can write to it (a sticky one like /tmp only above it), and a
    symlink on the way is followed only where nobody else could have planted
    it.  A missing last directory is created 0700 (with ``create``); nothing
    is ever chmodded.  Anything else: UntrustedPath, naming the directory."""
    d = os.path.dirname(socket_path(path))
    try:
        if create:
            os.makedirs(os.path.dirname(d), exist_ok=True)  # checked below, like the rest of the way
            _walk(os.path.dirname(d), final=False)  # before anything is made inside it
            try:
                os.mkdir(d, 0o700)
            except FileExistsError:
                pass
        return _walk(d, final=True)
    except FileNotFoundError as e:
        raise UntrustedPath(f"socket directory {e.filename or d} does not exist") from None
    except OSError as e:
        if isinstance(e, UntrustedPath):
            raise
        raise UntrustedPath(f"cannot use socket directory {e.filename or d}: {e.strerror}") from None


def serve_refusal(path: str) -> str | None:
    """Why a device could not serve on ``path`` (None: it could), without
    creating anything: what ``listen`` would refuse."""
    real = socket_path(path)
    d = os.path.dirname(real)
    try:
        if os.path.lexists(d):
            _walk(d, final=True)
        else:  # listen would create it (and any missing parent) in the nearest existing directory
            up = os.path.dirname(d)
            while not os.path.lexists(up):
                up = os.path.dirname(up)
            _walk(up, final=False)
    except UntrustedPath as e:
        return str(e)
    except OSError as e:
        return f"cannot use socket directory {e.filename or d}: {e.strerror}"
    try:
        st = os.lstat(real)
    except OSError:
        return None
    return None if stat.S_ISSOCK(st.st_mode) else _not_a_socket(real, st)


def _not_a_socket(path: str, st: os.stat_result) -> str:
    kind = ("a directory" if stat.S_ISDIR(st.st_mode) else "a symlink" if stat.S_ISLNK(st.st_mode)
            else "a regular file" if stat.S_ISREG(st.st_mode) else "not a socket")
    return f"{path} exists and is {kind}, not a socket"


def listen(path: str, backlog: int = 64) -> socket.socket:
    """Bind a listening socket, 0600, where ``socket_path`` places ``path``
    (its directory checked by ``socket_dir``; the name bound is
    ``lsock.getsockname()``).  A stale socket (a socket file no device
    listens on) is replaced; a live one, or anything that is not a socket (a
    user's file), is refused and kept."""
    real = os.path.join(socket_dir(path), os.path.basename(path))
    try:
        st = os.lstat(real)
    except FileNotFoundError:
        st = None
    if st is not None:
        if not stat.S_ISSOCK(st.st_mode):
            raise TransportError(f"{_not_a_socket(real, st)}: refusing to replace it (choose another --socket)")
        if is_listening(real):
            raise TransportError(f"a device is already listening on {real}")
        os.unlink(real)
    s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET | socket.SOCK_CLOEXEC)
    old = os.umask(0o177)
    try:
        s.bind(real)
    except OSError as e:
        s.close()
        raise TransportError(f"cannot bind {real}: {e.strerror}") from None
    finally:
        os.umask(old)
    os.chmod(real, 0o600)
    s.listen(backlog)
    return s


def file_id(path: str) -> tuple[int, int, int] | None:
    """(device, inode, change time) of ``path`` itself, None if it is gone: a
    file made later under that name differs, even if it got the same inode."""
    try:
        st = os.lstat(path)
    except OSError:
        return None
    return st.st_dev, st.st_ino, st.st_ctime_ns


def unlink_if(path: str, ident: tuple[int, int, int] | None) -> None:
    """Remove the socket this device bound, not one a successor bound there since."""
    if ident is not None and file_id(path) == ident:
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass


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
