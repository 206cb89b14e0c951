"""The counting clock (dspx.costmodel.clock): COST-SPEC's rules on small
cases computed by hand — a segment's issue bound, stalls, DMA channels each on
their own timeline, waits, the call's end — and the exact sum identity
cycles == overhead + compute + ddr_stall + dma_wait."""
from __future__ import annotations

import json
import random

import pytest

from dspx.costmodel import CostClock, profile as prof

# Round numbers, so every case below can be checked on paper.
PARAMS = {
    "clock_hz": 1e9, "vector_bits": 512,
    "issue_load_store": 2, "issue_alu": 2, "issue_mul": 1, "issue_special": 1, "issue_move": 1,
    "ddr_cached": 0, "ddr_load_latency_cycles": 100, "ddr_store_cycles": 4, "ddr_bandwidth_bytes_per_cycle": 16,
    "tcm_load_latency_cycles": 1, "idma_channels": 2, "idma_setup_cycles": 10, "idma_bandwidth_bytes_per_cycle": 4,
    "tcm_banks": 2, "call_overhead_cycles": 50,
}


def profile(**changes):
    params = {n: {"value": v, "unit": "-", "status": "calibrated", "source": "a hand-checked test machine"}
              for n, v in {**PARAMS, **changes}.items()}
    return prof.parse(json.dumps({"name": "paper", "title": "test", "kind": "vector-dsp", "params": params}),
                      "test")


def clock(**changes) -> CostClock:
    return CostClock(profile(**changes))


def identity(r: dict) -> bool:
    return r["cycles"] == r["overhead"] + r["compute"] + r["ddr_stall"] + r["dma_wait"]


def test_a_call_starts_at_its_overhead():
    c = clock()
    assert c.read() == 50
    r = c.end()
    assert (r["cycles"], r["overhead"], r["compute"], r["ddr_stall"], r["dma_wait"]) == (50, 50, 0, 0, 0)
    assert r["profile"] == "paper" and r["estimate"] is True
    assert r["dma_bytes"] == [0, 0] and r["dma_transfers"] == [0, 0]


def test_a_segment_costs_its_issue_bound_plus_stalls():
    c = clock()
    c.add(tcm_loads=5, tcm_stores=1, alu=7, mul=3)
    # ls = 6 -> ceil(6/2) = 3; alu ceil(7/2) = 4; mul 3/1 = 3: bound 4.  stall: 5 TCM loads x 1
    assert c.read() == 50 + 4 + 5
    r = c.end()
    assert (r["compute"], r["ddr_stall"], r["tcm_loads"], r["tcm_stores"], r["ops_alu"], r["ops_mul"]) == \
        (4, 5, 5, 1, 7, 3)


def test_each_class_can_bind():
    for kw, bound in ((dict(alu=9), 5), (dict(mul=6), 6), (dict(special=3), 3), (dict(move=7), 7),
                      (dict(tcm_stores=9), 5)):
        c = clock()
        c.add(**kw)
        assert c.end()["compute"] == bound, kw


def test_segments_do_not_pool_their_slots():
    c = clock()
    c.add(alu=1)
    c.read()  # a clock read ends the segment
    c.add(mul=1)
    r = c.end()
    assert r["compute"] == 2  # one segment would have cost 1: the ALU and the multiply co-issue
    c = clock()
    c.add(alu=1)
    c.add(mul=1)
    assert c.end()["compute"] == 1


def test_uncached_ddr_loads_stall_and_stores_cost_their_cycles():
    c = clock()
    c.add(ddr_loads=3, ddr_stores=2)
    r = c.end()
    assert (r["compute"], r["ddr_stall"], r["cycles"]) == (3, 3 * 100 + 2 * 4, 50 + 3 + 308)
    c = clock(ddr_cached=1)  # through a cache: no per-load stall (misses are not modeled)
    c.add(ddr_loads=3, ddr_stores=2)
    assert c.end()["ddr_stall"] == 8


