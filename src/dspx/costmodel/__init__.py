"""The timing model (issue 26): machine profiles as data and the counting
clock that turns counted operations into modeled DSP cycles.

A base-layer package: it imports nothing of dspx but ``dspx.abi``, so the
device, the host and the compiler can all use it.  ``profile`` reads and
checks profiles; ``clock`` holds the counting rules (the same in C and
Python, docs/cost-model.md).
"""
from .clock import CostClock
from .profile import ENV, Param, Profile, ProfileError, from_env, load, names, resolve_env

__all__ = ["CostClock", "ENV", "Param", "Profile", "ProfileError", "from_env", "load", "names", "resolve_env"]
