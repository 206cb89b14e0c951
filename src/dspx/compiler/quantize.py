"""``dspx compile --quantize int8 --calibrate inputs.npz``: int8 post-training
quantization (docs/quantize.md).

1. **Calibration.**  ``inputs.npz`` holds one array per model input, leading
   axis = samples.  onnxruntime's own MinMax calibrator
   (``onnxruntime.quantization.calibrate``) runs the float32 graph (after the
   compiler's rewrites, BatchNorm folded: the graph TVM imports) on every
   sample and records the range of each Conv/Gemm/MatMul input and output.
2. **Lowering.**  After the kernel rewrite (NCHW, no blocked layout) every
   ``conv2d``/``conv2d_add``/``dense`` kernel call whose weight is a constant
   of an ONNX node is replaced by its int8 kernel (``conv2d_q8``,
   ``conv2d_add_q8``, ``dense_q8``): weight per-output-channel symmetric int8,
   activations uint8 with the calibrated per-tensor scale and zero point, as
   onnxruntime's ``quantize_static`` (U8S8, per channel) does.  A call is
   matched to its ONNX node by the weight's bytes (same bytes, same
   initializer).
3. **Verification.**  The module runs on a device on the calibration samples
   and is compared with onnxruntime running its own ``quantize_static`` QDQ
   model of the same graph, calibrated on the same samples: logits within
   ``QDQ_RTOL`` of the QDQ model's largest magnitude; and with the numpy
   integer reference (``dspx.compiler.int8_reference``: the lowered Conv,
   Gemm and MatMul in integers, independent of onnxruntime, which runs on
   the same MLAS kernels as the module): within ``INT_REF_QUANTA`` of the
   output's quantum.  Top-1 agreement of both with float32 is reported
   (metadata.json ``quantize``).
"""
from __future__ import annotations

import hashlib
import tempfile
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import onnx
from onnx import numpy_helper

from dspx.compiler.checks import CompileError
from dspx.compiler.weights import MIN_WEIGHT_ELEMENTS

MODES = ("int8",)
#: the operators whose inputs are calibrated and that get int8 kernels
QUANTIZED_OPS = ("Conv", "Gemm", "MatMul")
#: verification: max |module - onnxruntime QDQ| <= QDQ_RTOL * max |QDQ| over the samples
QDQ_RTOL = 0.1
#: verification: max |module - integer reference| <= INT_REF_QUANTA steps of the output's uint8 range
INT_REF_QUANTA = 1.0
#: at most this many calibration samples are run in verification (each is one device call)
VERIFY_SAMPLES = 16


def _digest(a: np.ndarray) -> str:
    a = np.ascontiguousarray(a)
    return hashlib.sha1(a.tobytes() + str((a.shape, a.dtype.str)).encode()).hexdigest()


def qparams(lo: float, hi: float) -> tuple[float, int]:
    """uint8 (scale, zero point) for the range [lo, hi], widened to contain 0
    (onnxruntime's asymmetric uint8 rule)."""
    lo, hi = min(float(lo), 0.0), max(float(hi), 0.0)
    if hi - lo <= 0 or not np.isfinite(hi - lo):
        return 1.0, 0
    scale = (hi - lo) / 255.0
    return scale, int(np.clip(np.rint(-lo / scale), 0, 255))


# ---------------------------------------------------------------- calibration file

