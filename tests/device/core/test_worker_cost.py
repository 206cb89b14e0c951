"""The core's side of the timing model's record (worker.py ``_send_cost``):
a call whose outcome carries a cost dict sends one ``jobs.Cost`` to the
front before the client has its answer; one without (every call when no
cost model is on) sends nothing extra."""
from __future__ import annotations

import socket

import pytest

from dspx.abi import protocol as P
from dspx.device import jobs
from dspx.device.core.prepared import Outcome
from dspx.device.core.worker import CoreWorker
from dspx.transport import Timeout

COST = {"profile": "j6-vision", "estimate": True, "cycles": 110, "overhead": 10, "compute": 60, "ddr_stall": 30,
        "dma_wait": 10, "ddr_loads": 1, "ddr_stores": 2, "tcm_loads": 3, "tcm_stores": 4, "ops_alu": 5,
        "ops_mul": 6, "ops_special": 7, "ops_move": 8, "dma_bytes": [4096, 0], "dma_transfers": [1, 0]}
CID = 3


class FakePlan:
    """A prepared RPC whose run comes to ``outcome``."""

    def __init__(self, outcome: Outcome):
        self.spec = jobs.RpcSpec(CID, 0x3101, (0, 0, 0), (0, 0, 0), [], None)
        self.outcome = outcome

    def run(self, core) -> Outcome:
        return self.outcome

    @staticmethod
    def response(seq, outcome, queued_us) -> bytes:
        return P.RpcResp(seq=seq, cycles=outcome.cost["cycles"] if outcome.cost else 0).encode()


class Client:
    """The client's socket as the core sees it: records, at each answer,
    what the front's end of the channel already held."""

    def __init__(self, front_ep):
        self.front_ep = front_ep
        self.answers = []

    def send(self, data, flags=0):
        held = []
        while True:
            try:
                held.append(jobs.recv(self.front_ep, jobs.CORE_TO_FRONT, timeout=0)[0])
            except Timeout:
                break
        self.answers.append((P.decode(data), held))
        return len(data)

    def close(self):
        pass


@pytest.fixture
def core():
    front, core_end = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    front.setblocking(False)
    w = CoreWorker(jobs.endpoint(core_end), 0, 1)
    w.client = Client(jobs.endpoint(front))
    w.clients[CID] = w.client
    yield w
    front.close()
    core_end.close()


def test_a_counted_call_sends_its_cost_before_the_answer(core):
    core.plans[1] = FakePlan(Outcome(answer=(), cost=COST))
    core.call(jobs.Call(job=5, plan=1, seq=7))
    ((resp, held),) = core.client.answers
    assert resp.cycles == 110 and resp.seq == 7
    assert held == [jobs.Cost.of(5, CID, 7, COST)]  # already in the channel when the client got its answer


def test_a_call_without_a_cost_sends_no_extra_datagram(core):
    """The cost model off: the outcome has no cost, the front hears nothing
    (a success goes through the status page)."""
    core.plans[1] = FakePlan(Outcome(answer=()))
    core.call(jobs.Call(job=5, plan=1, seq=7))
    ((resp, held),) = core.client.answers
    assert resp.status == 0 and held == []
    with pytest.raises(Timeout):
        jobs.recv(core.client.front_ep, jobs.CORE_TO_FRONT, timeout=0.1)
    assert jobs.STATUS_WORD.unpack_from(core.status, jobs.STATUS_DONE)[0] == 5


def test_a_cost_dict_that_makes_no_record_is_left_out_and_the_call_answered(core, capfd):
    core.plans[1] = FakePlan(Outcome(answer=(), cost=dict(COST, dma_bytes=[1, 2, 3])))
    core.call(jobs.Call(job=5, plan=1, seq=7))
    ((resp, held),) = core.client.answers
    assert resp.status == 0 and held == []
    assert "the cost record of job 5 is not sent" in capfd.readouterr().err
