"""The report of a per-layer profile (like TVM's ``Report``).

    report = vm.profile(x)             # VirtualMachine.profile makes the call
    print(report)                      # table sorted by time, share of total
    report.json()                      # {"entry_cycles":…, "rows": […]}
    report.csv()                       # one row per call site, TVM's columns

The call is one INFER with the PROFILE flag (docs/protocol.md, "Profile
records"): the core runs the entry on an instrumented copy of the module's
VM, timing every call it makes — firmware kernels (``dspx.kernels.*``), the
module's compiled TVM functions, VM built-ins — on its cycle clock, and
writes one row per call site to the printf ring, which ``parse`` reads.
"""
from __future__ import annotations

import csv
import io
import json
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

    # TVM's Report.csv() columns for a call, plus the call's kind
    CSV_COLUMNS = ("Name", "Duration (us)", "Percent", "Count", "Device", "Argument Shapes", "Kind")

    def csv(self) -> str:
        """The rows as CSV, like TVM's ``Report.csv()``: per call site, no totals.
        Duration (us) is summed over the site's calls and the runs (device
        cycles at 1 GHz nominal), Percent its share of the entry's time."""
        out = io.StringIO()
        w = csv.writer(out, lineterminator="\n")
        w.writerow(self.CSV_COLUMNS)
        for r in self.rows:
            w.writerow([r.name, f"{r.cycles / 1e3:.3f}", f"{r.share * 100:.2f}", r.calls, "dsp0",
                        r.shapes.replace(",", ", "), r.kind])
        return out.getvalue()


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
    """``vm.profile(...)`` as a function: the call is the VirtualMachine's
    (it binds the inputs by its signature), this module reads the report."""
    return vm.profile(*inputs, runs=runs, fn=fn, **named)


__all__ = ["ProfileReport", "ProfileRow", "parse", "profile"]
