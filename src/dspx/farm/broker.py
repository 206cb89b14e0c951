"""The lease broker: who holds which device, and who waits for one.

One detached async actor per farm (``broker`` in the farm's namespace, on
the head node).  Ray places the work; the broker only decides, per key,
which waiting client gets the next free device:

- **Order.**  Higher ``priority`` first; first come, first served within a
  priority.
- **Cap per user.**  While another user waits for a key, a user holding
  ``user_cap`` of its devices is given no more (default: all but one of the
  key's devices).  Without contention a user may hold every device.  Batch
  leases (``map``) give back devices above the cap when asked (``adjust``);
  interactive ones keep theirs until released or out of time.
- **Two limits.**  A wait longer than its ``queue_timeout`` ends with the
  queue error; a lease held past its ``timeout`` is reclaimed: the device
  actor is restarted (a new device process), so whatever the holder left
  running there stops, and the lease's outcome says ``run``.
- A lease whose holder dies (its driver's job ends, or the actor holding
  it, such as a Serve replica, is dead) is ended within seconds and its
  device restarted.
- The broker's state is in memory: a broker restarted by Ray forgets the
  leases (their holders keep their devices until they release them).
"""
from __future__ import annotations

import asyncio
import itertools
import time
from dataclasses import asdict, dataclass, field

import ray

from . import actors

NAME = "broker"
REAP_PERIOD = 0.2       # seconds between checks of the leases' deadlines
RESTART_TIMEOUT = 300.0  # a reclaimed device's new process must answer within this
ENDPOINT_TIMEOUT = 30.0  # a device granted must say where it is within this
DISCOVER_PERIOD = 2.0    # seconds between looks for devices added to a key (farm join)
HEAD_RESOURCE = "node:__internal_head__"  # the resource Ray gives the head node only
OWNER_PERIOD = 2.0       # seconds between checks that the holders still live


@dataclass
class Held:
    id: int
    key: str
    device: str
    user: str
    priority: int
    kind: str            # "lease" (interactive) or "batch" (map)
    since: float
    limit: float | None  # seconds, or None: no run limit
    node: str = ""
    socket: str = ""
    host: str = ""
    owner: dict = field(default_factory=dict)  # the holder's Ray job and actor ids: freed when it dies

    def public(self, now: float) -> dict:
        d = asdict(self)
        d["held_s"] = round(now - self.since, 3)
        del d["since"], d["owner"]
        return d


@dataclass
class Waiter:
    seq: int
    key: str
    user: str
    priority: int
    kind: str
    limit: float | None
    node: str | None
    since: float
    owner: dict
    future: asyncio.Future = field(repr=False)


