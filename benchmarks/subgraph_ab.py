"""A/B of the subgraph kernel: in-process module ÷ onnxruntime, op by op vs one call.

    python benchmarks/subgraph_ab.py [--models resnet18,resnet50,shufflenet] [--runs 40] [--batch 2]
                                     [--threads 2] [--spin-ab]

For each model: the module compiled op by op (``DSPX_SUBGRAPH=0``: a kernel
call per conv/pool) and with its supported prefix in one ``onnx_subgraph``
call (the default), each loaded in-process in its own worker process
(benchmarks/infer.py's ``tvm`` worker), against onnxruntime's whole-graph
session in a third; calls interleaved in shuffled batches, paired per round.
``--spin-ab`` adds the subgraph module with its pool's spinning off
(``DSPX_SUBGRAPH_SPIN=0``).  ``--cpu1`` also measures CPU time per call at 1
thread, all three in this one process, interleaved: the figure the machine's
load distorts least (no pool to wake, no spinning).  Prints a table; writes
JSON to benchmarks/results/subgraph-<timestamp>.json.
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


def cpu_one_thread(opbyop, sub, src, runs: int) -> tuple[dict, dict]:
    """Median CPU time per call at 1 thread of both modules and onnxruntime in a
    subprocess of their own (one process, kernels at 1 thread), interleaved."""
    import subprocess

    code = f"""
import json, statistics, time
import onnxruntime as ort
from dspx.compiler.examples import random_inputs
from dspx.device.core import kernels, loader
from pathlib import Path
kernels.configure_threads(1)
kernels.register_all()
calls = {{}}
for k, d in (("opbyop", {str(opbyop)!r}), ("subgraph", {str(sub)!r})):
    meta = json.loads((Path(d) / "metadata.json").read_text())
    mod = loader.load_module((Path(d) / "model.so").read_bytes(), kernels.names())
    args = [loader.as_tensor(x)[0] for x in random_inputs(meta)]
    calls[k] = (lambda f=mod._func, a=args: f(*a))
    calls[k + "_mod"] = mod
so = ort.SessionOptions()
so.intra_op_num_threads, so.inter_op_num_threads, so.log_severity_level = 1, 1, 3
sess = ort.InferenceSession({str(src)!r}, so, providers=["CPUExecutionProvider"])
feed = {{i.name: x for i, x in zip(sess.get_inputs(), random_inputs(meta))}}
calls["ort"] = lambda: sess.run(None, feed)
keys = ["opbyop", "subgraph", "ort"]
for k in keys:
    calls[k]()
times = {{k: [] for k in keys}}
rounds = []
for r in range({runs}):
    this = {{}}
    for k in (keys if r % 2 else keys[::-1]):
        t0 = time.process_time()
        calls[k]()
        this[k] = time.process_time() - t0
        times[k].append(this[k])
    rounds.append(this)
med = {{k: statistics.median(v) * 1e3 for k, v in times.items()}}
vs = {{k: statistics.median(r[k] / r["ort"] for r in rounds) for k in ("opbyop", "subgraph")}}
print(json.dumps([med, vs]))
"""
    env = {**infer._threads_env(1), "DSPX_SUBGRAPH_SPIN": "0"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True)
    med, vs = json.loads(out.stdout.strip().splitlines()[-1])
    return med, vs


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--models", default="resnet18,resnet50,shufflenet")
    ap.add_argument("--runs", type=int, default=40)
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--spin-ab", action="store_true", help="also the subgraph module with DSPX_SUBGRAPH_SPIN=0")
    ap.add_argument("--cpu1", action="store_true", help="also CPU time per call at 1 thread, in one process")
    ap.add_argument("--env-ab", action="append", default=[], metavar="NAME=VALUE",
                    help="also the subgraph module with this environment (NAME=VALUE[,NAME=VALUE...], e.g. "
                         "DSPX_SUBGRAPH_BLOCK_BASE=4); repeatable")
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
        for kv in a.env_ab:  # NAME=VALUE[,NAME=VALUE...]
            env = dict(pair.partition("=")[::2] for pair in kv.split(","))
            workers[f"subgraph {kv}"] = infer.Worker("tvm", builds["subgraph"][0], a.threads, env)
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
        if a.cpu1:
            entry["cpu1_ms"], entry["cpu1_vs_ort"] = cpu_one_thread(builds["opbyop"][0], builds["subgraph"][0],
                                                                    src, a.runs)
        report["models"][m] = entry
    report["loadavg_end"] = os.getloadavg()
    infer.RESULTS.mkdir(parents=True, exist_ok=True)
    path = infer.RESULTS / f"subgraph-{time.strftime('%Y%m%d-%H%M%S', time.gmtime())}.json"
    path.write_text(json.dumps(report, indent=2))
    print(f"\nin-process module vs onnxruntime whole graph, {a.threads} threads, {a.runs} calls each, interleaved "
          f"(load avg {report['loadavg_start'][0]:.2f} -> {report['loadavg_end'][0]:.2f})")
    print(f"{'model':12} {'candidate':36} {'median':>9} {'p10':>9} {'paired ÷ ORT':>13} {'max|diff|':>10}")
    for m, e in report["models"].items():
        for k, med in e["median_ms"].items():
            pv = e["paired_vs_ort"].get(k)
            diff = e["max_abs_diff_vs_ort"].get(k)
            print(f"{m:12} {k:36} {med:7.2f}ms {e['p10_ms'][k]:7.2f}ms "
                  f"{'' if pv is None else f'{pv:13.3f}':>13} {'' if diff is None else f'{diff:10.2e}':>10}")
        print(f"{m:12} {'subgraph ÷ op-by-op (paired)':30} {e['paired_subgraph_vs_opbyop']:.3f}; compile wall "
              + ", ".join(f"{k} {v['wall_s']:.1f} s" for k, v in e["compile"].items()))
        if "cpu1_ms" in e:
            print(f"{m:12} CPU per call at 1 thread (medians): " + ", ".join(
                f"{k} {v:.2f} ms" + (f" ({e['cpu1_vs_ort'][k]:.3f} ÷ ORT, paired)" if k in e["cpu1_vs_ort"] else "")
                for k, v in e["cpu1_ms"].items()))
    print(f"JSON: {path.relative_to(infer.ROOT)}")


if __name__ == "__main__":
    main()
