"""Build helpers for libdspx, the C/C++ host library.

``build()`` generates ``dspx_wire.h`` from the Python protocol table,
compiles ``libdspx.so`` (C11, libc only) and ``libdspx++.so`` (the C++
``c7x::Module``, C++17) with the system compilers into the cache area "sdk"
(``dspx.cache``: ``$DSPX_CACHE/sdk/<hash of the sources>/``, else under
``$XDG_CACHE_HOME/dspx`` or ``~/.cache/dspx``; never into the package
tree), builds the ``c7x_compute`` CLI on them, writes ``dspx.pc`` beside
them and returns that directory.
It is idempotent and rebuilds when any source changes.  ``cflags()`` and
``libs()`` say what a program needs to build against it.
"""
from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

from .. import cache
from . import gen_wire

HERE = Path(__file__).resolve().parent
INCLUDE = HERE / "include"
HOST = HERE / "host"
LIB_CFLAGS = ["-O2", "-fPIC", "-Wall", "-Wextra", "-Werror", "-fvisibility=hidden", "-D_GNU_SOURCE", "-pthread"]
PUBLIC_HEADERS = ["c7x_client.h", "c7x_runtime.h", "hb_ucp.h", "hb_dsp.h", "dlpack/dlpack.h"]
BUILD_TIMEOUT = 300


class BuildError(RuntimeError):
    pass


def _cc() -> str:
    return os.environ.get("CC", "cc")


def _cxx() -> str:
    return os.environ.get("CXX", "c++")


def _compiler_id(exe: str) -> bytes:
    try:
        return subprocess.run([exe, "--version"], capture_output=True, timeout=30).stdout
    except (OSError, subprocess.TimeoutExpired):
        return exe.encode()


def sources() -> list[Path]:
    """Everything the build depends on."""
    files = [INCLUDE / h for h in PUBLIC_HEADERS]
    files += sorted(p for p in HOST.iterdir() if p.suffix in (".c", ".cc", ".h"))
    files += sorted((HOST / "cli").glob("*.cc"))
    files += [Path(__file__).resolve(), *gen_wire.source_files()]
    return files


def digest() -> str:
    files = sources()
    names = [str(p.relative_to(HERE.parent.parent)) if p.is_relative_to(HERE.parent.parent) else p.name
             for p in files]
    return cache.digest(files, *names, _compiler_id(_cc()), _compiler_id(_cxx()), " ".join(LIB_CFLAGS))


def build_dir() -> Path:
    """Where this build of the sources lives: the cache area "sdk" (never the package tree)."""
    return cache.area("sdk") / digest()


def _run(cmd: list[str], cwd: Path) -> None:
    try:
        r = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=BUILD_TIMEOUT)
    except subprocess.TimeoutExpired:
        raise BuildError(f"{cmd[0]} did not finish within {BUILD_TIMEOUT} s: {' '.join(cmd)}") from None
    except FileNotFoundError:
        raise BuildError(f"no compiler {cmd[0]!r} (set CC / CXX)") from None
    if r.returncode != 0:
        raise BuildError(f"{' '.join(cmd)}\n{r.stdout}{r.stderr}")


def build(force: bool = False) -> Path:
    """Build libdspx (if needed) and return the directory holding libdspx.so,
    libdspx++.so, include/dspx_wire.h, dspx.pc and the c7x_compute CLI."""
    out = build_dir()
    if force:
        shutil.rmtree(out, ignore_errors=True)
    cache.publish(out, lambda tmp: _build_into(tmp, out), complete=".built")
    return out


