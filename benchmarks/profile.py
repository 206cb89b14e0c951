"""What profiling and tracing cost, and what profiling off costs (nothing).

    python benchmarks/profile.py [--runs 30] [--plot]

For two compiled example modules — the tiny 2-output one (every operator a
TVM function; the per-call overhead shows) and ResNet-18 with firmware
kernels — on one device process, calls interleaved in small shuffled batches
so load spikes hit every candidate alike, medians of --runs calls:

- ``plain``:       INFER without PROFILE of a module loaded once and never
                   profiled (the baseline);
- ``plain-after``: INFER without PROFILE of a second load of the same module,
                   one that is profiled between its calls (its timed VM and
                   profiled plan exist): profiling off must cost nothing
                   (ratio 1.00 within noise);
- ``profiled``:    INFER with PROFILE of that second load (every call of the
                   entry timed, rows in printf).

Figures are device cycles (the entry call, 1 GHz nominal) and host wall time
per call.  Then, for the tiny module, the same plain call with DSPX_TRACE set
for host and device (``traced``), against an untraced device started alike.
Prints a table; writes benchmarks/results/profile.json; ``--plot`` also
writes benchmarks/results/profile-<module>.png (per-layer bars) and
profile-latency.png.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT / "benchmarks"))


def _modules() -> dict:
    """Compiled example modules, cached like the tests' (.cache/dspx/modules/<compiler digest>)."""
    import hashlib

    import tvm

    import dspx.compiler
    from dspx.compiler import examples
    from dspx.compiler.onnx import compile_onnx

    h = hashlib.sha256(tvm.__version__.encode())
    comp = Path(dspx.compiler.__file__).parent
    for f in [*sorted(comp.glob("*.py")), *sorted((comp.parent / "abi").glob("*.py"))]:
        h.update(f.read_bytes())
    cache = ROOT / ".cache" / "dspx"
    onnx = examples.build_all(cache / "onnx")
    out = {}
    for name, kernels in (("multi_output", False), ("resnet18", True)):
        d = cache / "modules" / h.hexdigest()[:16] / f"{name}{'-k' if kernels else ''}"
        if not (d / "metadata.json").exists():
            print(f"compiling {name} …", file=sys.stderr)
            compile_onnx(onnx[name], d, kernels=kernels, progress=False)
        out[name] = d
    return out


def _device(sock: str, env: dict) -> subprocess.Popen:
    from dspx.transport import is_listening
    p = subprocess.Popen([sys.executable, "-m", "dspx.device", "--socket", sock, "--quiet"], env=env)
    deadline = time.monotonic() + 60
    while not is_listening(sock):
        if p.poll() is not None or time.monotonic() > deadline:
            raise SystemExit("device did not start")
        time.sleep(0.02)
    return p


def _inputs(vm):
    import numpy as np
    return [np.random.default_rng(0).standard_normal(s["shape"]).astype(s["dtype"]) for s in vm.metadata["inputs"]]


