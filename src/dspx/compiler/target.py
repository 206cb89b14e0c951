"""Which CPU compiled code is for: the ``--target`` names, the LLVM target
dict both compilers build for, the /proc/cpuinfo flags that code needs, and
whether this machine has them."""
from __future__ import annotations

import os

from .. import cpuinfo


def detect_mcpu() -> str:
    """The host CPU name as LLVM knows it (never "native", which TVM turns
    into "generic"); falls back to an x86-64 micro-architecture level read
    from /proc/cpuinfo flags."""
    from tvm.target import codegen

    try:
        cpu = codegen.llvm_get_system_cpu()
        if cpu and cpu != "generic" and codegen.llvm_is_valid_cpu(cpu, "x86_64-linux-gnu"):
            return cpu
    except Exception:  # older/limited LLVM builds lack these helpers
        pass
    flags = cpuinfo.flags()
    if flags is None:
        return "x86-64"
    if {"avx512f", "avx512bw", "avx512cd", "avx512dq", "avx512vl"} <= flags:
        return "x86-64-v4"
    if {"avx2", "bmi2", "fma", "movbe"} <= flags:
        return "x86-64-v3"
    if {"sse4_2", "popcnt", "ssse3"} <= flags:
        return "x86-64-v2"
    return "x86-64"


#: the portable x86-64 levels; any LLVM CPU name (``llc -mcpu=help``) works too
TARGET_LEVELS = ("x86-64", "x86-64-v2", "x86-64-v3", "x86-64-v4")
# Portable by default: modules travel, and measured here x86-64-v3 code was no
# slower than the host's own CPU (ResNet-18 / ShuffleNet paired v3/native 0.99 /
# 0.98 in-process): the heavy operators are firmware kernels that choose their
# instructions at run time; generated glue is a few percent of a call.
DEFAULT_TARGET = "x86-64-v3"

# LLVM feature name -> /proc/cpuinfo flag, for the instruction-set extensions
# generated code may use (what the device's loader checks, dspx.device.core.cpu)
_CPUINFO_FLAG = {
    "sse3": "pni", "ssse3": "ssse3", "sse4.1": "sse4_1", "sse4.2": "sse4_2", "popcnt": "popcnt",
    "avx": "avx", "avx2": "avx2", "fma": "fma", "f16c": "f16c", "bmi": "bmi1", "bmi2": "bmi2",
    "lzcnt": "abm", "movbe": "movbe", "avx512f": "avx512f", "avx512cd": "avx512cd",
    "avx512bw": "avx512bw", "avx512dq": "avx512dq", "avx512vl": "avx512vl",
    "avx512ifma": "avx512ifma", "avx512vbmi": "avx512vbmi", "avx512vbmi2": "avx512_vbmi2",
    "avx512vnni": "avx512_vnni", "avx512bitalg": "avx512_bitalg",
    "avx512vpopcntdq": "avx512_vpopcntdq", "avx512bf16": "avx512_bf16",
    "avx512fp16": "avx512_fp16", "avxvnni": "avx_vnni", "gfni": "gfni", "vaes": "vaes",
    "vpclmulqdq": "vpclmulqdq", "sse4a": "sse4a", "amx-tile": "amx_tile", "amx-int8": "amx_int8",
    "amx-bf16": "amx_bf16",
}


def resolve_cpu(target: str | None = None) -> str:
    """The LLVM CPU for ``--target``: "native" (this machine, detected), an
    x86-64 level, or an LLVM CPU name."""
    from tvm.target import codegen

    if target is None:  # the default, unless this machine could not even run it
        return DEFAULT_TARGET if not missing_here(cpu_features(DEFAULT_TARGET)) else detect_mcpu()
    name = target.strip()
    if name == "native":
        return detect_mcpu()
    try:
        valid = codegen.llvm_is_valid_cpu(name, "x86_64-linux-gnu")
    except Exception:  # noqa: BLE001 - LLVM builds without the helper: trust the name
        valid = True
    if not valid:
        from dspx.compiler.checks import CompileError

        raise CompileError(f"unknown --target {name!r}: use native, {', '.join(TARGET_LEVELS)} "
                           f"or an LLVM x86 CPU name (e.g. znver4, icelake-server)")
    return name


def cpu_features(mcpu: str) -> list[str]:
    """The /proc/cpuinfo flags code generated for ``mcpu`` may need."""
    import tvm
    from tvm.target import codegen

    t = tvm.target.Target({"kind": "llvm", "mtriple": "x86_64-linux-gnu", "mcpu": mcpu})
    return sorted({_CPUINFO_FLAG[f] for f in codegen.llvm_get_cpu_features(t) if f in _CPUINFO_FLAG})


def make_target(target: str | None = None) -> dict:
    """The LLVM target dict for ``--target`` (see ``resolve_cpu``), on all cores."""
    return {"kind": "llvm", "mtriple": "x86_64-linux-gnu", "mcpu": resolve_cpu(target),
            "num-cores": os.cpu_count() or 1}


def missing_here(features: list[str]) -> list[str]:
    """Features the target needs that this machine's CPU lacks (then the
    module cannot be verified here)."""
    have = cpuinfo.flags()
    if have is None:
        return []
    return sorted(set(features) - have)


def detect_target(threads: int | None = None):
    """A ``tvm.target.Target`` for this CPU (``detect_mcpu``) with ``threads``
    cores (default: all of them)."""
    import tvm

    return tvm.target.Target({**make_target("native"), "num-cores": int(threads or os.cpu_count() or 1)})


def target_cores(target) -> int:
    """The cores a target is built for (its ``num-cores``, else this machine's)."""
    import tvm

    t = tvm.target.Target(target) if not isinstance(target, tvm.target.Target) else target
    n = t.attrs.get("num-cores") if hasattr(t, "attrs") else None
    try:
        return max(1, int(n)) if n is not None else (os.cpu_count() or 1)
    except (TypeError, ValueError):
        return os.cpu_count() or 1
