"""``dspx info PATH``: what a compiled module, an LLM package, a GGUF or an ONNX model holds."""
from __future__ import annotations

import json
from pathlib import Path

import click

from .. import fmt
from ..errors import DspxError
from . import cost


# ---------------------------------------------------------------- ELF
def elf_facts(so: Path) -> dict:
    """From the module file itself: the symbols it imports (each must be in
    the device's export table, docs/exports.md) and its embedded io_meta."""
    from elftools.common.exceptions import ELFError
    from elftools.elf.elffile import ELFFile

    from ..abi import modformat as fmt_
    from ..abi.protocol import IoMeta

    with open(so, "rb") as f:
        try:
            elf = ELFFile(f)
        except ELFError as e:
            raise DspxError(f"{so} is not an ELF shared object ({e})") from None
        dyn = elf.get_section_by_name(".dynsym")
        imports = sorted({s.name for s in dyn.iter_symbols() if s.name and s["st_shndx"] == "SHN_UNDEF"
                          and s["st_info"]["bind"] != "STB_WEAK"}) if dyn else []  # weak: optional
        io_meta = None
        for name in (".symtab", ".dynsym"):
            sec = elf.get_section_by_name(name)
            found = sec.get_symbol_by_name(fmt_.IO_META_SYMBOL) if sec else None
            if found:
                addr = found[0]["st_value"]
                for seg in elf.iter_segments():
                    if seg["p_type"] == "PT_LOAD" and seg["p_vaddr"] <= addr < seg["p_vaddr"] + seg["p_filesz"]:
                        f.seek(seg["p_offset"] + addr - seg["p_vaddr"])
                        m = IoMeta.decode(f.read(IoMeta.SIZE))
                        io_meta = {"num_inputs": m.num_inputs, "num_outputs": m.num_outputs,
                                   "input_bytes": m.input_bytes, "output_bytes": m.output_bytes,
                                   "exact": bool(m.flags & IoMeta.FLAG_EXACT)}
                break
    return {"file": str(so), "size": so.stat().st_size, "imports": imports, "io_meta": io_meta}


def _tensors(ts) -> list[dict]:
    return [{"name": t["name"], "dtype": t["dtype"], "shape": t["shape"]} for t in ts]


def module_info(so: Path, meta: dict) -> dict:
    out = {"kind": "module", **elf_facts(so)}
    if meta:
        w = meta.get("weights") or {}
        wfile = w.get("file")
        out.update(entry=meta.get("entry"), inputs=_tensors(meta.get("inputs", [])),
                   outputs=_tensors(meta.get("outputs", [])), io_reserve=meta.get("io_reserve"),
                   target_cpu=(meta.get("target") or {}).get("mcpu"), target=meta.get("target"),
                   cpu_features=meta.get("cpu_features"), weights_precision=meta.get("weights_precision"),
                   kernel_imports=meta.get("kernel_imports", []), workspace_bytes=meta.get("workspace_bytes"),
                   subgraphs=meta.get("subgraphs") or [],
                   weights={"mode": w.get("mode"), "file": wfile, "count": w.get("count"),
                            "bytes": (so.parent / wfile).stat().st_size if wfile and (so.parent / wfile).is_file()
                            else None})
        if meta.get("cost_estimate"):  # recorded by `dspx compile --cost-model`
            out["cost_estimate"] = meta["cost_estimate"]
    return out


def llm_info(d: Path, meta: dict) -> dict:
    mods = {}
    for name, m in meta.get("modules", {}).items():
        so = d / m["module"]
        facts = elf_facts(so) if so.is_file() else {"file": str(so), "missing": True}
        mods[name] = {**facts, "inputs": _tensors(m.get("inputs", [])), "outputs": _tensors(m.get("outputs", []))}
    kv = dict(meta.get("kv") or {})
    kv.pop("tensors", None)
    tok = meta.get("tokenizer") or {}
    w = meta.get("weights") or {}
    out = {"kind": "llm", "dir": str(d), "model": meta.get("model"), "context": meta.get("context"),
           "prefill_chunk": meta.get("prefill_chunk"), "kv": kv,
           "chat_template": tok.get("chat_template"), "tokenizer": tok.get("source"),
           "weights": {"file": w.get("file"), "bytes": w.get("bytes"), "count": w.get("count"),
                       "storage": w.get("storage")},
           "target_cpu": ((meta.get("compiler") or {}).get("target") or {}).get("mcpu"), "modules": mods}
    if meta.get("cost_estimate"):  # recorded by `dspx compile-llm --cost-model`
        out["cost_estimate"] = meta["cost_estimate"]
    return out


