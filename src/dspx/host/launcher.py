"""The embedded default: start a private simulated device when none is running.

``resolve()`` returns the socket to talk to.  An explicit socket (argument or
``$DSPX_SOCKET``) must have a device listening; otherwise the per-user default
socket is used when a device listens there, and if not, a private device is
started on a socket of its own and stopped when its owner closes.
"""
from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time

from ..errors import DspxError
from ..transport import default_socket_path, is_listening

START_TIMEOUT = 60.0


class PrivateDevice:
    """A device process owned by this host process."""

    def __init__(self, cores: int = 1, extra_args=()):
        self.dir = tempfile.mkdtemp(prefix="dspx-")
        os.chmod(self.dir, 0o700)
        self.path = os.path.join(self.dir, "dsp0.sock")
        self.log_path = os.path.join(self.dir, "device.log")
        self._log = open(self.log_path, "wb")
        args = [sys.executable, "-m", "dspx.device", "--socket", self.path, "--parent-pid", str(os.getpid()),
                "--cores", str(cores), *map(str, extra_args)]
        self.proc = subprocess.Popen(args, stdin=subprocess.DEVNULL, stdout=self._log, stderr=self._log,
                                     start_new_session=True)
        deadline = time.monotonic() + START_TIMEOUT
        while not is_listening(self.path):
            if self.proc.poll() is not None:
                raise DspxError(f"the simulated device failed to start (exit {self.proc.returncode}):\n"
                                f"{self.log_tail()}")
            if time.monotonic() > deadline:
                self.stop()
                raise DspxError(f"the simulated device did not start within {START_TIMEOUT:.0f} s")
            time.sleep(0.01)

    def log_tail(self, n: int = 2000) -> str:
        try:
            with open(self.log_path, "rb") as f:
                return f.read()[-n:].decode(errors="replace")
        except OSError:
            return ""

    def stop(self, timeout: float = 5.0) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(timeout)
        self._log.close()
        shutil.rmtree(self.dir, ignore_errors=True)


def resolve(socket: str | None = None, **device_opts) -> tuple[str, PrivateDevice | None]:
    explicit = socket or os.environ.get("DSPX_SOCKET")
    if explicit:
        if not is_listening(explicit):
            raise DspxError(f"no device is listening on {explicit} (start one with `dspx serve --socket "
                            f"{explicit}`, or unset DSPX_SOCKET to use a private simulated device)")
        return explicit, None
    path = default_socket_path()
    if is_listening(path):
        return path, None
    dev = PrivateDevice(**device_opts)
    return dev.path, dev
