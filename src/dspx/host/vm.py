"""``VirtualMachine``: a compiled module on the device, called like TVM's
``relax.VirtualMachine`` — swap the class, keep the calls.

    vm = VirtualMachine("build/resnet18")      # dir with model.so + metadata.json
    y = vm["main"](x)                          # numpy / DLPack / torch / lists in, copies out
    y = vm["main"](x=x)                        # inputs by name (metadata.json)
    vm.set_input("main", x); vm.invoke_stateful("main"); y = vm.get_outputs("main")
    print(vm.time_evaluator("main", number=10, repeat=3)(x))   # device-side repeat, TVM's figures
    vm.save_function("main", "on_x", x); vm.time_evaluator("on_x")()   # TVM's closures
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
from ..abi.protocol import REPEAT_MASK
from .profile import ProfileReport, parse as parse_profile

# TVM's VMInstrumentReturnKind.SKIP_RUN: an instrument's "skip this call"
SKIP_RUN = 1

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


@dataclass(frozen=True)
class TensorShape:
    """A tensor argument as an instrument sees it: its shape (the device's
    profile records shapes, not the data)."""
    shape: tuple


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
        self._saved: dict[str, tuple] = {}  # save_function: saved name -> (entry, arrays, include_return)
        self._instrument = None
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
        if name in self._saved:
            return self._saved_call(name)
        self._entry(name)

        def call(*args, **named):
            t0 = trace.clock() if trace.on else 0
            try:
                if self._instrument is not None:
                    rep, views = self.run_profiled(args, named, name)
                    outs = [np.array(v, copy=True) for v in views]
                    self._replay_instrument(rep)
                else:
                    outs = [np.array(v, copy=True) for v in self._run(args, named, fn=name)]
            finally:
                if t0:
                    trace.complete(f"vm[{name!r}] (infer + copy-out)", t0, "host", top=True)
            return outs[0] if len(outs) == 1 else outs
        call.__name__ = name
        return call

    # ------------------------------------------------------------------ TVM's introspection and closures
    def get_function_arity(self, func_name: str) -> int:
        """The number of inputs ``func_name`` takes (metadata.json), as TVM's VM reports it."""
        return len(self._entry(func_name).inputs)

    def get_function_param_name(self, func_name: str, index: int) -> str:
        """The name of input ``index`` of ``func_name``."""
        specs = self._entry(func_name).inputs
        if not 0 <= index < len(specs):  # TVM's ValueError, in its words
            raise ValueError(f"Invalid index for {func_name} ({index} out of {len(specs)})")
        return specs[index].name

    def save_function(self, func_name: str, saved_name: str, *args, include_return: bool = True, **kwargs) -> None:
        """TVM's ``save_function``: ``vm[saved_name]()`` calls ``func_name`` on
        these inputs (checked and copied now), and ``time_evaluator(saved_name)``
        times it.  A saved name may be saved again, never a module's entry."""
        if saved_name in self._entries:
            raise DspxError(f"save_function: {saved_name!r} is a function of the module; pick another name")
        e = self._entry(func_name)
        arrays = [np.array(a, copy=True) for a in _inputs.bind(e.inputs, args, kwargs, func_name)]
        self._saved[saved_name] = (func_name, arrays, include_return)

    def _saved_call(self, saved_name: str):
        func_name, arrays, include_return = self._saved[saved_name]

        def call():
            outs = self[func_name](*arrays)
            return outs if include_return else None
        call.__name__ = saved_name
        return call

    def set_instrument(self, instrument) -> None:
        """TVM's ``set_instrument``: ``instrument(func, func_symbol, before_run,
        ret_value, *args)`` for every call the entry makes.  The calls run on
        the device, so a ``vm[name](...)`` call (and ``invoke_stateful``, a
        saved function) with an instrument set is profiled (the PROFILE flag)
        and the instrument is called afterwards for each call site, once
        before and once after, in the order of their first calls: ``func`` is its ``ProfileRow`` (name,
        kind, calls, cycles), ``ret_value`` None, ``args`` one ``TensorShape``
        per tensor argument (``.shape``; outputs last).  It cannot skip a call
        (the device already ran it): returning ``VMInstrumentReturnKind.SKIP_RUN``
        (1) raises.  ``None`` removes the instrument."""
        if instrument is not None and not callable(instrument):
            raise TypeError(f"set_instrument takes a function or None, not {type(instrument).__name__}")
        self._instrument = instrument

    def _replay_instrument(self, rep: ProfileReport) -> None:
        for row in rep.rows:
            args = [TensorShape(tuple(int(d) for d in s.split("x") if d)) for s in row.shapes.split(",") if s]
            for before in (True, False):
                kind = self._instrument(row, row.name, before, None, *args)
                if before and kind == SKIP_RUN:
                    raise DspxError(f"the instrument asked to skip {row.name}, but the call already ran on the "
                                    f"device (instruments see the device's calls after the fact)")

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
        """A function that times ``func_name`` as TVM's ``time_evaluator`` does:
        the entry runs ``1 + number * repeat`` times in one INFER (the device
        repeats it: the protocol's repeat field) and the first run, the
        warm-up, is discarded; ``results`` holds ``repeat`` figures, each the
        mean of ``number`` runs.  ``min_repeat_ms``: a repeat shorter than
        that is run again with ``number`` raised (TVM's rule: to
        ``max(min_repeat_ms / per-run ms + 1, number * 1.618)``) until it
        lasts that long or ``number`` reaches the repeat field's limit.
        ``func_name="invoke_stateful"`` times the entry named by its argument
        with the inputs given to ``set_input``; a ``save_function`` name times
        its saved call."""
        if number < 1 or repeat < 1 or 1 + number * repeat > REPEAT_MASK:
            raise ValueError(f"1 + number * repeat must be 2..{REPEAT_MASK} (got 1 + {number} * {repeat})")

        def evaluate(*args, **named) -> BenchmarkResult:
            fn = func_name
            if fn == "invoke_stateful":
                fn = args[0] if args else None
                if fn not in self._set:
                    raise DspxError(f"set_input({fn!r}, ...) before timing invoke_stateful({fn!r})")
                args, named = self._set[fn], {}
            elif fn in self._saved:
                fn, args, named = self._saved[fn][0], self._saved[fn][1], {}
            runs = self._timed_runs(args, named, fn, 1 + number * repeat)[1:]  # the warm-up run is dropped
            per_repeat = [runs[i * number:(i + 1) * number] for i in range(repeat)]
            return BenchmarkResult([statistics.fmean(r) * CYCLE_S
                                    for r in self._lengthen(per_repeat, min_repeat_ms, args, named, fn)])
        return evaluate

    def _lengthen(self, per_repeat: list, min_repeat_ms: float, args, named, fn) -> list:
        """Each repeat's runs, a repeat shorter than ``min_repeat_ms`` run again
        with more runs (TVM's rule), the larger count kept for the next ones."""
        if min_repeat_ms <= 0:
            return per_repeat
        out, number = [], len(per_repeat[0])
        for runs in per_repeat:
            while sum(runs) * CYCLE_S * 1e3 < min_repeat_ms and number < REPEAT_MASK:
                ms_per_run = max(sum(runs), 1) * CYCLE_S * 1e3 / len(runs)
                number = min(REPEAT_MASK, int(max(min_repeat_ms / ms_per_run + 1, number * 1.618)))
                runs = self._timed_runs(args, named, fn, number)
            out.append(runs)
        return out

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
        rep, _ = self.run_profiled(inputs, named, fn or self.entry, runs)
        return rep

    def run_profiled(self, args, named, fn: str, runs: int = 1) -> tuple[ProfileReport, list]:
        """(the profile report, the outputs as views of output_buf) of one INFER with the PROFILE flag."""
        if not 1 <= runs <= 0xFFFF:
            raise ValueError(f"runs must be 1..65535, got {runs}")
        e = self._entry(fn)
        arrays = _inputs.bind(e.inputs, args, named, fn)
        res = self.client.infer(e.module.handle, arrays, model_id=self.model_id, repeat=runs if runs > 1 else 0,
                                profile=True)
        rep = parse_profile(res.printf)
        if runs > 1:  # the per-run lines are the repeat's, not the user's printf
            rep.printf = re.sub(r"^run \d+: \d+ cycles\n", "", rep.printf, flags=re.M)
        if rep.printf:
            sys.stderr.write(rep.printf)
        self.last_cycles = res.cycles
        self.last_printf = rep.printf
        return rep, [self.client.output_view(d) for d in res.descs]

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


__all__ = ["VirtualMachine", "BenchmarkResult", "TensorShape", "find_module", "load_input"]
