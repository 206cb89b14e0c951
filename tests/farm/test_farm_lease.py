"""Leases on a local farm of two small devices: a leased device works like a
local one; the queue and run limits each end with their own error and
numbers; an op that hangs past its lease has its device reclaimed
(restarted) and the next lease works; equal priorities share the devices
within 10 %; a higher priority goes first; the per-user cap holds while
another user waits; `farm status` shows holders and waiters."""
from __future__ import annotations

import json
import threading
import time

import numpy as np
import pytest
from click.testing import CliRunner

import dspx.farm  # before ray: it sets Ray's loopback switch, read when Ray is first imported
import ray  # noqa: F401  (part of the test extra)
from dspx.cli import main
from dspx.farm import actors
from dspx.host.inputs import specs
from dspx.host.vm import VirtualMachine, find_module
from spin_ops import FOREVER, NOP, SOURCE

SMALL = ["--carveout-size", "64M", "--ddr-pool-size", "64M"]


@pytest.fixture(scope="module")
def farm():
    with dspx.farm.LocalFarm(2, device_args=SMALL) as f:
        yield f


def _device_pids() -> dict:
    return {n: ray.get(h.info.remote(), timeout=60)["device_pid"] for n, h in actors.find_devices("sim").items()}


def _held_by(user: str) -> int:
    return sum(1 for h in dspx.farm.status()["holders"] if h["user"] == user)


def _wait_for(cond, timeout=30.0, what="condition"):
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)


def _queued(want, user: str, priority: int, pending: int) -> threading.Thread:
    """``want(user, priority)`` on a thread, once its request is the
    ``pending``-th in the queue."""
    t = threading.Thread(target=want, args=(user, priority))
    t.start()
    _wait_for(lambda: dspx.farm.status()["keys"]["sim"]["pending"] == pending, what=f"{user} queued")
    return t


def test_a_leased_device_works_like_a_local_one(farm, compiled, shared_device):
    module = compiled("multi_input")
    _, meta = find_module(module)
    rng = np.random.default_rng(0)
    inputs = {s.name: rng.standard_normal(s.shape).astype(s.dtype) for s in specs(meta)}
    with VirtualMachine(module, socket=shared_device.path) as vm:
        reference = vm["main"](**inputs)
    with dspx.farm.lease(timeout=120, user="alice") as dev:
        assert dev.device in ("sim-0", "sim-1") and dev.ping()["version"]
        with dev.VirtualMachine(module) as vm:
            got = vm["main"](**inputs)
        for a, b in zip(got if isinstance(got, list) else [got], reference if isinstance(reference, list)
                        else [reference]):
            assert a.dtype == b.dtype and np.array_equal(a, b)
        assert dev.outcome()["state"] == "held" and _held_by("alice") == 1
    assert dev.outcome()["state"] == "released" and _held_by("alice") == 0


def test_waiting_past_the_queue_limit_is_its_own_error(farm):
    with dspx.farm.lease(user="a"), dspx.farm.lease(user="b"):
        t0 = time.monotonic()
        with pytest.raises(dspx.farm.QueueTimeout) as e:
            dspx.farm.acquire(queue_timeout=1.0, user="c")
        assert time.monotonic() - t0 >= 1.0
    err = e.value
    assert err.phase == "queue" and err.status_name == "QUEUE_TIMEOUT" and err.limit == 1.0
    assert err.elapsed >= 1.0 and err.held == 2 and err.devices == 2 and err.ahead == 0
    assert "within the queue limit of 1 s" in str(err) and "2 of 2 held" in str(err)
    assert dspx.farm.status()["keys"]["sim"]["pending"] == 0  # the request left the queue with its error


def test_an_op_that_hangs_past_its_lease_is_reclaimed_and_the_next_lease_works(farm):
    before = _device_pids()
    t0 = time.monotonic()
    with pytest.raises(dspx.farm.RunTimeout) as e:
        with dspx.farm.lease(timeout=3.0, user="hang") as dev:
            tasks = dev.Tasks()
            tasks.load_ops(SOURCE)
            inp, out = tasks.malloc(64), tasks.malloc(64)
            tasks.run(FOREVER, inp, out, timeout_ms=120_000)  # the lease, not this, must end it
    took = time.monotonic() - t0
    err = e.value
    assert err.phase == "run" and err.status_name == "RUN_TIMEOUT" and err.limit == 3.0
    assert 3.0 <= err.elapsed < 30 and took < 60 and err.device == dev.device
    assert isinstance(err.__cause__, dspx.DspxError)  # the call's own error: its device went away
    # The device was restarted (a new process), the other one untouched, and the next lease works.
    _wait_for(lambda: dspx.farm.status()["keys"]["sim"]["free"] == 2, 120, "the reclaimed device")
    after = _device_pids()
    assert after[dev.device] != before[dev.device]
    other = ({"sim-0", "sim-1"} - {dev.device}).pop()
    assert after[other] == before[other]
    with dspx.farm.lease(timeout=60, user="hang") as again:
        tasks = again.Tasks()
        tasks.load_ops(SOURCE)
        inp, out = tasks.malloc(64), tasks.malloc(64)
        assert tasks.run(NOP, inp, out).return_value == 0


