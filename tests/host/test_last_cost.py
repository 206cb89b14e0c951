"""GET_COST end to end (Client.last_cost, Tasks.last_cost) on real devices:
a device under a cost model, with an op library that fakes the timing
model's record (it wraps the core's RPC run so its op's outcome carries a
cost dict, as the Python runtime's counting will); a device without one,
where nothing is sent and GET_COST is ERR_OP; a core that forges a Cost is
restarted; and a traced host program draws the record as the modeled DSP
timeline."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import textwrap

import numpy as np
import pytest

from conftest import SMALL, Device
from dspx.device import jobs
from dspx.errors import CallFailed, UnknownOp
from dspx.host.client import Client
from dspx.host.tasks import Tasks

COSTED, PLAIN, WHOAMI, FORGE = 0x3101, 0x3102, 0x3103, 0x3104

# The fake: a sitecustomize for the device's processes (PYTHONPATH) that, in a
# core, wraps the RPC run so COSTED's outcome carries a cost dict (cycles =
# overhead + compute + ddr_stall + dma_wait; ops_alu is the call's first input
# byte, so two calls' records differ).  WHOAMI writes the job id its core runs;
# FORGE sends a Cost for the job id in its input, then waits to be killed.
FAKE_SITE = textwrap.dedent("""
    import sys
    if "dspx.device.core" in sys.orig_argv:
        import time
        import numpy as np
        from dspx.device import jobs
        from dspx.device.core import rpc

        FAKE = {"profile": "j6-vision", "estimate": True, "cycles": 1_000_500, "overhead": 500,
                "compute": 600_000, "ddr_stall": 300_000, "dma_wait": 100_000, "ddr_loads": 25_000,
                "ddr_stores": 6_250, "tcm_loads": 12, "tcm_stores": 13, "ops_alu": 0, "ops_mul": 50_000,
                "ops_special": 6_250, "ops_move": 7, "dma_bytes": [400_000, 400_064], "dma_transfers": [13, 12]}
        _run = rpc.PreparedRpc.run

        def run(self, core):
            cmd = self.spec.cmd
            if cmd == 0x3103:
                self.out[:8] = np.frombuffer(np.uint64(core._running_job).tobytes(), np.uint8)
            elif cmd == 0x3104:
                job = int(np.frombuffer(self.inp, np.uint64, count=1)[0])
                jobs.send(core.ep, jobs.Cost.of(job, self.spec.cid, 1, FAKE))
                time.sleep(60)
            out = _run(self, core)
            if cmd == 0x3101:
                out.cost = dict(FAKE, ops_alu=int(self.inp[0]))
            elif cmd == 0x3102:
                out.cost = None  # as a call the model does not count (the runtime counts every Python op)
            return out
        rpc.PreparedRpc.run = run
""")

FAKE_COST_OPS = textwrap.dedent("""
    from dspx.device.core import runtime as rt

    def nothing(inp, out, tm):  # what each op does is the fake's (FAKE_SITE)
        return 0

    for cmd, name in ((0x3101, "costed"), (0x3102, "plain"), (0x3103, "whoami"), (0x3104, "forge")):
        rt.register_op(cmd, nothing, name=name)
