"""What the front knows: connections, their buffers, modules and models, the
op table and the device-wide accounting, and what its handlers may ask about
the cores.  Pure state, no sockets."""
from __future__ import annotations

import itertools
import os
import time
from dataclasses import dataclass, field
from typing import Callable

from ... import memory
from ...memory import AddressError, AddressSpace, Region
from ...abi.protocol import Status as S

MAX_PENDING_PER_CONN = 256
MAX_PENDING = 4096
# The source travels to every core inside one internal job message, which
# must fit a socket buffer: op libraries are small files.
MAX_OPLIB_SOURCE = 128 << 10
# Past these a request is refused with a status instead of exhausting the
# front's file descriptors or the job channel (SCM_RIGHTS carries at most
# 253 fds per message).
MAX_CONNS = 512  # at most; fewer when the fd limit is low (Limits)
MAX_BUFS_PER_CONN = 128  # BUF_ATTACH past this is ERR_NOMEM
MAX_INPUTS = 4096  # INFER_LARGE past this is ERR_INVALID
# Plans (validated INFER/RPC requests) a connection keeps; the oldest goes first.
MAX_PLANS_PER_CONN = 16


class Cores:
    """What handlers may ask about the cores."""

    def __init__(self, count: int, generation: Callable[[int], int | None], rss: Callable[[], int] = lambda: 0):
        self.count = count
        self.generation = generation  # the incarnation of a ready core, None if it is not ready
        self.rss = rss  # resident bytes of the front and its cores


