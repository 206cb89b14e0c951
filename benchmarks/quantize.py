"""int8 post-training quantization: speed and accuracy against onnxruntime's own.

    python benchmarks/quantize.py [--models resnet18,resnet50] [--samples 32] [--runs 24] [--threads 2]

For each model (ResNet-18 from dspx.compiler.examples; the onnx wheel's light
ResNet-50, re-weighted at random, examples.light) and one calibration set
(--samples standard-normal inputs, fixed seed: the models have random weights,
so there is no real data set to draw from):

- ``dev_f32``:  ``dspx compile`` (float32) run through a device (vm["main"]);
- ``dev_int8``: ``dspx compile --quantize int8 --calibrate`` through the same device;
- ``ort_f32``:  onnxruntime on the ONNX file (worker process, same threads);
- ``ort_int8``: onnxruntime on its own ``quantize_static`` model of the same
  file (``quant_pre_process`` first, QDQ, U8S8, per channel, MinMax on the
  same samples, every operator it can quantize).

Latency: calls interleaved in shuffled rounds (benchmarks/infer.py's method),
medians and paired per-round ratios.  Accuracy: every calibration sample
through all four; top-1 agreement with onnxruntime float32, max and mean abs
error of the logits.  Prints a table; writes
benchmarks/results/quantize-<timestamp>.json.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT / "benchmarks"))
from infer import (BUILD, RESULTS, DevicePaths, Worker, _threads_env, interleave, paired,  # noqa: E402
                   summarize)


def compile_module(onnx_path: Path, out: Path, threads: int, calibrate: Path | None, reuse: bool = False) -> dict:
    if reuse and (out / "compile.json").exists():
        return json.loads((out / "compile.json").read_text())
    cmd = [sys.executable, "-m", "dspx.cli", "compile", str(onnx_path), "-o", str(out), "--json"]
    if calibrate is not None:
        cmd += ["--quantize", "int8", "--calibrate", str(calibrate)]
    t0 = time.perf_counter()
    p = subprocess.run(cmd, capture_output=True, text=True, env=_threads_env(threads))
    if p.returncode:
        raise SystemExit(f"compile failed: {p.stdout}\n{p.stderr}")
    meta = json.loads(p.stdout.strip().splitlines()[-1])
    res = {"wall_s": time.perf_counter() - t0, "stages_s": meta.get("timings", {}),
           "quantize": meta.get("quantize"), "verify": meta.get("verify")}
    (out / "compile.json").write_text(json.dumps(res))
    return res


def _initializers_not_inputs(m) -> None:
    """From IR 4 on, an initializer listed as a graph input is an overridable
    default, not a constant: onnxruntime would not fold BatchNorm into it."""
    names = {i.name for i in m.graph.initializer}
    keep = [i for i in m.graph.input if i.name not in names]
    del m.graph.input[:]
    m.graph.input.extend(keep)


def ort_int8(onnx_path: Path, out: Path, samples) -> Path:
    """onnxruntime's own static quantization of the model file."""
    import logging

    import onnx
    import onnx.version_converter
    from onnxruntime.quantization import CalibrationMethod, QuantFormat, QuantType, quantize_static
    from onnxruntime.quantization.shape_inference import quant_pre_process

    class Reader:
        def __init__(self):
            self.it = iter(samples)

        def get_next(self):
            return next(self.it, None)

    logging.getLogger().setLevel(logging.ERROR)
    pre = out.with_suffix(".pre.onnx")
    m = onnx.load(str(onnx_path))
    if next(o.version for o in m.opset_import if o.domain in ("", "ai.onnx")) < 13:
        # old graphs (the light models: IR 3, opset 9, initializers not listed as inputs):
        # per-channel DequantizeLinear needs opset 13, quantize_static upgrades to 11 only
        m.ir_version = max(m.ir_version, 4)
        _initializers_not_inputs(m)
        m = onnx.version_converter.convert_version(m, 13)
    onnx.save(m, str(pre))
    quant_pre_process(str(pre), str(pre))
    quantize_static(str(pre), str(out), Reader(), quant_format=QuantFormat.QDQ, per_channel=True,
                    activation_type=QuantType.QUInt8, weight_type=QuantType.QInt8,
                    calibrate_method=CalibrationMethod.MinMax)
    return out


def accuracy(outs: dict, ref: str) -> dict:
    import numpy as np

    r = np.stack(outs[ref]).reshape(len(outs[ref]), -1)
    res = {}
    for k, v in outs.items():
        if k == ref:
            continue
        g = np.stack(v).reshape(len(v), -1)
        err = np.abs(g.astype(np.float64) - r)
        res[k] = {"top1_vs_" + ref: float(np.mean(g.argmax(-1) == r.argmax(-1))), "max_abs": float(err.max()),
                  "mean_abs": float(err.mean()), "max_abs_rel": float(err.max() / np.abs(r).max())}
    return res


