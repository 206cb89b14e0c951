"""How far below onnxruntime a float32 ResNet-18 can go on this machine, measured.

    python benchmarks/ceiling.py [--runs 40] [--threads 2] [--model resnet18|<light model>]

Issue 17 asks for ResNet-18 on the device at or below onnxruntime in-process
(device ÷ ORT ≤ 1.0, float32, max abs error ≤ 1e-4, the same 2 threads).  The
device runs the same onnxruntime engine in its core (the ``onnx_subgraph``
kernel), so the ratio is one plus the device's fixed cost over the call, minus
whatever a faster engine could win.  This prints both sides, side by side in
one run:

1. **The engine against the machine's float32 ceiling.**  onnxruntime's own
   per-node profile of the model: each convolution's GFLOP/s (2 x weight
   elements x output pixels), against the best float32 GEMM the same threads
   reach (onnxruntime MatMul and numpy, 2048^3).
2. **Other engines on the same graph**, in-process, interleaved in shuffled
   rounds and paired per round against onnxruntime, each output checked
   against onnxruntime's: OpenVINO with inference precision forced to f32 (if
   ``openvino`` is installed: ``pip install openvino``), and PyTorch's oneDNN
   (the ONNX graph traced into TorchScript, frozen and
   ``optimize_for_inference``; if ``torch`` is installed).
3. **The device's fixed cost**: a bare SEQPACKET echo between two processes,
   PING and the tiny 7-input module (zero copy) through a real device, back to
   back and after 50 ms idle (as ``benchmarks/infer.py`` calls, with a pause
   between batches); the echo also after the sender kept its vCPU busy.

Prints a table; writes JSON to benchmarks/results/ceiling-<timestamp>.json.
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

sys.path.insert(0, str(Path(__file__).resolve().parent))
import infer  # noqa: E402  (threads environment, module compile, device paths)
from _results import write_json  # noqa: E402

GEMM_N = 2048


def _model(name: str):
    from dspx.compiler import examples

    return examples.resnet18_model() if name == "resnet18" else examples.light_model(name)


def _ort_session(model_bytes: bytes, threads: int, profile: str | None = None):
    import onnxruntime as ort

    so = ort.SessionOptions()
    so.intra_op_num_threads = threads
    so.log_severity_level = 3
    if profile:
        so.enable_profiling = True
        so.profile_file_prefix = profile
    return ort.InferenceSession(model_bytes, so, providers=["CPUExecutionProvider"])


def gemm_ceiling(threads: int) -> dict:
    """Best GFLOP/s of a 2048^3 float32 GEMM: onnxruntime's MatMul (MLAS) and numpy."""
    import numpy as np
    from onnx import TensorProto, helper, numpy_helper

    n = GEMM_N
    rng = np.random.default_rng(0)
    a, b = (rng.random((n, n), dtype=np.float32) for _ in range(2))
    g = helper.make_graph([helper.make_node("MatMul", ["a", "b"], ["c"])], "gemm",
                          [helper.make_tensor_value_info("a", TensorProto.FLOAT, [n, n])],
                          [helper.make_tensor_value_info("c", TensorProto.FLOAT, [n, n])],
                          [numpy_helper.from_array(b, "b")])
    sess = _ort_session(helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)]).SerializeToString(),
                        threads)

    def best(f):
        f()
        ts = []
        for _ in range(7):
            t0 = time.perf_counter()
            f()
            ts.append(time.perf_counter() - t0)
        return 2 * n ** 3 / min(ts) / 1e9

    return {"onnxruntime MatMul": best(lambda: sess.run(None, {"a": a})), "numpy matmul": best(lambda: a @ b)}


