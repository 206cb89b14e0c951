"""The timing model in the Python DSP runtime (dspx.device.core.runtime under
a cost profile): a Python operator written like the UCP seed's softmax —
direct over DDR, and three ping-pong passes through the two L2 banks — is
counted exactly as the runtime's rules say, written out by hand below; the
same call twice gives the same record; with no profile nothing changes."""
from __future__ import annotations

import math

import numpy as np
import pytest
import scipy.special

from dspx import costmodel
from dspx.device.core import ops, runtime as rt
from dspx.memory import AddressSpace

DIRECT, PING_PONG, MAX_ONLY = 0x7001, 0x7002, 0x7003
J6 = costmodel.load("j6-vision")
LANES = 16  # j6-vision: 512-bit vectors of float32
R = 4       # log2(LANES): the steps of a lane reduction


def seed_direct(inp, out, tm):
    """The seed's dsp_softmax: whole-array vector passes straight over DDR."""
    src, dst = inp.view(np.float32), out.view(np.float32)
    start = rt.cycles()
    m = rt.vecmax(src)
    total = rt.vecexp_max(dst, src, m)
    rt.vecmul(dst, dst, np.float32(1) / total)
    rt.printf("find softmax ddr tcm is %d cycles\n", rt.cycles() - start)
    return 0


def make_seed_ping_pong(tile_elems: int, passes: int = 3):
    """The seed's hb_dsp_softmax with run_tcm_opt: max, exp & sum, mul, each a
    ping-pong pass of tiles through the two banks (the last two write back)."""
    def seed_ping_pong(inp, out, tm):
        src, dst = inp.view(np.float32), out.view(np.float32)
        n = src.size
        start = rt.cycles()
        state = {"max": np.float32(-np.inf), "sum": np.float32(0)}

        def tile_max(tile):
            state["max"] = max(state["max"], rt.vecmax(tile))

        def tile_sum(tile):
            state["sum"] += rt.vecexp_max(tile, tile, state["max"])

        def tile_mul(tile):
            rt.vecmul(tile, tile, inv)

        rt.ping_pong(src, None, n, tile_max, tm, tile_elems=tile_elems, write_back=False)
        if passes > 1:
            rt.ping_pong(src, dst, n, tile_sum, tm, tile_elems=tile_elems)
            inv = np.float32(1) / state["sum"]
            rt.ping_pong(dst, dst, n, tile_mul, tm, tile_elems=tile_elems)
        rt.printf("find softmax ping-pong tcm is %d cycles\n", rt.cycles() - start)
        return 0
    return seed_ping_pong


class Board:
    def __init__(self, profile=J6, tile_elems: int = 256):
        self.core = rt.CoreRuntime()
        self.core.configure_cost(profile)
        self.reg = ops.OpRegistry()
        self.reg.register(DIRECT, seed_direct)
        self.reg.register(PING_PONG, make_seed_ping_pong(tile_elems))
        self.reg.register(MAX_ONLY, make_seed_ping_pong(tile_elems, passes=1))

    def run(self, cmd: int, x: np.ndarray):
        out = np.zeros(x.nbytes, np.uint8)
        res = self.reg.run(cmd, x.view(np.uint8), out, rt.TaskContext(AddressSpace(), self.core))
        return res, out.view(np.float32)


@pytest.fixture
def board():
    b = Board()
    yield b
    b.core.close()


def data(n: int) -> np.ndarray:
    return np.random.default_rng(n).standard_normal(n).astype(np.float32)


