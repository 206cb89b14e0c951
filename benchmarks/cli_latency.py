"""Command latency: the wall time of `dspx run` on a tiny module (the example
multi_output, one float32[2, 32] input), as a user types it:

  - a private device per command (DSPX_PRIVATE=1: what every command did
    before the background device);
  - the background device: the first command (it starts the device), the
    second, and the median of the warm ones after.

In a runtime directory of its own (no device of the user's is touched), and
`dspx stop` at the end.  Prints a table, writes benchmarks/results/cli_latency.json.
Goal: the second command on the background device ≤ 1.5 s.

    python benchmarks/cli_latency.py [--repeat 5] [--module DIR]
"""
from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time

import numpy as np

from _results import write_json

DSPX = [sys.executable, "-m", "dspx.cli"]


def example_module(workdir: str) -> str:
    """The compiled multi_output example: the tests' cached build if there is one, else compiled now."""
    from dspx import cache
    from dspx.compiler import compiler_digest, examples

    cached = cache.area("modules") / compiler_digest() / "multi_output"
    if (cached / "metadata.json").exists():
        return str(cached)
    onnx_path = examples.build_all(str(cache.area("onnx")))["multi_output"]
    out = os.path.join(workdir, "multi_output")
    subprocess.run([*DSPX, "compile", str(onnx_path), "-o", out], check=True, timeout=1800)
    return out


def timed(args, env) -> float:
    t0 = time.perf_counter()
    r = subprocess.run([*DSPX, *args], env=env, capture_output=True, text=True, timeout=600)
    dt = time.perf_counter() - t0
    if r.returncode != 0:
        raise SystemExit(f"`dspx {' '.join(args)}` failed ({r.returncode}): {r.stderr.strip()}")
    return dt


def load() -> str:
    return subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeat", type=int, default=5, help="runs for each median (default 5)")
    ap.add_argument("--module", default=None, help="a compiled module directory (default: the multi_output example)")
    a = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="dspx-bench-") as tmp:
        module = a.module or example_module(tmp)
        x = os.path.join(tmp, "x.npy")
        np.save(x, np.random.default_rng(0).standard_normal((2, 32)).astype(np.float32))
        rt = os.path.join(tmp, "rt")
        os.mkdir(rt, 0o700)
        env = {k: v for k, v in os.environ.items() if k not in ("DSPX_SOCKET", "DSPX_PRIVATE", "DSPX_TRACE")}
        env["XDG_RUNTIME_DIR"] = rt
        run = ["run", module, "-i", f"x={x}"]
        load_before = load()
        private = [timed(run, {**env, "DSPX_PRIVATE": "1"}) for _ in range(a.repeat)]
        try:
            first = timed(run, env)
            second = timed(run, env)
            warm = [timed(run, env) for _ in range(a.repeat)]
        finally:
            subprocess.run([*DSPX, "stop"], env=env, capture_output=True, timeout=60)
        load_after = load()
    rows = [("private device per command (DSPX_PRIVATE=1), median", statistics.median(private)),
            ("background device: first command (starts it)", first),
            ("background device: second command", second),
            (f"background device: warm, median of {a.repeat}", statistics.median(warm))]
    width = max(len(r[0]) for r in rows)
    print(f"`dspx run` of {os.path.basename(module)}, wall time")
    for name, s in rows:
        print(f"  {name:<{width}}  {s:6.2f} s")
    print(f"goal: second command <= 1.5 s: {'met' if second <= 1.5 else 'NOT met'}")
    print(f"load before: {load_before}\nload after:  {load_after}")
    path = write_json("cli_latency.json", {
        "module": module, "repeat": a.repeat, "private_s": [round(s, 3) for s in private],
        "background_first_s": round(first, 3), "background_second_s": round(second, 3),
        "background_warm_s": [round(s, 3) for s in warm], "goal_second_s": 1.5,
        "uptime_before": load_before, "uptime_after": load_after})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
