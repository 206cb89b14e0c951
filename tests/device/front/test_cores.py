"""The front's supervision of cores, driven in-process (no client, no listening socket)."""
from __future__ import annotations

import sys
import time

from dspx.device.front.loop import Service


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
        svc._start_core(c, wait=False)
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
