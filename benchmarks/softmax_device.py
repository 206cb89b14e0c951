"""Device-side softmax cycles, in-process (no service, no sockets).

Runs the built-in softmax operator (cmd 0x1402) through the op registry the
way a core does — parameter struct in an input buffer, data mapped by DSP
address, output into an output buffer — with run_tcm_opt 0 (direct over DDR)
and 1 (ping-pong through L2), and times numpy's and scipy's softmax on the
same data in the same process.  Cycles are the runtime's: nanoseconds × the
nominal 1 GHz clock.  Runs are interleaved and repeated; the table shows
medians and minimums (the machine may be shared: the load average is recorded).

    python benchmarks/softmax_device.py                 # 100,000 and 16,777,216 floats
    python benchmarks/softmax_device.py --sweep         # also try several tile sizes

Writes benchmarks/results/softmax_device.json.
"""
from __future__ import annotations

import argparse
import json
import mmap
import os
import platform
import statistics
import struct
import sys
import time
from pathlib import Path

import numpy as np
import scipy.special

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

from dspx.device.core import builtin_ops, ops, runtime  # noqa: E402
from dspx.memory import AddressSpace, Region  # noqa: E402

PARAM_ADDR, DATA_ADDR, OUT_ADDR = 0xC000_0000, 0xC100_0000, 0xD000_0000
SEED_RATIO = 5154293 / 7648254  # the seed's ping-pong / direct cycles on J6


def numpy_softmax(x: np.ndarray) -> np.ndarray:
    e = np.exp(x - x.max())
    return e / e.sum()


class Bench:
    def __init__(self, n: int):
        self.n = n
        self.core = runtime.CoreRuntime()
        self.reg = ops.OpRegistry()
        builtin_ops.register(self.reg)
        self.space = AddressSpace()
        self.maps = {}
        for i, (addr, size) in enumerate(((PARAM_ADDR, 4096), (DATA_ADDR, 4 * n), (OUT_ADDR, 4 * n))):
            self.maps[addr] = mm = mmap.mmap(-1, size)
            self.space.add(Region(i + 1, addr, size, mm))
        self.x = np.frombuffer(self.maps[DATA_ADDR], np.float32)
        self.x[:] = 1 + np.arange(n, dtype=np.float32) / np.float32(n)  # the seed's data
        self.out = np.frombuffer(self.maps[OUT_ADDR], np.uint8)
        self.out.fill(0)  # the host's output buffer is resident, as after its first use
        self.param = np.frombuffer(self.maps[PARAM_ADDR], np.uint8)[:13]

    def device(self, tcm: int) -> tuple[int, np.ndarray]:
        struct.pack_into("<iQB", self.maps[PARAM_ADDR], 0, 4 * self.n, DATA_ADDR, tcm)
        r = self.reg.run(builtin_ops.SOFTMAX_CMD, self.param, self.out, runtime.TaskContext(self.space, self.core))
        if r.status or r.return_value:
            raise SystemExit(f"softmax failed: {r}")
        return r.cycles, self.out.view(np.float32)

    def close(self) -> None:
        self.core.close()


def timed(fn) -> tuple[int, np.ndarray]:
    t = time.perf_counter_ns()
    y = fn()
    return (time.perf_counter_ns() - t) * runtime.CLOCK_HZ // 1_000_000_000, y


def measure(n: int, repeat: int) -> dict:
    b = Bench(n)
    try:
        ref = scipy.special.softmax(b.x)
        runs = {
            "direct": lambda: b.device(0),
            "ping_pong": lambda: b.device(1),
            "numpy": lambda: timed(lambda: numpy_softmax(b.x)),
            "scipy": lambda: timed(lambda: scipy.special.softmax(b.x)),
        }
        cycles = {k: [] for k in runs}
        err = {}
        for r in range(repeat + 2):  # two warm-up rounds
            for k, fn in runs.items():
                c, y = fn()
                if r >= 2:
                    cycles[k].append(c)
                if r == 0:
                    err[k] = float(np.max(np.abs(y - ref) / ref))
        row = {"n": n, "repeat": repeat}
        for k, cs in cycles.items():
            row[k] = {"median": int(statistics.median(cs)), "min": min(cs), "max_rel_err_vs_scipy": err[k]}
        for stat in ("median", "min"):
            pp, d = row["ping_pong"][stat], row["direct"][stat]
            row[f"ping_pong/direct ({stat})"] = pp / d
            row[f"ping_pong/numpy ({stat})"] = pp / row["numpy"][stat]
            row[f"direct/numpy ({stat})"] = d / row["numpy"][stat]
        return row
    finally:
        b.close()


