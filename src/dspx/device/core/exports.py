"""The firmware export table: the undefined ELF symbols a loaded module may import.

A module's undefined dynamic symbols are resolved against what the device
process exports.  The loader refuses (ERR_SYMBOL, naming the symbol) any
import outside this table *before* the module is mapped, so a module cannot
reach the rest of libc (``system``, ``fork``, sockets …) through the dynamic
linker.

What real TVM modules import was measured on modules compiled here
(docs/exports.md): the TVM FFI C ABI (``TVMFFI*``), the TVM backend runtime
(``TVMBackend*``: workspace allocation, the parallel-for pool), the C math
library calls LLVM lowers math intrinsics to (``expf``, ``tanhf`` …), the
memory builtins LLVM emits (``memcpy``, ``memset`` …) and gcc/glibc
start-up boilerplate (weak references).

Firmware kernels called through ``R.call_dps_packed("name", …)`` are not ELF
symbols: they are names inside the module's ``__tvm_ffi__library_bin``, carried
in the module's signature blob and checked separately against the kernel
library (see loader).  Symbol versions (``expf@GLIBC_2.27``) are not part of
the name compared here.
"""
from __future__ import annotations

from collections.abc import Iterable

# Every symbol with one of these prefixes: the C ABIs of libtvm_ffi and
# libtvm_runtime, which the device links and keeps ABI-stable.
EXPORT_PREFIXES: tuple[str, ...] = ("TVMFFI", "TVMBackend")

_MATH = ("exp", "exp2", "expm1", "log", "log2", "log10", "log1p", "pow", "sqrt", "cbrt", "hypot",
         "sin", "cos", "tan", "asin", "acos", "atan", "atan2", "sinh", "cosh", "tanh",
         "asinh", "acosh", "atanh", "erf", "erfc", "lgamma", "tgamma", "fmod", "remainder",
         "round", "nearbyint", "rint", "floor", "ceil", "trunc", "fabs", "fma", "fmin", "fmax",
         "copysign", "ldexp", "frexp")

EXPORT_NAMES: frozenset[str] = frozenset(
    # libm, single and double precision
    [f for name in _MATH for f in (name, name + "f")]
    # memory builtins LLVM emits for copies and zero fills
    + ["memcpy", "memmove", "memset", "memcmp"]
    # half-precision conversions from compiler-rt/libgcc, when not inlined
    + ["__extendhfsf2", "__truncsfhf2", "__truncdfhf2", "__gnu_h2f_ieee", "__gnu_f2h_ieee"]
    # gcc/glibc boilerplate every shared object references (weak)
    + ["__cxa_finalize", "__gmon_start__", "_ITM_deregisterTMCloneTable", "_ITM_registerTMCloneTable"]
)


def is_exported(name: str) -> bool:
    return name in EXPORT_NAMES or name.startswith(EXPORT_PREFIXES)


def check_imports(undefined_names: Iterable[str]) -> str | None:
    """The first name the firmware does not export, or None if all resolve."""
    for name in undefined_names:
        if not is_exported(name):
            return name
    return None


#: The only shared libraries a module (or a native op library) may name in
#: DT_NEEDED: the system's C runtime.  Anything else would run its own
#: constructors, and import whatever it likes, before any check of ours.
ALLOWED_NEEDED: frozenset[str] = frozenset({"libc.so.6", "libm.so.6", "libgcc_s.so.1", "libstdc++.so.6"})


def linker_tags(elf, what: str, error=None) -> list[tuple[str, str | None]]:
    """(d_tag, needed name or None) of the dynamic segment the dynamic linker
    reads (PT_DYNAMIC), after checking that the section table's ``.dynamic``,
    ``.dynsym`` and ``.dynstr`` are the same bytes the segment points at.
    Checks that read sections by name alone are blind to a module that
    renames ``.dynamic`` (its DT_NEEDED then goes unseen) or points
    DT_SYMTAB / DT_STRTAB somewhere else (its imports then go unseen)."""
    if error is None:
        from .errors import LoadError as error
    segs = list(elf.iter_segments("PT_DYNAMIC"))
    if len(segs) != 1:
        raise error(f"{what} has {len(segs)} PT_DYNAMIC segments; a shared object has exactly one")
    seg = segs[0]
    dyn = elf.get_section_by_name(".dynamic")
    if dyn is None or dyn["sh_offset"] != seg["p_offset"] or dyn["sh_size"] != seg["p_filesz"]:
        raise error(f"{what}: the .dynamic section is not the PT_DYNAMIC segment the dynamic linker reads")
    tags = list(seg.iter_tags())
    table = {t.entry.d_tag: t.entry.d_val for t in tags}
    for tag, name in (("DT_SYMTAB", ".dynsym"), ("DT_STRTAB", ".dynstr")):
        sec = elf.get_section_by_name(name)
        if tag in table and (sec is None or sec["sh_addr"] != table[tag]):
            raise error(f"{what}: {tag} 0x{table[tag]:x} is not the {name} section")
    return [(t.entry.d_tag, getattr(t, "needed", None)) for t in tags]


def check_libraries(tags, what: str) -> None:
    """Refuse DT_NEEDED outside ALLOWED_NEEDED (SymbolError, naming it) and
    any DT_RPATH / DT_RUNPATH (LoadError): an allowed name looked up in a
    directory of the module's choosing is its own library again.
    ``tags``: (d_tag, needed name or None) of the ELF's dynamic section."""
    from .errors import LoadError, SymbolError

    for tag, needed in tags:
        if tag in ("DT_RPATH", "DT_RUNPATH"):
            raise LoadError(f"{what} sets {tag[3:]}; libraries are looked up only where the device's are "
                            f"(drop -rpath)")
        if tag == "DT_NEEDED" and needed not in ALLOWED_NEEDED:
            raise SymbolError(needed, f"{what} needs {needed!r}; it may link only "
                                      f"{', '.join(sorted(ALLOWED_NEEDED))}")
