"""Per-kernel cost of the SmolLM2 device modules, in this process, one thread.

    .venv/bin/python benchmarks/llm_kernels.py [--rows 37] [--repeat 20] [--gemv-only]

Builds each TIR kernel of the prefill entry (one 64-row chunk, ``--rows`` real
rows, positions 0…rows-1) and of the decode attention at the end of each KV
dtype's context and at position 37, for each KV layout (rows / blocked,
interleaved rounds: the A/B of dspx.compiler.llm.KV_LAYOUTS), runs it on random inputs of its own shapes and reports the
process CPU time per call with TVM_NUM_THREADS=1 (CPU time, so the figures
hold on a busy machine better than wall time; two free cores roughly halve
the parallel kernels' wall time), GFLOP/s for the GEMMs, and the per-token
totals (× layers).  Then decode's GEMVs (one row, and the 4-row batched step) on each kind of decode
activations (int8, the default, and float32) and, where the CPU has VNNI, with the int8 block sums on
vpdpbusd and in int16, in interleaved rounds, each
call on one of 30 copies of its weights in turn (a layer's weights come from
memory in decode, not from cache), with the weight bytes read per second.
Prints a table, writes benchmarks/results/llm_kernels.json.
"""
from __future__ import annotations

import argparse
import os
import re
import sys
import time

os.environ["TVM_NUM_THREADS"] = "1"
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "src"))

import numpy as np  # noqa: E402
from _results import write_json  # noqa: E402

ROUNDS = 5  # interleaved rounds of the layout A/B
SMOLLM2 = dict(n_layers=30, dim=576, n_heads=9, n_kv=3, head_dim=64, ffn=1536, vocab=49152, theta=100000.0, eps=1e-5)


def random_args(func, rng, rows: int, pos0: int = 0, kv_layout: str = "blocked"):
    """tvm tensors for a kernel's buffers: random values, positions pos0… for `rows` rows, -1 after."""
    import tvm

    out = []
    # the buffers as the kernel's TVMScript signature declares them
    head = func.script().split("def main(", 1)[1].split("):\n", 1)[0]
    for bname, dims, dt in re.findall(r'(\w+): T\.Buffer\(\(([\d, ]+)\), "(\w+)"\)', head):
        shape = [int(x) for x in dims.split(",") if x.strip()]
        if bname == "pos":
            a = np.full(shape, -1, np.int64)
            a[0, :rows] = np.arange(pos0, pos0 + rows)
        elif bname == "bases":  # one KV slot: every row's slot starts at cache position 0
            a = np.zeros(shape, np.int64)
        elif bname == "ids":
            a = rng.integers(0, 1000, shape).astype(dt)
        elif dt.startswith("uint") or dt.startswith("int"):
            info = np.iinfo(dt)
            a = rng.integers(info.min, info.max, shape, endpoint=True).astype(dt)
        else:
            a = (rng.standard_normal(shape) * (0.01 if dt == "float16" else 1)).astype(dt)
        if bname in ("kc", "vc") and dt == "int8":  # the float32 scales: a sane value (random bits are denormals)
            s = np.frombuffer(np.float32(0.01).tobytes(), np.int8)
            if kv_layout == "rows":  # after each row's 64 values
                a[..., -4:] = s
            else:  # after each 16-position block's 16 x 64 values
                a.reshape(shape[1], -1, 16 * shape[3])[..., 16 * 64:] = np.tile(s, 16)
        out.append(tvm.runtime.tensor(a))
    return out


def build(func, name, target):
    import tvm

    return tvm.compile(tvm.IRModule({name: func.with_attr("global_symbol", name)}), target=target)[name]


def time_calls(fn, args, repeat):
    fn(*args)
    t0 = time.process_time()
    for _ in range(repeat):
        fn(*args)
    return (time.process_time() - t0) / repeat


def time_kernel(func, name, target, args, repeat):
    return time_calls(build(func, name, target), args, repeat)


