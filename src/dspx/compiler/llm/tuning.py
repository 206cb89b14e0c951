"""The measured choice of the prefill GEMMs' register micro-tile.

Which (rows, outputs) tile is fastest is not obvious from the register count
alone: fewer rows waste less on a prompt's last partial group, more rows
reuse each dequantized weight more.  Every candidate sums each output in the
same order, so the choice changes the speed, never a bit of the logits.  On
the machine the modules are built for, ``prefill_tile_for`` times each
candidate on one core (CPU time, so a busy machine skews it less) on the
model's widest GEMM, keeps the fastest, and caches it per CPU model and
compiler under ``<cache>/llm-tiles/``; built for another CPU, it takes the
register-count default (``prefill_tile``)."""
from __future__ import annotations

import json
import os
import time

import numpy as np

from dspx import cache, cpuinfo

from .sizing import TN, Dims
from .tir import prefill_tile
from .tir.gemv import _q4_1_prefill

# candidates per float32 lanes: every one fits the register file (rows x outputs / lanes accumulators
# plus the weight vectors: 16 ymm on AVX2, 32 zmm on AVX-512)
CANDIDATES = {8: ((6, 16), (4, 16), (2, 32)), 16: ((6, 64), (4, 64), (2, 64))}
TIMED_ROWS = (37, 64)  # a short prompt's chunk (a partial last group) and a full one
REPEAT = 5


def prefill_tile_for(d: Dims, target, lanes: int, runs_here: bool) -> dict:
    """{"tile": [rows, outputs], "chosen_by": ..., "us": {tile: CPU µs}}: measured when the
    modules run on this machine (``runs_here``), else ``prefill_tile(lanes)``."""
    if not runs_here:
        return {"tile": list(prefill_tile(lanes)), "chosen_by": "register count (built for another CPU)"}
    from dspx.compiler import compiler_digest

    key = cache.digest((), cpuinfo.model_name(), str(target), compiler_digest(), f"{lanes} {d.dim}x{d.ffn}")
    path = cache.area("llm-tiles") / f"{key}.json"
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        pass
    us = {f"{r}x{n}": _time_tile((r, n), d, target) for r, n in CANDIDATES[lanes]}
    best = min(us, key=us.get)
    choice = {"tile": [int(v) for v in best.split("x")], "us": us,
              "chosen_by": f"fastest of {len(us)} timed on {cpuinfo.model_name()}"}
    try:  # a cache that cannot be written costs the timing again next build, not the build
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(choice))
        tmp.replace(path)
    except OSError:
        pass
    return choice


def _time_tile(tile, d: Dims, target) -> float:
    """CPU µs of one serial gate/up GEMM (the model's widest) at each of TIMED_ROWS real rows, summed."""
    import tvm

    K, N, M = d.dim, 2 * d.ffn, d.chunk
    f = _q4_1_prefill(M, K, N, tile, parallel=False).with_attr("global_symbol", "g")
    fn = tvm.compile(tvm.IRModule({"g": f}), target=target)["g"]
    rng = np.random.default_rng(0)
    NB = K // 32
    args = [rng.standard_normal((M, K)).astype(np.float32), None,
            rng.integers(0, 256, (N // TN, NB, 16, TN), dtype=np.uint8),
            (rng.standard_normal((N // TN, NB, TN)) * 0.01).astype(np.float16),
            (rng.standard_normal((N // TN, NB, TN)) * 0.01).astype(np.float16),
            rng.standard_normal((M, N)).astype(np.float32), np.zeros((M, N), np.float32)]
    total = 0.0
    for rows in TIMED_ROWS:
        pos = np.full((1, M), -1, np.int64)
        pos[0, :rows] = np.arange(rows)
        targs = [tvm.runtime.tensor(pos if a is None else a) for a in args]
        fn(*targs)
        ts = []
        for _ in range(3):
            t0 = time.process_time()
            for _ in range(REPEAT):
                fn(*targs)
            ts.append((time.process_time() - t0) / REPEAT)
        total += sorted(ts)[1]
    return round(total * 1e6, 1)
