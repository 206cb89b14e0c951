"""A pytest plugin (``-p sanitize_plugin``, loaded by tests/sdk/test_sanitized.py
into a pytest subprocess): every C build the SDK tests make — the DSP runtime
shim, op libraries and the IVP harness (dspx.sdk), libdspx and the programs
linked against it (dspx.sdk.libdspx) — is built with ASan and UBSan instead.

The sanitized builds go to their own cache entries (the sanitizer flags are
part of every cache key), so the plain ones stay as they are.  A sanitized op
library imports the sanitizers' runtime, needs libasan/libubsan and has
their module constructor: the loader's checks let exactly those through here,
and nothing else changes in them.  A device process of the tests would run
the plain shim and refuse a sanitized library: tests that start one are left
out when this process itself runs under ASan (LD_PRELOAD)."""
from __future__ import annotations

import hashlib
import os
import shutil
from pathlib import Path

SAN = ("-fsanitize=address,undefined", "-fno-sanitize-recover=all", "-fno-omit-frame-pointer", "-g")
SAN_PREFIXES = ("__asan_", "__ubsan_", "__sanitizer_", "__lsan_")
SAN_NEEDED = frozenset({"libasan.so.8", "libubsan.so.1"})
#: GCC's module constructor / destructor that register a library's globals with ASan
SAN_INIT = frozenset({"_sub_I_00099_0", "_sub_I_00099_1"})
SAN_FINI = frozenset({"_sub_D_00099_0", "_sub_D_00099_1"})
#: fixtures that start a device process (it would load the plain shim)
DEVICE_FIXTURES = frozenset({"device", "loaded"})


def _with_san(flags) -> list[str]:
    flags = list(flags)
    return flags + [f for f in SAN if f not in flags]


def _includes_digest(sources, flags) -> str:
    """What a source may include beyond the SDK headers (the cache key has
    those and the sources): the C/C++ files beside each source and beside a
    file a -D flag names (the IVP harness's -DDSPX_SEED)."""
    named = [Path(f.split("=", 1)[1].strip('"')) for f in flags if f.startswith("-D") and "=" in f]
    dirs = {Path(s).resolve().parent for s in sources} | {p.resolve().parent for p in named if p.is_file()}
    h = hashlib.sha256()
    for p in sorted(f for d in dirs for f in d.iterdir() if f.suffix in (".c", ".cc", ".cpp", ".h", ".hpp")):
        h.update(str(p).encode() + b"\0" + p.read_bytes())
    return h.hexdigest()[:16]


def _patch_sdk() -> None:
    from dspx import sdk

    build_ops, build_cached = sdk.build_ops, sdk.build_cached
    building = []  # set while build_cached runs the real build_ops

    def sanitized_build_ops(sources, output, extra_flags=(), echo=True, cost=False):
        if building:
            return build_ops(sources, output, _with_san(extra_flags), echo=echo, cost=cost)
        # cached by content: a sanitized compile of the seed's C++ takes seconds
        flags = _with_san([*(sdk.COST_FLAGS if cost else ()), *extra_flags])
        flags.append(f"-DDSPX_SAN_DEPS={_includes_digest(sources, flags)}")
        building.append(1)
        try:
            built = build_cached(Path(output).name, [Path(s) for s in sources], flags, sdk=True)
        finally:
            building.pop()
        Path(output).parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(built, output)
        return Path(output)

    def sanitized_build_cached(name, sources, flags=(), *, sdk=True):
        building.append(1)
        try:
            return build_cached(name, sources, _with_san(flags), sdk=sdk)  # the flags are the cache key
        finally:
            building.pop()

    sdk.build_ops, sdk.build_cached = sanitized_build_ops, sanitized_build_cached


def _patch_libdspx() -> None:
    from dspx.sdk import libdspx

    run, compile_program = libdspx._run, libdspx.compile_program
    libdspx.LIB_CFLAGS = _with_san(libdspx.LIB_CFLAGS)  # part of the build directory's digest

    def sanitized_run(cmd, cwd):
        return run([cmd[0], *SAN, *cmd[1:]], cwd)  # compiles and links alike

    def sanitized_compile_program(sources, output, *, cxx=None, extra=(), **kw):
        return compile_program(sources, output, cxx=cxx, extra=(*extra, *SAN), **kw)

    libdspx._run, libdspx.compile_program = sanitized_run, sanitized_compile_program


def _patch_loader() -> None:
    from dspx.device.core import native

    check_imports = native.check_imports
    native.check_imports = lambda names: check_imports([n for n in names if not n.startswith(SAN_PREFIXES)])
    native.ALLOWED_NEEDED = native.ALLOWED_NEEDED | SAN_NEEDED
    native.ALLOWED_INIT = native.ALLOWED_INIT | SAN_INIT
    native.ALLOWED_FINI = native.ALLOWED_FINI | SAN_FINI


def pytest_configure(config):
    _patch_sdk()
    _patch_libdspx()
    _patch_loader()


def pytest_collection_modifyitems(config, items):
    if "libasan" not in os.environ.get("LD_PRELOAD", ""):
        return
    keep, drop = [], []
    for item in items:
        (drop if DEVICE_FIXTURES & set(getattr(item, "fixturenames", ())) else keep).append(item)
    if drop:
        config.hook.pytest_deselected(items=drop)
        items[:] = keep
