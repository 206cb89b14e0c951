"""The operator SDK: headers for DSP operators in C/C++, and building them.

* ``INCLUDE_DIR`` holds ``dspx/dsp.h`` (the seed's DSP-side API) and
  ``dspx/ivp.h`` (the vector intrinsics emulation); ``cflags()`` says how to
  point a compiler at it.
* ``build_ops(sources, output)`` compiles an op library with the system
  compilers: ``cc`` for ``.c``, ``c++`` for ``.cc``/``.cpp``/``.cxx``,
  ``-O2 -fPIC -shared`` plus the SDK flags.  Compiler errors come back as
  they are, in ``BuildError``.
* ``build_cached(...)`` builds the device's own C (the runtime shim, the
  firmware softmax) once into the cache area "sdk" (``dspx.cache``:
  ``<cache>/sdk/dsp-<hash>/``), never into the package tree.
* ``cost=True`` (build_ops, runtime_shim, builtin_softmax): the timing
  model's build (``-DDSPX_COST=1``, dspx/cost.h): the intrinsics count
  themselves and the shim keeps the modeled clock.  Cached apart from the
  plain build, which it leaves exactly as it was.
"""
from __future__ import annotations

import functools
import os
import subprocess
import sys
import tempfile
from collections.abc import Iterable, Sequence
from pathlib import Path

from .. import cache

HERE = Path(__file__).resolve().parent
INCLUDE_DIR = HERE / "include"
DSP_DIR = HERE / "dsp"
CXX_SUFFIXES = (".cc", ".cpp", ".cxx", ".C")
#: -ffp-contract=off: IVP_MULAN_2XF32 is documented unfused, whatever -march says.
#: -Wno-psabi: GCC notes an ABI change for 512-bit vector arguments of the
#: intrinsics' inline helpers, which never cross a real call.
#: -Wl,--as-needed: no DT_NEEDED for libraries a library does not use (the
#: device admits only libc/libm/libgcc_s/libstdc++).
#: -march=native: the simulated DSP is this host, so its vector ISA is the
#: host's (the intrinsics' 512-bit vectors are one AVX-512 register here;
#: on SSE2 alone the seed's softmax runs ~5x slower).
SDK_FLAGS = ("-march=native", "-ffp-contract=off", "-Wno-psabi")
BASE_FLAGS = ("-O2", "-fPIC", "-shared")
LINK_FLAGS = ("-Wl,--as-needed", "-lm")
#: The seed's C++ unmaps with hb_dsp_mem_unmap((uint32_t)src): a 32-bit DSP
#: pointer, an error in C++ on a 64-bit host.  -fpermissive keeps it the
#: warning it is in C.
CXX_FLAGS = ("-fpermissive",)
BUILD_TIMEOUT_S = 300
#: A cost build.  gnu2 TLS descriptors: the counters (dspx_cost_tls, a
#: thread-local of the shim) are reached without __tls_get_addr, so a
#: counted library imports nothing outside the op export table and needs
#: no ld-linux in DT_NEEDED.
COST_FLAGS = ("-DDSPX_COST=1", "-mtls-dialect=gnu2")


class BuildError(RuntimeError):
    """The compiler failed; the message is its output, as it printed it."""


def cflags() -> str:
    return f"-I{INCLUDE_DIR}"


def _cc() -> str:
    return os.environ.get("CC", "cc")


def _cxx() -> str:
    return os.environ.get("CXX", "c++")


def _run(cmd: list[str]) -> str:
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=BUILD_TIMEOUT_S)
    except FileNotFoundError:
        raise BuildError(f"compiler {cmd[0]!r} not found (set CC / CXX)") from None
    except subprocess.TimeoutExpired:
        raise BuildError(f"{cmd[0]} did not finish within {BUILD_TIMEOUT_S} s") from None
    if p.returncode != 0:
        raise BuildError(p.stdout + p.stderr)
    return p.stdout + p.stderr


