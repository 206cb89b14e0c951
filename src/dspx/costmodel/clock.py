"""The counting clock: COST-SPEC's rules, the reference the C counting is
checked against.

One call's life: ``begin()`` starts the clock at the profile's
``call_overhead_cycles`` (booked as ``overhead``); the code counts its vector
loads and stores (by where the address lies: ``tcm`` or ``ddr``) and its
vector operations by class with ``add``; a DMA issue, a DMA wait, a clock read
and the call's end each close the current *segment*.  A segment costs its
issue bound

    max(ceil(ls / issue_load_store), ceil(alu / issue_alu), ceil(mul / issue_mul),
        ceil(special / issue_special), ceil(move / issue_move))      -> compute

(``ls`` = the segment's loads + stores) plus its stalls

    ddr_loads * ddr_load_latency_cycles   (only when ddr_cached == 0)
    + ddr_stores * ddr_store_cycles + tcm_loads * tcm_load_latency_cycles   -> ddr_stall

Each DMA channel has its own timeline: a transfer issued at core clock t
starts at ``max(t, chan_free[ch])`` and ends ``idma_setup_cycles +
ceil(bytes / idma_bandwidth_bytes_per_cycle)`` later.  A wait moves the core
clock to the channel's end, booking the difference as ``dma_wait``; the
call's end waits for every channel.  So always
``cycles == overhead + compute + ddr_stall + dma_wait``.  All integers, no
wall clock: the same call gives the same numbers.

Channel numbers beyond the profile's ``idma_channels`` share timeline
``ch % idma_channels`` (a one-channel profile serialises both banks' copies).
"""
from __future__ import annotations

import math

from .profile import Profile

COUNTS = ("ddr_loads", "ddr_stores", "tcm_loads", "tcm_stores", "ops_alu", "ops_mul", "ops_special", "ops_move")


def _ceil_div(n: int, rate) -> int:
    """ceil(n / rate) for a whole-number count and a positive rate (exact for whole rates)."""
    if isinstance(rate, int):
        return -(-n // rate)
    return math.ceil(n / rate)


class CostClock:
    """The modeled clock of one core under one profile; reused call after call (``begin`` resets it)."""

    def __init__(self, profile: Profile):
        self.profile = profile
        v = profile.param
        self.f32_lanes = v("vector_bits") // 32
        self._issue = (v("issue_load_store"), v("issue_alu"), v("issue_mul"), v("issue_special"), v("issue_move"))
        self._ddr_load_stall = 0 if v("ddr_cached") else v("ddr_load_latency_cycles")
        self._ddr_store_cycles = v("ddr_store_cycles")
        self._tcm_load_stall = v("tcm_load_latency_cycles")
        self._setup = v("idma_setup_cycles")
        self._dma_rate = v("idma_bandwidth_bytes_per_cycle")
        self._channels = v("idma_channels")
        self._overhead = v("call_overhead_cycles")
        self.begin()

    # ---------------------------------------------------------------- one call
    def begin(self) -> None:
        """Start a call: every count zero, the clock at the call overhead."""
        self.t = self.overhead = self._overhead
        self.compute = self.ddr_stall = self.waited = 0  # waited: booked as dma_wait
        self.totals = dict.fromkeys(COUNTS, 0)
        self.dma_bytes = [0] * self._channels
        self.dma_transfers = [0] * self._channels
        self._free = [0] * self._channels
        self._seg = dict.fromkeys(COUNTS, 0)

    def add(self, ddr_loads: int = 0, ddr_stores: int = 0, tcm_loads: int = 0, tcm_stores: int = 0,
            alu: int = 0, mul: int = 0, special: int = 0, move: int = 0) -> None:
        """Count vector loads/stores (by where they land) and vector operations (by class)."""
        seg = self._seg
        seg["ddr_loads"] += ddr_loads
        seg["ddr_stores"] += ddr_stores
        seg["tcm_loads"] += tcm_loads
        seg["tcm_stores"] += tcm_stores
        seg["ops_alu"] += alu
        seg["ops_mul"] += mul
        seg["ops_special"] += special
        seg["ops_move"] += move

    def sync(self) -> None:
        """Close the current segment: advance the clock by its issue bound and its stalls."""
        seg = self._seg
        if not any(seg.values()):
            return
        ls = seg["ddr_loads"] + seg["ddr_stores"] + seg["tcm_loads"] + seg["tcm_stores"]
        i_ls, i_alu, i_mul, i_special, i_move = self._issue
        bound = max(_ceil_div(ls, i_ls), _ceil_div(seg["ops_alu"], i_alu), _ceil_div(seg["ops_mul"], i_mul),
                    _ceil_div(seg["ops_special"], i_special), _ceil_div(seg["ops_move"], i_move))
        stall = (seg["ddr_loads"] * self._ddr_load_stall + seg["ddr_stores"] * self._ddr_store_cycles
                 + seg["tcm_loads"] * self._tcm_load_stall)
        self.compute += bound
        self.ddr_stall += stall
        self.t += bound + stall
        for k, n in seg.items():
            self.totals[k] += n
        self._seg = dict.fromkeys(COUNTS, 0)

    def dma_issue(self, channel: int, nbytes: int) -> int:
        """A transfer of nbytes on a channel, issued now; returns when it ends (modeled cycles)."""
        self.sync()
        ch = channel % self._channels
        start = max(self.t, self._free[ch])
        end = start + self._setup + _ceil_div(nbytes, self._dma_rate)
        self._free[ch] = end
        self.dma_bytes[ch] += nbytes
        self.dma_transfers[ch] += 1
        return end

    def dma_wait(self, channel: int) -> None:
        """Wait for every transfer issued on the channel."""
        self.sync()
        self._wait(channel % self._channels)

    def _wait(self, ch: int) -> None:
        if self._free[ch] > self.t:
            self.waited += self._free[ch] - self.t
            self.t = self._free[ch]

    def read(self) -> int:
        """The modeled clock now (TIME_STAMP, dspx_cycles, runtime.cycles): cycles since the call began."""
        self.sync()
        return self.t

    def end(self) -> dict:
        """End the call (transfers still running are waited for) and return its record."""
        self.sync()
        for ch in range(self._channels):
            self._wait(ch)
        return self.record()

    def record(self) -> dict:
        """The call's figures so far, in the names every side uses (C struct, Python dict, JSON)."""
        return {"profile": self.profile.name, "estimate": True, "cycles": self.t, "overhead": self.overhead,
                "compute": self.compute, "ddr_stall": self.ddr_stall, "dma_wait": self.waited,
                **self.totals, "dma_bytes": list(self.dma_bytes), "dma_transfers": list(self.dma_transfers)}
