"""A tile-size sweep of the seed's ping-pong softmax under the j6-vision
timing model (issue 26): where per-tile overhead meets first-tile DMA exposure.

The seed's listing (examples/softmax_c/softmax_ivp.cc, unmodified) is built
as a cost build once per TILE_SIZE (set in the user's header softmax.h, as the
listing expects), 4 KiB to 512 KiB, and run at 100,000 and 2**20 floats, ping-
pong (run_tcm_opt 1) and, once per size, direct over DDR for the ratio.  Every
figure is the model's ESTIMATE (modeled cycles, deterministic: one run each),
not a measurement.

The listing allocates one tile per L2 bank (xvAllocateBuffer(tm, TILE_SIZE,
XV_MEM_BANK_COLOR_0/1)), in place (dst = src), so a tile fits while TILE_SIZE
<= half of the SDK's L2 (dspx.memory.L2_SIZE, 1280 KiB: 640 KiB a bank);
sizes above it are listed, not run (xvAllocateBuffer returns NULL, which the
listing does not check).

    python benchmarks/cost_sweep.py [--profile j6-vision] [--plot]

Prints a table, writes benchmarks/results/cost_sweep.json (and with --plot
benchmarks/results/cost_sweep.png: the plot extra, matplotlib).
"""
from __future__ import annotations

import argparse
import math
import os
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _cost_softmax import ROOT, Child, build  # noqa: E402
from _results import RESULTS, write_json  # noqa: E402

sys.path.insert(0, str(ROOT / "src"))
TILES = [4096 << k for k in range(8)]  # 4 KiB .. 512 KiB
SIZES = [100_000, 2**20]
PARTS = ("overhead", "compute", "ddr_stall", "dma_wait")
FRAMES = 3  # the listing's passes over the data (max, exp+sum, mul), each waits for its first block


def first_tile_exposure(tile_bytes: int, n: int, profile) -> int:
    """What each frame waits before its first block is in a tile, at the least:
    set-up + the first block's bytes at one channel's rate, three times."""
    first = min(tile_bytes, 4 * n)
    return FRAMES * (profile.param("idma_setup_cycles")
                     + math.ceil(first / profile.param("idma_bandwidth_bytes_per_cycle")))


def setup_time(transfers: list[int], profile) -> int:
    """The busiest channel's set-up cycles: what small tiles pay per transfer."""
    return max(transfers) * profile.param("idma_setup_cycles")


def crossover_bytes(n: int, profile) -> float:
    """The tile where the two meet, to first order: the busiest channel's
    set-up, (5 transfers x 4n / T) / channels x set-up, equals the tile
    transfers a frame cannot overlap (the first copy-in of each of the 3 frames,
    the last copy-out of the 2 that write back: 5 x T / rate), so
    T* = sqrt(4n x set-up x rate / channels)."""
    return math.sqrt(4 * n * profile.param("idma_setup_cycles") * profile.param("idma_bandwidth_bytes_per_cycle")
                     / profile.param("idma_channels"))


