"""Per-layer profile of a compiled module on the device.

    report = profile(vm, x)            # or vm.profile(x)
    print(report)                      # table sorted by time, share of total
    report.json()                      # {"entry_cycles":…, "rows": […]}

One INFER with the PROFILE flag (docs/protocol.md, "Profile records"): the
core runs the entry on an instrumented copy of the module's VM, timing every
call it makes — firmware kernels (``dspx.kernels.*``), the module's compiled
TVM functions, VM built-ins — on its cycle clock, and writes one row per call
site to the printf ring, which this module parses.
"""
from __future__ import annotations

import json
import re
import sys
from dataclasses import asdict, dataclass, field

from ..abi.protocol import PROFILE_PREFIX
from ..errors import DspxError


@dataclass
class ProfileRow:
    name: str      # dspx.kernels.conv2d, a TVM function's name, vm.builtin.*
    kind: str      # kernel | tvm | vm
    shapes: str    # tensor arguments, outputs last: 1x64x56x56,64x64x3x3,...
    calls: int
    cycles: int    # summed over calls (1 GHz nominal: ns)
    share: float = 0.0  # of the entry's cycles

    @property
    def short(self) -> str:
        return self.name.removeprefix("dspx.kernels.")


@dataclass
class ProfileReport:
    entry_cycles: int   # the entry's own cycles, summed over runs
    runs: int
    rows: list = field(default_factory=list)  # call order
    dropped: int = 0    # rows the printf ring had no room for
    printf: str = ""    # whatever else the call printed

    @property
    def total_cycles(self) -> int:
        """The rows summed: the entry minus the VM's own work between calls."""
        return sum(r.cycles for r in self.rows)

    def sorted(self) -> list:
        return sorted(self.rows, key=lambda r: -r.cycles)

    def by_name(self) -> list:
        """Rows summed by name (every conv2d call in one row)."""
        agg: dict = {}
        for r in self.rows:
            a = agg.get(r.name)
            if a is None:
                a = agg[r.name] = ProfileRow(r.name, r.kind, "", 0, 0)
            a.calls += r.calls
            a.cycles += r.cycles
        for a in agg.values():
            a.share = a.cycles / self.entry_cycles if self.entry_cycles else 0.0
        return sorted(agg.values(), key=lambda r: -r.cycles)

    def table(self, limit: int | None = None) -> str:
        order = sorted(range(len(self.rows)), key=lambda i: -self.rows[i].cycles)[:limit]
        rows = [self.rows[i] for i in order]
        ms = 1e-6 / self.runs
        lines = [f"{'#':>3}  {'name':<28} {'kind':<6} {'calls':>5} {'ms/run':>9} {'share':>6}  shapes"]
        for i, r in zip(order, rows):
            lines.append(f"{i:>3}  {r.short[:28]:<28} {r.kind:<6} {r.calls:>5} "
                         f"{r.cycles * ms:>9.3f} {r.share:>6.1%}  {r.shapes}")
        rest = len(self.rows) - len(rows)
        if rest > 0:
            lines.append(f"     … {rest} more rows")
        lines.append(f"     {'rows total':<28} {'':<6} {sum(r.calls for r in self.rows):>5} "
                     f"{self.total_cycles * ms:>9.3f} {self.total_cycles / max(1, self.entry_cycles):>6.1%}")
        lines.append(f"     {'entry (device cycles)':<28} {'':<6} {self.runs:>5} {self.entry_cycles * ms:>9.3f} "
                     f"{1:>6.1%}")
        if self.dropped:
            lines.append(f"     ({self.dropped} smallest rows dropped: the printf ring was full)")
        return "\n".join(lines)

    __str__ = table

    def to_dict(self) -> dict:
        return {"entry_cycles": self.entry_cycles, "runs": self.runs, "rows_cycles": self.total_cycles,
                "dropped": self.dropped, "rows": [asdict(r) for r in self.rows]}

    def json(self, indent: int | None = 2) -> str:
        return json.dumps(self.to_dict(), indent=indent)


def parse(text: str) -> ProfileReport:
    """The profile records in a call's printf text (the rest kept as printf)."""
    head, rows, other = None, [], []
    for line in text.splitlines(keepends=True):
        if line.startswith(PROFILE_PREFIX + "-row\t"):
            _, kind, name, shapes, calls, cycles = line.rstrip("\n").split("\t")
            rows.append(ProfileRow(name, kind, shapes, int(calls), int(cycles)))
        elif line.startswith(PROFILE_PREFIX + "\t"):
            head = dict(f.split("=", 1) for f in line.rstrip("\n").split("\t")[2:])
        else:
            other.append(line)
    if head is None:
        raise DspxError("the device sent no profile records (a device without the PROFILE extension?)")
    rep = ProfileReport(int(head["entry_cycles"]), int(head["runs"]), rows, int(head.get("dropped", 0)),
                        "".join(other))
    for r in rows:
        r.share = r.cycles / rep.entry_cycles if rep.entry_cycles else 0.0
    return rep


def profile(vm, *inputs, runs: int = 1, fn: str | None = None, **named) -> ProfileReport:
    """Run ``vm``'s entry (or ``fn``) once per run with every call timed on
    the device; inputs as for ``vm[fn](...)``."""
    if not 1 <= runs <= 0xFFFF:
        raise ValueError(f"runs must be 1..65535, got {runs}")
    fn = fn or vm.entry
    if hasattr(vm, "_entry"):  # a VirtualMachine with input binding by signature
        from . import inputs as _inputs
        e = vm._entry(fn)
        handle, arrays = e.module.handle, _inputs.bind(e.inputs, inputs, named, fn)
    else:
        from .vm import _as_numpy
        handle, arrays = vm.handle, [_as_numpy(x) for x in inputs]
    res = vm.client.infer(handle, arrays, model_id=vm.model_id, repeat=runs if runs > 1 else 0, profile=True)
    rep = parse(res.printf)
    if runs > 1:  # the per-run lines are the repeat's, not the user's printf
        rep.printf = re.sub(r"^run \d+: \d+ cycles\n", "", rep.printf, flags=re.M)
    if rep.printf:
        sys.stderr.write(rep.printf)
    vm.last_cycles = res.cycles
    return rep


__all__ = ["ProfileReport", "ProfileRow", "parse", "profile"]