def gguf_info(path: Path) -> dict:
    try:
        from gguf import GGUFReader
    except ImportError as e:
        from ..errors import missing_extra
        raise missing_extra(e, "`dspx info` on a GGUF") or e
    r = GGUFReader(str(path))

    def field(key):
        f = r.fields.get(key)
        if f is None:
            return None
        v = f.parts[f.data[0]] if f.data else None
        if v is None:
            return None
        if v.dtype.kind == "u" and v.dtype.itemsize == 1:  # strings are uint8 arrays
            return bytes(v).decode("utf-8", errors="replace")
        return v.tolist()[0] if len(v) == 1 else v.tolist()

    arch = field("general.architecture")
    types: dict = {}
    for t in r.tensors:
        types[t.tensor_type.name] = types.get(t.tensor_type.name, 0) + 1
    template = field("tokenizer.chat_template")
    return {"kind": "gguf", "file": str(path), "size": path.stat().st_size, "name": field("general.name"),
            "architecture": arch, "context_length": field(f"{arch}.context_length"),
            "layers": field(f"{arch}.block_count"), "embedding": field(f"{arch}.embedding_length"),
            "heads": field(f"{arch}.attention.head_count"), "kv_heads": field(f"{arch}.attention.head_count_kv"),
            "tensors": len(r.tensors), "tensor_types": types,
            "weights_bytes": int(sum(int(t.n_bytes) for t in r.tensors)),
            "chat_template": template}


def _onnx_tensors(values, skip=()) -> list[dict]:
    from onnx import helper

    out = []
    for v in values:
        if v.name in skip:
            continue
        tt = v.type.tensor_type
        dtype = helper.tensor_dtype_to_np_dtype(tt.elem_type).name if tt.elem_type else "?"
        shape = [d.dim_value if d.HasField("dim_value") else (d.dim_param or "?") for d in tt.shape.dim]
        out.append({"name": v.name, "dtype": dtype, "shape": shape})
    return out


def _offload(model) -> dict:
    """What ``dspx compile`` would hand the firmware by default: the
    compiler's own steps and subgraph partition on a copy of the model."""
    import onnx

    from ..compiler import checks
    from ..compiler.onnx import _partition

    m = onnx.ModelProto()
    m.CopyFrom(model)
    try:
        checks.precheck(m)
    except checks.CompileError as e:
        return {"compiles": False, "why": str(e)}
    checks.rewrite_prelu(m)  # the steps compile_onnx takes before it partitions
    checks.fold_batchnorm(m)
    checks.sum_to_add(m)
    part = _partition(m, True, True)
    return {"compiles": True, "subgraph": part.summary() if part is not None else None,
            "nodes": len(m.graph.node)}


def onnx_info(path: Path) -> dict:
    """An ONNX model before it is compiled: its inputs, outputs, opsets, operators, and what dspx offloads."""
    try:
        import onnx
    except ImportError as e:
        from ..errors import missing_extra
        raise missing_extra(e, "`dspx info` on an ONNX model") or e
    import collections

    try:
        model = onnx.load(str(path))
    except Exception as e:  # noqa: BLE001 — any reason it does not parse
        raise DspxError(f"{path}: not a readable ONNX model ({str(e).splitlines()[0][:200]})") from None
    g = model.graph
    inits = {i.name for i in g.initializer}
    ops = collections.Counter(n.op_type if n.domain in ("", "ai.onnx") else f"{n.domain}.{n.op_type}" for n in g.node)
    return {"kind": "onnx", "file": str(path), "size": path.stat().st_size,
            "producer": " ".join(x for x in (model.producer_name, model.producer_version) if x) or None,
            "ir_version": model.ir_version,
            "opset": {(o.domain or "ai.onnx"): o.version for o in model.opset_import},
            "inputs": _onnx_tensors(g.input, inits), "outputs": _onnx_tensors(g.output),
            "nodes": len(g.node), "operators": dict(ops.most_common()),
            "weights": len(inits), "weights_bytes": int(sum(onnx.numpy_helper.to_array(i).nbytes for i in g.initializer)),
            "offload": _offload(model)}


