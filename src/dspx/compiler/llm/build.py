"""Compiling a GGUF into the two device modules and their weights file
(``compile_llm``), and the cached copy every caller shares (``compiled_dir``)."""
from __future__ import annotations

import json
import os
import time
from dataclasses import asdict
from pathlib import Path

from dspx import cache
from dspx.abi import llmpack
from dspx.abi.layout import align, desc_region, side_bytes
from dspx.abi.llmpack import (BATCH_ROWS, CHUNK, CONTEXT, DECODE_BATCH_FILE, DECODE_BATCH_PARALLEL_FILE, DECODE_FILE,
                              DECODE_PARALLEL_FILE, FORMAT, METADATA_FILE, PREFILL_FILE, WEIGHTS_FILE)
from dspx.compiler.module import (IO_META_NAME, SIGNATURE_NAME, Signature, TensorSpec, export_module,
                                  make_io_meta, write_metadata, write_weights)

from .graph import entry
from .tir import vnni_lanes, vector_lanes
from .tuning import prefill_tile_for
from .sizing import Dims, LLMCompileError, check_decode_activations, check_kv_layout, dims_of
from .weights import pack_weights

# The modules are built for the machine they run on, like llama.cpp's
# GGML_NATIVE: AVX-512 here runs the prefill GEMMs ~1.4x faster than the
# portable x86-64-v3 (AVX2) that `dspx compile` defaults to.
LLM_TARGET = "native"


def _llm_pipeline(target, record: dict):
    """The CPU pipeline minus legalization and fusion (every call is already a
    scheduled TIR kernel; TVM's op-pattern analysis wants block-form TIR), with
    the same workspace probe as the ONNX compiler."""
    import tvm
    from tvm import relax
    from tvm.relax.backend.cpu_generic import pipeline as cpu_generic
    from dspx.compiler.onnx import _pipeline

    probe = [p for p in _pipeline(target, record).passes if p.info.name == "dspx.RecordWorkspace"]
    finalize = cpu_generic.finalize_passes(target)
    passes = ([relax.transform.ToNonDataflow(), relax.transform.RemovePurityChecking(),
               relax.transform.CallTIRRewrite()] + finalize[:1] + probe + finalize[1:])
    return tvm.transform.Sequential(passes, name="dspx.llm_pipeline")


def _signature(d: Dims, M: int, weights, digest) -> Signature:
    kv_in = []
    for i in range(d.n_layers):
        kv_in += [TensorSpec(f"k{i}", d.kv_shape, d.kv_dtype), TensorSpec(f"v{i}", d.kv_shape, d.kv_dtype)]
    inputs = [TensorSpec("ids", (1, M), "int64"), TensorSpec("positions", (1, M), "int64"),
              TensorSpec("bases", (1, M), "int64")] + kv_in
    outputs = [TensorSpec("logits", (1, M, d.vocab), "float32")] + [
        TensorSpec(t.name + "_out", t.shape, t.dtype) for t in kv_in]
    return Signature(entry="main", inputs=inputs, outputs=outputs, kernel_imports=[], workspace_bytes=0,
                     weights="separate", num_weights=len(weights), weights_digest=digest)


def kv_resident_reserve(sig: Signature) -> dict:
    """What a KV-resident call really uses: the non-KV inputs (KV inputs live in
    the KV region, but their descriptors still sit in input_buf) and only the
    first output (logits)."""
    n_in = len(sig.inputs)
    return {"input_bytes": desc_region(n_in) + sum(align(t.nbytes) for t in sig.inputs[:3]),
            "output_bytes": side_bytes([sig.outputs[0].nbytes])}


def build_digest() -> str:
    """What an LLM build depends on besides its GGUF and options: the
    compiler (``dspx.compiler.compiler_digest``) and the CPU the default
    target resolves to here (the modules are built for this machine)."""
    from dspx.compiler import compiler_digest
    from dspx.compiler.target import resolve_cpu

    return cache.digest((), compiler_digest(), resolve_cpu(LLM_TARGET))


def gguf_identity(path: Path) -> dict:
    st = path.stat()
    return {"path": str(path.resolve()), "size": st.st_size, "mtime_ns": st.st_mtime_ns}


