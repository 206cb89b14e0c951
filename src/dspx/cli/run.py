"""``dspx run``: open → load → infer → unload → close in one connection.
Readable lines by default; ``--json``: one JSON object for programs."""
from __future__ import annotations

import contextlib
import io
import json
import os
import re
import statistics

import click
import numpy as np

from ..abi.protocol import REPEAT_MASK
from . import cost

CLOCK = "device clock: 1 GHz nominal, 1 cycle = 1 ns of the entry call"


def _ms(cycles: float) -> float:
    return round(cycles / 1e6, 6)


def _percentile(sorted_values, q: float):
    return sorted_values[min(len(sorted_values) - 1, int(round(q * (len(sorted_values) - 1))))]


def _inputs_list(specs) -> str:
    return ", ".join(f"{s.name} {s}" for s in specs) or "none declared"


def _split(value: str, specs, module) -> tuple[str | None, str]:
    """(input name or None, path) of one ``--input [NAME=]FILE``."""
    from ..errors import InputError

    name, eq, path = value.partition("=")
    if not eq or not path or os.path.exists(value):  # FILE alone (even one whose name has a '=')
        return None, value
    if not specs:
        raise InputError(f"-i {value}: inputs by name need the module's metadata.json (none at {module}); "
                         f"give the files in order, without NAME=", name)
    if name not in {s.name for s in specs}:
        raise InputError(f"-i {value}: {module} has no input {name!r} (its inputs: {_inputs_list(specs)})",
                         name, [s.name for s in specs], name)
    return name, path


def _parse_shape(text: str) -> tuple[int, ...]:
    from ..errors import InputError

    try:
        dims = tuple(int(d) for d in text.replace("x", ",").split(","))
    except ValueError:
        dims = ()
    if not dims or any(d < 0 for d in dims):
        raise InputError(f"--shape {text!r}: give the dimensions as integers >= 0 separated by commas, "
                         f"e.g. --shape 1,3,224,224", None, None, text)
    return dims


def _parse_dtype(text: str) -> np.dtype:
    from ..errors import InputError

    try:
        return np.dtype(text)
    except TypeError:
        raise InputError(f"--dtype {text!r} is not a dtype (float32, int8, uint16 ...)", None, None, text) from None


def _load_npy(path: str) -> np.ndarray:
    from ..errors import DspxError

    try:
        return np.load(path, allow_pickle=False)
    except ValueError as e:
        raise DspxError(f"{path}: not a .npy array ({e})") from None


def _load_raw(path: str, spec, shape: str | None, dtype: str | None) -> np.ndarray:
    """Raw bytes: --shape/--dtype when given, else what the module declares
    for the input; the file's size is checked against them first."""
    from ..errors import InputError

    dims = _parse_shape(shape) if shape is not None else (spec.shape if spec else None)
    dt = _parse_dtype(dtype) if dtype is not None else (np.dtype(spec.dtype) if spec else None)
    if dims is None or dt is None:
        raise InputError(f"{path}: raw bytes need --shape and --dtype (no metadata.json declares the input); "
                         f"or save it with np.save as .npy", None)
    size = os.path.getsize(path)
    count = int(np.prod(dims, dtype=np.int64))
    need = count * dt.itemsize
    if size != need:
        what = f"{dt.name}[{', '.join(map(str, dims))}]"
        if shape is None and dtype is None:
            what = f"input {spec.name!r} {what}"
        elif spec:
            what += f" (from --shape/--dtype; input {spec.name!r} is {spec})"
        held = f"{size // dt.itemsize:,} {dt.name} values" + (f" and {size % dt.itemsize} bytes" if size % dt.itemsize
                                                              else "")
        raise InputError(f"{path} holds {size:,} bytes ({held}); {what} takes {need:,} bytes "
                         f"({count:,} values of {dt.itemsize})", spec and spec.name, need, size)
    return np.fromfile(path, dtype=dt).reshape(dims)


def _load_npz(path: str, name: str | None, specs) -> list[tuple[str | None, np.ndarray]]:
    """An archive's arrays: one under an input's name goes to that input;
    ``arr_0, arr_1 ...`` (np.savez without names) and a lone array go in order."""
    from ..errors import InputError

    try:
        z = np.load(path, allow_pickle=False)
    except ValueError as e:
        raise InputError(f"{path}: not a .npz archive ({e})") from None
    with z:
        keys = list(z.files)
        names = {s.name for s in specs}
        if name is not None:  # NAME=FILE.npz: its array of that name, or its only one
            if name in keys or len(keys) == 1:
                return [(name, z[name if name in keys else keys[0]])]
            raise InputError(f"{path} holds {len(keys)} arrays ({', '.join(keys)}), none named {name!r}", name)
        positional = [k for k in keys if k.startswith("arr_") and k[4:].isdigit() and k not in names]
        unknown = [k for k in keys if k not in names and k not in positional]
        if unknown and len(keys) > 1:
            raise InputError(f"{path} holds arrays {', '.join(map(repr, unknown))} that are no input's name "
                             f"(inputs: {_inputs_list(specs)}): save them under the input names, "
                             f"np.savez(f, {next(iter(names), 'x')}=...)", unknown[0])
        if len(keys) == 1 and unknown:
            return [(None, z[keys[0]])]
        positional.sort(key=lambda k: int(k[4:]))
        return [(None, z[k]) for k in positional] + [(k, z[k]) for k in keys if k in names]


