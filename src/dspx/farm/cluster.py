"""A farm's cluster: start a local one (on loopback, or on an address other
machines join it at: ``nodes.py``), find a running one, connect to it, stop
it.

A local farm is one Ray head node, started as ``ray start --head --block``
in its own session (so it outlives ``dspx farm up``, and SIGTERM to that one
process stops everything Ray started), with ``dspx:<key>`` resources for its
devices, no dashboard, and one detached device actor per device.  Commands
find it the way they find a device: ``--farm ADDRESS``, else ``$DSPX_FARM``,
else the farm ``dspx farm up`` recorded in the per-user directory.
"""
from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from ..errors import DspxError

DEFAULT_KEY = "sim"
NAMESPACE = "dspx-farm"
START_TIMEOUT = 300.0   # the head, then every device (a loaded machine takes long to start a core)
STOP_GRACE = 5.0  # seconds Ray's processes get to exit on SIGTERM (ray stop gives 16)
OBJECT_STORE_BYTES = 512 << 20  # Ray's default is 30 % of RAM; a farm's items are small


class FarmError(DspxError):
    """A farm that is not there, not answering, or not ready."""


def state_path() -> Path:
    """Where ``dspx farm up`` records its farm: beside the per-user device socket."""
    base = os.environ.get("XDG_RUNTIME_DIR") or "/tmp"
    return Path(base) / f"dspx-{os.getuid()}" / "farm.json"


@dataclass
class Farm:
    """A running farm: its Ray address and, when this machine started it,
    the head process and its directory (Ray's session, logs)."""

    address: str
    pid: int = 0
    dir: str = ""
    key: str = DEFAULT_KEY
    devices: int = 0
    node: str = ""  # the Ray node id when this machine joined the farm (`dspx farm join`), else ""
    auth: str = ""  # "token": the farm takes only processes holding its token (RAY_AUTH_MODE=token)

    def alive(self) -> bool:
        if not self.pid:
            return _answers(self.address)
        try:
            os.kill(self.pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:  # another user's process under a reused pid
            return False
        return True

    def save(self) -> None:
        path = state_path()
        path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(asdict(self)))
        os.replace(tmp, path)

    def stop(self, grace: float = STOP_GRACE) -> None:
        """Stop a farm this machine started: SIGTERM to every process of the
        head's session (Ray's servers and workers; the devices, in sessions of
        their own, exit with the worker that started them), SIGKILL to those
        still there after ``grace`` seconds, as ``ray stop`` does."""
        if not self.pid:
            raise FarmError(f"the farm at {self.address} was not started by `dspx farm up` here: stop it where it "
                            f"was started")
        for sig, wait in ((signal.SIGTERM, grace), (signal.SIGKILL, 10.0)):
            if not _signal_session(self.pid, sig, wait):
                break
        if self.dir:
            shutil.rmtree(self.dir, ignore_errors=True)  # made by start(): Ray's session, logs, the devices' sockets
        saved = _read_state()
        if saved is not None and saved.address == self.address and saved.pid == self.pid:
            state_path().unlink(missing_ok=True)


def _session_pids(sid: int) -> list[int]:
    import psutil

    pids = []
    for p in psutil.process_iter():
        try:
            if os.getsid(p.pid) == sid and p.status() != psutil.STATUS_ZOMBIE:
                pids.append(p.pid)
        except (ProcessLookupError, PermissionError, psutil.Error):
            pass
    return pids


def _signal_session(sid: int, sig: int, wait: float) -> bool:
    """Send ``sig`` to the processes of session ``sid`` (the session
    start() made); True when some are still there after ``wait`` seconds."""
    for pid in _session_pids(sid):
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            pass
    deadline = time.monotonic() + wait
    while True:
        try:
            os.waitpid(sid, os.WNOHANG)  # the head is our child when this process started it
        except ChildProcessError:
            pass
        if not _session_pids(sid):
            return False
        if time.monotonic() > deadline:
            return True
        time.sleep(0.2)


