"""ONNX -> TVM Relax -> a loadable dspx module (``model.so`` + ``metadata.json``
[+ ``weights.bin``]).  See docs/compiler.md."""
from __future__ import annotations

import os
import re
import time
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import onnx
from rich.console import Console

from dspx.compiler.module import (IO_META_NAME, METADATA_FILE, MODULE_FILE, SIGNATURE_NAME, WEIGHTS_FILE,
                                  Signature, TensorSpec, export_module, make_io_meta, write_metadata,
                                  write_weights)

# Initializers below this many elements stay embedded even with separate
# weights: shapes, axes and scalars must be compile-time constants for the
# frontend to produce static shapes, and are not worth shipping apart anyway.
MIN_WEIGHT_ELEMENTS = 64


class CompileError(Exception):
    """The model cannot be compiled; the message says why (unsupported
    operators are named)."""

    def __init__(self, message: str, operators: list[str] | None = None):
        super().__init__(message)
        self.operators = operators or []


def detect_mcpu() -> str:
    """The host CPU name as LLVM knows it (never "native", which TVM turns
    into "generic"); falls back to an x86-64 micro-architecture level read
    from /proc/cpuinfo flags."""
    from tvm.target import codegen

    try:
        cpu = codegen.llvm_get_system_cpu()
        if cpu and cpu != "generic" and codegen.llvm_is_valid_cpu(cpu, "x86_64-linux-gnu"):
            return cpu
    except Exception:  # older/limited LLVM builds lack these helpers
        pass
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return "x86-64"
    m = re.search(r"^flags\s*:\s*(.*)$", text, re.M)
    flags = set(m.group(1).split()) if m else set()
    if {"avx512f", "avx512bw", "avx512cd", "avx512dq", "avx512vl"} <= flags:
        return "x86-64-v4"
    if {"avx2", "bmi2", "fma", "movbe"} <= flags:
        return "x86-64-v3"
    if {"sse4_2", "popcnt", "ssse3"} <= flags:
        return "x86-64-v2"
    return "x86-64"


def make_target() -> dict:
    return {"kind": "llvm", "mtriple": "x86_64-linux-gnu", "mcpu": detect_mcpu(),
            "num-cores": os.cpu_count() or 1}


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
    moved = {n.output[0] for n in consts}
    inputs = [i for i in g.input if i.name not in moved]  # old exporters list initializers as inputs
    del g.initializer[:]
    g.initializer.extend(keep)
    del g.input[:]
    g.input.extend(inputs)
    nodes = consts + list(g.node)
    del g.node[:]
    g.node.extend(nodes)
    return model


def _spec(name: str, ty) -> TensorSpec:
    shape = ty.shape.values if ty.shape is not None else None
    if shape is None or not all(hasattr(s, "value") for s in shape):
        raise CompileError(f"tensor {name!r} has a dynamic shape {ty}; dspx modules need static shapes "
                           f"(fix the dimensions in the ONNX model)")
    try:
        return TensorSpec(name, tuple(int(s.value) for s in shape), str(ty.dtype))
    except ValueError as e:  # a dtype or rank tensor descriptors cannot carry
        raise CompileError(f"tensor {name!r}: {e}") from None


def _io_specs(model: onnx.ModelProto, func, num_inputs: int) -> tuple[list[TensorSpec], list[TensorSpec]]:
    """Names from the ONNX graph, shapes and dtypes from the imported Relax
    function (the frontend has inferred them)."""
    inits = {i.name for i in model.graph.initializer}
    in_names = [i.name for i in model.graph.input if i.name not in inits]
    out_names = [o.name for o in model.graph.output]
    inputs = [_spec(n, p.ty) for n, p in zip(in_names, func.params[:num_inputs])]
    ret = func.ret_ty
    out_tys = list(ret.fields) if hasattr(ret, "fields") else [ret]
    if len(out_tys) != len(out_names):
        raise CompileError(f"the entry returns {len(out_tys)} values, the ONNX graph declares {len(out_names)} outputs")
    return inputs, [_spec(n, t) for n, t in zip(out_names, out_tys)]


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


def _rewrite_kernels(mod, target) -> tuple[object, list[str]]:
    """Hook for the firmware kernel library: offload operators to kernels the
    device exports, if the rewrite module is present."""
    try:
        from dspx.compiler import kernel_rewrite
    except ImportError:
        return mod, []
    mod, names = kernel_rewrite.rewrite(mod, target)
    return mod, sorted(set(names))


def compile_onnx(model_path, outdir, separate_weights: bool = False, kernels: bool = True,
                 progress: bool = True) -> dict:
    """Compile an ONNX model into ``outdir``; returns the metadata written to
    ``outdir/metadata.json`` (plus ``"timings"`` in seconds per stage)."""
    import tvm
    from tvm import relax
    from tvm.relax.frontend.onnx import from_onnx

    outdir = Path(outdir)
    prog = _Progress(progress)
    with prog.stage("import", f"import {Path(model_path).name}"):
        try:
            model = onnx.load(str(model_path))
        except Exception as e:
            raise CompileError(f"cannot read ONNX model {model_path}: {e}") from e
        if separate_weights:
            model = _split_weights(model)
        try:
            mod = from_onnx(model, keep_params_in_input=separate_weights)
        except tvm.error.OpNotImplemented as e:
            text = str(e)
            m = re.search(r"not supported for frontend ONNX:\s*([^\n]+)", text)
            ops = sorted(o.strip() for o in m.group(1).split(",")) if m else []
            raise CompileError(f"unsupported ONNX operator(s): {', '.join(ops) or text}", ops) from None
        except Exception as e:  # the frontend raises assorted types for graphs it cannot convert
            raise CompileError(f"TVM cannot import {Path(model_path).name}: {type(e).__name__}: {e}") from e
        params = []
        if separate_weights:
            mod, detached = relax.frontend.detach_params(mod)
            params = detached.get("main", [])
        func = mod["main"]
        num_inputs = len(func.params) - len(params)
        inputs, outputs = _io_specs(model, func, num_inputs)
        weight_names = [p.name for p in func.params[num_inputs:]]

    target_dict = make_target()
    target = tvm.target.Target(target_dict)
    imports: list[str] = []
    record: dict = {}
    with prog.stage("optimize", "optimize (relax pipeline)"):
        mod = relax.transform.DecomposeOpsForInference()(mod)  # BatchNorm etc. to arithmetic
        if kernels:
            mod, imports = _rewrite_kernels(mod, target)
        with target:
            mod = _pipeline(target, record)(mod)
    with prog.stage("build", f"build for {target_dict['mcpu']}"):
        ex = tvm.compile(mod, target, relax_pipeline=None)

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
                        num_weights=len(params), weights_digest=digest)
        io_meta = make_io_meta(inputs, outputs)
        export_module(ex, outdir / MODULE_FILE, {IO_META_NAME: io_meta.encode(), SIGNATURE_NAME: sig.encode()})
        meta = write_metadata(outdir / METADATA_FILE, sig, io_meta, target=target_dict,
                              tvm_version=tvm.__version__,
                              weights_file=WEIGHTS_FILE if separate_weights else None)
    meta["timings"] = prog.times
    return meta
