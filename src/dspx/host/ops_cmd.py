"""``dspx load-ops`` and ``dspx ops``: custom-operator libraries on a device."""
from __future__ import annotations

import json

import click

# Errors end as one line (or a JSON object with --json): dspx.cli.DspxGroup.


@click.command("load-ops")
@click.argument("file", type=click.Path(exists=True, dir_okay=False))
@click.option("--socket", default=None, envvar="DSPX_SOCKET")
@click.option("--json", "as_json", is_flag=True, help="one JSON object instead of text")
def load_ops(file, socket, as_json):
    """Load an op library into a running device: Python source, or a native
    library (LIB.so from ``dspx build-ops``; told apart by the ELF magic).

    Its ops stay registered until the library is unloaded or the device
    stops; with no running device a private one checks and loads it, then
    stops (useful to validate a library)."""
    from pathlib import Path

    from .tasks import Tasks

    data = Path(file).read_bytes()
    source = data if data[:4] == b"\x7fELF" else Path(file)
    from ..cli import private_note

    with Tasks(socket=socket, printf_size=0) as ucp:
        handle, n = ucp.load_ops(source)
        mine = [o for o in ucp.ops() if o["library"] == handle]
        note = private_note(ucp.client)
    if as_json:
        click.echo(json.dumps({"status": "ok", "library": handle, "ops": mine, "private_device": note is not None}))
        return
    click.echo(f"loaded {file} as library {handle}: " + ", ".join(f"0x{o['cmd']:x} {o['name']}" for o in mine))
    if note:
        click.echo("(" + note.replace("this answer is from", "checked and loaded on") + "; its ops are gone)")


@click.command("ops")
@click.option("--socket", default=None, envvar="DSPX_SOCKET")
@click.option("--json", "as_json", is_flag=True, help="one JSON object instead of text")
def ops(socket, as_json):
    """List the registered operators: command id, name, latency hint, library."""
    from .tasks import Tasks

    from ..cli import private_note

    with Tasks(socket=socket, printf_size=0) as ucp:
        listing = ucp.ops()
        note = private_note(ucp.client)
    if as_json:
        click.echo(json.dumps({"status": "ok", "ops": listing, "private_device": note is not None,
                               **({"note": note} if note else {})}))
        return
    if note:
        click.echo(note + "; it has the built-in operators only")
    for o in listing:
        lib = "built-in" if o["library"] == 0 else f"library {o['library']}"
        click.echo(f"0x{o['cmd']:04x}  {o['name']:<24} {o['latency_us']:>8} µs  {lib}")
