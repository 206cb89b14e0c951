"""This machine's CPU as /proc/cpuinfo describes its first processor: the
one reader the compiler (which code this CPU runs), the device (which modules
it may load) and the benchmarks (what they ran on) share."""
from __future__ import annotations

import functools
import re


@functools.lru_cache(maxsize=None)
def _fields(path: str = "/proc/cpuinfo") -> dict[str, str] | None:
    """The first processor's ``key: value`` lines (None when the file cannot be read)."""
    try:
        with open(path) as f:
            text = f.read()
    except OSError:
        return None
    fields: dict[str, str] = {}
    for line in text.split("\n\n", 1)[0].splitlines():
        key, sep, value = line.partition(":")
        if sep:
            fields.setdefault(key.strip(), value.strip())
    return fields


def flags(path: str = "/proc/cpuinfo") -> frozenset[str] | None:
    """The CPU's feature flags (``avx2``, ``avx512f`` …); None when /proc/cpuinfo cannot be read."""
    fields = _fields(path)
    return None if fields is None else frozenset(fields.get("flags", "").split())


def model_name(path: str = "/proc/cpuinfo") -> str:
    return (_fields(path) or {}).get("model name") or "unknown"


def mhz(path: str = "/proc/cpuinfo") -> float | None:
    """The clock /proc/cpuinfo reports (a VM's nominal one), if any."""
    m = re.match(r"[\d.]+", (_fields(path) or {}).get("cpu MHz", ""))
    return float(m.group(0)) if m else None