def _free_port() -> int:
    """A loopback TCP port free now (Ray binds it a moment later)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _answers(address: str, timeout: float = 2.0) -> bool:
    host, _, port = address.rpartition(":")
    try:
        with socket.create_connection((host, int(port)), timeout=timeout):
            return True
    except (OSError, ValueError):
        return False


def _read_state() -> Farm | None:
    try:
        return Farm(**json.loads(state_path().read_text()))
    except (OSError, ValueError, TypeError):
        return None


def find(address: str | None = None) -> Farm:
    """The farm to use: ``address``, else ``$DSPX_FARM``, else the one
    ``dspx farm up`` recorded (when it still runs)."""
    address = address or os.environ.get("DSPX_FARM")
    saved = _read_state()
    if address:
        return saved if saved is not None and saved.address == address else Farm(address)
    if saved is not None and saved.alive():
        return saved
    if saved is not None:
        state_path().unlink(missing_ok=True)  # ours, left by a farm that died
    raise FarmError("no farm is running (start one with `dspx farm up --devices N`, or give --farm ADDRESS "
                    "or $DSPX_FARM)")


_connected: str | None = None


def connect(farm: Farm | str) -> None:
    """Make this process a driver of ``farm`` (once; a different farm
    replaces the connection)."""
    global _connected
    import ray

    address = farm.address if isinstance(farm, Farm) else farm
    if ray.is_initialized() and _connected == address:
        return
    if not _answers(address):
        raise FarmError(f"no farm answers at {address} (is it up? `dspx farm status`)")
    from ray._private import ray_constants

    if address.startswith("127.") and ray_constants.ENABLE_RAY_CLUSTER:
        # Ray would look for this driver's node at the routable address, and wait for it for ever.
        raise FarmError(f"the farm at {address} is on loopback, but Ray was imported before dspx.farm set its "
                        f"loopback switch: import dspx.farm before ray (or set "
                        f"RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0)")
    token = isinstance(farm, Farm) and farm.auth == "token"
    if token and not token_mode():
        raise FarmError(f"the farm at {address} takes only processes holding its token: run this with "
                        f"RAY_AUTH_MODE=token set before Ray is imported, and the token in ~/.ray/auth_token or "
                        f"$RAY_AUTH_TOKEN_PATH (docs/farm.md, \"A farm on several machines\")")
    if ray.is_initialized():
        ray.shutdown()
    try:
        ray.init(address=address, namespace=NAMESPACE, log_to_driver=False, logging_level="warning")
    except ConnectionError as e:  # what Ray says of a farm that refused this process's token, among others
        raise FarmError(f"cannot connect to the farm at {address} ({str(e).splitlines()[0]}): a farm started "
                        f"with --listen takes only processes holding its token (RAY_AUTH_MODE=token)") from None
    except RuntimeError as e:
        if "No node info found" not in str(e):
            raise
        # Ray attaches a driver to a node on its own machine, and this machine has none of the farm's.
        raise FarmError(f"this machine is not a node of the farm at {address}: run this on one of its machines "
                        f"(`dspx farm join {address}` makes this one a node)") from None
    _connected = address


def token_mode() -> bool:
    """Whether this process runs Ray with token authentication (Ray reads
    RAY_AUTH_MODE once, when first imported)."""
    from ray._raylet import AuthenticationMode, get_authentication_mode

    return get_authentication_mode() == AuthenticationMode.TOKEN


def use(farm: Farm | str | None = None) -> None:
    """Connect to ``farm`` (a Farm or an address); with None, stay on the
    farm this process is connected to (a driver's, or the farm's own when
    this is one of its workers: an actor such as a Serve replica), else find
    the running one."""
    if farm is None and (_connected is not None or _in_a_worker()):
        return
    connect(farm if isinstance(farm, Farm) else find(farm))


def _in_a_worker() -> bool:
    import ray

    return ray.is_initialized() and ray.get_runtime_context().worker.mode == ray.WORKER_MODE


def disconnect() -> None:
    global _connected
    import ray

    if ray.is_initialized():
        ray.shutdown()
    _connected = None


def _ray_start(cmd_args: list[str], log, env: dict) -> subprocess.Popen:
    """``ray start ARGS`` as its own session, through this interpreter (the
    ``ray`` script may not be on PATH in a venv that is not activated)."""
    code = "import sys; from ray.scripts.scripts import main; sys.exit(main())"
    return subprocess.Popen([sys.executable, "-c", code, "start", *cmd_args], stdin=subprocess.DEVNULL,
                            stdout=log, stderr=log, start_new_session=True, env=env)


def start(devices: int, key: str = DEFAULT_KEY, *, cores: int = 1, threads: int = 1, device_args=(),
          user_cap: int | None = None,
          env: dict | None = None, object_store_bytes: int = OBJECT_STORE_BYTES, timeout: float = START_TIMEOUT,
          progress=None, listen: str = "127.0.0.1") -> Farm:
    """A local farm with ``devices`` simulated devices under ``key``;
    returns once every device answers.  The caller is connected to it.
    ``cores``, ``threads``, ``device_args``: each device's (``dspx serve``
    options); ``env``: more environment for the head and so for the
    devices (``DSPX_CACHE``: the node's cache); ``user_cap``: devices of a
    key one user may hold while others wait (default: all but one);
    ``progress(text)``: told each step; ``listen``: loopback, or an address
    of this machine that other machines join the farm at (``nodes.py``):
    the farm then takes only processes holding its token, this one too."""
    from . import actors, broker, nodes

    if devices < 1:
        raise FarmError(f"a farm needs at least one device (got {devices})")
    say = progress or (lambda text: None)
    head_env, head_args, auth = nodes.head_options(listen)
    # Short: Ray's socket paths live under it and a socket path is at most 107 bytes.
    work = tempfile.mkdtemp(prefix="dspx-farm-", dir="/tmp")
    log = open(os.path.join(work, "head.log"), "wb")
    args = ["--head", "--block", "--port=0", f"--num-cpus={os.cpu_count() or 1}", "--include-dashboard=false",
            "--disable-usage-stats", f"--object-store-memory={object_store_bytes}",
            # Ray's fixed defaults (52365, 10001) would clash with another Ray on this machine (a second
            # farm, a test farm beside a user's): its node would die at start.
            f"--dashboard-agent-listen-port={_free_port()}", f"--ray-client-server-port={_free_port()}",
            f"--resources={json.dumps({actors.resource(key): devices})}", f"--temp-dir={work}/ray", *head_args]
    where = f"on {listen}, token auth" if auth else "on loopback"
    say(f"starting the Ray head node ({where}, {os.cpu_count()} cpus)")
    # The devices' directories (sockets, logs) go under the farm's, which stop() removes.
    os.mkdir(os.path.join(work, "tmp"))
    proc = _ray_start(args, log, {**os.environ, **head_env, "TMPDIR": os.path.join(work, "tmp"), **(env or {})})
    log.close()
    farm = Farm("", proc.pid, work, key, devices, auth=auth)
    try:
        farm.address = _wait_address(proc, Path(work), timeout)
        connect(farm)
        say(f"head at {farm.address}; starting {devices} device(s) under dspx:{key}")
        handles = [actors.spawn(key, i, cores, threads, device_args) for i in range(devices)]
        actors.wait_ready(handles, timeout)
        import ray

        ray.get(broker.get(user_cap).status.remote(), timeout=timeout)  # the lease broker, up before anyone asks it
    except BaseException:
        farm.stop()
        raise
    return farm


def _wait_address(proc: subprocess.Popen, work: Path, timeout: float) -> str:
    """The head's GCS address, once Ray has written it."""
    where = work / "ray" / "ray_current_cluster"
    deadline = time.monotonic() + timeout
    while True:
        text = where.read_text().strip() if where.is_file() else ""
        if text:
            return text
        if proc.poll() is not None:
            tail = (work / "head.log").read_bytes()[-1500:].decode(errors="replace")
            raise FarmError(f"the Ray head node exited ({proc.returncode}) before it was ready:\n{tail}")
        if time.monotonic() > deadline:
            raise FarmError(f"the Ray head node did not start within {timeout:.0f} s (log: {work}/head.log)")
        time.sleep(0.1)


class LocalFarm:
    """A farm for the life of a ``with`` block (tests, benchmarks): started
    on enter, stopped on exit, never recorded for other commands."""

    def __init__(self, devices: int, key: str = DEFAULT_KEY, **opts):
        self.devices, self.key, self.opts = devices, key, opts
        self.farm: Farm | None = None

    def __enter__(self) -> Farm:
        self.farm = start(self.devices, self.key, **self.opts)
        return self.farm

    def __exit__(self, *exc) -> None:
        disconnect()
        if self.farm is not None:
            self.farm.stop()