def _build_into(tmp: Path, out: Path) -> None:
    """Compile everything into ``tmp``, for its final place ``out`` (rpath, dspx.pc)."""
    inc = tmp / "include"
    gen_wire.write(inc / "dspx_wire.h")
    incs = [f"-I{inc}", f"-I{INCLUDE}", f"-I{HOST}"]
    objs_c, objs_cc = [], []
    for src in sorted(HOST.glob("*.c")):
        obj = tmp / (src.stem + ".o")
        _run([_cc(), "-std=c11", *LIB_CFLAGS, *incs, "-c", str(src), "-o", str(obj)], tmp)
        objs_c.append(str(obj))
    for src in sorted(HOST.glob("*.cc")):
        obj = tmp / (src.stem + ".o")
        _run([_cxx(), "-std=c++17", *LIB_CFLAGS, *incs, "-c", str(src), "-o", str(obj)], tmp)
        objs_cc.append(str(obj))
    _run([_cc(), "-shared", "-pthread", "-o", str(tmp / "libdspx.so"), *objs_c,
          "-Wl,-soname,libdspx.so", "-Wl,--no-undefined", "-Wl,-z,defs"], tmp)
    _run([_cxx(), "-shared", "-pthread", "-o", str(tmp / "libdspx++.so"), *objs_cc,
          "-Wl,-soname,libdspx++.so", "-Wl,--no-undefined", "-Wl,-rpath,$ORIGIN", f"-L{tmp}", "-ldspx"], tmp)
    # c7x_compute, the TI-shaped CLI, built on the libraries like any user program
    for src in sorted((HOST / "cli").glob("*.cc")):
        _run([_cxx(), "-std=c++17", "-O2", "-Wall", "-Wextra", "-Werror", f"-I{inc}", f"-I{INCLUDE}", str(src),
              "-o", str(tmp / src.stem), f"-L{tmp}", f"-Wl,-rpath,{out}", "-ldspx++", "-ldspx"], tmp)
    for o in objs_c + objs_cc:
        os.unlink(o)
    (tmp / "dspx.pc").write_text(_pkgconfig(out))
    (tmp / ".built").write_text("ok\n")


def _pkgconfig(libdir: Path) -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        ver = version("dspx")
    except PackageNotFoundError:
        ver = "0"
    return (f"prefix={libdir}\nlibdir={libdir}\nincludedir={INCLUDE}\ngenincludedir={libdir}/include\n\n"
            f"Name: dspx\nDescription: dspx host library: c7x_client (C), c7x::Module (C++), hbUCP/hbDSP (C)\n"
            f"Version: {ver}\n"
            f"Cflags: -I${{includedir}} -I${{genincludedir}}\n"
            f"Libs: -L${{libdir}} -Wl,-rpath,${{libdir}} -Wl,--as-needed -ldspx++ -ldspx -Wl,--no-as-needed\n")


def include_dirs() -> list[Path]:
    return [INCLUDE, build() / "include"]


def cflags() -> str:
    """Compiler flags for a program using libdspx (C or C++)."""
    return " ".join(f"-I{d}" for d in include_dirs())


def libs() -> str:
    """Linker flags: one string for C and C++ programs (``--as-needed`` drops
    libdspx++ and so libstdc++ from a C program that does not use c7x::Module)."""
    d = build()
    # -I of the generated dspx_wire.h too: `dspx sdk --cflags` prints the
    # source include dir only, and `$(dspx sdk --cflags --libs)` must build
    # (the compiler driver takes -I anywhere; a link-only step ignores it).
    return f"-I{d}/include -L{d} -Wl,-rpath,{d} -Wl,--as-needed -ldspx++ -ldspx -Wl,--no-as-needed"


def cli_path() -> Path:
    """The c7x_compute command line (TI-shaped, over libdspx)."""
    return build() / "c7x_compute"


def pkgconfig_path() -> Path:
    """The dspx.pc file (for PKG_CONFIG_PATH)."""
    return build() / "dspx.pc"


def compile_program(sources, output, *, cxx: bool | None = None, extra=(), timeout: float = BUILD_TIMEOUT) -> Path:
    """Compile and link a host program against libdspx (used by the tests and
    examples).  C++ when any source is .cc/.cpp, else C11."""
    sources = [str(s) for s in sources]
    if cxx is None:
        cxx = any(s.endswith((".cc", ".cpp", ".cxx")) for s in sources)
    std = "-std=c++17" if cxx else "-std=c11"
    cmd = [_cxx() if cxx else _cc(), std, "-O2", "-Wall", "-Wextra", "-Werror", *cflags().split(), *sources,
           "-o", str(output), *libs().split(), *extra]
    try:
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        raise BuildError(f"compiling {output} took longer than {timeout} s") from None
    if r.returncode != 0:
        raise BuildError(f"{' '.join(cmd)}\n{r.stdout}{r.stderr}")
    if r.stderr.strip():
        raise BuildError(f"compiler warnings for {output}:\n{r.stderr}")
    return Path(output)


__all__ = ["build", "cflags", "libs", "pkgconfig_path", "cli_path", "compile_program", "BuildError", "build_dir"]