def sweep(n: int, repeat: int, tiles: list[int]) -> list[dict]:
    """The ping-pong softmax itself (no parameter parsing) for several tile sizes."""
    rows = []
    b = Bench(n)
    y = b.out.view(np.float32)
    try:
        with runtime.activate(runtime.TaskContext(b.space, b.core)):
            for te in tiles:
                cs = [timed(lambda: builtin_ops.softmax_ping_pong(b.x, y, b.core.tm, te))[0]
                      for _ in range(repeat + 1)][1:]
                rows.append({"tile_elems": te, "tile_bytes": 4 * te, "median": int(statistics.median(cs)),
                             "min": min(cs)})
    finally:
        b.close()
    return rows


def overlap_probe() -> float:
    """How much of a memcpy thread's work overlaps main-thread compute right
    now: 1.0 = fully (a free CPU), 0.0 = not at all.  Ping-pong only wins
    when the DMA threads get a CPU of their own."""
    import threading

    tile = np.random.default_rng(0).random(1 << 17, dtype=np.float32)
    src, dst = np.ones(1 << 25, np.uint8), np.zeros(1 << 25, np.uint8)

    def compute():
        for _ in range(150):
            np.multiply(tile, np.float32(1.0001), out=tile)
            np.exp(tile, out=tile)
            np.multiply(tile, np.float32(0.3), out=tile)

    def copy():
        for _ in range(8):
            np.copyto(dst, src)

    def run(*fns) -> float:
        threads = [threading.Thread(target=f) for f in fns]
        t = time.perf_counter()
        for th in threads:
            th.start()
        for th in threads:
            th.join()
        return time.perf_counter() - t

    a, b, both = run(compute), run(copy), run(compute, copy)
    return max(0.0, min(1.0, (a + b - both) / min(a, b)))


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sizes", type=int, nargs="+", default=[100_000, 16_777_216])
    ap.add_argument("--repeat", type=int, default=15)
    ap.add_argument("--sweep", action="store_true", help="ping-pong cycles for several tile sizes at the largest size")
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "softmax_device.json")
    a = ap.parse_args(argv)

    load_before = os.getloadavg()
    overlap = overlap_probe()
    rows = [measure(n, a.repeat) for n in a.sizes]
    tiles = sweep(max(a.sizes), a.repeat, [16 << 10, 32 << 10, 64 << 10, 128 << 10, 160 << 10]) if a.sweep else []
    load_after = os.getloadavg()

    ms = lambda c: f"{c / 1e6:9.2f}"  # noqa: E731 — cycles at 1 GHz to ms
    print(f"softmax, device side in-process; cycles = ns x 1 GHz; tile {runtime.TILE_ELEMS} floats "
          f"({runtime.TILE_ELEMS * 4 >> 10} KiB) per L2 bank")
    print(f"machine: {os.cpu_count()} CPUs, load average {load_before[0]:.2f} -> {load_after[0]:.2f}, "
          f"copy/compute overlap available {overlap:.2f} (1 = a free CPU for the DMA threads)")
    print(f"{'floats':>10} {'stat':>6} | {'direct ms':>9} {'pingpong':>9} {'numpy':>9} {'scipy':>9} | "
          f"{'pp/direct':>9} {'pp/numpy':>9} {'dir/numpy':>9}")
    for r in rows:
        for stat in ("median", "min"):
            print(f"{r['n']:>10} {stat:>6} | {ms(r['direct'][stat])} {ms(r['ping_pong'][stat])} "
                  f"{ms(r['numpy'][stat])} {ms(r['scipy'][stat])} | {r[f'ping_pong/direct ({stat})']:9.2f} "
                  f"{r[f'ping_pong/numpy ({stat})']:9.2f} {r[f'direct/numpy ({stat})']:9.2f}")
    print(f"seed (J6 DSP, 100,000 floats): ping-pong/direct = {SEED_RATIO:.2f}")
    print("max relative error vs scipy: " + ", ".join(
        f"{r['n']}: direct {r['direct']['max_rel_err_vs_scipy']:.1e} ping-pong "
        f"{r['ping_pong']['max_rel_err_vs_scipy']:.1e}" for r in rows))
    for t in tiles:
        print(f"tile {t['tile_elems']:>7} floats ({t['tile_bytes'] >> 10:>4} KiB): ping-pong median "
              f"{ms(t['median'])} ms, min {ms(t['min'])} ms")

    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps({
        "benchmark": "softmax_device", "clock_hz": runtime.CLOCK_HZ, "tile_elems": runtime.TILE_ELEMS,
        "seed_ratio": SEED_RATIO, "cpu_count": os.cpu_count(), "machine": platform.processor() or platform.machine(),
        "numpy": np.__version__, "scipy": scipy.__version__, "loadavg_before": load_before,
        "loadavg_after": load_after, "overlap_probe": overlap, "results": rows, "tile_sweep": tiles,
        "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }, indent=2))
    print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
