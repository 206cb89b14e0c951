"""The tile manager's and DMA engine's rules at their edges (in-process, no
device): a tile never runs past its bank, counting the alignment padding; DMA
copies only live tiles and whole arrays; every refusal is its typed error."""
from __future__ import annotations

import numpy as np
import pytest

from dspx.abi.protocol import Status
from dspx.device.core import runtime as rt
from dspx.device.core.errors import DmaError, RuntimeMisuse, TileExhausted


@pytest.fixture
def core():
    c = rt.CoreRuntime(l2_size=8192)
    yield c
    c.close()


def _offset(core, tile) -> int:
    return tile.ctypes.data - core.l2.ctypes.data


# ------------------------------------------------------------------ tile fit

def test_a_tile_fits_only_if_its_alignment_padding_fits_too(core):
    tm = core.tm
    tm.alloc(1, 0)  # the next 64-aligned start in bank 0 is offset 64, one hole [1, 4096)
    with pytest.raises(TileExhausted) as e:
        tm.alloc(4096 - 63, 0, align=64)  # 1 + 4033 fits the hole, 64 + 4033 does not
    assert (e.value.requested, e.value.bank, e.value.free) == (4033, 0, 4095)
    assert tm.live() == [(0, 1, 0)]
    t = tm.alloc(4096 - 64, 0, align=64)  # exactly to the bank's end
    assert (_offset(core, t), t.nbytes) == (64, 4032)
    assert tm.free_bytes(0) == 63 and tm.free_bytes(1) == 4096  # the padding stays a hole


def test_a_tile_never_reaches_into_the_other_bank(core):
    tm = core.tm
    t = tm.alloc(4096, 0)
    assert _offset(core, t) + t.nbytes == 4096
    with pytest.raises(TileExhausted):
        tm.alloc(1, 0)
    u = tm.alloc(4096, 1)
    assert _offset(core, u) == 4096
    with pytest.raises(TileExhausted):
        tm.alloc(4097, 1)


def test_exhaustion_reports_the_largest_hole(core):
    tm = core.tm
    a = tm.alloc(1024, 0)
    tm.alloc(1024, 0)
    tm.free(a)  # holes: [0, 1024) and [2048, 4096)
    with pytest.raises(TileExhausted) as e:
        tm.alloc(3000, 0)
    assert (e.value.free, e.value.largest, e.value.total) == (3072, 2048, 4096)
    assert e.value.status == Status.ERR_NOMEM


def test_first_fit_takes_the_lowest_hole_that_fits(core):
    tm = core.tm
    a, b, c = tm.alloc(1024, 1), tm.alloc(1024, 1), tm.alloc(1024, 1)
    tm.free(a)
    tm.free(c)
    assert _offset(core, tm.alloc(512, 1)) == 4096  # a's hole, not c's
    assert _offset(core, tm.alloc(1024, 1)) == 4096 + 2048  # c merged with the free tail
    assert _offset(core, b) == 4096 + 1024


def test_free_merges_neighbours_on_both_sides(core):
    tm = core.tm
    tiles = [tm.alloc(1024, 0) for _ in range(4)]
    tm.free(tiles[0])
    tm.free(tiles[2])
    tm.free(tiles[1])  # joins the holes before and after it
    assert tm.alloc(3072, 0).nbytes == 3072


def test_an_odd_l2_gives_the_second_bank_the_extra_byte():
    with rt.CoreRuntime(l2_size=4097) as c:
        assert c.tm.bank_range == ((0, 2048), (2048, 2049))
        assert c.tm.free_bytes(1) == 2049


@pytest.mark.parametrize("bad", [0, -5, 1.5, "64"])
def test_tile_size_must_be_a_positive_integer(core, bad):
    with pytest.raises(RuntimeMisuse):
        core.tm.alloc(bad, 0)


@pytest.mark.parametrize("align", [0, 3, 96])
def test_tile_alignment_must_be_a_power_of_two(core, align):
    with pytest.raises(RuntimeMisuse):
        core.tm.alloc(64, 0, align=align)


def test_free_all_frees_every_live_tile_and_counts_them(core):
    tm = core.tm
    tm.alloc(100, 0)
    tm.alloc(100, 1)
    assert tm.free_all() == 2 and tm.live() == [] and tm.free_bytes(0) == tm.free_bytes(1) == 4096
    assert tm.free_all() == 0


def test_a_view_into_a_tile_is_not_a_tile_to_free(core):
    t = core.tm.alloc(256, 0)
    with pytest.raises(RuntimeMisuse):
        core.tm.free(t[64:])
    core.tm.free(t)


# ------------------------------------------------------------------ DMA

