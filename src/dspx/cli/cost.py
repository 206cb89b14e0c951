"""The board-time estimate on the command line (issue 26, docs/cost-model.md):
the ``--cost-model`` option of compile, compile-llm, run and generate, and
how a recorded or computed estimate is shown.  Every figure shown is
labelled an estimate, names its profile and lists the parameters it assumed
(``estimate.format_estimate`` / ``estimate.assumed_line``)."""
from __future__ import annotations

import logging

import click

log = logging.getLogger("dspx")


def option(what: str):
    """``--cost-model NAME|FILE``; ``what`` says what it does with the profile."""
    return click.option("--cost-model", "cost_model", default=None, metavar="NAME|FILE",
                        help=f"{what} (c7x-j722s, or a profile file; default $DSPX_COST_MODEL; an estimate, "
                             "not a measurement: docs/cost-model.md)")


def check(cost_model: str | None) -> None:
    """Refuse a bad profile named on the command line before any work is done
    (ProfileError is a ValueError: one ``error:`` line)."""
    if cost_model is not None:
        from .. import costmodel

        costmodel.load(cost_model)


def wanted(cost_model: str | None) -> bool:
    """Is an estimate asked for (``--cost-model``, else ``$DSPX_COST_MODEL``)?"""
    from ..costmodel import estimate

    return estimate.requested(cost_model) is not None


def estimate_of(meta: dict, cost_model: str | None, what: str) -> dict | None:
    """The estimate to show for a module's or an LLM package's metadata, under
    ``--cost-model`` or else ``$DSPX_COST_MODEL``; None when neither is set.

    Named on the command line, a profile that cannot give one (no MMA, a bad
    file) or a module compiled without a cost model is an error.  Set only in
    the environment (which the device reads too, perhaps naming j6-vision), it
    is logged and skipped, so the command still does its own work."""
    from ..costmodel import estimate

    name = estimate.requested(cost_model)
    if name is None:
        return None
    try:
        est = estimate.module_estimate(meta, name)
    except (ValueError, OSError) as e:  # ProfileError, EstimateError, an unreadable profile file
        if not cost_model:
            log.info("no board-time estimate under %s=%s: %s", estimate.ENV, name, e)
            return None
        if isinstance(e, estimate.EstimateError):  # say which profile lacks what
            raise estimate.EstimateError(f"cost model {name!r}: {e}") from None
        raise
    if est is None and cost_model:
        raise estimate.EstimateError(f"{what} was compiled without a cost model, so it records no kernel calls to "
                                     f"estimate: compile it again with --cost-model {name}")
    return est


def summary(est: dict, width: int = 11) -> list[str]:
    """The short block ``dspx info`` and ``dspx compile`` show for a recorded
    estimate: profile, total, labelled, with its assumed parameters
    (``width``: of the label column, to line up with the command's others)."""
    from ..costmodel import estimate

    head = f"  {'estimate':<{width}}ESTIMATE on {est['profile']} (a model of the board, not a measurement): "
    if "prefill" in est:
        p, d = est["prefill"], est["decode"]
        head += (f"prefill {p['tok_per_s']:,.1f} tok/s ({p['tokens']} tokens per call), "
                 f"decode {d['tok_per_s']:,.1f} tok/s (at position {d['position']})")
    else:
        head += (f"{est['seconds'] * 1e3:.3f} ms = {est['total_cycles']:,.0f} cycles, {est['calls']} kernel calls "
                 f"({est.get('precision', 'float32')})")
    return [head, " " * (2 + width) + estimate.assumed_line(est).strip()]


def generate_lines(est: dict) -> str:
    """What ``dspx generate --cost-model`` prints on stderr beside the statistics."""
    from ..costmodel import estimate

    p, d = est["prefill"], est["decode"]
    return "\n".join([
        f"[ESTIMATE on {est['profile']} (a model of the board, not a measurement): prefill "
        f"{p['tok_per_s']:,.1f} tok/s ({p['tokens']} tokens per call), decode {d['tok_per_s']:,.1f} tok/s "
        f"(at position {d['position']}; {d['weight_bytes_per_token']:,.0f} weight bytes per token)]",
        "[" + estimate.assumed_line(est).strip() + "]"])
