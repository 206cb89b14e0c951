"""The host's own refusals, made before anything reaches the device: the UCP
task states (created -> submitted -> done | failed -> released) and the
priority range.  A client that fails any use proves nothing was sent."""
from __future__ import annotations

import pytest

from dspx.errors import CallFailed, DspxError
from dspx.host.tasks import Mem, Task, Tasks


class NoDevice:
    """A client every use of which is a test failure: the check must come first."""

    def __getattr__(self, name):
        raise AssertionError(f"client.{name} used: the state check must refuse before any I/O")


@pytest.fixture
def ucp():
    return Tasks(client=NoDevice())


def _task(state: str) -> Task:
    t = Task(0x1402, Mem(None, 16), Mem(None, 16))
    t.state = state
    return t


@pytest.mark.parametrize("state", ["submitted", "done", "failed", "released"])
def test_only_a_created_task_can_be_submitted(ucp, state):
    with pytest.raises(DspxError, match=f"task is {state}; create a new one"):
        ucp.submit(_task(state))


@pytest.mark.parametrize("priority", [-1, 256])
def test_priority_outside_0_to_255_is_refused_on_the_host(ucp, priority):
    with pytest.raises(ValueError, match=f"priority {priority} outside 0..255"):
        ucp.submit(_task("created"), priority=priority)


@pytest.mark.parametrize("state", ["created", "released"])
def test_wait_needs_a_submitted_task(ucp, state):
    with pytest.raises(DspxError, match=f"task is {state}; submit it first"):
        ucp.wait(_task(state))


def test_wait_on_a_finished_task_answers_at_once(ucp):
    done = _task("done")
    assert ucp.wait(done) is done
    failed = _task("failed")
    failed.error = CallFailed(-11, "handler raised", "RPC 0x1402")
    with pytest.raises(CallFailed):
        ucp.wait(failed)


def test_a_task_in_flight_cannot_be_released(ucp):
    with pytest.raises(DspxError, match="still in flight"):
        ucp.release(_task("submitted"))
    for state in ("done", "failed", "created"):
        t = _task(state)
        ucp.release(t)
        assert t.state == "released"


def test_closing_a_borrowed_client_leaves_it_open():
    client = NoDevice()
    u = Tasks(client=client)
    u.close()  # would raise if it touched the client
    assert u.client is None
