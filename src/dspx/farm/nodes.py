"""Farms of several machines (docs/farm.md, "A farm on several machines").

A farm that other machines can join is started with ``dspx farm up --listen
HOST``: its head node is on HOST, an address of its machine that the others
reach, instead of loopback, and it takes only processes holding its token
(Ray's token authentication, ``RAY_AUTH_MODE=token``).  ``join`` makes this
machine a node of such a farm: a Ray worker node (``ray start --address …
--block``, in a session of its own, like the head) offering ``dspx:KEY``,
and one device actor per device, pinned to this node: simulated devices
that their actors start, or boards (device sockets that already listen)
that their actors connect to.  ``dspx farm leave`` (or ``down``) on that
machine stops what ``join`` started.

The pinning is a hard node affinity: Ray restarts a device only on its own
node, so a device whose node is lost ends with it (instead of waiting for
ever for a resource no other node has), and a batch hands its work to the
other devices (``batch.py``).
"""
from __future__ import annotations

import ipaddress
import json
import os
import socket
import tempfile
import time
from pathlib import Path

from ..errors import DspxError
from ..transport import is_listening, peer_cred, socket_path
from . import cluster
from .cluster import Farm, FarmError

# Ray's loopback switch off (its Linux default) for the Ray processes of a farm other machines join:
# with it on, `ray start --address` refuses to add a node, and Ray puts every node on 127.0.0.1.
ROUTABLE_ENV = {"RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "1"}
BOARD_WAIT = 60.0  # seconds a board's actor waits for its socket (a restarted actor, while the board restarts)
DEFAULT_TOKEN = Path("~/.ray/auth_token")  # where Ray looks last (RAY_AUTH_TOKEN, then RAY_AUTH_TOKEN_PATH first)


def is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"


def routable_ip(host: str) -> str:
    """The IPv4 address ``host`` names, refused with one line unless it is
    an address of this machine (Ray tells the other nodes this address)."""
    try:
        ip = socket.gethostbyname(host)
    except OSError:
        raise FarmError(f"--listen {host}: not an IPv4 address, nor a name this machine resolves") from None
    if ipaddress.ip_address(ip).is_unspecified:
        raise FarmError(f"--listen {host}: give the address other machines reach this one at (Ray hands it to "
                        f"every node), not {ip}")
    try:
        with socket.socket() as s:
            s.bind((ip, 0))
    except OSError:
        raise FarmError(f"--listen {host}: {ip} is not an address of this machine") from None
    return ip


def token_source() -> str:
    """Where Ray will read this process's token, in Ray's order
    (``$RAY_AUTH_TOKEN``, the file ``$RAY_AUTH_TOKEN_PATH``,
    ``~/.ray/auth_token``); refused with one line when there is none (Ray
    itself aborts the process on an unreadable token file)."""
    if os.environ.get("RAY_AUTH_TOKEN", "").strip():
        return "$RAY_AUTH_TOKEN"
    named = os.environ.get("RAY_AUTH_TOKEN_PATH")
    path = Path(named) if named else DEFAULT_TOKEN.expanduser()
    try:
        if path.read_text().strip():
            return str(path)
    except OSError:
        pass
    if named:
        raise FarmError(f"RAY_AUTH_TOKEN_PATH={named}: no token there (the file is missing, unreadable or empty)")
    raise FarmError("no Ray token on this machine, and a farm of several machines takes only processes holding "
                    "its token: on the farm's first machine `ray get-auth-token --generate` writes one to "
                    "~/.ray/auth_token; copy that file to the same place on every other machine (mode 600), or "
                    "name it with RAY_AUTH_TOKEN_PATH")


def _require_token(what: str) -> str:
    if not cluster.token_mode():
        raise FarmError(f"{what} takes only processes holding the farm's token, and this one is not in Ray's "
                        f"token mode: set RAY_AUTH_MODE=token before Ray is imported (`dspx farm up --listen` and "
                        f"`dspx farm join` do)")
    return token_source()


def head_options(listen: str) -> tuple[dict, list[str], str]:
    """For ``cluster.start``: the head's environment, its ``ray start``
    arguments and the farm's auth, for a head on ``listen``."""
    if is_loopback(listen):
        # Ray 2.60's `ray start --head` turns token auth on by itself when it finds a token file, but a driver
        # given an address does not: the head keeps this process's mode, so its drivers can connect.
        return {"RAY_AUTH_MODE": os.environ.get("RAY_AUTH_MODE", "disabled")}, [], ""
    ip = routable_ip(listen)
    _require_token(f"a farm that listens on {listen}")
    return {**ROUTABLE_ENV, "RAY_AUTH_MODE": "token"}, [f"--node-ip-address={ip}"], "token"


class Board:
    """A device this node did not start (a board, or a ``dspx serve``
    device) at a socket.  It stands where a device actor keeps the device it
    started (``path``, ``proc.pid``, ``proc.poll()``, ``stop()``), so the
    actor runs on it unchanged; ``stop`` leaves the device running: it is not
    the actor's to stop."""

    def __init__(self, path: str, wait: float = BOARD_WAIT):
        self.path = socket_path(path)
        deadline = time.monotonic() + wait
        while not is_listening(self.path):  # a restarted actor: the board may be restarting too
            if time.monotonic() > deadline:
                raise DspxError(f"no device listens on {path} (waited {wait:.0f} s)")
            time.sleep(0.2)
        self.proc = _Listener(self.path)

    def stop(self, timeout: float = 0.0) -> None:
        pass

    def log_tail(self, n: int = 2000) -> str:
        return ""


class _Listener:
    """The ``proc`` of a ``Board``: the pid of the process listening on its
    socket (0 when another pid namespace hides it), and ``poll()`` as
    ``Popen.poll``: None while a device listens there."""

    def __init__(self, path: str):
        self.path = path
        self.pid = 0
        s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET | socket.SOCK_CLOEXEC)
        s.settimeout(2.0)
        try:
            s.connect(path)
            self.pid = peer_cred(s)[0]
        except OSError:
            pass
        finally:
            s.close()

    def poll(self) -> int | None:
        return None if is_listening(self.path) else 1


