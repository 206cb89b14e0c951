"""The op export table: the undefined symbols a native op library may have.

A native library (C/C++ against ``dspx/dsp.h``, built with ``dspx
build-ops``) is refused with ERR_SYMBOL, naming the symbol, if any of its
undefined dynamic symbols is outside this table — checked on the ELF bytes
before anything is mapped.  docs/custom-ops.md prints this table
(``python -m dspx.device.core.native_exports`` regenerates that section).

The table is a guard against mistakes (a stray ``fopen`` or ``system``),
not a sandbox: a library runs native code with the core's privileges.
"""
from __future__ import annotations

from collections.abc import Iterable

from .exports import _MATH

#: The SDK: implemented by the core's runtime shim (src/dspx/sdk/dsp/runtime.c).
SDK: tuple[str, ...] = (
    "hb_dsp_register_fn", "hb_dsp_mem_map", "hb_dsp_mem_unmap", "dspx_input_size", "dspx_output_size",
    "xvAllocateBuffer", "xvFreeBuffer", "dspx_idma_copy", "dspx_idma_wait",
    "DmaUtilsAutoInc3d_configure", "DmaUtilsAutoInc3d_trigger", "DmaUtilsAutoInc3d_wait",
    "DmaUtilsAutoInc3d_deconfigure", "dspx_printf", "dspx_log", "dspx_cycles", "dspx_ivp_guarded_load",
)

#: What a cost build (``dspx build-ops --cost-model``) imports besides: the
#: counters its intrinsics bump, a thread-local of the cost shim (dspx/cost.h).
COST: tuple[str, ...] = ("dspx_cost_tls",)

#: libc: memory and string functions, formatting into a buffer, heap, sorting.
LIBC: tuple[str, ...] = (
    "memcpy", "memmove", "memset", "memcmp", "memchr", "strlen", "strnlen", "strcmp", "strncmp", "strchr",
    "strrchr", "strstr", "snprintf", "vsnprintf", "abs", "labs", "llabs", "qsort", "bsearch",
    "malloc", "calloc", "realloc", "free", "aligned_alloc", "posix_memalign",
    # what -D_FORTIFY_SOURCE, -fstack-protector and assert() call
    "__memcpy_chk", "__memmove_chk", "__memset_chk", "__snprintf_chk", "__vsnprintf_chk",
    "__stack_chk_fail", "__assert_fail", "abort",
)

#: libm, single and double precision (the same list modules may import).
LIBM: tuple[str, ...] = tuple(f for name in _MATH for f in (name, name + "f"))

#: gcc/glibc boilerplate every shared object references (weak).
BOILERPLATE: tuple[str, ...] = ("__cxa_finalize", "__gmon_start__", "_ITM_deregisterTMCloneTable",
                                "_ITM_registerTMCloneTable")

OP_EXPORTS: frozenset[str] = frozenset(SDK + COST + LIBC + LIBM + BOILERPLATE)

#: The only shared libraries a native library may name in DT_NEEDED are the
#: modules' ones: exports.ALLOWED_NEEDED.


def check_imports(undefined: Iterable[str]) -> str | None:
    """The first name outside the op export table, or None."""
    for name in undefined:
        if name not in OP_EXPORTS:
            return name
    return None


def markdown() -> str:
    """The table as docs/custom-ops.md shows it."""
    # COST is not printed yet: docs/custom-ops.md gains its row with the cost model's docs
    rows = [("SDK (runtime shim)", SDK), ("libc", LIBC), ("libm", LIBM), ("boilerplate (weak)", BOILERPLATE)]
    out = ["| group | symbols |", "|---|---|"]
    out += [f"| {group} | {', '.join(f'`{n}`' for n in names)} |" for group, names in rows]
    return "\n".join(out)


if __name__ == "__main__":
    print(markdown())
