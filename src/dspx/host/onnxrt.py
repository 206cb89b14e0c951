"""``InferenceSession``: onnxruntime's calls on the device.

    sess = dspx.InferenceSession("model.onnx")     # compiled on first use, cached
    [i.name for i in sess.get_inputs()]            # NodeArg: name, shape, type
    y, = sess.run(None, {"x": x})                  # or run(["y"], feeds)
    io = sess.io_binding(); ...; sess.run_with_iobinding(io)   # host/iobinding.py
    so = dspx.SessionOptions(); so.enable_profiling = True
    sess = dspx.InferenceSession("model.onnx", so); sess.run(...); sess.end_profiling()  # a chrome-trace JSON

An ``.onnx`` file is compiled (``dspx compile``, verified on a private
device) into a directory keyed by its content, the compiler and the options,
in the cache area "sessions" (``dspx.cache``: ``$DSPX_CACHE/sessions``, else
``$XDG_CACHE_HOME/dspx/sessions``, else ``~/.cache/dspx/sessions``); a later
session on the same model loads it from there.  A directory from
``dspx compile`` is loaded as it is.
"""
from __future__ import annotations

import datetime
import json
import os
import sys
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from .. import cache
from ..errors import DspxError, InputError, missing_extra
from . import inputs as _inputs
from .iobinding import IOBinding

# numpy dtype name -> onnxruntime's type string
ORT_TYPES = {"float32": "tensor(float)", "float16": "tensor(float16)", "float64": "tensor(double)",
             "bfloat16": "tensor(bfloat16)", "int8": "tensor(int8)", "int16": "tensor(int16)",
             "int32": "tensor(int32)", "int64": "tensor(int64)", "uint8": "tensor(uint8)",
             "uint16": "tensor(uint16)", "uint32": "tensor(uint32)", "uint64": "tensor(uint64)",
             "bool": "tensor(bool)"}
AREA = "sessions"

# The providers a session accepts: the device, under its name and dspx's; the
# CPU as onnxruntime's usual fallback (nothing falls back here: a model dspx
# cannot compile is refused when the session is made).
DEVICE_PROVIDERS = ("DSPExecutionProvider", "DspxExecutionProvider")
PROVIDERS = (*DEVICE_PROVIDERS, "CPUExecutionProvider")


def check_providers(providers) -> None:
    """Refuse provider lists that ask for something this session does not do."""
    if providers is None:
        return
    if isinstance(providers, str):  # onnxruntime would take it letter by letter
        raise DspxError(f"providers must be a list of names, e.g. [{providers!r}]; got the string {providers!r}")
    names = [p[0] if isinstance(p, (tuple, list)) else p for p in providers]  # (name, options) as onnxruntime
    unknown = [n for n in names if n not in PROVIDERS]
    if unknown:
        raise DspxError(f"unknown execution provider {', '.join(map(repr, unknown))}: dspx.InferenceSession runs "
                        f"on the device, providers {', '.join(PROVIDERS)} (use onnxruntime.InferenceSession for "
                        f"other providers)")
    if names and not any(n in DEVICE_PROVIDERS for n in names):
        raise DspxError(f"providers={names!r} asks for the host CPU only; dspx.InferenceSession runs on the device: "
                        f"add 'DSPExecutionProvider' first, or use onnxruntime.InferenceSession for the CPU")


class SessionOptions:
    """The options of ``onnxruntime.SessionOptions`` that dspx reads: profiling.
    (An ``onnxruntime.SessionOptions`` is accepted too; of it, dspx reads
    the same two fields.)"""

    __slots__ = ("enable_profiling", "profile_file_prefix")

    def __init__(self):
        self.enable_profiling = False
        self.profile_file_prefix = "onnxruntime_profile_"

    def __setattr__(self, name, value):
        if name not in SessionOptions.__slots__:
            raise AttributeError(f"SessionOptions.{name}: dspx reads only {', '.join(SessionOptions.__slots__)} "
                                 f"(the device decides threads, optimization and memory)")
        object.__setattr__(self, name, value)


@dataclass
class ModelMetadata:
    """Like ``onnxruntime.ModelMetadata``, read from the ONNX file."""
    producer_name: str = ""
    graph_name: str = ""
    domain: str = ""
    description: str = ""
    graph_description: str = ""
    version: int = 2 ** 63 - 1  # onnxruntime's figure for a model without model_version
    custom_metadata_map: dict = field(default_factory=dict)


def read_modelmeta(onnx_path) -> ModelMetadata:
    try:
        import onnx
    except ImportError as e:
        raise missing_extra(e, "get_modelmeta()") or e
    m = onnx.load(str(onnx_path), load_external_data=False)
    return ModelMetadata(m.producer_name, m.graph.name, m.domain, m.doc_string, m.graph.doc_string,
                         m.model_version if m.HasField("model_version") else 2 ** 63 - 1,
                         {p.key: p.value for p in m.metadata_props})


