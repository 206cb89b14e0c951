"""ONNX -> TVM Relax -> a loadable dspx module (``model.so`` + ``metadata.json``
[+ ``weights.bin``]).  See docs/compiler.md."""
from __future__ import annotations

import json
import os
import time
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import onnx
from rich.console import Console

from dspx.compiler.checks import (CompileError, apply_shapes, fold_batchnorm, import_onnx, precheck,
                                  rewrite_prelu, sum_to_add)
from dspx.compiler.module import (IO_META_NAME, METADATA_FILE, MODULE_FILE, SIGNATURE_NAME, WEIGHTS_FILE,
                                  Signature, TensorSpec, export_module, make_io_meta, write_metadata,
                                  write_weights)
from dspx.abi.kernels import PREFIX
from dspx.compiler.target import cpu_features, make_target, missing_here
from dspx.compiler.weights import MIN_WEIGHT_ELEMENTS, rebuild_graph


class _Progress:
    """Stage lines on stderr: a spinner while a stage runs, then its time."""

    def __init__(self, enabled: bool):
        self.console = Console(stderr=True) if enabled else None
        self.times: dict[str, float] = {}

    @contextmanager
    def stage(self, name: str, what: str):
        t0 = time.perf_counter()
        if self.console is None:
            yield
        else:
            with self.console.status(f"{what} …"):
                yield
        self.times[name] = time.perf_counter() - t0
        if self.console is not None:
            self.console.print(f"[green]✓[/] {what} [dim]({self.times[name]:.2f} s)[/]")


def _split_weights(model: onnx.ModelProto) -> onnx.ModelProto:
    """A copy where every initializer that is not a weight (see
    MIN_WEIGHT_ELEMENTS, non-float) becomes a Constant node, so that
    ``keep_params_in_input`` turns only real weights into entry parameters."""
    model = onnx.ModelProto.FromString(model.SerializeToString())
    g = model.graph
    keep, consts = [], []
    for init in g.initializer:
        arr = onnx.numpy_helper.to_array(init)
        if np.issubdtype(arr.dtype, np.floating) and arr.size >= MIN_WEIGHT_ELEMENTS:
            keep.append(init)
        else:
            consts.append(onnx.helper.make_node("Constant", [], [init.name], value=init))
    rebuild_graph(g, keep, consts, {n.output[0] for n in consts})
    return model


def _spec(name: str, ty, kind: str) -> TensorSpec:
    shape = ty.shape.values if getattr(ty, "shape", None) is not None else None
    if shape is None or not all(hasattr(s, "value") for s in shape):
        text = "unknown rank" if shape is None else "[" + ", ".join(str(s) for s in shape) + "]"
        if kind == "input":
            raise CompileError(f"input {name!r} has a dynamic shape {text}; dspx modules need static shapes: "
                               f"give it with --shape {name}=D0,D1,... or --dim NAME=VALUE")
        raise CompileError(f"output {name!r} has a shape TVM cannot infer statically ({text}): it depends on "
                           "input values (e.g. NonZero, Unique, a shape computed from data); dspx modules "
                           "need static output shapes: fix the value-dependent part in the model, or give "
                           "static input shapes with --shape/--dim if they are the cause")
    try:
        return TensorSpec(name, tuple(int(s.value) for s in shape), str(ty.dtype))
    except ValueError as e:  # a dtype or rank tensor descriptors cannot carry
        raise CompileError(f"{kind} {name!r}: {e}") from None
    except AttributeError:
        raise CompileError(f"{kind} {name!r} is not a tensor ({ty}); dspx modules take and return tensors "
                           "only") from None


def _io_specs(model: onnx.ModelProto, func, num_inputs: int) -> tuple[list[TensorSpec], list[TensorSpec]]:
    """Names from the ONNX graph, shapes and dtypes from the imported Relax
    function (the frontend has inferred them)."""
    inits = {i.name for i in model.graph.initializer}
    in_names = [i.name for i in model.graph.input if i.name not in inits]
    out_names = [o.name for o in model.graph.output]
    inputs = [_spec(n, p.ty, "input") for n, p in zip(in_names, func.params[:num_inputs])]
    ret = func.ret_ty
    out_tys = list(ret.fields) if hasattr(ret, "fields") else [ret]
    if len(out_tys) != len(out_names):
        raise CompileError(f"the entry returns {len(out_tys)} values, the ONNX graph declares {len(out_names)} "
                           "outputs (an output that is a sequence or tuple?); dspx modules return tensors only")
    return inputs, [_spec(n, t, "output") for n, t in zip(out_names, out_tys)]


