"""``dspx compile MODEL.onnx -o OUTDIR``: the compiler's CLI command (added to
the main group in dspx.cli).  Progress goes to stderr, the summary to stdout."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import click


def _size(n: int) -> str:
    return f"{n / 2**20:.2f} MiB" if n >= 2**20 else f"{n / 1024:.1f} KiB"


def _shape(t: dict) -> str:
    return f"{t['name']} {t['dtype']}{t['shape']}"


@click.command("compile")
@click.argument("model", type=click.Path(exists=True, dir_okay=False, path_type=Path))
@click.option("-o", "--output", "outdir", required=True, type=click.Path(file_okay=False, path_type=Path),
              help="directory for model.so, metadata.json (and weights.bin)")
@click.option("--separate-weights", is_flag=True, help="write the weights to weights.bin (sent with MODEL_LOAD)")
@click.option("--no-kernels", is_flag=True, help="generate every operator with TVM; call no firmware kernels")
@click.option("--json", "as_json", is_flag=True, help="print the metadata as JSON")
def compile_cmd(model, outdir, separate_weights, no_kernels, as_json):
    """Compile an ONNX MODEL into a module the device can DYN_LOAD."""
    from dspx.compiler.onnx import CompileError, compile_onnx

    try:
        meta = compile_onnx(model, outdir, separate_weights=separate_weights, kernels=not no_kernels)
    except CompileError as e:
        if as_json:
            click.echo(json.dumps({"status": "error", "error": "CompileError", "message": str(e),
                                   "operators": e.operators}))
        else:
            click.echo(f"error: {e}", err=True)
        sys.exit(1)
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
    click.echo("\n".join(lines))


compile = compile_cmd  # the name dspx.cli looks up  # noqa: A001
