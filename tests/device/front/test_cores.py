"""The front's supervision of cores, driven in-process (no client, no
listening socket), and the environment a core starts with."""
from __future__ import annotations

import os
import sys
import time

import psutil

from dspx.device.front.loop import Service
from conftest import Device


def _wait_exit(c, timeout=20.0):
    deadline = time.monotonic() + timeout
    while c.proc.poll() is None:
        assert time.monotonic() < deadline, "core process did not exit"
        time.sleep(0.01)


def test_a_core_that_dies_before_its_hello_is_restarted_with_a_growing_backoff(tmp_path):
    svc = Service(str(tmp_path / "dsp0.sock"), cores=1, threads=1)
    c = svc.cores[0]
    c.COMMAND = (sys.executable, "-c", "import sys; sys.exit(3)")  # dies at once, never says hello
    try:
        svc.supervisor.start_core(c, wait=False)
        delays = []
        for attempt in (1, 2):
            _wait_exit(c)
            now = time.monotonic()
            svc._housekeeping(now)
            assert c.ep is None and not c.ready and c.start_failures == attempt
            delays.append(c.retry_at - now)
            svc._housekeeping(now)  # before retry_at: no new process
            assert c.ep is None
            svc._housekeeping(c.retry_at + 0.001)  # due: started again
            assert c.ep is not None
        assert 0 < delays[0] < delays[1] <= 5.0
    finally:
        c.stop()


def test_cores_start_with_a_short_tvm_spin_unless_the_caller_sets_one():
    """TVM's pool spins ~0.3 s after each parallel region by default, taking
    half the CPU from whatever runs next on a 2-vCPU machine; cores get a
    short spin, and a caller's own setting wins."""
    from dspx.device.front.cores import TVM_SPIN_COUNT

    def core_env(d):
        (core,) = [p for p in psutil.Process(d.proc.pid).children() if "--index" in p.cmdline()]
        return core.environ()

    d = Device("--carveout-size", "64M", "--ddr-pool-size", "64M")
    try:
        assert core_env(d)["TVM_THREAD_POOL_SPIN_COUNT"] == str(TVM_SPIN_COUNT) == "5000"
    finally:
        d.stop()
    os.environ["TVM_THREAD_POOL_SPIN_COUNT"] = "123"
    try:
        d = Device("--carveout-size", "64M", "--ddr-pool-size", "64M")
    finally:
        del os.environ["TVM_THREAD_POOL_SPIN_COUNT"]
    try:
        assert core_env(d)["TVM_THREAD_POOL_SPIN_COUNT"] == "123"
    finally:
        d.stop()
