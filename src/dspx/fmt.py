"""Numbers for people: sizes as 512M, times with their unit."""
from __future__ import annotations


def size(n: int) -> str:
    """512M, 12M, 64K, 1.5G (binary units, the form --carveout-size takes)."""
    for unit, shift in (("G", 30), ("M", 20), ("K", 10)):
        if n >= 1 << shift:
            v = n / (1 << shift)
            return f"{v:.0f}{unit}" if v == int(v) else f"{v:.1f}{unit}"
    return f"{n}B"


def duration_ns(ns: float) -> str:
    """A time in the unit that reads best: 850 ns, 12.3 µs, 4.56 ms, 1.23 s."""
    if ns < 1e3:
        return f"{ns:.0f} ns"
    if ns < 1e6:
        return f"{ns / 1e3:.1f} µs"
    if ns < 1e9:
        return f"{ns / 1e6:.2f} ms"
    return f"{ns / 1e9:.2f} s"
