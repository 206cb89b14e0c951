"""A planned call on a core (INFER or RPC), behind one interface.

The core keeps each plan the front sent (``jobs.InferSpec``, ``jobs.RpcSpec``)
as a prepared call — ``inference.PreparedInfer`` or ``rpc.PreparedRpc`` —
and runs it for every request with the same bytes.  The worker asks both
kinds the same two things: ``run(core)`` runs it and says what it came to,
``response(seq, outcome, queued_us)`` is the client's answer.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

from ...abi.protocol import Status


@dataclass(slots=True)
class Outcome:
    """What one run of a prepared call came to: its status (with the error
    text and the numbers a failure response carries) and ``answer``, the
    figures its kind's response is made of.  ``cost``: the timing model's
    record of the run (docs/cost-model.md's names) when a cost model is on;
    the worker sends it to the front (``jobs.Cost``) before the answer."""
    status: int = Status.SUCCESS
    error: str = ""
    numbers: dict = field(default_factory=dict)
    answer: tuple = ()
    cost: dict | None = None


class Prepared(Protocol):
    spec: object  # the jobs.InferSpec or jobs.RpcSpec it was built from

    def run(self, core) -> Outcome:
        """Run the call on ``core`` (the worker: its ops, buffers, printf);
        an exception means it failed before it had an outcome."""

    def response(self, seq: int, outcome: Outcome, queued_us: int) -> bytes | None:
        """The client's answer to request ``seq``; None when the call has no
        answer of its own (the worker sends the failure response)."""