def conv_profile(model_bytes: bytes, x, threads: int, runs: int) -> dict:
    """onnxruntime's per-node kernel times (median over runs) and each conv's GFLOP/s."""
    import numpy as np

    prefix = os.path.join(tempfile.mkdtemp(prefix="dspx-ceiling-"), "ort")
    sess = _ort_session(model_bytes, threads, prefix)
    name = sess.get_inputs()[0].name
    for _ in range(runs + 5):
        sess.run(None, {name: x})
    path = sess.end_profiling()
    events = [e for e in json.loads(Path(path).read_text())
              if e.get("cat") == "Node" and e["name"].endswith("_kernel_time")]
    Path(path).unlink()
    per_node = collections.defaultdict(list)
    info = {}
    for e in events:
        per_node[e["name"]].append(e["dur"])
        info[e["name"]] = e["args"]
    convs, other_us = [], 0.0
    for node, durs in per_node.items():
        us = float(np.median(durs[5:] or durs))
        args = info[node]
        if args.get("op_name") != "Conv":
            other_us += us
            continue
        w = args["input_type_shape"][1]["float"]
        out = args["output_type_shape"][0]["float"]
        flop = 2 * int(np.prod(w)) * out[2] * out[3]
        convs.append({"node": node[:-len("_kernel_time")], "weight": w, "output": out, "us": us,
                      "gflops": flop / us / 1e3, "flop": flop})
    conv_us = sum(c["us"] for c in convs)
    return {"convs": convs, "conv_us": conv_us, "other_us": other_us,
            "conv_gflops": sum(c["flop"] for c in convs) / conv_us / 1e3}


# ------------------------------------------------------------------ other engines
def _torch_module(model):
    """The ONNX graph (the operators of ResNet-18 and the light ResNet-50) as a
    traced, frozen, optimize_for_inference TorchScript module."""
    import torch
    import torch.nn.functional as F
    from onnx import numpy_helper

    g = model.graph
    consts = {i.name: torch.from_numpy(numpy_helper.to_array(i).copy()) for i in g.initializer}

    def pads(a, op):
        p = a.get("pads", [0, 0, 0, 0])
        if p[:2] != p[2:] or a.get("ceil_mode", 0):
            raise NotImplementedError(f"{op} with asymmetric padding or ceil_mode")
        return p[:2]

    def attrs(node):
        from onnx import helper
        return {a.name: helper.get_attribute_value(a) for a in node.attribute}

    class Graph(torch.nn.Module):
        def forward(self, x):
            env = dict(consts)
            env[g.input[0].name] = x
            for node in g.node:
                a, i = attrs(node), [env.get(n) for n in node.input]
                op = node.op_type
                if op == "Conv":
                    y = F.conv2d(i[0], i[1], i[2] if len(i) > 2 else None, a.get("strides", [1, 1]), pads(a, op),
                                 a.get("dilations", [1, 1]), a.get("group", 1))
                elif op == "Relu":
                    y = torch.relu(i[0])
                elif op in ("Add", "Sum"):
                    y = i[0]
                    for t in i[1:]:
                        y = y + t
                elif op == "Identity":
                    y = i[0]
                elif op == "MatMul":
                    y = torch.matmul(i[0], i[1])
                elif op == "BatchNormalization":
                    y = F.batch_norm(i[0], i[3], i[4], i[1], i[2], False, 0.0, a.get("epsilon", 1e-5))
                elif op == "Reshape":
                    y = torch.reshape(i[0], [int(v) for v in i[1]])
                elif op == "Softmax":
                    y = torch.softmax(i[0], a.get("axis", -1))
                elif op == "AveragePool":
                    y = F.avg_pool2d(i[0], a["kernel_shape"], a.get("strides", a["kernel_shape"]), pads(a, op),
                                     count_include_pad=bool(a.get("count_include_pad", 0)))
                elif op == "MaxPool":
                    y = F.max_pool2d(i[0], a["kernel_shape"], a.get("strides", a["kernel_shape"]), pads(a, op))
                elif op == "GlobalAveragePool":
                    y = F.adaptive_avg_pool2d(i[0], 1)
                elif op == "Flatten":
                    y = torch.flatten(i[0], a.get("axis", 1))
                elif op == "Gemm":
                    if a.get("alpha", 1.0) != 1.0 or a.get("beta", 1.0) != 1.0 or a.get("transA", 0):
                        raise NotImplementedError("Gemm with alpha, beta or transA")
                    w = i[1].t() if a.get("transB", 0) else i[1]
                    y = F.linear(i[0], w.t(), i[2] if len(i) > 2 else None)
                else:
                    raise NotImplementedError(f"{op} is not in this benchmark's ONNX -> torch table")
                env[node.output[0]] = y
            return env[g.output[0].name]

    shape = [d.dim_value for d in g.input[0].type.tensor_type.shape.dim]
    with torch.no_grad():
        traced = torch.jit.trace(Graph().eval(), torch.zeros(shape))
        return torch.jit.optimize_for_inference(torch.jit.freeze(traced))


