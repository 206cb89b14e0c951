"""DSP runtime: cycle counter, tile manager, DMA engine, ping-pong, vector
helpers, mem_map and printf — in-process, with an AddressSpace over
anonymous mmaps standing in for a connection's dmabufs."""
from __future__ import annotations

import mmap
import threading
import time

import numpy as np
import pytest

from dspx.memory import L2_SIZE, AddressError, AddressSpace, Region
from dspx.abi.protocol import Status
from dspx.device.core import runtime as rt
from dspx.device.core.errors import DmaError, DmaTimeout, MapError, RuntimeMisuse, TileExhausted

BASE = 0xC000_0000


@pytest.fixture
def core():
    c = rt.CoreRuntime()
    yield c
    c.close()


def make_space(*sizes: int) -> tuple[AddressSpace, list[int], list[mmap.mmap]]:
    """One region per size, a page apart, like dmabufs in the carveout window."""
    space, addrs, maps = AddressSpace(), [], []
    addr = BASE
    for i, size in enumerate(sizes):
        mm = mmap.mmap(-1, size)
        space.add(Region(i + 1, addr, size, mm))
        addrs.append(addr)
        maps.append(mm)
        addr += (size + 2 * mmap.PAGESIZE) // mmap.PAGESIZE * mmap.PAGESIZE
    return space, addrs, maps


class GatedDma(rt.DmaEngine):
    """A DMA engine whose copies wait for a gate and record the worker thread:
    makes asynchrony observable without depending on timing."""

    def __init__(self, tm):
        self.gate = threading.Event()
        self.copied_by: list[int] = []
        super().__init__(tm, timeout=5.0)

    def _do_copy(self, src, dst):
        assert self.gate.wait(10)
        self.copied_by.append(threading.get_ident())
        super()._do_copy(src, dst)


@pytest.fixture
def gated(core):
    eng = GatedDma(core.tm)
    yield eng
    eng.gate.set()
    eng.close()


# ------------------------------------------------------------------ cycles

def test_cycles_is_nanoseconds_at_1ghz():
    assert rt.CLOCK_HZ == 1_000_000_000
    a = time.perf_counter_ns()
    c = rt.cycles()
    b = time.perf_counter_ns()
    assert isinstance(c, int) and a <= c <= b
    assert rt.cycles() >= c


# ------------------------------------------------------------------ tiles

def test_l2_is_one_preallocated_buffer_split_in_two_banks(core):
    assert core.l2.nbytes == L2_SIZE == 1280 << 10
    assert core.tm.free_bytes(0) == core.tm.free_bytes(1) == L2_SIZE // 2
    t0 = core.tm.alloc(1000, 0)
    t1 = core.tm.alloc(1000, 1)
    assert t0.dtype == np.uint8 and t0.nbytes == 1000
    assert np.shares_memory(t0, core.l2) and np.shares_memory(t1, core.l2)
    base = core.l2.ctypes.data
    assert 0 <= t0.ctypes.data - base < L2_SIZE // 2 <= t1.ctypes.data - base < L2_SIZE
    t0[:] = 7
    assert (core.l2[t0.ctypes.data - base:][:1000] == 7).all()


@pytest.mark.parametrize("align", [1, 64, 4096])
def test_tiles_are_aligned(core, align):
    core.tm.alloc(3, 0, align=1)  # knock the next hole off alignment
    t = core.tm.alloc(100, 0, align=align)
    assert t.ctypes.data % align == 0


def test_tile_exhaustion_names_requested_and_free(core):
    tm = core.tm
    half = L2_SIZE // 2
    tm.alloc(half - 4096, 1)
    with pytest.raises(TileExhausted) as ei:
        tm.alloc(8192, 1)
    e = ei.value
    assert e.status == Status.ERR_NOMEM
    assert (e.requested, e.bank, e.free, e.total) == (8192, 1, 4096, half)
    assert "8192" in str(e) and "free 4096" in str(e) and "bank 1" in str(e)
    tm.alloc(half, 0)  # the other bank is untouched


