"""Request handlers of the front: ``(conn, request, fds) -> actions``.

A handler validates a request against the front's state and returns what
should happen (``actions.py``: ``Respond``, ``Submit`` a job to a core,
``Notify`` cores, ``Forget`` what cores hold) instead of calling into the
loop, so every rule can be tested with no socket
(``tests/device/front/test_handlers.py``).  A refusal is
``Reject(status, message, **numbers)``.

``Handlers`` is one table over the message families, one module each:
``buffers``, ``modules`` (and weights), ``oplibs`` and ``calls`` (INFER,
INFER_LARGE and RPC, planned).  The families share the state, the cores and
``invalidate``.
"""
from __future__ import annotations

from .... import memory
from ....abi import protocol as P
from ....abi.protocol import Status as S
from ..actions import Respond, failure
from ..state import Conn, Cores, DeviceState, Reject
from .buffers import BufferHandlers
from .calls import CallHandlers
from .modules import ModuleHandlers
from .oplibs import OpLibHandlers


class Handlers(BufferHandlers, ModuleHandlers, OpLibHandlers, CallHandlers):
    """Every request type's handler ``h_<type>``, and what the loop asks of them."""

    def __init__(self, state: DeviceState, cores: Cores, job_timeout_s: float = 0.0):
        self.st = state
        self.cores = cores
        self.job_timeout_s = job_timeout_s
        self._table = {t.value: getattr(self, "h_" + t.name.lower()) for t in P.MsgType}

    def handle(self, conn: Conn, req: P.Message, fds: list, key: bytes | None = None) -> list:
        """``key``: the request's plan key (INFER, INFER_LARGE, RPC), to keep
        the plan this request becomes under."""
        try:
            if key is not None:
                return self._table[req.TYPE](conn, req, fds, key=key)
            return self._table[req.TYPE](conn, req, fds)
        except Reject as e:
            return failure(conn, req, e)

    # ------------------------------------------------------------ basics
    def h_ping(self, conn, req, fds):
        return [Respond(P.PingResp(seq=req.seq, version=P.VERSION, uptime_ms=self.st.uptime_ms()))]

    def h_get_status(self, conn, req, fds):
        st = self.st
        return [Respond(P.StatusResp(seq=req.seq, version=P.VERSION, uptime_ms=st.uptime_ms(),
                                     jobs_completed=st.jobs_completed & 0xFFFFFFFF,
                                     jobs_failed=st.jobs_failed & 0xFFFFFFFF))]

    def h_pool_status(self, conn, req, fds):
        st = self.st
        return [Respond(P.PoolStatusResp(
            seq=req.seq, ddr_total=st.ddr.size, ddr_used=st.ddr.used, ddr_peak=st.ddr.peak,
            carveout_total=st.window.size, carveout_used=st.window.used, l2_total=memory.L2_SIZE, l2_used=0,
            connections=len(st.conns), modules=sum(1 for m in st.modules.values() if m.kind == "module"),
            cores=self.cores.count, op_count=len(st.op_table), rss_bytes=self.cores.rss()))]

    def h_get_error(self, conn, req, fds):
        seq, status, text = conn.last_error
        return [Respond(P.GetErrorResp(seq=req.seq, error_seq=seq, error_status=status,
                                       payload=text.encode(errors="replace")[:P.GetErrorResp.MAX_TEXT]))]

    def h_get_cost(self, conn, req, fds):
        """The cost record of the connection's last counted call; ERR_OP without one (docs/protocol.md)."""
        if conn.last_cost is None:
            raise Reject(S.ERR_OP, "no cost record: no call of this connection was counted by a cost model (a "
                                   "device counts when started with DSPX_COST_MODEL=NAME or dspx serve "
                                   "--cost-model NAME)")
        core, rec = conn.last_cost
        return [Respond(P.GetCostResp(
            seq=req.seq, cost_seq=rec.seq, core=core, flags=P.COST_COUNTED if rec.counted else 0,
            profile=rec.profile.encode("ascii"), **rec.figures(),
            dma_bytes_0=rec.dma_bytes[0], dma_bytes_1=rec.dma_bytes[1],
            dma_transfers_0=rec.dma_transfers[0], dma_transfers_1=rec.dma_transfers[1]))]
