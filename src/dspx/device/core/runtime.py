"""DSP runtime for custom operators — and the export table of op libraries.

An op library (see ``dspx.device.core.ops`` and docs/custom-ops.md) may import
numpy, math and this module, and from this module only the names in
``__all__``.  Everything a handler needs is here:

* ``register_op`` — put a handler under a command id (op libraries);
* ``mem_map`` / ``mem_unmap`` — a DSP address range of the calling
  connection as a zero-copy uint8 array, range-checked like inference;
* the tile manager ``tm`` (passed to every handler): tiles in the two L2 banks;
* ``dma`` — the core's two-channel asynchronous DMA engine;
* ``ping_pong`` — stream a DDR array through both banks, prefetching the next
  tile while the current one is computed on;
* vector helpers ``vecmax``, ``vecexp_max``, ``vecsum``, ``vecmul`` (float32);
* ``printf`` and ``cycles``.

The device core owns one ``CoreRuntime`` (L2, tile manager, DMA engine) and runs each
task inside ``activate(TaskContext(space, core))``; the per-task APIs above read the
active task from a context variable.

The timing model (``dspx.costmodel``, docs/cost-model.md).  A core started
with ``DSPX_COST_MODEL`` set has a profile (``CoreRuntime.configure_cost``);
then each task counts on the core's ``CostClock`` and ``cycles()`` returns
the modeled clock (cycles since the call began, its overhead included)
instead of the host's.  What a Python operator is counted for:

* ``dma.copy`` (and ``ping_pong``'s copies) issues a transfer on its channel's
  timeline, ``dma.wait`` waits for it; tiles cost nothing to allocate;
* each vector helper counts per *vector* of its array, ``v = ceil(n / L)``
  with ``L = vector_bits / 32`` float32 lanes (16 on ``j6-vision``): its loads
  and stores are TCM accesses when the array is a view of the core's L2 (a
  tile), DDR accesses otherwise; its operations are those of the seed's
  listing for one vector (``_VEC_OPS`` below; constants and coefficient
  tables are in local memory, so their loads count as TCM).  With
  ``R = log2(L)``:

  - ``vecmax(x)``: v loads of x, v + R ALU (max, then the lane tree), R + 1 moves;
  - ``vecsum(x)``: v loads of x, v ALU (add), 1 special (RADD);
  - ``vecexp_max(out, x, m)``: the seed's vecexpf_max, then vecsum(out):
    per vector 1 load of x, 7 table loads (TCM), 1 store to out, 18 ALU,
    11 multiply, 2 moves; then v loads of out, v ALU; once 1 TCM load,
    2 moves, 1 special;
  - ``vecmul(out, x, s)``: v loads of x, v stores to out, v multiply, 1 move;

  an empty array counts nothing.  Python arithmetic outside these helpers is
  not counted (it is not DSP code).

With no profile nothing of this runs: ``cycles()`` is the host clock, as before.
"""
from __future__ import annotations

import contextlib
import contextvars
import mmap
import operator
import queue
import re
import threading
import time
from collections.abc import Callable, Iterator

import numpy as np

from ... import trace
from ...abi.layout import PRINTF_HEADER
from ...costmodel import CostClock, Profile
from ...memory import L2_SIZE, PRINTF_SIZE, AddressError
from ...abi.protocol import Status
from .errors import DmaError, DmaTimeout, MapError, RuntimeMisuse, TileExhausted

__all__ = [
    # registration
    "register_op",
    # memory
    "mem_map", "mem_unmap",
    # L2 tiles and DMA
    "dma", "ping_pong", "BANKS", "CHANNELS", "TILE_ELEMS",
    # vector math
    "vecmax", "vecexp_max", "vecsum", "vecmul",
    # diagnostics
    "printf", "cycles", "CLOCK_HZ",
    # status codes and the errors a handler may want to catch
    "Status", "MapError", "TileExhausted", "DmaError", "DmaTimeout", "RuntimeMisuse",
]