def test_free_merges_holes_so_the_whole_bank_comes_back(core):
    tm = core.tm
    half = L2_SIZE // 2
    tiles = [tm.alloc(half // 4, 0) for _ in range(4)]
    for i in (1, 3, 0, 2):
        tm.free(tiles[i])
    assert tm.live() == []
    assert tm.alloc(half, 0).nbytes == half


def test_tile_misuse(core):
    tm = core.tm
    t = tm.alloc(64, 0)
    tm.free(t)
    with pytest.raises(RuntimeMisuse, match="double free"):
        tm.free(t)
    with pytest.raises(RuntimeMisuse):
        tm.free(np.zeros(64, np.uint8))
    for bad in (2, -1):
        with pytest.raises(RuntimeMisuse, match="bank"):
            tm.alloc(64, bad)
    with pytest.raises(RuntimeMisuse, match="power of two"):
        tm.alloc(64, 0, align=48)
    with pytest.raises(RuntimeMisuse):
        tm.alloc(0, 0)
    assert RuntimeMisuse.status == Status.ERR_INVALID


# ------------------------------------------------------------------ DMA

def test_dma_copy_then_wait(core):
    src = np.arange(1 << 16, dtype=np.float32)
    tile = core.tm.alloc(src.nbytes, 0).view(np.float32)
    core.dma.copy(0, src, tile, src.nbytes)
    assert core.dma.in_flight(0) == 1
    core.dma.wait(0)
    assert core.dma.in_flight(0) == 0
    assert np.array_equal(tile, src)


def test_dma_copies_a_prefix_only(core):
    src = np.arange(100, dtype=np.uint8)
    dst = np.zeros(100, np.uint8)
    core.dma.copy(1, src, dst, 10)
    core.dma.wait(1)
    assert np.array_equal(dst[:10], src[:10]) and not dst[10:].any()


def test_dma_is_ordered_per_channel(core, gated):
    a = np.arange(4096, dtype=np.uint8)
    b = core.tm.alloc(4096, 0)
    c = np.zeros(4096, np.uint8)
    b[:] = 0
    gated.copy(0, a, b, 4096)
    gated.copy(0, b, c, 4096)  # depends on the first copy having landed
    assert not c.any()
    gated.gate.set()
    gated.wait(0)
    assert np.array_equal(c, a)


def test_dma_runs_on_its_own_thread_while_the_caller_computes(core, gated):
    src = np.arange(1 << 20, dtype=np.float32)
    dst = np.zeros_like(src)
    gated.copy(1, src, dst, src.nbytes)
    # copy() returned; the copy has not happened and the caller keeps computing
    assert not dst.any()
    x = np.linspace(-1, 1, 1 << 16, dtype=np.float32)
    assert rt.vecexp_max(x, x, np.float32(1)) > 0
    assert not dst.any()
    gated.gate.set()
    gated.wait(1)
    assert np.array_equal(dst, src)
    worker = gated.threads[1].ident
    assert gated.copied_by == [worker] and worker != threading.get_ident()


def test_dma_wait_times_out_and_can_be_retried(core, gated):
    src = np.ones(64, np.uint8)
    dst = np.zeros(64, np.uint8)
    gated.copy(0, src, dst, 64)
    with pytest.raises(DmaTimeout) as ei:
        gated.wait(0, timeout=0.05)
    assert ei.value.status == Status.ERR_TIMEOUT
    gated.gate.set()
    gated.wait(0)
    assert dst.all()


def test_dma_misuse(core):
    dma = core.dma
    a = np.zeros(256, np.uint8)
    with pytest.raises(DmaError, match="nothing in flight"):
        dma.wait(0)
    for ch in (2, -1, "0"):
        with pytest.raises(RuntimeMisuse, match="channel"):
            dma.copy(ch, a, a.copy(), 16)
    with pytest.raises(DmaError, match="holds only 256"):
        dma.copy(0, a, np.zeros(512, np.uint8), 300)
    with pytest.raises(DmaError, match="holds only 256"):
        dma.copy(0, np.zeros(512, np.uint8), a, 300)
    with pytest.raises(RuntimeMisuse):
        dma.copy(0, a, a.copy(), 0)
    with pytest.raises(DmaError, match="contiguous"):
        dma.copy(0, np.zeros((16, 16), np.uint8)[:, ::2], a, 16)
    ro = np.zeros(256, np.uint8)
    ro.flags.writeable = False
    with pytest.raises(DmaError, match="read-only"):
        dma.copy(0, a, ro, 16)
    with pytest.raises(DmaError, match="numpy array"):
        dma.copy(0, b"x" * 256, a, 16)
    assert dma.in_flight(0) == dma.in_flight(1) == 0  # nothing was queued
    assert DmaError.status == Status.ERR_INVALID


def test_dma_refuses_freed_tiles(core):
    tm, dma = core.tm, core.dma
    tile = tm.alloc(256, 0)
    tm.free(tile)
    a = np.zeros(256, np.uint8)
    with pytest.raises(DmaError, match="live tile"):
        dma.copy(0, a, tile, 256)
    with pytest.raises(DmaError, match="live tile"):
        dma.copy(0, tile, a, 256)
    # a view past a live tile's end is not inside it either
    small = tm.alloc(128, 0)
    with pytest.raises(DmaError, match="live tile"):
        dma.copy(0, a, tm.l2[small.ctypes.data - tm.l2.ctypes.data:][:256], 256)


def test_free_of_a_tile_with_copies_in_flight_is_refused(core, gated):
    tile = core.tm.alloc(64, 1)
    gated.copy(1, np.ones(64, np.uint8), tile, 64)
    with pytest.raises(RuntimeMisuse, match="not yet waited"):
        core.tm.free(tile)
    gated.gate.set()
    gated.wait(1)
    core.tm.free(tile)


def test_a_failed_copy_is_reported_by_wait(core):
    class Broken(rt.DmaEngine):
        def _do_copy(self, src, dst):
            raise OSError("bus error")

    eng = Broken(core.tm)
    try:
        eng.copy(0, np.ones(8, np.uint8), np.zeros(8, np.uint8), 8)
        with pytest.raises(DmaError, match="bus error"):
            eng.wait(0)
        assert eng.in_flight(0) == 0
    finally:
        eng.close()


def test_settle_drains_dma_and_frees_leftover_tiles(core):
    tile = core.tm.alloc(1 << 16, 0)
    core.tm.alloc(64, 1)
    core.dma.copy(0, np.ones(1 << 16, np.uint8), tile, 1 << 16)
    notes = core.settle()
    assert any("1 DMA copies" in n for n in notes) and any("2 L2 tiles" in n for n in notes)
    assert core.tm.live() == [] and core.dma.in_flight(0) == 0
    assert core.settle() == []


# ------------------------------------------------------------------ ping-pong

TE = 1024


@pytest.mark.parametrize("length", [1, 7, TE - 1, TE, TE + 1, 2 * TE, 3 * TE + 5, 100_000])
def test_ping_pong_tails(core, length):
    rng = np.random.default_rng(length)
    src = rng.standard_normal(length + 3, dtype=np.float32)
    dst = np.full_like(src, -7)
    seen = []

    def double(tile):
        seen.append(tile.size)
        assert tile.dtype == np.float32 and np.shares_memory(tile, core.l2)
        tile *= np.float32(2)

    rt.ping_pong(src, dst, length, double, core.tm, tile_elems=TE, dma=core.dma)
    assert np.array_equal(dst[:length], src[:length] * 2)
    assert (dst[length:] == -7).all()  # nothing written past length
    assert sum(seen) == length and all(n == TE for n in seen[:-1]) and 0 < seen[-1] <= TE
    assert core.tm.live() == [] and core.dma.in_flight(0) == core.dma.in_flight(1) == 0

    m, s = np.float32(-np.inf), [0.0]

    def reduce(tile):
        nonlocal m
        m = max(m, rt.vecmax(tile))
        s[0] += float(rt.vecsum(tile))

    rt.ping_pong(src, None, length, reduce, core.tm, tile_elems=TE, write_back=False, dma=core.dma)
    assert m == src[:length].max()
    assert s[0] == pytest.approx(float(src[:length].astype(np.float64).sum()), rel=1e-5, abs=1e-3)


def test_ping_pong_in_place(core):
    x = np.arange(10 * TE + 3, dtype=np.float32)
    want = x + 1
    rt.ping_pong(x, x, x.size, lambda t: np.add(t, np.float32(1), out=t), core.tm, tile_elems=TE, dma=core.dma)
    assert np.array_equal(x, want)


def test_ping_pong_huge_with_default_tiles(core):
    n = (1 << 24) + 3
    x = np.arange(n, dtype=np.float32)
    x %= np.float32(1000)
    y = np.empty_like(x)
    tiles = []
    rt.ping_pong(x, y, n, lambda t: (tiles.append(t.size), np.multiply(t, np.float32(0.5), out=t)),
                 core.tm, dma=core.dma)
    assert np.array_equal(y, x * np.float32(0.5))
    assert tiles[0] == rt.TILE_ELEMS and tiles[-1] == n % rt.TILE_ELEMS == 3


def test_ping_pong_default_tile_fits_the_banks():
    assert 2 * rt.TILE_ELEMS * 4 <= L2_SIZE


def test_ping_pong_zero_length_does_nothing(core):
    rt.ping_pong(np.zeros(4, np.float32), None, 0, pytest.fail, core.tm, write_back=False, dma=core.dma)
    assert core.tm.live() == []


def test_ping_pong_error_in_tile_fn_leaves_the_core_clean(core):
    x = np.ones(10 * TE, np.float32)
    calls = []

    def boom(tile):
        calls.append(1)
        if len(calls) == 3:
            raise ArithmeticError("tile 3")

    with pytest.raises(ArithmeticError):
        rt.ping_pong(x, x.copy(), x.size, boom, core.tm, tile_elems=TE, dma=core.dma)
    assert core.tm.live() == [] and core.dma.in_flight(0) == core.dma.in_flight(1) == 0


def test_ping_pong_misuse(core):
    tm, dma = core.tm, core.dma
    x = np.ones(100, np.float32)
    with pytest.raises(RuntimeMisuse, match="float32"):
        rt.ping_pong(x.astype(np.float64), x, 10, abs, tm, dma=dma)
    with pytest.raises(RuntimeMisuse, match="exceeds"):
        rt.ping_pong(x, x[:50], 100, abs, tm, dma=dma)
    with pytest.raises(RuntimeMisuse, match="contiguous"):
        rt.ping_pong(x, np.ones(200, np.float32)[::2], 100, abs, tm, dma=dma)
    with pytest.raises(TileExhausted):
        rt.ping_pong(np.ones(L2_SIZE, np.float32), None, L2_SIZE, abs, tm, tile_elems=L2_SIZE,
                     write_back=False, dma=dma)
    assert tm.live() == []
    dma.copy(0, np.ones(4, np.uint8), np.zeros(4, np.uint8), 4)
    with pytest.raises(RuntimeMisuse, match="idle"):
        rt.ping_pong(x, x, 100, abs, tm, dma=dma)
    dma.wait(0)
    with pytest.raises(RuntimeMisuse, match="outside a task"):
        rt.ping_pong(x, x, 100, abs, tm)


# ------------------------------------------------------------------ vector math

def test_vector_helpers_stay_float32():
    x = np.linspace(-3, 2, 1001, dtype=np.float32)
    out = np.empty_like(x)
    m = rt.vecmax(x)
    assert m.dtype == np.float32 and m == x.max()
    s = rt.vecexp_max(out, x, np.float64(m))  # a float64 scalar must not widen anything
    assert s.dtype == np.float32 and out.dtype == np.float32
    assert np.array_equal(out, np.exp(x - m))
    assert s == np.add.reduce(out, dtype=np.float32)
    rt.vecmul(out, out, 1 / np.float64(s))
    assert out.dtype == np.float32
    assert np.allclose(out.sum(dtype=np.float64), 1, rtol=1e-6)
    assert rt.vecsum(x).dtype == np.float32
    assert rt.vecmax(np.zeros(0, np.float32)) == -np.inf


def test_vecmul_matches_float32_arithmetic_exactly():
    x = np.random.default_rng(0).standard_normal(999).astype(np.float32)
    out = np.empty_like(x)
    rt.vecmul(out, x, 0.1)
    assert np.array_equal(out, x * np.float32(0.1))


def test_vector_helpers_refuse_other_dtypes():
    with pytest.raises(RuntimeMisuse, match="float32"):
        rt.vecmax(np.zeros(3))
    with pytest.raises(RuntimeMisuse, match="float32"):
        rt.vecexp_max(np.zeros(3), np.zeros(3, np.float32), 0)
    with pytest.raises(RuntimeMisuse, match="float32"):
        rt.vecsum([1.0, 2.0])


# ------------------------------------------------------------------ mem_map, printf, dma proxy

def test_mem_map_is_zero_copy_and_range_checked(core):
    space, (a, b), (ma, mb) = make_space(4096, 8192)
    with rt.activate(rt.TaskContext(space, core)):
        arr = rt.mem_map(a + 100, 50)
        assert arr.dtype == np.uint8 and arr.nbytes == 50
        arr[:] = 9
        assert ma[100:150] == b"\x09" * 50 and ma[99] == 0 and ma[150] == 0
        mb[0:4] = b"abcd"
        assert rt.mem_map(b, 4).tobytes() == b"abcd"
        assert rt.mem_map(b + 8191, 1).nbytes == 1
        rt.mem_unmap(arr)
        with pytest.raises(RuntimeMisuse, match="mem_unmap"):
            rt.mem_unmap(arr)
        for addr, n in [(a + 4000, 200),       # runs past the end of the first buffer
                        (a - 1, 2),            # starts before it
                        (a + 4096, 4),         # the gap between buffers
                        (b, 8193),
                        ((1 << 64) - 4, 8),    # wraps around 2**64
                        (a, -1)]:
            with pytest.raises(MapError) as ei:
                rt.mem_map(addr, n)
            assert ei.value.status == Status.ERR_ADDR
            assert isinstance(ei.value, AddressError)
            assert f"0x{addr:x}" in str(ei.value)


def test_task_apis_outside_a_task_are_refused():
    for call in (lambda: rt.mem_map(BASE, 4), lambda: rt.printf("x"), lambda: rt.dma.wait(0),
                 lambda: rt.dma.copy(0, np.zeros(1, np.uint8), np.zeros(1, np.uint8), 1)):
        with pytest.raises(RuntimeMisuse, match="outside a task"):
            call()


def test_dma_proxy_uses_the_running_tasks_core(core):
    space, _, _ = make_space(4096)
    with rt.activate(rt.TaskContext(space, core)):
        src, dst = np.arange(64, dtype=np.uint8), np.zeros(64, np.uint8)
        rt.dma.copy(1, src, dst, 64)
        assert rt.dma.in_flight(1) == 1 and core.dma.in_flight(1) == 1
        rt.dma.wait(1)
        assert np.array_equal(src, dst)


def test_printf_formats_like_c(core):
    space, _, _ = make_space(4096)
    task = rt.TaskContext(space, core)
    with rt.activate(task):
        rt.printf("find softmax ping-pong tcm is %d cycles\n", 5154293)
        rt.printf("%lu %lld %5.2f %s %x %%\n", 1, -2, np.float32(1.5), "ok", 255)
        rt.printf("no args, 100%%\n")
    assert task.printf_text() == ("find softmax ping-pong tcm is 5154293 cycles\n"
                                  "1 -2  1.50 ok ff %\nno args, 100%\n")


def test_printf_keeps_the_newest_text_when_over_the_limit(core):
    space, _, _ = make_space(4096)
    task = rt.TaskContext(space, core, printf_limit=200)
    with rt.activate(task):
        for i in range(100):
            rt.printf("line %03d\n", i)
    text = task.printf_text()
    assert len(text.encode()) <= 200 and text.endswith("line 099\n") and "dropped" in text.splitlines()[0]


def test_register_op_outside_a_library_load_is_refused():
    with pytest.raises(RuntimeMisuse, match="op libraries"):
        rt.register_op(0x1234, lambda i, o, tm: 0)


def test_export_table_names_exist():
    for name in rt.__all__:
        assert hasattr(rt, name), name


def test_l2_size_is_configurable():
    with rt.CoreRuntime(l2_size=64 << 10) as small:
        assert small.tm.free_bytes(0) == small.tm.free_bytes(1) == 32 << 10
        with pytest.raises(TileExhausted):
            small.tm.alloc((32 << 10) + 1, 0)
        x = np.arange(20_000, dtype=np.float32)
        y = np.empty_like(x)
        rt.ping_pong(x, y, x.size, lambda t: None, small.tm, tile_elems=4096, dma=small.dma)
        assert np.array_equal(x, y)


def test_settle_survives_a_failed_copy_left_in_flight():
    class Broken(rt.DmaEngine):
        def _do_copy(self, src, dst):
            raise OSError("bus error")

    with rt.CoreRuntime() as c:
        c.dma.close()
        c.dma = Broken(c.tm)
        t0, t1 = c.tm.alloc(64, 0), c.tm.alloc(64, 1)
        c.dma.copy(0, np.ones(64, np.uint8), t0, 64)
        c.dma.copy(1, np.ones(64, np.uint8), t1, 64)
        notes = c.settle()
        assert any("bus error" in n for n in notes) and any("2 DMA copies" in n for n in notes)
        assert c.tm.live() == [] and c.dma.in_flight(0) == c.dma.in_flight(1) == 0