""")

FAKE_KEYS = {"profile": "j6-vision", "estimate": True, "counted": True, "cycles": 1_000_500, "overhead": 500,
             "compute": 600_000, "ddr_stall": 300_000, "dma_wait": 100_000, "ddr_loads": 25_000, "ddr_stores": 6_250,
             "tcm_loads": 12, "tcm_stores": 13, "ops_mul": 50_000, "ops_special": 6_250, "ops_move": 7,
             "dma_bytes": [400_000, 400_064], "dma_transfers": [13, 12]}


def _device(cost_model: str | None, *args) -> Device:
    """A device (its environment: the cost model, and the fake on PYTHONPATH)."""
    site = tempfile.mkdtemp(prefix="dspx-fake-cost-")
    with open(os.path.join(site, "sitecustomize.py"), "w") as f:
        f.write(FAKE_SITE)
    saved = {k: os.environ.get(k) for k in (jobs.COST_MODEL_ENV, "PYTHONPATH")}
    os.environ.pop(jobs.COST_MODEL_ENV, None)
    if cost_model:
        os.environ[jobs.COST_MODEL_ENV] = cost_model
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (site, saved["PYTHONPATH"]) if p)
    try:
        return Device(*SMALL, *args)
    finally:
        for k, v in saved.items():
            os.environ.pop(k, None)
            if v is not None:
                os.environ[k] = v


@pytest.fixture(scope="module")
def cost_dev():
    d = _device("j6-vision", "--cores", "2")
    with Tasks(socket=d.path) as u:
        u.load_ops(FAKE_COST_OPS, device_wide=True)  # the tests use it from sessions of their own
    yield d
    d.stop()


@pytest.fixture(scope="module")
def plain_dev():
    d = _device(None)
    with Tasks(socket=d.path) as u:
        u.load_ops(FAKE_COST_OPS, device_wide=True)  # the tests use it from sessions of their own
    yield d
    d.stop()


def _run(u: Tasks, cmd: int, first: int = 0, core: int = -1, inp=None):
    inp = inp or u.malloc(64)
    inp.vir[0] = first
    return u.run(cmd, inp, u.malloc(64), core=core)


def test_last_cost_is_the_record_of_the_last_counted_call(cost_dev):
    with Tasks(socket=cost_dev.path) as u:
        t = _run(u, COSTED, 3)
        got = u.last_cost()
        assert got == {**FAKE_KEYS, "ops_alu": 3, "seq": t.seq, "core": t.core}
        t2 = _run(u, COSTED, 9, core=1)
        got = u.client.last_cost()
        assert (got["seq"], got["core"], got["ops_alu"]) == (t2.seq, 1, 9)
        _run(u, PLAIN)  # not counted: the record stays the last counted call's, and says which
        assert u.last_cost()["seq"] == t2.seq


def test_each_connection_has_its_own_record(cost_dev):
    with Tasks(socket=cost_dev.path) as a, Tasks(socket=cost_dev.path) as b:
        _run(a, COSTED, 5)
        with pytest.raises(UnknownOp, match="no cost record: no call of this connection was counted"):
            b.last_cost()
        assert a.last_cost()["ops_alu"] == 5


def test_right_after_the_answer_the_record_is_there(cost_dev):
    """The Cost goes out before the answer and GET_COST drains the cores first:
    asked at once, many times over, it is never the previous call's."""
    with Client(cost_dev.path, staging_size=0, timeout=60) as c:
        u = Tasks(c)
        inp = u.malloc(64)
        for i in range(40):
            t = _run(u, COSTED, i, inp=inp)
            got = c.last_cost()
            assert (got["seq"], got["ops_alu"]) == (t.seq, i)


def test_a_core_that_forges_a_cost_is_restarted_and_the_device_serves_on(cost_dev):
    """A Cost for a job another core runs (the wrong core), and for a job
    never sent: the core that sent it is restarted, its call fails ERR_CALL."""
    with Tasks(socket=cost_dev.path) as u:
        t = _run(u, WHOAMI, core=1)
        other_job = int(np.frombuffer(bytes(t.output.vir[:8]), np.uint64)[0])
        assert other_job > 0
        for job, why in ((other_job, "which was never sent to core 0"), (1 << 40, "which was never sent to core 0")):
            inp = u.malloc(64)
            inp.view(np.uint64, 1)[0] = job
            with pytest.raises(CallFailed, match=f"core 0 sent an invalid record .*Cost for job {job}, {why}"):
                u.run(FORGE, inp, u.malloc(64), core=0)
        assert _run(u, COSTED, 1, core=0).state == "released"  # the restarted core got the library back
        assert u.last_cost()["ops_alu"] == 1
    assert cost_dev.alive()
    assert "sent an invalid record: Cost for job" in cost_dev.output()


