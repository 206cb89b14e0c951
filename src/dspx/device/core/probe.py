"""Run untrusted code once in a throwaway child before the core runs it.

A module or a native op library can crash or hang in ways no check before
mapping sees (a damaged TVM module tree aborts the deserializer; an op
library's init may segfault).  A forked child (copy-on-write) takes that hit
instead of the core, and says how it ended.  Under the sandbox the core may
not fork: its probes are forked by its zygote (``Zygote``, below).
"""
from __future__ import annotations

import os
import signal
import socket
import struct
import sys
import threading
import time
from dataclasses import dataclass
from typing import Callable

from ...transport import recv_exact
from .. import sandbox


@dataclass(frozen=True)
class Outcome:
    hung: bool = False
    signal: int | None = None  # the signal that ended it
    exit_code: int = 0  # 0: fn returned; 1: fn raised; else how native code ended it
    # fn itself came back (returned or raised).  A child that exits with 0
    # without this — exit_group(0) in a constructor — did not load anything.
    returned: bool = False

    @property
    def signal_name(self) -> str:
        return signal.Signals(self.signal).name if self.signal else ""


def in_child(fn: Callable[[], object], timeout_s: int, keep: tuple[int, ...] = ()) -> Outcome:
    r, w = os.pipe2(os.O_CLOEXEC)
    pid = os.fork()
    if pid == 0:  # the child: never returns, never talks to the front
        os.close(r)
        code = 0
        try:
            import ctypes
            import faulthandler
            faulthandler.disable()  # a crash here is the expected answer, not news for the log
            # A native exit() (TVM's way of failing) would run the parent's C++
            # static destructors, which wait for thread pools that do not exist
            # here: leave at once instead.
            hook = ctypes.CFUNCTYPE(None, ctypes.c_void_p)(lambda _: os._exit(3))
            ctypes.CDLL(None).__cxa_atexit(hook, None, None)
        except (OSError, AttributeError):
            pass
        # The core's channel to the front, its status page, client sockets
        # and buffers: nothing the loaded code may reach.  Only stdio (for a
        # crash's message), the pipe that says "returned" and ``keep`` (the
        # code being loaded) stay open.
        first = 3
        for fd in sorted({w, *keep}):
            os.closerange(first, fd)
            first = fd + 1
        os.closerange(first, os.sysconf("SC_OPEN_MAX"))
        # A watchdog no Python code can block: SIGALRM's default action ends
        # the child even when it is stuck in native code.
        signal.signal(signal.SIGALRM, signal.SIG_DFL)
        signal.alarm(int(timeout_s))
        if sandbox.enabled():
            # Whatever the code tries beyond loading ends this child (SIGSYS):
            # the load is refused and the core never runs that code.
            sys.dont_write_bytecode = True  # an import here must not write a .pyc
            try:
                sandbox.install_probe()
            except OSError:
                pass
        try:
            fn()
        except BaseException:
            code = 1
        os.write(w, b"r")
        os._exit(code)
    os.close(w)
    deadline = time.monotonic() + timeout_s + 5
    done, status = 0, 0
    try:
        while not done:
            done, status = os.waitpid(pid, os.WNOHANG)
            if not done:
                if time.monotonic() > deadline:
                    return Outcome(hung=True)
                time.sleep(0.001)
    finally:
        if not done:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
        try:
            os.set_blocking(r, False)
            returned = os.read(r, 1) == b"r"
        except OSError:
            returned = False
        os.close(r)
    if os.WIFSIGNALED(status):
        sig = os.WTERMSIG(status)
        return Outcome(hung=True) if sig == signal.SIGALRM else Outcome(signal=sig)
    return Outcome(exit_code=os.WEXITSTATUS(status), returned=returned)


# ---------------------------------------------------------------- the zygote
# A core's filter refuses fork and signals to any other process, so its probes
# come from a zygote: a process the core forks at start-up, before its own
# filter (like planner.Planner), that runs no client code itself.  On the
# core's request it forks each probe (in_child), enforces the watchdog, kills
# a hung probe and reports the Outcome.  Requests over a stream socketpair:
# a header, then the module's bytes, or an op library's memfd by SCM_RIGHTS.
_REQUEST = struct.Struct("<BIqQ")  # kind, timeout s, ddr_free (-1: none), payload length
_ANSWER = struct.Struct("<BiiB")  # hung, signal (0: none), exit code, returned
MODULE, LIBRARY = 1, 2
EXIT_INTERRUPTED = 75  # as worker.EXIT_TORN_IMPORT: the core ended itself to restart clean
ANSWER_SLACK_S = 30  # on top of the probe's own limit: the zygote answers within timeout + 5 s