def test_dma_into_a_tile_pins_it_until_the_wait(core):
    tm, dma = core.tm, core.dma
    t = tm.alloc(256, 0)
    src = np.arange(256, dtype=np.uint8)
    dma.copy(1, src, t, 256)
    assert dma.in_flight(1) == 1 and dma.in_flight(0) == 0
    with pytest.raises(RuntimeMisuse, match="not yet waited"):
        tm.free(t)
    dma.wait(1)
    assert dma.in_flight(1) == 0
    assert (t == src).all()
    tm.free(t)


def test_two_copies_pin_a_tile_twice(core):
    tm, dma = core.tm, core.dma
    t = tm.alloc(128, 0)
    dma.copy(0, np.ones(64, np.uint8), t[:64], 64)
    dma.copy(1, np.ones(64, np.uint8), t[64:], 64)
    dma.wait(0)
    with pytest.raises(RuntimeMisuse, match="1 DMA copies"):
        tm.free(t)
    dma.wait(1)
    tm.free(t)


def test_dma_range_running_past_a_tile_is_refused(core):
    t = core.tm.alloc(64, 0)
    core.tm.alloc(64, 0)  # the neighbour is live too, but a copy may not span both
    whole = core.l2[_offset(core, t):_offset(core, t) + 128]
    with pytest.raises(DmaError, match="not inside a live tile"):
        core.dma.copy(0, np.zeros(128, np.uint8), whole, 128)
    assert core.dma.in_flight(0) == 0


@pytest.mark.parametrize("nbytes,ok", [(64, True), (65, False)])
def test_dma_size_at_most_both_arrays(core, nbytes, ok):
    src, dst = np.zeros(64, np.uint8), np.zeros(128, np.uint8)
    if ok:
        core.dma.copy(0, src, dst, nbytes)
        core.dma.wait(0)
    else:
        with pytest.raises(DmaError, match="holds only 64"):
            core.dma.copy(0, src, dst, nbytes)


def test_dma_counts_bytes_not_elements(core):
    src = np.arange(16, dtype=np.float32)
    dst = np.zeros(16, np.float32)
    core.dma.copy(0, src, dst, 8)
    core.dma.wait(0)
    assert list(dst[:3]) == [0.0, 1.0, 0.0]


@pytest.mark.parametrize("channel", [-1, 2, 1.0])
def test_dma_channel_must_exist(core, channel):
    with pytest.raises(RuntimeMisuse):
        core.dma.copy(channel, np.zeros(8, np.uint8), np.zeros(8, np.uint8), 8)


def test_dma_refuses_read_only_and_strided_arrays(core):
    ro = np.zeros(8, np.uint8)
    ro.flags.writeable = False
    with pytest.raises(DmaError, match="read-only"):
        core.dma.copy(0, np.zeros(8, np.uint8), ro, 8)
    with pytest.raises(DmaError, match="contiguous"):
        core.dma.copy(0, np.zeros(16, np.uint8)[::2], np.zeros(8, np.uint8), 8)
    with pytest.raises(DmaError, match="numpy array"):
        core.dma.copy(0, b"12345678", np.zeros(8, np.uint8), 8)
    with pytest.raises(RuntimeMisuse):
        core.dma.copy(0, np.zeros(8, np.uint8), np.zeros(8, np.uint8), 0)
    assert core.dma.in_flight(0) == 0


def test_dma_wait_with_nothing_in_flight_is_refused(core):
    with pytest.raises(DmaError, match="nothing in flight"):
        core.dma.wait(0)


def test_drain_waits_every_channel_and_raises_the_first_failure():
    class Failing(rt.DmaEngine):
        def _do_copy(self, src, dst):
            if src[0] == 1:
                raise ValueError("bad copy")
            super()._do_copy(src, dst)

    with rt.CoreRuntime(l2_size=8192) as c:
        eng = Failing(c.tm)
        try:
            eng.copy(0, np.ones(4, np.uint8), np.zeros(4, np.uint8), 4)
            ok = np.zeros(4, np.uint8)
            eng.copy(1, np.full(4, 2, np.uint8), ok, 4)
            with pytest.raises(DmaError, match="channel 0 failed"):
                eng.drain()
            assert eng.in_flight(0) == eng.in_flight(1) == 0 and (ok == 2).all()
        finally:
            eng.close()


def test_settle_reports_leftover_copies_and_tiles(core):
    t = core.tm.alloc(64, 0)
    core.dma.copy(0, np.ones(64, np.uint8), t, 64)
    notes = core.settle()
    assert any("1 DMA copies not waited for" in n for n in notes)
    assert any("1 L2 tiles allocated" in n for n in notes)
    assert core.tm.live() == [] and core.settle() == []


# ------------------------------------------------------------------ what refusals say

@pytest.mark.parametrize("call,text", [
    (lambda tm: tm.alloc("64", 0), "tile size must be an integer, got str"),
    (lambda tm: tm.alloc(64, -1), "bank must be >= 0, got -1"),
    (lambda tm: tm.alloc(64, 0, align=0), "align must be >= 1, got 0"),
    (lambda tm: tm.free("not a tile"), "free of an array that is not a live tile (double free, or not from tm.alloc)"),
])
def test_tile_misuse_says_what(core, call, text):
    with pytest.raises(RuntimeMisuse) as e:
        call(core.tm)
    assert str(e.value) == text