def engines(model, x, threads: int, runs: int) -> dict:
    """In-process engines on the same graph, interleaved in shuffled rounds,
    paired per round against onnxruntime; max abs error against its output."""
    import numpy as np

    mb = model.SerializeToString()
    sess = _ort_session(mb, threads)
    name = sess.get_inputs()[0].name
    ref = sess.run(None, {name: x})[0]
    calls = {"onnxruntime": lambda: sess.run(None, {name: x})[0]}
    skipped = {}
    try:
        import openvino as ov

        core = ov.Core()
        compiled = core.compile_model(core.read_model(model=mb, weights=b""), "CPU", {
            "INFERENCE_PRECISION_HINT": "f32", "INFERENCE_NUM_THREADS": threads, "NUM_STREAMS": 1,
            "PERFORMANCE_HINT": "LATENCY"})
        req = compiled.create_infer_request()
        calls[f"OpenVINO {ov.__version__.split('-')[0]} f32"] = lambda: req.infer({0: x})[0]
    except ImportError:
        skipped["OpenVINO"] = "not installed (pip install openvino)"
    try:
        import torch

        torch.set_num_threads(threads)
        tmod = _torch_module(model)
        xt = torch.from_numpy(x)

        def run_torch():
            with torch.no_grad():
                return tmod(xt).numpy()
        calls[f"PyTorch {torch.__version__.split('+')[0]} oneDNN (frozen TorchScript)"] = run_torch
    except ImportError:
        skipped["PyTorch"] = "not installed"
    except NotImplementedError as e:
        skipped["PyTorch"] = str(e)
    err = {k: float(np.max(np.abs(np.asarray(f()) - ref))) for k, f in calls.items()}

    for f in calls.values():
        f()
    times, per_round = infer.interleave({k: infer.timed_calls(f) for k, f in calls.items()}, runs, 1, settle=0.02)
    return {"rows": {k: {"median_ms": statistics.median(v) * 1e3, "max_abs_err_vs_ort": err[k],
                         "paired_vs_ort": infer.paired(per_round, k, "onnxruntime")}
                     for k, v in times.items()}, "skipped": skipped}


# ------------------------------------------------------------------ the device's fixed cost
def _spin(seconds: float) -> None:
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        pass


def fixed_cost(threads: int, runs: int) -> dict:
    """Median microseconds of a bare SEQPACKET echo between two processes,
    PING and the tiny 7-input module (zero copy) through one device: back to
    back, after 50 ms idle, and (the echo) after the sender kept its own vCPU
    busy for 50 ms, so that the answer must wake the other one."""
    from dspx.abi import protocol as P
    from dspx.compiler import examples
    from dspx.host.launcher import PrivateDevice

    onnx_path = examples.multi_input(infer.BUILD / "onnx" / "multi_input.onnx")
    module = infer.BUILD / "multi_input"
    infer.compile_module(onnx_path, module, False, threads)
    bare = infer.Echo(bytes(P.Ping().encode()))
    dev = PrivateDevice(cores=1, extra_args=["--threads", threads, "--quiet"])
    try:
        paths = infer.DevicePaths(dev.path, module, staging=(module / "model.so").stat().st_size + (1 << 20))
        client, ping = paths.vm.client, P.Ping()
        idle = {"back to back": None, "after 50 ms idle": lambda: time.sleep(0.05)}
        cands = [("bare echo", bare, {**idle, "after 50 ms busy": lambda: _spin(0.05)}),
                 ("PING", lambda: client.request(ping), idle),
                 ("tiny INFER (zero copy)", lambda: paths.run("nocopy", 1), idle)]
        try:
            return {f"{name}, {label}": statistics.median(infer.timed_calls(call, before)(runs)) * 1e6
                    for name, call, befores in cands for label, before in befores.items()}
        finally:
            paths.close()
    finally:
        dev.stop()
        bare.close()


