"""Custom operators: ``dspx load-ops`` and ``dspx ops`` (libraries on a device),
``dspx build-ops`` (compile a native op library) and ``dspx sdk`` (compiler
flags for the SDKs)."""
from __future__ import annotations

import json
import re
import sys

import click

from .common import private_note


@click.command("load-ops")
@click.argument("file", type=click.Path(exists=True, dir_okay=False))
@click.option("--replace", is_flag=True,
              help="first unload the op libraries that hold this library's command ids (a fixed build of "
                   "a library loaded before)")
@click.option("--socket", default=None, envvar="DSPX_SOCKET")
@click.option("--json", "as_json", is_flag=True, help="one JSON object instead of text")
def load_ops(file, replace, socket, as_json):
    """Load an op library into a running device: Python source, or a native
    library (LIB.so from ``dspx build-ops``; told apart by the ELF magic).

    Its ops stay registered until the library is unloaded (``dspx
    unload-ops``) or the device stops; with no running device a private one
    checks and loads it, then stops (useful to validate a library)."""
    from ..host.tasks import Tasks
    from .files import check_op_library

    data = check_op_library(file)
    with Tasks(socket=socket, printf_size=0) as ucp:
        handle, replaced = _load_replacing(ucp, data, replace)
        mine = [o for o in ucp.ops() if o["library"] == handle]
        note = private_note(ucp.client)
    if as_json:
        click.echo(json.dumps({"status": "ok", "library": handle, "ops": mine, "replaced": replaced,
                               "private_device": note is not None}))
        return
    for h in replaced:
        click.echo(f"unloaded library {h} (it held a command id of {file})")
    click.echo(f"loaded {file} as library {handle}: " + ", ".join(f"0x{o['cmd']:x} {o['name']}" for o in mine))
    if note:
        click.echo("(" + note.replace("this answer is from", "checked and loaded on") + "; its ops are gone)")


# The device's words for a command id taken (ERR_BUSY, dspx.device.core.errors.OpBusy).
_TAKEN = re.compile(r"command 0x[0-9a-f]+ is already registered by op library (\d+)")


def _load_replacing(ucp, data: bytes, replace: bool) -> tuple[int, list[int]]:
    """(library handle, libraries unloaded first): a command id another
    library holds is, with ``replace``, that library unloaded and the load
    tried again; without, the error says how to replace it."""
    from ..errors import DeviceError

    replaced: list[int] = []
    while True:
        try:
            return ucp.load_ops(data, device_wide=True)[0], replaced  # outlives this command's connection
        except DeviceError as e:
            m = _TAKEN.search(e.detail) if e.status_name == "ERR_BUSY" else None
            if m is None:
                raise
            lib = int(m.group(1))
            if not replace or lib in replaced:
                raise DeviceError(e.status, f"{e.detail}: unload it first with `dspx unload-ops {lib}`, or "
                                            f"load with --replace", e.request, **e.numbers) from None
            _unload(ucp, lib)
            replaced.append(lib)


def _unload(ucp, handle: int) -> None:
    from ..errors import DeviceError

    try:
        ucp.unload_ops(handle)
    except DeviceError as e:
        if e.status_name != "ERR_HANDLE":
            raise
        known = sorted({o["library"] for o in ucp.ops()} - {0})
        if handle in known:  # the device's words say whose it is
            raise
        raise DeviceError(e.status, f"no op library {handle} on the device (loaded: "
                                    f"{', '.join(map(str, known)) or 'none'}; `dspx ops --libraries` lists them)",
                          e.request) from None


@click.command("unload-ops")
@click.argument("libraries", nargs=-1, type=click.IntRange(min=1), metavar="LIBRARY...")
@click.option("--all", "unload_all", is_flag=True,
              help="every op library this command may unload (the device-wide ones; not those of connected programs)")
@click.option("--socket", default=None, envvar="DSPX_SOCKET")
@click.option("--json", "as_json", is_flag=True, help="one JSON object instead of text")
def unload_ops(libraries, unload_all, socket, as_json):
    """Unload op libraries from a running device, by the number ``dspx
    load-ops`` printed (``dspx ops --libraries`` lists them).  A library
    loaded by ``dspx load-ops`` (device-wide) can be unloaded here; one a
    running program loaded for itself belongs to that program and goes when
    it disconnects.  Its command ids are free
    again: load the fixed library with ``dspx load-ops``."""
    from ..errors import DeviceError, DspxError
    from ..host.tasks import Tasks

    if bool(libraries) == unload_all:
        raise click.UsageError("give the LIBRARY numbers to unload, or --all")
    done, kept = [], []
    with Tasks(socket=socket, printf_size=0) as ucp:
        if private_note(ucp.client):
            raise DspxError("no device is running: a private one has no op libraries to unload "
                                 "(give --socket, or start one with `dspx serve`)")
        targets = sorted({o["library"] for o in ucp.ops()} - {0}) if unload_all else libraries
        for h in targets:
            try:
                _unload(ucp, h)
                done.append(h)
            except DeviceError as e:
                if not unload_all:
                    raise
                kept.append({"library": h, "why": e.detail})
    if as_json:
        click.echo(json.dumps({"status": "ok", "unloaded": done, "kept": kept}))
        return
    click.echo(f"unloaded {', '.join(f'library {h}' for h in done)}" if done else "no op library unloaded")
    for k in kept:
        click.echo(f"kept library {k['library']}: {k['why']}")


@click.command("ops")
@click.option("--libraries", is_flag=True, help="one line per op library: its number and its commands")
@click.option("--socket", default=None, envvar="DSPX_SOCKET")
@click.option("--json", "as_json", is_flag=True, help="one JSON object instead of text")
def ops(libraries, socket, as_json):
    """List the registered operators: command id, name, latency hint, library
    (``--libraries``: the op libraries, for ``dspx unload-ops``)."""
    from ..host.tasks import Tasks

    with Tasks(socket=socket, printf_size=0) as ucp:
        listing = ucp.ops()
        note = private_note(ucp.client)
    libs: dict[int, list] = {}
    for o in listing:
        if o["library"]:
            libs.setdefault(o["library"], []).append(o)
    if as_json:
        click.echo(json.dumps({"status": "ok", "ops": listing, "private_device": note is not None,
                               "libraries": [{"library": h, "ops": v} for h, v in sorted(libs.items())],
                               **({"note": note} if note else {})}))
        return
    if note:
        click.echo(note + "; it has the built-in operators only")
    if libraries:
        for h, v in sorted(libs.items()):
            click.echo(f"library {h}: " + ", ".join(f"0x{o['cmd']:04x} {o['name']}" for o in v))
        if not libs:
            click.echo("no op libraries loaded (`dspx load-ops FILE` loads one)")
        return
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
    from .files import check_op_sources

    check_op_sources(sources)
    try:
        path = build(sources, output, flags, cost=cost)
    except BuildError as e:
        sys.stderr.write(str(e))
        sys.exit(1)
    click.echo(f"built {path}")