def load_calibration(path, model: onnx.ModelProto) -> dict[str, np.ndarray]:
    """{input name: array (samples, *input shape)} from an .npz; one-line
    CompileErrors for what does not fit the model's inputs."""
    path = Path(path)
    inits = {i.name for i in model.graph.initializer}
    specs = {}
    for v in model.graph.input:
        if v.name in inits:
            continue
        t = v.type.tensor_type
        shape = [d.dim_value if d.HasField("dim_value") else None for d in t.shape.dim]
        specs[v.name] = (shape, onnx.helper.tensor_dtype_to_np_dtype(t.elem_type))
    try:
        with np.load(path, allow_pickle=False) as z:
            arrays = {k: z[k] for k in z.files}
    except FileNotFoundError:
        raise CompileError(f"--calibrate {path}: no such file") from None
    except Exception as e:  # noqa: BLE001 - not an npz, corrupt, pickled objects
        raise CompileError(f"--calibrate {path}: not a readable .npz of arrays ({type(e).__name__}: "
                           f"{str(e).splitlines()[0][:120]}); save it with numpy.savez(path, input_name=array)") \
            from None
    missing = [n for n in specs if n not in arrays]
    if missing:
        raise CompileError(f"--calibrate {path}: no array for model input {missing[0]!r} (the file has "
                           f"{', '.join(sorted(arrays)) or 'no arrays'}; the model's inputs are {', '.join(specs)})")
    extra = sorted(set(arrays) - set(specs))
    if extra:
        raise CompileError(f"--calibrate {path}: array {extra[0]!r} is not a model input (inputs: "
                           f"{', '.join(specs)})")
    out, counts = {}, {}
    for name, (shape, dtype) in specs.items():
        a = arrays[name]
        want = "x".join(str(d) for d in shape)
        if a.ndim == len(shape) + 1 and all(d is None or d == s for d, s in zip(shape, a.shape[1:])):
            pass
        elif shape and shape[0] == 1 and a.ndim == len(shape) and \
                all(d is None or d == s for d, s in zip(shape[1:], a.shape[1:])):
            a = a[:, None]  # samples stacked along the batch axis of a batch-1 input
        else:
            raise CompileError(f"--calibrate {path}: array {name!r} has shape {list(a.shape)}; input {name!r} "
                               f"is {want}, so the array must be (samples, {', '.join(map(str, shape))})")
        if a.shape[0] < 1:
            raise CompileError(f"--calibrate {path}: array {name!r} has 0 samples")
        if np.dtype(a.dtype).kind != np.dtype(dtype).kind or (a.dtype.kind == "f" and a.dtype.itemsize > 8):
            raise CompileError(f"--calibrate {path}: array {name!r} is {a.dtype}, input {name!r} is "
                               f"{np.dtype(dtype).name}")
        a = a.astype(dtype, copy=False)
        if a.dtype.kind == "f" and not np.all(np.isfinite(a)):
            bad = int(np.count_nonzero(~np.isfinite(a)))
            raise CompileError(f"--calibrate {path}: array {name!r} has {bad} NaN or infinite values")
        out[name], counts[name] = a, a.shape[0]
    if len(set(counts.values())) > 1:
        raise CompileError(f"--calibrate {path}: the arrays have different sample counts "
                           f"({', '.join(f'{k} {v}' for k, v in counts.items())})")
    return out


def samples(arrays: dict[str, np.ndarray]):
    """One feed dict per calibration sample."""
    n = next(iter(arrays.values())).shape[0]
    for i in range(n):
        yield {k: np.ascontiguousarray(v[i]) for k, v in arrays.items()}


class _Reader:
    """onnxruntime's CalibrationDataReader protocol over the samples."""

    def __init__(self, arrays):
        self.it = samples(arrays)

    def get_next(self):
        return next(self.it, None)


def calibrate(model: onnx.ModelProto, arrays: dict[str, np.ndarray]) -> dict[str, tuple[float, float]]:
    """{tensor: (min, max)} over the samples for the inputs and outputs of
    every Conv/Gemm/MatMul, by onnxruntime's MinMax calibrator."""
    from onnxruntime.quantization.calibrate import CalibrationMethod, create_calibrator

    with tempfile.TemporaryDirectory(prefix="dspx-calib-") as d:
        src = Path(d) / "model.onnx"
        onnx.save(model, str(src))
        cal = create_calibrator(src, list(QUANTIZED_OPS), augmented_model_path=str(Path(d) / "augmented.onnx"),
                                calibrate_method=CalibrationMethod.MinMax)
        cal.collect_data(_Reader(arrays))
        data = cal.compute_data()
    return {name: (float(np.min(t.range_value[0])), float(np.max(t.range_value[1])))
            for name, t in data.data.items()}


