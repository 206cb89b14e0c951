"""What the timing model costs in host time (issue 26, "benchmarks/cost_model.py").

1. Counting: the seed's softmax listing (examples/softmax_c, unmodified) at
   100,000 floats, direct and ping-pong, as a cost build counted under
   j6-vision against the plain build of the same listing, each in a child
   process of its own (the cost shim is per process), calls interleaved:
   median host ns per call and counted / plain (goal <= 1.5x).
2. Switch off against no switch: the firmware softmax (0x1402) RPC round trip
   from a client, on a private device started without DSPX_COST_MODEL and on
   one started with DSPX_COST_MODEL= (empty: the model off, the same code
   path), both running, calls interleaved: the median of the per-round ratios
   and a bootstrap 95% interval (goal: no measurable change), beside a
   control: a second device without the variable, what two devices of one
   kind differ by here, and (--baseline) a device of the tree before the
   timing model: no switch at all.

    python benchmarks/cost_model.py [--rounds 200] [--rpc-rounds 300] [--baseline REV]

Prints a table and writes benchmarks/results/cost_model.json.  The machine
may be shared: the load average is printed beside the figures.
"""
from __future__ import annotations

import argparse
import contextlib
import os
import random
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _cost_softmax import ROOT, Child, build  # noqa: E402
from _results import write_json  # noqa: E402

sys.path.insert(0, str(ROOT / "src"))
N = 100_000  # the seed's size
PATHS = {"direct": 0, "ping_pong": 1}
WARM_UP = 3
BASELINE = "ef19025^1"  # the tree before "Merge r-cost-py", the timing model's first merge


def interval(ratios: list[float], seed: int = 0, draws: int = 2000) -> tuple[float, float]:
    """A bootstrap 95% interval of the median of ``ratios``."""
    rng = random.Random(seed)
    meds = sorted(statistics.median(rng.choices(ratios, k=len(ratios))) for _ in range(draws))
    return meds[int(0.025 * draws)], meds[int(0.975 * draws) - 1]


def summary(a: list[int], b: list[int]) -> dict:
    """b against a, paired by round: medians (µs), the median per-round ratio b/a and its interval."""
    ratios = [y / x for x, y in zip(a, b)]
    lo, hi = interval(ratios)
    return {"a_median_us": statistics.median(a) / 1e3, "b_median_us": statistics.median(b) / 1e3,
            "ratio": statistics.median(ratios), "ratio_95": [lo, hi], "rounds": len(ratios)}


# ------------------------------------------------------------------ 1. counting's overhead

def counting(rounds: int, profile: str) -> dict:
    """Host ns per call of the plain build (plain shim) and the cost build (cost shim, counting)."""
    with tempfile.TemporaryDirectory(prefix="dspx-cost-bench-") as tmp:
        libs = {"plain": build(Path(tmp), cost=False), "cost": build(Path(tmp), cost=True)}
        with Child({"plain": libs["plain"]}, None) as plain, Child({"cost": libs["cost"]}, profile) as counted:
            kinds = {"plain": plain, "cost": counted}
            for kind, child in kinds.items():  # each path once checked, then warmed up
                for tcm in PATHS.values():
                    r = child.run(kind, N, tcm, check=True)
                    counted = bool((r["cost"] or {}).get("counted"))
                    if r["status"] != 0 or r["err"] > 1e-6 or counted != (kind == "cost"):
                        raise SystemExit(f"{kind} build, run_tcm_opt {tcm}: {r}")
            ns = {(k, p): [] for k in kinds for p in PATHS}
            for r in range(WARM_UP + rounds):
                for kind in (("plain", "cost") if r % 2 == 0 else ("cost", "plain")):  # alternate who goes first
                    for path, tcm in PATHS.items():
                        t = kinds[kind].run(kind, N, tcm)["host_ns"]
                        if r >= WARM_UP:
                            ns[(kind, path)].append(t)
    return {path: summary(ns[("plain", path)], ns[("cost", path)]) for path in PATHS}


# ------------------------------------------------------------------ 2. the switch off against no switch

@contextlib.contextmanager
def device_env(value: str | None, src: Path = ROOT / "src"):
    """A private device started in the block sees DSPX_COST_MODEL = ``value``
    (None: unset) and ``src`` (default: this tree's) first on its PYTHONPATH."""
    saved = {k: os.environ.get(k) for k in ("DSPX_COST_MODEL", "PYTHONPATH")}
    os.environ["PYTHONPATH"] = os.pathsep.join([str(src), saved["PYTHONPATH"] or ""])
    if value is None:
        os.environ.pop("DSPX_COST_MODEL", None)
    else:
        os.environ["DSPX_COST_MODEL"] = value
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


class Side:
    """A private device (its own, whatever listens on the default socket) and a task session on it."""

    def __init__(self, cost_model: str | None, src: Path = ROOT / "src"):
        import numpy as np

        from dspx.host.launcher import PrivateDevice
        from dspx.host.tasks import Tasks, softmax_param

        with device_env(cost_model, src):
            self.dev = PrivateDevice()
        self.tasks = Tasks(socket=self.dev.path, timeout=300)
        data = self.tasks.malloc(4 * N)
        data.view(np.float32)[:] = 1 + np.arange(N, dtype=np.float32) / np.float32(N)  # the seed's data
        self.params, self.out = {}, self.tasks.malloc(4 * N)
        for path, tcm in PATHS.items():
            self.params[path] = self.tasks.malloc(24)
            softmax_param(self.params[path], data, N, tiled=bool(tcm))

    def rpc_ns(self, path: str) -> int:
        from dspx.host.tasks import SOFTMAX_CMD

        t0 = time.perf_counter_ns()
        self.tasks.run(SOFTMAX_CMD, self.params[path], self.out)
        return time.perf_counter_ns() - t0

    def close(self) -> None:
        self.tasks.close()
        self.dev.stop()