def _read_inputs(specs, given, shapes, dtypes, module="the module"):
    """(positional arrays, named arrays) from ``--input [NAME=]FILE`` values:
    .npy, .npz (see ``_load_npz``), anything else raw bytes (the n-th
    --shape/--dtype for the n-th raw file)."""
    from ..errors import InputError

    by_name = {s.name: s for s in specs}
    args, named, raw = [], {}, 0
    for value in given:
        name, path = _split(value, specs, module)
        if not os.path.exists(path):
            raise FileNotFoundError(2, "No such file or directory", path)
        if path.endswith(".npz"):
            arrays = _load_npz(path, name, specs)
        elif path.endswith(".npy"):
            arrays = [(name, _load_npy(path))]
        else:
            spec = by_name[name] if name else (specs[len(args)] if len(args) < len(specs) else None)
            arrays = [(name, _load_raw(path, spec, shapes[raw] if raw < len(shapes) else None,
                                       dtypes[raw] if raw < len(dtypes) else None))]
            raw += 1
        for n, a in arrays:
            if n is None:
                args.append(a)
            elif n in named:
                raise InputError(f"input {n!r} given twice", n)
            else:
                named[n] = a
    return args, named


def _check_output_path(output) -> None:
    from ..errors import DspxError

    if output and not output.endswith((".npz", ".npy")):
        raise DspxError(f"-o {output}: write outputs as .npz (every output, by name) or .npy (the first); "
                        "for raw bytes, np.load the .npy and .tofile() it")


def _write(output, names, outs) -> str:
    if output.endswith(".npz"):
        np.savez(output, **{n: np.array(o) for n, o in zip(names, outs)})
        return output
    np.save(output, np.array(outs[0]))
    return output + (f" (the first output, {names[0]}; .npz keeps all {len(outs)})" if len(outs) > 1 else "")


def _values(a: np.ndarray) -> str:
    """numpy's own summarised form (… past 32 values)."""
    return np.array2string(np.asarray(a), threshold=32, edgeitems=3, separator=", ")


@click.command("run")
@click.argument("module", type=click.Path(exists=True))
@click.option("--input", "-i", "inputs", multiple=True, required=True, metavar="[NAME=]FILE",
              help="an input: .npy, .npz (arrays under input names, or np.savez's arr_0, arr_1 ... in order), "
                   "or raw bytes (shape and dtype from --shape/--dtype or the module); NAME=FILE by input name, "
                   "FILE alone in order; repeat for each input")
@click.option("--shape", multiple=True, help="shape for a raw input, e.g. 1,3,224,224 (one per raw file)")
@click.option("--dtype", multiple=True, help="dtype for a raw input (one per raw file)")
@click.option("--output", "-o", default=None,
              help="write outputs: .npz (all, keyed by output name) or .npy (the first)")
@click.option("--print", "show", is_flag=True, help="print the output values (numpy's summarised form)")
@click.option("--repeat", default=0, type=click.IntRange(0, REPEAT_MASK - 1),
              help="run the entry N times on the device in one call, after one warm-up run that is reported "
                   "on its own and not counted (as TVM's time_evaluator); report min/median/p90")
@click.option("--kv-resident", is_flag=True,
              help="keep outputs after the first on the device, in its KV-cache region (KV_RESIDENT), "
                   "for models that carry a KV cache from call to call")
@click.option("--socket", default=None, envvar="DSPX_SOCKET")
@click.option("--json", "as_json", is_flag=True, help="one JSON object instead of readable lines")
@click.option("--profile", "do_profile", is_flag=True,
              help="then one call more with every kernel and TVM function timed on the device: a per-layer "
                   "table sorted by time (in the JSON with --json; docs/profiling.md)")
@click.option("--trace", "trace_path", default=None, metavar="OUT.json",
              help="write a Chrome trace-event timeline of host and device (docs/profiling.md)")
@cost.option("then print the estimated board latency per layer under this timing-model profile (from the "
             "kernel calls `dspx compile --cost-model` recorded)")