# ---------------------------------------------------------------- what calibration found

@dataclass
class Calibration:
    """What calibration found, keyed by the digest of each quantizable weight."""
    arrays: dict[str, np.ndarray]  # the calibration samples (load_calibration)
    model: onnx.ModelProto  # the float32 graph TVM imports (compiler rewrites applied)
    weights: dict[str, dict] = field(default_factory=dict)  # digest -> {node, input, output ranges}
    report: dict = field(default_factory=dict)

    def lower(self, mod) -> tuple[object, list[str]]:
        """Replace matched float kernel calls by their int8 kernels; returns the
        module and every kernel it now calls."""
        mod, counts, used = _lower(mod, self)
        self.report["kernels"] = {k: v for k, v in counts.items() if v}  # float ones: kept float32
        return mod, sorted(used)

    def verify(self, outdir, meta: dict, original: onnx.ModelProto, shapes, dims, verifier) -> dict:
        """The module against onnxruntime's QDQ model of the same graph (see verify)."""
        from dspx.compiler.checks import apply_shapes

        apply_shapes(original, shapes, dims)
        return verify(outdir, meta, self, original, verifier)

    def record(self, outdir, meta: dict) -> dict:
        """Add the ``quantize`` report to metadata.json (and the returned metadata)."""
        import json
        import os

        from dspx.compiler.module import METADATA_FILE

        meta = dict(meta, quantize=self.report)
        path = Path(outdir) / METADATA_FILE
        tmp = path.with_suffix(".json.tmp")
        tmp.write_text(json.dumps(meta, indent=2) + "\n")
        os.replace(tmp, path)
        return meta


def prepare(model: onnx.ModelProto, mode: str, calibration_path, *, kernels: bool, separate_weights: bool,
            weights: str) -> Calibration:
    """Check the options, read the calibration file and calibrate ``model``."""
    if mode not in MODES:
        raise CompileError(f"--quantize must be {' or '.join(MODES)}, got {mode!r}")
    if calibration_path is None:
        raise CompileError("--quantize int8 needs --calibrate inputs.npz: representative inputs, one array per "
                           "model input with the samples along the first axis")
    if not kernels:
        raise CompileError("--quantize int8 runs on the int8 firmware kernels; drop --no-kernels")
    if separate_weights or weights != "float32":
        raise CompileError("--quantize int8 stores its own int8 weights in the module; drop --separate-weights "
                           "and --weights (not combined yet)")
    arrays = load_calibration(calibration_path, model)
    t0 = time.perf_counter()
    ranges = calibrate(model, arrays)
    calib = Calibration(arrays, model)
    inits = {i.name: i for i in model.graph.initializer}
    for node in model.graph.node:
        if node.op_type not in QUANTIZED_OPS or len(node.input) < 2 or node.input[1] not in inits:
            continue
        w = numpy_helper.to_array(inits[node.input[1]])
        if (w.dtype != np.float32 or w.size < MIN_WEIGHT_ELEMENTS or node.input[0] not in ranges
                or node.output[0] not in ranges):
            continue  # stays float32
        lo, hi = ranges[node.input[0]]
        olo, ohi = ranges[node.output[0]]
        entry = calib.weights.setdefault(_digest(w), {"node": node.name or node.output[0], "input": (lo, hi),
                                                     "output": (olo, ohi)})
        # one initializer read by two nodes: the union of their ranges
        entry["input"] = (min(entry["input"][0], lo), max(entry["input"][1], hi))
        entry["output"] = (min(entry["output"][0], olo), max(entry["output"][1], ohi))
    n = next(iter(arrays.values())).shape[0]
    calib.report = {"mode": mode, "samples": n, "calibration": "onnxruntime MinMax",
                    "calibrated_weights": len(calib.weights),
                    "calibrate_seconds": round(time.perf_counter() - t0, 2)}
    return calib


