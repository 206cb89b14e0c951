"""``dspx farm up --listen HOST``, ``dspx farm join``, ``dspx farm leave``:
a farm of several machines (docs/farm.md, "A farm on several machines").

Registered at the end of ``farm.py``, whose ``up`` hands a routable
``--listen`` to ``up_routable`` here.  A farm on a routable address takes only processes holding its token, and
Ray reads ``RAY_AUTH_MODE`` once, when first imported: these commands set it
before they import Ray (``_token_mode``)."""
from __future__ import annotations

import json
import os

import click

from .farm import _farm, json_opt


def _token_mode() -> None:
    """Ray's token mode for this process and what it starts, set before Ray
    is imported; an explicit other mode is refused."""
    mode = os.environ.get("RAY_AUTH_MODE", "token")
    if mode != "token":
        raise click.ClickException(f"RAY_AUTH_MODE={mode}: a farm of several machines takes only processes holding "
                                   f"its token (RAY_AUTH_MODE=token, or leave it unset)")
    os.environ["RAY_AUTH_MODE"] = "token"


def _nodes():
    import dspx.farm.nodes  # after _token_mode: it imports Ray

    return dspx.farm.nodes


def _running(f):
    try:
        return f.find()
    except f.FarmError:
        return None


def up_routable(listen, devices, key, cores, threads, user_cap, as_json):
    """``dspx farm up --listen HOST`` for an address other machines reach:
    the farm takes only processes holding its token, this one too."""
    _token_mode()
    f = _farm()
    running = _running(f)
    if running is not None:
        raise f.FarmError(f"a farm is already running at {running.address} (`dspx farm down` stops it)")
    say = None if as_json else (lambda text: click.echo(text, err=True))
    farm_ = f.cluster.start(devices, key, cores=cores, threads=threads, user_cap=user_cap, progress=say,
                            listen=listen)
    farm_.save()
    f.cluster.disconnect()
    token = _nodes().token_source()
    if as_json:
        click.echo(json.dumps({"status": "ok", "address": farm_.address, "key": key, "devices": devices,
                               "pid": farm_.pid, "auth": "token", "token": token}))
        return
    click.echo(f"farm up at {farm_.address}: {devices} device(s) under dspx:{key}, token authentication (the "
               f"token: {token}); other machines join with `dspx farm join {farm_.address} --key KEY --devices N`, "
               f"holding the same token (`dspx farm down` stops it)")


@click.command("join")
@click.argument("address")
@click.option("--key", default="sim", show_default=True, help="this node's devices' key: they hold dspx:KEY")
@click.option("--devices", "-n", default=0, show_default=True, type=click.IntRange(min=0),
              help="simulated devices to start on this machine (one Ray actor each)")
@click.option("--socket", "sockets", multiple=True, metavar="PATH",
              help="a device already listening at PATH (a board, or `dspx serve --socket PATH`): one device "
                   "each; repeatable")
@click.option("--cores", default=1, show_default=True, type=click.IntRange(min=1),
              help="cores per simulated device")
@click.option("--threads", default=1, show_default=True, type=click.IntRange(min=0),
              help="threads per core (0: cpus / cores)")
@json_opt
def join(address, key, devices, sockets, cores, threads, as_json):
    """Make this machine a node of the farm at ADDRESS (one started with
    `dspx farm up --listen HOST`), offering N simulated devices and the
    boards given by --socket under dspx:KEY; returns once they answer.
    `dspx farm leave` (or `down`) here stops them."""
    _token_mode()
    f = _farm()
    running = _running(f)
    if running is not None:
        what = "is a node of" if running.node else "runs"
        raise f.FarmError(f"this machine already {what} the farm at {running.address} (`dspx farm "
                          f"{'leave' if running.node else 'down'}` first)")
    say = None if as_json else (lambda text: click.echo(text, err=True))
    node = _nodes().join(address, key, devices, sockets, cores=cores, threads=threads, progress=say)
    node.save()
    f.cluster.disconnect()
    if as_json:
        click.echo(json.dumps({"status": "ok", "address": address, "node": node.node, "key": key,
                               "devices": devices, "boards": len(sockets), "pid": node.pid}))
        return
    click.echo(f"joined the farm at {address} as node {node.node[:12]}: {devices} device(s) and {len(sockets)} "
               f"board(s) under dspx:{key} (`dspx farm leave` stops them)")


@click.command("leave")
@json_opt
def leave(as_json):
    """Stop what `dspx farm join` started on this machine: its node and its
    devices (a batch running on the farm moves their work to the others)."""
    _farm()
    node = _nodes().leave()
    if as_json:
        click.echo(json.dumps({"status": "ok", "address": node.address, "node": node.node, "left": True}))
        return
    click.echo(f"left the farm at {node.address}: node {node.node[:12]} and its {node.devices} device(s) stopped")
