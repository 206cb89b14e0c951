"""Device actors: one Ray actor per device, holding one unit of the
``dspx:<key>`` resource, owning a simulated device process (a
``PrivateDevice``) and a ``Client`` on it.

- **Crashes.**  A device process that dies makes its actor exit; Ray restarts
  the actor (``max_restarts``), which starts a fresh device, and retries the
  call that was running and the calls queued behind it (``max_task_retries``).
  Every result says which attempt produced it.
- **Modules** cross to a node once: the driver ``ray.put``s a module's files
  and hands the actor a reference; the first actor on a node that needs it
  fetches it (under a lock) into the dspx cache, area ``farm``, by content
  digest; every other actor there, and every later batch, finds it on disk.
- **Status** answers while a call runs: ``info`` runs in its own concurrency
  group, apart from the calls.
"""
from __future__ import annotations

import fcntl
import json
import os
import re
import threading
from pathlib import Path

import numpy as np
import ray

from .. import cache
from ..errors import DeviceLost, DspxError

MANIFEST = "farm-manifest.json"  # written last: its presence says a cached module is whole
MAX_TASK_RETRIES = 2             # a call is tried up to 3 times: a device lost twice in one call is a bad input
CACHE_AREA = "farm"


def resource(key: str) -> str:
    return f"dspx:{key}"


def attempt_number() -> int:
    """1 for a call's first run, 2 for its first retry ...  Ray keeps the
    count in its core worker, not in a public API (hence the pinned minor
    version in pyproject.toml)."""
    from ray._private import worker

    return int(worker.global_worker.core_worker.get_current_task_attempt_number()) + 1


def module_paths(module) -> list[Path]:
    """The files of a compiled module that a device needs: a directory's
    regular files, or a ``.so`` with the metadata.json beside it."""
    p = Path(module)
    if p.is_dir():
        return sorted(f for f in p.iterdir() if f.is_file() and not f.name.startswith("."))
    return [p] + ([p.parent / "metadata.json"] if (p.parent / "metadata.json").is_file() else [])


def files_digest(files: dict[str, bytes]) -> str:
    return cache.digest((), *[part for name in sorted(files) for part in (name, files[name])], length=24)