def compile_llm(gguf_path=None, outdir="build/llm", *, progress: bool = True, parallel_decode_gemv: bool = False,
                context: int = CONTEXT, chunk: int = CHUNK, kv_dtype: str = "float32", target: str = LLM_TARGET,
                kv_layout: str = "blocked", cost_model: str | None = None, decode_activations: str = "int8") -> dict:
    """Compile a Llama GGUF into ``outdir`` (prefill.so, decode.so,
    decode_parallel.so, decode_batch.so, decode_batch_parallel.so, weights.bin, metadata.json); returns the metadata
    (plus ``"timings"``). ``target`` as
    ``dspx compile --target`` (default: this machine); ``kv_layout`` one of
    KV_LAYOUTS (the arrangement inside the KV tensors; both modules share it);
    ``decode_activations`` one of DECODE_ACTIVATIONS (what decode's Q4_1 layers multiply by);
    ``cost_model`` (default ``$DSPX_COST_MODEL``): record the estimated prefill
    and decode tok/s on that profile's board in metadata "cost_estimate"."""
    from dspx.compiler.onnx import _Progress
    from dspx.compiler.target import cpu_features, make_target, missing_here
    from dspx.llm import read_gguf

    outdir = Path(outdir)
    prog = _Progress(progress)
    t_all = time.perf_counter()
    model = read_gguf(gguf_path, progress=progress)  # raises GGUFNotFoundError / UnsupportedArchitectureError
    d = dims_of(model.config, context, chunk, kv_dtype, kv_layout, decode_activations)
    with prog.stage("pack", f"repack {model.path.name} quantized blocks ({len(model.tensors)} tensors)"):
        weights = pack_weights(model, d)
    import tvm

    target_dict = make_target(target)
    features = cpu_features(target_dict["mcpu"])
    target = tvm.target.Target(target_dict)
    outdir.mkdir(parents=True, exist_ok=True)
    with prog.stage("weights", f"write {WEIGHTS_FILE}"):
        digest = write_weights(outdir / WEIGHTS_FILE, weights)
    lanes = vector_lanes(features)
    vnni = vnni_lanes(features)  # int8 decode and batch block sums on vpdpbusd (0: int16), the same bits either way
    with prog.stage("tile", "choose the prefill GEMM micro-tile"):
        tile = prefill_tile_for(d, target, lanes, runs_here=not missing_here(features))
    entries = {}
    # Decode twice: GEMVs on one thread and on all of them; the host times both
    # at load and keeps the faster on that machine (two threads lose when the
    # other CPU is busy: TVM's workers spin on the CPU the IPC needs).
    builds = [("prefill", chunk, PREFILL_FILE, True), ("decode", 1, DECODE_FILE, parallel_decode_gemv)]
    if not parallel_decode_gemv:
        builds.append(("decode_parallel", 1, DECODE_PARALLEL_FILE, True))
    # serve-llm --parallel's decode step, on one thread and on all (timed when the slots are set); both sum
    # every output in the serial decode's order (the batch's attention never splits a head's positions)
    builds += [("decode_batch", BATCH_ROWS, DECODE_BATCH_FILE, False),
               ("decode_batch_parallel", BATCH_ROWS, DECODE_BATCH_PARALLEL_FILE, True)]
    for name, M, fname, parallel in builds:
        with prog.stage(f"build_{name}", f"build {name} (M={M}) for {target_dict['mcpu']}"):
            mod = entry(d, M, weights, parallel, batch=name.startswith("decode_batch"), tile=tuple(tile["tile"]),
                        lanes=lanes, vnni=vnni)
            record: dict = {}
            with target:
                mod = _llm_pipeline(target, record)(mod)
            ex = tvm.compile(mod, target, relax_pipeline=None)
        with prog.stage(f"export_{name}", f"export {outdir / fname}"):
            sig = _signature(d, M, weights, digest)
            sig.cpu_features = features  # the device refuses the module where one is missing
            sig.target_cpu = target_dict["mcpu"]
            sig.workspace_bytes = record.get("workspace_bytes", 0)
            io_meta = make_io_meta(sig.inputs, sig.outputs)
            export_module(ex, outdir / fname, {IO_META_NAME: io_meta.encode(), SIGNATURE_NAME: sig.encode()})
            reserve = kv_resident_reserve(sig)
            meta = write_metadata(outdir / f"{name}.json", sig, io_meta, target=target_dict,
                                  tvm_version=tvm.__version__, module_file=fname, weights_file=WEIGHTS_FILE,
                                  io_reserve=reserve)
            entries[name] = meta
    offsets, kv_end = llmpack.kv_offsets(2 * d.n_layers, d.kv_bytes)
    kv_tensors = [{"name": f"{kind}{i}", "layer": i, "kind": kind, "offset": offsets[2 * i + j]}
                  for i in range(d.n_layers) for j, kind in enumerate("kv")]
    meta = {
        "format": FORMAT,
        "model": {"name": model.config.name, "architecture": "llama", **asdict(d)},
        "gguf": gguf_identity(model.path),
        "tokenizer": {"source": "gguf", "gguf": str(model.path.resolve()),
                      "eos_id": int(model.metadata("tokenizer.ggml.eos_token_id", 2)),
                      "chat_template": "tokenizer.chat_template"},
        "context": d.context, "prefill_chunk": d.chunk, "batch_rows": BATCH_ROWS,
        "weights": {"file": WEIGHTS_FILE, "digest": digest, "count": len(weights),
                    "bytes": (outdir / WEIGHTS_FILE).stat().st_size,
                    "storage": "GGUF blocks repacked: Q4_1 linear layers (f16 d, f16 m, 4-bit q), "
                               "Q8_0 embedding/LM head (f16 d, int8 q), F32 norms, F32 RoPE tables"},
        "kv": {"order": "k0, v0, k1, v1, ...", "shape": list(d.kv_shape), "dtype": d.kv_dtype,
               "arrangement": d.kv_layout,
               "tensor_bytes": d.kv_bytes, "count": len(kv_tensors),
               "total_bytes": kv_end,
               "layout": "KV region base + i * tensor_bytes (the device packs KV outputs there, 64-aligned)",
               "tensors": kv_tensors, "k_rope": "pairwise (GGUF row order), applied before caching"},
        "modules": entries,
        "compiler": {"digest": build_digest(), "tvm_version": tvm.__version__, "target": target_dict,
                     "prefill_tile": tile,
                     # what the int8 decode and batch GEMVs sum a block with
                     # (None: float32 activations, no integer block sums)
                     "int8_block_sum": (None if d.decode_activations != "int8" else
                                        f"vpdpbusd-{32 * vnni}" if vnni else "int16")},
    }
    cost = _cost_estimate(d, cost_model)
    if cost is not None:
        meta["cost_estimate"] = cost
    (outdir / METADATA_FILE).write_text(json.dumps(meta, indent=2) + "\n")
    meta["timings"] = dict(prog.times, total=time.perf_counter() - t_all)
    return meta


