"""PNG charts for the benchmarks (``--plot``) and a timeline of a dspx trace.

    python benchmarks/plots.py trace out.json trace.png [--focus "op 0x2402#2"] [--from-ms A --to-ms B]
    python benchmarks/plots.py profile profile.json profile.png   # dspx run --profile --json output

Needs the ``plot`` extra (matplotlib).  Every function writes one PNG at a
size meant to be read without zooming (about 1400 px wide) and returns its path.
"""
from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

COLORS = {"host": "#4C72B0", "front": "#8172B2", "core": "#55A868", "entry": "#2E8B57", "kernel": "#C44E52",
          "tvm": "#DD8452", "vm": "#B0B0B0", "tile": "#64B5CD", "dma": "#DA8BC3"}


def _plt():
    try:
        import matplotlib
    except ImportError:
        raise SystemExit("plots need matplotlib: pip install 'dspx[plot]'") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    plt.rcParams.update({"font.size": 11, "axes.titlesize": 13, "figure.dpi": 100})
    return plt


def _save(fig, path, rect=(0, 0, 1, 1)) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout(rect=rect)
    fig.savefig(path, dpi=100)
    fig.clf()
    return path


def latency(series: dict, path, title: str, baseline=None, unit: str = "us") -> Path:
    """Distributions of per-call latencies (seconds), one box + points per
    candidate, medians and ratios to ``baseline`` written beside them
    (a series name, or f(name) -> the name of that series' baseline)."""
    plt = _plt()
    scale = {"us": 1e6, "ms": 1e3}[unit]
    names = list(series)
    fig, ax = plt.subplots(figsize=(14, 1.1 + 0.75 * len(names)))
    data = [[v * scale for v in series[n]] for n in names]
    ax.boxplot(data, vert=False, widths=0.55, showfliers=False, medianprops={"color": "black", "linewidth": 2})
    for i, d in enumerate(data, 1):
        jitter = [i + ((k * 7919) % 100 - 50) / 250 for k in range(len(d))]
        ax.scatter(d, jitter, s=6, alpha=0.35, color="#4C72B0")
    labels = []
    for n in names:
        med = statistics.median(series[n])
        b = baseline(n) if callable(baseline) else baseline
        ratio = f", {med / statistics.median(series[b]):.2f}x {b}" if b in series and n != b else ""
        labels.append(f"{n}\nmedian {med * scale:,.1f} {unit}{ratio}")
    ax.set_yticks(range(1, len(names) + 1), labels)
    ax.set_xscale("log")
    ax.set_xlabel(f"latency per call ({unit}, log scale)")
    ax.set_title(title)
    ax.grid(axis="x", which="both", alpha=0.3)
    return _save(fig, path)


def profile_bars(report: dict, path, title: str = "per-layer device time", top: int = 24) -> Path:
    """A profile (ProfileReport.to_dict()) as horizontal bars, largest on top."""
    plt = _plt()
    runs = max(1, report.get("runs", 1))
    rows = sorted(enumerate(report["rows"]), key=lambda r: -r[1]["cycles"])[:top]
    fig, ax = plt.subplots(figsize=(14, 1.2 + 0.36 * len(rows)))
    ms = [r["cycles"] / runs / 1e6 for _, r in rows]
    ax.barh(range(len(rows)), ms, color=[COLORS.get(r["kind"], "gray") for _, r in rows])
    ax.set_yticks(range(len(rows)),
                  [f"#{i} {r['name'].removeprefix('dspx.kernels.')}  {r['shapes'].split(',')[0]}"
                   [:60] for i, r in rows], fontsize=9)
    ax.invert_yaxis()
    for y, (v, (_, r)) in enumerate(zip(ms, rows)):
        ax.text(v, y, f" {v:.2f} ms  {r['share']:.1%}", va="center", fontsize=9)
    ax.set_xlabel(f"device time per run (ms; entry {report['entry_cycles'] / runs / 1e6:.1f} ms, "
                  f"rows {report['rows_cycles'] / max(1, report['entry_cycles']):.0%} of it)")
    ax.set_xlim(0, max(ms) * 1.25 if ms else 1)
    ax.set_title(title + "  (red: firmware kernel, orange: TVM function, gray: VM built-in)")
    return _save(fig, path)


def lines(x, series: dict, path, title: str, xlabel: str, ylabel: str, logx=False, logy=False) -> Path:
    """One line per series over a shared x (softmax cycles by size, tok/s by position)."""
    plt = _plt()
    fig, ax = plt.subplots(figsize=(14, 6))
    for name, ys in series.items():
        ax.plot(x[:len(ys)] if not isinstance(x, dict) else x[name], ys, marker="o", label=name)
    if logx:
        ax.set_xscale("log")
    if logy:
        ax.set_yscale("log")
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.grid(alpha=0.3, which="both")
    ax.legend()
    return _save(fig, path)


# ------------------------------------------------------------------ trace timeline

def _depths(events: list) -> list:
    """Nesting depth of each event on one track (events well nested)."""
    out, stack = [], []
    for e in sorted(events, key=lambda e: (e["ts"], -e["dur"])):
        while stack and stack[-1] <= e["ts"]:
            stack.pop()
        out.append((e, len(stack)))
        stack.append(e["ts"] + e["dur"])
    return out