def sweep(profile_name: str, tiles: list[int], sizes: list[int]) -> dict:
    from dspx import costmodel, memory

    profile = costmodel.load(profile_name)
    bank = memory.L2_SIZE // 2
    fits = [t for t in tiles if t <= bank]
    with tempfile.TemporaryDirectory(prefix="dspx-cost-sweep-") as tmp:
        libs = {str(t): build(Path(tmp), cost=True, tile_bytes=t) for t in fits}
        rows, direct = [], {}
        with Child(libs, profile_name) as child:
            for n in sizes:
                direct[n] = _record(child.run(str(fits[0]), n, 0, check=True))  # the direct path has no tiles
                for t in tiles:
                    row = {"n": n, "tile_bytes": t, "fits": t <= bank, "blocks": -(-4 * n // t)}
                    if row["fits"]:
                        rec = _record(child.run(str(t), n, 1, check=True))
                        row.update(rec, ratio_to_direct=rec["cycles"] / direct[n]["cycles"],
                                   first_tile_exposure=first_tile_exposure(t, n, profile),
                                   setup_busiest_channel=setup_time(rec["dma_transfers"], profile))
                    rows.append(row)
    return {"benchmark": "cost_sweep", "estimate": True, "profile": profile.name, "assumed": profile.assumed(),
            "listing": "examples/softmax_c/softmax_ivp.cc (unmodified; TILE_SIZE from softmax.h)",
            "l2_bytes": memory.L2_SIZE, "bank_bytes": bank, "tiles_per_bank": 1,
            "crossover_bytes": {n: crossover_bytes(n, profile) for n in sizes}, "direct": direct, "rows": rows}


def _record(r: dict) -> dict:
    if r["status"] != 0 or r["err"] > 1e-6 or not (r["cost"] or {}).get("counted"):
        raise SystemExit(f"the listing failed or was not counted: {r}")
    c = r["cost"]
    return {k: c[k] for k in ("cycles", *PARTS, "dma_bytes", "dma_transfers")} | {"max_rel_err": r["err"]}


def print_table(res: dict) -> None:
    print(f"ESTIMATE ({res['profile']}): the seed's ping-pong softmax by TILE_SIZE, modeled cycles "
          f"(one tile per L2 bank; a bank is {res['bank_bytes'] >> 10} KiB of the SDK's "
          f"{res['l2_bytes'] >> 10} KiB L2)")
    head = (f"{'floats':>9} {'tile':>8} {'blocks':>6} {'cycles':>10} {'overhead':>8} {'compute':>9} "
            f"{'ddr_stall':>9} {'dma_wait':>9} {'1st-tile':>9} {'set-up':>8} {'xfers':>6} {'/direct':>7}")
    for n in sorted(res["direct"]):
        d = res["direct"][n]
        print(f"\n{head}\n{n:>9} {'direct':>8} {'-':>6} {d['cycles']:>10,} {d['overhead']:>8,} {d['compute']:>9,} "
              f"{d['ddr_stall']:>9,} {d['dma_wait']:>9,} {'-':>9} {'-':>8} {0:>6} {1:>7.3f}")
        for r in (r for r in res["rows"] if r["n"] == n):
            tile = f"{r['tile_bytes'] >> 10} KiB"
            if not r["fits"]:
                print(f"{n:>9} {tile:>8} {r['blocks']:>6}  does not fit: a bank holds {res['bank_bytes'] >> 10} KiB")
                continue
            print(f"{n:>9} {tile:>8} {r['blocks']:>6} {r['cycles']:>10,} {r['overhead']:>8,} {r['compute']:>9,} "
                  f"{r['ddr_stall']:>9,} {r['dma_wait']:>9,} {r['first_tile_exposure']:>9,} "
                  f"{r['setup_busiest_channel']:>8,} "
                  f"{sum(r['dma_transfers']):>6} {r['ratio_to_direct']:>7.3f}")
        best = min((r for r in res["rows"] if r["n"] == n and r["fits"]), key=lambda r: r["cycles"])
        print(f"{n:>9} fastest tile {best['tile_bytes'] >> 10} KiB; set-up meets tile exposure near "
              f"T* = {res['crossover_bytes'][n] / 1024:.0f} KiB")
    print(f"\nA tile fits while TILE_SIZE <= {res['bank_bytes'] >> 10} KiB (the listing puts one in each bank): "
          f"512 KiB does, the next power of two (1 MiB) does not.")
    print("1st-tile: the least the three frames wait for their first block (3 x (idma set-up + block / "
          "channel rate)); set-up: the busiest channel's transfers x idma set-up.  Assumed parameters: "
          + ", ".join(f"{k}={v:g}" for k, v in res["assumed"].items()))


def plot(res: dict, path: Path) -> Path:
    from plots import _plt, _save

    plt = _plt()
    sizes = sorted(res["direct"])
    fig, axes = plt.subplots(1, len(sizes), figsize=(14, 5.5), squeeze=False)
    colors = {"overhead": "#B0B0B0", "compute": "#55A868", "ddr_stall": "#C44E52", "dma_wait": "#DA8BC3"}
    for ax, n in zip(axes[0], sizes):
        rows = [r for r in res["rows"] if r["n"] == n and r["fits"]]
        x = [f"{r['tile_bytes'] >> 10}K" for r in rows]
        bottom = [0] * len(rows)
        for part in PARTS:
            vals = [r[part] / 1e3 for r in rows]
            ax.bar(x, vals, bottom=bottom, color=colors[part], label=part)
            bottom = [b + v for b, v in zip(bottom, vals)]
        ax.plot(x, [r["first_tile_exposure"] / 1e3 for r in rows], "k:", marker="o", label="first-tile exposure")
        ax.plot(x, [r["setup_busiest_channel"] / 1e3 for r in rows], "k--", marker="s",
                label="DMA set-up, busiest channel")
        d = res["direct"][n]["cycles"] / 1e3
        ax.set_title(f"{n:,} floats (direct: {d:,.0f} k cycles, off the scale)" if d > 2 * max(bottom)
                     else f"{n:,} floats")
        if d <= 2 * max(bottom):
            ax.axhline(d, color="#C44E52", linestyle="--", label="direct")
        for i, r in enumerate(rows):
            ax.text(i, bottom[i], f"{r['ratio_to_direct']:.3f}x", ha="center", va="bottom", fontsize=9)
        ax.set_xlabel("TILE_SIZE (one tile per L2 bank)")
        ax.set_ylabel("modeled k cycles")
        ax.legend(fontsize=9, loc="upper center", ncol=2)
        ax.set_ylim(0, 1.3 * max(bottom))
    fig.suptitle(f"estimate ({res['profile']}): the seed's ping-pong softmax by tile size "
                 "(labels: ping-pong / direct)")
    return _save(fig, path, rect=(0, 0, 1, 0.95))


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--profile", default="j6-vision")
    ap.add_argument("--tiles", type=int, nargs="+", default=TILES, help="tile sizes in bytes")
    ap.add_argument("--sizes", type=int, nargs="+", default=SIZES, help="data sizes in floats")
    ap.add_argument("--plot", action="store_true", help="also write benchmarks/results/cost_sweep.png (plot extra)")
    a = ap.parse_args(argv)
    res = sweep(a.profile, a.tiles, a.sizes)
    print_table(res)
    print("wrote", write_json("cost_sweep.json", res))
    if a.plot:
        print("plot:", plot(res, Path(RESULTS) / "cost_sweep.png"))


if __name__ == "__main__":
    main()