def _onnx_human(info: dict) -> list[str]:
    def tensor(t):
        return f"{t['name']} {t['dtype']}[{', '.join(map(str, t['shape']))}]"
    lines = [f"{info['file']}: ONNX model, {fmt.size(info['size'])}" + (f", from {info['producer']}"
                                                                      if info["producer"] else ""),
             "  opset      " + ", ".join(f"{d} {v}" for d, v in info["opset"].items())
             + f" (IR version {info['ir_version']})",
             "  inputs     " + ", ".join(map(tensor, info["inputs"])),
             "  outputs    " + ", ".join(map(tensor, info["outputs"][:6]))
             + (f", … {len(info['outputs']) - 6} more (--json lists all)" if len(info["outputs"]) > 6 else ""),
             f"  operators  {info['nodes']} nodes: " + ", ".join(f"{op} {n}" for op, n in info["operators"].items()),
             f"  weights    {info['weights']} tensors, {fmt.size(info['weights_bytes'])}"]
    off = info["offload"]
    if not off["compiles"]:
        lines.append(f"  offload    none: dspx compile refuses it ({off['why']})")
    elif off["subgraph"]:
        sg = off["subgraph"]
        lines.append(f"  offload    {sg['nodes']} of {off['nodes']} nodes in one {sg['kernel']} firmware call ("
                     + ", ".join(f"{op} {n}" for op, n in sg["ops"].items())
                     + f"), {sg['rest_nodes']} nodes left to TVM code (by default; `dspx compile --op-by-op`: "
                     "one call per operator)")
    else:
        lines.append("  offload    no subgraph call: compiled op by op, TVM code with a firmware kernel call "
                     "for each convolution, dense, pooling or softmax it has")
    p = info["file"]
    lines.append(f"  compile    dspx compile {p} -o DIR, then dspx run DIR -i ...")
    return lines


def describe(path) -> dict:
    from .files import is_onnx

    p = Path(path)
    if p.is_file() and p.read_bytes()[:4] == b"GGUF":
        return gguf_info(p)
    if is_onnx(p):
        return onnx_info(p)
    meta_path = p / "metadata.json" if p.is_dir() else p.parent / "metadata.json"
    meta = json.loads(meta_path.read_text()) if meta_path.is_file() else {}
    if p.is_dir() and meta.get("format", "").startswith("dspx-llm/"):
        return llm_info(p, meta)
    if p.is_file() and "modules" in meta:  # one module of an LLM package: its own part of the metadata
        mine = [m for m in meta["modules"].values() if m.get("module") == p.name]
        return module_info(p, mine[0] if mine else {})
    from ..host.vm import find_module
    so, meta = find_module(p)
    return module_info(so, meta)


def _tensor_line(t) -> str:
    return f"{t['name']} {t['dtype']}[{', '.join(map(str, t['shape']))}]"


def _tensor_list(ts, first: int = 6) -> str:
    shown = ", ".join(map(_tensor_line, ts[:first]))
    return shown + (f", … {len(ts) - first} more (--json lists all)" if len(ts) > first else "")