def vectors(n: int) -> int:
    return -(-n // LANES)


# ------------------------------------------------------------------ hand counts

def direct_by_hand(n: int) -> dict:
    """dsp_softmax on n floats, every array in DDR, v vectors of 16 floats:
    vecmax(src)          v DDR loads, v + R ALU (max, lane tree), R + 1 moves
    vecexp_max(dst, src) v DDR loads, 7v + 1 table loads (TCM), v DDR stores, 18v ALU, 11v mul, 2v + 2 moves
      its vecsum(dst)    v DDR loads, v ALU, 1 special (RADD)
    vecmul(dst, dst)     v DDR loads, v DDR stores, v mul, 1 move (the broadcast of 1/sum)"""
    v = vectors(n)
    counts = {"ddr_loads": 4 * v, "ddr_stores": 2 * v, "tcm_loads": 7 * v + 1, "tcm_stores": 0,
              "ops_alu": (v + R) + 18 * v + v, "ops_mul": 11 * v + v, "ops_special": 1,
              "ops_move": (R + 1) + (2 * v + 2) + 1}
    # One segment from the first clock read to the second: its issue bound
    # (2 load/store, 2 ALU, 1 mul, 1 special, 1 move per cycle) plus every
    # uncached DDR load's 100 cycles and every DDR store's 4.
    ls = counts["ddr_loads"] + counts["ddr_stores"] + counts["tcm_loads"]
    compute = max(-(-ls // 2), -(-counts["ops_alu"] // 2), counts["ops_mul"], 1, counts["ops_move"])
    stall = counts["ddr_loads"] * 100 + counts["ddr_stores"] * 4
    return {**counts, "compute": compute, "ddr_stall": stall, "dma_wait": 0, "overhead": 2000,
            "cycles": 2000 + compute + stall, "dma_bytes": [0, 0], "dma_transfers": [0, 0]}


def ping_pong_by_hand(n: int, te: int) -> dict:
    """Three ping-pong passes of tiles of te floats (tile k in bank and on channel k & 1), per tile of v_k vectors:
    pass 1, vecmax(tile)            v_k TCM loads, v_k + R ALU, R + 1 moves; a fetch
    pass 2, vecexp_max(tile, tile)  8v_k + 1 TCM loads, v_k TCM stores, 18v_k ALU, 11v_k mul, 2v_k + 2 moves
              its vecsum(tile)      v_k TCM loads, v_k ALU, 1 special; a fetch and a write-back
    pass 3, vecmul(tile, tile)      v_k TCM loads, v_k TCM stores, v_k mul, 1 move; a fetch and a write-back
    Nothing touches DDR but the DMA."""
    sizes = [min(te, n - lo) for lo in range(0, n, te)]
    t, v = len(sizes), sum(vectors(s) for s in sizes)
    per_channel = [sum(s for k, s in enumerate(sizes) if k & 1 == ch) for ch in (0, 1)]
    tiles_on = [sum(1 for k in range(t) if k & 1 == ch) for ch in (0, 1)]
    return {"ddr_loads": 0, "ddr_stores": 0,
            "tcm_loads": v + (8 * v + t + v) + v, "tcm_stores": v + v,
            "ops_alu": (v + R * t) + (18 * v + v), "ops_mul": 11 * v + v, "ops_special": t,
            "ops_move": (R + 1) * t + (2 * v + 2 * t) + t,
            "dma_bytes": [4 * b * (1 + 2 + 2) for b in per_channel], "dma_transfers": [k * 5 for k in tiles_on]}


def counts_of(record: dict) -> dict:
    return {k: record[k] for k in costmodel.clock.COUNTS + ("dma_bytes", "dma_transfers")}


# ------------------------------------------------------------------ tests

@pytest.mark.parametrize("n", [1000, (1 << 12) + 3])
def test_direct_is_counted_as_the_hand_count(board, n):
    x = data(n)
    res, y = board.run(DIRECT, x)
    assert res.status == 0
    hand = direct_by_hand(n)
    assert res.cost == {"profile": "j6-vision", "estimate": True, **hand}
    assert res.cycles == hand["cycles"]  # the RPC response's cycles are the modeled ones
    assert f"ddr tcm is {hand['cycles'] - 2000} cycles" in res.printf  # cycles() is the modeled clock
    np.testing.assert_allclose(y, scipy.special.softmax(x), rtol=1e-5, atol=1e-9)


@pytest.mark.parametrize("n, te", [(1000, 256), ((1 << 12) + 3, 1024)])
def test_ping_pong_is_counted_as_the_hand_count(n, te):
    b = Board(tile_elems=te)
    try:
        x = data(n)
        res, y = b.run(PING_PONG, x)
    finally:
        b.core.close()
    assert res.status == 0, res.printf
    r = res.cost
    assert counts_of(r) == ping_pong_by_hand(n, te)
    assert r["cycles"] == r["overhead"] + r["compute"] + r["ddr_stall"] + r["dma_wait"] == res.cycles
    assert r["ddr_stall"] == 0 and r["dma_wait"] > 0
    np.testing.assert_allclose(y, scipy.special.softmax(x), rtol=1e-5, atol=1e-9)
    # the model's lesson (its own figures; not fitted to anything): tiles through TCM beat DDR
    assert r["cycles"] < direct_by_hand(n)["cycles"]


def test_one_tile_by_hand():
    """32 floats, one tile, the max pass only.  The fetch (channel 0) is issued
    at 2000 and ends at 2000 + 150 set-up + 128 B / 16 B per cycle = 2158: the
    wait books 158.  vecmax on 2 vectors: 2 TCM loads, 2 + 4 ALU, 5 moves:
    the moves bind, 5 cycles."""
    b = Board(tile_elems=32)
    try:
        res, _ = b.run(MAX_ONLY, data(32))
    finally:
        b.core.close()
    r = res.cost
    assert (r["cycles"], r["overhead"], r["compute"], r["ddr_stall"], r["dma_wait"]) == (2163, 2000, 5, 0, 158)
    assert (r["tcm_loads"], r["ops_alu"], r["ops_move"], r["dma_bytes"], r["dma_transfers"]) == \
        (2, 6, 5, [128, 0], [1, 0])
    assert "ping-pong tcm is 163 cycles" in res.printf


def test_the_same_call_twice_gives_the_same_record(board):
    x = data(3000)
    for cmd in (DIRECT, PING_PONG):
        first, y1 = board.run(cmd, x)
        second, y2 = board.run(cmd, x)
        assert first.cost == second.cost and first.cycles == second.cycles
        np.testing.assert_array_equal(y1, y2)


def test_the_task_leaves_no_clock_behind(board):
    res, _ = board.run(PING_PONG, data(600))
    assert board.core.dma.clock is None
    # a helper called outside a task counts nothing and cycles() is the host clock again
    rt.vecmax(data(64))
    board.core.clock.sync()
    assert board.core.clock.record() == res.cost
    a = rt.cycles()
    assert rt.cycles() >= a > 10 ** 9


def test_without_a_profile_nothing_changes():
    """Off: no clock anywhere, the record is None, cycles are the host's (as
    before), and the results are the same bits as under the model."""
    off, on = Board(profile=None), Board()
    try:
        x = data(2000)
        for cmd in (DIRECT, PING_PONG):
            res_off, y_off = off.run(cmd, x)
            res_on, y_on = on.run(cmd, x)
            assert res_off.cost is None and res_off.status == 0
            np.testing.assert_array_equal(y_off, y_on)
            assert res_off.cycles != res_on.cycles
        assert off.core.clock is None and off.core.cost is None and off.core.dma.clock is None
        task = rt.TaskContext(AddressSpace(), off.core)
        assert task.clock is None and task.end_cost() is None
    finally:
        off.core.close()
        on.core.close()


def test_a_tile_in_l2_counts_as_tcm_and_other_memory_as_ddr(board):
    task = rt.TaskContext(AddressSpace(), board.core)
    with rt.activate(task):
        tile = board.core.tm.alloc(64 * 4, 0).view(np.float32)
        tile[:] = 1
        rt.vecsum(tile)           # 4 vectors from L2
        rt.vecsum(np.ones(33, np.float32))  # 3 vectors from elsewhere
        board.core.tm.free(tile)
    r = task.end_cost()
    assert (r["tcm_loads"], r["ddr_loads"], r["ops_alu"], r["ops_special"]) == (4, 3, 7, 2)
    assert task.end_cost() is r  # ended once


def test_lanes_follow_the_profile():
    c7x = costmodel.load("c7x-j722s")  # 256-bit vectors: 8 floats
    b = Board(profile=c7x)
    try:
        res, _ = b.run(DIRECT, data(100))
    finally:
        b.core.close()
    v = math.ceil(100 / 8)
    assert res.cost["profile"] == "c7x-j722s" and res.cost["ddr_loads"] == 4 * v
    assert res.cost["ops_move"] == (3 + 1) + (2 * v + 2) + 1  # R = log2(8) = 3
    assert res.cost["ddr_stall"] == 0  # ddr_cached: no per-load stall


def test_dma_copies_are_on_the_channels_timelines(board):
    task = rt.TaskContext(AddressSpace(), board.core)
    src = np.ones(1024, np.float32)
    with rt.activate(task):
        tiles = [board.core.tm.alloc(4096, b) for b in (0, 1)]
        rt.dma.copy(0, src, tiles[0], 4096)  # ends at 2000 + 150 + 256 = 2406
        rt.dma.copy(1, src, tiles[1], 2048)  # ends at 2000 + 150 + 128 = 2278
        rt.dma.wait(1)
        rt.dma.wait(0)
        for t in tiles:
            board.core.tm.free(t)
    r = task.end_cost()
    assert (r["cycles"], r["dma_wait"], r["dma_bytes"], r["dma_transfers"]) == (2406, 406, [4096, 2048], [1, 1])


def test_the_core_takes_its_profile_once_from_the_environment(monkeypatch):
    """worker.main reads DSPX_COST_MODEL once (costmodel.from_env) and the
    worker hands the profile to its runtime."""
    import socket

    from dspx.device.core.worker import CoreWorker
    from dspx.transport import Endpoint
    monkeypatch.setenv(costmodel.ENV, "j6-vision")
    a, b = socket.socketpair()
    w = CoreWorker(Endpoint(a), index=0, threads=1, cost=costmodel.from_env())
    try:
        assert w.ops.rt.cost.name == "j6-vision" and w.ops.rt.clock is not None
    finally:
        w.ops.rt.close()
        a.close()
        b.close()