# ---------------------------------------------------------------- lowering (relax)

_FLOAT_TO_Q8 = {"conv2d": "conv2d_q8", "conv2d_add": "conv2d_add_q8", "dense": "dense_q8"}


def quantize_weight(w: np.ndarray, axis: int) -> tuple[np.ndarray, np.ndarray]:
    """Symmetric per-channel int8 along ``axis``: (q int8, scale float32 (channels,))."""
    from dspx.compiler.weights import quantize_int8

    q, s = quantize_int8(w, axis)
    return q, s.reshape(-1)


def _lower(mod, calib: Calibration):
    import tvm
    from tvm import relax, tirx

    from dspx.abi.kernels import ACT_RELU, KERNELS, LAYOUT_NCHW, PREFIX

    dps = tvm.ir.Op.get("relax.call_dps_packed")
    counts = {PREFIX + k: 0 for k in list(_FLOAT_TO_Q8) + list(_FLOAT_TO_Q8.values())}

    def f64(v):
        return relax.prim_value(tirx.FloatImm("float64", float(v)))

    def pv(e) -> int:
        v = e.value
        return int(v.value) if hasattr(v, "value") else int(v)

    @relax.expr_functor.mutator
    class Lower(relax.PyExprMutator):
        def visit_call_(self, call):
            call = super().visit_call_(call)
            if not call.op.same_as(dps) or not isinstance(call.args[0], relax.ExternFunc):
                return call
            name = str(call.args[0].global_symbol)
            short = name[len(PREFIX):] if name.startswith(PREFIX) else ""
            if short not in _FLOAT_TO_Q8:
                return call
            abi = KERNELS[short]
            args = list(call.args[1].fields)
            w, b = args[abi.position("weight")], args[abi.position("bias")]
            entry = None
            if isinstance(w, tvm.ir.expr.Constant) and isinstance(b, tvm.ir.expr.Constant):
                wn = w.value.numpy()
                if wn.dtype == np.float32:
                    # the importer may have folded a Gemm's transB into the constant
                    entry = calib.weights.get(_digest(wn)) or (calib.weights.get(_digest(wn.T))
                                                              if short == "dense" else None)
            if entry is None:
                counts[name] += 1  # stays float32: no calibrated ONNX node has this weight
                return call
            xs, xz = qparams(*entry["input"])
            if short == "dense":
                tb = pv(args[abi.position("trans_b")])
                q, s = quantize_weight(wn, 0 if tb else 1)
                new = [args[0], relax.const(q), b, relax.const(s), args[abi.position("trans_b")],
                       args[abi.position("act")], f64(xs), relax.prim_value(xz)]
            else:
                layout = pv(args[abi.position("layout")])
                if layout != LAYOUT_NCHW:
                    counts[name] += 1
                    return call
                act = pv(args[abi.position("act")])
                lo, hi = entry["output"]
                if act == ACT_RELU and short == "conv2d":
                    lo = 0.0  # the ReLU is the requantization's clamp
                ys, yz = qparams(lo, hi)
                q, s = quantize_weight(wn, 0)
                n_in = len(abi.inputs)
                tensors = args[:n_in]
                tensors[1] = relax.const(q)
                new = tensors + [relax.const(s)] + args[n_in:n_in + len(abi.attrs)] + \
                    [f64(xs), relax.prim_value(xz), f64(ys), relax.prim_value(yz)]
            q8 = PREFIX + _FLOAT_TO_Q8[short]
            counts[q8] += 1
            entry["lowered"] = True  # the integer reference (verify) computes this node in int8
            return relax.call_dps_packed(q8, new, out_ty=call.ty)

    used: set[str] = set()

    def called(e):
        if isinstance(e, relax.Call) and e.op.same_as(dps) and isinstance(e.args[0], relax.ExternFunc):
            used.add(str(e.args[0].global_symbol))

    for gv, func in list(mod.functions.items()):
        if isinstance(func, relax.Function):
            mod[gv] = Lower(mod).visit_expr(func)
            relax.analysis.post_order_visit(mod[gv], called)
    return mod, counts, used


