"""The core worker (device/core/worker.py) in-process: which status an
aborted job answers."""
from __future__ import annotations

import signal
import socket

import pytest

from dspx.abi import protocol as P


def test_a_call_stopped_inside_a_kernel_callback_answers_err_timeout():
    """The time-limit abort raised inside TVM (a kernel called back from the
    module) reaches the job wrapped as a CallError; the core still answers
    the abort's status for that job, and only for that job."""
    from dspx.device.core.errors import CallError
    from dspx.device.core.worker import CoreWorker, JobAborted
    from dspx.transport import Endpoint

    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    try:
        w = CoreWorker(Endpoint(a), index=0, threads=1)
        w._running_job = 7
        try:
            try:
                w._on_abort(signal.SIGUSR2, None)
            except JobAborted as e:  # what TVM's FFI does to it
                raise CallError(f"main failed: {e}") from None
        except CallError as e:
            assert e.status == P.Status.ERR_CALL
            assert w._abort_status(7, e.status) == P.Status.ERR_TIMEOUT
        assert w._abort_status(8, P.Status.ERR_CALL) == P.Status.ERR_CALL  # another job's failure is its own
        assert w._abort_status(7, P.Status.SUCCESS) == P.Status.SUCCESS  # an answer that went out first
        w._running_job = 9
        with pytest.raises(JobAborted) as e:
            w._on_abort(signal.SIGUSR1, None)  # its connection closed
        assert e.value.status == P.Status.ERR_CALL and w._abort_status(9, P.Status.ERR_WEIGHTS) == P.Status.ERR_CALL
    finally:
        a.close()
        b.close()