@contextmanager
def _quiet_stderr(enabled: bool = True):
    """Swallow what TVM's C++ side prints on fd 2 while it imports (e.g. a
    "BlockBuilder destroyed with remaining blocks" warning after a failed
    conversion): the CompileError says what failed, in one line."""
    import gc
    import tempfile

    if not enabled:
        yield
        return
    import sys

    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile() as sink:
        os.dup2(sink.fileno(), 2)
        try:
            yield
        finally:
            gc.collect()  # the frontend's BlockBuilder warns when it is destroyed
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)


def _pipeline(target, record: dict):
    """The CPU default relax pipeline (tvm.relax.backend.cpu_generic) with a
    probe after StaticPlanBlockMemory that records the planned workspace."""
    import tvm
    from tvm import relax
    from tvm.relax.backend.cpu_generic import pipeline as cpu_generic

    alloc_storage = tvm.ir.Op.get("relax.memory.alloc_storage")

    @tvm.transform.module_pass(opt_level=0, name="dspx.RecordWorkspace")
    def record_workspace(mod, _ctx):
        # After memory planning every intermediate lives in an alloc_storage of
        # a static byte size; tensors that leave the entry (outputs) are
        # allocated separately, so the sum is the workspace a call needs.
        total = 0

        def visit(expr):
            nonlocal total
            if isinstance(expr, relax.Call) and expr.op.same_as(alloc_storage):
                size = expr.args[0]
                if isinstance(size, relax.ShapeExpr) and all(hasattr(v, "value") for v in size.values):
                    total += int(np.prod([int(v.value) for v in size.values], dtype=np.int64))

        for _, func in mod.functions.items():
            if isinstance(func, relax.Function):
                relax.analysis.post_order_visit(func, visit)
        record["workspace_bytes"] = total
        return mod

    finalize = cpu_generic.finalize_passes(target)
    passes = (cpu_generic.library_dispatch_passes(target)
              + cpu_generic.legalize_passes(target)
              + cpu_generic.dataflow_lower_passes(target)
              + finalize[:1] + [record_workspace] + finalize[1:])
    return tvm.transform.Sequential(passes, name="dspx.pipeline")


def _rewrite_kernels(mod, target, blocked: bool = True) -> tuple[object, list[str]]:
    """Hook for the firmware kernel library: offload operators to kernels the
    device exports, if the rewrite module is present."""
    try:
        from dspx.compiler import kernel_rewrite
    except ImportError:
        return mod, []
    mod, names = kernel_rewrite.rewrite(mod, target, blocked=blocked)
    return mod, sorted(set(names))


def _verify_module(outdir, meta, model_path, reference, imported, params, shapes, dims, weights, calib,
                   verifier) -> dict:
    """The module just written, run through ``verifier`` against its reference
    (the int8 calibration's own check under --quantize; the float32 model too
    under reduced-precision weights)."""
    from dspx.compiler import verify as _verify

    if calib is not None:
        return calib.verify(outdir, meta, onnx.load(str(model_path)), shapes, dims, verifier)
    original = None
    if weights != "float32":
        original = onnx.load(str(model_path))
        apply_shapes(original, shapes, dims)
        original = original.SerializeToString()
    return _verify.verify(outdir, meta, reference.SerializeToString(), verifier, imported, params,
                          float32_model=original)


