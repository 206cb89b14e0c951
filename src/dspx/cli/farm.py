"""``dspx farm up | down | status | run | ops`` (and, from their own
modules, ``join | leave | serve-llm``): a farm of devices on Ray
(docs/farm.md).  Each command imports Ray only when it runs (the ``farm``
extra), so ``dspx`` itself stays quick to start."""
from __future__ import annotations

import json
import sys

import click

FARM_HELP = ("farm address host:port (default: $DSPX_FARM, else the farm `dspx farm up` started for this user)")
farm_opt = click.option("--farm", "address", default=None, metavar="ADDRESS", help=FARM_HELP)
json_opt = click.option("--json", "as_json", is_flag=True, help="one JSON object instead of text")


def _farm():
    import dspx.farm  # needs the farm extra: an ImportError becomes the one line naming it
    return dspx.farm


@click.group("farm")
def farm():
    """A farm of devices on a Ray cluster: batch runs and op cases spread
    across them, leases, nodes on other machines, and LLM serving."""


@farm.command("up")
@click.option("--devices", "-n", default=2, show_default=True, type=click.IntRange(min=1),
              help="simulated devices to start (one Ray actor each)")
@click.option("--key", default="sim", show_default=True, help="the devices' key: they hold dspx:KEY resources")
@click.option("--cores", default=1, show_default=True, type=click.IntRange(min=1), help="cores per device")
@click.option("--threads", default=1, show_default=True, type=click.IntRange(min=0),
              help="threads per core (0: cpus / cores)")
@click.option("--user-cap", default=None, type=click.IntRange(min=1),
              help="devices of a key one user may hold while another waits  [default: all but one]")
@click.option("--listen", default="127.0.0.1", show_default=True, metavar="HOST",
              help="the address of this machine that other machines reach it at, so they can join the farm "
                   "(`dspx farm join`); the farm then takes only processes holding its token")
@json_opt
def up(devices, key, cores, threads, user_cap, listen, as_json):
    """Start a local farm with N simulated devices, on loopback or on the
    address given by --listen; returns once every device answers and prints
    the farm's address."""
    from .common import is_loopback
    from .farm_nodes import up_routable

    if not is_loopback(listen):  # before Ray is imported: it reads its auth mode once
        return up_routable(listen, devices, key, cores, threads, user_cap, as_json)
    f = _farm()
    try:
        running = f.find()
    except f.FarmError:
        running = None
    if running is not None:
        raise f.FarmError(f"a farm is already running at {running.address} (`dspx farm down` stops it)")
    say = None if as_json else (lambda text: click.echo(text, err=True))
    farm_ = f.cluster.start(devices, key, cores=cores, threads=threads, user_cap=user_cap, progress=say)
    farm_.save()
    f.cluster.disconnect()
    if as_json:
        click.echo(json.dumps({"status": "ok", "address": farm_.address, "key": key, "devices": devices,
                               "pid": farm_.pid}))
        return
    click.echo(f"farm up at {farm_.address}: {devices} device(s) under dspx:{key} (`dspx farm down` stops it)")


@farm.command("down")
@farm_opt
@json_opt
def down(address, as_json):
    """Stop the farm `dspx farm up` started (its Ray processes and devices)."""
    found = _farm().find(address)
    found.stop()
    if as_json:
        click.echo(json.dumps({"status": "ok", "address": found.address, "stopped": True}))
        return
    click.echo(f"farm at {found.address} stopped")


def status_of(address=None) -> dict:
    """The farm's devices and, per key, how many are free and busy; with the
    broker's word: held, pending, the holders and the waiters."""
    f = _farm()  # first: it sets Ray's loopback switch, which Ray reads when first imported
    import ray

    f.cluster.connect(f.find(address))
    handles = f.actors.find_devices()
    refs = {name: h.info.remote() for name, h in handles.items()}
    ready, _ = ray.wait(list(refs.values()), num_returns=len(refs), timeout=10.0)
    devices, keys = [], {}
    for name, ref in refs.items():
        key = name.rpartition("-")[0]
        try:
            d = ray.get(ref) if ref in ready else {"device": name, "state": "not answering"}
        except ray.exceptions.RayError as e:
            d = {"device": name, "state": f"down ({type(e).__name__})"}
        d.setdefault("state", "busy" if d.get("busy") else "free")
        d["key"] = key
        devices.append(d)
        k = keys.setdefault(key, {"devices": 0, "free": 0, "busy": 0, "other": 0})
        k["devices"] += 1
        k[d["state"] if d["state"] in ("free", "busy") else "other"] += 1
    leases = f.leases.status()
    holders = {h["device"]: h for h in leases["holders"]}
    for d in devices:
        h = holders.get(d["device"])
        d["holder"] = None if h is None else {k: h[k] for k in ("user", "id", "kind", "priority", "held_s", "limit")}
    for key, k in keys.items():
        b = leases["keys"].get(key, {})
        k.update({n: b.get(n, 0) for n in ("held", "restarting", "pending", "user_cap")})
        k["waiting"] = b.get("waiting", [])
    nodes = sum(n["Alive"] for n in ray.nodes())  # Ray lists a dead node for a while
    return {"status": "ok", "address": f.cluster._connected, "nodes": nodes, "keys": keys, "devices": devices}


