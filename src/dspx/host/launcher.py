"""Which device a host entry point talks to, starting one when needed.

``resolve()`` returns the socket to talk to, in this order:

1. a socket the caller names (``socket=``, ``--socket``) — a device must listen there;
2. ``private=True`` (``--private``): a private device for this caller;
3. ``$DSPX_SOCKET`` — a device must listen there;
4. a private device when ``$DSPX_PRIVATE=1``, when the caller asks for a
   device of its own shape (``cores`` > 1, device arguments), or when the
   environment configures the device (``DEVICE_ENV``: the shared background
   device runs with the defaults);
5. the per-user default socket: the device listening there, else the
   background device, started now (``start_background``) and left running
   until it has had no connection for ``$DSPX_IDLE_EXIT`` seconds (300).

A private device runs on a socket of its own and stops when its owner closes.
"""
from __future__ import annotations

import fcntl
import logging
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time

from ..errors import DspxError
from ..transport import (TransportError, UntrustedPath, connect, default_socket_dir, is_listening, peer_cred,
                         serve_refusal, socket_dir, socket_path, user_socket_path)

START_TIMEOUT = 60.0
STOP_TIMEOUT = 15.0
PRIVATE_ENV = "DSPX_PRIVATE"
IDLE_ENV = "DSPX_IDLE_EXIT"
DEFAULT_IDLE_EXIT_S = 300.0
LOG_KEEP = 4 << 20  # a background device's log is moved aside (.1) past this size
# What the environment may set for a device: a command with any of these set
# gets a private device that inherits them, not the shared background one.
DEVICE_ENV = ("DSPX_COST_MODEL", "DSPX_TRACE", "DSPX_KERNEL_BACKEND", "DSPX_SANDBOX", "DSPX_FAULT_INJECTION",
              "DSPX_LOAD_PROBE", "DSPX_ORT_POOL", "DSPX_ORT_SPIN_US", "DSPX_SUBGRAPH_SPIN", "DSPX_SUBGRAPH_BLOCK_BASE")

log = logging.getLogger("dspx")


def _device_command(path: str, *args) -> list[str]:
    return [sys.executable, "-m", "dspx.device", "--socket", path, *map(str, args)]


def _wait_listening(proc: subprocess.Popen, path: str, log_tail, on_timeout) -> None:
    deadline = time.monotonic() + START_TIMEOUT
    while not is_listening(path):
        if proc.poll() is not None:
            raise DspxError(f"the simulated device failed to start (exit {proc.returncode}):\n{log_tail()}")
        if time.monotonic() > deadline:
            on_timeout()
            raise DspxError(f"the simulated device did not start within {START_TIMEOUT:.0f} s:\n{log_tail()}")
        time.sleep(0.01)


def _tail(path: str, n: int = 2000) -> str:
    try:
        with open(path, "rb") as f:
            f.seek(max(0, os.fstat(f.fileno()).st_size - n))
            return f.read().decode(errors="replace")
    except OSError:
        return ""


class PrivateDevice:
    """A device process owned by this host process."""

    def __init__(self, cores: int = 1, extra_args=()):
        self.dir = tempfile.mkdtemp(prefix="dspx-")
        os.chmod(self.dir, 0o700)
        self.path = os.path.join(self.dir, "dsp0.sock")
        self.log_path = os.path.join(self.dir, "device.log")
        self._log = open(self.log_path, "wb")
        args = _device_command(self.path, "--parent-pid", os.getpid(), "--cores", cores, *extra_args)
        self.proc = subprocess.Popen(args, stdin=subprocess.DEVNULL, stdout=self._log, stderr=self._log,
                                     start_new_session=True)
        _wait_listening(self.proc, self.path, self.log_tail, self.stop)

    def log_tail(self, n: int = 2000) -> str:
        return _tail(self.log_path, n)

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


def private_wanted() -> bool:
    """``$DSPX_PRIVATE`` set to anything but empty or 0."""
    return os.environ.get(PRIVATE_ENV, "").strip() not in ("", "0")


def idle_exit_s() -> float:
    """The background device's idle exit: ``$DSPX_IDLE_EXIT`` seconds (0: never), else 300."""
    text = os.environ.get(IDLE_ENV, "").strip()
    if not text:
        return DEFAULT_IDLE_EXIT_S
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not value >= 0:
        raise DspxError(f"{IDLE_ENV}={text!r} is not a number of seconds (0: the background device never "
                        f"stops on its own)")
    return value


def resolve(socket: str | None = None, *, private: bool | None = None, cores: int = 1,
            extra_args=()) -> tuple[str, PrivateDevice | None]:
    """(socket path, the private device started for the caller or None); see the module's docstring."""
    if socket:
        if private:
            raise DspxError("a private device and a named socket exclude each other: pass one of them")
        return _named(socket, "--socket"), None
    env = os.environ.get("DSPX_SOCKET")
    if not private and env:
        return _named(env, "DSPX_SOCKET"), None
    if private or private_wanted() or cores != 1 or extra_args or any(os.environ.get(v) for v in DEVICE_ENV):
        return (dev := PrivateDevice(cores, extra_args)).path, dev
    try:
        return start_background(), None
    except UntrustedPath as e:  # say so, and still do the caller's work
        log.warning("cannot start the background device (%s); using a private device for this command", e)
        return (dev := PrivateDevice()).path, dev