def compile_onnx(model_path, outdir, separate_weights: bool = False, kernels: bool = True,
                 progress: bool = True, *, target: str | None = None, verify: bool = True,
                 shapes: dict | None = None, dims: dict | None = None, weights: str = "float32",
                 verifier=None, quantize: str | None = None, calibrate=None, subgraph: bool | None = None,
                 cost_model: str | None = None) -> dict:
    """Compile an ONNX model into ``outdir``; returns the metadata written to
    ``outdir/metadata.json`` (plus ``"timings"`` in seconds per stage).

    target: None (default: "x86-64-v3", portable to any AVX2 machine; this
        machine's CPU if it lacks AVX2), "native" (this machine's CPU), an
        x86-64 level or an LLVM CPU name.
    verify: run the module on a device against a reference (onnxruntime, else
        TVM's unoptimized build) before declaring success (dspx.compiler.verify).
    shapes / dims: {input: [d0, d1, ...]} / {symbol: value} for dynamic inputs.
    weights: "float32", "float16" or "int8" (implies separate weights).
    verifier: what runs the module for ``verify`` (a
        dspx.compiler.verify.ModuleRunner, e.g. dspx.host.verifier.DeviceVerifier;
        required with verify=True: the compiler starts no device of its own).
    quantize / calibrate: "int8" and the .npz of calibration inputs: int8
        post-training quantization (dspx.compiler.quantize, docs/quantize.md).
    subgraph: hand the longest supported prefix of the graph to one
        onnx_subgraph kernel call (dspx.compiler.subgraph; default on unless
        DSPX_SUBGRAPH=0; float32 weights with kernels only).
    cost_model: a cost profile (name or file; default ``$DSPX_COST_MODEL``):
        record the estimated board time of the module's kernel calls in
        metadata.json "cost_estimate" (dspx.costmodel.estimate); off: nothing.
    """
    import tvm
    from tvm import relax

    from dspx.compiler.weights import MODES, reduce_weights

    if weights not in MODES:
        raise CompileError(f"--weights must be one of {', '.join(MODES)}, got {weights!r}")
    if verify and verifier is None:
        raise CompileError("verify=True needs a verifier to run the module: pass "
                           "verifier=dspx.host.verifier.DeviceVerifier() (a private device), or verify=False")
    separate_weights = separate_weights or weights != "float32"
    outdir = Path(outdir)
    prog = _Progress(progress)
    target_dict = make_target(target)
    features = cpu_features(target_dict["mcpu"])
    with prog.stage("import", f"import {Path(model_path).name}"):
        try:
            model = onnx.load(str(model_path))
        except Exception as e:
            raise CompileError(f"cannot read ONNX model {model_path}: {e}") from None
        precheck(model)
        apply_shapes(model, shapes, dims)
        reference, wreport = reduce_weights(model, weights)  # the verification reference
        rewrite_prelu(model)
        fold_batchnorm(model)
        sum_to_add(model)
        part = _partition(model, subgraph, kernels and weights == "float32" and not quantize)
        cost = _cost_estimate(model, cost_model, part, quantize=quantize, weights=weights, kernels=kernels)
        if part is not None:
            from dspx.compiler.subgraph import build_module

            def import_rest(rest):
                return _import(_split_weights(rest) if separate_weights else rest, separate_weights)[0]
            mod = build_module(part, separate_weights, import_rest)
        else:
            if separate_weights:
                model = _split_weights(model)
            model, _ = reduce_weights(model, weights)
            mod, model = _import(model, separate_weights)
        params = []
        if separate_weights:
            mod, detached = relax.frontend.detach_params(mod)
            params = detached.get("main", [])
        imported = mod if part is None else None  # TVM's reference cannot run the subgraph kernel
        func = mod["main"]
        num_inputs = len(func.params) - len(params)
        inputs, outputs = _io_specs(model, func, num_inputs)
        weight_names = [p.name for p in func.params[num_inputs:]]
    calib = None
    if quantize:
        from dspx.compiler.quantize import prepare

        with prog.stage("calibrate", "calibrate int8 activation ranges"):
            calib = prepare(model, quantize, calibrate, kernels=kernels, separate_weights=separate_weights,
                            weights=weights)

    target = tvm.target.Target(target_dict)
    imports: list[str] = []
    record: dict = {}
    with prog.stage("optimize", "optimize (relax pipeline)"):
        try:
            mod = relax.transform.DecomposeOpsForInference()(mod)  # BatchNorm etc. to arithmetic
            if kernels:
                mod, imports = _rewrite_kernels(mod, target, blocked=calib is None)
                if calib is not None:  # int8 kernels take plain NCHW tensors
                    mod, imports = calib.lower(mod)
                if part is not None:
                    imports = sorted(set(imports) | {PREFIX + "onnx_subgraph"})
            with target:
                mod = _pipeline(target, record)(mod)
        except CompileError:
            raise
        except Exception as e:  # noqa: BLE001 - a pass that cannot handle the graph
            raise CompileError(f"TVM cannot optimize the model: {type(e).__name__}: {_one_line(e)}; "
                               "try --no-kernels, or report the model") from None
    with prog.stage("build", f"build for {target_dict['mcpu']}"):
        try:
            ex = tvm.compile(mod, target, relax_pipeline=None)
        except Exception as e:  # noqa: BLE001
            raise CompileError(f"TVM cannot build the model: {type(e).__name__}: {_one_line(e)}") from None

    outdir.mkdir(parents=True, exist_ok=True)
    with prog.stage("export", f"export {outdir / MODULE_FILE}"):
        digest = None
        if separate_weights:
            digest = write_weights(outdir / WEIGHTS_FILE,
                                   [(n, p.numpy()) for n, p in zip(weight_names, params)])
        else:
            (outdir / WEIGHTS_FILE).unlink(missing_ok=True)  # stale from an earlier separate build
        sig = Signature(entry="main", inputs=inputs, outputs=outputs, kernel_imports=imports,
                        workspace_bytes=record.get("workspace_bytes", 0),
                        weights="separate" if separate_weights else "embedded",
                        num_weights=len(params), weights_digest=digest,
                        target_cpu=target_dict["mcpu"], cpu_features=features)
        io_meta = make_io_meta(inputs, outputs)
        export_module(ex, outdir / MODULE_FILE, {IO_META_NAME: io_meta.encode(), SIGNATURE_NAME: sig.encode()})
        subgraphs = [part.summary()] if part is not None else []
        meta = _metadata(outdir, sig, io_meta, target_dict, tvm.__version__, separate_weights, wreport, None,
                         subgraphs)
    if verify:
        with prog.stage("verify", "verify against a reference"):
            missing = missing_here(features)
            if missing:
                report = {"skipped": f"this machine lacks {', '.join(missing)} for {target_dict['mcpu']}"}
            else:
                report = _verify_module(outdir, meta, model_path, reference, imported, params, shapes, dims,
                                        weights, calib, verifier)
            meta = _metadata(outdir, sig, io_meta, target_dict, tvm.__version__, separate_weights, wreport,
                             report, subgraphs)
    if calib is not None:
        meta = calib.record(outdir, meta)
    if cost is not None:
        meta = _add_metadata(outdir, meta, "cost_estimate", cost)
    meta["timings"] = prog.times
    return meta