def _boards(sockets) -> list[str]:
    paths = []
    for given in sockets:
        path = socket_path(given)
        if not is_listening(path):
            raise FarmError(f"--socket {given}: no device listens there (a board's socket, or start one with "
                            f"`dspx serve --socket {given}`)")
        if path in paths:
            raise FarmError(f"--socket {given}: given twice (each socket is one device)")
        paths.append(path)
    return paths


def join(address: str, key: str = cluster.DEFAULT_KEY, devices: int = 0, sockets=(), *, cores: int = 1,
         threads: int = 1, device_args=(), env: dict | None = None,
         object_store_bytes: int = cluster.OBJECT_STORE_BYTES, timeout: float = cluster.START_TIMEOUT,
         progress=None) -> Farm:
    """Make this machine a node of the farm at ``address`` with ``devices``
    simulated devices and one device per socket of ``sockets`` (boards), all
    under ``key``; returns once every device answers, the caller connected
    to the farm.  The returned Farm is this node (``farm.node`` its Ray node
    id): ``stop()`` ends it and its devices."""
    from . import actors

    say = progress or (lambda text: None)
    if devices < 0:
        raise FarmError(f"--devices must be 0 or more (got {devices})")
    boards = _boards(sockets)
    if devices + len(boards) < 1:
        raise FarmError("a node needs at least one device: give --devices N, or --socket PATH for a board")
    host, _, port = address.rpartition(":")
    if not host or not port.isdigit():
        raise FarmError(f"{address!r} is not a farm address (HOST:PORT, as `dspx farm up --listen HOST` prints it)")
    if not cluster._answers(address):
        raise FarmError(f"no farm answers at {address} (is it up, started with `dspx farm up --listen HOST`, and "
                        f"is its port open to this machine?)")
    if is_loopback(host):
        raise FarmError(f"the farm at {address} is on loopback: no other node can join it (start it with "
                        f"`dspx farm up --listen HOST`)")
    _require_token(f"the farm at {address}")
    work = tempfile.mkdtemp(prefix="dspx-node-", dir="/tmp")  # short: Ray's socket paths live under it
    os.mkdir(os.path.join(work, "tmp"))  # the devices' directories (sockets, logs): stop() removes them
    name = f"dspx-{socket.gethostname()}-{Path(work).name.rpartition('-')[2]}"  # finds this node in ray.nodes()
    total = devices + len(boards)
    args = [f"--address={address}", "--block", f"--num-cpus={os.cpu_count() or 1}", "--disable-usage-stats",
            f"--object-store-memory={object_store_bytes}", f"--resources={json.dumps({actors.resource(key): total})}",
            f"--node-name={name}", f"--temp-dir={work}/ray",
            f"--dashboard-agent-listen-port={cluster._free_port()}"]  # Ray's fixed default clashes with a head here
    say(f"starting a Ray node of the farm at {address}, {os.cpu_count()} cpus")
    with open(os.path.join(work, "node.log"), "wb") as log:
        proc = cluster._ray_start(args, log, {**os.environ, **ROUTABLE_ENV, "RAY_AUTH_MODE": "token",
                                              "TMPDIR": os.path.join(work, "tmp"), **(env or {})})
    farm = Farm(address, proc.pid, work, key, total, auth="token")
    try:
        _wait_started(proc, Path(work), address, timeout)
        cluster.connect(farm)
        farm.node = _node_id(name, timeout)
        say(f"node {farm.node[:12]} joined; starting {devices} device(s) and {len(boards)} board(s) under dspx:{key}")
        actors.wait_ready(_spawn(key, farm.node, [None] * devices + boards, cores, threads, device_args), timeout)
    except BaseException:
        cluster.disconnect()
        farm.stop()
        raise
    return farm