def _cost_estimate(d: Dims, cost_model: str | None) -> dict | None:
    """Estimated prefill/decode on the board (dspx.costmodel.estimate) when a
    cost model is asked for; None when off."""
    if not (cost_model or os.environ.get("DSPX_COST_MODEL")):
        return None
    from dspx.costmodel import estimate

    try:
        return estimate.when_requested(cost_model, lambda params, **kw: estimate.estimate_llm(d, params, **kw))
    except estimate.EstimateError as e:
        raise LLMCompileError(str(e)) from None


def compiled_dir(gguf_path=None, cache_dir=None, progress: bool = True, *, context: int = CONTEXT,
                 kv_dtype: str = "float32", kv_layout: str | None = None,
                 decode_activations: str = "int8", target: str = LLM_TARGET) -> Path:
    """A compiled copy of ``gguf_path`` under ``cache_dir``/llm (default: the
    dspx cache's "llm" area), compiled once per build digest, GGUF identity,
    context, KV dtype, KV layout (default ``$DSPX_LLM_KV_LAYOUT``, else
    "blocked"), decode activations and ``target`` (``compile_llm``'s).  Builds there by an older
    compiler are deleted first."""
    from dspx.llm import find_default_gguf

    kv_layout = kv_layout or os.environ.get("DSPX_LLM_KV_LAYOUT") or "blocked"
    check_kv_layout(kv_layout)
    check_decode_activations(decode_activations)
    path = find_default_gguf() if gguf_path is None else Path(gguf_path)
    if not path.is_file():
        from dspx.llm import GGUFNotFoundError
        raise GGUFNotFoundError(f"GGUF file not found: {path}")
    options = {"context": context, "kv_dtype": kv_dtype, "kv_layout": kv_layout,
               "decode_activations": decode_activations, "target": target}
    digest = build_digest()
    key = cache.digest((), digest, json.dumps(gguf_identity(path), sort_keys=True), json.dumps(options, sort_keys=True))
    area = Path(cache_dir) / "llm" if cache_dir else cache.area("llm")
    out = area / key
    if not (out / METADATA_FILE).exists():
        # builds by an older compiler go (~95 MB each); what has no dspx metadata stays
        cache.prune(area, lambda e: not _stale(e, digest))
        cache.publish(out, lambda tmp: compile_llm(path, tmp, progress=progress, context=context,
                                                   kv_dtype=kv_dtype, kv_layout=kv_layout,
                                                   decode_activations=decode_activations, target=target),
                      complete=METADATA_FILE)
    return out


def _stale(entry: Path, digest: str) -> bool:
    """A build whose metadata says another build digest (an entry without
    dspx metadata is not ours to delete)."""
    try:
        return json.loads((entry / METADATA_FILE).read_text())["compiler"]["digest"] != digest
    except (OSError, ValueError, KeyError, TypeError):
        return False
