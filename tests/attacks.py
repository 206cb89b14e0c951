"""Hostile native code, run from each place a client's code runs on a core.

The trust boundary (SPEC §12, docs/containment.md) holds for code a
client brings in three places, and an attack is tested from each:

* ``handler``: a C op library's operator, in the core, during an RPC;
* ``init``: a C op library's ``dspx_ops_init``, which runs first in the
  load probe (forked by the core's probe zygote, under a stricter filter) and then in the core;
* ``ctor``: the ELF constructor of a module with no imports, which runs in
  DLOAD's probe.  The module is a fake (no TVM library inside), so even a
  harmless constructor's load ends in ERR_LOAD "dynamic loading failed"
  after the constructor ran; an attack the filter stops names SIGSYS.

``body`` is C code that runs in that place.  It may call ``sc(n, a, b, c, d,
e, f)`` (a raw system call: no libc wrapper for the checks to see) and reads
``ATTACK_ARG`` (a u64 the test passes: in the handler the first 8 bytes of
the input buffer, elsewhere the ``arg`` given to the builder), and it
``return``s a long (the handler's return value; ignored elsewhere).
"""
from __future__ import annotations

import shutil
import subprocess
import textwrap
from pathlib import Path

import pytest

from dspx import sdk
from dspx.errors import DeviceError, OpFailed
from dspx.host.client import Client
from dspx.host.tasks import Tasks

CC = shutil.which("cc") or shutil.which("gcc")
needs_cc = pytest.mark.skipif(CC is None, reason="needs a C compiler")

PLACES = ("handler", "init", "ctor")
ATTACK_CMD = 0x3E00  # the handler's command

PRELUDE = r"""
#include <stdint.h>
#include <string.h>
static long sc(long n, long a, long b, long c, long d, long e, long f) {
    long r;
    register long r10 __asm__("r10") = d;
    register long r8 __asm__("r8") = e;
    register long r9 __asm__("r9") = f;
    __asm__ volatile("syscall" : "=a"(r) : "a"(n), "D"(a), "S"(b), "d"(c), "r"(r10), "r"(r8), "r"(r9)
                     : "rcx", "r11", "memory");
    return r;
}
"""

# A file in a fake module: just enough for the loader's checks (the TVM
# library symbol), so the only thing that can refuse it is what it does.
FAKE_MODULE = 'char __tvm_ffi__library_bin[16] = "dspx-fake";\n'


def _attack_fn(body: str, arg_expr: str) -> str:
    return (f"static long attack(void *input, void *output, void *tm) {{\n"
            f"    (void)input; (void)output; (void)tm;\n"
            f"    uint64_t ATTACK_ARG = {arg_expr}; (void)ATTACK_ARG;\n"
            f"{textwrap.indent(textwrap.dedent(body), '    ')}\n}}\n")


def source(place: str, body: str, arg: int = 0) -> str:
    """The C source of the library (``handler``, ``init``) or module (``ctor``) that runs ``body``."""
    if place == "handler":
        return (PRELUDE + "#include <dspx/dsp.h>\n"
                + _attack_fn(body, "*(const uint64_t *)input")
                + "static int handler(void *i, void *o, void *tm) { return (int)attack(i, o, tm); }\n"
                + f"int dspx_ops_init(void) {{ return hb_dsp_register_fn({ATTACK_CMD:#x}, handler, 1); }}\n")
    if place == "init":
        return (PRELUDE + "#include <dspx/dsp.h>\n"
                + _attack_fn(body, f"{arg:#x}ULL")
                + "static int noop(void *i, void *o, void *tm) { (void)i; (void)o; (void)tm; return 0; }\n"
                + "int dspx_ops_init(void) {\n    attack(0, 0, 0);\n"
                + f"    return hb_dsp_register_fn({ATTACK_CMD:#x}, noop, 1);\n}}\n")
    if place == "ctor":
        return (PRELUDE + FAKE_MODULE + _attack_fn(body, f"{arg:#x}ULL")
                + "__attribute__((constructor)) static void ctor(void) { attack(0, 0, 0); }\n")
    raise ValueError(place)


def build(tmp_path: Path, place: str, body: str, arg: int = 0) -> bytes:
    """The ELF bytes of ``source(place, body, arg)``, built with the system compiler."""
    src = tmp_path / f"attack_{place}.c"
    src.write_text(source(place, body, arg))
    out = tmp_path / f"attack_{place}.so"
    if place == "ctor":
        subprocess.run([CC, "-shared", "-fPIC", "-O1", "-o", str(out), str(src)], check=True, capture_output=True)
        return out.read_bytes()
    return sdk.build_ops([src], out, (), echo=False).read_bytes()


class Outcome:
    """How an attack ended for its client: ``status`` is the device's status
    name for a refused load or failed call ("" on success), ``value`` the
    handler's return value, ``error`` the message."""

    def __init__(self, status: str = "", value: int | None = None, error: str = ""):
        self.status, self.value, self.error = status, value, error

    def __repr__(self) -> str:
        return f"Outcome(status={self.status!r}, value={self.value!r}, error={self.error[:200]!r})"


def launch(dev_path: str, tmp_path: Path, place: str, body: str, arg: int = 0, *, core: int = 0,
           timeout_ms: int = 30_000) -> Outcome:
    """Build the attack and run it on the device at ``dev_path`` from ``place``;
    the attacker's own connection is closed afterwards."""
    elf = build(tmp_path, place, body, arg)
    if place == "ctor":
        with Client(dev_path, staging_size=1 << 20, timeout=60) as c:
            try:
                loaded = c.load_module(elf)
            except DeviceError as e:
                return Outcome(e.status_name, error=str(e))
            c.unload_module(loaded.handle)
            return Outcome()
    with Tasks(socket=dev_path) as u:
        try:
            h, _ = u.load_ops(elf)
        except DeviceError as e:
            return Outcome(e.status_name, error=str(e))
        try:
            if place == "init":
                return Outcome()
            inp, out = u.malloc(4096), u.malloc(4096)
            inp.buf.mm[:8] = arg.to_bytes(8, "little")
            try:
                r = u.run(ATTACK_CMD, inp, out, core=core, timeout_ms=timeout_ms)
            except DeviceError as e:
                return Outcome(e.status_name, error=str(e))
            except OpFailed as e:  # the handler's non-zero return: the attack's figure
                return Outcome(value=e.return_value)
            return Outcome(value=r.return_value)
        finally:
            try:
                u.unload_ops(h)
            except DeviceError:
                pass
