"""The core's side of custom operators: its op registry, its L2/DMA runtime,
and turning an RPC job into a task over the connection's address space."""
from __future__ import annotations

import numpy as np

from ... import memory
from ...abi import layout
from ...memory import AddressSpace, Region
from ...abi.protocol import Status
from . import builtin_ops, ops, runtime


class CoreOps:
    def __init__(self, core):
        self.core = core
        self.rt = runtime.Core(l2_size=memory.L2_SIZE)
        self.registry = ops.OpRegistry()
        builtin_ops.register(self.registry)

    def op_list(self, lib: int | None = None) -> list[tuple[int, str, int]]:
        return [(o.cmd, o.name, o.latency_us) for o in self.registry.ops() if lib is None or o.lib == lib]

    def handle(self, msg: dict) -> dict | None:
        kind = msg["kind"]
        if kind == "ops_load":
            h = self.registry.load_library(msg["source"], msg["filename"], handle=msg["handle"])
            return None if msg.get("broadcast") else {"ops": self.op_list(h)}
        if kind == "ops_unload":
            self.registry.unload_library(msg["handle"])
            return None
        if kind == "ops_list":
            return {"ops": self.op_list()}
        return self.rpc(msg)

    def rpc(self, msg: dict) -> dict:
        bufs = self.core.bufs
        space = AddressSpace()
        for buf_id, addr, size in msg["regions"]:
            space.add(Region(buf_id, addr, size, bufs[buf_id]))
        (ib, ioff, isz), (ob, ooff, osz) = msg["input"], msg["output"]
        inp = np.frombuffer(bufs[ib], np.uint8, count=isz, offset=ioff)
        out = np.frombuffer(bufs[ob], np.uint8, count=osz, offset=ooff)
        printf = msg.get("printf")
        limit = (printf[2] if printf else memory.PRINTF_SIZE) - layout.PRINTF_HEADER
        task = runtime.Task(space, self.rt, printf_limit=limit)
        res = self.registry.run(msg["cmd"], inp, out, task)
        del inp, out
        return {"status": res.status, "return_value": res.return_value, "cycles": res.cycles,
                "core": self.core.index, "printf_size": self.core.write_printf(printf, res.printf),
                "error": res.printf.strip().splitlines()[-1] if res.status != Status.SUCCESS and res.printf else ""}
