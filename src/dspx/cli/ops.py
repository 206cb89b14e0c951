"""Custom operators: ``dspx load-ops`` and ``dspx ops`` (libraries on a device),
``dspx build-ops`` (compile a native op library) and ``dspx sdk`` (compiler
flags for the SDKs)."""
from __future__ import annotations

import json
import sys

import click

from .common import private_note


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

    from ..host.tasks import Tasks

    data = Path(file).read_bytes()
    source = data if data[:4] == b"\x7fELF" else Path(file)
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
    from ..host.tasks import Tasks

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


@click.command("sdk")
@click.option("--cflags", "want_cflags", is_flag=True, help="Include flags for DSP operators (dspx/dsp.h) and host programs.")
@click.option("--libs", "want_libs", is_flag=True, help="Link flags for host programs against libdspx (builds it if needed).")
@click.option("--build", "want_build", is_flag=True, help="Build the C host library (libdspx) and print its directory.")
def sdk(want_cflags, want_libs, want_build):
    """Flags for building against the dspx SDKs: DSP operators in C/C++
    (``#include <dspx/dsp.h>``) and host programs (libdspx)."""
    from ..sdk import cflags

    if not (want_cflags or want_libs or want_build):
        want_cflags = True
    out = []
    try:
        if want_build:
            from ..sdk import libdspx
            out.append(str(libdspx.build()))
        if want_cflags:
            out.append(cflags())
        if want_libs:
            from ..sdk import libdspx
            out.append(libdspx.libs())
    except Exception as e:  # a build failure: the compiler's own words
        click.echo(str(e), err=True)
        sys.exit(1)
    click.echo(" ".join(out))


@click.command("build-ops")
@click.argument("sources", nargs=-1, required=True, type=click.Path(exists=True, dir_okay=False))
@click.option("-o", "--output", required=True, type=click.Path(dir_okay=False), help="The library to write (LIB.so).")
@click.option("-X", "--flag", "flags", multiple=True, help="An extra compiler flag (repeatable), e.g. -X -DDSP_LOG_LEVEL=0.")
@click.option("--cost-model", "cost", is_flag=True,
              help="a counted build (-DDSPX_COST=1) for a device with a cost model: its vector loads, stores, "
                   "operations and DMA are counted and TIME_STAMP reads the modeled clock (docs/cost-model.md)")
def build_ops(sources, output, flags, cost):
    """Compile DSP operator sources (C, or C++ for .cc/.cpp) into a native op
    library for ``dspx load-ops``: the system compiler, the SDK flags and
    -O2 -fPIC -shared."""
    from ..sdk import BuildError, build_ops as build

    try:
        path = build(sources, output, flags, cost=cost)
    except BuildError as e:
        sys.stderr.write(str(e))
        sys.exit(1)
    click.echo(f"built {path}")