@farm.command("status")
@farm_opt
@json_opt
def status(address, as_json):
    """Per key: free, busy, leased and pending devices, and who waits; per
    device: its node, its calls and who holds it."""
    st = status_of(address)
    if as_json:
        click.echo(json.dumps(st))
        return
    click.echo(f"farm at {st['address']}: {st['nodes']} node(s)")
    for key, k in sorted(st["keys"].items()):
        other = f", {k['other']} not answering" if k["other"] else ""
        click.echo(f"  dspx:{key}  {k['devices']} device(s): {k['free']} free, {k['busy']} busy{other}; "
                   f"{k['held']} leased, {k['pending']} pending (cap {k['user_cap']} per user while others wait)")
        for w in k["waiting"]:
            click.echo(f"    waiting: {w['user']} (priority {w['priority']}, {w['kind']}) for {w['waited_s']:.1f} s")
    for d in st["devices"]:
        where = f"node {d['node'][:12]}, {d['calls']} call(s)" if "node" in d else ""
        h = d.get("holder")
        held = "" if h is None else (f", leased to {h['user']} for {h['held_s']:.1f} s"
                                     + (f" of {h['limit']:g}" if h["limit"] is not None else ""))
        click.echo(f"    {d['device']}  {d['state']}  {where}{held}")


@farm.command("run")
@click.argument("module", type=click.Path(exists=True))
@click.option("--inputs", "inputs_path", required=True, type=click.Path(exists=True, dir_okay=False),
              metavar="DATA.npz", help="one array per module input, named after it, shape (N, *input_shape)")
@click.option("--key", default="sim", show_default=True, help="run on the devices under this key")
@click.option("--output", "-o", required=True, metavar="OUT.npz",
              help="each output by name, shape (N, *output_shape), in input order")
@click.option("--chunk", default=1, show_default=True, type=click.IntRange(min=1),
              help="items per device call (fewer round trips for small items)")
@farm_opt
@json_opt
def run(module, inputs_path, key, output, chunk, address, as_json):
    """Run a compiled MODULE over many inputs, spread across the farm's
    devices.  Progress and every retry are shown on stderr; --json adds each
    item's node, device and attempt."""
    import numpy as np
    from pathlib import Path

    f = _farm()
    if Path(output).exists():
        raise click.UsageError(f"{output} exists: it is not overwritten (remove it, or choose another -o)")
    if not output.endswith(".npz"):
        raise click.BadParameter(f"{output!r}: the outputs are written as .npz", param_hint="-o/--output")
    with np.load(inputs_path) as data:
        items = f.batch.split(module, {name: data[name] for name in data.files})
    f.cluster.connect(f.find(address))
    results = _with_progress("farm run", len(items), lambda each: f.map(module, items, key=key, chunk=chunk,
                                                                        on_result=each))
    np.savez(output, **f.batch.stack(results))
    retried = [r for r in results if r.attempt > 1]
    summary = {"status": "ok", "items": len(results), "written": output, "retried": len(retried),
               "devices": sorted({r.device for r in results})}
    if as_json:
        summary["results"] = [{"index": r.index, "node": r.node, "device": r.device, "attempt": r.attempt}
                              for r in results]
        click.echo(json.dumps(summary))
        return
    click.echo(f"{len(results)} item(s) on {len(summary['devices'])} device(s) ({', '.join(summary['devices'])}), "
               f"{len(retried)} retried; outputs in {output}")