CLOCK_HZ = 1_000_000_000  # nominal DSP clock: one cycle per nanosecond
BANKS = 2                 # L2 bank "colours" 0 and 1
CHANNELS = 2              # DMA channels
# 128 Ki floats = 512 KiB per tile: two fit the default L2 (640 KiB per bank)
# and stay in the host CPU's cache across a tile's fused steps; measured in
# benchmarks/softmax_device.py (smaller tiles pay more per-tile overhead).
TILE_ELEMS = 128 << 10
DMA_TIMEOUT_S = 10.0
F32 = np.dtype(np.float32)
_MASK64 = (1 << 64) - 1
# True once a core runtime in this process has a cost model: only then do the
# helpers look for the task's clock (a device without one runs no counting code).
_counting = False


def cycles() -> int:
    """The simulated 64-bit cycle counter: nanoseconds × the nominal 1 GHz clock;
    under a cost model, the task's modeled clock (cycles since the call began)."""
    if _counting:
        clock = _clock()
        if clock is not None:
            return clock.read()
    return (time.perf_counter_ns() * CLOCK_HZ // 1_000_000_000) & _MASK64


def _data_ptr(arr: np.ndarray) -> int:
    return arr.__array_interface__["data"][0]


def _count(value, what: str, minimum: int = 1) -> int:
    try:
        n = operator.index(value)
    except TypeError:
        raise RuntimeMisuse(f"{what} must be an integer, got {type(value).__name__}") from None
    if n < minimum:
        raise RuntimeMisuse(f"{what} must be >= {minimum}, got {n}")
    return n


# ------------------------------------------------------------------ L2 tiles

class TileManager:
    """Tiles in L2 SRAM: two banks (colours 0 and 1, one half each), first fit
    within a bank.  Tracks which tiles are live and which have DMA copies not
    yet waited for, so a copy can never touch a freed tile."""

    def __init__(self, l2: np.ndarray):
        self.l2 = l2
        self._ptr = _data_ptr(l2)
        half = l2.nbytes // 2
        self.bank_range = ((0, half), (half, l2.nbytes - half))  # (offset, size)
        self._holes: list[list[list[int]]] = [[[off, size]] for off, size in self.bank_range]
        self._tiles: dict[int, tuple[int, int]] = {}  # offset -> (size, bank)
        self._pins: dict[int, int] = {}  # offset -> copies not yet waited for

    def _bank(self, bank) -> int:
        b = _count(bank, "bank", 0)
        if b >= BANKS:
            raise RuntimeMisuse(f"bank {b} does not exist (banks are 0 and 1)")
        return b

    def free_bytes(self, bank: int) -> int:
        return sum(size for _, size in self._holes[self._bank(bank)])

    def alloc(self, nbytes: int, bank: int, align: int = 64) -> np.ndarray:
        """A uint8 view of ``nbytes`` of L2 in ``bank``, its address a multiple of ``align``."""
        nbytes = _count(nbytes, "tile size")
        b = self._bank(bank)
        align = _count(align, "align")
        if align & (align - 1):
            raise RuntimeMisuse(f"align must be a power of two, got {align}")
        holes = self._holes[b]
        for i, (off, size) in enumerate(holes):
            start = -(-(self._ptr + off) // align) * align - self._ptr
            if start + nbytes <= off + size:
                pieces = [[off, start - off], [start + nbytes, off + size - start - nbytes]]
                holes[i:i + 1] = [p for p in pieces if p[1] > 0]
                self._tiles[start] = (nbytes, b)
                return self.l2[start:start + nbytes]
        total = self.bank_range[b][1]
        raise TileExhausted(nbytes, b, self.free_bytes(b), max((s for _, s in holes), default=0), total)

    def free(self, tile: np.ndarray) -> None:
        off = _data_ptr(tile) - self._ptr if isinstance(tile, np.ndarray) and tile.base is self.l2 else None
        if off not in self._tiles:
            raise RuntimeMisuse("free of an array that is not a live tile (double free, or not from tm.alloc)")
        if self._pins.get(off):
            raise RuntimeMisuse(f"free of a tile with {self._pins[off]} DMA copies not yet waited for")
        size, b = self._tiles.pop(off)
        holes = self._holes[b]
        holes.append([off, size])
        holes.sort()
        merged: list[list[int]] = []
        for h in holes:
            if merged and merged[-1][0] + merged[-1][1] == h[0]:
                merged[-1][1] += h[1]
            else:
                merged.append(h)
        self._holes[b] = merged

    def live(self) -> list[tuple[int, int, int]]:
        """Live tiles as (L2 offset, size, bank)."""
        return [(off, size, b) for off, (size, b) in sorted(self._tiles.items())]

    def free_all(self) -> int:
        """Free every live tile (after a task); returns how many there were."""
        tiles = list(self._tiles)
        for off in tiles:
            self.free(self.l2[off:off + 1])
        return len(tiles)

    # -- used by the DMA engine
    def tile_of(self, arr: np.ndarray, nbytes: int) -> int | None:
        """The live tile holding arr's first nbytes, None if arr is not in L2."""
        if arr.base is not self.l2:  # every numpy view of L2 has .base == l2
            return None
        p = _data_ptr(arr) - self._ptr
        for off, (size, _) in self._tiles.items():
            if off <= p and p + nbytes <= off + size:
                return off
        raise DmaError(f"L2 range +0x{p:x} (+{nbytes}) is not inside a live tile (freed, or never allocated)")

    def pin(self, off: int) -> None:
        self._pins[off] = self._pins.get(off, 0) + 1

    def unpin(self, off: int) -> None:
        left = self._pins[off] - 1
        if left:
            self._pins[off] = left
        else:
            del self._pins[off]


# ------------------------------------------------------------------ DMA engine

class _Copy:
    __slots__ = ("src", "dst", "tiles", "done", "error", "issued")

    def __init__(self, src: np.ndarray, dst: np.ndarray, tiles: list[int]):
        self.src, self.dst, self.tiles = src, dst, tiles
        self.issued = trace.clock() if trace.on else 0  # when the task queued it (the trace's copy span says)
        # a bare lock held until the worker finishes: far cheaper than an Event per copy
        self.done = threading.Lock()
        self.done.acquire()
        self.error: BaseException | None = None


_STOP = object()  # close()'s private end-of-queue mark


class DmaEngine:
    """Two DMA channels, each a worker thread copying in submission order.
    ``copy`` returns at once; ``wait(channel)`` returns when every copy queued
    on that channel is done.  np.copyto releases the GIL, so copies really run
    while the caller computes."""

    def __init__(self, tm: TileManager, channels: int = CHANNELS, timeout: float = DMA_TIMEOUT_S):
        self.tm = tm
        self.timeout = timeout
        self.clock: CostClock | None = None  # the running task's, while a task with a cost model runs
        self._queues: list[queue.SimpleQueue] = [queue.SimpleQueue() for _ in range(channels)]
        self._pending: list[list[_Copy]] = [[] for _ in range(channels)]
        self.threads = [threading.Thread(target=self._worker, args=(q,), name=f"dspx-dma{ch}", daemon=True)
                        for ch, q in enumerate(self._queues)]
        for t in self.threads:
            t.start()

    def _channel(self, channel) -> int:
        ch = _count(channel, "DMA channel", 0)
        if ch >= len(self._queues):
            raise DmaError(f"DMA channel {ch} does not exist (channels 0..{len(self._queues) - 1})")
        return ch

    @staticmethod
    def _bytes(arr, nbytes: int, what: str) -> np.ndarray:
        if not isinstance(arr, np.ndarray):
            raise DmaError(f"DMA {what} must be a numpy array, got {type(arr).__name__}")
        if not arr.flags.c_contiguous:
            raise DmaError(f"DMA {what} must be contiguous")
        if nbytes > arr.nbytes:
            raise DmaError(f"DMA of {nbytes} bytes but the {what} holds only {arr.nbytes}")
        return arr.reshape(-1).view(np.uint8)[:nbytes]

    def copy(self, channel: int, src: np.ndarray, dst: np.ndarray, nbytes: int) -> None:
        """Queue a copy of the first nbytes of src into dst; returns at once."""
        ch = self._channel(channel)
        nbytes = _count(nbytes, "DMA size")
        s = self._bytes(src, nbytes, "source")
        d = self._bytes(dst, nbytes, "destination")
        if not d.flags.writeable:
            raise DmaError("DMA destination is read-only")
        tiles = [t for t in (self.tm.tile_of(s, nbytes), self.tm.tile_of(d, nbytes)) if t is not None]
        for t in tiles:
            self.tm.pin(t)
        if self.clock is not None:
            self.clock.dma_issue(ch, nbytes)
        job = _Copy(s, d, tiles)
        self._pending[ch].append(job)
        self._queues[ch].put(job)

    def in_flight(self, channel: int) -> int:
        """Copies queued on the channel and not yet waited for."""
        return len(self._pending[self._channel(channel)])

    def wait(self, channel: int, timeout: float | None = None) -> None:
        """Block until every copy queued on the channel has completed."""
        t0 = trace.clock() if trace.on else 0
        try:
            ch = self._channel(channel)
            pending = self._pending[ch]
            if not pending:
                raise DmaError(f"dma.wait({ch}) with nothing in flight on channel {ch}")
            if self.clock is not None:
                self.clock.dma_wait(ch)
            limit = self.timeout if timeout is None else timeout
            if not pending[-1].done.acquire(timeout=limit):  # FIFO per channel: the last done means all done
                raise DmaTimeout(f"DMA channel {ch}: {len(pending)} copies not complete after {limit} s")
            self._pending[ch] = []
            error = None
            for job in pending:
                for t in job.tiles:
                    self.tm.unpin(t)
                error = error or job.error
            if error is not None:
                raise DmaError(f"a copy on DMA channel {ch} failed: {error!r}") from error
        finally:
            if t0:
                trace.complete(f"dma wait ch{channel}", t0, "dma")

    def drain(self) -> None:
        """Wait for every channel with copies in flight (all of them, even
        when one reports a failed copy; the first failure is raised after)."""
        failure = None
        for ch, pending in enumerate(self._pending):
            if pending:
                try:
                    self.wait(ch)
                except DmaError as e:
                    failure = failure or e
        if failure is not None:
            raise failure

    def close(self) -> None:
        self.drain()
        for q in self._queues:
            q.put(_STOP)
        for t in self.threads:
            t.join(self.timeout)

    def broken(self) -> str:
        """What is wrong with the engine once a task settled ("" if intact):
        a worker thread gone, or a queue holding something nobody waits for."""
        for ch, (t, q) in enumerate(zip(self.threads, self._queues)):
            if not t.is_alive():
                return f"DMA channel {ch}'s thread is gone"
            if not q.empty() or self._pending[ch]:
                return f"DMA channel {ch}'s queue is inconsistent (items nobody waits for)"
        return ""

    def _do_copy(self, src: np.ndarray, dst: np.ndarray) -> None:
        np.copyto(dst, src)

    def _worker(self, q: queue.SimpleQueue) -> None:
        # Idle workers block on their queue; only close() ends them (a handler
        # that puts None or junk in a queue does not).
        while (job := q.get()) is not _STOP:
            if not isinstance(job, _Copy):
                continue
            try:
                if trace.on:  # every transfer on its channel's track (dspx.trace)
                    channel = threading.current_thread().name.removeprefix("dspx-dma")
                    trace.recorder().name_thread(f"dma channel {channel}")
                    with trace.span("dma copy", "dma", {"bytes": int(job.dst.nbytes), "issued": job.issued / 1000}):
                        self._do_copy(job.src, job.dst)
                else:
                    self._do_copy(job.src, job.dst)
            except Exception as e:  # reported to whoever waits on the channel
                job.error = e
            job.done.release()


# ------------------------------------------------------------------ core and task

class CoreRuntime:
    """The runtime state private to one simulated DSP core: L2 SRAM (a real,
    preallocated buffer), its tile manager and its DMA engine."""

    def __init__(self, l2_size: int = L2_SIZE, dma_timeout: float = DMA_TIMEOUT_S):
        l2_size = _count(l2_size, "L2 size", 2)
        # page-aligned (so tile alignment is real); every view of it has .base == l2
        self.l2 = np.frombuffer(mmap.mmap(-1, l2_size), np.uint8)
        self.l2.fill(0)  # touch every page now, not inside the first task
        self.tm = TileManager(self.l2)
        self.dma = DmaEngine(self.tm, timeout=dma_timeout)
        self.native = None  # the native ops' runtime (dspx.device.core.native.Context), made on first use
        self.cost: Profile | None = None  # the timing model's profile (configure_cost); None: off
        self.clock: CostClock | None = None

    def configure_cost(self, profile: Profile | None) -> None:
        """Count every later Python task under ``profile`` (None: the host clock, no counting)."""
        global _counting
        self.cost = profile
        self.clock = CostClock(profile) if profile is not None else None
        _counting = _counting or profile is not None

    def settle(self) -> list[str]:
        """Return the core to idle after a task: wait for copies the handler
        left in flight and free tiles it left allocated.  Returns warnings for
        the task's printf.  A DmaTimeout here means the engine is stuck and the
        core should be restarted."""
        notes = []
        left = sum(self.dma.in_flight(ch) for ch in range(CHANNELS))
        try:
            self.dma.drain()
        except DmaError as e:  # a failed copy nobody waited for; the channels are clear now
            notes.append(f"[dspx] {e}")
        if left:
            notes.append(f"[dspx] handler returned with {left} DMA copies not waited for")
        leaked = self.tm.free_all()
        if leaked:
            notes.append(f"[dspx] handler returned with {leaked} L2 tiles allocated; freed")
        return notes

    def broken(self) -> str:
        """What user code broke in this core's runtime ("" if intact): the
        Python DMA engine, and the native shim's state if it exists."""
        return self.dma.broken() or (self.native.broken(check=True) if self.native is not None else "")

    def close(self) -> None:
        self.dma.close()
        if self.native is not None:
            self.native.close()
            self.native = None

    def __enter__(self) -> "CoreRuntime":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class TaskContext:
    """What a handler's runtime calls see while it runs: the connection's
    address space (anything with ``.view(addr, size) -> memoryview`` raising
    AddressError, like dspx.memory.AddressSpace), the core, and the printf text."""

    def __init__(self, space, core: CoreRuntime, printf_limit: int = PRINTF_SIZE - PRINTF_HEADER):
        self.space = space
        self.core = core
        self.printf_limit = printf_limit
        self._text: list[str] = []
        self._maps: dict[int, np.ndarray] = {}
        # the timing model: the core's clock, restarted for this task (None: off)
        self.clock: CostClock | None = getattr(core, "clock", None)
        self.cost_record: dict | None = None  # the task's record, once end_cost ran
        if self.clock is not None:
            self.clock.begin()

    def end_cost(self) -> dict | None:
        """End the task's modeled clock and keep its record (None without a cost model)."""
        if self.clock is not None and self.cost_record is None:
            self.cost_record = self.clock.end()
        return self.cost_record

    def map(self, addr: int, nbytes: int) -> np.ndarray:
        try:
            view = self.space.view(addr, nbytes)
        except AddressError as e:
            raise MapError(addr, nbytes, str(e)) from None
        arr = np.frombuffer(view, np.uint8)
        self._maps[id(arr)] = arr
        return arr

    def unmap(self, arr: np.ndarray) -> None:
        if self._maps.pop(id(arr), None) is None:
            raise RuntimeMisuse("mem_unmap of an array that mem_map did not return (or already unmapped)")

    def write(self, text: str) -> None:
        self._text.append(text)

    def printf_text(self) -> str:
        """The task's printf output; when over the limit, the newest text wins
        (like the ring it goes to)."""
        text = "".join(self._text)
        data = text.encode("utf-8", "replace")
        if len(data) <= self.printf_limit:
            return text
        note = f"[dspx] printf: {len(data) - self.printf_limit} earlier bytes dropped\n".encode()
        return (note + data[len(data) - self.printf_limit + len(note):]).decode("utf-8", "ignore")


_current: contextvars.ContextVar[TaskContext | None] = contextvars.ContextVar("dspx_task", default=None)


@contextlib.contextmanager
def activate(task: TaskContext) -> Iterator[TaskContext]:
    """Make ``task`` the one mem_map, printf, dma and ping_pong act on."""
    token = _current.set(task)
    engine = task.core.dma if task.clock is not None else None
    if engine is not None:
        engine.clock = task.clock
    try:
        yield task
    finally:
        if engine is not None:
            engine.clock = None
        _current.reset(token)


def _clock() -> CostClock | None:
    task = _current.get()
    return task.clock if task is not None else None


def _task(api: str) -> TaskContext:
    task = _current.get()
    if task is None:
        raise RuntimeMisuse(f"{api} called outside a task")
    return task


# ------------------------------------------------------------------ per-task APIs

def mem_map(dsp_addr: int, nbytes: int) -> np.ndarray:
    """The task connection's DSP range [dsp_addr, dsp_addr+nbytes) as a
    zero-copy uint8 array; MapError (ERR_ADDR) unless it lies wholly inside
    one of the connection's buffers."""
    return _task("mem_map").map(dsp_addr, nbytes)


def mem_unmap(arr: np.ndarray) -> None:
    """Give back an array from mem_map.  (Numpy cannot revoke a view: keeping
    a reference past the task is still a bug, but not one this can catch.)"""
    _task("mem_unmap").unmap(arr)


# C length modifiers (%ld, %llu, %zu ...) have no meaning in Python's % formatting.
_C_LENGTH = re.compile(r"%([-+ #0]*(?:\d+|\*)?(?:\.(?:\d+|\*))?)(?:hh|h|ll|l|z|j|t|L)([diouxXeEfFgGcs])")


def printf(fmt: str, *args) -> None:
    """C-style printf into the task's printf text (no newline added)."""
    _task("printf").write(_C_LENGTH.sub(r"%\1\2", fmt) % args)


class _TaskDma:
    """``dma``: the running task's core DMA engine (see DmaEngine)."""

    def copy(self, channel: int, src: np.ndarray, dst: np.ndarray, nbytes: int) -> None:
        _task("dma.copy").core.dma.copy(channel, src, dst, nbytes)

    def wait(self, channel: int, timeout: float | None = None) -> None:
        _task("dma.wait").core.dma.wait(channel, timeout)

    def in_flight(self, channel: int) -> int:
        return _task("dma.in_flight").core.dma.in_flight(channel)


dma = _TaskDma()


# ------------------------------------------------------------------ vector math

def _f32(x: np.ndarray, what: str) -> np.ndarray:
    if not isinstance(x, np.ndarray) or x.dtype != F32:
        got = x.dtype if isinstance(x, np.ndarray) else type(x).__name__
        raise RuntimeMisuse(f"{what} must be a float32 array, got {got}")
    return x


# What a vector helper is counted for under a cost model (the runtime's
# docstring): per vector, (loads of x, stores to out, table loads (TCM), ALU,
# multiply, special, moves) from the seed's listing; and once per call, as a
# function of R = log2(lanes).  vecexp_max's sum is its own vecsum call.
_VEC_OPS = {
    "vecmax": ((1, 0, 0, 1, 0, 0, 0), lambda r: {"alu": r, "move": r + 1}),
    "vecsum": ((1, 0, 0, 1, 0, 0, 0), lambda r: {"special": 1}),
    "vecexp_max": ((1, 1, 7, 18, 11, 0, 2), lambda r: {"tcm_loads": 1, "move": 2}),
    "vecmul": ((1, 1, 0, 0, 1, 0, 0), lambda r: {"move": 1}),
}


def _count_vec(name: str, x: np.ndarray, out: np.ndarray | None = None) -> None:
    """Count one helper call on the running task's clock (nothing without one)."""
    task = _current.get()
    if task is None or task.clock is None or not x.size:
        return
    clock = task.clock
    lanes = clock.f32_lanes
    v = -(-x.size // lanes)
    (x_loads, out_stores, table_loads, alu, mul, special, move), once = _VEC_OPS[name]
    l2 = task.core.l2
    x_tcm, out_tcm = x.base is l2, out is not None and out.base is l2
    clock.add(ddr_loads=0 if x_tcm else x_loads * v, tcm_loads=(x_loads * v if x_tcm else 0) + table_loads * v,
              ddr_stores=0 if out_tcm else out_stores * v, tcm_stores=out_stores * v if out_tcm else 0,
              alu=alu * v, mul=mul * v, special=special * v, move=move * v)
    clock.add(**once(lanes.bit_length() - 1))


def vecmax(x: np.ndarray) -> np.float32:
    """Largest element; -inf for an empty array."""
    x = _f32(x, "vecmax input")
    if _counting:
        _count_vec("vecmax", x)
    return x.max() if x.size else np.float32(-np.inf)


def vecsum(x: np.ndarray) -> np.float32:
    """Sum in float32 (numpy's pairwise summation)."""
    x = _f32(x, "vecsum input")
    if _counting:
        _count_vec("vecsum", x)
    return np.add.reduce(x, dtype=F32)


def vecexp_max(out: np.ndarray, x: np.ndarray, m) -> np.float32:
    """out = exp(x - m), in place when out is x; returns sum(out)."""
    np.subtract(_f32(x, "vecexp_max input"), np.float32(m), out=_f32(out, "vecexp_max output"))
    if _counting:
        _count_vec("vecexp_max", x, out)
    np.exp(out, out=out)
    return vecsum(out)


def vecmul(out: np.ndarray, x: np.ndarray, scalar) -> None:
    """out = x * scalar (scalar taken as float32, so nothing widens to float64)."""
    np.multiply(_f32(x, "vecmul input"), np.float32(scalar), out=_f32(out, "vecmul output"))
    if _counting:
        _count_vec("vecmul", x, out)


# ------------------------------------------------------------------ ping-pong

def ping_pong(src: np.ndarray, dst: np.ndarray | None, length: int, tile_fn: Callable[[np.ndarray], None],
              tm: TileManager, *, tile_elems: int = TILE_ELEMS, write_back: bool = True,
              dma: DmaEngine | None = None) -> None:
    """Stream src[:length] (float32, in DDR) through one tile in each L2 bank:
    while ``tile_fn(tile)`` computes on the tile in one bank (a float32 view
    of L2 holding the current elements), the next tile is fetched into the
    other.  With ``write_back`` the tile's contents afterwards go to dst at
    the same offset (dst may be src).  Bank b uses DMA channel b; both must be
    idle.  Returns only after the last write-back has completed."""
    engine = dma if dma is not None else _task("ping_pong").core.dma
    length = _count(length, "length", 0)
    for arr, what in ((src, "source"), (dst, "destination")) if write_back else ((src, "source"),):
        if not _f32(arr, f"ping_pong {what}").flags.c_contiguous:
            raise RuntimeMisuse(f"ping_pong {what} must be contiguous")
    if length > src.size:
        raise RuntimeMisuse(f"ping_pong length {length} exceeds the source's {src.size} elements")
    if write_back and length > dst.size:
        raise RuntimeMisuse(f"ping_pong length {length} exceeds the destination's {dst.size} elements")
    te = min(_count(tile_elems, "tile_elems"), length)
    if any(engine.in_flight(b) for b in range(BANKS)):
        raise RuntimeMisuse("ping_pong needs both DMA channels idle (wait for your own copies first)")
    if length == 0:
        return
    rec = trace.recorder()
    if rec is not None:  # tracing: each tile's compute is an event (never checked per tile)
        tile_fn = _traced_tile(tile_fn, rec)
    src, dst = src.reshape(-1), dst.reshape(-1) if write_back else None
    tiles: list[np.ndarray] = []
    try:
        for b in range(BANKS):
            tiles.append(tm.alloc(te * F32.itemsize, b))
        views = [t.view(F32) for t in tiles]
        n_tiles = -(-length // te)

        def fetch(k: int) -> None:
            lo = k * te
            n = min(te, length - lo)
            engine.copy(k & 1, src[lo:lo + n], views[k & 1], n * F32.itemsize)

        fetch(0)
        if n_tiles > 1:
            fetch(1)
        for k in range(n_tiles):
            b, lo = k & 1, k * te
            n = min(te, length - lo)
            engine.wait(b)  # this tile's fetch, and the bank's previous write-back queued before it
            tile = views[b][:n]
            tile_fn(tile)
            if write_back:
                engine.copy(b, tile, dst[lo:lo + n], n * F32.itemsize)
            if k + 2 < n_tiles:
                fetch(k + 2)  # same channel, after the write-back: FIFO keeps the tile's data safe
    finally:
        # the last write-backs (or, after an error, whatever is still in flight)
        for b in range(BANKS):
            if engine.in_flight(b):
                engine.wait(b)
        for t in tiles:
            tm.free(t)


def _traced_tile(tile_fn: Callable, rec) -> Callable:
    count = iter(range(1 << 62))

    def traced(tile):
        t0 = trace.clock()
        try:
            return tile_fn(tile)
        finally:
            rec.complete(f"tile {next(count)}", t0, trace.clock(), "tile", {"elems": int(tile.size)})
    return traced


# ------------------------------------------------------------------ registration

class _Collector:
    """Where register_op puts operators while an op library's top level runs."""

    def __init__(self):
        self.ops: list[tuple[int, Callable, int, str]] = []


_collector: contextvars.ContextVar[_Collector | None] = contextvars.ContextVar("dspx_oplib", default=None)


@contextlib.contextmanager
def collecting() -> Iterator[_Collector]:
    """Collect register_op calls (the op registry wraps a library load in this)."""
    c = _Collector()
    token = _collector.set(c)
    try:
        yield c
    finally:
        _collector.reset(token)


def register_op(cmd: int, handler: Callable | None = None, latency_us: int = 0, name: str | None = None):
    """Register ``handler(input, output, tm) -> int`` under command id ``cmd``
    (0 = success).  Call it from an op library's top level, directly or as a
    decorator: ``@register_op(0x2402, latency_us=500)``."""
    collector = _collector.get()
    if collector is None:
        raise RuntimeMisuse("register_op is for op libraries being loaded "
                            "(firmware operators use OpRegistry.register)")
    cmd = _count(cmd, "command id", 0)
    latency_us = _count(latency_us, "latency_us", 0)
    if cmd >= 1 << 32 or latency_us >= 1 << 32:
        raise RuntimeMisuse("command id and latency_us must fit in 32 bits")

    def add(fn: Callable) -> Callable:
        if not callable(fn):
            raise RuntimeMisuse(f"handler for command 0x{cmd:x} is not callable")
        collector.ops.append((cmd, fn, latency_us, name or getattr(fn, "__name__", "op")))
        return fn

    return add if handler is None else add(handler)
