"""The core's side of custom operators: its op registry and L2/DMA runtime,
and an RPC plan turned into a task over the connection's address space."""
from __future__ import annotations

import numpy as np

from ... import memory, trace
from ...abi import layout, protocol as P
from ...abi.ops import FAULT_CRASH_CMD
from ...abi.protocol import Status
from ...memory import AddressSpace, Region
from . import builtin_ops, ops, runtime
from .prepared import Outcome


class CoreOps:
    def __init__(self, index: int, fault_injection: bool = False, cost=None):
        self.index = index
        self.rt = runtime.CoreRuntime(l2_size=memory.L2_SIZE)
        self.rt.configure_cost(cost)  # a costmodel.Profile counts every Python task; None: off
        self.registry = ops.OpRegistry()
        builtin_ops.register(self.registry)
        if fault_injection:
            self.registry.register(FAULT_CRASH_CMD, _fault_crash, 0, "fault.crash")

    def op_list(self, lib: int | None = None) -> list[tuple[int, str, int]]:
        return [(o.cmd, o.name, o.latency_us) for o in self.registry.ops() if lib is None or o.lib == lib]


class PreparedRpc:
    """One validated RPC: the connection's address space and the task's views."""

    def __init__(self, spec, bufs: dict):
        self.spec = spec
        self.space = AddressSpace()
        for buf_id, addr, size in spec.regions:
            self.space.add(Region(buf_id, addr, size, bufs[buf_id]))
        (ib, ioff, isz), (ob, ooff, osz) = spec.input, spec.output
        self.inp = np.frombuffer(bufs[ib], np.uint8, count=isz, offset=ioff)
        self.out = np.frombuffer(bufs[ob], np.uint8, count=osz, offset=ooff)
        self.printf_limit = (spec.printf[2] if spec.printf else memory.PRINTF_SIZE) - layout.PRINTF_HEADER

    def run(self, core) -> Outcome:
        """Run the task on the core's ops; a handler's failure is a status
        (the last printf line says why) that the response carries too."""
        core_ops = core.ops
        task = runtime.TaskContext(self.space, core_ops.rt, printf_limit=self.printf_limit)
        if trace.on:
            with trace.span(f"op 0x{self.spec.cmd:04x}", "core"):
                res = core_ops.registry.run(self.spec.cmd, self.inp, self.out, task)
        else:
            res = core_ops.registry.run(self.spec.cmd, self.inp, self.out, task)
        answer = (res, core.index, core.write_printf(self.spec.printf, res.printf))
        if res.status == Status.SUCCESS:
            return Outcome(answer=answer, cost=res.cost)
        text = res.printf.strip()
        return Outcome(res.status, text.splitlines()[-1] if text else "", answer=answer, cost=res.cost)

    @staticmethod
    def response(seq: int, outcome: Outcome, queued_us: int) -> bytes:
        res, core, printf_size = outcome.answer
        return P.RpcResp(seq=seq, status=res.status if res.status != Status.SUCCESS else 0,
                         return_value=res.return_value, core=core, cycles=res.cycles, printf_size=printf_size,
                         queued_us=queued_us).encode()


def _fault_crash(inp, out, tm) -> int:
    import os
    os._exit(70)

