"""Fuzz the C client's decoder of device replies with Atheris (libFuzzer's
engine) under AddressSanitizer + UBSan.

    nice -n 10 .venv/bin/python benchmarks/fuzz_c.py --inputs 10000000 [--seed 1] [--workers 2]

Builds tests/sdk/fuzz_decoder.c (libdspx's dspx_conn.c + c7x_client.c with
-fsanitize=address,undefined) as a shared object, preloads the ASan runtime
into ``--workers`` child Pythons (seeds seed..seed+workers-1, the inputs split
between them) and feeds each input — a structure-aware INFER reply, the
descriptor table the device wrote into output_buf, the printf ring's header
(tests/sdk/c_fuzz.py) — through the framing, size, status, printf and output
descriptor checks.  Every output the decoder hands back is read whole, so
an accepted pointer outside the client's buffers is an ASan report.
Prints a table and writes benchmarks/results/fuzz_c.json: inputs, seconds,
sanitizer reports, unexpected return codes, and the distinct decoder
outcomes (return code, error text without its numbers, outputs handed back)
— gcc builds the harness, which has no coverage instrumentation for
libFuzzer, so the outcome count stands for coverage; ``--coverage`` (one
worker) also builds it with gcc's --coverage and reports gcov's lines
executed of each of the decoder's functions.  Exit status 1 on any report or
unexpected code."""
from __future__ import annotations

import argparse
import collections
import os
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT / "tests" / "sdk"))
sys.path.insert(0, str(ROOT / "benchmarks"))

import c_fuzz  # noqa: E402
from _results import write_json  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--inputs", type=int, default=1_000_000)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--workers", type=int, default=1)
    ap.add_argument("--out", default="fuzz_c.json", help="file name under benchmarks/results/")
    ap.add_argument("--coverage", action="store_true",
                    help="build with --coverage and report gcov's line coverage of the decoder's functions (1 worker)")
    a = ap.parse_args()
    if a.coverage and a.workers != 1:
        ap.error("--coverage counts one worker's run: use --workers 1")
    t0 = time.monotonic()
    share = [a.inputs // a.workers + (i < a.inputs % a.workers) for i in range(a.workers)]
    with tempfile.TemporaryDirectory(prefix="fuzz_c-", dir=os.environ.get("FUZZ_C_TMP")) as tmp:
        with ThreadPoolExecutor(a.workers) as pool:
            runs = list(pool.map(lambda i: c_fuzz.run(share[i], a.seed + i, Path(tmp) / str(i), nice=10,
                                                      coverage=a.coverage), range(a.workers)))
    outcomes: collections.Counter = collections.Counter()
    for r in runs:
        outcomes.update(r["outcomes"])
    res = {"inputs": sum(r["inputs"] for r in runs), "requested": a.inputs, "seeds": [a.seed + i for i in range(a.workers)],
           "seconds": round(time.monotonic() - t0, 1), "engine": "atheris (libFuzzer), gcc -fsanitize=address,undefined",
           "sanitizer_reports": [x for r in runs for x in r["reports"]],
           "unexpected": [x for r in runs for x in r["unexpected"]],
           "exit_codes": [r["returncode"] for r in runs],
           "distinct_outcomes": len(outcomes), "outcomes": dict(outcomes.most_common()),
           **({"line_coverage": runs[0]["line_coverage"]} if a.coverage else {})}
    print(f"{'inputs':<22}{res['inputs']:>14,}")
    print(f"{'seconds':<22}{res['seconds']:>14}")
    print(f"{'sanitizer reports':<22}{len(res['sanitizer_reports']):>14}")
    print(f"{'unexpected codes':<22}{len(res['unexpected']):>14}")
    print(f"{'distinct outcomes':<22}{res['distinct_outcomes']:>14}")
    for name, c in res.get("line_coverage", {}).items():
        print(f"{'lines of ' + name:<34}{c['percent']:>6.1f} % of {c['lines']}")
    print()
    print(f"{'count':>12}  outcome (rc, outputs handed back, error)")
    for k, v in outcomes.most_common():
        print(f"{v:>12,}  {k}")
    print(write_json(a.out, res))
    ok = (res["inputs"] == a.inputs and not res["sanitizer_reports"] and not res["unexpected"]
          and all(c == 0 for c in res["exit_codes"]))
    if not ok:
        for r in runs:
            print(r["stderr_tail"], file=sys.stderr)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