def _wait_started(proc, work: Path, address: str, timeout: float) -> None:
    """Until ``ray start`` says its node runs (it has registered with the head)."""
    log = work / "node.log"
    deadline = time.monotonic() + timeout
    while True:
        text = log.read_bytes().decode(errors="replace") if log.is_file() else ""
        if "Ray runtime started" in text:
            return
        if "InvalidAuthToken" in text or "Unauthenticated" in text:
            raise FarmError(f"the farm at {address} refused this machine's token ({token_source()}): it is not "
                            f"the farm's")
        if proc.poll() is not None:
            tail = "\n".join(text.strip().splitlines()[-15:])
            raise FarmError(f"the Ray node exited ({proc.returncode}) before it joined the farm at {address} "
                            f"(log: {log}):\n{tail}")
        if time.monotonic() > deadline:
            raise FarmError(f"the Ray node did not join the farm at {address} within {timeout:.0f} s (log: {log})")
        time.sleep(0.2)


def _node_id(name: str, timeout: float) -> str:
    import ray

    deadline = time.monotonic() + timeout
    while True:
        ids = [n["NodeID"] for n in ray.nodes() if n.get("NodeName") == name and n["Alive"]]
        if ids:
            return ids[0]
        if time.monotonic() > deadline:
            raise FarmError(f"the farm does not list this machine's node {name} within {timeout:.0f} s")
        time.sleep(0.2)


def _spawn(key: str, node: str, boards: list, cores: int, threads: int, device_args) -> list:
    """One device actor per entry of ``boards`` (None: a simulated device),
    pinned to ``node``, named after the first free indices under ``key``."""
    import ray

    from . import actors

    taken = {int(n.rpartition("-")[2]) for n in actors.find_devices(key)}
    handles, index = [], 0
    for board in boards:
        while True:
            while index in taken:
                index += 1
            taken.add(index)
            try:
                handles.append(actors.spawn(key, index, cores, threads, device_args, node=node, socket=board))
                break
            except ray.exceptions.ActorAlreadyExistsError:  # taken since (another node joining): the next one
                continue
    return handles


def leave() -> Farm:
    """Stop what ``dspx farm join`` started on this machine (its node, so its
    devices); refused with one line when this machine is no farm's node."""
    farm = cluster._read_state()
    if farm is not None and farm.node:
        farm.stop()  # also a node that already ended with its farm: its directory and record go
        return farm
    if farm is not None and farm.alive():
        raise FarmError(f"this machine runs the farm at {farm.address}, it did not join it: `dspx farm down` stops it")
    raise FarmError("this machine is not a node of a farm (`dspx farm join ADDRESS` makes it one)")