def main(argv=None) -> None:
    import numpy as np

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--runs", type=int, default=40)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--model", default="resnet18")
    a = ap.parse_args(argv)
    os.environ.update(infer._threads_env(a.threads))
    model = _model(a.model)
    mb = model.SerializeToString()
    shape = [d.dim_value for d in model.graph.input[0].type.tensor_type.shape.dim]
    x = np.random.default_rng(0).standard_normal(shape).astype(np.float32)
    report = {"date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "model": a.model, "threads": a.threads,
              "runs": a.runs, "loadavg_start": os.getloadavg()}
    print("float32 GEMM ceiling ...", file=sys.stderr)
    report["gemm_gflops"] = gemm_ceiling(a.threads)
    print("onnxruntime's per-node profile ...", file=sys.stderr)
    report["ort_profile"] = prof = conv_profile(mb, x, a.threads, a.runs)
    print("other engines on the same graph ...", file=sys.stderr)
    report["engines"] = eng = engines(model, x, a.threads, a.runs)
    print("the device's fixed cost ...", file=sys.stderr)
    report["device_fixed_cost_us"] = fixed = fixed_cost(a.threads, max(a.runs, 100))
    report["loadavg_end"] = os.getloadavg()
    path = write_json(f"ceiling-{time.strftime('%Y%m%d-%H%M%S', time.gmtime())}.json", report)

    best = max(report["gemm_gflops"].values())
    print(f"\n{a.model}, float32, {a.threads} threads (load {report['loadavg_start'][0]:.2f} -> "
          f"{report['loadavg_end'][0]:.2f})")
    print(f"best float32 GEMM {GEMM_N}^3: " + ", ".join(f"{k} {v:.0f}" for k, v in report["gemm_gflops"].items())
          + " GFLOP/s")
    print(f"onnxruntime convolutions: {prof['conv_us'] / 1e3:.2f} ms at {prof['conv_gflops']:.0f} GFLOP/s "
          f"({prof['conv_gflops'] / best:.0%} of the best GEMM); other nodes {prof['other_us'] / 1e3:.2f} ms")
    by_shape = collections.defaultdict(list)
    for c in prof["convs"]:
        by_shape[(tuple(c["weight"]), tuple(c["output"][1:]))].append(c)
    print(f"  {'weight':>18} {'output':>14} {'n':>2} {'us each':>8} {'GFLOP/s':>8}")
    for (w, o), cs in sorted(by_shape.items(), key=lambda kv: -sum(c["us"] for c in kv[1])):
        us = statistics.median(c["us"] for c in cs)
        print(f"  {'x'.join(map(str, w)):>18} {'x'.join(map(str, o)):>14} {len(cs):2d} {us:8.0f} "
              f"{statistics.median(c['gflops'] for c in cs):8.0f}")
    print(f"\nengines on the same graph, in-process, paired per round ({a.runs} rounds):")
    print(f"  {'engine':48} {'median ms':>9} {'÷ ORT':>7} {'max abs err':>11}")
    for k, r in eng["rows"].items():
        print(f"  {k:48} {r['median_ms']:9.2f} {r['paired_vs_ort']:7.3f} {r['max_abs_err_vs_ort']:11.1e}")
    for k, why in eng["skipped"].items():
        print(f"  {k}: skipped, {why}")
    print("\nthe device's fixed cost (median us):")
    for k, v in fixed.items():
        print(f"  {k:44} {v:8.0f}")
    print(f"JSON: {os.path.relpath(path)}")


if __name__ == "__main__":
    main()
