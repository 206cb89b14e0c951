"""The front's side of the timing model's records (device/jobs.py ``Cost``):
GET_COST answers the connection's last counted call, and every Cost a core
sends is checked like any core record (docs/containment.md) — a device with
no cost model, a job the core was never sent, another connection's or
another core's job, records out of order or figures that do not add up are
bad records, which restart the core."""
from __future__ import annotations

import pytest

from front_harness import responses
from dspx.abi import protocol as P
from dspx.device import jobs
from dspx.device.front.actions import FrontJob
from dspx.device.front.state import Conn

COST = {"profile": "j6-vision", "estimate": True, "cycles": 110, "overhead": 10, "compute": 60, "ddr_stall": 30,
        "dma_wait": 10, "ddr_loads": 1, "ddr_stores": 2, "tcm_loads": 3, "tcm_stores": 4, "ops_alu": 5,
        "ops_mul": 6, "ops_special": 7, "ops_move": 8, "dma_bytes": [4096, 8192], "dma_transfers": [1, 2]}


def cost(job, cid, seq, **change) -> jobs.Cost:
    return jobs.Cost.of(job, cid, seq, dict(COST, **change))


# ---------------------------------------------------------------- GET_COST

def test_get_cost_without_a_record_is_err_op_and_says_why(front):
    (r,) = responses(front(P.GetCost(seq=3)))
    assert (type(r), r.seq, r.status) == (P.GetCostResp, 3, P.Status.ERR_OP)
    assert front.conn.last_error[:2] == (3, P.Status.ERR_OP) and "no cost record" in front.conn.last_error[2]


def test_get_cost_answers_the_kept_record_with_its_call_s_seq_and_core(front):
    front.conn.last_cost = (1, cost(9, front.conn.cid, 41))
    (r,) = responses(front(P.GetCost(seq=42)))
    assert (r.seq, r.status) == (42, 0)
    assert r.record() == {**{k: v for k, v in COST.items()}, "seq": 41, "core": 1, "counted": True}
    front.conn.last_cost = (0, cost(10, front.conn.cid, 43, counted=False))
    (r,) = responses(front(P.GetCost(seq=44)))
    assert r.record()["counted"] is False and r.flags == 0


# ---------------------------------------------------------------- the checks, in-process

@pytest.fixture
def svc(tmp_path, monkeypatch):
    """A front (not started) with 2 cores under a cost model; connection 1
    runs call job 5 (seq 7) on core 0, and core 1 was sent job 6."""
    from dspx.device.front.loop import Service
    monkeypatch.setenv(jobs.COST_MODEL_ENV, "j6-vision")
    s = Service(str(tmp_path / "dsp0.sock"), cores=2, threads=1)
    for cid in (1, 2):
        s.st.conns[cid] = Conn(cid, None, 0)
    c0, c1 = s.cores
    c0.known_conns = {1}
    c0.note_sent(5)
    c0.running = FrontJob(jobs.Call(job=5, seq=7), s.st.conns[1], None)
    c1.known_conns = {2}
    c1.note_sent(6)
    return s


def test_a_cost_for_the_running_call_is_kept_for_its_connection(svc):
    svc.supervisor.cost(svc.cores[0], cost(5, 1, 7))
    core, rec = svc.st.conns[1].last_cost
    assert core == 0 and rec == cost(5, 1, 7)
    assert svc.st.conns[2].last_cost is None


def test_a_cost_after_its_call_ended_is_kept_if_the_core_serves_that_connection(svc):
    c = svc.cores[0]
    c.running = None  # the call ended through the status page before the front read its Cost
    svc.supervisor.cost(c, cost(5, 1, 7))
    assert svc.st.conns[1].last_cost[1].job == 5


@pytest.mark.parametrize("rec, why", [
    (cost(1 << 40, 1, 7), "Cost for job 1099511627776, which was never sent to core 0"),
    (cost(6, 1, 7), "Cost for job 6, which was never sent to core 0"),  # core 1's job: the wrong core
    (cost(5, 2, 7), "Cost for job 5 (connection 2, seq 7), which is Call seq 7 of connection 1"),
    (cost(5, 1, 8), "(connection 1, seq 8), which is Call seq 7"),
    (cost(5, 1, 7, cycles=111), "cycles 111 != overhead + compute + ddr_stall + dma_wait = 110"),
    (cost(5, 1, 7, profile=""), "names profile '', not a printable ASCII name"),
    (cost(5, 1, 7, profile="j6\nvision"), "not a printable ASCII name"),
], ids=["forged-job", "wrong-core", "other-connection", "other-seq", "figures", "no-profile", "control-chars"])
def test_a_cost_that_is_not_this_core_s_call_is_a_bad_record(svc, rec, why):
    with pytest.raises(jobs.BadRecord) as e:
        svc.supervisor.cost(svc.cores[0], rec)
    assert why in str(e.value)
    assert svc.st.conns[1].last_cost is None and svc.st.conns[2].last_cost is None


