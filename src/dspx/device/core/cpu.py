"""Refuse a module built for a CPU this device lacks (ERR_LOAD), before mapping it.

A module's generated code uses the instruction set of its compile target
(``dspx compile --target``); running AVX-512 code on a CPU without it ends in
SIGILL somewhere inside the first call.  The compiler records the CPU
features the target needs in the module's signature (``cpu_features``,
``/proc/cpuinfo`` flag names; docs/compiler.md); the loader calls
:func:`check_module` with the signature, and a missing feature is a
``LoadError`` naming it.
"""
from __future__ import annotations

from dspx import cpuinfo
from dspx.device.core.errors import LoadError


def host_features() -> frozenset[str]:
    """The CPU flags this device's CPU has (``/proc/cpuinfo``, first processor; none when unreadable)."""
    return cpuinfo.flags() or frozenset()


def missing_features(required, have=None) -> list[str]:
    have = host_features() if have is None else have
    return sorted(set(required) - set(have))


def check_module(signature) -> None:
    """Raise LoadError if the module's code needs CPU features this CPU lacks.

    Modules without a recorded target (older compilers) are not checked: there
    is nothing to check them against.  An unreadable /proc/cpuinfo is not a
    reason to refuse a module either."""
    if signature is None or not signature.cpu_features or not host_features():
        return
    missing = missing_features(signature.cpu_features)
    if missing:
        raise LoadError(f"module was compiled for CPU {signature.target_cpu or '?'} and needs "
                        f"{', '.join(missing)}, which this device's CPU lacks; recompile with "
                        f"`dspx compile --target x86-64-v3` (portable) or --target native on this machine")