class Profiler:
    """Events in onnxruntime's profile format (a chrome-trace JSON array,
    times in µs from the session's start), from dspx's own figures: the host
    clock for the session and each run, the device's profile (one row per call
    site, its cycles at 1 GHz nominal) for the kernels inside a run, laid end
    to end from the run's start (the device reports how long, not when)."""

    def __init__(self, prefix: str):
        self.prefix, self.start_ns, self.events = prefix, time.time_ns(), []

    def now_us(self) -> int:
        return (time.time_ns() - self.start_ns) // 1000

    def add(self, cat: str, name: str, ts: int, dur: int, args: dict | None = None) -> None:
        self.events.append({"cat": cat, "pid": os.getpid(), "tid": os.getpid(), "dur": int(dur), "ts": int(ts),
                            "ph": "X", "name": name, "args": args or {}})

    def run(self, ts: int, dur: int, report) -> None:
        at = ts
        for i, r in enumerate(report.rows):
            us = r.cycles / 1e3 / max(1, report.runs)
            self.add("Node", f"{r.short}_{i}_kernel_time", at, us,
                     {"op_name": r.short, "provider": "DSPExecutionProvider", "kind": r.kind, "calls": str(r.calls),
                      "shapes": r.shapes, "node_index": str(i)})
            at += us
        self.add("Session", "model_run", ts, dur, {"device_us": str(report.entry_cycles // 1000)})

    def write(self) -> str:
        """The profile file in the working directory (a new name, never one that exists)."""
        stamp = datetime.datetime.now().strftime("%Y-%m-%d_%H-%M-%S_%f")[:-3]
        for n in range(1000):
            path = f"{self.prefix}_{stamp}{f'_{n}' if n else ''}.json"
            try:
                with open(path, "x") as f:
                    json.dump(self.events, f)
                return path
            except FileExistsError:
                continue
        raise DspxError(f"end_profiling: could not find a free file name for {self.prefix}_{stamp}.json")


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
        check_providers(providers)
        self._options = sess_options
        self._profiler = (Profiler(getattr(sess_options, "profile_file_prefix", "onnxruntime_profile_"))
                          if getattr(sess_options, "enable_profiling", False) else None)
        t0 = self._profiler.now_us() if self._profiler else 0
        self._vm = None
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
        self.onnx_path = None if p.is_dir() else p
        if p.is_dir():
            self.module_dir, self.compiled_now = p, False
        else:
            try:
                self.module_dir, self.compiled_now = compiled_dir(p, cache_dir, progress, **(compile_options or {}))
            except ImportError as e:  # the compiler's optional dependencies (onnx, tvm)
                raise missing_extra(e, "dspx.InferenceSession on an .onnx file") or e
        from .vm import VirtualMachine

        t1 = self._profiler.now_us() if self._profiler else 0
        self._vm = VirtualMachine(self.module_dir, client, socket=socket)
        meta = self._vm.metadata
        self._inputs = [NodeArg(t["name"], list(t["shape"]), ORT_TYPES.get(t["dtype"], t["dtype"]))
                        for t in meta.get("inputs", [])]
        self._outputs = [NodeArg(t["name"], list(t["shape"]), ORT_TYPES.get(t["dtype"], t["dtype"]))
                         for t in meta.get("outputs", [])]
        if self._profiler:
            self._profiler.add("Session", "model_loading_uri", t0, t1 - t0, {"compiled_now": self.compiled_now})
            self._profiler.add("Session", "session_initialization", t1, self._profiler.now_us() - t1)

    def get_inputs(self) -> list[NodeArg]:
        return list(self._inputs)

    def get_outputs(self) -> list[NodeArg]:
        return list(self._outputs)

    def _specs(self, side: str) -> list:
        return self._vm.input_specs() if side == "inputs" else self._vm.output_specs()

    def get_providers(self) -> list[str]:
        return ["DSPExecutionProvider"]

    def get_session_options(self):
        return self._options

    def get_modelmeta(self) -> ModelMetadata:
        """The ONNX file's metadata; a session on a module directory has no
        ONNX file, and its metadata is empty."""
        return read_modelmeta(self.onnx_path) if self.onnx_path is not None else ModelMetadata()

    def run(self, output_names, input_feed: dict, run_options=None) -> list:
        """Outputs named by ``output_names`` (None: all), in that order, as numpy arrays."""
        names = [o.name for o in self._outputs]
        want = names if output_names is None else list(output_names)
        unknown = [n for n in want if n not in names]
        if unknown:
            raise InputError(f"no output named {', '.join(map(repr, unknown))} (outputs: {', '.join(names)})",
                             unknown[0], names, unknown)
        if not isinstance(input_feed, Mapping):  # onnxruntime refuses these too (an AttributeError there)
            example = ", ".join(f"{i.name!r}: ..." for i in self._inputs)
            raise InputError(f"run(): input_feed must be a dict of input name to array, as onnxruntime takes; "
                             f"got {_inputs.what(input_feed)}: pass {{{example}}}", None, "dict",
                             type(input_feed).__name__)
        outs = self._run_entry(input_feed)
        by_name = dict(zip(names, outs))
        return [by_name[n] for n in want]

    def _run_entry(self, input_feed) -> list:
        if self._profiler is None:
            outs = self._vm[self._vm.entry](**input_feed)
            return outs if isinstance(outs, list) else [outs]
        ts = self._profiler.now_us()
        report, views = self._vm.run_profiled((), dict(input_feed), self._vm.entry)
        outs = [np.array(v, copy=True) for v in views]
        self._profiler.run(ts, self._profiler.now_us() - ts, report)
        return outs

    def io_binding(self) -> IOBinding:
        return IOBinding(self)

    def run_with_iobinding(self, iobinding: IOBinding, run_options=None) -> None:
        """Run on the bound inputs; the bound outputs are then in ``iobinding``."""
        iobinding._run(lambda names, feed: self.run(names, feed))

    def end_profiling(self) -> str:
        """Stop profiling and write the profile (onnxruntime's format): its
        file name, or "" when the session was not profiling (onnxruntime's answers)."""
        if self._profiler is None:
            return ""
        path, self._profiler = self._profiler.write(), None
        return path

    def get_profiling_start_time_ns(self) -> int:
        return self._profiler.start_ns if self._profiler else 0

    def close(self) -> None:
        if self._vm is not None:
            self._vm.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


__all__ = ["InferenceSession", "NodeArg", "SessionOptions", "ModelMetadata", "IOBinding", "check_providers"]