def run(module, inputs, shape, dtype, output, show, repeat, kv_resident, socket, as_json, do_profile, trace_path,
        cost_model):
    """Run a compiled MODULE (dir or .so) on the device once (or --repeat N
    times) and report its outputs and the device time."""
    from ..host.vm import VirtualMachine, find_module
    from ..host.inputs import bind, specs as input_specs
    from . import files

    if os.path.isfile(module):
        files.refuse_onnx(module, "`dspx run DIR -i ...`")
    _check_output_path(output)
    _, meta = find_module(module)
    estimate = cost.estimate_of(meta, cost_model, str(module))  # a bad profile fails before the device starts
    specs = input_specs(meta)
    args, named = _read_inputs(specs, inputs, shape, dtype, module)
    if specs:  # checked before a device is even opened (the call binds them again: cheap)
        args, named = bind(specs, args, named, meta.get("entry", "main")), {}
    if trace_path:
        from ..host import tracing
        tracing.start_host(trace_path)  # before the device starts: a private one inherits DSPX_TRACE
    report = None
    with VirtualMachine(module, socket=socket) as vm:
        private = vm.client.device is not None
        out_specs = vm.output_specs()
        captured = io.StringIO()
        # --repeat N: N + 1 runs, the first a warm-up (a module's first call pays for its pages and caches)
        with contextlib.redirect_stderr(captured) if repeat else contextlib.nullcontext():
            outs = vm._run(args, named, repeat=repeat + 1 if repeat else 0, kv_resident=kv_resident)
        runs = [int(c) for c in re.findall(r"^run \d+: (\d+) cycles$", vm.last_printf, re.M)]
        other = "".join(ln for ln in captured.getvalue().splitlines(True) if not re.match(r"run \d+: ", ln))
        if other:
            click.echo(other, err=True, nl=False)
        # (with --kv-resident only the first outputs come back: they keep their names)
        names = ([s.name for s in out_specs][:len(outs)] if len(out_specs) >= len(outs)
                 else [f"output_{i}" for i in range(len(outs))])
        descs = [{"index": i, "name": n, "dtype": o.dtype.name, "shape": list(o.shape), "ndim": o.ndim,
                  "data_size": int(o.nbytes)} | ({"values": np.asarray(o).tolist()} if show and as_json else {})
                 for i, (n, o) in enumerate(zip(names, outs))]
        values = [_values(o) for o in outs] if show and not as_json else []
        written = _write(output, names, outs) if output else None
        cycles = vm.last_cycles
        if do_profile:
            from ..host.profile import profile
            report = profile(vm, *args, runs=max(1, repeat), **named)
    if trace_path:
        click.echo(f"trace: {tracing.finish()}", err=True)
    result = {"status": "ok", "num_outputs": len(outs), "outputs": descs, "cycles": cycles,
              "time_ms": _ms(cycles), "clock": CLOCK, "private_device": private}
    if output:
        result["written"] = output
    if report is not None:
        result["profile"] = report.to_dict()
    if estimate is not None:
        result["cost_estimate"] = estimate
    if runs:
        warmup, runs = runs[0], runs[1:]
        s = sorted(runs)
        result["cycles"] = round(statistics.median(s))  # of the counted runs
        result["time_ms"] = _ms(result["cycles"])
        result["repeat"] = {"runs": len(runs), "min_ms": _ms(s[0]), "median_ms": _ms(statistics.median(s)),
                            "p90_ms": _ms(_percentile(s, 0.9)), "max_ms": _ms(s[-1]), "cycles": runs,
                            "warmup_ms": _ms(warmup), "warmup_cycles": warmup}
    if as_json:
        click.echo(json.dumps(result))
        return
    _print_result(module, result, private, descs, values, written, report, estimate)


def _print_result(module, result, private, descs, values, written, report, estimate) -> None:
    from .. import fmt

    where = " (a private device started for this command)" if private else ""
    r = result.get("repeat")
    click.echo(f"{module}: {r['runs'] if r else 1} run(s) on the device{where}")
    if r:
        click.echo(f"  time     min {fmt.duration_ns(r['min_ms'] * 1e6)}, median "
                   f"{fmt.duration_ns(r['median_ms'] * 1e6)}, p90 {fmt.duration_ns(r['p90_ms'] * 1e6)} "
                   f"over {r['runs']} runs ({CLOCK})")
        click.echo(f"  warm-up  {fmt.duration_ns(r['warmup_ms'] * 1e6)} (the first run, not counted)")
    else:
        cycles = result["cycles"]
        click.echo(f"  time     {fmt.duration_ns(cycles)} ({cycles:,} cycles; {CLOCK}); the module's first call, "
                   "cold: --repeat N times warm runs")
    width = max(len(d["name"]) for d in descs) if descs else 0
    for i, d in enumerate(descs):
        click.echo(f"  output   {d['name']:<{width}}  {d['dtype']}[{', '.join(map(str, d['shape']))}]")
        if values:
            click.echo("\n".join("    " + ln for ln in values[i].splitlines()))
    if written:
        click.echo(f"  written  {written}")
    if report is not None:
        click.echo(f"profile ({report.runs} run(s), device cycles):")
        click.echo(report.table())
    if estimate is not None:
        from ..costmodel.estimate import format_estimate
        click.echo(format_estimate(estimate))