class Zygote:
    """The core's side: ``module`` and ``library`` send a probe request and
    return its Outcome.  ``confine`` runs in the zygote before it serves
    (its capabilities, Landlock and filter)."""

    def __init__(self, confine: Callable[[], None]):
        parent, child = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        self.pid = os.fork()
        if self.pid == 0:
            parent.close()
            try:
                _serve(child, confine)
            finally:
                os._exit(0)
        child.close()
        self.sock = parent
        self.lock = threading.Lock()

    def _ask(self, kind: int, timeout_s: int, ddr_free: int | None, payload: bytes = b"",
             fd: int | None = None) -> Outcome:
        head = _REQUEST.pack(kind, int(timeout_s), -1 if ddr_free is None else ddr_free, len(payload))
        with self.lock:
            self.sock.settimeout(timeout_s + ANSWER_SLACK_S)
            try:
                if fd is None:
                    self.sock.sendall(head)
                else:
                    self.sock.sendmsg([head], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, struct.pack("i", fd))])
                self.sock.sendall(payload)
                answer = recv_exact(self.sock, "probe zygote channel", _ANSWER.size)
                hung, sig, code, returned = _ANSWER.unpack(answer)
            except (OSError, EOFError) as e:
                raise RuntimeError(f"the core's probe process did not answer ({e})") from None
            except BaseException:
                # An abort (JobAborted from the front's signal) cut the exchange
                # short: the zygote's answer would be read as the next one's, and
                # this core cannot fork another.  End the core, as an abort in an
                # import does: the front fails the job with the abort's status
                # and restarts the core, with a new zygote.
                os.write(2, b"dspx-core: a load probe was stopped mid-exchange; ending this core so that "
                            b"it restarts with a new probe zygote\n")
                os._exit(EXIT_INTERRUPTED)
        return Outcome(hung=bool(hung), signal=sig or None, exit_code=code, returned=bool(returned))

    def module(self, elf: bytes, ddr_free: int | None, timeout_s: int) -> Outcome:
        return self._ask(MODULE, timeout_s, ddr_free, bytes(elf))

    def library(self, fd: int, timeout_s: int) -> Outcome:
        return self._ask(LIBRARY, timeout_s, None, fd=fd)


def module_probe(elf, ddr_free: int | None) -> Callable[[], object]:
    """What the probe of a module runs: the whole load, then unload.  The
    kernel library is registered here, before the fork: the child must do
    no first-time set-up."""
    from . import kernels, loader
    global _kernels_registered
    if not _kernels_registered:
        kernels.register_all()
        _kernels_registered = True
    names = kernels.names()

    def load():
        _die_with_parent()
        loader.load_module(elf, names, ddr_free=ddr_free).unload()
    return load


def _die_with_parent() -> None:
    """A probe child ends with the zygote that forked it (which ends with its core)."""
    import ctypes
    ctypes.CDLL(None).prctl(1, int(signal.SIGKILL), 0, 0, 0)  # PR_SET_PDEATHSIG


_kernels_registered = False


def _serve(s: socket.socket, confine: Callable[[], None]) -> None:
    _die_with_parent()  # with the core
    keep = s.fileno()
    os.closerange(3, keep)
    os.closerange(keep + 1, 1 << 16)
    confine()
    from . import native
    while True:
        try:
            msg, anc, _, _ = s.recvmsg(_REQUEST.size, socket.CMSG_SPACE(4))
            if not msg:
                return
            msg += recv_exact(s, "probe zygote channel", _REQUEST.size - len(msg))
            kind, timeout_s, ddr_free, n = _REQUEST.unpack(msg)
            payload = recv_exact(s, "probe zygote channel", n)
        except EOFError:
            return
        fds = [struct.unpack("i", data[:4])[0] for level, typ, data in anc
               if level == socket.SOL_SOCKET and typ == socket.SCM_RIGHTS and len(data) >= 4]
        try:
            if kind == MODULE:
                out = in_child(module_probe(payload, None if ddr_free < 0 else ddr_free), timeout_s)
            elif kind == LIBRARY and fds:
                out = in_child(native.library_probe(f"/proc/self/fd/{fds[0]}"), timeout_s, keep=(fds[0],))
            else:
                out = Outcome(exit_code=2)
        except Exception:  # noqa: BLE001 - set-up failed before the fork: not a probe that returned
            out = Outcome(exit_code=2)
        finally:
            for fd in fds:
                os.close(fd)
        s.sendall(_ANSWER.pack(out.hung, out.signal or 0, out.exit_code, out.returned))


zygote: Zygote | None = None  # the core's, once its sandbox is on (worker.CoreWorker._contain)


def run_module(elf, ddr_free: int | None, timeout_s: int) -> Outcome:
    """Probe loading a module: in the zygote, or (no sandbox) a fork of this process."""
    if zygote is not None:
        return zygote.module(elf, ddr_free, timeout_s)
    return in_child(module_probe(elf, ddr_free), timeout_s)


def run_library(fd: int, timeout_s: int) -> Outcome:
    """Probe an op library's load and init (its bytes in memfd ``fd``), as run_module."""
    if zygote is not None:
        return zygote.library(fd, timeout_s)
    from . import native
    return in_child(native.library_probe(f"/proc/self/fd/{fd}"), timeout_s, keep=(fd,))