# ---------------------------------------------------------------- reference and verification

@contextmanager
def _quiet_advice():
    """quantize_static logs "consider pre-processing" advice on the root
    logger; the compiler has already folded BatchNorm (its main point)."""
    import logging

    root = logging.getLogger()
    level = root.level
    root.setLevel(logging.ERROR)
    try:
        yield
    finally:
        root.setLevel(level)


def qdq_model(model: onnx.ModelProto, arrays: dict[str, np.ndarray]) -> onnx.ModelProto:
    """onnxruntime's own static int8 quantization of ``model`` (QDQ, uint8
    activations, per-channel int8 weights, MinMax on the same samples) -- the peer."""
    from onnxruntime.quantization import CalibrationMethod, QuantFormat, QuantType, quantize_static

    model = onnx.ModelProto.FromString(model.SerializeToString())
    # IR 3 requires every initializer to be a graph input, which BatchNorm folding's new
    # ones are not; quantize_static's opset upgrade then refuses the graph
    if model.ir_version < 4:
        model.ir_version = 4  # and its initializers are constants, not overridable inputs
        names = {i.name for i in model.graph.initializer}
        keep = [i for i in model.graph.input if i.name not in names]
        del model.graph.input[:]
        model.graph.input.extend(keep)
    opset = next((o.version for o in model.opset_import if o.domain in ("", "ai.onnx")), 13)
    if opset < 13:  # per-channel DequantizeLinear (its axis) needs opset 13; quantize_static upgrades to 11 only
        from onnx import version_converter

        model = version_converter.convert_version(model, 13)
    with tempfile.TemporaryDirectory(prefix="dspx-qdq-") as d, _quiet_advice():
        src, dst = Path(d) / "model.onnx", Path(d) / "model.qdq.onnx"
        onnx.save(model, str(src))
        quantize_static(src, dst, _Reader(arrays), quant_format=QuantFormat.QDQ,
                        op_types_to_quantize=list(QUANTIZED_OPS), per_channel=True,
                        activation_type=QuantType.QUInt8, weight_type=QuantType.QInt8,
                        calibrate_method=CalibrationMethod.MinMax)
        return onnx.load(str(dst))


def ort_outputs(model: onnx.ModelProto | bytes, feeds: list[dict]) -> list[list[np.ndarray]]:
    """onnxruntime's outputs for each feed (2 threads, like the device's core)."""
    import onnxruntime as ort

    so = ort.SessionOptions()
    so.log_severity_level = 3
    so.intra_op_num_threads = 2
    data = model if isinstance(model, bytes) else model.SerializeToString()
    sess = ort.InferenceSession(data, so, providers=["CPUExecutionProvider"])
    return [sess.run(None, f) for f in feeds]


def agreement(got: list[np.ndarray], ref: list[np.ndarray]) -> dict:
    """top-1 agreement (argmax over the last axis) and abs errors of stacked outputs."""
    g, r = np.stack(got).astype(np.float64), np.stack(ref).astype(np.float64)
    err = np.abs(g - r)
    top = np.argmax(g.reshape(len(got), -1, g.shape[-1]), -1) == np.argmax(r.reshape(len(ref), -1, r.shape[-1]), -1)
    return {"top1": float(np.mean(top)), "max_abs": float(err.max(initial=0.0)), "mean_abs": float(err.mean()),
            "rel": float(err.max(initial=0.0)) / max(float(np.abs(r).max(initial=0.0)), 1e-30)}


def integer_reference(calib: Calibration, feeds: list[dict]) -> tuple[list | None, list[str]]:
    """The numpy integer reference's outputs for each feed (dspx.compiler.int8_reference:
    the lowered Conv/Gemm/MatMul in integers, the rest float32), or None and the
    lowered nodes it does not cover."""
    from dspx.compiler import int8_reference

    lowered = {k: v for k, v in calib.weights.items() if v.get("lowered")}
    model, missed = int8_reference.reference_model(calib.model, lowered, _digest)
    return (None if missed else int8_reference.run(model, feeds)), missed


