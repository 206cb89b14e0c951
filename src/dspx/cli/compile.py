"""``dspx compile MODEL.onnx -o OUTDIR``: the compiler, with the module
verified on a private device.  Progress goes to stderr, the summary to stdout
(a CompileError ends as the group's one error line or JSON object, with its
operators and node)."""
from __future__ import annotations

import json
from pathlib import Path

import click

from . import cost


def _size(n: int) -> str:
    return f"{n / 2**20:.2f} MiB" if n >= 2**20 else f"{n / 1024:.1f} KiB"


def _shape(t: dict) -> str:
    return f"{t['name']} {t['dtype']}{t['shape']}"


@click.command("compile")
@click.argument("model", type=click.Path(exists=True, dir_okay=False, path_type=Path))
@click.option("-o", "--output", "outdir", required=True, type=click.Path(file_okay=False, path_type=Path),
              help="directory for model.so, metadata.json (and weights.bin)")
@click.option("--separate-weights", is_flag=True, help="write the weights to weights.bin, sent to the device on their own (MODEL_LOAD)")
@click.option("--no-kernels", is_flag=True, help="generate every operator with TVM; call no firmware kernels")
@click.option("--op-by-op", is_flag=True,
              help="one firmware kernel call per operator, instead of handing the longest supported run of "
                   "operators to one onnx_subgraph call (the default; docs/kernels.md, Subgraphs)")
@click.option("--target", default=None,
              help="CPU to generate code for: x86-64-v3 (default: portable to any AVX2 machine, no slower "
                   "here), native (this machine's CPU), x86-64-v4 (AVX-512), x86-64-v2, or an LLVM CPU name "
                   "(znver4, icelake-server ...). Recorded in the module; the device refuses a module for "
                   "a CPU it lacks.")
@click.option("--weights", "weights", type=click.Choice(["float32", "float16", "int8"]), default="float32",
              show_default=True,
              help="store weights in reduced precision (implies --separate-weights): int8 = per-channel "
                   "symmetric for conv/matmul weights, float16 elsewhere; float16 = float16 everywhere")
@click.option("--shape", "shapes", multiple=True, metavar="NAME=D0,D1,...",
              help="static shape of a dynamic input (repeatable)")
@click.option("--dim", "dims", multiple=True, metavar="NAME=V",
              help="value of a symbolic dimension of the inputs (repeatable)")
@click.option("--no-verify", is_flag=True,
              help="skip running the module on a device against onnxruntime (or TVM's unoptimized build)")
@click.option("--quantize", type=click.Choice(["int8"]), default=None,
              help="int8 post-training quantization of Conv/Gemm/MatMul (needs --calibrate; docs/quantize.md)")
@click.option("--calibrate", "calibrate", type=click.Path(dir_okay=False, path_type=Path), default=None,
              metavar="INPUTS.npz",
              help="calibration inputs for --quantize: one array per model input, samples along axis 0")
@cost.option("record in metadata.json the estimated board time of each kernel call under this timing-model profile")
@click.option("--json", "as_json", is_flag=True, help="print the metadata as JSON")
def compile_cmd(model, outdir, separate_weights, no_kernels, op_by_op, target, weights, shapes, dims, no_verify, quantize,
                calibrate, cost_model, as_json):
    """Compile an ONNX MODEL into a module the device loads at run time (DYN_LOAD).

    The compiled module is run once on a private device against a reference
    before the command succeeds (--no-verify skips it)."""
    from ..compiler.checks import parse_dims, parse_shapes
    from ..compiler.onnx import compile_onnx
    from ..host.verifier import DeviceVerifier

    cost.check(cost_model)  # before the compiler's minutes
    with DeviceVerifier() as verifier:  # its device starts only if the module is verified
        meta = compile_onnx(model, outdir, separate_weights=separate_weights, kernels=not no_kernels,
                            subgraph=False if op_by_op else None, target=target, verify=not no_verify,
                            verifier=verifier, shapes=parse_shapes(shapes), dims=parse_dims(dims), weights=weights,
                            progress=not as_json, quantize=quantize, calibrate=calibrate,
                            cost_model=cost_model)
    if as_json:
        click.echo(json.dumps({"status": "ok", "outdir": str(outdir), **meta}))
        return
    io = meta["io"]
    so = outdir / meta["module"]
    lines = [f"{so}  ({_size(so.stat().st_size)}, {meta['target']['mcpu']}, "
             f"{sum(meta['timings'].values()):.1f} s)",
             f"  entry     {meta['entry']}",
             "  inputs    " + ", ".join(_shape(t) for t in meta["inputs"]),
             "  outputs   " + ", ".join(_shape(t) for t in meta["outputs"]),
             f"  io bytes  in {io['input_bytes']}, out {io['output_bytes']}",
             f"  workspace {_size(meta['workspace_bytes'])}",
             "  kernels   " + (", ".join(meta["kernel_imports"]) or "none")]
    w = meta["weights"]
    lines.append(f"  weights   {w['mode']}" + (f" → {outdir / w['file']} ({w['count']} tensors)"
                                               if w["file"] else ""))
    prec = meta.get("weights_precision") or {}
    if prec.get("mode", "float32") != "float32":
        lines.append(f"  precision {prec['mode']}: {prec['int8']} int8, {prec['float16']} float16 tensors, "
                     f"{_size(prec['float32_bytes'])} -> {_size(prec['stored_bytes'])}")
    q = meta.get("quantize")
    if q:
        lines.append(f"  quantized {q['mode']}: " + ", ".join(f"{n} {k.split('.')[-1]}"
                                                          for k, n in sorted(q["kernels"].items()))
                     + f" (calibrated on {q['samples']} samples)")
    lines.append(f"  target    {meta['target']['mcpu']} (needs {', '.join(meta.get('cpu_features', [])) or '-'})")
    lines.append("  verified  " + _verified(meta.get("verify")))
    if meta.get("cost_estimate"):
        lines += cost.summary(meta["cost_estimate"], width=10)
    click.echo("\n".join(lines))


def _verified(v) -> str:
    if v is None:
        return "no (--no-verify)"
    if "skipped" in v:
        return f"no: {v['skipped']}"
    if "vs_qdq" in v:  # --quantize: on the calibration samples
        return "; ".join(f"{k}: vs onnxruntime QDQ int8 max abs error {d['max_abs']:.2g} "
                         f"({100 * d['rel']:.2g} %), top-1 vs float32 {100 * v['vs_float32'][k]['top1']:.0f} %"
                         for k, d in v["vs_qdq"].items()) + f" ({v['samples']} calibration samples)"
    worst = max(v["max_abs_error"].values(), default=0.0)
    text = f"against {v['reference']} on random inputs, max abs error {worst:.2g}"
    e32 = v.get("error_vs_float32")
    if e32 and "skipped" not in e32:
        text += "; vs float32 weights: " + ", ".join(f"{k} {d['max_abs']:.2g} ({100 * d['rel']:.2g} %)"
                                                    for k, d in e32.items())
    return text

