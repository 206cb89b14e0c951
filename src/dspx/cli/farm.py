"""``dspx farm up | down | status | run``: a farm of devices on Ray
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
    """A farm of devices on a Ray cluster: batch runs spread across them."""


@farm.command("up")
@click.option("--devices", "-n", default=2, show_default=True, type=click.IntRange(min=1),
              help="simulated devices to start (one Ray actor each)")
@click.option("--key", default="sim", show_default=True, help="the devices' key: they hold dspx:KEY resources")
@click.option("--cores", default=1, show_default=True, type=click.IntRange(min=1), help="cores per device")
@click.option("--threads", default=1, show_default=True, type=click.IntRange(min=0),
              help="threads per core (0: cpus / cores)")
@json_opt
def up(devices, key, cores, threads, as_json):
    """Start a local farm on loopback with N simulated devices; returns once
    every device answers and prints the farm's address."""
    f = _farm()
    try:
        running = f.find()
    except f.FarmError:
        running = None
    if running is not None:
        raise f.FarmError(f"a farm is already running at {running.address} (`dspx farm down` stops it)")
    say = None if as_json else (lambda text: click.echo(text, err=True))
    farm_ = f.cluster.start(devices, key, cores=cores, threads=threads, progress=say)
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
    """The farm's devices and, per key, how many are free and busy."""
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
    return {"status": "ok", "address": f.cluster._connected, "nodes": len(ray.nodes()), "keys": keys,
            "devices": devices}


@farm.command("status")
@farm_opt
@json_opt
def status(address, as_json):
    """Free and busy devices per key, and each device's node and calls."""
    st = status_of(address)
    if as_json:
        click.echo(json.dumps(st))
        return
    click.echo(f"farm at {st['address']}: {st['nodes']} node(s)")
    for key, k in sorted(st["keys"].items()):
        other = f", {k['other']} not answering" if k["other"] else ""
        click.echo(f"  dspx:{key}  {k['devices']} device(s): {k['free']} free, {k['busy']} busy{other}")
    for d in st["devices"]:
        where = f"node {d['node'][:12]}, {d['calls']} call(s)" if "node" in d else ""
        click.echo(f"    {d['device']}  {d['state']}  {where}")


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
    results = _run_with_progress(f, module, items, key, chunk, address)
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


def _run_with_progress(f, module, items, key, chunk, address):
    """map() with progress on stderr (a bar on a terminal, else a line per
    tenth of the items) and one line per retried item."""
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    console = Console(stderr=True, highlight=False)
    tty = sys.stderr.isatty()
    step = max(1, len(items) // 10)
    done = 0
    with Progress(TextColumn("farm run"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                  console=console, disable=not tty) as bar:
        task = bar.add_task("items", total=len(items))

        def on_result(r):
            nonlocal done
            done += 1
            bar.advance(task)
            if r.attempt > 1:
                console.print(f"retry: item {r.index} done on {r.device}, attempt {r.attempt} "
                              f"(its device was lost and restarted)")
            if not tty and (done % step == 0 or done == len(items)):
                console.print(f"farm run: {done}/{len(items)} item(s)")
        f.cluster.connect(f.find(address))
        return f.map(module, items, key=key, chunk=chunk, on_result=on_result)