def test_fractional_issue_rates_round_up():
    c = clock(issue_special=0.25)
    c.add(special=3)
    assert c.end()["compute"] == 12


def test_two_channels_overlap_and_a_wait_books_the_difference():
    c = clock()
    assert c.dma_issue(0, 40) == 50 + 10 + 10  # starts at once: set-up + 40 B / 4 B per cycle
    assert c.dma_issue(1, 80) == 50 + 10 + 20  # its own channel: also starts at 50
    c.add(alu=20)  # 10 cycles of compute while both move data
    c.dma_wait(0)  # core at 60, channel 0 free at 70
    assert c.read() == 70
    c.dma_wait(1)  # channel 1 free at 80
    r = c.end()
    assert (r["cycles"], r["compute"], r["dma_wait"]) == (80, 10, 20)
    assert r["dma_bytes"] == [40, 80] and r["dma_transfers"] == [1, 1]
    assert identity(r)


def test_one_channel_runs_its_transfers_in_order():
    c = clock()
    assert c.dma_issue(0, 40) == 70
    assert c.dma_issue(0, 40) == 90  # waits for the channel, not for the core
    c.dma_wait(0)
    r = c.end()
    assert (r["cycles"], r["dma_wait"], r["dma_transfers"]) == (90, 40, [2, 0])


def test_a_transfer_already_done_costs_no_wait():
    c = clock()
    c.dma_issue(1, 4)  # ends at 50 + 10 + 1 = 61
    c.add(mul=30)  # core at 80
    c.dma_wait(1)
    r = c.end()
    assert (r["cycles"], r["dma_wait"]) == (80, 0)


def test_the_end_waits_for_transfers_still_running():
    c = clock()
    c.dma_issue(1, 400)  # ends at 160
    c.add(alu=2)
    r = c.end()
    assert (r["cycles"], r["compute"], r["dma_wait"]) == (160, 1, 109)


def test_an_issue_ends_the_segment_before_it():
    c = clock()
    c.add(alu=10)  # 5 cycles: the transfer is issued at 55
    assert c.dma_issue(0, 4) == 55 + 10 + 1


def test_channels_beyond_the_profile_share_its_timelines():
    c = clock(idma_channels=1)
    c.dma_issue(0, 40)  # 70
    assert c.dma_issue(1, 40) == 90
    assert c.end()["dma_transfers"] == [2]


def test_begin_resets_everything():
    c = clock()
    c.add(ddr_loads=1)
    c.dma_issue(0, 100)
    first = c.end()
    c.begin()
    assert c.end() == {**first, "cycles": 50, "compute": 0, "ddr_stall": 0, "dma_wait": 0, "ddr_loads": 0,
                       "dma_bytes": [0, 0], "dma_transfers": [0, 0]}


def _random_call(c: CostClock, seed: int) -> dict:
    rnd = random.Random(seed)
    for _ in range(200):
        what = rnd.randrange(4)
        if what == 0:
            c.add(**{k: rnd.randrange(50) for k in ("ddr_loads", "ddr_stores", "tcm_loads", "tcm_stores",
                                                     "alu", "mul", "special", "move")})
        elif what == 1:
            c.dma_issue(rnd.randrange(3), rnd.randrange(1, 5000))
        elif what == 2:
            c.dma_wait(rnd.randrange(2))
        else:
            c.read()
    return c.end()


@pytest.mark.parametrize("seed", range(5))
def test_the_sum_is_exact_and_the_same_call_gives_the_same_numbers(seed):
    c = clock(issue_special=0.5)
    r = _random_call(c, seed)
    assert identity(r)
    assert all(isinstance(r[k], int) for k in ("cycles", "overhead", "compute", "ddr_stall", "dma_wait"))
    c.begin()
    assert _random_call(c, seed) == r
    assert _random_call(clock(issue_special=0.5), seed) == r