def test_without_a_cost_model_get_cost_is_err_op_and_nothing_is_counted(plain_dev):
    """Off: the faked op's record would be a bad record (the front restarts
    a core that sends one), so a call that sends none leaves the core as it
    was; the plain op is answered and GET_COST has nothing."""
    with Tasks(socket=plain_dev.path) as u:
        with pytest.raises(UnknownOp, match="no cost record"):
            u.last_cost()
        pids = plain_dev.core_pids()
        assert _run(u, PLAIN).state == "released"
        with pytest.raises(UnknownOp, match="DSPX_COST_MODEL=NAME"):
            u.last_cost()
        assert plain_dev.core_pids() == pids


def test_a_cost_on_a_device_without_a_cost_model_restarts_the_core(plain_dev):
    """(FORGE waits to be killed: a call that went on would be answered
    before the front read its record, and its success could win.)"""
    with Tasks(socket=plain_dev.path) as u:
        pids = plain_dev.core_pids()
        with pytest.raises(CallFailed, match="Cost for job 5, but core 0 runs without a cost model"):
            _run(u, FORGE, 5)
        assert plain_dev.core_pids() != pids
        assert _run(u, PLAIN).state == "released"


TRACED = r'''
import json, sys
from dspx.host import tracing
from dspx.host.tasks import Tasks
tracing.start_host(sys.argv[2])
with Tasks(socket=sys.argv[1]) as u:
    inp, out = u.malloc(64), u.malloc(64)
    t = u.run(0x3101, inp, out)
    rec = u.last_cost()
    print(json.dumps({"seq": t.seq, "core": rec["core"]}))
'''


def test_a_traced_host_draws_the_modeled_dsp_timeline(cost_dev, tmp_path):
    out = tmp_path / "trace.json"
    env = dict(os.environ)
    env.pop("DSPX_TRACE", None)
    r = subprocess.run([sys.executable, "-c", TRACED, cost_dev.path, str(out)], capture_output=True, text=True,
                       timeout=120, env=env)
    assert r.returncode == 0, r.stderr
    info = json.loads(r.stdout.strip().splitlines()[-1])
    events = json.loads(out.read_text())["traceEvents"]
    names = {e["pid"]: e["args"]["name"] for e in events if e.get("name") == "process_name"}
    modeled = [pid for pid, n in names.items() if n == "modeled DSP (j6-vision)"]
    assert len(modeled) == 1 and names.get(modeled[0] - (1 << 22)) == "host", names
    spans = [e for e in events if e.get("ph") == "X" and e["pid"] == modeled[0]]
    core = [e for e in spans if e["tid"] == info["core"]]
    assert [e["name"] for e in core] == [f"call seq {info['seq']} (estimate)", "overhead", "compute", "ddr stall",
                                         "dma wait"]
    call, *parts = core
    us = 1e6 / call["args"]["clock_hz"]  # per modeled cycle: the profile's clock, else (no profile here) 1 GHz
    assert call["args"]["estimate"] is True and call["dur"] == pytest.approx(1_000_500 * us)
    assert [p["dur"] for p in parts] == pytest.approx([500 * us, 600_000 * us, 300_000 * us, 100_000 * us])
    for a, b in zip(parts, parts[1:]):  # consecutive: the record holds totals, not when each happened
        assert b["ts"] == pytest.approx(a["ts"] + a["dur"])
    assert parts[0]["ts"] == pytest.approx(call["ts"])
    host_send = [e for e in events if e.get("ph") == "X" and e["name"] == "send" and e["pid"] == modeled[0] - (1 << 22)]
    assert any(e["ts"] == pytest.approx(call["ts"]) for e in host_send)  # it starts when the host sent the call
    dma = sorted((e for e in spans if e["tid"] != info["core"]), key=lambda e: e["tid"])
    assert [e["name"] for e in dma] == ["ch0: 13 transfers, 400000 bytes", "ch1: 12 transfers, 400064 bytes"]
    assert all(e["args"]["placement"].startswith("totals") and e["dur"] == call["dur"] for e in dma)
