"""The core spawner: the one process of the device that may still exec.

The front's seccomp filter (device/sandbox.py ``front_program``) forbids
execve and new sockets once it has started, so it cannot start a core
itself.  At start-up, before its filter and before any client connects,
the front forks this spawner (it holds no client state, and closes every
fd but its channel).  On request (a core index, nothing else: it execs only
the core commands fixed when it was forked) it creates the core's
SEQPACKET socketpair and status memfd and starts the core with
clone(CLONE_PARENT), so the core is the front's own child: the front waits
for it (exit status), signals it, and the core's PR_SET_PDEATHSIG follows
the front.  It hands back the pid and the front's ends (SCM_RIGHTS).

If the spawner dies, the device keeps serving with the cores it has; a core
that dies after that cannot be restarted (the front logs it).
"""
from __future__ import annotations

import ctypes
import os
import signal
import socket
import struct
import subprocess
import time

from .. import jobs

SPAWN_TIMEOUT_S = 10.0  # the spawner answers within milliseconds: clone, not the core's start-up
_REQ = struct.Struct("<I")  # core index
_RESP = struct.Struct("<ii")  # pid (> 0) or -errno, and unused
CLONE_PARENT, SIGCHLD = 0x00008000, 17
SYS_CLONE, PR_SET_PDEATHSIG, PR_SET_NAME = 56, 1, 15


class SpawnerGone(OSError):
    """The spawner has died or stopped answering: no core can be started any more."""


class ChildProc:
    """A core started by the spawner and parented to the front: the part of
    subprocess.Popen the front uses (poll, wait, terminate, kill)."""

    def __init__(self, pid: int):
        self.pid = pid
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            try:
                pid, status = os.waitpid(self.pid, os.WNOHANG)
            except ChildProcessError:  # reaped elsewhere: gone, status unknown
                self.returncode = -1
            else:
                if pid:
                    self.returncode = os.waitstatus_to_exitcode(status)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = time.monotonic() + (timeout if timeout is not None else 3600.0)
        while self.poll() is None:
            if time.monotonic() >= deadline:
                raise subprocess.TimeoutExpired(f"core pid {self.pid}", timeout)
            time.sleep(0.005)
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:  # not reaped: the pid is still this process
            os.kill(self.pid, sig)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


class Spawner:
    """The front's handle on its spawner process."""

    def __init__(self, commands: dict[int, tuple[list[str], dict]]):
        """``commands``: per core index, the argv and environment it is started with."""
        front, child = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        pid = os.fork()
        if pid == 0:  # the spawner
            code = 1
            try:
                front.close()
                _serve(child, commands)
                code = 0
            finally:
                os._exit(code)
        child.close()
        self.proc = ChildProc(pid)
        self.chan = front
        self.gone = ""  # why it cannot spawn any more ("" while it can)

    def spawn(self, index: int):
        """Start core ``index``: (ChildProc, the front's channel socket, the status memfd)."""
        if self.gone:
            raise SpawnerGone(self.gone)
        try:
            self.chan.settimeout(SPAWN_TIMEOUT_S)
            self.chan.send(_REQ.pack(index))
            data, fds, _, _ = socket.recv_fds(self.chan, _RESP.size, 2)
        except OSError as e:  # socket.timeout included
            self._lost(f"it did not answer ({e!r})")
        if len(data) != _RESP.size:
            for fd in fds:
                os.close(fd)
            self._lost("it closed its channel" if not data else f"it sent {len(data)} bytes")
        pid, _ = _RESP.unpack(data)
        if pid <= 0:
            raise OSError(-pid, f"the spawner could not start core {index}: {os.strerror(-pid)}")
        if len(fds) != 2:
            for fd in fds:
                os.close(fd)
            self._lost(f"it sent {len(fds)} fds with core {index}")
        return ChildProc(pid), socket.socket(fileno=fds[0]), fds[1]

    def _lost(self, why: str):
        self.gone = f"the core spawner (pid {self.proc.pid}) is gone: {why}"
        self.proc.kill()
        raise SpawnerGone(self.gone)

    def check(self) -> str:
        """'' while the spawner lives; once it has died, why (once; it is reaped)."""
        if self.gone or self.proc.poll() is None:
            return ""
        self.gone = f"the core spawner (pid {self.proc.pid}) died (exit {self.proc.returncode})"
        return self.gone

    def stop(self, timeout: float = 3.0) -> None:
        self.chan.close()  # it exits on EOF
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(timeout)


# ---------------------------------------------------------------- the spawner process

def _serve(chan: socket.socket, commands: dict) -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    front = os.getppid()
    libc.prctl(PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0)  # dies with the front
    libc.prctl(PR_SET_NAME, b"dspx-spawner", 0, 0, 0)
    if os.getppid() != front:
        return
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the group: the front decides
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    keep = chan.fileno()
    os.closerange(3, keep)
    os.closerange(keep + 1, 1 << 20)  # the front's epoll, memfds, spare fd: none of them are ours
    chan.settimeout(None)
    clone = ctypes.PyDLL(None, use_errno=True).syscall  # PyDLL: the GIL stays held across the clone
    clone.restype = ctypes.c_long
    while True:
        try:
            data = chan.recv(64)
        except OSError:
            return
        if len(data) != _REQ.size:
            return  # EOF (the front closed) or not the front's request
        (index,) = _REQ.unpack(data)
        if index not in commands:
            chan.send(_RESP.pack(-22, 0))  # EINVAL
            continue
        argv, env = commands[index]
        try:
            parent, child = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        except OSError as e:
            chan.send(_RESP.pack(-(e.errno or 5), 0))
            continue
        try:
            status_fd = os.memfd_create(f"dspx-core{index}-status", os.MFD_CLOEXEC)
            os.ftruncate(status_fd, jobs.STATUS_SIZE)
            args = [*argv, "--fd", str(child.fileno()), "--status-fd", str(status_fd)]
            # clone(CLONE_PARENT): the core is the front's child, not ours
            pid = clone(ctypes.c_long(SYS_CLONE), ctypes.c_long(CLONE_PARENT | SIGCHLD), ctypes.c_long(0),
                        ctypes.c_long(0), ctypes.c_long(0), ctypes.c_long(0))
            if pid == 0:
                try:
                    os.set_inheritable(child.fileno(), True)
                    os.set_inheritable(status_fd, True)
                    null = os.open(os.devnull, os.O_RDONLY)
                    os.dup2(null, 0)
                    os.execve(argv[0], args, env)
                finally:
                    os._exit(127)
            if pid < 0:
                err = ctypes.get_errno() or 11
                chan.send(_RESP.pack(-err, 0))
                os.close(status_fd)
                continue
            socket.send_fds(chan, [_RESP.pack(pid, 0)], [parent.fileno(), status_fd])
            os.close(status_fd)
        except OSError as e:
            try:
                chan.send(_RESP.pack(-(e.errno or 5), 0))
            except OSError:
                return
        finally:
            parent.close()
            child.close()
