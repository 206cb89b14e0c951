"""``dspx run``: open → load → infer → unload → close in one connection.
Readable lines by default; ``--json``: one JSON object for programs."""
from __future__ import annotations

import contextlib
import io
import json
import re
import statistics

import click
import numpy as np

from . import cost

CLOCK = "device clock: 1 GHz nominal, 1 cycle = 1 ns of the entry call"


def _ms(cycles: float) -> float:
    return round(cycles / 1e6, 6)


def _percentile(sorted_values, q: float):
    return sorted_values[min(len(sorted_values) - 1, int(round(q * (len(sorted_values) - 1))))]


def _read_inputs(specs, given, shapes, dtypes):
    """(positional arrays, named arrays) from ``--input [NAME=]FILE`` values."""
    from ..errors import InputError
    from ..host.vm import load_input

    names = {s.name: s for s in specs}
    args, named, raw = [], {}, 0
    for value in given:
        name, _, path = value.partition("=")
        if not path or name not in names:
            name, path = None, value
        if path.endswith(".npy"):
            a = load_input(path)
        else:  # raw bytes: --shape/--dtype, else what the module declares for this input
            spec = names[name] if name else (specs[len(args)] if len(args) < len(specs) else None)
            shape = tuple(int(s) for s in shapes[raw].split(",")) if raw < len(shapes) else (spec and spec.shape)
            dtype = dtypes[raw] if raw < len(dtypes) else (spec and spec.dtype)
            raw += 1
            a = load_input(path, shape or None, dtype or None)
        if name:
            if name in named:
                raise InputError(f"input {name!r} given twice", name)
            named[name] = a
        else:
            args.append(a)
    return args, named


@click.command("run")
@click.argument("module", type=click.Path(exists=True))
@click.option("--input", "-i", "inputs", multiple=True, required=True, metavar="[NAME=]FILE",
              help="an input: .npy, or raw .bin (shape and dtype from --shape/--dtype or the module); "
                   "NAME=FILE by input name, FILE alone in order; repeat for each input")
@click.option("--shape", multiple=True, help="shape for a raw .bin input, e.g. 1,3,224,224 (one per .bin)")
@click.option("--dtype", multiple=True, help="dtype for a raw .bin input (one per .bin)")
@click.option("--output", "-o", default=None,
              help="write outputs: .npz (all, keyed by output name), .npy or .bin (the first)")
@click.option("--repeat", default=0, type=click.IntRange(0, 0xFFFF),
              help="run the entry N times on the device in one call; report min/median/p90")
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
def run(module, inputs, shape, dtype, output, repeat, kv_resident, socket, as_json, do_profile, trace_path,
        cost_model):
    """Run a compiled MODULE (dir or .so) on the device once (or --repeat N
    times) and report its outputs and the device time."""
    from .. import fmt
    from ..host.vm import VirtualMachine, find_module
    from ..host.inputs import bind, specs as input_specs

    _, meta = find_module(module)
    estimate = cost.estimate_of(meta, cost_model, str(module))  # a bad profile fails before the device starts
    specs = input_specs(meta)
    args, named = _read_inputs(specs, inputs, shape, dtype)
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
        with contextlib.redirect_stderr(captured) if repeat > 1 else contextlib.nullcontext():
            outs = vm._run(args, named, repeat=repeat, kv_resident=kv_resident)
        runs = [int(c) for c in re.findall(r"^run \d+: (\d+) cycles$", vm.last_printf, re.M)]
        other = "".join(ln for ln in captured.getvalue().splitlines(True) if not re.match(r"run \d+: ", ln))
        if other:
            click.echo(other, err=True, nl=False)
        # (with --kv-resident only the first outputs come back: they keep their names)
        names = ([s.name for s in out_specs][:len(outs)] if len(out_specs) >= len(outs)
                 else [f"output_{i}" for i in range(len(outs))])
        descs = [{"index": i, "name": n, "dtype": o.dtype.name, "shape": list(o.shape), "ndim": o.ndim,
                  "data_size": int(o.nbytes)} for i, (n, o) in enumerate(zip(names, outs))]
        if output:
            if output.endswith(".npz"):
                np.savez(output, **{n: np.array(o) for n, o in zip(names, outs)})
            elif output.endswith(".npy"):
                np.save(output, np.array(outs[0]))
            else:
                np.array(outs[0]).tofile(output)
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
        s = sorted(runs)
        result["repeat"] = {"runs": len(runs), "min_ms": _ms(s[0]), "median_ms": _ms(statistics.median(s)),
                            "p90_ms": _ms(_percentile(s, 0.9)), "max_ms": _ms(s[-1]), "cycles": runs}
    if as_json:
        click.echo(json.dumps(result))
        return
    where = " (a private device started for this command)" if private else ""
    click.echo(f"{module}: {len(runs) or 1} run(s) on the device{where}")
    if runs:
        r = result["repeat"]
        click.echo(f"  time     min {fmt.duration_ns(r['min_ms'] * 1e6)}, median "
                   f"{fmt.duration_ns(r['median_ms'] * 1e6)}, p90 {fmt.duration_ns(r['p90_ms'] * 1e6)} "
                   f"over {r['runs']} runs ({CLOCK})")
    else:
        click.echo(f"  time     {fmt.duration_ns(cycles)} ({cycles:,} cycles; {CLOCK})")
    width = max(len(d["name"]) for d in descs) if descs else 0
    for d in descs:
        click.echo(f"  output   {d['name']:<{width}}  {d['dtype']}[{', '.join(map(str, d['shape']))}]")
    if output:
        click.echo(f"  written  {output}")
    if report is not None:
        click.echo(f"profile ({report.runs} run(s), device cycles):")
        click.echo(report.table())
    if estimate is not None:
        from ..costmodel.estimate import format_estimate
        click.echo(format_estimate(estimate))