@ray.remote(num_cpus=0)
class Broker:
    def __init__(self, user_cap: int | None = None):
        self.user_cap = user_cap
        self.devices: dict[str, list[str]] = {}    # key -> device names
        self.handles: dict[str, object] = {}
        self.nodes: dict[str, str] = {}            # device -> its Ray node (learnt from its endpoint)
        self.discovered = 0.0
        self.held: dict[str, Held] = {}            # device -> its lease
        self.restarting: set[str] = set()
        self.queues: dict[str, list[Waiter]] = {}
        self.outcomes: dict[int, dict] = {}        # lease id -> how it ended
        self.ids = itertools.count(1)
        self.seqs = itertools.count(1)
        self.granted = 0
        self.reaper = None

    # ------------------------------------------------------------ devices
    def _discover(self, force: bool = False) -> None:
        now = time.monotonic()
        if not force and now - self.discovered < DISCOVER_PERIOD:
            return
        self.discovered = now
        found = actors.find_devices()
        self.handles.update(found)
        self.devices = {}
        for name in found:
            self.devices.setdefault(name.rpartition("-")[0], []).append(name)

    def _cap(self, key: str) -> int:
        n = len(self.devices.get(key, ()))
        return self.user_cap if self.user_cap else max(1, n - 1)

    def _holding(self, user: str, key: str) -> int:
        return sum(1 for h in self.held.values() if h.user == user and h.key == key)

    def _contended(self, key: str, user: str) -> bool:
        return any(w.user != user for w in self.queues.get(key, ()))

    def _free(self, key: str, node: str | None) -> list[str]:
        return [d for d in self.devices.get(key, ()) if d not in self.held and d not in self.restarting
                and (node is None or self._node_of(d) == node)]

    def _node_of(self, device: str) -> str:
        return self.nodes.get(device, "")

    # ------------------------------------------------------------ granting
    def _eligible(self, w: Waiter) -> bool:
        return self._holding(w.user, w.key) < self._cap(w.key) or not self._contended(w.key, w.user)

    def _dispatch(self, key: str) -> None:
        queue = self.queues.get(key, [])
        for w in sorted(queue, key=lambda w: (-w.priority, w.seq)):  # a waiter leaves the queue with its future
            free = self._free(key, w.node)
            if not free or not self._eligible(w):
                continue
            device = free[0]
            self.held[device] = Held(next(self.ids), key, device, w.user, w.priority, w.kind, time.monotonic(),
                                     w.limit, owner=w.owner)
            queue.remove(w)
            self.granted += 1
            w.future.set_result(device)

    async def acquire(self, key: str, user: str, priority: int = 0, queue_timeout: float | None = 60.0,
                      limit: float | None = None, node: str | None = None, kind: str = "lease",
                      owner: dict | None = None) -> dict:
        """Wait (at most ``queue_timeout`` s; 0: only a device free now) for
        a device under ``key``; the lease, or ``{"error": ...}`` with the
        numbers."""
        self._start_reaper()
        self._discover(force=key not in self.devices)
        if key not in self.devices:
            return {"error": "no-key", "key": key, "keys": sorted(self.devices)}
        if node is not None:
            await self._learn_nodes(key)
            if not any(self._node_of(d) == node for d in self.devices[key]):
                return {"error": "no-node", "key": key, "node": node}
        loop = asyncio.get_running_loop()
        w = Waiter(next(self.seqs), key, user, priority, kind, limit, node, time.monotonic(), owner or {},
                   loop.create_future())
        self.queues.setdefault(key, []).append(w)
        self._dispatch(key)
        try:
            if not w.future.done():
                await asyncio.wait_for(asyncio.shield(w.future), None if queue_timeout is None
                                       else max(queue_timeout, 0.0))
        except asyncio.TimeoutError:
            pass
        if not w.future.done():
            ahead = sum(1 for o in self.queues.get(key, ()) if (-o.priority, o.seq) < (-w.priority, w.seq))
            self.queues[key].remove(w)
            w.future.cancel()
            self._dispatch(key)  # a waiter that was blocked behind this one's cap may go now
            return {"error": "queue", "key": key, "limit": queue_timeout, "waited": time.monotonic() - w.since,
                    "ahead": ahead, "devices": len(self.devices[key]),
                    "held": len([h for h in self.held.values() if h.key == key])}
        device = w.future.result()
        held = self.held[device]
        try:
            ep = await asyncio.wait_for(self.handles[device].endpoint.remote(), ENDPOINT_TIMEOUT)
        except (asyncio.TimeoutError, ray.exceptions.RayError) as e:
            self._end(held, "lost", why=f"{type(e).__name__}")
            self._restart(device)
            return {"error": "lost", "key": key, "device": device}
        held.node, held.socket, held.host = ep["node"], ep["socket"], ep["host"]
        self.nodes[device] = ep["node"]
        return held.public(time.monotonic())

    async def release(self, lease_id: int) -> dict:
        """Give a device back; the lease's outcome (``released``, or how it
        had already ended)."""
        for h in list(self.held.values()):
            if h.id == lease_id:
                return self._end(h, "released")
        return self.outcomes.get(lease_id, {"state": "unknown", "id": lease_id})

    async def outcome(self, lease_id: int) -> dict:
        for h in self.held.values():
            if h.id == lease_id:
                return {"state": "held", **h.public(time.monotonic())}
        return self.outcomes.get(lease_id, {"state": "unknown", "id": lease_id})

    async def adjust(self, lease_ids: list[int]) -> list[int]:
        """For a batch: which of its leases to give back now (those above its
        user's cap while another user waits), most recent first."""
        mine = sorted((h for h in self.held.values() if h.id in lease_ids), key=lambda h: -h.id)
        if not mine:
            return []
        key, user = mine[0].key, mine[0].user
        if not self._contended(key, user):
            return []
        over = self._holding(user, key) - self._cap(key)
        return [h.id for h in mine[:max(over, 0)]]

    def _end(self, h: Held, state: str, **more) -> dict:
        del self.held[h.device]
        now = time.monotonic()
        out = {"state": state, **h.public(now), **more}
        self.outcomes[h.id] = out
        if len(self.outcomes) > 10_000:  # a long-lived farm: keep the recent ones
            for old in sorted(self.outcomes)[:1000]:
                del self.outcomes[old]
        self._dispatch(h.key)
        return out

    # ------------------------------------------------------------ reclaiming
    def _start_reaper(self) -> None:
        if self.reaper is None:
            self.reaper = asyncio.get_running_loop().create_task(self._reap())

    async def _reap(self) -> None:
        checked = time.monotonic()
        while True:
            await asyncio.sleep(REAP_PERIOD)
            now = time.monotonic()
            for h in list(self.held.values()):
                if h.limit is not None and now - h.since > h.limit:
                    self._end(h, "reclaimed", phase="run")
                    self._restart(h.device)
            if now - checked > OWNER_PERIOD and self.held:
                checked = now
                for h in self._orphans():
                    self._end(h, "holder-died")
                    self._restart(h.device)  # whatever the dead holder left running there stops

    def _orphans(self) -> list[Held]:
        """Leases whose holder (a driver's job, or an actor such as a Serve
        replica) is dead.  Ray's GCS tables: a private API, hence the pinned
        minor version."""
        from ray._private.state import state

        try:
            dead_jobs = {j["JobID"] for j in state.job_table() if j.get("IsDead")}
            out = []
            for h in self.held.values():
                job, actor = h.owner.get("job"), h.owner.get("actor")
                if job in dead_jobs or (actor and state.actor_table(actor).get("State") == "DEAD"):
                    out.append(h)
            return out
        except Exception:  # the tables' shape is Ray's: never let it stop the reaper
            return []

    def _restart(self, device: str) -> None:
        """A new process for ``device`` (whatever ran there stops); free again
        once it answers."""
        self.restarting.add(device)
        handle = self.handles[device]
        ray.kill(handle, no_restart=False)
        asyncio.get_running_loop().create_task(self._back(device, handle))

    async def _back(self, device: str, handle) -> None:
        deadline = time.monotonic() + RESTART_TIMEOUT
        while time.monotonic() < deadline:
            try:
                await asyncio.wait_for(handle.info.remote(), 10.0)
                break
            except (asyncio.TimeoutError, ray.exceptions.RayError):
                await asyncio.sleep(0.2)
        self.restarting.discard(device)
        self.nodes.pop(device, None)  # a restarted actor may be on another node
        self._dispatch(device.rpartition("-")[0])

    async def _learn_nodes(self, key: str) -> None:
        for d in self.devices.get(key, ()):
            if d not in self.nodes:
                try:
                    self.nodes[d] = (await asyncio.wait_for(self.handles[d].endpoint.remote(), ENDPOINT_TIMEOUT))["node"]
                except (asyncio.TimeoutError, ray.exceptions.RayError):
                    pass

    # ------------------------------------------------------------ status
    async def status(self) -> dict:
        """Per key: devices, free, held, restarting, pending; the holders and
        the waiters."""
        self._discover(force=True)
        now = time.monotonic()
        keys = {}
        for key, names in self.devices.items():
            queue = sorted(self.queues.get(key, ()), key=lambda w: (-w.priority, w.seq))
            keys[key] = {"devices": len(names), "held": sum(1 for n in names if n in self.held),
                         "restarting": sum(1 for n in names if n in self.restarting),
                         "free": len(self._free(key, None)), "pending": len(queue), "user_cap": self._cap(key),
                         "waiting": [{"user": w.user, "priority": w.priority, "kind": w.kind,
                                      "waited_s": round(now - w.since, 3)} for w in queue]}
        return {"keys": keys, "holders": [h.public(now) for h in self.held.values()], "granted": self.granted}


def get(user_cap: int | None = None):
    """The farm's broker (created on first use, on the head node: a joined
    node may leave or die, taking the leases' state with it)."""
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    from .cluster import NAMESPACE

    head = next(n["NodeID"] for n in ray.nodes() if n["Alive"] and HEAD_RESOURCE in n["Resources"])
    return Broker.options(name=NAME, namespace=NAMESPACE, lifetime="detached", get_if_exists=True,
                          max_restarts=-1, max_concurrency=1000,
                          scheduling_strategy=NodeAffinitySchedulingStrategy(head, soft=False)).remote(user_cap)
