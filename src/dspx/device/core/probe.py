"""Run untrusted code once in a throwaway child before the core runs it.

A module or a native op library can crash or hang in ways no check before
mapping sees (a damaged TVM module tree aborts the deserializer; an op
library's init may segfault).  A forked child (copy-on-write) takes that hit
instead of the core, and says how it ended.
"""
from __future__ import annotations

import os
import signal
import sys
import time
from dataclasses import dataclass
from typing import Callable

from . import sandbox


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
