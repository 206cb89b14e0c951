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

import os

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


def _patch_sdk() -> None:
    from dspx import sdk

    build_ops, build_cached = sdk.build_ops, sdk.build_cached

    def sanitized_build_ops(sources, output, extra_flags=(), echo=True, cost=False):
        return build_ops(sources, output, _with_san(extra_flags), echo=echo, cost=cost)

    def sanitized_build_cached(name, sources, flags=(), *, sdk=True):
        return build_cached(name, sources, _with_san(flags), sdk=sdk)  # the flags are the cache key

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
