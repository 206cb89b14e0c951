"""What the front's handlers ask for, as values: the loop carries them out.

A handler never calls into the loop: it returns a list of actions —
``Respond`` to the request's connection, ``RespondTo`` another one,
``Submit`` a ``FrontJob`` to a core, ``Notify`` cores of a record that needs
no answer, ``Forget`` what cores hold — so every rule can be tested with no
socket (``tests/device/front/test_handlers.py``).  ``Service.apply`` (loop.py)
carries them out.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

from ...abi import protocol as P
from .. import jobs
from .state import Conn, Plan, Reject


@dataclass
class Respond:
    msg: P.Message


@dataclass
class RespondTo:
    """Respond to a connection other than the one whose job ended (an unload
    answered after its core freed the module)."""
    conn: Conn
    msg: P.Message


@dataclass
class FrontJob:
    """A job waiting for or running on a core, and what to do when it ends."""
    rec: jobs.Job
    conn: Conn | None
    req: P.Message | None
    core: int = P.CORE_ANY
    bufs: list = field(default_factory=list)
    # (Done) -> actions; raising Reject answers the request with that failure
    on_done: Callable | None = None
    priority: int = 0
    deadline: float | None = None  # monotonic time the job must have ended by
    plan: Plan | None = None
    req_type: int = 0  # a Call's request type (its req is not decoded on replay)
    queued_at: float = 0.0
    run_limit_s: float = 0.0  # seconds it may run once started (its deadline is set then)


@dataclass
class Submit:
    job: FrontJob


@dataclass
class Notify:
    """Send a record that needs no answer to one core (index) or every core (None)."""
    core: int | None
    rec: jobs.Job
    generation: int | None = None  # only if that core is still this incarnation


@dataclass
class Forget:
    """Cores drop these plans, client sockets and buffer mappings, if they hold them."""
    plans: list = field(default_factory=list)
    conns: list = field(default_factory=list)
    bufs: list = field(default_factory=list)


class NoRoom(Reject):
    """A load that succeeded on the core but does not fit the pool: undo it there, then refuse."""

    def __init__(self, undo: Notify, reject: Reject):
        super().__init__(reject.status, str(reject), **reject.numbers)
        self.undo = undo


def failure(conn: Conn | None, req: P.Message, e: Reject) -> list:
    """The failure response to ``req``, recorded for GET_ERROR."""
    if conn is None:
        return []
    conn.last_error = (req.seq, int(e.status), str(e))
    return [Respond(P.failure(req, e.status, **e.numbers))]