def test_dma_channel_misuse_says_what(core):
    with pytest.raises(RuntimeMisuse) as e:
        core.dma.copy(-1, np.zeros(8, np.uint8), np.zeros(8, np.uint8), 8)
    assert str(e.value) == "DMA channel must be >= 0, got -1"


def test_a_one_byte_hole_is_still_free(core):
    core.tm.alloc(4095, 0, align=1)
    assert core.tm.free_bytes(0) == 1 and core.tm.alloc(1, 0, align=1).nbytes == 1


def test_a_full_bank_reports_no_hole(core):
    core.tm.alloc(4096, 1)
    with pytest.raises(TileExhausted) as e:
        core.tm.alloc(1, 1)
    assert (e.value.free, e.value.largest) == (0, 0)


def test_dma_workers_are_named_daemon_threads(core):
    assert [t.name for t in core.dma.threads] == ["dspx-dma0", "dspx-dma1"]
    assert all(t.daemon and t.is_alive() for t in core.dma.threads)


@pytest.mark.parametrize("size,text", [(1, "L2 size must be >= 2, got 1"), ("8k", "L2 size must be an integer, got str")])
def test_l2_size_must_hold_both_banks(size, text):
    with pytest.raises(RuntimeMisuse) as e:
        rt.CoreRuntime(l2_size=size)
    assert str(e.value) == text


def test_a_new_cores_l2_reads_as_zeros(core):
    assert core.l2.nbytes == 8192 and not core.l2.any()


def test_dma_wait_uses_the_cores_dma_timeout_unless_given_one():
    class Stuck(rt.DmaEngine):
        def _do_copy(self, src, dst):
            gate.wait(30)

    import threading

    gate = threading.Event()
    with rt.CoreRuntime(l2_size=8192, dma_timeout=0.05) as c:
        assert c.dma.timeout == 0.05
        eng = Stuck(c.tm, timeout=c.dma.timeout)
        try:
            eng.copy(0, np.ones(4, np.uint8), np.zeros(4, np.uint8), 4)
            with pytest.raises(rt.DmaTimeout) as e:
                eng.wait(0)
            assert str(e.value) == "DMA channel 0: 1 copies not complete after 0.05 s"
            with pytest.raises(rt.DmaTimeout) as e:
                eng.wait(0, timeout=0.01)  # an explicit limit wins
            assert str(e.value) == "DMA channel 0: 1 copies not complete after 0.01 s"
        finally:
            gate.set()
            eng.wait(0)
            eng.close()


def test_dma_of_2d_arrays_copies_the_first_bytes_in_memory_order(core):
    src = np.arange(16, dtype=np.float32).reshape(4, 4)
    dst = np.zeros((4, 4), np.float32)
    core.dma.copy(0, src, dst, 24)  # 6 floats: row 0 and half of row 1
    core.dma.wait(0)
    assert dst.ravel().tolist() == [0, 1, 2, 3, 4, 5] + [0] * 10


@pytest.mark.parametrize("src,dst,nbytes,text", [
    (b"12345678", np.zeros(8, np.uint8), 8, "DMA source must be a numpy array, got bytes"),
    (np.zeros(8, np.uint8), [0] * 8, 8, "DMA destination must be a numpy array, got list"),
    (np.zeros(4, np.uint8), np.zeros(8, np.uint8), 8, "DMA of 8 bytes but the source holds only 4"),
    (np.zeros(8, np.uint8), np.zeros(4, np.uint8), 8, "DMA of 8 bytes but the destination holds only 4"),
    (np.zeros(8, np.uint8), np.zeros(8, np.uint8)[::-1], 8, "DMA destination must be contiguous"),
])
def test_dma_refusals_name_the_side(core, src, dst, nbytes, text):
    with pytest.raises(DmaError) as e:
        core.dma.copy(0, src, dst, nbytes)
    assert str(e.value) == text


def test_dma_refusals_of_size_channel_and_read_only_say_what(core):
    with pytest.raises(RuntimeMisuse) as e:
        core.dma.copy(0, np.zeros(8, np.uint8), np.zeros(8, np.uint8), 0)
    assert str(e.value) == "DMA size must be >= 1, got 0"
    with pytest.raises(DmaError) as e:
        core.dma.copy(2, np.zeros(8, np.uint8), np.zeros(8, np.uint8), 8)
    assert str(e.value) == "DMA channel 2 does not exist (channels 0..1)"
    ro = np.zeros(8, np.uint8)
    ro.flags.writeable = False
    with pytest.raises(DmaError) as e:
        core.dma.copy(0, np.zeros(8, np.uint8), ro, 8)
    assert str(e.value) == "DMA destination is read-only"