@ray.remote(concurrency_groups={"control": 1, "run": 1})
class DeviceActor:
    """One device of the farm (created through ``spawn``)."""

    def __init__(self, name: str, cores: int = 1, device_args=(), socket: str | None = None):
        from ..host.client import Client
        from ..host.launcher import PrivateDevice
        from .nodes import Board

        self.name = name
        # A board (a socket given to `farm join`) is connected to, not started: a restarted actor reconnects.
        self.device = Board(socket) if socket else PrivateDevice(cores=cores, extra_args=device_args)
        self.client = Client(self.device.path, timeout=120)
        self.vms: dict[str, object] = {}
        self.ops = None  # (digest, task session, library handle) of the op library loaded for run_ops
        self.busy = 0
        self.calls = 0
        self.fetched = 0  # modules this actor brought to its node
        self.restarted = ray.get_runtime_context().was_current_actor_reconstructed
        self._lock = threading.Lock()

    @ray.method(concurrency_group="control")
    def info(self) -> dict:
        ctx = ray.get_runtime_context()
        return {"device": self.name, "node": ctx.get_node_id(), "node_ip": ray.util.get_node_ip_address(),
                "pid": os.getpid(), "device_pid": self.device.proc.pid, "busy": self.busy > 0,
                "calls": self.calls, "fetched": self.fetched, "restarted": self.restarted}

    @ray.method(concurrency_group="control")
    def endpoint(self) -> dict:
        """Where a lease holder on this machine reaches the device itself."""
        import socket

        return {"device": self.name, "node": ray.get_runtime_context().get_node_id(), "host": socket.gethostname(),
                "socket": self.client.socket_path}

    @ray.method(concurrency_group="run")
    def run(self, digest: str, module_box: list, batch: list[dict]) -> list[dict]:
        """Run the module (content ``digest``; ``module_box[0]`` the object
        ref of its files, fetched only on a cache miss) once per input dict
        of ``batch``; each result: outputs by name, node, device, attempt."""
        return self._batch(lambda: self._module(digest, module_box), self._call, batch)

    @ray.method(concurrency_group="run")
    def run_ops(self, digest: str, lib_box: list, cases: list[dict]) -> list[dict]:
        """Run an op library's cases (content ``digest``; ``lib_box[0]`` its
        files, fetched only on a cache miss): each case ``{"cmd", "input"
        (uint8), "output_bytes", "timeout_ms"}`` gives its output bytes,
        return value and cycles, or the device's error for it."""
        return self._batch(lambda: self._op_library(digest, lib_box), self._op_case, cases)

    def _batch(self, prepare, each, batch: list) -> list[dict]:
        """``each(prepare(), item)`` for every item, counted as one call;
        each result with where it ran."""
        with self._lock:
            self.busy += 1
            try:
                target = prepare()
                outs = [each(target, item) for item in batch]
            finally:
                self.busy -= 1
                self.calls += 1
        where = {"node": ray.get_runtime_context().get_node_id(), "device": self.name, "attempt": attempt_number()}
        return [{"outputs": o, **where} for o in outs]

    def _op_library(self, digest: str, lib_box: list):
        """A task session with the library loaded (one library at a time:
        another batch's may hold the same command ids)."""
        from ..host.tasks import Tasks

        if self.ops is not None and self.ops[0] == digest:
            return self.ops[1]
        if self.ops is not None:
            self.ops[1].unload_ops(self.ops[2])
            self.ops = None
        path = self._cached(digest, lib_box, _write_op_library)
        manifest = json.loads((path / MANIFEST).read_text())
        tasks = Tasks(client=self.client)
        try:
            handle, _ = tasks.load_ops(path / manifest["library"])
        except DspxError as e:
            self._exit_if_lost(e)
            raise
        self.ops = (digest, tasks, handle)
        return tasks

    def _op_case(self, tasks, case: dict) -> dict:
        from ..errors import OpFailed

        data = np.asarray(case["input"], np.uint8).reshape(-1)
        inp, out = tasks.malloc(max(data.size, 1)), tasks.malloc(max(int(case["output_bytes"]), 1))
        try:
            inp.vir[:data.size] = data
            out.vir[:] = 0
            try:
                t = tasks.run(int(case["cmd"]), inp, out, timeout_ms=int(case["timeout_ms"]))
                rv, cycles, error = t.return_value, t.cycles, None
            except OpFailed as e:  # it ran and returned non-zero: a result to compare, not a failure here
                rv, cycles, error = e.return_value, e.task.cycles if e.task is not None else 0, None
            except DspxError as e:
                self._exit_if_lost(e)
                rv, cycles, error = None, 0, f"{getattr(e, 'status_name', type(e).__name__)}: {e}"
            return {"output": np.array(out.vir[:int(case["output_bytes"])]), "return_value": rv, "cycles": cycles,
                    "error": error}
        finally:
            tasks.free(inp)
            tasks.free(out)

    def _call(self, vm, inputs: dict) -> dict:
        try:
            outs = vm[vm.entry](**inputs)
        except DspxError as e:
            self._exit_if_lost(e)
            raise
        outs = outs if isinstance(outs, list) else [outs]
        return {spec.name: np.asarray(o) for spec, o in zip(vm.output_specs(), outs)}

    def _exit_if_lost(self, e: Exception) -> None:
        """A lost device ends this actor, so that Ray restarts it with a new
        device and retries the call; any other error is the caller's."""
        if isinstance(e, DeviceLost) or self.device.proc.poll() is not None:
            self.device.stop(timeout=2.0)  # its directory; the process is gone or going
            os._exit(1)

    def _module(self, digest: str, module_box: list):
        vm = self.vms.get(digest)
        if vm is not None:
            return vm
        from ..host.vm import VirtualMachine

        path = self._cached(digest, module_box)
        manifest = json.loads((path / MANIFEST).read_text())
        try:
            vm = VirtualMachine(path / manifest["module"], client=self.client)
        except DspxError as e:
            self._exit_if_lost(e)
            raise
        self.vms[digest] = vm
        return vm

    def _cached(self, digest: str, module_box: list, write=None) -> Path:
        """The module's (or op library's) directory in this node's cache,
        fetched into it by the first actor on the node that needs it."""
        area = cache.area(CACHE_AREA)
        path = area / digest
        area.mkdir(parents=True, exist_ok=True)
        with open(area / f".{digest}.lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            if not (path / MANIFEST).is_file():
                files = ray.get(module_box[0])
                if files_digest(files) != digest:
                    raise DspxError(f"module {digest}: the files received do not match their digest")
                cache.publish(path, lambda tmp: (write or _write_module)(tmp, files), complete=MANIFEST)
                self.fetched += 1
        return path


def _write_module(tmp: Path, files: dict[str, bytes]) -> None:
    for name, data in files.items():
        (tmp / name).write_bytes(data)
    so = next((n for n in files if n.endswith(".so")), None)
    if so is None:
        raise DspxError("the module has no .so file")
    (tmp / MANIFEST).write_text(json.dumps({"module": so, "files": sorted(files)}))


def _write_op_library(tmp: Path, files: dict[str, bytes]) -> None:
    if len(files) != 1:
        raise DspxError(f"an op library is one file (got {len(files)})")
    (name, data), = files.items()
    (tmp / name).write_bytes(data)
    (tmp / MANIFEST).write_text(json.dumps({"library": name, "files": [name]}))


def spawn(key: str, index: int, cores: int = 1, threads: int = 1, device_args=(), *, node: str | None = None,
          socket: str | None = None):
    """Create device ``<key>-<index>``: a detached actor (it outlives the
    driver that made it), named so any driver finds it.  ``node``: the Ray
    node it runs on (and is restarted on; a device of a lost node ends with
    it); ``socket``: a board's socket on that node, connected to instead of
    starting a simulated device."""
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    from .cluster import NAMESPACE

    name = f"{key}-{index}"
    args = ["--threads", str(threads), *map(str, device_args)]
    pin = {"scheduling_strategy": NodeAffinitySchedulingStrategy(node, soft=False)} if node else {}
    return DeviceActor.options(name=name, namespace=NAMESPACE, lifetime="detached", num_cpus=0,
                           resources={resource(key): 1}, max_restarts=-1, max_task_retries=MAX_TASK_RETRIES,
                           **pin).remote(name, cores, args, socket)


def wait_ready(handles, timeout: float) -> list[dict]:
    """Every device's ``info`` once it answers (its device started)."""
    from .cluster import FarmError

    refs = [h.info.remote() for h in handles]
    ready, pending = ray.wait(refs, num_returns=len(refs), timeout=timeout)
    if pending:
        raise FarmError(f"{len(pending)} of {len(refs)} device(s) did not start within {timeout:.0f} s")
    try:
        return ray.get(ready)
    except ray.exceptions.RayError as e:  # a constructor that raised: the device did not start
        lines = [ln for ln in str(e).splitlines() if ln.strip()]
        raise FarmError(f"a device did not start: {lines[-1] if lines else type(e).__name__}") from None


def find_devices(key: str | None = None) -> dict[str, object]:
    """The farm's device actors (of ``key``, or all), by name in index order."""
    from .cluster import NAMESPACE

    names = [a["name"] for a in ray.util.list_named_actors(all_namespaces=True) if a["namespace"] == NAMESPACE
             and re.fullmatch(r".+-\d+", a["name"])]  # the farm's other actors (its broker) are not devices
    if key is not None:
        names = [n for n in names if n.rpartition("-")[0] == key]
    names.sort(key=lambda n: (n.rpartition("-")[0], int(n.rpartition("-")[2] or 0)))
    return {n: ray.get_actor(n, namespace=NAMESPACE) for n in names}
