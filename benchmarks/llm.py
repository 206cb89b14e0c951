"""SmolLM2-135M on the simulated device vs the float32 numpy reference.

    .venv/bin/python benchmarks/llm.py [--decode-tokens 64] [--no-compile] [--repeat 3]

What is measured (wall clock in the host process, medians of --repeat runs):

- compile: ``compile_llm`` of the GGUF into a fresh directory (parse + repack +
  build + export of both modules); skipped with --no-compile.
- prefill tok/s: prompt tokens / time of ``DeviceLLM.prefill(ids)`` — every
  64-token chunk's INFER (KV_RESIDENT) plus copying out the last position's
  logits.  Prompts: the 37-token chat prompt "What is the capital of France?"
  and a 256-token prompt (the whole context: four full chunks).
- decode tok/s: after prefilling the 37-token prompt, N greedy steps (positions
  37…37+N-1), each one INFER of decode.so + reading the logits + argmax.
  KV-resident (KV stays in the KV region) and non-resident (KV copied into
  input_buf and out of output_buf every token).
- decode at the end of the context: the same N steps at positions
  context-N … context-1 (after prefilling context-N tokens), and its ratio to
  decode at position 37 (goal >= 0.8).
- every KV dtype: float32 (context 256), float16 (512) and int8 (1,024), each
  its own compiled package and device, with decode's default int8
  activations, and a fourth package with float32 ones (f32 KV: what the
  exact arithmetic costs), all four loaded at once and measured in
  interleaved rounds (each round measures each package in turn; medians
  over the rounds), so the rows share the machine's state.  Each load
  picks its decode module (GEMVs on one thread or all) by timing both
  (``decode_choice``; force with DSPX_LLM_DECODE=serial|parallel).  The KV
  layout is compiler/llm's default ("blocked"; DSPX_LLM_KV_LAYOUT=rows for
  the earlier one); --layout-ab compares the two.
- bytes moved per decoded token: bytes the host copies into input_buf
  (tensors + descriptor table) + KV bytes it copies out of output_buf; the
  196,608 bytes of logits read are the same in both modes and listed apart.
- reference: tests/llm_reference.py (float32 numpy, dequantized weights), same
  prompts and steps, in this process, OPENBLAS_NUM_THREADS=1 unless set.
- llama.cpp (llama-cpp-python on the same GGUF and token ids, 1 and 2
  threads), when it is importable: it builds from source in ~15 min and is
  not a dependency of the project (``CMAKE_ARGS="-DGGML_NATIVE=ON" pip
  install llama-cpp-python==0.3.36``), measured in the same interleaved
  rounds as the packages.  Ratios dspx / llama.cpp 2 threads are paired per
  round (median over the rounds of llama.cpp's time / dspx's time; goals:
  prefill >= 1.5x, decode >= 1.2x).

Prints a table and writes benchmarks/results/llm.json.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

# The numpy reference decodes with 1 BLAS thread: with 2, OpenBLAS spin-waits
# whenever the other CPU is busy and runs ~5x slower (docs/history.md).
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
# Each package on a device of its own (the tests' switch, docs/device.md): on the one shared
# background device the three packages took turns on one core, and the first call after the
# other package's paid ~190 ms (prefill of 37 tokens: 300 ms instead of 110)
os.environ.setdefault("DSPX_PRIVATE", "1")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "src"))
sys.path.insert(0, os.path.join(ROOT, "tests"))

import numpy as np  # noqa: E402
from _results import write_json  # noqa: E402


def med(xs):
    return statistics.median(xs)


def decode_run(step, first_logits, start, n):
    """n greedy steps; returns (seconds, ids)."""
    t = int(np.argmax(first_logits))
    ids = []
    settle()
    t0 = time.perf_counter()
    for i in range(n):
        logits = step(t, start + i)
        ids.append(t)
        t = int(np.argmax(logits))
    return time.perf_counter() - t0, ids


SETTLE_S = 0.2  # idle before every timed phase, dspx's and llama.cpp's alike: the other engine's workers
# spin-wait after their last call (TVM's pool, llama.cpp's threads), and a phase timed in that
# window shares the 2 CPUs with them (prefill of 37 tokens ran at 135 tok/s after a llama.cpp
# round, 350 tok/s alone, on a 2-vCPU Zen 3)


def settle() -> None:
    time.sleep(SETTLE_S)


class LlamaCpp:
    """llama.cpp on the same GGUF and token ids at ``threads``, measured inside
    bench_dspx's rounds: prefill by eval() of the prompt, decode by greedy
    eval() of one token at a time."""

    def __init__(self, threads: int):
        from llama_cpp import Llama

        from dspx.llm import find_default_gguf

        self.llm = Llama(model_path=str(find_default_gguf()), n_ctx=256, n_batch=64, n_threads=threads,
                         n_threads_batch=threads, logits_all=False, verbose=False)

    def round(self, p37, p256, n: int) -> dict:
        """Seconds of one prefill of each prompt and of n decode steps from 37."""
        llm, out = self.llm, {}
        for name, ids in (("37", p37), ("256", p256)):
            llm.reset()
            settle()
            t0 = time.perf_counter()
            llm.eval(ids)
            out[f"prefill_{name}"] = time.perf_counter() - t0
        llm.reset()
        llm.eval(p37)
        settle()
        t0 = time.perf_counter()
        for _ in range(n):
            # the last token's logits (logits_all=False keeps no scores table)
            tok = int(np.argmax(np.ctypeslib.as_array(llm._ctx.get_logits(), shape=(llm.n_vocab(),))))
            llm.eval([tok])
        out["decode_resident"] = time.perf_counter() - t0
        return out

    def close(self):
        del self.llm


def bench_dspx(model_dirs: dict, p37, p256, long_text, n: int, repeat: int, non_resident: str,
               peers: dict | None = None) -> dict:
    """Every package of ``model_dirs`` ({key: dir}) loaded at once, each on its
    own device, and measured in interleaved rounds (round i measures each
    package in turn, then each of ``peers`` ({key: LlamaCpp})), so the rows
    share the machine's state: one package measured after another saw a
    different load (the f16 row of the last quiet run, 1.18x, was measured
    between the other two), and llama.cpp measured after all of dspx moved
    the ratios by up to 1.7x between two quiet runs.  Each peer's ratios are
    paired per round (``per_round_vs``: median over rounds of the peer's time
    / the package's)."""
    from dspx.host.llm import DeviceLLM

    llms, res, peers = {}, {}, peers or {}
    try:
        for key, d in model_dirs.items():
            t0 = time.perf_counter()
            llms[key] = llm = DeviceLLM(d, progress=True)
            res[key] = {"load_s": round(time.perf_counter() - t0, 2), "context": llm.context, "kv_dtype": llm.kv_dtype}
        ts = {k: {} for k in llms}
        for _ in range(repeat):
            for key, llm in llms.items():
                t, dev = ts[key], res[key]
                for name, ids in (("37", p37), ("256", p256)):
                    settle()
                    t0 = time.perf_counter()
                    llm.prefill(ids)
                    t.setdefault(f"prefill_{name}", []).append(time.perf_counter() - t0)
                for mode, resident in (("resident", True), ("non_resident", False))[:2 if key == non_resident else 1]:
                    first = llm.prefill(p37)
                    before = llm.traffic.moved
                    dt, dev[f"ids_{mode}"] = decode_run(lambda tk, p: llm.decode(tk, p, resident=resident), first,
                                                        len(p37), n)
                    t.setdefault(f"decode_{mode}", []).append(dt)
                    dev[f"bytes_per_token_{mode}"] = int((llm.traffic.moved - before) / n)
                start = llm.context - n
                first = llm.prefill(long_text[:start])
                dt, _ = decode_run(llm.decode, first, start, n)
                t.setdefault("decode_end", []).append(dt)
            for key, peer in peers.items():
                for k, v in peer.round(p37, p256, n).items():
                    ts.setdefault(key, {}).setdefault(k, []).append(v)
        for key, llm in llms.items():
            t, dev = ts[key], res[key]
            for name, ids in (("37", p37), ("256", p256)):
                dev[f"prefill_tok_s_{name}"] = round(len(ids) / med(t[f"prefill_{name}"]), 1)
            for mode in ("resident", "non_resident"):
                if f"decode_{mode}" in t:
                    dev[f"decode_tok_s_{mode}"] = round(n / med(t[f"decode_{mode}"]), 1)
            if key == non_resident:
                dev["same_tokens"] = dev["ids_resident"] == dev["ids_non_resident"]
                dev["resident_speedup"] = round(dev["decode_tok_s_resident"] / dev["decode_tok_s_non_resident"], 2)
            dev["decode_tok_s_end_of_context"] = round(n / med(t["decode_end"]), 1)
            dev["end_of_context_ratio"] = round(dev["decode_tok_s_end_of_context"] / dev["decode_tok_s_resident"], 2)
            dev["logits_bytes_per_token"] = 4 * llm.vocab
            dev["load_warnings"] = llm.load_warnings
            dev["decode_choice"] = llm.decode_choice
            dev["per_round_vs"] = {
                peer: {m: round(med([b / a for a, b in zip(t[m], ts[peer][m])]), 2)
                       for m in ("prefill_37", "prefill_256", "decode_resident")} for peer in peers}
        for key in peers:
            t = ts[key]
            res[key] = {"prefill_tok_s_37": round(len(p37) / med(t["prefill_37"]), 1),
                        "prefill_tok_s_256": round(len(p256) / med(t["prefill_256"]), 1),
                        "decode_tok_s": round(n / med(t["decode_resident"]), 1)}
    finally:
        for llm in [*llms.values(), *peers.values()]:
            llm.close()
    return res


def layout_ab(p37, long_text, n: int, repeat: int) -> dict:
    """--layout-ab: decode from 37 and at the end of the context for each KV dtype
    with the "rows" and "blocked" KV layouts (dspx.compiler.llm.KV_LAYOUTS), both
    packages loaded at once and measured alternately (interleaved rounds,
    medians), each on both decode modules (serial and parallel: the load-time
    choice would otherwise differ between the two packages)."""
    from dspx.compiler.llm import KV_LAYOUTS, compiled_dir
    from dspx.host.llm import DeviceLLM

    out = {}
    for dtype, ctx in (("float32", 256), ("float16", 512), ("int8", 1024)):
        llms = {lay: DeviceLLM(compiled_dir(progress=True, context=ctx, kv_dtype=dtype, kv_layout=lay), progress=False)
                for lay in KV_LAYOUTS}
        cases = [(lay, kind) for kind in ("serial", "parallel") for lay in llms]
        ts = {c: {"37": [], "end": []} for c in cases}
        ids = {}
        try:
            for _ in range(repeat):
                for lay, kind in cases:
                    llm = llms[lay]
                    llm.use_decode(kind)
                    dt, ids[lay, kind] = decode_run(llm.decode, llm.prefill(p37), len(p37), n)
                    ts[lay, kind]["37"].append(dt)
                    start = llm.context - n
                    dt, _ = decode_run(llm.decode, llm.prefill(long_text[:start]), start, n)
                    ts[lay, kind]["end"].append(dt)
        finally:
            for llm in llms.values():
                llm.close()
        r = {}
        for (lay, kind), t in ts.items():
            x = r.setdefault(kind, {})[lay] = {"decode_tok_s": round(n / med(t["37"]), 1),
                                               "decode_tok_s_end_of_context": round(n / med(t["end"]), 1)}
            x["end_of_context_ratio"] = round(x["decode_tok_s_end_of_context"] / x["decode_tok_s"], 2)
        r["same_tokens"] = len(set(map(tuple, ids.values()))) == 1
        out[dtype] = r
    return out


def decode_by_position(model_dir, first_ids, every: int = 8) -> dict:
    """--plot: greedy decode from the end of ``first_ids`` to the end of the
    context, KV-resident and not; tok/s of each step, averaged over ``every``
    positions: {"positions": [...], "resident": [...], "non_resident": [...]}."""
    from dspx.host.llm import DeviceLLM

    llm = DeviceLLM(model_dir, progress=False)
    out = {}
    try:
        for mode, resident in (("resident", True), ("non_resident", False)):
            t = int(np.argmax(llm.prefill(first_ids)))
            steps = []
            for pos in range(len(first_ids), llm.context):
                t0 = time.perf_counter()
                t = int(np.argmax(llm.decode(t, pos, resident=resident)))
                steps.append(time.perf_counter() - t0)
            chunks = [steps[i:i + every] for i in range(0, len(steps), every)]
            out[mode] = [round(len(c) / sum(c), 1) for c in chunks]
            out["positions"] = [len(first_ids) + i * every + len(c) // 2 for i, c in enumerate(chunks)]
    finally:
        llm.close()
    return out


SIMD_FLAGS = ("avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512_vnni", "avx_vnni", "avx512_bf16",
              "amx_int8")


def read_bandwidth() -> float:
    """GB/s of a 2-thread read of 512 MiB (numpy's sum releases the GIL), best of 3."""
    import threading

    a = np.ones(128 << 20, np.float32)
    halves = np.split(a, 2)
    best = float("inf")
    for _ in range(3):
        ts = [threading.Thread(target=np.add.reduce, args=(h,)) for h in halves]
        t0 = time.perf_counter()
        for t in ts:
            t.start()
        for t in ts:
            t.join()
        best = min(best, time.perf_counter() - t0)
    return a.nbytes / best / 1e9


def cpu_info() -> dict:
    """This CPU: its model name, LLVM's name for it, and the SIMD flags the kernels care about."""
    from dspx import cpuinfo
    from dspx.compiler.target import detect_mcpu

    flags = cpuinfo.flags() or frozenset()
    return {"model": cpuinfo.model_name(), "mcpu": detect_mcpu(), "flags": [f for f in SIMD_FLAGS if f in flags]}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--decode-tokens", type=int, default=64)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--no-compile", action="store_true")
    ap.add_argument("--no-reference", action="store_true")
    ap.add_argument("--layout-ab", action="store_true",
                    help="only A/B the KV layouts (rows vs blocked): decode from 37 and at the end of the context "
                         "for each KV dtype, interleaved; writes llm_layout_ab.json")
    ap.add_argument("--plot", action="store_true",
                    help="also decode across the whole context and write llm.png: tok/s by position, "
                         "KV-resident vs not (plot extra)")
    a = ap.parse_args()

    from dspx.compiler.llm import compile_llm, compiled_dir
    from dspx.llm import Tokenizer

    results: dict = {"decode_tokens": a.decode_tokens, "repeat": a.repeat, "host": os.uname().nodename,
                     "cpus": os.cpu_count(), "cpu": cpu_info(), "load_avg_start": os.getloadavg()[0]}
    print(f"CPU: {results['cpu']['model']} ({results['cpu']['mcpu']}), {results['cpus']} CPUs, "
          f"flags: {' '.join(results['cpu']['flags']) or 'none of ' + ' '.join(SIMD_FLAGS)}")
    if not a.no_compile:
        with tempfile.TemporaryDirectory(prefix="dspx-llm-bench-") as tmp:
            meta = compile_llm(None, tmp, progress=True)
            results["compile_s"] = round(meta["timings"]["total"], 2)
            results["compile_stages_s"] = {k: round(v, 2) for k, v in meta["timings"].items()}
    model_dir = compiled_dir(progress=True)
    with open(os.path.join(model_dir, "metadata.json")) as f:
        results["cpu"]["prefill_tile"] = json.load(f)["compiler"].get("prefill_tile")
    tok = Tokenizer.from_gguf(None)
    p37 = tok.encode_chat([{"role": "user", "content": "What is the capital of France?"}])
    assert len(p37) == 37, len(p37)
    text = ("The quick brown fox jumps over the lazy dog while the river runs to the sea. " * 40)
    p256 = tok.encode(text)[:256]
    long_text = tok.encode(text * 4)
    n = a.decode_tokens
    if a.layout_ab:
        results["layout_ab"] = ab = layout_ab(p37, long_text, n, a.repeat)
        results["load_avg_end"] = os.getloadavg()[0]
        print(f"\n{'KV':8s} {'decode':8s} {'layout':8s} {'decode@37':>10s} {'decode@end':>11s} {'end/37':>7s}")
        for dtype, r in ab.items():
            for kind in ("serial", "parallel"):
                for lay in ("rows", "blocked"):
                    x = r[kind][lay]
                    print(f"{dtype:8s} {kind:8s} {lay:8s} {x['decode_tok_s']:10.1f} "
                          f"{x['decode_tok_s_end_of_context']:11.1f} {x['end_of_context_ratio']:7.2f}")
                b, w = r[kind]["blocked"], r[kind]["rows"]
                print(f"{'':17s} blocked/rows: decode@37 {b['decode_tok_s'] / w['decode_tok_s']:.2f}x, decode@end "
                      f"{b['decode_tok_s_end_of_context'] / w['decode_tok_s_end_of_context']:.2f}x")
            print(f"{'':17s} same tokens in all four: {r['same_tokens']}")
        print(f"(tok/s, {n} greedy tokens, medians of {a.repeat} interleaved rounds; load average "
              f"{results['load_avg_start']:.2f} -> {results['load_avg_end']:.2f} on {results['cpus']} CPUs)")
        print(f"wrote {write_json('llm_layout_ab.json', results)}")
        return 0

    dirs = {"dspx": model_dir, "dspx_f16kv": compiled_dir(progress=True, context=512, kv_dtype="float16"),
            "dspx_int8kv": compiled_dir(progress=True, context=1024, kv_dtype="int8"),
            "dspx_f32act": compiled_dir(progress=True, decode_activations="float32")}
    try:
        peers = {f"llama_cpp_{t}t": LlamaCpp(t) for t in (1, 2)}
    except ImportError:
        peers = {}
    results.update(bench_dspx(dirs, p37, p256, long_text, n, a.repeat, non_resident="dspx", peers=peers))
    if peers:
        results["llama_cpp"] = {"1 thread": results.pop("llama_cpp_1t"), "2 threads": results.pop("llama_cpp_2t")}
    else:
        results["llama_cpp"] = "skipped: llama-cpp-python is not installed (building it takes ~15 min)"
    results["load_s"] = results["dspx"].pop("load_s")
    for key in ("dspx_f16kv", "dspx_int8kv", "dspx_f32act"):
        results[key]["same_tokens_as_f32kv"] = results[key]["ids_resident"] == results["dspx"]["ids_resident"]

    if not a.no_reference:
        import llm_reference as R

        t0 = time.perf_counter()
        ref = R.ReferenceLlama(max_seq=256)
        rr = {"load_s": round(time.perf_counter() - t0, 2)}
        for name, ids in (("37", p37), ("256", p256)):
            ts = []
            for _ in range(a.repeat):
                t0 = time.perf_counter()
                ref.prefill(ids)
                ts.append(time.perf_counter() - t0)
            rr[f"prefill_tok_s_{name}"] = round(len(ids) / med(ts), 1)
        ts = []
        for _ in range(a.repeat):
            first = ref.prefill(p37)[-1]
            dt, toks = decode_run(ref.decode, first, len(p37), n)
            ts.append(dt)
        rr["decode_tok_s"] = round(n / med(ts), 1)
        rr["same_tokens_as_dspx"] = toks == results["dspx"]["ids_resident"]
        results["reference"] = rr
    results["load_avg_end"] = os.getloadavg()[0]

    d, h, q, fa = results["dspx"], results["dspx_f16kv"], results["dspx_int8kv"], results["dspx_f32act"]
    lc = results["llama_cpp"]
    base = lc.get("2 threads") if isinstance(lc, dict) else None

    rows = [(f"dspx f32 KV (ctx {d['context']})", d["prefill_tok_s_37"], d["prefill_tok_s_256"],
             d["decode_tok_s_resident"], d["decode_tok_s_end_of_context"], d["bytes_per_token_resident"]),
            (f"dspx f16 KV (ctx {h['context']})", h["prefill_tok_s_37"], h["prefill_tok_s_256"],
             h["decode_tok_s_resident"], h["decode_tok_s_end_of_context"], h["bytes_per_token_resident"]),
            (f"dspx int8 KV (ctx {q['context']})", q["prefill_tok_s_37"], q["prefill_tok_s_256"],
             q["decode_tok_s_resident"], q["decode_tok_s_end_of_context"], q["bytes_per_token_resident"]),
            ("dspx f32 KV, f32 activations", fa["prefill_tok_s_37"], fa["prefill_tok_s_256"],
             fa["decode_tok_s_resident"], fa["decode_tok_s_end_of_context"], fa["bytes_per_token_resident"]),
            ("dspx f32 KV non-resident", "", "", d["decode_tok_s_non_resident"], "",
             d["bytes_per_token_non_resident"])]
    if "reference" in results:
        r = results["reference"]
        rows.append(("numpy float32 reference", r["prefill_tok_s_37"], r["prefill_tok_s_256"], r["decode_tok_s"],
                     "", ""))
    if isinstance(lc, dict):
        for th, r in lc.items():
            rows.append(("llama.cpp, " + th, r["prefill_tok_s_37"], r["prefill_tok_s_256"], r["decode_tok_s"], "",
                         ""))
    print()
    print(f"{'':30s} {'prefill 37':>11s} {'prefill 256':>12s} {'decode':>9s} {'decode@end':>11s} "
          f"{'bytes/token':>12s}")
    for name, p1, p2, dd, de, b in rows:
        print(f"{name:30s} {p1!s:>11s} {p2!s:>12s} {dd!s:>9s} {de!s:>11s} {b if b == '' else f'{b:,}':>12s}")
    for name, x in (("f32 KV", d), ("f16 KV", h), ("int8 KV", q), ("f32 KV, f32 activations", fa)):
        if base:  # paired per round: the median of (llama.cpp's time / dspx's time) over the rounds
            v = x["per_round_vs"]["llama_cpp_2t"]
            x["vs_llama_cpp_2t"] = {"prefill_tok_s_37": v["prefill_37"], "prefill_tok_s_256": v["prefill_256"],
                                    "decode_tok_s_resident": v["decode_resident"]}
            print(f"dspx {name} / llama.cpp 2 threads, paired per round: prefill 37 {v['prefill_37']:.2f}x "
                  f"(goal 1.5x), prefill 256 {v['prefill_256']:.2f}x (goal 1.5x), decode {v['decode_resident']:.2f}x "
                  f"(goal 1.2x); decode at the end of the context / at 37: {x['end_of_context_ratio']}x (goal 0.8x)")
        else:
            print(f"dspx {name}: decode at the end of the context / at 37: {x['end_of_context_ratio']}x (goal 0.8x)")
    print(f"(tok/s; decode = {n} greedy tokens from position 37, decode@end = {n} tokens ending at the context; "
          f"KV-resident / non-resident = {d['resident_speedup']}x, same tokens: {d['same_tokens']}; same tokens as "
          f"f32 KV: f16 {h['same_tokens_as_f32kv']}, int8 {q['same_tokens_as_f32kv']}, f32 activations "
          f"{fa['same_tokens_as_f32kv']}; decode modules chosen at "
          f"load: {d['decode_choice']})")
    if "compile_s" in results:
        print(f"compile: {results['compile_s']} s; load (modules + weights): {results['load_s']} s")
    if not isinstance(lc, dict):
        print(f"llama.cpp: {lc}")
    bw = read_bandwidth()
    wbytes = os.path.getsize(os.path.join(model_dir, "weights.bin"))  # every weight is read once per token
    results["memory"] = {"read_gb_s": round(bw, 1), "weights_bytes": wbytes,
                         "decode_gb_s": {k: round(wbytes * x["decode_tok_s_resident"] / 1e9, 1)
                                         for k, x in (("f32 KV", d), ("f16 KV", h), ("int8 KV", q),
                                                      ("f32 KV, f32 activations", fa))}}
    print(f"decode reads {wbytes / 2**20:.0f} MiB of weights per token: "
          + ", ".join(f"{k} {v} GB/s" for k, v in results["memory"]["decode_gb_s"].items())
          + f", against {bw:.1f} GB/s read bandwidth (numpy sum over 512 MiB, 2 threads, measured now)")
    print(f"load average {results['load_avg_start']:.2f} -> {results['load_avg_end']:.2f} on {results['cpus']} CPUs")
    out = write_json("llm.json", results)
    print(f"wrote {out}")
    if a.plot:
        import plots
        sweep = decode_by_position(model_dir, p37)
        results["decode_by_position"] = sweep
        write_json("llm.json", results)
        print("wrote", plots.lines(sweep["positions"], {"KV-resident": sweep["resident"],
                                                        "non-resident (KV copied both ways)": sweep["non_resident"]},
                                   out.removesuffix(".json") + ".png",
                                   f"SmolLM2-135M decode on the device, f32 KV, context {results['dspx']['context']}",
                                   "position in the context", "tok/s (8-step mean)"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
