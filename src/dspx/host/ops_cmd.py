"""``dspx load-ops`` and ``dspx ops``: custom-operator libraries on a device."""
from __future__ import annotations

import json
import sys

import click


def _fail(e, as_json):
    from ..errors import DeviceError
    if as_json:
        out = {"status": "error", "error": type(e).__name__, "message": str(e)}
        if isinstance(e, DeviceError):
            out.update(code=e.status, error=e.status_name, message=e.detail or str(e))
        click.echo(json.dumps(out))
    else:
        click.echo(f"error: {e}", err=True)
    sys.exit(1)


@click.command("load-ops")
@click.argument("file", type=click.Path(exists=True, dir_okay=False))
@click.option("--socket", default=None, envvar="DSPX_SOCKET")
@click.option("--json", "as_json", is_flag=True)
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
    try:
        with Tasks(socket=socket, printf_size=0) as ucp:
            handle, n = ucp.load_ops(source)
            mine = [o for o in ucp.ops() if o["library"] == handle]
    except Exception as e:
        _fail(e, as_json)
    if as_json:
        click.echo(json.dumps({"status": "ok", "library": handle, "ops": mine}))
    else:
        click.echo(f"loaded {file} as library {handle}: " +
                   ", ".join(f"0x{o['cmd']:x} {o['name']}" for o in mine))


@click.command("ops")
@click.option("--socket", default=None, envvar="DSPX_SOCKET")
@click.option("--json", "as_json", is_flag=True)
def ops(socket, as_json):
    """List the registered operators: command id, name, latency hint, library."""
    from .tasks import Tasks

    try:
        with Tasks(socket=socket, printf_size=0) as ucp:
            listing = ucp.ops()
    except Exception as e:
        _fail(e, as_json)
    if as_json:
        click.echo(json.dumps({"status": "ok", "ops": listing}))
        return
    for o in listing:
        lib = "built-in" if o["library"] == 0 else f"library {o['library']}"
        click.echo(f"0x{o['cmd']:04x}  {o['name']:<24} {o['latency_us']:>8} µs  {lib}")