def decode_gemvs(d, target, lanes: int, vnni: int, rng, repeat: int) -> dict:
    """Each decode GEMV (one row, and serve-llm's 4-row batched step) per way of computing it: float32
    or int8 activations, the int8 block sums in int16 or on vpdpbusd (where the target has VNNI): CPU
    time per call with its weights rotated over 30 copies, and the weight bytes read per second
    (medians of ROUNDS interleaved rounds)."""
    from dspx.abi.llmpack import BATCH_ROWS
    from dspx.compiler import llm as L

    copies = 30
    ways = {"float32": ("float32", 1, 0), "int8": ("int8", 1, 0)}
    if vnni:
        ways["int8 vnni"] = ("int8", 1, vnni)
    ways[f"{BATCH_ROWS} rows int8"] = ("int8", BATCH_ROWS, 0)
    if vnni:
        ways[f"{BATCH_ROWS} rows vnni"] = ("int8", BATCH_ROWS, vnni)
    fns = {}
    for way, (act, rows, vn) in ways.items():
        ks = L.kernels(L.Dims(**SMOLLM2, decode_activations=act), rows, False, batch=rows > 1, lanes=lanes, vnni=vn)
        for name in ("gemv_qkv", "gemv_o", "gemv_gate_up", "gemv_down"):
            args = [random_args(ks[name], rng, rows) for _ in range(copies)]
            q = 1 if rows == 1 else 2  # the weights after x (and the positions)
            weight_bytes = sum(a.numpy().nbytes for a in args[0][q:q + 3])  # q, d, m
            fns[way, name] = (build(ks[name], name, target), args, weight_bytes)
    ts = {k: [] for k in fns}
    for _ in range(ROUNDS):
        for k, (fn, argsets, _) in fns.items():
            fn(*argsets[0])
            t0 = time.process_time()
            for _ in range(max(1, repeat // 4)):
                for args in argsets:
                    fn(*args)
            ts[k].append((time.process_time() - t0) / (max(1, repeat // 4) * copies))
    out = {}
    print(f"\ndecode GEMVs (1 thread, CPU time, weights rotated over {copies} copies, medians of "
          f"{ROUNDS} interleaved rounds; us per call and weight GB/s):")
    print(f"{'kernel':14s} " + " ".join(f"{way:>18s}" for way in ways))
    for name in ("gemv_qkv", "gemv_o", "gemv_gate_up", "gemv_down"):
        row = {}
        for way in ways:
            t = float(np.median(ts[way, name]))
            row[way] = {"us": round(t * 1e6, 1), "weight_gb_s": round(fns[way, name][2] / t / 1e9, 1)}
        out[name] = row
        print(f"{name:14s} " + " ".join(f"{row[w]['us']:10.1f} {row[w]['weight_gb_s']:5.1f}GB/s" for w in ways))
    per_token = {way: round(sum(out[n][way]["us"] for n in out) * d.n_layers / 1e3, 2) for way in ways}
    out["per_step_ms_one_core"] = per_token
    print(f"{'x layers (ms)':14s} " + " ".join(f"{per_token[w]:18.2f}" for w in ways))
    return out


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, default=37, help="real rows of the prefill chunk (the rest is padding)")
    ap.add_argument("--repeat", type=int, default=20)
    ap.add_argument("--gemv-only", action="store_true", help="only the decode and batched-step GEMVs")
    a = ap.parse_args()
    import tvm
    from dspx.compiler import llm as L
    from dspx.compiler.llm.tuning import prefill_tile_for
    from dspx.compiler.target import cpu_features, make_target

    target = tvm.target.Target(make_target(L.LLM_TARGET))
    features = cpu_features(str(target.attrs["mcpu"]))
    lanes = L.vector_lanes(features)
    rng = np.random.default_rng(0)
    d = L.Dims(**SMOLLM2)
    tile = prefill_tile_for(d, target, lanes, runs_here=True)  # what compile_llm picks on this machine
    ks = L.kernels(d, d.chunk, True, tile=tuple(tile["tile"]), lanes=lanes)
    gemm = {"gemv_qkv": (d.dim, d.qkv), "gemv_o": (d.dim, d.dim), "gemv_gate_up": (d.dim, 2 * d.ffn),
            "gemv_down": (d.ffn, d.dim), "lm_head": (d.dim, d.vocab)}
    per_layer = ["rmsnorm", "gemv_qkv", "kv_write", "attention", "gemv_o", "rmsnorm", "gemv_gate_up", "silu_mul",
                 "gemv_down"]
    once = ["embed", "rmsnorm", "lm_head"]
    results = {"rows": a.rows, "target": str(target.attrs["mcpu"]), "prefill_tile": tile,
               "load_avg_start": os.getloadavg()[0],
               "prefill_us": {}, "decode_attention_us": {}}
    if a.gemv_only:
        results["decode_gemv"] = decode_gemvs(d, target, lanes, L.vnni_lanes(features), rng, a.repeat)
        print(f"wrote {write_json('llm_kernels.json', results)}")
        return 0
    cost = {}
    for name in dict.fromkeys(per_layer + once):
        cost[name] = time_kernel(ks[name], name, target, random_args(ks[name], rng, a.rows), a.repeat)
        results["prefill_us"][name] = round(cost[name] * 1e6, 1)
    total = sum(cost[n] for n in per_layer) * d.n_layers + sum(cost[n] for n in once)
    print(f"prefill chunk: {a.rows} real rows of {d.chunk}, {results['target']}, micro-tile "
          f"{'x'.join(map(str, tile['tile']))} ({tile['chosen_by']}), 1 thread, CPU time per call")
    print(f"{'kernel':14s} {'us/call':>9s} {'calls':>6s} {'ms/chunk':>9s} {'share':>6s} {'GFLOP/s':>8s}")
    for name in dict.fromkeys(per_layer + once):
        calls = per_layer.count(name) * d.n_layers + once.count(name)
        gf = ""
        if name in gemm:
            k, n = gemm[name]
            rows = 1 if name == "lm_head" else a.rows
            gf = f"{2 * rows * k * n / cost[name] / 1e9:.1f}"
        print(f"{name:14s} {cost[name] * 1e6:9.1f} {calls:6d} {cost[name] * calls * 1e3:9.2f} "
              f"{cost[name] * calls / total:6.1%} {gf:>8s}")
    print(f"{'total':14s} {'':9s} {'':6s} {total * 1e3:9.2f}  -> {a.rows / total:.0f} tok/s on one core")
    from dspx import cpuinfo

    mhz = cpuinfo.mhz()
    if mhz:  # two FMA pipes of `lanes` float32, 2 flops each, at the clock /proc/cpuinfo reports
        peak = 2 * 2 * lanes * mhz / 1e3
        results["fma_peak_gflop_s_one_core"] = round(peak, 1)
        print(f"nominal FMA peak of one core: {peak:.0f} GFLOP/s (2 pipes x {lanes} float32 x 2 flops x {mhz:.0f} MHz)")
    results["prefill_ms_one_core"] = round(total * 1e3, 2)
    print("\ndecode attention at the last position of each KV dtype's context and at 37, one layer, 1 thread, "
          f"per KV layout (medians of {ROUNDS} interleaved rounds):")
    for kd in ("float32", "float16", "int8"):
        ctx = L.largest_context(d.n_layers, d.n_kv, d.head_dim, kd)
        cases = {}
        for lay in L.KV_LAYOUTS:
            f = L.kernels(L.Dims(**SMOLLM2, context=ctx, kv_dtype=kd, kv_layout=lay), 1, False, lanes=lanes)["attention"]
            fn = build(f, "attention", target)
            for at in (ctx - 1, 37):
                cases[lay, at] = (fn, random_args(f, rng, 1, pos0=at, kv_layout=lay))
        ts = {k: [] for k in cases}
        for _ in range(ROUNDS):
            for k, (fn, args) in cases.items():
                ts[k].append(time_calls(fn, args, a.repeat))
        us = {k: float(np.median(v)) * 1e6 for k, v in ts.items()}
        results["decode_attention_us"][kd] = {
            lay: {"context": ctx, "at_end": round(us[lay, ctx - 1], 1), "at_37": round(us[lay, 37], 1)}
            for lay in L.KV_LAYOUTS}
        for lay in L.KV_LAYOUTS:
            t = us[lay, ctx - 1]
            print(f"  {kd:8s} {lay:8s} context {ctx:5d}: {t:7.1f} us/layer at {ctx - 1} "
                  f"({t * d.n_layers / 1e3:.2f} ms/token), {us[lay, 37]:6.1f} at 37")
        print(f"  {'':8s} blocked / rows at {ctx - 1}: {us['blocked', ctx - 1] / us['rows', ctx - 1]:.2f}")
    results["decode_gemv"] = decode_gemvs(d, target, lanes, L.vnni_lanes(features), rng, a.repeat)
    results["load_avg_end"] = os.getloadavg()[0]
    print(f"load average {results['load_avg_start']:.2f} -> {results['load_avg_end']:.2f}")
    print(f"wrote {write_json('llm_kernels.json', results)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
