"""``VirtualMachine``: a compiled module on the device, called like TVM's
``relax.VirtualMachine`` — swap the class, keep the calls.

    vm = VirtualMachine("build/resnet18")      # dir with model.so + metadata.json
    y = vm["main"](x)                          # numpy / DLPack / torch / lists in, copies out
    y = vm["main"](x=x)                        # inputs by name (metadata.json)
    vm.set_input("main", x); vm.invoke_stateful("main"); y = vm.get_outputs("main")
    print(vm.time_evaluator("main", number=10, repeat=3)(x))   # device-side repeat, TVM's figures
    x_dev = vm.create_input((1, 3, 224, 224), "float32")   # lives in input_buf
    views = vm.run_nocopy(x_dev)               # views of output_buf, valid until the next call

Inputs are checked on the host against metadata.json before anything is
staged (``host/inputs.py``).  A directory from ``dspx compile-llm`` holds
several modules sharing one weights file: each is an entry (``vm["prefill"]``,
``vm["decode"]``).
"""
from __future__ import annotations

import contextlib
import io
import json
import re
import statistics
import sys
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from .. import trace
from ..errors import ClosedError, DspxError
from . import inputs as _inputs
from .client import Client
from .profile import ProfileReport, parse as parse_profile

# The device's clock for INFER cycles: 1 GHz nominal, one cycle per nanosecond
# of the entry call (device/core/inference.py).
CYCLE_S = 1e-9


def find_module(path) -> tuple[Path, dict]:
    """(model.so path, metadata dict) from a module directory or .so file."""
    p = Path(path)
    so = p / "model.so" if p.is_dir() else p
    if p.is_dir() and not so.is_file() and (p / "metadata.json").is_file():
        meta = json.loads((p / "metadata.json").read_text())
        if "modules" in meta:  # an LLM package: several modules, one weights file
            return p / "metadata.json", meta
    if not so.is_file():
        raise DspxError(f"no compiled module at {so} (build one with `dspx compile MODEL.onnx -o DIR`)")
    meta_path = so.parent / "metadata.json"
    meta = json.loads(meta_path.read_text()) if meta_path.is_file() else {}
    return so, meta


@dataclass
class BenchmarkResult:
    """Timing figures shaped like ``tvm.runtime.BenchmarkResult``: seconds,
    one result per repeat (the mean of ``number`` runs), measured on the
    device around the entry call."""

    results: list = field(default_factory=list)

    @property
    def mean(self) -> float:
        return statistics.fmean(self.results)

    @property
    def median(self) -> float:
        return statistics.median(self.results)

    @property
    def std(self) -> float:
        return statistics.pstdev(self.results)

    @property
    def min(self) -> float:
        return min(self.results)

    @property
    def max(self) -> float:
        return max(self.results)

    def __str__(self) -> str:
        head = "Execution time summary (device clock, 1 GHz nominal):\n"
        cols = ("mean (ms)", "median (ms)", "max (ms)", "min (ms)", "std (ms)")
        vals = (self.mean, self.median, self.max, self.min, self.std)
        return head + " ".join(f"{c:>12}" for c in cols) + "\n" + " ".join(f"{v * 1e3:12.4f}" for v in vals)


@dataclass
class _Entry:
    module: object  # client.LoadedModule
    inputs: list
    outputs: list


