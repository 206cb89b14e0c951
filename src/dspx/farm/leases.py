"""Leases: one device of a farm, held for interactive use.

    with dspx.farm.lease("sim", timeout=60) as dev:
        dev.ping()
        with dev.VirtualMachine("build/model") as vm:
            y = vm["main"](x=x)

A lease is granted by the farm's broker (``broker.py``: priority order,
first come first served within a priority, a cap per user).  The device it
names is reached directly, over its own socket, with a ``dspx.Client``: the
calls do not go through Ray, so a leased device is as fast as a local one,
zero copy included.  That needs the device to be on this machine: a lease
from another machine passes ``node=`` (its own Ray node) or is refused with
the device's host named.

Two limits, two errors: ``queue_timeout`` (waiting for a device) ends with
``QueueTimeout``; ``timeout`` (holding it) ends with the device reclaimed,
restarted, and ``RunTimeout`` raised from the ``with`` block (and from
``check()``) in place of the ``DeviceLost`` the holder's calls then get.
"""
from __future__ import annotations

import getpass
import socket as _socket
import time

import ray

from . import broker as _broker
from .cluster import DEFAULT_KEY, Farm, FarmError, use

QUEUE_TIMEOUT = 300.0  # seconds a lease waits for a device, by default
RUN_TIMEOUT = 3600.0   # seconds a lease may hold one, by default (a driver that died frees its device then)
CALL_TIMEOUT = 60.0    # a broker call that is not a wait


class LeaseTimeout(FarmError):
    """A lease ran out of time, in the queue or while running.  ``phase``:
    "queue" or "run"; ``limit`` and ``elapsed`` in seconds."""

    phase = ""

    def __init__(self, message: str, key: str, limit: float | None, elapsed: float, **numbers):
        super().__init__(message)
        self.key, self.limit, self.elapsed = key, limit, elapsed
        self.status_name = f"{self.phase.upper()}_TIMEOUT"
        self.numbers = {"limit": limit, "elapsed": round(elapsed, 3), **numbers}
        for k, v in numbers.items():
            setattr(self, k, v)


class QueueTimeout(LeaseTimeout):
    """No device of the key was free for the lease within its queue limit."""

    phase = "queue"


class RunTimeout(LeaseTimeout):
    """The lease held its device past its run limit: the device was reclaimed
    (restarted), and what ran on it was stopped."""

    phase = "run"


def default_user() -> str:
    return f"{getpass.getuser()}@{_socket.gethostname()}"


class Lease:
    """A granted lease: the device (``device``, ``node``, ``socket``), and
    the local API on it (``client``, ``ping``, ``VirtualMachine``,
    ``Tasks``, ``load_ops``).  Release it with ``release()`` or by leaving
    the ``with`` block."""

    def __init__(self, grant: dict, broker):
        self.id: int = grant["id"]
        self.key: str = grant["key"]
        self.device: str = grant["device"]
        self.node: str = grant["node"]
        self.socket: str = grant["socket"]
        self.host: str = grant["host"]
        self.user: str = grant["user"]
        self.priority: int = grant["priority"]
        self.limit: float | None = grant["limit"]
        self._broker = broker
        self._granted = time.monotonic()
        self._client = None
        self.released = False

    def __repr__(self) -> str:
        return f"<Lease {self.id} {self.device} for {self.user}>"

    # ------------------------------------------------------------ the device
    @property
    def client(self):
        """A ``dspx.Client`` on the leased device (opened on first use)."""
        if self.released:
            raise FarmError(f"lease {self.id} on {self.device} was released")
        if self._client is None:
            if self.host != _socket.gethostname():
                raise FarmError(f"{self.device} is on {self.host}, not this machine ({_socket.gethostname()}): "
                                f"its socket is reached only there (lease with node= this machine's Ray node)")
            from ..host.client import Client

            self._client = Client(self.socket, timeout=CALL_TIMEOUT if self.limit is None
                                  else max(self.limit, 1.0) + CALL_TIMEOUT)
        return self._client

    def ping(self) -> dict:
        return self.client.ping()

    def VirtualMachine(self, module):  # noqa: N802  (the local API's name)
        from ..host.vm import VirtualMachine

        return VirtualMachine(module, client=self.client)

    def Tasks(self):  # noqa: N802
        from ..host.tasks import Tasks

        return Tasks(client=self.client)

    def load_ops(self, source, device_wide: bool = False):
        return self.Tasks().load_ops(source, device_wide=device_wide)

    def remaining(self) -> float | None:
        """Seconds left before the run limit, or None without one."""
        return None if self.limit is None else self.limit - (time.monotonic() - self._granted)

    # ------------------------------------------------------------ its end
    def outcome(self) -> dict:
        """The broker's word on this lease: state "held", "released" or
        "reclaimed" (phase "run"), with the numbers."""
        return ray.get(self._broker.outcome.remote(self.id), timeout=CALL_TIMEOUT)

    def check(self) -> None:
        """Raise ``RunTimeout`` if the broker reclaimed the device."""
        out = self.outcome()
        if out.get("state") == "reclaimed":
            raise self._reclaimed(out)

    def _reclaimed(self, out: dict) -> RunTimeout:
        return RunTimeout(f"lease {self.id} on {self.device} ({self.key}) ran past its run limit of "
                          f"{out['limit']:g} s: the device was reclaimed (restarted) after {out['held_s']:.1f} s",
                          self.key, out["limit"], out["held_s"], device=self.device, lease=self.id)

    def release(self) -> dict:
        """Give the device back (once; later calls return the same outcome)."""
        if self._client is not None:
            try:
                self._client.close()
            except Exception:  # a reclaimed device's channel is gone: nothing to close cleanly
                pass
            self._client = None
        self.released = True
        return ray.get(self._broker.release.remote(self.id), timeout=CALL_TIMEOUT)

    def __enter__(self) -> "Lease":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        out = self.release()
        if out.get("state") == "reclaimed":
            raise self._reclaimed(out) from exc