def test_a_cost_for_an_ended_job_of_a_connection_the_core_does_not_serve_is_a_bad_record(svc):
    c = svc.cores[0]
    c.running = None
    with pytest.raises(jobs.BadRecord, match="Cost for connection 2, which core 0 does not serve"):
        svc.supervisor.cost(c, cost(5, 2, 7))


def test_a_cost_for_a_job_that_is_not_a_call_is_a_bad_record(svc):
    c = svc.cores[0]
    c.running = FrontJob(jobs.LoadOps(job=5), svc.st.conns[1], None)
    with pytest.raises(jobs.BadRecord, match="which is LoadOps"):
        svc.supervisor.cost(c, cost(5, 1, 0))


def test_a_second_cost_for_a_job_or_one_out_of_order_is_a_bad_record(svc):
    c = svc.cores[0]
    svc.supervisor.cost(c, cost(5, 1, 7))
    with pytest.raises(jobs.BadRecord, match="Cost for job 5 after core 0's Cost for job 5"):
        svc.supervisor.cost(c, cost(5, 1, 7))
    c.note_sent(4)
    c.running = None
    with pytest.raises(jobs.BadRecord, match="Cost for job 4 after core 0's Cost for job 5"):
        svc.supervisor.cost(c, cost(4, 1, 3))


def test_calls_of_one_connection_on_two_cores_keep_the_latest(svc):
    """Job 8 on core 1 reports before job 5 on core 0: the connection keeps job 8's."""
    c0, c1 = svc.cores
    c1.known_conns.add(1)
    c1.note_sent(8)
    svc.supervisor.cost(c1, cost(8, 1, 9))
    svc.supervisor.cost(c0, cost(5, 1, 7))
    assert svc.st.conns[1].last_cost[0] == 1 and svc.st.conns[1].last_cost[1].seq == 9


def test_without_a_cost_model_any_cost_is_a_bad_record(svc, monkeypatch):
    monkeypatch.delenv(jobs.COST_MODEL_ENV)
    with pytest.raises(jobs.BadRecord, match="Cost for job 5, but core 0 runs without a cost model"):
        svc.supervisor.cost(svc.cores[0], cost(5, 1, 7))
    svc.cores[0].env = {jobs.COST_MODEL_ENV: "j6-vision"}  # a core's own environment decides
    svc.supervisor.cost(svc.cores[0], cost(5, 1, 7))


def test_a_bad_cost_read_from_the_channel_restarts_the_core(svc, monkeypatch):
    """drain: a Cost that fails its checks goes where every bad record goes."""
    import socket
    from dspx.transport import Timeout
    died = []
    monkeypatch.setattr(svc.supervisor, "_invalid_record", lambda c, why: died.append((c.index, why)))
    c = svc.cores[0]
    c.ready = True
    front_end, core_end = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    front_end.setblocking(False)
    try:
        c.ep = jobs.endpoint(front_end)
        core_ep = jobs.endpoint(core_end)
        jobs.send(core_ep, cost(5, 1, 7))
        jobs.send(core_ep, cost(1 << 40, 1, 7))
        svc.supervisor.drain(c)
        assert svc.st.conns[1].last_cost[1].job == 5
        assert died == [(0, "Cost for job 1099511627776, which was never sent to core 0")]
        with pytest.raises(Timeout):
            jobs.recv(c.ep, jobs.CORE_TO_FRONT, timeout=0)
    finally:
        c.ep = None
        front_end.close()
        core_end.close()


def test_get_cost_reads_a_cost_still_in_a_core_s_channel(svc, monkeypatch):
    """The call ended through the status page (the connection has nothing in
    flight, so nothing drains its core) and its Cost is unread in the core's
    channel: GET_COST takes what the cores sent first, and answers it."""
    import socket
    sent = []
    monkeypatch.setattr(svc.connections, "send", lambda conn, data: sent.append(P.decode(data)))
    c = svc.cores[0]
    c.ready, c.running = True, None
    front_end, core_end = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    front_end.setblocking(False)
    try:
        c.ep = jobs.endpoint(front_end)
        jobs.send(jobs.endpoint(core_end), cost(5, 1, 7))
        svc._dispatch(svc.st.conns[1], P.GetCost(seq=8).encode(), [], False)
        (r,) = sent
        assert (r.seq, r.status, r.cost_seq, r.core) == (8, 0, 7, 0)
    finally:
        c.ep = None
        front_end.close()
        core_end.close()