def bench(name: str, onnx_path: Path, sock: str, a) -> dict:
    import numpy as np
    import onnxruntime as ort

    sess = ort.InferenceSession(str(onnx_path), providers=["CPUExecutionProvider"])
    inp = sess.get_inputs()[0]
    rng = np.random.default_rng(20261201)
    samples = rng.standard_normal((a.samples, *inp.shape)).astype(np.float32)
    build = BUILD / "quantize" / name
    build.mkdir(parents=True, exist_ok=True)
    npz = build / "calib.npz"
    np.savez(npz, **{inp.name: samples})
    print(f"{name}: compiling float32 and int8 ...", file=sys.stderr)
    comp = {"dev_f32": compile_module(onnx_path, build / "f32", a.threads, None, a.reuse_builds),
            "dev_int8": compile_module(onnx_path, build / "int8", a.threads, npz, a.reuse_builds)}
    q_path = ort_int8(onnx_path, build / "ort-int8.onnx", [{inp.name: s} for s in samples])

    staging = max((build / d / "model.so").stat().st_size for d in ("f32", "int8")) + (1 << 20)
    devs = {k: DevicePaths(sock, build / k[4:], staging) for k in ("dev_f32", "dev_int8")}
    workers = {"ort_f32": Worker("ort", onnx_path, a.threads), "ort_int8": Worker("ort", q_path, a.threads)}
    try:
        print(f"{name}: accuracy on {a.samples} samples ...", file=sys.stderr)
        so = ort.SessionOptions()
        so.intra_op_num_threads = a.threads
        sessions = {"ort_f32": sess, "ort_int8": ort.InferenceSession(str(q_path), so,
                                                                     providers=["CPUExecutionProvider"])}
        outs = {k: [] for k in ("ort_f32", "ort_int8", "dev_f32", "dev_int8")}
        for x in samples:
            for k, s in sessions.items():
                outs[k].append(s.run(None, {inp.name: x})[0])
            for k, d in devs.items():
                o = d.vm["main"](x)
                outs[k].append(np.array(o[0] if isinstance(o, list) else o))
        acc = accuracy(outs, "ort_f32")
        print(f"{name}: latency, {a.runs} calls each, interleaved ...", file=sys.stderr)
        cands = {"dev_f32": lambda n: devs["dev_f32"].run("vm", n), "dev_int8": lambda n: devs["dev_int8"].run("vm", n),
                 **{k: w.run for k, w in workers.items()}}
        times, rounds = interleave(cands, a.runs, a.batch)
    finally:
        for d in devs.values():
            d.close()
        for w in workers.values():
            w.close()
    lat = {k: summarize(v) for k, v in times.items()}
    ratios = {"dev_int8/dev_f32": paired(rounds, "dev_int8", "dev_f32"),
              "ort_int8/ort_f32": paired(rounds, "ort_int8", "ort_f32"),
              "dev_int8/ort_int8": paired(rounds, "dev_int8", "ort_int8"),
              "dev_f32/ort_f32": paired(rounds, "dev_f32", "ort_f32"),
              "dev_int8/ort_f32": paired(rounds, "dev_int8", "ort_f32")}
    return {"compile": comp, "latency": lat, "ratios_paired": ratios, "accuracy": acc, "samples": a.samples}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--models", default="resnet18,resnet50")
    ap.add_argument("--samples", type=int, default=32, help="calibration (and accuracy) samples")
    ap.add_argument("--runs", type=int, default=24)
    ap.add_argument("--batch", type=int, default=2, help="calls per candidate per interleaving round")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--reuse-builds", action="store_true",
                    help="keep modules compiled by an earlier run (same samples; not after compiler changes)")
    a = ap.parse_args(argv)
    os.environ.update(_threads_env(a.threads))
    from dspx.compiler import examples
    from dspx.host.launcher import PrivateDevice

    onnx_dir = BUILD / "onnx"
    paths = {}
    for m in [m.strip() for m in a.models.split(",") if m.strip()]:
        paths[m] = examples.resnet18(onnx_dir / "resnet18.onnx") if m == "resnet18" else \
            examples.light(m, onnx_dir / f"light-{m}.onnx")
    report = {"date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "host": platform.node(),
              "cpus": os.cpu_count(), "threads": a.threads, "runs": a.runs, "loadavg_start": os.getloadavg(),
              "command": " ".join([Path(sys.argv[0]).name] + sys.argv[1:] if argv is None else argv)}
    dev = PrivateDevice(cores=1, extra_args=["--threads", a.threads, "--quiet"])  # environment set above
    try:
        for m, p in paths.items():
            report[m] = bench(m, p, dev.path, a)
    finally:
        dev.stop()
    report["loadavg_end"] = os.getloadavg()

    RESULTS.mkdir(parents=True, exist_ok=True)
    out = RESULTS / f"quantize-{time.strftime('%Y%m%d-%H%M%S')}.json"
    out.write_text(json.dumps(report, indent=1) + "\n")
    print(f"load average {report['loadavg_start'][0]:.1f} -> {report['loadavg_end'][0]:.1f}, "
          f"{a.threads} threads, medians of {a.runs} interleaved calls")
    print(f"{'model':10} {'candidate':9} {'median ms':>10} {'top-1 vs f32':>13} {'max abs err':>12} "
          f"{'mean abs err':>13} {'compile s':>10}")
    for m in paths:
        r = report[m]
        for k in ("ort_f32", "ort_int8", "dev_f32", "dev_int8"):
            acc = r["accuracy"].get(k, {})
            top = f"{100 * acc['top1_vs_ort_f32']:.1f} %" if acc else "ref"
            comp = r["compile"].get(k, {}).get("wall_s")
            print(f"{m:10} {k:9} {r['latency'][k]['median_ms']:10.2f} {top:>13} "
                  f"{acc.get('max_abs', 0):12.4g} {acc.get('mean_abs', 0):13.4g} "
                  f"{'' if comp is None else f'{comp:.0f}':>10}")
        print(f"{m:10} paired: " + ", ".join(f"{k} {v:.2f}" for k, v in r["ratios_paired"].items()))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