def _with_progress(label: str, total: int, run):
    """``run(on_result)`` with progress on stderr (a bar on a terminal, else
    a line per tenth of the items) and one line per retried item."""
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    console = Console(stderr=True, highlight=False)
    tty = sys.stderr.isatty()
    step = max(1, total // 10)
    done = 0
    with Progress(TextColumn(label), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                  console=console, disable=not tty) as bar:
        task = bar.add_task("items", total=total)

        def on_result(r):
            nonlocal done
            done += 1
            bar.advance(task)
            if r.attempt > 1:
                console.print(f"retry: item {r.index} done on {r.device}, attempt {r.attempt} "
                              f"(an earlier attempt lost its device)")
            if not tty and (done % step == 0 or done == total):
                console.print(f"{label}: {done}/{total} item(s)")
        return run(on_result)


@farm.command("ops")
@click.argument("library", type=click.Path(exists=True, dir_okay=False))
@click.option("--cases", "cases_path", required=True, type=click.Path(exists=True, dir_okay=False),
              metavar="CASES.npz", help="input (N, ...), cmd, expected (N, ...) or output_bytes (docs/farm.md)")
@click.option("--key", default="sim", show_default=True, help="run on the devices under this key")
@click.option("--output", "-o", default=None, metavar="OUT.npz",
              help="write each case's output, return_value, cycles and passed, in case order")
@click.option("--chunk", default=8, show_default=True, type=click.IntRange(min=1), help="cases per device call")
@farm_opt
@json_opt
def ops(library, cases_path, key, output, chunk, address, as_json):
    """Run an op LIBRARY's test cases (a LIB.so from `dspx build-ops`, or a
    .py op library) spread across the farm's devices.  A case passes when
    its output bytes and return code are the expected ones; the exit code
    is 1 when any case fails."""
    import numpy as np
    from pathlib import Path

    from .files import check_op_library

    f = _farm()
    check_op_library(library)  # C source, an ONNX model ...: one line saying what to do instead
    if output is not None:
        if Path(output).exists():
            raise click.UsageError(f"{output} exists: it is not overwritten (remove it, or choose another -o)")
        if not output.endswith(".npz"):
            raise click.BadParameter(f"{output!r}: the outputs are written as .npz", param_hint="-o/--output")
    with np.load(cases_path) as data:
        cases = f.ops.read_cases({name: data[name] for name in data.files})
    f.cluster.connect(f.find(address))
    results = _with_progress("farm ops", len(cases), lambda each: f.ops.run_cases(
        library, cases, key=key, chunk=chunk, on_result=each))
    if output is not None:
        np.savez(output, output=np.stack([r.output for r in results]),
                 return_value=np.array([-1 if r.return_value is None else r.return_value for r in results]),
                 cycles=np.array([r.cycles for r in results]),
                 passed=np.array([bool(r.passed) if r.passed is not None else True for r in results]))
    failed = [r for r in results if r.passed is False]
    summary = {"status": "ok" if not failed else "failed", "cases": len(results), "failed": len(failed),
               "checked": cases.expected is not None, "retried": sum(r.attempt > 1 for r in results),
               "devices": sorted({r.device for r in results}), "written": output}
    if as_json:
        summary["results"] = [{"index": r.index, "passed": r.passed, "return_value": r.return_value,
                               "cycles": r.cycles, "error": r.error, "node": r.node, "device": r.device,
                               "attempt": r.attempt} for r in results]
        click.echo(json.dumps(summary))
    else:
        for r in failed[:20]:
            why = r.error or (f"returned {r.return_value}, expected {int(cases.return_values[r.index])}"
                              if r.return_value != cases.return_values[r.index] else "output differs from expected")
            click.echo(f"case {r.index} FAILED on {r.device}: {why}")
        if len(failed) > 20:
            click.echo(f"... and {len(failed) - 20} more failed case(s)")
        verdict = (f"{len(results) - len(failed)} passed, {len(failed)} failed" if cases.expected is not None
                   else f"{len(results)} run, {len(failed)} with an error or an unexpected return code")
        click.echo(f"{len(results)} case(s) on {len(summary['devices'])} device(s): {verdict}"
                   + (f"; outputs in {output}" if output else ""))
    if failed:
        sys.exit(1)


# The farm commands of their own modules (they import this one for its options).
from .farm_nodes import join, leave  # noqa: E402
from .farm_serve import serve_llm  # noqa: E402

farm.add_command(join)
farm.add_command(leave)
farm.add_command(serve_llm)