def measure(directory: Path, sock: str, runs: int) -> tuple[dict, dict]:
    """{candidate: {"cycles": [...], "wall_s": [...]}}, and one profile (to_dict)."""
    from dspx.host.client import Client
    from dspx.host.profile import profile
    from dspx.host.vm import VirtualMachine

    c = Client(sock, timeout=120, staging_size=(directory / "model.so").stat().st_size + (1 << 20), kv_size=0)
    never = VirtualMachine(directory, client=c)  # never profiled
    vm = VirtualMachine(directory, client=c)     # profiled between its plain calls
    x = _inputs(vm)
    out = {k: {"cycles": [], "wall_s": []} for k in ("plain", "plain-after", "profiled")}

    def call(kind):
        t0 = time.perf_counter()
        if kind == "profiled":
            cyc = profile(vm, *x).entry_cycles
        else:
            cyc = c.infer((never if kind == "plain" else vm).module.handle, x).cycles
        out[kind]["wall_s"].append(time.perf_counter() - t0)
        out[kind]["cycles"].append(cyc)

    for _ in range(3):  # warm both plain plans and the timed VM
        c.infer(never.module.handle, x)
        c.infer(vm.module.handle, x)
        profile(vm, *x)
    for _ in range(max(1, runs // 5)):
        order = list(out)
        random.shuffle(order)
        for kind in order:
            for _ in range(5):
                call(kind)
        time.sleep(0.05)
    final = profile(vm, *x).to_dict()
    for m in (never, vm):
        m.close()
    c.close()
    return out, final


def measure_trace(directory: Path, runs: int) -> dict:
    """Plain calls of the module on an untraced device and on a traced one
    (host and device tracing), each in its own host process."""
    res = {}
    for kind in ("untraced", "traced"):
        with tempfile.TemporaryDirectory(prefix="dspx-bench-trace-") as d:
            sock = os.path.join(d, "s.sock")
            env = dict(os.environ)
            env.pop("DSPX_TRACE", None)
            if kind == "traced":
                env["DSPX_TRACE"] = os.path.join(d, "t.json")
            dev = _device(sock, env)
            try:
                code = (
                    "import json, sys, time\n"
                    "import numpy as np\n"
                    "from dspx.host.client import Client\n"
                    "from dspx.host.vm import VirtualMachine\n"
                    f"c = Client({sock!r}, timeout=60)\n"
                    f"vm = VirtualMachine({str(directory)!r}, client=c)\n"
                    "x = [np.ones(s['shape'], s['dtype']) for s in vm.metadata['inputs']]\n"
                    "for _ in range(5): c.infer(vm.module.handle, x)\n"
                    "w, cy = [], []\n"
                    f"for _ in range({runs}):\n"
                    "    t = time.perf_counter(); r = c.infer(vm.module.handle, x); w.append(time.perf_counter() - t)\n"
                    "    cy.append(r.cycles)\n"
                    "print(json.dumps({'wall_s': w, 'cycles': cy}))\n")
                r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=600)
                if r.returncode:
                    raise SystemExit(r.stderr)
                res[kind] = json.loads(r.stdout.strip().splitlines()[-1])
            finally:
                dev.terminate()
                dev.wait(10)
    return res


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", type=int, default=30)
    ap.add_argument("--plot", action="store_true", help="write PNGs next to the JSON (needs the plot extra)")
    a = ap.parse_args()
    mods = _modules()
    result = {"host": platform.node(), "load": os.getloadavg(), "runs": a.runs, "modules": {}}
    rows = []
    with tempfile.TemporaryDirectory(prefix="dspx-bench-profile-") as d:
        sock = os.path.join(d, "s.sock")
        env = dict(os.environ)
        env.pop("DSPX_TRACE", None)
        dev = _device(sock, env)
        try:
            for name, directory in mods.items():
                series, prof = measure(directory, sock, a.runs)
                result["modules"][name] = {"series": series, "profile": prof}
                base_c = statistics.median(series["plain"]["cycles"])
                base_w = statistics.median(series["plain"]["wall_s"])
                for kind, s in series.items():
                    mc, mw = statistics.median(s["cycles"]), statistics.median(s["wall_s"])
                    rows.append((name, kind, mc, mc / base_c, mw, mw / base_w, len(s["cycles"])))
        finally:
            dev.terminate()
            dev.wait(10)
    tr = measure_trace(mods["multi_output"], a.runs * 3)
    result["trace"] = tr
    base_c = statistics.median(tr["untraced"]["cycles"])
    base_w = statistics.median(tr["untraced"]["wall_s"])
    for kind in ("untraced", "traced"):
        mc, mw = statistics.median(tr[kind]["cycles"]), statistics.median(tr[kind]["wall_s"])
        rows.append(("multi_output", kind, mc, mc / base_c, mw, mw / base_w, len(tr[kind]["cycles"])))
    result["load_after"] = os.getloadavg()
    result["table"] = [dict(zip(("module", "candidate", "cycles_median", "cycles_ratio", "wall_median_s",
                                 "wall_ratio", "n"), r)) for r in rows]
    print(f"profiling cost — medians; load {result['load'][0]:.2f} → {result['load_after'][0]:.2f} "
          f"(1-min avg); ratios vs plain / untraced in the same run")
    print(f"{'module':<14} {'candidate':<12} {'device µs':>11} {'ratio':>6} {'host µs/call':>13} {'ratio':>6} {'n':>4}")
    for name, kind, mc, rc, mw, rw, n in rows:
        print(f"{name:<14} {kind:<12} {mc / 1e3:>11.1f} {rc:>6.2f} {mw * 1e6:>13.1f} {rw:>6.2f} {n:>4}")
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "profile.json").write_text(json.dumps(result, indent=1))
    print(f"wrote {RESULTS / 'profile.json'}")
    if a.plot:
        import plots
        for name, m in result["modules"].items():
            print(plots.profile_bars(m["profile"], RESULTS / f"profile-{name}.png",
                                     title=f"{name}: per-layer device time"))
        series = {f"{n} {k}": s["wall_s"] for n, m in result["modules"].items() for k, s in m["series"].items()}
        series.update({f"multi_output {k}": s["wall_s"] for k, s in tr.items()})
        print(plots.latency(series, RESULTS / "profile-latency.png", "host latency per INFER: plain, profiled, "
                            "after profiling, traced",
                            baseline=lambda n: n.split()[0] + (" untraced" if n.endswith("traced") else " plain")))


if __name__ == "__main__":
    main()
