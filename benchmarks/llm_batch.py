"""serve-llm's batched decode step, per module and number of rows, on SmolLM2
packages built for each CPU of --targets.

    .venv/bin/python benchmarks/llm_batch.py [--targets native,skylake-avx512] [--rounds 5] [--calls 10]

The default targets are this machine's CPU and, where it has AVX-512 VNNI,
the same vector width without it (skylake-avx512), so the int8 GEMVs' block
sums on vpdpbusd and in int16 are compared in one run (``int8_block_sum`` in
each package's metadata says which it has).  Each package is compiled once per
build digest into the dspx cache (``compiled_dir``), then loaded on a device
of its own.  A figure is the wall time of one device call: decode.so and
decode_parallel.so on one row, decode_batch.so and decode_batch_parallel.so on
1 to 4 rows (positions 40 of four slots; one row with the serial batch module is
decode.so, as decode_batch runs it), the median of --calls calls, then
the median over --rounds rounds that visit every package and module in turn.
Also prints, per package, 4 x the faster one-row decode / the faster 4-row step:
what 4 slots can give over one in device calls alone (benchmarks/llm_server.py
measures it through HTTP).  Prints a table and writes
benchmarks/results/llm_batch.json.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "src"))

from _results import write_json  # noqa: E402

POS = 40  # each row's position in its slot


def package(target: str):
    """A compiled SmolLM2 for ``target`` (the dspx cache: once per build digest and target)."""
    from dspx.compiler.llm import compiled_dir

    return compiled_dir(progress=True, target=target)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--targets", help="comma-separated --target names (default: native, and skylake-avx512 "
                                      "where this CPU has AVX-512 VNNI)")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--calls", type=int, default=10)
    a = ap.parse_args()
    from dspx import cpuinfo
    from dspx.compiler.llm import vnni_lanes
    from dspx.compiler.target import cpu_features, make_target
    from dspx.host.llm import DeviceLLM

    flags = sorted(cpuinfo.flags() or ())
    targets = a.targets.split(",") if a.targets else (
        ["native", "skylake-avx512"] if vnni_lanes(cpu_features(make_target("native")["mcpu"])) == 16 else ["native"])
    llms, info = {}, {}
    for t in targets:
        d = package(t)
        meta = json.loads((d / "metadata.json").read_text())
        llms[t] = DeviceLLM(d, progress=False)
        llms[t].set_slots(4)
        info[t] = {"mcpu": meta["compiler"]["target"]["mcpu"],
                   "int8_block_sum": meta["compiler"].get("int8_block_sum", "int16")}
    cases = [(t, "decode", kind, 1) for t in targets for kind in ("serial", "parallel")]
    cases += [(t, "batch", kind, n) for t in targets for kind in ("serial", "parallel") for n in (1, 2, 3, 4)]
    ms = {c: [] for c in cases}
    load = [os.getloadavg()[0]]
    try:
        for r in range(a.rounds):
            for c in cases:
                t, what, kind, n = c
                m = llms[t]
                if what == "decode":
                    m.use_decode(kind)
                    step = lambda: m.decode(1, POS)  # noqa: E731
                else:
                    m.use_batch(kind)
                    rows = [(s, 1, POS) for s in range(n)]
                    step = lambda: m.decode_batch(rows)  # noqa: E731
                step()  # warm-up, not counted
                calls = []
                for _ in range(a.calls):
                    t0 = time.perf_counter()
                    step()
                    calls.append((time.perf_counter() - t0) * 1e3)
                ms[c].append(statistics.median(calls))
            print(f"round {r + 1}/{a.rounds} done", flush=True)
    finally:
        for m in llms.values():
            m.close()
    load.append(os.getloadavg()[0])
    med = {c: statistics.median(v) for c, v in ms.items()}
    print(f"\none device call, ms (median of {a.calls} calls, median of {a.rounds} rounds); "
          f"CPU {cpuinfo.model_name()}, load {load[0]:.2f} -> {load[1]:.2f}")
    labels = {t: f"{t} ({info[t]['mcpu']}, {info[t]['int8_block_sum']})" for t in targets}
    wide = max(len(x) for x in labels.values())
    print(f"{'package':{wide}s} {'rows':>4s} {'batch serial':>13s} {'batch parallel':>15s} {'decode s / p':>14s}")
    for t in targets:
        for n in (1, 2, 3, 4):
            dec = (f"{med[t, 'decode', 'serial', 1]:.1f} / {med[t, 'decode', 'parallel', 1]:.1f}" if n == 1 else "")
            print(f"{labels[t] if n == 1 else '':{wide}s} {n:4d} {med[t, 'batch', 'serial', n]:13.1f} "
                  f"{med[t, 'batch', 'parallel', n]:15.1f} {dec:>14s}")
    ceiling = {}
    for t in targets:  # what 4 slots can give over one, in device calls alone: each as its load-time choice would run
        one = min(med[t, "decode", k, 1] for k in ("serial", "parallel"))
        four = min(med[t, "batch", k, 4] for k in ("serial", "parallel"))
        ceiling[t] = round(4 * one / four, 2)
        print(f"{labels[t]}: 4 rows per step on the faster batch module give {ceiling[t]:.2f}x the tokens of one "
              f"row on the faster decode module")
    if len(targets) > 1:
        a0, b0 = targets
        print(f"\n{a0} / {b0}, 4 rows: serial "
              f"{med[a0, 'batch', 'serial', 4] / med[b0, 'batch', 'serial', 4]:.2f}, parallel "
              f"{med[a0, 'batch', 'parallel', 4] / med[b0, 'batch', 'parallel', 4]:.2f}")
    result = {"cpu": cpuinfo.model_name(), "flags": flags, "load_avg": load, "rounds": a.rounds, "calls": a.calls,
              "packages": info, "four_slots_over_one": ceiling,
              "ms": [{"target": t, "module": w, "kind": k, "rows": n, "median_ms": round(med[t, w, k, n], 3),
                      "rounds_ms": [round(x, 3) for x in ms[t, w, k, n]]} for (t, w, k, n) in cases]}
    print(f"wrote {write_json('llm_batch.json', result)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