#: models of older opsets that TVM cannot import are converted to this one and tried again
RETRY_OPSET = 13


def _import(model: onnx.ModelProto, params_as_inputs: bool):
    """(relax module, the ONNX model it came from).  TVM's converters for old
    operator versions are the least tested (e.g. attribute-form Slice-1): a
    model below opset 13 that fails is upgraded with onnx's version converter
    and imported once more; the first error stands if that fails too."""
    from tvm.relax.frontend.onnx import from_onnx

    def run(m):
        return from_onnx(m, keep_params_in_input=params_as_inputs)

    try:
        with _quiet_stderr():
            return import_onnx(model, run), model
    except CompileError as first:
        opset = next((o.version for o in model.opset_import if o.domain in ("", "ai.onnx")), RETRY_OPSET)
        if opset >= RETRY_OPSET or first.operators and not first.node and "unsupported" in str(first):
            raise
        try:
            from onnx import version_converter

            newer = version_converter.convert_version(model, RETRY_OPSET)
        except Exception:  # noqa: BLE001 - the converter cannot help: the first error stands
            raise first from None
        try:
            with _quiet_stderr():
                return import_onnx(newer, run), newer
        except CompileError:
            raise first from None


def _metadata(outdir, sig, io_meta, target_dict, tvm_version, separate, wreport, report, subgraphs) -> dict:
    meta = write_metadata(outdir / METADATA_FILE, sig, io_meta, target=target_dict, tvm_version=tvm_version,
                          weights_file=WEIGHTS_FILE if separate else None,
                          extra={"cpu_features": sig.cpu_features, "weights_precision": wreport,
                                 "verify": report, "subgraphs": subgraphs})
    return meta


def _cost_estimate(model: onnx.ModelProto, cost_model: str | None, part, **options) -> dict | None:
    """The static board-time estimate of the module's kernel calls (from the
    rewritten ONNX graph, each node of an offloaded subgraph its own row) when a
    cost model is asked for; None when off (then nothing is imported or done)."""
    if not (cost_model or os.environ.get("DSPX_COST_MODEL")):
        return None
    from dspx.costmodel import estimate

    offloaded = [n.output[0] for n in part.sub.graph.node] if part is not None else []

    def make(params, **kw):
        return estimate.estimate_onnx(model, params, offloaded=offloaded, **options, **kw)

    try:
        return estimate.when_requested(cost_model, make)
    except estimate.EstimateError as e:
        raise CompileError(str(e)) from None


def _add_metadata(outdir, meta: dict, key: str, value) -> dict:
    """``meta`` with ``key`` added, written to outdir/metadata.json."""
    meta = dict(meta, **{key: value})
    path = Path(outdir) / METADATA_FILE
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(meta, indent=2) + "\n")
    os.replace(tmp, path)
    return meta


def _partition(model: onnx.ModelProto, wanted: bool | None, possible: bool):
    """The subgraph partition of the model (dspx.compiler.subgraph), or None:
    not wanted, not possible (no kernels, reduced weights, int8), nothing worth
    offloading, or onnxruntime refuses the subgraph (then logged, op by op)."""
    from dspx.compiler import subgraph

    if wanted is None:
        wanted = subgraph.enabled_by_default()
    if not (wanted and possible):
        return None
    part = subgraph.partition(model)
    if part is None:
        return None
    why = subgraph.check_with_onnxruntime(part)
    if why is not None:
        subgraph.log.warning("subgraph not offloaded (onnxruntime refuses it: %s); compiling op by op", why)
        return None
    return part


def _one_line(e: Exception) -> str:
    from dspx.compiler.checks import _first_line

    return _first_line(e)
