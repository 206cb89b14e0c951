"""Writing modules: blobs linked into the ELF, weights files, metadata.json.
The format itself lives in ``dspx.abi.modformat`` (shared with the device
loader); its names are re-exported here for the compiler's convenience."""
from __future__ import annotations

import json
import os
import subprocess
import tempfile
from pathlib import Path

import numpy as np

# The format's names, re-exported: the compiler speaks it.
from dspx.abi.modformat import (ALIGN, IO_META_NAME, IO_META_SYMBOL, METADATA_FILE, MODULE_FILE,  # noqa: F401
                            SIGNATURE_FORMAT, SIGNATURE_NAME, SIGNATURE_SYMBOL, WEIGHTS_FILE, WEIGHTS_MAGIC,
                            WEIGHTS_VERSION, IoMeta, Signature, TensorSpec, Weights, WeightsError,
                            WeightTensor, _WHEADER, encode_weights, make_io_meta, read_weights)


# ---------------------------------------------------------------- ELF symbols

def blob_c_source(blobs: dict[str, bytes]) -> str:
    """C source defining, per blob NAME, objcopy-style symbols:
    ``_binary_NAME_start`` (the bytes), ``_binary_NAME_end`` (one past) and
    ``_binary_NAME_size`` (absolute symbol whose value is the size)."""
    parts = []
    for name, data in blobs.items():
        start = f"_binary_{name}_start"
        body = ",".join(str(b) for b in data)
        parts.append(f'__attribute__((visibility("default"), used, aligned(8)))\n'
                     f"const unsigned char {start}[{len(data)}] = {{{body}}};\n"
                     f'__asm__(".globl _binary_{name}_end\\n.set _binary_{name}_end, {start} + {len(data)}\\n"\n'
                     f'        ".type _binary_{name}_end, @notype\\n.size _binary_{name}_end, 0\\n"\n'
                     f'        ".globl _binary_{name}_size\\n.set _binary_{name}_size, {len(data)}\\n");\n')
    return "\n".join(parts)


def export_module(executable, path, blobs: dict[str, bytes]) -> Path:
    """``executable.export_library(path)`` with ``blobs`` linked in as symbols
    (compiled from generated C, passed as an extra object through ``addons``)."""
    path = Path(path)
    with tempfile.TemporaryDirectory(prefix="dspx-blobs-") as tmp:
        src = Path(tmp, "blobs.c")
        obj = Path(tmp, "blobs.o")
        src.write_text(blob_c_source(blobs))
        subprocess.run(["gcc", "-c", "-fPIC", "-o", str(obj), str(src)], check=True,
                       capture_output=True, text=True)
        executable.export_library(str(path), addons=[str(obj)], workspace_dir=tmp)
    return path


def write_weights(path, named: list[tuple[str, np.ndarray]]) -> str:
    """Write ``weights.bin``; returns its digest."""
    data = encode_weights(named)
    Path(path).write_bytes(data)
    return "sha256:" + _WHEADER.unpack_from(data)[5].hex()


# ---------------------------------------------------------------- metadata.json

def write_metadata(path, signature: Signature, io_meta: IoMeta, *, target: dict, tvm_version: str,
                   module_file: str = MODULE_FILE, weights_file: str | None = None,
                   io_reserve: dict | None = None, extra: dict | None = None) -> dict:
    """``metadata.json``: what the host needs to drive the module.

    ``io_reserve`` ({"input_bytes", "output_bytes"}) is set only when the
    io_meta table over-declares what a call really uses; null otherwise.
    ``extra``: more top-level fields (the ONNX compiler's cpu_features,
    weights_precision and verify reports)."""

    def tensors(specs):
        return [dict(t.to_json(), nbytes=t.nbytes) for t in specs]

    meta = {
        "format": "dspx-module/1",
        "module": module_file,
        "entry": signature.entry,
        "inputs": tensors(signature.inputs),
        "outputs": tensors(signature.outputs),
        "io": {"num_inputs": io_meta.num_inputs, "num_outputs": io_meta.num_outputs,
               "input_bytes": io_meta.input_bytes, "output_bytes": io_meta.output_bytes,
               "flags": io_meta.flags},
        "io_reserve": io_reserve,
        "weights": {"mode": signature.weights, "file": weights_file,
                    "count": signature.num_weights, "digest": signature.weights_digest},
        "kernel_imports": list(signature.kernel_imports),
        "workspace_bytes": signature.workspace_bytes,
        "target": target,
        "tvm_version": tvm_version,
        **(extra or {}),
    }
    tmp = Path(path).with_suffix(".json.tmp")
    tmp.write_text(json.dumps(meta, indent=2) + "\n")
    os.replace(tmp, path)
    return meta
