"""The core's planner: a process forked before the core's seccomp filter, for
the one step of the kernel library that needs the file system.

onnxruntime hands back a graph it optimized (the NCHWc layout plans of
``kernels.backends.nchwc_plan``) only by writing it to a file
(``SessionOptions.optimized_model_filepath``).  A core under its filter
creates no files, so it sends the one-op model here and gets the optimized
bytes back; the planner writes them in a private temporary directory and
does nothing else.  Its own filter refuses exec, sockets and the
administrative calls; it dies with its core (PR_SET_PDEATHSIG) and holds
none of the core's fds (no channel, no client socket, no buffer).
"""
from __future__ import annotations

import os
import signal
import socket
import struct
import threading

from ...transport import recv_exact

_HEAD = struct.Struct("<BQ")  # status (0 ok, 1 error text), length
TIMEOUT_S = 120


class Planner:
    def __init__(self):
        parent, child = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        self.pid = os.fork()
        if self.pid == 0:  # the planner
            parent.close()
            try:
                _serve(child)
            finally:
                os._exit(0)
        child.close()
        parent.settimeout(TIMEOUT_S)
        self.sock = parent
        self.lock = threading.Lock()

    def optimize(self, model: bytes) -> bytes:
        """What ``kernels.optimize_model`` returns, computed in the planner (the
        core hands this to ``kernels.configure``)."""
        with self.lock:
            try:
                self.sock.sendall(struct.pack("<Q", len(model)) + model)
                status, n = _HEAD.unpack(recv_exact(self.sock, "planner channel", _HEAD.size))
                data = recv_exact(self.sock, "planner channel", n)
            except (OSError, EOFError) as e:
                raise RuntimeError(f"the core's planner process did not answer ({e})") from None
        if status:
            raise RuntimeError(data.decode(errors="replace"))
        return data


def _serve(s: socket.socket) -> None:
    import ctypes

    from .. import sandbox
    ctypes.CDLL(None).prctl(1, int(signal.SIGKILL), 0, 0, 0)  # PR_SET_PDEATHSIG: die with the core
    keep = s.fileno()
    os.closerange(3, keep)
    os.closerange(keep + 1, 1 << 16)
    if sandbox.enabled():
        sandbox.install_planner()
    from . import kernels
    while True:
        try:
            (n,) = struct.unpack("<Q", recv_exact(s, "planner channel", 8))
            model = recv_exact(s, "planner channel", n)
        except EOFError:
            return
        try:
            out, status = kernels.optimize_model(model), 0
        except Exception as e:  # noqa: BLE001 - the core reports it
            out, status = f"{type(e).__name__}: {e}".encode(), 1
        s.sendall(_HEAD.pack(status, len(out)) + out)