def _vs_integer(got: list[np.ndarray], ref: list[np.ndarray]) -> dict:
    """agreement() plus the error in quanta: steps of the reference output's
    range over the samples (widened to 0) divided into 255."""
    from dspx.compiler.int8_reference import uint8_params

    r = np.stack(ref)
    out = agreement(got, ref)
    out["quantum"] = float(uint8_params(r.min(initial=0.0), r.max(initial=0.0))[0])
    out["quanta"] = out["max_abs"] / out["quantum"]
    return out


def verify(outdir, meta: dict, calib: Calibration, original: onnx.ModelProto, verifier) -> dict:
    """Run the module on up to VERIFY_SAMPLES calibration samples through
    ``verifier`` (a dspx.compiler.verify.ModuleRunner); CompileError if an
    output is further than QDQ_RTOL from onnxruntime's QDQ int8 model or more
    than INT_REF_QUANTA quanta from the numpy integer reference.  Returns the
    report (also errors and top-1 vs float32)."""
    feeds = list(samples(calib.arrays))[:VERIFY_SAMPLES]
    names = [t["name"] for t in meta["inputs"]]
    qdq = qdq_model(calib.model, calib.arrays)
    ref_q = ort_outputs(qdq, feeds)
    ref_f = ort_outputs(original, feeds)
    ref_i, missed = integer_reference(calib, feeds)
    try:
        got = verifier(Path(outdir), [[f[n] for n in names] for f in feeds])
    except CompileError:
        raise
    except Exception as e:  # noqa: BLE001 - a module that does not load or run is a compile failure
        raise CompileError(f"the quantized module fails on the device: {type(e).__name__}: "
                           f"{str(e).splitlines()[0][:300]}") from None
    report = {"reference": "onnxruntime quantize_static QDQ (U8S8, per channel, MinMax, same samples)",
              "samples": len(feeds), "rtol": QDQ_RTOL, "vs_qdq": {}, "vs_float32": {}, "qdq_vs_float32": {},
              "int8_reference": {"covers": "Conv, Gemm, MatMul lowered to int8 kernels (numpy integers); other "
                                           "operators float32 (onnx.reference)", "not_covered": missed,
                                 "max_quanta": INT_REF_QUANTA},
              "vs_int8_reference": {}}
    for i, out in enumerate(meta["outputs"]):
        if np.dtype(out["dtype"]).kind != "f":
            continue
        name = out["name"]
        g, q, f = [s[i] for s in got], [s[i] for s in ref_q], [s[i] for s in ref_f]
        vq = report["vs_qdq"][name] = agreement(g, q)
        report["vs_float32"][name] = agreement(g, f)
        report["qdq_vs_float32"][name] = agreement(q, f)
        if not vq["rel"] <= QDQ_RTOL:
            raise CompileError(f"verification failed: output {name!r} of the int8 module differs from "
                               f"onnxruntime's QDQ int8 model on the calibration samples (max abs error "
                               f"{vq['max_abs']:.3g} = {100 * vq['rel']:.3g} % of its largest value > "
                               f"{100 * QDQ_RTOL:.3g} %); this is a compiler bug, please report it (use "
                               "--no-verify to keep the module anyway)")
        if ref_i is None:
            continue
        vi = report["vs_int8_reference"][name] = _vs_integer(g, [s[i] for s in ref_i])
        if not vi["quanta"] <= INT_REF_QUANTA:
            raise CompileError(f"verification failed: output {name!r} of the int8 module differs from the numpy "
                               f"integer reference on the calibration samples by {vi['max_abs']:.3g} = "
                               f"{vi['quanta']:.3g} quanta of its range (> {INT_REF_QUANTA:g}); this is a compiler "
                               "bug, please report it (use --no-verify to keep the module anyway)")
    return report