@dataclass
class Limits:
    """What one connection, one peer process and the whole device may hold.

    File descriptors bound the connections and buffers the front can keep
    (one fd each; a core holds one per buffer it maps): of the soft
    RLIMIT_NOFILE (raised to the hard limit at start) a quarter goes to
    connections, half minus a reserve to buffers, the rest to cores,
    epoll, the listening socket and transient copies."""
    conns: int = MAX_CONNS
    conns_per_peer: int = MAX_CONNS // 4  # connections of one process (SO_PEERCRED pid)
    # The last connections are kept for processes that have none yet: five
    # greedy processes at 128 each no longer lock a sixth out.
    conns_reserved: int = MAX_CONNS // 8
    bufs_per_conn: int = MAX_BUFS_PER_CONN
    bufs_total: int = 4096
    conn_bytes: int = 0  # window bytes one connection may attach (0: the whole window)
    # What all connections of one process may hold while another process is
    # connected (0: no limit): 3/4 of the window and of the DDR pool, so a
    # process cannot take the rest from another by opening a second
    # connection or loading the same model again.  A process alone on the
    # device may use all of it (one large model on a small device).
    peer_bytes: int = 0
    peer_ddr: int = 0
    nofile: int = 0

    @classmethod
    def for_device(cls, nofile: int, window: int, conn_bytes: int | None = None, ddr: int = 0) -> "Limits":
        conns = max(8, min(MAX_CONNS, nofile // 4))
        return cls(conns=conns, conns_per_peer=max(2, conns // 4), conns_reserved=max(1, conns // 8),
                   bufs_total=max(MAX_BUFS_PER_CONN, nofile // 2 - 64),
                   conn_bytes=window * 3 // 4 if conn_bytes is None else conn_bytes,
                   peer_bytes=window * 3 // 4, peer_ddr=ddr * 3 // 4, nofile=nofile)


class Reject(Exception):
    """A request refused with a status; ``numbers`` fill response fields."""

    def __init__(self, status: int, message: str, **numbers):
        super().__init__(message)
        self.status = status
        self.numbers = numbers


@dataclass
class Buffer:
    buf_id: int
    fd: int
    region: Region
    staging: bool = False
    kv_size: int = 0
    busy: int = 0  # jobs in flight that use it


@dataclass
class Plan:
    """A validated INFER or RPC: what a request with the same bytes becomes."""
    plan_id: int
    core: int  # a core index, or CORE_ANY
    spec: object  # jobs.InferSpec | jobs.RpcSpec
    used: list  # Buffers the job holds busy
    priority: int = 0
    timeout_ms: int = 0


@dataclass
class Conn:
    cid: int
    ep: object  # transport.Endpoint; only the loop touches it
    uid: int
    space: AddressSpace = field(default_factory=AddressSpace)
    bufs: dict = field(default_factory=dict)  # addr -> Buffer
    printf: tuple | None = None  # (addr, size)
    modules: set = field(default_factory=set)
    models: set = field(default_factory=set)
    oplibs: set = field(default_factory=set)  # op libraries it owns: unloaded when it closes
    last_error: tuple = (0, 0, "")
    last_cost: tuple | None = None  # (core index, jobs.Cost) of its last counted call, for GET_COST
    inflight: int = 0
    closed: bool = False
    outbox: list = field(default_factory=list)  # encoded responses waiting for room in the socket
    plans: dict = field(default_factory=dict)  # request bytes (seq left out) -> Plan
    pid: int = 0  # the peer process (SO_PEERCRED)
    attached: int = 0  # window bytes its buffers take

    @property
    def staging(self) -> Buffer | None:
        for b in self.bufs.values():
            if b.staging:
                return b
        return None

    def kv_region(self):
        st = self.staging
        if st is None or st.kv_size == 0:
            return None
        return st, st.region.end() - st.kv_size, st.kv_size

    def resolve(self, addr: int, size: int, what: str) -> tuple[Buffer, int]:
        """Buffer and offset of [addr, addr+size) inside one of this connection's buffers."""
        try:
            r = self.space.find(addr, size)
        except AddressError:
            raise Reject(S.ERR_ADDR, f"{what} 0x{addr:x}+{size} is not inside a buffer of this connection") from None
        return self.bufs[r.addr], addr - r.addr


@dataclass
class ModuleRec:
    handle: int
    cid: int
    core: int
    generation: int
    kind: str  # "module" | "oplib"
    ddr_bytes: int = 0
    signature: object = None  # jobs.ModuleSig | None
    image: "Buffer | None" = None  # the front's copy of its bytes, to load it again after a core restart
    shared_uid: int | None = None  # a device-wide op library: any connection of this uid unloads it


@dataclass
class ModelRec:
    model_id: int
    cid: int
    core: int
    generation: int
    ddr_bytes: int
    num_constants: int
    image: "Buffer | None" = None


class DeviceState:
    """The front's bookkeeping of everything connections hold."""

    def __init__(self, carveout_size: int = memory.CARVEOUT_SIZE, ddr_pool_size: int = memory.DDR_POOL_SIZE):
        self.window = memory.FirstFit(memory.CARVEOUT_BASE, carveout_size)
        self.ddr = memory.Pool("ddr", memory.DDR_POOL_BASE, ddr_pool_size)
        self.started = time.monotonic()
        self.jobs_completed = 0
        self.jobs_failed = 0
        self.conns: dict[int, Conn] = {}
        self.modules: dict[int, ModuleRec] = {}
        self.models: dict[int, ModelRec] = {}
        self.op_table: dict[int, tuple] = {}  # cmd -> (name, latency_us, lib_handle)
        self.op_sources: dict[int, tuple[bytes, str]] = {}  # lib handle -> (source, filename)
        self.limits = Limits(conn_bytes=carveout_size)
        self.nbufs = 0  # buffers attached, all connections
        # Copies of loaded modules and weights (memfds), so that a core restart
        # costs no one else their state; at most the DDR pool's size of them.
        self.kept_bytes = 0
        self.keep_limit = ddr_pool_size
        self._ids = itertools.count(1)

    def new_id(self) -> int:
        return next(self._ids)

    def contended(self, pid: int) -> bool:
        """Whether a process other than ``pid`` is connected: the per-process shares bind then."""
        return any(c.pid != pid for c in self.conns.values())

    def peer_use(self, pid: int) -> tuple[int, int]:
        """(window bytes, DDR bytes) that all connections of process ``pid`` hold."""
        cids = {c.cid for c in self.conns.values() if c.pid == pid}
        window = sum(self.conns[cid].attached for cid in cids)
        ddr = sum(r.ddr_bytes for r in self.modules.values() if r.cid in cids)
        ddr += sum(r.ddr_bytes for r in self.models.values() if r.cid in cids)
        return window, ddr

    def check_peer_ddr(self, conn: Conn, need: int, what: str) -> None:
        """Reject (ERR_NOMEM, with the numbers) ``need`` more DDR bytes past the process's share."""
        share = self.limits.peer_ddr
        if not share or not self.contended(conn.pid):
            return
        used = self.peer_use(conn.pid)[1]
        if used + need > share:
            raise Reject(S.ERR_NOMEM, f"process quota: {what} needs {need} bytes of the DDR pool; process "
                                      f"{conn.pid} holds {used} of its {share} already, with other processes "
                                      f"connected (pool total {self.ddr.size})",
                         oom_requested=need, oom_free=max(0, share - used), oom_total=share)

    def uptime_ms(self) -> int:
        return int((time.monotonic() - self.started) * 1000) & 0xFFFFFFFF

    def module(self, conn: Conn, handle: int) -> ModuleRec:
        rec = self.modules.get(handle)
        if rec is None or rec.kind != "module" or rec.cid != conn.cid:
            raise Reject(S.ERR_HANDLE, f"unknown module handle {handle}")
        return rec

    def keep_image(self, src: "Buffer", size: int) -> "Buffer | None":
        """A private copy of the first ``size`` bytes of ``src`` (None past the budget)."""
        if self.kept_bytes + size > self.keep_limit:
            return None
        fd = os.memfd_create("dspx-kept", os.MFD_CLOEXEC)
        try:
            done = 0
            while done < size:
                n = os.copy_file_range(src.fd, fd, size - done, done, done)
                if n <= 0:
                    raise OSError("short copy")
                done += n
        except OSError:
            os.close(fd)
            return None
        self.kept_bytes += size
        buf_id = self.new_id()
        return Buffer(buf_id, fd, Region(buf_id, 0, size, None, "kept"))

    def drop_image(self, rec) -> None:
        if rec.image is not None:
            os.close(rec.image.fd)
            self.kept_bytes -= rec.image.region.size
            rec.image = None

    def drop_module(self, rec: ModuleRec) -> None:
        self.drop_image(rec)
        self.modules.pop(rec.handle, None)
        conn = self.conns.get(rec.cid)
        if conn:
            conn.modules.discard(rec.handle)
        self.ddr.give(rec.ddr_bytes)
        self._maybe_reset_pool()

    def drop_model(self, rec: ModelRec) -> None:
        self.drop_image(rec)
        self.models.pop(rec.model_id, None)
        conn = self.conns.get(rec.cid)
        if conn:
            conn.models.discard(rec.model_id)
        self.ddr.give(rec.ddr_bytes)
        self._maybe_reset_pool()

    def _maybe_reset_pool(self) -> None:
        # docs/compiler.md: pools are reset when nothing is loaded, so back-to-back
        # load cycles start from the same figures.
        if not any(m.kind == "module" for m in self.modules.values()) and not self.models:
            self.ddr.used = 0
