"""UCP-style custom-operator tasks: malloc / rpc / submit / wait / release.

The Horizon UCP flow (seed ``ucp-dsp-custom-operator``), one call each:

    with Tasks() as ucp:                       # hbUCP… on a (private) device
        data = ucp.malloc(4 * n)               # hbUCPMalloc + hbDSPAddrMap
        param = ucp.malloc(24)                 # hbDSPSoftmaxParam
        out = ucp.malloc(4 * n)
        task = ucp.rpc(0x1402, param, out)     # hbDSPRpcV2
        ucp.submit(task, core=ANY, priority=0) # hbUCPSubmitTask
        ucp.wait(task, timeout_ms=5000)        # hbUCPWaitTaskDone (raises OpFailed on a non-zero return)
        ucp.release(task)                      # hbUCPReleaseTask

Several tasks may be in flight at once; responses are matched by seq.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from .. import memory, trace
from ..abi import protocol as P
from ..abi import ops
from ..abi.ops import SOFTMAX_CMD, SOFTMAX_PARAM  # noqa: F401  (re-exported for the UCP flow)
from ..errors import DspxError, OpFailed
from .client import Client

ANY = P.CORE_ANY


@dataclass
class Mem:
    """Memory visible to the DSP: ``vir`` is the host view, ``phy`` the DSP address."""

    buf: memory.DmaBuf
    size: int

    @property
    def phy(self) -> int:
        return self.buf.dsp_addr

    @property
    def vir(self) -> np.ndarray:
        return self.buf.array(0, (self.size,), np.uint8)

    def view(self, dtype, count: int | None = None) -> np.ndarray:
        dt = np.dtype(dtype)
        n = self.size // dt.itemsize if count is None else count
        return self.buf.array(0, (n,), dt)


@dataclass
class Task:
    cmd: int
    input: Mem
    output: Mem
    seq: int | None = None
    state: str = "created"  # created → submitted → done | failed → released
    return_value: int = 0
    cycles: int = 0
    core: int = -1
    queued_us: int = 0
    printf: str = ""
    error: Exception | None = field(default=None, repr=False)


class Tasks:
    """A task session on a device (a private simulated one when none runs)."""

    def __init__(self, client: Client | None = None, *, socket: str | None = None, cores: int = 1, **opts):
        self._own = client is None
        opts.setdefault("staging_size", 0)  # tasks need no staging
        self.client = client or Client(socket, cores=cores, **opts)
        self._mems: list[Mem] = []

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def close(self) -> None:
        if self._own and self.client is not None:
            self.client.close()
        self.client = None

    # ------------------------------------------------------------------ memory
    def malloc(self, nbytes: int) -> Mem:
        mem = Mem(self.client.alloc(nbytes, "dspx-ucp"), nbytes)
        self._mems.append(mem)
        return mem

    def free(self, mem: Mem) -> None:
        self.client.detach(mem.buf)
        self._mems.remove(mem)

    # ------------------------------------------------------------------ tasks
    def rpc(self, cmd: int, input_mem: Mem, output_mem: Mem) -> Task:
        return Task(cmd, input_mem, output_mem)

    def submit(self, task: Task, core: int = ANY, priority: int = 0, timeout_ms: int = 0) -> Task:
        t0 = trace.clock() if trace.on else 0
        try:
            if task.state != "created":
                raise DspxError(f"task is {task.state}; create a new one with rpc()")
            if not 0 <= priority <= 255:
                raise ValueError(f"priority {priority} outside 0..255")
            for m in (task.input, task.output):  # the device reads what the host wrote
                m.buf.begin_cpu_access(memory.SYNC_WRITE)
                m.buf.end_cpu_access(memory.SYNC_WRITE)
            task.seq = self.client.send(P.Rpc(cmd=task.cmd, core=core, priority=priority, timeout_ms=timeout_ms,
                                              input_dsp_addr=task.input.phy, input_size=task.input.size,
                                              output_dsp_addr=task.output.phy, output_size=task.output.size))
            task.state = "submitted"
            return task
        finally:
            if t0:
                trace.complete("submit task", t0, "host", top=True)

    def wait(self, task: Task, timeout_ms: int = 30_000) -> Task:
        """Block until the task is done.  A task that failed raises: the
        device's typed error, or ``OpFailed`` (the op's name and non-zero
        ``return_value``) when the op ran and returned non-zero; either way
        ``task.return_value`` holds the code and the task can be released."""
        t0 = trace.clock() if trace.on else 0
        try:
            if task.state in ("done", "failed"):
                if task.error:
                    raise task.error
                return task
            if task.state != "submitted":
                raise DspxError(f"task is {task.state}; submit it first")
            resp = self.client.wait(task.seq, timeout_ms / 1000, f"RPC 0x{task.cmd:x}")
            task.printf = self.client.show_printf(resp.printf_size)
            task.return_value, task.cycles, task.core, task.queued_us = (resp.return_value, resp.cycles, resp.core,
                                                                         resp.queued_us)
            task.output.buf.begin_cpu_access(memory.SYNC_READ)
            task.output.buf.end_cpu_access(memory.SYNC_READ)
            try:
                self.client.check(resp, f"RPC 0x{task.cmd:x}")
                if resp.return_value != 0:  # the op ran and failed: hbUCPWaitTaskDone's -EREMOTEIO
                    raise OpFailed(task.cmd, self._op_name(task.cmd), resp.return_value, resp.core, task)
            except DspxError as e:
                task.state, task.error = "failed", e
                raise
            task.state = "done"
            return task
        finally:
            if t0:
                trace.complete("wait task", t0, "host", top=True)

    def _op_name(self, cmd: int) -> str:
        """The name the device registered ``cmd`` under (asked only when an op fails)."""
        try:
            return next((o["name"] for o in self.ops() if o["cmd"] == cmd), "no longer registered")
        except DspxError:
            return "name unknown"

    def release(self, task: Task) -> None:
        if task.state == "submitted":
            raise DspxError("task is still in flight: wait for it before releasing")
        task.state = "released"

    def run(self, cmd: int, input_mem: Mem, output_mem: Mem, core: int = ANY, priority: int = 0,
            timeout_ms: int = 30_000) -> Task:
        """rpc + submit + wait + release; raises as ``wait`` does (the task is
        released all the same)."""
        t = self.submit(self.rpc(cmd, input_mem, output_mem), core, priority)
        try:
            self.wait(t, timeout_ms)
        finally:
            if t.state != "submitted":  # still in flight after a timeout: it cannot be released yet
                self.release(t)
        return t

    def last_cost(self) -> dict:
        """The timing model's record of the last counted task of this session
        (``Client.last_cost``; its ``"seq"`` is that task's ``seq``)."""
        return self.client.last_cost()

    # ------------------------------------------------------------------ op libraries
    def load_ops(self, source: str | bytes | Path, device_wide: bool = False) -> tuple[int, int]:
        """Send an op library to the device: (library handle, number of ops).
        ``source``: Python source, a native library's bytes, or the path of
        either (a .py file or a .so built with ``dspx build-ops``).  The
        library is this session's: it is unloaded when the session closes.
        ``device_wide``: it stays after that, until any session (of the same
        user) unloads it with ``unload_ops`` or the device stops."""
        if isinstance(source, Path) or (isinstance(source, str) and "\n" not in source
                                        and source.endswith((".py", ".so"))):
            source = Path(source).read_bytes()
        data = source.encode() if isinstance(source, str) else bytes(source)
        buf = self.client.alloc(len(data), "dspx-oplib")
        try:
            buf.mm[:len(data)] = data
            buf.begin_cpu_access(memory.SYNC_WRITE)
            buf.end_cpu_access(memory.SYNC_WRITE)
            r = self.client.request(P.OpsLoad(src_dsp_addr=buf.dsp_addr, src_size=len(data),
                                              flags=P.OPS_LOAD_DEVICE_WIDE if device_wide else 0))
        finally:
            self.client.detach(buf)
        return r.lib_handle, r.num_ops

    def unload_ops(self, handle: int) -> None:
        """Unload an op library: this session's own, or a device-wide one (another's is ERR_HANDLE)."""
        self.client.request(P.DynUnload(module_handle=handle))

    def ops(self) -> list[dict]:
        out, start = [], 0
        while True:
            r = self.client.request(P.OpsList(start=start))
            out += [{"cmd": c, "name": n, "latency_us": lat, "library": lib} for c, lat, lib, _, n in r.entries()]
            start += r.count
            if r.count == 0 or start >= r.total:
                return out


def softmax_param(mem: Mem, data: Mem, n: int, tiled: bool) -> None:
    """Fill the seed's hbDSPSoftmaxParam (24 bytes) into ``mem``."""
    mem.buf.mm[:SOFTMAX_PARAM.size] = ops.softmax_param(4 * n, data.phy, tiled)