def _share_run(users, seconds=6.0, hold=0.05):
    """Each user runs two threads that lease, hold ``hold`` s and release,
    for ``seconds``; the seconds each user held devices."""
    held = {u: 0.0 for u in users}
    stop = time.monotonic() + seconds
    lock = threading.Lock()

    def loop(user):
        while time.monotonic() < stop:
            with dspx.farm.lease(user=user, queue_timeout=30, timeout=30):
                t = time.monotonic()
                time.sleep(hold)
                with lock:
                    held[user] += time.monotonic() - t

    threads = [threading.Thread(target=loop, args=(u,)) for u in users for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not any(t.is_alive() for t in threads)
    return held


def test_equal_priorities_get_equal_shares(farm):
    held = _share_run(["ann", "bob"])
    assert min(held.values()) > 0
    assert abs(held["ann"] - held["bob"]) <= 0.10 * max(held.values()), held


def test_a_higher_priority_is_served_first(farm):
    order = []
    a, b = dspx.farm.acquire(user="holder"), dspx.farm.acquire(user="holder")  # nobody waits: both devices

    def want(user, priority):
        with dspx.farm.lease(user=user, priority=priority, queue_timeout=60):
            order.append(user)

    low = _queued(want, "low", 0, pending=1)
    high = _queued(want, "high", 5, pending=2)
    waiting = dspx.farm.status()["keys"]["sim"]["waiting"]
    assert [w["user"] for w in waiting] == ["high", "low"]
    a.release()
    _wait_for(lambda: order, what="a grant")
    assert order[0] == "high"
    b.release()
    low.join(60)
    high.join(60)
    assert order == ["high", "low"]


def test_the_user_cap_holds_while_another_user_waits(farm):
    """Alice holds both devices (nobody waited).  Bob queues; then Alice asks
    for one more at a higher priority.  When she gives one back, Bob gets it:
    she is at her cap (1 of 2) while he waits."""
    a, b = dspx.farm.acquire(user="alice"), dspx.farm.acquire(user="alice")
    got = {}

    def want(user, priority):
        got[user] = dspx.farm.acquire(user=user, priority=priority, queue_timeout=60)

    bob = _queued(want, "bob", 0, pending=1)
    alice = _queued(want, "alice", 9, pending=2)
    assert dspx.farm.status()["keys"]["sim"]["user_cap"] == 1
    a.release()
    bob.join(30)
    assert "bob" in got and "alice" not in got
    got["bob"].release()  # now nobody else waits: alice may hold both again
    alice.join(30)
    assert "alice" in got
    got["alice"].release()
    b.release()


def test_status_shows_holders_and_waiters(farm):
    with dspx.farm.lease(user="carol", timeout=100) as one, dspx.farm.lease(user="dave"):
        refused = []

        def erin():
            with pytest.raises(dspx.farm.QueueTimeout) as e:  # both stay held for the whole check
                dspx.farm.acquire(user="erin", queue_timeout=5)
            refused.append(e.value)

        waiter = threading.Thread(target=erin)
        waiter.start()
        _wait_for(lambda: dspx.farm.status()["keys"]["sim"]["pending"] == 1, what="erin queued")
        cli = CliRunner().invoke(main, ["farm", "status", "--farm", farm.address, "--json"])
        assert cli.exit_code == 0, cli.output
        st = json.loads(cli.stdout)
        sim = st["keys"]["sim"]
        assert (sim["held"], sim["pending"], [w["user"] for w in sim["waiting"]]) == (2, 1, ["erin"])
        holders = {d["device"]: d["holder"] for d in st["devices"]}
        assert holders[one.device]["user"] == "carol" and holders[one.device]["limit"] == 100
        text = CliRunner().invoke(main, ["farm", "status", "--farm", farm.address])
        assert "leased to carol" in text.stdout and "waiting: erin (priority 0, lease)" in text.stdout
        waiter.join(30)
        assert len(refused) == 1


def test_bad_lease_requests_get_one_clear_error(farm):
    with pytest.raises(dspx.farm.FarmError, match=r"no device under dspx:nope \(its keys: sim\)"):
        dspx.farm.acquire("nope")
    with pytest.raises(ValueError, match="timeout must be a number of seconds >= 0"):
        dspx.farm.acquire(timeout=-1)
    with pytest.raises(dspx.farm.FarmError, match="no device under dspx:sim is on node"):
        dspx.farm.acquire(node="0" * 56)


def test_a_batch_takes_free_devices_only_and_gives_one_back_to_a_waiting_user(farm, tmp_path):
    """A batch leases what is free; while it runs, another user's lease is
    granted within seconds (the batch is over its cap), and the batch still
    completes every case."""
    from spin_ops import SPIN

    lib = tmp_path / "spin.py"
    lib.write_text(SOURCE)
    n = 40
    ms = np.full((n, 1), 100, "<i4").view(np.uint8)  # each case spins 100 ms
    cases = dspx.farm.ops.read_cases({"input": ms, "cmd": np.int64(SPIN), "output_bytes": np.int64(4)})

    # A device leased by someone else is not the batch's.
    with dspx.farm.lease(user="ivy") as ivy:
        few = dspx.farm.ops.run_cases(lib, dspx.farm.ops.read_cases(
            {"input": ms[:4], "cmd": np.int64(SPIN), "output_bytes": np.int64(4)}), user="mapper")
        assert {r.device for r in few} == {"sim-0", "sim-1"} - {ivy.device}

    done_at, granted = [], {}

    def on_result(r):
        done_at.append(time.monotonic())
        if len(done_at) == 4:  # the batch holds both devices by now: zed asks for one
            threading.Thread(target=want).start()

    def want():
        t = time.monotonic()
        lease = dspx.farm.acquire(user="zed", queue_timeout=30)
        granted.update(at=time.monotonic(), waited=time.monotonic() - t, device=lease.device)
        time.sleep(1.0)
        lease.release()

    results = dspx.farm.ops.run_cases(lib, cases, user="mapper", chunk=1, on_result=on_result)
    assert [r.index for r in results] == list(range(n))
    assert all(r.error is None and r.return_value == 0 and r.output.tobytes() == b"RUN!" for r in results)
    assert granted and granted["waited"] < 10 and granted["at"] < done_at[-1], granted
    assert _held_by("mapper") == 0  # every lease of the batch was given back


def test_a_lease_whose_holder_died_is_freed(farm):
    """A driver that takes a lease and dies without giving it back: the
    broker ends the lease within seconds and restarts the device."""
    import subprocess
    import sys

    before = _device_pids()
    code = ("import os, dspx.farm\n"
            f"lease = dspx.farm.acquire(farm={farm.address!r}, user='ghost', timeout=None)\n"
            "print(lease.device, flush=True)\n"
            "os._exit(0)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    device = out.stdout.split()[-1]
    t0 = time.monotonic()
    _wait_for(lambda: _held_by("ghost") == 0, 60, "the dead holder's lease to end")
    assert time.monotonic() - t0 < 30
    _wait_for(lambda: dspx.farm.status()["keys"]["sim"]["free"] == 2, 120, "the device back")
    assert _device_pids()[device] != before[device]  # restarted: nothing the holder left runs on


def test_a_batch_takes_a_device_that_comes_free_while_it_runs(farm, tmp_path):
    from spin_ops import SPIN

    lib = tmp_path / "spin.py"
    lib.write_text(SOURCE)
    ms = np.full((30, 1), 100, "<i4").view(np.uint8)  # 30 cases of 100 ms
    cases = dspx.farm.ops.read_cases({"input": ms, "cmd": np.int64(SPIN), "output_bytes": np.int64(4)})
    held = dspx.farm.acquire(user="early")
    seen = []

    def on_result(r):
        seen.append(r.device)
        if len(seen) == 3:
            held.release()  # the batch has run on the other device only, so far

    results = dspx.farm.ops.run_cases(lib, cases, user="mapper", chunk=1, on_result=on_result)
    assert all(r.output.tobytes() == b"RUN!" for r in results)
    assert set(seen[:3]) == {({"sim-0", "sim-1"} - {held.device}).pop()}
    assert held.device in seen[3:], "the batch did not take the device released while it ran"


def test_a_lease_on_another_machine_says_where_its_device_is():
    grant = {"id": 7, "key": "sim", "device": "sim-3", "node": "n" * 56, "socket": "/tmp/x/dsp0.sock",
             "host": "elsewhere.example", "user": "u", "priority": 0, "limit": None}
    lease = dspx.farm.Lease(grant, broker=None)
    with pytest.raises(dspx.farm.FarmError, match=r"sim-3 is on elsewhere\.example, not this machine"):
        lease.client
