"""A/B of the subgraph kernel: in-process module ÷ onnxruntime, op by op vs one call.

    python benchmarks/subgraph_ab.py [--models resnet18,resnet50,shufflenet] [--runs 40] [--batch 2]
                                     [--threads 2] [--spin-ab]

For each model: the module compiled op by op (``DSPX_SUBGRAPH=0``: a kernel
call per conv/pool) and with its supported prefix in one ``onnx_subgraph``
call (the default), each loaded in-process in its own worker process
(benchmarks/infer.py's ``tvm`` worker), against onnxruntime's whole-graph
session in a third; calls interleaved in shuffled batches, paired per round.
``--spin-ab`` adds the subgraph module with its pool's spinning off
(``DSPX_SUBGRAPH_SPIN=0``).  Prints a table; writes JSON to
benchmarks/results/subgraph-<timestamp>.json.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import infer  # noqa: E402  (its workers, compile and interleaving)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--models", default="resnet18,resnet50,shufflenet")
    ap.add_argument("--runs", type=int, default=40)
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--spin-ab", action="store_true", help="also the subgraph module with DSPX_SUBGRAPH_SPIN=0")
    a = ap.parse_args(argv)
    import numpy as np

    from dspx.compiler import examples

    onnx = examples.build_all(infer.BUILD / "onnx")
    report = {"date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "threads": a.threads, "runs": a.runs,
              "loadavg_start": os.getloadavg(), "models": {}}
    for m in [s.strip() for s in a.models.split(",") if s.strip()]:
        src = onnx["resnet18"] if m == "resnet18" else examples.light(m, infer.BUILD / "onnx" / f"light-{m}.onnx")
        builds = {"opbyop": (infer.BUILD / f"{m}-k-opbyop", {"DSPX_SUBGRAPH": "0"}),
                  "subgraph": (infer.BUILD / f"{m}-k-subgraph", {"DSPX_SUBGRAPH": "1"})}
        entry = {"compile": {}}
        for k, (out, env) in builds.items():
            print(f"compiling {m} ({k}) ...", file=sys.stderr)
            entry["compile"][k] = infer.compile_module(src, out, True, a.threads, extra_env=env)
        workers = {"opbyop": infer.Worker("tvm", builds["opbyop"][0], a.threads),
                   "subgraph": infer.Worker("tvm", builds["subgraph"][0], a.threads),
                   "ort": infer.Worker("ort", src, a.threads)}
        if a.spin_ab:
            workers["subgraph_nospin"] = infer.Worker("tvm", builds["subgraph"][0], a.threads,
                                                      {"DSPX_SUBGRAPH_SPIN": "0"})
        try:
            ref = np.array(workers["ort"].out)
            entry["max_abs_diff_vs_ort"] = {k: float(np.max(np.abs(np.array(w.out) - ref)))
                                            for k, w in workers.items() if k != "ort"}
            times, per_round = infer.interleave({k: w.run for k, w in workers.items()}, a.runs, a.batch)
        finally:
            for w in workers.values():
                w.close()
        entry["median_ms"] = {k: statistics.median(v) * 1e3 for k, v in times.items()}
        entry["p10_ms"] = {k: sorted(v)[len(v) // 10] * 1e3 for k, v in times.items()}
        entry["paired_vs_ort"] = {k: infer.paired(per_round, k, "ort") for k in times if k != "ort"}
        entry["paired_subgraph_vs_opbyop"] = infer.paired(per_round, "subgraph", "opbyop")
        report["models"][m] = entry
    report["loadavg_end"] = os.getloadavg()
    infer.RESULTS.mkdir(parents=True, exist_ok=True)
    path = infer.RESULTS / f"subgraph-{time.strftime('%Y%m%d-%H%M%S', time.gmtime())}.json"
    path.write_text(json.dumps(report, indent=2))
    print(f"\nin-process module vs onnxruntime whole graph, {a.threads} threads, {a.runs} calls each, interleaved "
          f"(load avg {report['loadavg_start'][0]:.2f} -> {report['loadavg_end'][0]:.2f})")
    print(f"{'model':12} {'candidate':16} {'median':>9} {'p10':>9} {'paired ÷ ORT':>13} {'max|diff|':>10}")
    for m, e in report["models"].items():
        for k, med in e["median_ms"].items():
            pv = e["paired_vs_ort"].get(k)
            diff = e["max_abs_diff_vs_ort"].get(k)
            print(f"{m:12} {k:16} {med:7.2f}ms {e['p10_ms'][k]:7.2f}ms "
                  f"{'' if pv is None else f'{pv:13.3f}':>13} {'' if diff is None else f'{diff:10.2e}':>10}")
        print(f"{m:12} {'subgraph ÷ op-by-op (paired)':30} {e['paired_subgraph_vs_opbyop']:.3f}; compile wall "
              + ", ".join(f"{k} {v['wall_s']:.1f} s" for k, v in e["compile"].items()))
    print(f"JSON: {path.relative_to(infer.ROOT)}")


if __name__ == "__main__":
    main()
