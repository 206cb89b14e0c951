"""What holding one connection's buffers per core costs (issue 15, 7b).

    .venv/bin/python benchmarks/switch.py                      # baseline: the tree before the change
    .venv/bin/python benchmarks/switch.py --baseline REV --rounds 20 --calls 200

A core maps only the buffers of the connection it serves: a job of another
connection makes it unmap them all and drop their plans, and the front sends
the new owner's fds again.  This measures that, side by side in one run:
two devices (1 core each), one running this tree and one the baseline
revision (``git archive REV src``, put first on the device's PYTHONPATH),
each with two clients A and B of 8 buffers + staging each, and per device:

* INFER of the ``multi_output`` example (a 256-byte input: PING-sized work);
* a no-op RPC (an op library op that returns 0);

each as A, A, A … (same connection: the path that must stay as fast) and
A, B, A, B … (every call switches owner).  Rounds alternate the devices
so machine noise falls on both alike.  Prints median µs per call and the
ratios; writes benchmarks/results/switch.json.  The machine is shared:
figures are taken with ``uptime``'s load printed beside them.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import warnings

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "src"))
sys.path.insert(0, os.path.join(ROOT, "tests"))

NOOP = """
from dspx.device.core import runtime as rt

@rt.register_op(0x3E01)
def noop(inp, out, tm):
    return 0
"""
NOOP_CMD = 0x3E01
EXTRA_BUFS = 8


def baseline_tree(rev: str) -> str:
    d = tempfile.mkdtemp(prefix="dspx-switch-base-")
    archive = subprocess.run(["git", "-C", ROOT, "archive", rev, "src"], check=True, capture_output=True).stdout
    subprocess.run(["tar", "-x", "-C", d], input=archive, check=True)
    return os.path.join(d, "src")


def start_device(pythonpath: str | None):
    from conftest import Device
    old = os.environ.get("PYTHONPATH")
    if pythonpath:
        os.environ["PYTHONPATH"] = pythonpath
    try:
        return Device("--carveout-size", "128M", "--ddr-pool-size", "64M", "--cores", "1")
    finally:
        if old is None:
            os.environ.pop("PYTHONPATH", None)
        else:
            os.environ["PYTHONPATH"] = old


class Side:
    """One device, two clients with a module, buffers and a no-op op each."""

    def __init__(self, name: str, dev, module: bytes):
        import numpy as np
        from dspx.host.client import Client
        from dspx.host.tasks import Tasks

        self.name, self.dev = name, dev
        self.clients = [Client(dev.path, staging_size=1 << 20, timeout=300) for _ in range(2)]  # first load imports TVM
        self.tasks = [Tasks(c) for c in self.clients]
        self.lib, _ = self.tasks[0].load_ops(NOOP)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            self.mods = [c.load_module(module) for c in self.clients]
        self.mems = [[t.malloc(4096) for _ in range(EXTRA_BUFS)] for t in self.tasks]
        self.x = np.random.default_rng(0).standard_normal((2, 32)).astype(np.float32)

    def infer(self, i: int) -> None:
        self.clients[i].infer(self.mods[i].handle, [self.x])

    def rpc(self, i: int) -> None:
        t, m = self.tasks[i], self.mems[i]
        t.run(NOOP_CMD, m[0], m[1], core=0)

    def close(self) -> None:
        for c in self.clients:
            c.close()
        self.dev.stop()


def timed(call, order, n: int) -> list[int]:
    out = []
    for k in range(n):
        t0 = time.perf_counter_ns()
        call(order[k % len(order)])
        out.append(time.perf_counter_ns() - t0)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--baseline", default="04a7f56~1", help="git revision to compare against (default: the tree before the change)")
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--calls", type=int, default=200, help="calls per pattern per round")
    ap.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "results", "switch.json"))
    a = ap.parse_args()

    from tests.fuzz import compiled_example

    module = (compiled_example("multi_output") / "model.so").read_bytes()
    sides = [Side("this tree", start_device(None), module),
             Side(f"baseline {a.baseline}", start_device(baseline_tree(a.baseline)), module)]
    patterns = {"same connection": [0], "alternating": [0, 1]}
    samples = {(s.name, kind, p): [] for s in sides for kind in ("infer", "rpc") for p in patterns}
    load_before = os.getloadavg()
    try:
        for s in sides:  # warm-up: plans, kernel sessions, both owners
            for kind in ("infer", "rpc"):
                timed(getattr(s, kind), [0, 1], 50)
        for r in range(a.rounds):
            for s in (sides if r % 2 == 0 else sides[::-1]):
                for kind in ("infer", "rpc"):
                    for p, order in patterns.items():
                        samples[(s.name, kind, p)] += timed(getattr(s, kind), order, a.calls)
            print(f"  round {r + 1}/{a.rounds}", flush=True)
    finally:
        for s in sides:
            s.close()
    load_after = os.getloadavg()

    med = {k: statistics.median(v) / 1000 for k, v in samples.items()}
    new, base = sides[0].name, sides[1].name
    rows = []
    print(f"\nmedian µs per call, {a.rounds} × {a.calls} calls per cell, 1 core, {EXTRA_BUFS} buffers + staging "
          f"per connection; load {load_before[0]:.1f} → {load_after[0]:.1f} (shared machine)")
    print(f"{'call':<6}{'pattern':<17}{base:>22}{new:>12}{'new/base':>10}")
    for kind in ("infer", "rpc"):
        for p in patterns:
            b, n = med[(base, kind, p)], med[(new, kind, p)]
            rows.append({"call": kind, "pattern": p, "baseline_us": round(b, 1), "new_us": round(n, 1),
                         "ratio": round(n / b, 3)})
            print(f"{kind:<6}{p:<17}{b:>22.1f}{n:>12.1f}{n / b:>10.2f}")
    os.makedirs(os.path.dirname(a.out), exist_ok=True)
    with open(a.out, "w") as f:
        json.dump({"baseline": a.baseline, "rounds": a.rounds, "calls": a.calls, "extra_buffers": EXTRA_BUFS,
                   "loadavg_before": load_before, "loadavg_after": load_after, "rows": rows}, f, indent=1)
    print(f"wrote {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