def _refused(reply: dict) -> FarmError:
    kind = reply["error"]
    if kind == "queue":
        return QueueTimeout(f"no device under dspx:{reply['key']} was free within the queue limit of "
                            f"{reply['limit']:g} s (waited {reply['waited']:.1f} s; {reply['held']} of "
                            f"{reply['devices']} held, {reply['ahead']} request(s) ahead)", reply["key"],
                            reply["limit"], reply["waited"], ahead=reply["ahead"], devices=reply["devices"],
                            held=reply["held"])
    if kind == "no-key":
        return FarmError(f"the farm has no device under dspx:{reply['key']} (its keys: "
                         f"{', '.join(reply['keys']) or 'none'})")
    if kind == "no-node":
        return FarmError(f"no device under dspx:{reply['key']} is on node {reply['node']}")
    return FarmError(f"device {reply.get('device')} under dspx:{reply['key']} did not answer when granted "
                     f"(it is being restarted): try again")


def acquire(key: str = DEFAULT_KEY, *, timeout: float | None = RUN_TIMEOUT,
            queue_timeout: float | None = QUEUE_TIMEOUT, priority: int = 0, user: str | None = None,
            node: str | None = None, farm: Farm | str | None = None, kind: str = "lease") -> Lease:
    """A lease on one device under ``key``, waiting at most ``queue_timeout``
    seconds (0: only a device free now; None: no limit) and held at most
    ``timeout`` seconds (None: no limit).  Higher ``priority`` is served
    first; ``user`` (default ``user@host``) is who the per-user cap counts."""
    for name, value in (("timeout", timeout), ("queue_timeout", queue_timeout)):
        if value is not None and not value >= 0:
            raise ValueError(f"{name} must be a number of seconds >= 0 or None (got {value!r})")
    use(farm)
    b = _broker.get()
    wait = None if queue_timeout is None else queue_timeout + CALL_TIMEOUT
    ctx = ray.get_runtime_context()
    owner = {"job": ctx.get_job_id(), "actor": ctx.get_actor_id()}  # the broker frees the device if it dies
    reply = ray.get(b.acquire.remote(key, user or default_user(), int(priority), queue_timeout, timeout, node, kind,
                                     owner), timeout=wait)
    if "error" in reply:
        raise _refused(reply)
    return Lease(reply, b)


def lease(key: str = DEFAULT_KEY, **opts) -> Lease:
    """``with dspx.farm.lease(key, timeout=…) as dev:`` (see ``acquire``)."""
    return acquire(key, **opts)


def status(farm: Farm | str | None = None) -> dict:
    """The broker's view: per key, free, held, restarting and pending; the
    holders and the waiters."""
    use(farm)
    return ray.get(_broker.get().status.remote(), timeout=CALL_TIMEOUT)