class VirtualMachine:
    def __init__(self, module, client: Client | None = None, *, socket: str | None = None, **client_opts):
        so, self.metadata = find_module(module)
        if client is not None and not hasattr(client, "load_module"):
            client = None  # TVM's device argument (tvm.cpu()): here the device is the DSP
        self._own_client = client is None
        self.client = client or Client(socket, **client_opts)
        self.model_id = 0
        self.handle = None
        self.last_cycles = 0
        self.last_printf = ""
        self._entries: dict[str, _Entry] = {}
        self._set: dict[str, tuple] = {}
        self._outputs: dict[str, object] = {}
        try:
            subs = self.metadata.get("modules")
            files = ({name: (so.parent / m["module"], m) for name, m in subs.items()} if subs
                     else {self.metadata.get("entry", "main"): (so, self.metadata)})
            for name, (path, meta) in files.items():
                mod = self.client.load_module(path.read_bytes())
                self._entries[name] = _Entry(mod, _inputs.specs(meta), _inputs.specs(meta, "outputs"))
            self.entry = next(iter(self._entries))
            self.module = self._entries[self.entry].module
            self.handle = self.module.handle
            # metadata.json names a separate weights file as weights.file (docs/compiler.md)
            w = self.metadata.get("weights")
            wfile = (w.get("file") if isinstance(w, dict) else None) or self.metadata.get("weights_file")
            if wfile:
                self.model_id, _ = self.client.load_weights((so.parent / wfile).read_bytes())
        except BaseException:
            self.close()
            raise

    # ------------------------------------------------------------------ entries
    @property
    def entries(self) -> list[str]:
        return list(self._entries)

    def _entry(self, name: str) -> _Entry:
        if self.client is None:
            raise ClosedError("this VirtualMachine is closed")
        e = self._entries.get(name)
        if e is None:
            raise KeyError(f"module has no function {name!r} (entries: {', '.join(map(repr, self._entries))})")
        return e

    def __getitem__(self, name: str):
        self._entry(name)

        def call(*args, **named):
            t0 = trace.clock() if trace.on else 0
            try:
                outs = [np.array(v, copy=True) for v in self._run(args, named, fn=name)]
            finally:
                if t0:
                    trace.complete(f"vm[{name!r}] (infer + copy-out)", t0, "host", top=True)
            return outs[0] if len(outs) == 1 else outs
        call.__name__ = name
        return call

    def input_specs(self, name: str | None = None) -> list:
        return self._entry(name or self.entry).inputs

    def output_specs(self, name: str | None = None) -> list:
        return self._entry(name or self.entry).outputs

    # ------------------------------------------------------------------ calls
    def _run(self, args, named=None, repeat: int = 0, kv_resident: bool = False, kv_inputs=(), fn=None):
        fn = fn or self.entry
        e = self._entry(fn)
        arrays = _inputs.bind(e.inputs, args, named or {}, fn, skip=[k[0] for k in kv_inputs])
        res = self.client.infer(e.module.handle, arrays, model_id=self.model_id, repeat=repeat,
                                kv_resident=kv_resident, kv_inputs=kv_inputs)
        self.last_cycles = res.cycles
        self.last_printf = res.printf
        return [self.client.output_view(d) for d in res.descs]

    def run_nocopy(self, *inputs, fn: str | None = None, repeat: int = 0, kv_resident: bool = False,
                   kv_inputs=(), **named):
        """Outputs as views of output_buf: valid until the next call."""
        outs = self._run(inputs, named, repeat, kv_resident, kv_inputs, fn)
        return outs[0] if len(outs) == 1 else outs

    # TVM's stateful calls: inputs set once, outputs kept until the next invoke.
    def set_input(self, func_name: str, *args, **kwargs) -> None:
        e = self._entry(func_name)
        self._set[func_name] = tuple(_inputs.bind(e.inputs, args, kwargs, func_name))

    def invoke_stateful(self, func_name: str) -> None:
        if func_name not in self._set:
            self._entry(func_name)
            raise DspxError(f"set_input({func_name!r}, ...) before invoke_stateful({func_name!r})")
        outs = self[func_name](*self._set[func_name])
        self._outputs[func_name] = outs

    def get_outputs(self, func_name: str):
        if func_name not in self._outputs:
            self._entry(func_name)
            raise DspxError(f"invoke_stateful({func_name!r}) before get_outputs({func_name!r})")
        return self._outputs[func_name]

    def time_evaluator(self, func_name: str, dev=None, number: int = 10, repeat: int = 1, min_repeat_ms: int = 0,
                       **_ignored):
        """A function that times ``func_name`` like TVM's ``time_evaluator``:
        ``number * repeat`` runs in one INFER (the device repeats the entry,
        the protocol's repeat field), ``results`` the mean of each ``number``.
        ``func_name="invoke_stateful"`` times the entry named by its argument
        with the inputs given to ``set_input``."""
        from ..abi.protocol import REPEAT_MASK

        if number < 1 or repeat < 1 or number * repeat > REPEAT_MASK:
            raise ValueError(f"number * repeat must be 1..{REPEAT_MASK} (got {number} * {repeat})")

        def evaluate(*args, **named) -> BenchmarkResult:
            fn = func_name
            if fn == "invoke_stateful":
                fn = args[0]
                if fn not in self._set:
                    raise DspxError(f"set_input({fn!r}, ...) before timing invoke_stateful({fn!r})")
                args, named = self._set[fn], {}
            runs = self._timed_runs(args, named, fn, number * repeat)
            return BenchmarkResult([statistics.fmean(runs[i * number:(i + 1) * number]) * CYCLE_S
                                    for i in range(repeat)])
        return evaluate

    def _timed_runs(self, args, named, fn, n: int) -> list[int]:
        """Per-run device cycles of ``n`` runs in one INFER."""
        if n == 1:
            self._run(args, named, fn=fn)
            return [self.last_cycles]
        with contextlib.redirect_stderr(io.StringIO()):  # the per-run lines are ours to read, not to show
            self._run(args, named, repeat=n, fn=fn)
        runs = [int(c) for c in re.findall(r"^run \d+: (\d+) cycles$", self.last_printf, re.M)]
        if len(runs) != n:
            raise DspxError(f"the device reported {len(runs)} run times for {n} runs")
        return runs

    def profile(self, *inputs, runs: int = 1, fn: str | None = None, **named) -> ProfileReport:
        """Per-operator device times of one call of ``fn`` (the entry by
        default), run ``runs`` times with every call timed on the device;
        inputs as for ``vm[fn](...)``.  One INFER with the PROFILE flag
        (docs/protocol.md, "Profile records"): the core runs the entry on an
        instrumented copy of the module's VM and writes one row per call site
        to the printf ring, which ``dspx.host.profile`` reads into the report."""
        if not 1 <= runs <= 0xFFFF:
            raise ValueError(f"runs must be 1..65535, got {runs}")
        fn = fn or self.entry
        e = self._entry(fn)
        arrays = _inputs.bind(e.inputs, inputs, named, fn)
        res = self.client.infer(e.module.handle, arrays, model_id=self.model_id, repeat=runs if runs > 1 else 0,
                                profile=True)
        rep = parse_profile(res.printf)
        if runs > 1:  # the per-run lines are the repeat's, not the user's printf
            rep.printf = re.sub(r"^run \d+: \d+ cycles\n", "", rep.printf, flags=re.M)
        if rep.printf:
            sys.stderr.write(rep.printf)
        self.last_cycles = res.cycles
        return rep

    def create_input(self, shape, dtype="float32") -> np.ndarray:
        self._entry(self.entry)
        return self.client.create_input(shape, dtype)

    def reserve_io(self, input_bytes: int, output_bytes: int) -> None:
        self._entry(self.entry)
        self.client.reserve_io(input_bytes, output_bytes, self.module.io_num_inputs)

    # ------------------------------------------------------------------ lifetime
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def close(self) -> None:
        c = getattr(self, "client", None)
        if c is None:
            return
        try:
            if not c._closed:
                if self.model_id:
                    c.unload_weights(self.model_id)
                for e in getattr(self, "_entries", {}).values():
                    c.unload_module(e.module.handle)
        finally:
            self.model_id, self.handle = 0, None
            if self._own_client:
                c.close()
            self.client = None

    def __del__(self):
        if getattr(self, "_own_client", False) and getattr(self, "client", None) is not None:
            try:
                self.client.close()
            except Exception:
                pass


def load_input(path: str, shape=None, dtype=None) -> np.ndarray:
    """An input from .npy, or raw .bin with an explicit shape and dtype."""
    if path.endswith(".npy"):
        return np.load(path)
    if shape is None or dtype is None:
        raise DspxError(f"{path}: raw input needs --shape and --dtype")
    return np.fromfile(path, dtype=dtype).reshape(shape)


__all__ = ["VirtualMachine", "BenchmarkResult", "find_module", "load_input"]