def timeline(trace_path, path, t_from_ms: float | None = None, t_to_ms: float | None = None,
             title: str | None = None, focus: str | None = None) -> Path:
    """A dspx trace (Chrome trace-event JSON) drawn as tracks: one row per
    process/thread, nested events stacked downwards, colour by category,
    time in ms from the first event; the window is [t_from_ms, t_to_ms] or
    ``focus`` = "NAME" / "NAME#N": the N-th (from 1) event of that name, 4 % padded."""
    plt = _plt()
    data = json.loads(Path(trace_path).read_text())
    ev = data["traceEvents"]
    procs = {e["pid"]: e["args"]["name"] for e in ev if e["ph"] == "M" and e["name"] == "process_name"}
    order = {e["pid"]: e["args"]["sort_index"] for e in ev if e["ph"] == "M" and e["name"] == "process_sort_index"}
    threads = {(e["pid"], e["tid"]): e["args"]["name"] for e in ev if e["ph"] == "M" and e["name"] == "thread_name"}
    xs = [e for e in ev if e["ph"] == "X"]
    t0 = min(e["ts"] for e in xs)
    if focus:
        name, _, nth = focus.partition("#")
        hits = [e for e in xs if e["name"] == name]
        if len(hits) < int(nth or 1):
            raise SystemExit(f"{trace_path}: {len(hits)} events named {name!r}")
        e = hits[int(nth or 1) - 1]
        pad = e["dur"] * 0.04
        t_from_ms, t_to_ms = (e["ts"] - pad - t0) / 1e3, (e["ts"] + e["dur"] + pad - t0) / 1e3
    lo = t0 + (t_from_ms or 0) * 1e3
    hi = t0 + t_to_ms * 1e3 if t_to_ms is not None else max(e["ts"] + e["dur"] for e in xs)
    tracks: dict = {}
    for e in xs:
        if e["ts"] + e["dur"] >= lo and e["ts"] <= hi:
            tracks.setdefault((e["pid"], e["tid"]), []).append(e)
    keys = sorted(tracks, key=lambda k: (order.get(k[0], 9), threads.get(k, "").startswith("dma"), threads.get(k, "")))
    layout, y = [], 0.0
    for k in keys:
        d = _depths(tracks[k])
        rows = 1 + max(dep for _, dep in d)
        layout.append((k, d, y, rows))
        y += rows + 0.6
    fig, ax = plt.subplots(figsize=(14, 1.5 + 0.32 * y))
    span = hi - lo
    for k, d, y0, rows in layout:
        for e, dep in d:
            a, b = max(e["ts"], lo), min(e["ts"] + e["dur"], hi)
            yy = y0 + dep
            ax.barh(yy, (b - a) / 1e3, left=(a - t0) / 1e3, height=0.85, color=COLORS.get(e.get("cat"), "gray"),
                    edgecolor="black", linewidth=0.3)
            if (b - a) > span / 40:  # label events wide enough to read
                name = e["name"].removeprefix("dspx.kernels.")
                ax.text((a + b) / 2 / 1e3 - t0 / 1e3, yy, name[:int((b - a) / span * 120)], ha="center",
                        va="center", fontsize=8, clip_on=True)
    ax.set_yticks([y0 + (rows - 1) / 2 for _, _, y0, rows in layout],
                  [f"{procs.get(k[0], k[0])}\n{threads.get(k, k[1])}" for k, _, _, _ in layout], fontsize=9)
    ax.invert_yaxis()
    ax.set_xlim((lo - t0) / 1e3, (hi - t0) / 1e3)
    ax.set_xlabel("ms (CLOCK_MONOTONIC, shared by every process)")
    ax.grid(axis="x", alpha=0.3)
    handles = [plt.Rectangle((0, 0), 1, 1, color=c) for c in COLORS.values()]
    fig.legend(handles, list(COLORS), ncol=len(COLORS), loc="lower center", fontsize=9, frameon=False)
    ax.set_title(title or f"dspx trace: {Path(trace_path).name}")
    return _save(fig, path, rect=(0, 0.07, 1, 1))


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="what", required=True)
    t = sub.add_parser("trace", help="draw a trace's timeline")
    t.add_argument("trace")
    t.add_argument("png")
    t.add_argument("--from-ms", type=float, default=None)
    t.add_argument("--to-ms", type=float, default=None)
    t.add_argument("--title", default=None)
    t.add_argument("--focus", default=None, metavar="NAME[#N]", help="window on the N-th event named NAME")
    p = sub.add_parser("profile", help="bar chart of a profile (dspx run --profile --json)")
    p.add_argument("json")
    p.add_argument("png")
    a = ap.parse_args(argv)
    if a.what == "trace":
        print(timeline(a.trace, a.png, a.from_ms, a.to_ms, a.title, a.focus))
    else:
        data = json.loads(Path(a.json).read_text())
        print(profile_bars(data.get("profile", data), a.png))


if __name__ == "__main__":
    main()
