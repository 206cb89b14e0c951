"""Where a compiled model's time goes: per kernel type in the dspx module vs per
operator type in onnxruntime's whole-graph run of the same ONNX file.

    python benchmarks/layers.py [--models resnet18,resnet50,shufflenet] [--runs 20] [--threads 2] [--subgraph]

For each model: the module (compiled with kernels, cached under
benchmarks/results/build) is loaded in-process with the device's loader; every
firmware kernel is wrapped with a timer, so a call splits into kernel time per
kernel name and the rest (generated glue + the VM).  onnxruntime runs the same
ONNX file whole-graph with profiling on (same thread count), split per
operator type.  Both in this one process, runs interleaved.  Prints a table and
writes JSON to benchmarks/results/layers-<timestamp>.json.
"""
from __future__ import annotations

import argparse
import collections
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
BUILD = RESULTS / "build"


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--models", default="resnet18,resnet50,shufflenet")
    ap.add_argument("--runs", type=int, default=20)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--subgraph", action="store_true",
                    help="modules with their supported prefix in one onnx_subgraph call (DSPX_SUBGRAPH=1)")
    a = ap.parse_args(argv)
    for var in ("OMP_NUM_THREADS", "TVM_NUM_THREADS", "OPENBLAS_NUM_THREADS"):
        os.environ[var] = str(a.threads)
    sys.path.insert(0, str(ROOT / "src"))
    import numpy as np
    import onnxruntime as ort
    import tvm_ffi

    from dspx.compiler import examples
    from dspx.compiler.onnx import compile_onnx
    from dspx.device.core import kernels, loader

    kernels.configure_threads(a.threads)
    spent: dict[str, float] = collections.defaultdict(float)
    for spec in kernels.KERNELS.values():
        def timed(*args, _fn=spec.fn, _name=spec.name[len("dspx.kernels."):]):
            t0 = time.perf_counter()
            try:
                return _fn(*args)
            finally:
                spent[_name] += time.perf_counter() - t0
        tvm_ffi.register_global_func(spec.name, timed, override=True)

    report = {"date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "threads": a.threads,
              "runs": a.runs, "loadavg_start": os.getloadavg(), "models": {}}
    for name in [m.strip() for m in a.models.split(",") if m.strip()]:
        src = (examples.build_all(BUILD / "onnx")["resnet18"] if name == "resnet18"
               else examples.light(name, BUILD / "onnx" / f"light-{name}.onnx"))
        out = BUILD / f"{name}-k{'-sg' if a.subgraph else ''}"
        if not (out / "metadata.json").is_file():
            compile_onnx(src, out, progress=False, subgraph=a.subgraph)
        meta = json.loads((out / "metadata.json").read_text())
        mod = loader.load_module((out / "model.so").read_bytes(), kernels.names())
        x = examples.random_inputs(meta)[0]
        args = [loader.as_tensor(x)[0]]
        so = ort.SessionOptions()
        so.intra_op_num_threads, so.inter_op_num_threads = a.threads, 1
        so.log_severity_level = 3
        so.enable_profiling = True
        so.profile_file_prefix = os.path.join(tempfile.mkdtemp(), "ort")
        sess = ort.InferenceSession(str(src), so, providers=["CPUExecutionProvider"])
        feed = {sess.get_inputs()[0].name: x}
        mod._func(*args)
        sess.run(None, feed)  # warm both
        spent.clear()
        t_dspx, t_ort = [], []
        for _ in range(a.runs):
            t0 = time.perf_counter()
            mod._func(*args)
            t_dspx.append(time.perf_counter() - t0)
            time.sleep(0.02)
            t0 = time.perf_counter()
            sess.run(None, feed)
            t_ort.append(time.perf_counter() - t0)
            time.sleep(0.02)
        prof = json.loads(Path(sess.end_profiling()).read_text())
        per_op: dict[str, float] = collections.defaultdict(float)
        for ev in prof:
            if ev.get("cat") == "Node" and ev["name"].endswith("_kernel_time"):
                per_op[ev["args"]["op_name"]] += ev["dur"] / 1e6
        # profiling covers the warm-up run too: scale to one call
        n_ort = a.runs + 1
        total_kernels = sum(spent.values()) / a.runs
        entry = {
            "dspx_median_ms": statistics.median(t_dspx) * 1e3, "ort_median_ms": statistics.median(t_ort) * 1e3,
            "ratio": statistics.median(t_dspx) / statistics.median(t_ort),
            "dspx_kernels_ms": {k: v / a.runs * 1e3 for k, v in sorted(spent.items(), key=lambda kv: -kv[1])},
            "dspx_glue_ms": (statistics.mean(t_dspx) - total_kernels) * 1e3,
            "ort_ops_ms": {k: v / n_ort * 1e3 for k, v in sorted(per_op.items(), key=lambda kv: -kv[1])},
        }
        report["models"][name] = entry
        mod.unload()
        kernels.clear_caches()
        print(f"\n{name}: dspx in-process {entry['dspx_median_ms']:.2f} ms, onnxruntime whole graph "
              f"{entry['ort_median_ms']:.2f} ms (ratio {entry['ratio']:.2f}; medians, interleaved)")
        print("  dspx kernels (mean ms per call): " + ", ".join(f"{k} {v:.2f}" for k, v in
                                                                entry["dspx_kernels_ms"].items())
              + f"; glue + VM {entry['dspx_glue_ms']:.2f}")
        print("  onnxruntime ops (mean ms per call): " + ", ".join(f"{k} {v:.2f}" for k, v in
                                                                   list(entry["ort_ops_ms"].items())[:8]))
    report["loadavg_end"] = os.getloadavg()
    RESULTS.mkdir(parents=True, exist_ok=True)
    path = RESULTS / f"layers-{time.strftime('%Y%m%d-%H%M%S', time.gmtime())}.json"
    path.write_text(json.dumps(report, indent=2))
    print(f"\nload avg {report['loadavg_start'][0]:.2f} -> {report['loadavg_end'][0]:.2f}; JSON: "
          f"{path.relative_to(ROOT)}")


if __name__ == "__main__":
    main()