def build_ops(sources: Sequence[str | Path], output: str | Path, extra_flags: Iterable[str] = (),
              echo: bool = True, cost: bool = False) -> Path:
    """Compile ``sources`` into the op library ``output``; returns its path.
    Warnings go to stderr (when ``echo``); errors raise BuildError.
    ``cost``: a counted build for a device with a cost model (COST_FLAGS)."""
    sources = [Path(s) for s in sources]
    if not sources:
        raise BuildError("no source files")
    for s in sources:
        if not s.is_file():
            raise BuildError(f"{s}: no such file")
    output = Path(output)
    extra = [*(COST_FLAGS if cost else ()), *extra_flags]
    cxx = any(s.suffix in CXX_SUFFIXES for s in sources)
    common = [*BASE_FLAGS, *SDK_FLAGS, cflags(), *extra]
    notes = []
    with tempfile.TemporaryDirectory(prefix="dspx-build-") as tmp:
        objs = []
        for i, s in enumerate(sources):
            is_cxx = s.suffix in CXX_SUFFIXES
            obj = Path(tmp) / f"{i}-{s.stem}.o"
            notes.append(_run([_cxx() if is_cxx else _cc(), *common, *(CXX_FLAGS if is_cxx else ()),
                               "-c", str(s), "-o", str(obj)]))
            objs.append(str(obj))
        # link into a temporary name first: a reader never sees half a library
        out_tmp = Path(tmp) / "lib.so"
        notes.append(_run([_cxx() if cxx else _cc(), *BASE_FLAGS, *extra, *objs, "-o", str(out_tmp), *LINK_FLAGS]))
        output.parent.mkdir(parents=True, exist_ok=True)
        tmp_out = output.with_name(f".{output.name}.{os.getpid()}.tmp")
        tmp_out.write_bytes(out_tmp.read_bytes())
        os.replace(tmp_out, output)
    text = "".join(notes)
    if echo and text:
        sys.stderr.write(text)
    return output


# ------------------------------------------------------------------ cached device builds

@functools.lru_cache(maxsize=None)
def _compiler_id(cc: str) -> str:
    try:
        return subprocess.run([cc, "--version"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.TimeoutExpired):
        return cc


@functools.lru_cache(maxsize=None)
def _cpu_id() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            first = f.read().split("\n\n", 1)[0]  # the first processor's block
    except OSError:
        return ""
    return "".join(line for line in first.splitlines() if line.startswith(("model name", "flags")))


def build_cached(name: str, sources: Sequence[Path], flags: Sequence[str] = (), *, sdk: bool = True) -> Path:
    """``name`` built from ``sources`` into the cache (once per content,
    compiler and flags).  ``sdk``: build as an op library (build_ops);
    otherwise as a plain shared object with ``flags``."""

    files = [*(p for p in sorted((INCLUDE_DIR / "dspx").rglob("*")) if p.is_file()), *sources]
    key = cache.digest(files, *(p.name for p in files),
                       repr((list(flags), sdk, BASE_FLAGS, SDK_FLAGS, LINK_FLAGS, CXX_FLAGS)),
                       _compiler_id(_cc()), _compiler_id(_cxx()),
                       _cpu_id())  # -march=native: a cache shared across hosts must not mix CPUs

    def build(d: Path) -> None:
        if sdk:
            build_ops(sources, d / name, flags, echo=False)
        else:
            _run([_cc(), *BASE_FLAGS, *flags, cflags(), *map(str, sources), "-o", str(d / name)])
    out = cache.area("sdk") / f"dsp-{key}"
    cache.publish(out, build, complete=name)
    return out / name


def runtime_shim(cost: bool = False) -> Path:
    """The core's runtime shim (dsp/runtime.c, which takes the wire's status
    codes from the generated dspx_wire.h), built once; ``cost``: the shim
    that also keeps the modeled clock."""
    from . import gen_wire

    wire = gen_wire.include_dir(cache.area("sdk"))
    return build_cached("libdspx_dsp_rt_cost.so" if cost else "libdspx_dsp_rt.so", [DSP_DIR / "runtime.c"],
                        ["-Wall", "-Wextra", "-Werror", "-fvisibility=hidden", "-pthread", "-ldl", f"-I{wire}",
                         *(COST_FLAGS if cost else ())], sdk=False)


def builtin_softmax(cost: bool = False) -> Path:
    """The firmware softmax (dsp/builtin_softmax.cc, cmd 0x1402), built once
    (``cost``: counted)."""
    return build_cached("builtin_softmax_cost.so" if cost else "builtin_softmax.so", [DSP_DIR / "builtin_softmax.cc"],
                        ["-Wall", "-Wextra", "-Werror", *(COST_FLAGS if cost else ())])
