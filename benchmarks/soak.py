"""Soak: one device's life under a long, steady load, with memory figures.

    .venv/bin/python benchmarks/soak.py            # 1,000,000 pings, 10,000 inferences, 1,000 load/unload cycles
    .venv/bin/python benchmarks/soak.py --pings 100000 --infers 1000 --cycles 100   # a quicker look

One device (`python -m dspx.device`, 256 MiB window and DDR pool, 1 core)
lives through three phases:

1. PINGs from one client;
2. inferences of the `multi_output` example module (1 input, 7 outputs);
3. load → infer → unload cycles of the `multi_input` example module
   (7 inputs: INFER_LARGE), each cycle checked against the baseline.

RSS is POOL_STATUS ``rss_bytes`` (front + cores), sampled through each
phase; growth is measured from the end of a warm-up (the first 5 % of the
phase) to the end.  Pass criteria: growth < 5 MB in phases 1 and 2, pools
(ddr_used, carveout_used, modules) back to baseline after every cycle, and
growth < 5 MB across the cycles too (reported).  Prints a table and writes
benchmarks/results/soak.json.  Exit status 1 when a criterion fails.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
import warnings

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "src"))

LIMIT = 5 << 20  # bytes of RSS growth allowed after warm-up
POOLS = ("ddr_used", "carveout_used", "modules")


def mb(n: int) -> str:
    return f"{n / (1 << 20):8.2f}"


def rss(c) -> int:
    return c.pools()["rss_bytes"]


def phase(name, n, body, observer, samples=40):
    """Run body(i) n times; sample RSS; return the phase's figures."""
    warm = max(1, n // 20)
    every = max(1, n // samples)
    series = []
    t0 = time.perf_counter()
    rss_start = rss(observer)
    rss_warm = None
    for i in range(n):
        body(i)
        if i + 1 == warm:
            rss_warm = rss(observer)
        if (i + 1) % every == 0:
            series.append((i + 1, rss(observer)))
            print(f"  {name:<12}{i + 1:>10,}  rss {mb(series[-1][1])} MB  {time.perf_counter() - t0:7.1f} s",
                  flush=True)
    elapsed = time.perf_counter() - t0
    rss_end = rss(observer)
    return {"count": n, "elapsed_s": round(elapsed, 2), "per_s": round(n / elapsed, 1),
            "rss_start": rss_start, "rss_after_warmup": rss_warm, "rss_end": rss_end,
            "rss_max": max(s for _, s in series) if series else rss_end,
            "growth_after_warmup": rss_end - rss_warm, "series": series}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--pings", type=int, default=1_000_000)
    ap.add_argument("--infers", type=int, default=10_000)
    ap.add_argument("--cycles", type=int, default=1_000)
    ap.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "results", "soak.json"))
    a = ap.parse_args()

    import numpy as np

    from dspx.abi import protocol as P
    from dspx.host.client import Client
    from tests.conftest import Device
    from tests.fuzz import compiled_example, device_footprint

    mo = (compiled_example("multi_output") / "model.so").read_bytes()
    mi = (compiled_example("multi_input") / "model.so").read_bytes()
    dev = Device("--carveout-size", "256M", "--ddr-pool-size", "256M")
    res = {"device": "1 core, 256 MiB window, 256 MiB DDR pool", "limit_bytes": LIMIT}
    ok = True
    try:
        observer = Client(dev.path, staging_size=0, printf_size=0, timeout=60)
        base = observer.pools()  # before the soak client exists
        c = Client(dev.path, staging_size=1 << 20, kv_size=1 << 16, timeout=60)
        res["baseline"] = {k: base[k] for k in POOLS + ("rss_bytes", "connections")}

        print(f"phase 1: {a.pings:,} pings")
        ping = P.Ping()

        def do_ping(i):
            c.request(ping)

        res["pings"] = phase("ping", a.pings, do_ping, observer)

        print(f"phase 2: {a.infers:,} inferences (multi_output)")
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            m = c.load_module(mo)
        x = np.random.default_rng(0).standard_normal((2, 32)).astype(np.float32)
        ref = [c.output_view(d).copy() for d in c.infer(m.handle, [x]).descs]

        def do_infer(i):
            r = c.infer(m.handle, [x])
            if i % 1000 == 0:  # still the same answer
                for d, want in zip(r.descs, ref):
                    assert np.array_equal(c.output_view(d), want)

        res["infers"] = phase("infer", a.infers, do_infer, observer)
        c.unload_module(m.handle)

        print(f"phase 3: {a.cycles:,} load/infer/unload cycles (multi_input)")
        before_cycles = observer.pools()
        xs = [np.ones(s, dt) for s, dt in [((1, 16), np.float32), ((1, 16), np.float32), ((4, 4), np.float32),
                                           ((2, 8), np.float32), ((16,), np.float32), ((1, 16), np.int64),
                                           ((1,), np.float16)]]
        mismatches = []

        def do_cycle(i):
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                mod = c.load_module(mi)
            c.infer(mod.handle, xs)
            c.unload_module(mod.handle)
            now = observer.pools()
            diff = {k: (before_cycles[k], now[k]) for k in POOLS if now[k] != before_cycles[k]}
            if diff and len(mismatches) < 10:
                mismatches.append((i, diff))

        res["cycles"] = phase("load/unload", a.cycles, do_cycle, observer)
        after = observer.pools()
        res["cycles"]["pools_before"] = {k: before_cycles[k] for k in POOLS}
        res["cycles"]["pools_after"] = {k: after[k] for k in POOLS}
        res["cycles"]["mismatches"] = mismatches
        res["cycles"]["ddr_peak"] = after["ddr_peak"]
        c.close()
        time.sleep(0.3)
        final = observer.pools()
        res["final"] = {k: final[k] for k in POOLS + ("rss_bytes", "connections")}
        res["footprint_end"] = device_footprint(dev.proc.pid)
        res["uptime_ms"] = observer.ping()["uptime_ms"]
        observer.close()
    finally:
        dev.stop()

    p, inf, cyc = res["pings"], res["infers"], res["cycles"]
    checks = {
        "ping RSS growth < 5 MB after warm-up": p["growth_after_warmup"] < LIMIT,
        "inference RSS growth < 5 MB after warm-up": inf["growth_after_warmup"] < LIMIT,
        "pools back to baseline after every cycle": not cyc["mismatches"] and cyc["pools_before"] == cyc["pools_after"],
        "load/unload RSS growth < 5 MB after warm-up": cyc["growth_after_warmup"] < LIMIT,
        "carveout back to baseline after the client closed":
            res["final"]["carveout_used"] == res["baseline"]["carveout_used"],
    }
    res["checks"] = checks
    ok = all(checks.values())
    res["ok"] = ok
    os.makedirs(os.path.dirname(a.out), exist_ok=True)
    with open(a.out, "w") as f:
        json.dump(res, f, indent=1)

    print("\nsoak: one device's life (RSS = POOL_STATUS rss_bytes, front + cores; MB = MiB)")
    print(f"  {'phase':<13}{'count':>11}{'time s':>9}{'per s':>10}{'start MB':>10}{'warm MB':>10}"
          f"{'end MB':>10}{'max MB':>10}{'growth MB':>11}")
    for name, r in (("ping", p), ("infer", inf), ("load/unload", cyc)):
        print(f"  {name:<13}{r['count']:>11,}{r['elapsed_s']:>9.1f}{r['per_s']:>10.1f}{mb(r['rss_start']):>10}"
              f"{mb(r['rss_after_warmup']):>10}{mb(r['rss_end']):>10}{mb(r['rss_max']):>10}"
              f"{mb(r['growth_after_warmup']):>11}")
    print(f"  pools before cycles {cyc['pools_before']}\n  pools after cycles  {cyc['pools_after']}"
          f"  (ddr peak {cyc['ddr_peak']})")
    for k, v in checks.items():
        print(f"  [{'ok' if v else 'FAIL'}] {k}")
    print("OK" if ok else "FAILED", "->", a.out)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