def _named(given: str, origin: str) -> str:
    """The socket a caller named, with a device listening on it; else a hint whose commands work."""
    path = socket_path(given)
    if is_listening(path):
        return path
    raise DspxError(no_device_hint(given, origin))


def no_device_hint(given: str, origin: str) -> str:
    """No device on ``given`` (named by ``origin``: "--socket" or "DSPX_SOCKET"):
    what to run instead, each suggested command one that is accepted."""
    path = socket_path(given)
    where = f"no device is listening on {path}"
    if path != os.path.abspath(given):
        where += f" ({os.path.dirname(os.path.abspath(given))} is shared: its sockets live in {os.path.dirname(path)})"
    refusal = serve_refusal(given)
    if refusal is None:
        start = f"start one with `dspx serve --socket {given}`"
    else:
        alt = os.path.join(default_socket_dir(), os.path.basename(path))
        if serve_refusal(alt) is not None:
            alt = '"$(mktemp -d)/dsp0.sock"'
        start = (f"a device cannot serve there ({refusal}): start one with `dspx serve --socket {alt}` and use "
                 f"that socket")
    if origin == "--socket":
        default = "or leave out --socket" + (" and unset DSPX_SOCKET" if os.environ.get("DSPX_SOCKET") else "")
    else:
        default = "or unset DSPX_SOCKET"
    return f"{where}: {start}, {default} to use the default device (started on first use)"


# ---------------------------------------------------------------- the background device

def _lock(f, path: str, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while True:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return
        except BlockingIOError:
            if time.monotonic() > deadline:
                raise DspxError(f"another command has been starting the background device for {timeout:.0f} s "
                                f"(it holds {path}); see its log beside it") from None
            time.sleep(0.02)


def _open_log(path: str):
    try:
        if os.path.getsize(path) > LOG_KEEP:
            os.replace(path, path + ".1")
    except OSError:
        pass
    return open(path, "ab")


def _background_env() -> dict:
    """The starter's environment without its device settings (the shared
    device runs with the defaults), and this very dspx importable from /."""
    env = {k: v for k, v in os.environ.items() if k not in DEVICE_ENV}
    env["DSPX_LOG_LEVEL"] = "info"  # its log file says when it started, stopped, and why
    here = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # .../src
    paths = [os.path.abspath(p) for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    env["PYTHONPATH"] = os.pathsep.join([here, *paths])
    return env


def start_background(path: str | None = None) -> str:
    """The device on the per-user default socket (or ``path``), started now
    if none listens there: detached (its own session, cwd /), logging to
    ``<socket>.log`` beside the socket, stopping after ``idle_exit_s()`` with
    no connection.  Two commands starting at once start one device: the
    second waits on ``<socket>.lock`` and finds it.  UntrustedPath when the
    socket's directory is not one to serve in."""
    path = socket_path(path or user_socket_path())
    if is_listening(path):
        return path
    idle = idle_exit_s()
    path = os.path.join(socket_dir(path), os.path.basename(path))  # UntrustedPath: not a directory to serve in
    stem = os.path.splitext(path)[0]
    with open(stem + ".lock", "a") as lock:
        _lock(lock, stem + ".lock", START_TIMEOUT + 10)
        if is_listening(path):  # the command we waited for started it
            return path
        log_path = stem + ".log"
        with _open_log(log_path) as out:
            proc = subprocess.Popen(_device_command(path, "--idle-exit", idle), stdin=subprocess.DEVNULL,
                                    stdout=out, stderr=out, start_new_session=True, cwd="/", env=_background_env())
        _wait_listening(proc, path, lambda: _tail(log_path), proc.kill)
    # Reaped here if it stops (idle) while this program still runs; else init reaps it.
    threading.Thread(target=proc.wait, name="dspx-background-reaper", daemon=True).start()
    log.info("started the background device on %s (pid %d; log %s; it stops after %g s without a connection, "
             "`dspx stop` ends it now)", path, proc.pid, log_path, idle)
    return path


def _alive(pid: int) -> bool:
    """Running (not gone, not a zombie waiting for its parent)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


def stop(path: str, timeout: float = STOP_TIMEOUT) -> int | None:
    """Stop the device listening on ``path`` (SIGTERM: it closes its
    connections and removes its socket); its pid, or None if none listens."""
    path = socket_path(path)
    if not is_listening(path):
        return None
    try:
        ep = connect(path, timeout=5.0)
    except UntrustedPath as e:
        raise DspxError(str(e)) from None
    except TransportError:
        return None  # it went away meanwhile
    try:
        pid = peer_cred(ep.sock)[0]  # the process that listens: the device's front
    finally:
        ep.close()
    try:
        os.kill(pid, signal.SIGTERM)
    except ProcessLookupError:
        return pid
    deadline = time.monotonic() + timeout
    while is_listening(path) or (os.path.exists(path) and _alive(pid)):  # gone once it removed its socket
        if time.monotonic() > deadline:
            raise DspxError(f"the device on {path} (pid {pid}) did not stop within {timeout:.0f} s of SIGTERM")
        time.sleep(0.05)
    return pid