def switch_off(rounds: int, baseline: Path | None) -> dict:
    """unset against empty; against a second unset device (the control: what
    two devices of one kind differ by on this machine); and, with
    ``baseline`` (the src of a tree before the timing model), against a
    device that has no switch at all."""
    sides = {"unset": Side(None), "empty": Side(""), "unset_2": Side(None)}
    if baseline is not None:
        sides["baseline"] = Side(None, baseline)
    names = list(sides)
    ns = {(s, p): [] for s in sides for p in PATHS}
    # the host library echoes each call's log line (the listing's DSP_LOGI) to stderr: not wanted 1800 times here
    with open(os.devnull, "w") as null, contextlib.redirect_stderr(null):
        try:
            for r in range(WARM_UP + rounds):
                k = r % len(names)
                for name in names[k:] + names[:k]:  # each device goes first in turn
                    for path in PATHS:
                        t = sides[name].rpc_ns(path)
                        if r >= WARM_UP:
                            ns[(name, path)].append(t)
        finally:
            for s in sides.values():
                s.close()
    return {other: {path: summary(ns[("unset", path)], ns[(other, path)]) for path in PATHS}
            for other in names[1:]}


def baseline_src(rev: str) -> Path:
    """``git archive REV src`` in a temporary folder (switch.py's way): the device code of that revision."""
    from switch import baseline_tree

    return Path(baseline_tree(rev))


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--profile", default="j6-vision")
    ap.add_argument("--rounds", type=int, default=200, help="interleaved rounds of the counting comparison")
    ap.add_argument("--rpc-rounds", type=int, default=300, help="interleaved rounds of the switch comparison")
    ap.add_argument("--baseline", default=BASELINE, help="also time a device of this revision, from before the "
                    f"timing model (default {BASELINE}: the tree before its first merge; '': none)")
    a = ap.parse_args(argv)
    load_before = os.getloadavg()
    count = counting(a.rounds, a.profile)
    base = baseline_src(a.baseline) if a.baseline else None
    try:
        switch = switch_off(a.rpc_rounds, base)
    finally:
        if base is not None:
            shutil.rmtree(base.parent, ignore_errors=True)
    load_after = os.getloadavg()

    print(f"host time, {N:,} floats, the seed's softmax; load average {load_before[0]:.2f} -> {load_after[0]:.2f} "
          f"on {os.cpu_count()} CPUs (shared machine)")
    print(f"\n1. counting ({a.profile}): the listing's cost build, counted, against its plain build "
          f"({a.rounds} interleaved rounds; goal <= 1.5x)")
    print(f"{'path':<10} {'plain µs':>10} {'counted µs':>11} {'counted/plain':>14} {'95%':>16}")
    for path, s in count.items():
        print(f"{path:<10} {s['a_median_us']:>10.0f} {s['b_median_us']:>11.0f} {s['ratio']:>14.3f} "
              f"{s['ratio_95'][0]:>7.3f}-{s['ratio_95'][1]:<7.3f}")
    print(f"\n2. switch off against no switch: firmware softmax RPC round trip, a device without DSPX_COST_MODEL "
          f"against one with DSPX_COST_MODEL= ({a.rpc_rounds} interleaved rounds; goal: no measurable change)")
    print(f"{'path':<10} {'unset µs':>10} {'other µs':>11} {'other/unset':>14} {'95%':>16}")
    labels = {"empty": "DSPX_COST_MODEL= (the switch off)", "unset_2": "control: a second device without it",
              "baseline": f"no switch at all: a device of {a.baseline}, before the timing model"}
    for other, label in labels.items():
        if other not in switch:
            continue
        print(f"  other = {label}")
        for path, s in switch[other].items():
            print(f"{path:<10} {s['a_median_us']:>10.0f} {s['b_median_us']:>11.0f} {s['ratio']:>14.3f} "
                  f"{s['ratio_95'][0]:>7.3f}-{s['ratio_95'][1]:<7.3f}")
    print("wrote", write_json("cost_model.json", {
        "benchmark": "cost_model", "n": N, "profile": a.profile, "cpu_count": os.cpu_count(),
        "loadavg_before": load_before, "loadavg_after": load_after,
        "counting": {"a": "plain build", "b": "cost build, counted", **count},
        "switch_off": {"a": "DSPX_COST_MODEL unset", "b": "DSPX_COST_MODEL empty", **switch["empty"]},
        "control": {"a": "DSPX_COST_MODEL unset", "b": "a second device, DSPX_COST_MODEL unset", **switch["unset_2"]},
        "baseline": {"a": "DSPX_COST_MODEL unset", "b": f"a device of {a.baseline}", "rev": a.baseline,
                     **switch["baseline"]} if "baseline" in switch else None}))


if __name__ == "__main__":
    main()
