"""``InferenceSession``: onnxruntime's calls on the device.

    sess = dspx.InferenceSession("model.onnx")     # compiled on first use, cached
    [i.name for i in sess.get_inputs()]            # NodeArg: name, shape, type
    y, = sess.run(None, {"x": x})                  # or run(["y"], feeds)

An ``.onnx`` file is compiled (``dspx compile``, verified on a private
device) into a directory keyed by its content, the compiler and the options,
in the cache area "sessions" (``dspx.cache``: ``$DSPX_CACHE/sessions``, else
``$XDG_CACHE_HOME/dspx/sessions``, else ``~/.cache/dspx/sessions``); a later
session on the same model loads it from there.  A directory from
``dspx compile`` is loaded as it is.
"""
from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path

from .. import cache
from ..errors import DspxError, InputError

# numpy dtype name -> onnxruntime's type string
ORT_TYPES = {"float32": "tensor(float)", "float16": "tensor(float16)", "float64": "tensor(double)",
             "bfloat16": "tensor(bfloat16)", "int8": "tensor(int8)", "int16": "tensor(int16)",
             "int32": "tensor(int32)", "int64": "tensor(int64)", "uint8": "tensor(uint8)",
             "uint16": "tensor(uint16)", "uint32": "tensor(uint32)", "uint64": "tensor(uint64)",
             "bool": "tensor(bool)"}
AREA = "sessions"


@dataclass(frozen=True)
class NodeArg:
    """Like ``onnxruntime.NodeArg``."""
    name: str
    shape: list
    type: str


def cache_key(onnx_path, **compile_options) -> str:
    """The model's bytes, the compiler's and the options: what a compiled module depends on."""
    from ..compiler import compiler_digest

    compile_options.pop("verifier", None)  # where the module is checked is no part of it
    return cache.digest([Path(onnx_path)], compiler_digest(), repr(sorted(compile_options.items())), length=24)


def compiled_dir(onnx_path, cache_dir=None, progress: bool = True, **compile_options) -> tuple[Path, bool]:
    """(module directory, whether it was compiled now) for an ONNX file;
    ``compile_options`` go to ``compile_onnx`` (and into the cache key)."""
    from ..compiler.onnx import compile_onnx
    from .verifier import DeviceVerifier

    out = Path(cache_dir or cache.area(AREA)) / cache_key(onnx_path, **compile_options)
    if (out / "metadata.json").is_file():
        return out, False
    if progress:
        print(f"dspx: compiling {onnx_path} for the device (once; cached in {out})", file=sys.stderr, flush=True)

    def build(tmp: Path) -> None:
        with DeviceVerifier() as verifier:  # its device starts only if the module is verified
            compile_onnx(onnx_path, tmp, progress=progress, **{"verifier": verifier, **compile_options})
    cache.publish(out, build, complete="metadata.json")  # a concurrent session sees all of it or none
    return out, True


class InferenceSession:
    def __init__(self, path_or_dir, sess_options=None, providers=None, *, socket: str | None = None,
                 client=None, cache_dir=None, progress: bool = True, compile_options: dict | None = None,
                 **_ort_options):
        from .vm import VirtualMachine

        if isinstance(path_or_dir, (bytes, bytearray)):  # a serialized model, as onnxruntime also takes
            data = bytes(path_or_dir)
            root = Path(cache_dir or cache.area(AREA))
            root.mkdir(parents=True, exist_ok=True)
            path_or_dir = root / f"{cache.digest((), data, length=24)}.onnx"
            if not path_or_dir.exists():
                path_or_dir.write_bytes(data)
        p = Path(path_or_dir)
        if not p.exists():
            raise DspxError(f"{p}: no such model file or module directory")
        if p.is_dir():
            self.module_dir, self.compiled_now = p, False
        else:
            self.module_dir, self.compiled_now = compiled_dir(p, cache_dir, progress, **(compile_options or {}))
        self._vm = VirtualMachine(self.module_dir, client, socket=socket)
        meta = self._vm.metadata
        self._inputs = [NodeArg(t["name"], list(t["shape"]), ORT_TYPES.get(t["dtype"], t["dtype"]))
                        for t in meta.get("inputs", [])]
        self._outputs = [NodeArg(t["name"], list(t["shape"]), ORT_TYPES.get(t["dtype"], t["dtype"]))
                         for t in meta.get("outputs", [])]

    def get_inputs(self) -> list[NodeArg]:
        return list(self._inputs)

    def get_outputs(self) -> list[NodeArg]:
        return list(self._outputs)

    def get_providers(self) -> list[str]:
        return ["DSPExecutionProvider"]

    def run(self, output_names, input_feed: dict, run_options=None) -> list:
        """Outputs named by ``output_names`` (None: all), in that order, as numpy arrays."""
        names = [o.name for o in self._outputs]
        want = names if output_names is None else list(output_names)
        unknown = [n for n in want if n not in names]
        if unknown:
            raise InputError(f"no output named {', '.join(map(repr, unknown))} (outputs: {', '.join(names)})",
                             unknown[0], names, unknown)
        outs = self._vm[self._vm.entry](**input_feed)
        outs = outs if isinstance(outs, list) else [outs]
        by_name = dict(zip(names, outs))
        return [by_name[n] for n in want]

    def close(self) -> None:
        self._vm.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


__all__ = ["InferenceSession", "NodeArg"]