def _human(info: dict) -> list[str]:
    if info["kind"] == "onnx":
        return _onnx_human(info)
    if info["kind"] == "gguf":
        lines = [f"{info['file']}: GGUF, {fmt.size(info['size'])}",
                 f"  model      {info['name']} ({info['architecture']}, {info['layers']} layers, "
                 f"dim {info['embedding']}, {info['heads']} heads / {info['kv_heads']} KV heads)",
                 f"  context    {info['context_length']} tokens (trained)",
                 f"  weights    {info['tensors']} tensors, {fmt.size(info['weights_bytes'])}: "
                 + ", ".join(f"{n} {k}" for k, n in sorted(info["tensor_types"].items()))]
        t = info["chat_template"]
        lines.append(f"  chat       {'template (' + str(len(t)) + ' chars): ' + t.splitlines()[0][:60] if t else 'no template'}")
        return lines
    if info["kind"] == "llm":
        m, kv, w = info["model"] or {}, info["kv"], info["weights"]
        lines = [f"{info['dir']}: LLM package, {m.get('name')} ({m.get('architecture')}, {m.get('n_layers')} layers)",
                 f"  context    {info['context']} tokens, prefill {info['prefill_chunk']} tokens per call",
                 f"  KV cache   {kv.get('count')} tensors {kv.get('dtype')}{kv.get('shape')} in order "
                 f"{kv.get('order')}, {fmt.size(kv.get('total_bytes') or 0)} of the device's KV region",
                 f"  weights    {w['file']}: {fmt.size(w['bytes'] or 0)}, {w['count']} tensors ({w['storage']})",
                 f"  chat       template from the {info['tokenizer']} ({info['chat_template']})",
                 f"  target CPU {info['target_cpu']}"]
        for name, mod in info["modules"].items():
            lines.append(f"  {name:<10} {Path(mod['file']).name}: in " + ", ".join(map(_tensor_line, mod["inputs"][:2]))
                         + (f" (+{len(mod['inputs']) - 2} KV)" if len(mod["inputs"]) > 2 else "")
                         + "; out " + ", ".join(map(_tensor_line, mod["outputs"][:1]))
                         + (f" (+{len(mod['outputs']) - 1} KV)" if len(mod["outputs"]) > 1 else ""))
        return lines + (cost.summary(info["cost_estimate"]) if info.get("cost_estimate") else [])
    lines = [f"{info['file']}: compiled module, {fmt.size(info['size'])}" +
             (f", for CPU {info['target_cpu']}" if info.get("target_cpu") else "")]
    if info.get("cpu_features"):
        lines.append(f"  needs      {len(info['cpu_features'])} CPU features on the device: "
                     + " ".join(info["cpu_features"]))
    if "inputs" in info:
        lines += [f"  entry      {info['entry']}",
                  "  inputs     " + _tensor_list(info["inputs"]),
                  "  outputs    " + _tensor_list(info["outputs"])]
    io = info["io_meta"]
    lines.append("  io_meta    " + (f"{io['num_inputs']} in / {io['num_outputs']} out, input buffer "
                                    f"{io['input_bytes']:,} bytes, output buffer {io['output_bytes']:,} bytes"
                                    if io else "none (the caller sizes the buffers with reserve_io)"))
    if info.get("io_reserve"):
        r = info["io_reserve"]
        lines.append(f"  io_reserve input buffer {r.get('input_bytes', 0):,} bytes, output buffer {r.get('output_bytes', 0):,} bytes "
                     "(what a call really uses; io_meta declares more)")
    if "weights" in info:
        w = info["weights"]
        lines.append(f"  weights    {w['mode']}" + (f": {w['file']} {fmt.size(w['bytes'] or 0)}, {w['count']} tensors"
                                                    if w["file"] else " in the module"))
        lines.append("  kernels    " + (", ".join(info["kernel_imports"]) or "none"))
        for sg in info.get("subgraphs", []):  # dspx.compiler.subgraph: operators offloaded in one call
            lines.append(f"  subgraph   {sg['nodes']} nodes in one {sg['kernel']} call ("
                         + ", ".join(f"{op} {n}" for op, n in sg["ops"].items())
                         + f"), {sg['inputs']} -> {sg['outputs']}, {sg['rest_nodes']} nodes left to TVM")
    lines.append(f"  imports    {len(info['imports'])} symbols from the export table: " + ", ".join(info["imports"]))
    if info.get("cost_estimate"):  # recorded by `dspx compile --cost-model`
        lines += cost.summary(info["cost_estimate"])
        lines.append(f"             per layer: dspx run {Path(info['file']).parent} --input ... --cost-model "
                     f"{info['cost_estimate']['profile']}")
    return lines


def profile_lines(p: dict) -> list[str]:
    """A timing-model profile for people: every parameter with its status and source."""
    lines = [f"profile    {p['name']}: {p['title']}", f"  kind     {p['kind']} ({p['origin']})",
             "  parameters (value unit, status [range when assumed]; source):"]
    for name, q in p["params"].items():
        rng = f" [{q['range'][0]:g}..{q['range'][1]:g}]" if "range" in q else ""
        lines.append(f"    {name:32} {q['value']:g} {q['unit']}, {q['status']}{rng}")
        lines.append(f"      {q['source']}")
    return lines


@click.command("info")
@click.argument("path", type=click.Path(exists=True), required=False)
@click.option("--cost-model", "cost_model", default=None, metavar="NAME|FILE",
              help="print a timing-model profile (j6-vision, c7x-j722s, or your own profile file) instead")
@click.option("--json", "as_json", is_flag=True, help="one JSON object instead of text")
def info(path, cost_model, as_json):
    """What PATH holds: a compiled module (dir or .so), an LLM package (from
    `dspx compile-llm`), a GGUF file or an ONNX model — inputs and outputs,
    buffer sizes, imports, target CPU, weights; for an LLM its context,
    KV-cache layout and chat template; for an ONNX model its opsets,
    operators and what `dspx compile` would offload to the firmware.  With --cost-model: the profile's parameters, each
    with its status and source (docs/cost-model.md)."""
    if cost_model is not None:
        from .. import costmodel

        prof = costmodel.load(cost_model).describe()
        click.echo(json.dumps({"status": "ok", "profile": prof}) if as_json else "\n".join(profile_lines(prof)))
        return
    if path is None:
        raise click.UsageError("give a PATH to describe, or --cost-model NAME")
    facts = describe(path)
    if as_json:
        click.echo(json.dumps({"status": "ok", **facts}))
    else:
        click.echo("\n".join(_human(facts)))
