"""``dspx sdk`` (compiler flags for the SDKs) and ``dspx build-ops`` (compile a native op library)."""
from __future__ import annotations

import sys

import click


@click.command("sdk")
@click.option("--cflags", "want_cflags", is_flag=True, help="Include flags for DSP operators (dspx/dsp.h) and host programs.")
@click.option("--libs", "want_libs", is_flag=True, help="Link flags for host programs against libdspx (builds it if needed).")
@click.option("--build", "want_build", is_flag=True, help="Build the C host library (libdspx) and print its directory.")
def sdk(want_cflags, want_libs, want_build):
    """Flags for building against the dspx SDKs: DSP operators in C/C++
    (``#include <dspx/dsp.h>``) and host programs (libdspx)."""
    from . import cflags

    if not (want_cflags or want_libs or want_build):
        want_cflags = True
    out = []
    try:
        if want_build:
            from . import host
            out.append(str(host.build()))
        if want_cflags:
            out.append(cflags())
        if want_libs:
            from . import host
            out.append(host.libs())
    except Exception as e:  # a build failure: the compiler's own words
        click.echo(str(e), err=True)
        sys.exit(1)
    click.echo(" ".join(out))


@click.command("build-ops")
@click.argument("sources", nargs=-1, required=True, type=click.Path(exists=True, dir_okay=False))
@click.option("-o", "--output", required=True, type=click.Path(dir_okay=False), help="The library to write (LIB.so).")
@click.option("-X", "--flag", "flags", multiple=True, help="An extra compiler flag (repeatable), e.g. -X -DDSP_LOG_LEVEL=0.")
def build_ops(sources, output, flags):
    """Compile DSP operator sources (C, or C++ for .cc/.cpp) into a native op
    library for ``dspx load-ops``: the system compiler, the SDK flags and
    -O2 -fPIC -shared."""
    from . import BuildError, build_ops as build

    try:
        path = build(sources, output, flags)
    except BuildError as e:
        sys.stderr.write(str(e))
        sys.exit(1)
    click.echo(f"built {path}")
