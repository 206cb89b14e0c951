"""Ahead-of-time compiler (host side)."""
from __future__ import annotations

from pathlib import Path


def compiler_digest() -> str:
    """What every compiled artefact depends on besides its input: TVM's
    version and the sources of the compiler and of the ABI it writes
    (the one key part of ``dspx.cache`` builds the compiler makes)."""
    import tvm

    from .. import cache

    here = Path(__file__).parent
    return cache.digest([*sorted(here.rglob("*.py")), *sorted((here.parent / "abi").glob("*.py"))],
                        tvm.__version__)
