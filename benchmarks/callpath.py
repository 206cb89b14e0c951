"""The call path, one run, paired rounds (issue 28): what a call costs back to
back and frame-paced, against its floors.

    .venv/bin/python benchmarks/callpath.py [--runs 400] [--paced-runs 40] [--threads 2] [--idle-s 5]

Rows, each in three pacings (back to back; one call every 33 ms; every
100 ms — the sleep before each call is not timed):

- ``bare``: a bare Python SEQPACKET ping-pong between two processes, the
  floor that pays the same vCPU wakes as a device call;
- ``ping``: ``Client`` PING to a device (``dspx serve`` process, one core);
- ``tiny_vm`` / ``tiny_nocopy``: the 7-input example through
  ``vm["main"]`` and through ``create_input`` + ``run_nocopy``;
- ``noop_py`` / ``noop_c``: a no-op custom op, Python and native (C, built
  here with ``dspx build-ops``), through ``Tasks.run``;
- ``resnet18``: ResNet-18 (firmware kernels) zero copy on the device, and
  ``ort``: onnxruntime on the same ONNX file in a process of its own with the
  same thread budget (its in-process peer).

The candidates of one pacing run in shuffled batches, round after round, and
each ratio is the median over rounds of the two medians of the same round
(the machine's load drifts between rounds, much less within one).  The bare
C ping-pong floors are ``benchmarks/ping.py``'s (back to back).  At the end,
the device sits idle for ``--idle-s`` seconds: its processes' CPU share.
``--legs``: then one zero-copy call of the 7-input module, leg by leg
(``infer.py``'s stamps in the client, an instrumented front and core), after
0, 10, 33 and 100 ms of idle.
Prints a table, writes benchmarks/results/callpath-<timestamp>.json.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "src"))

from benchmarks._results import example, write_json  # noqa: E402
from benchmarks.infer import (LEGS, NOOP_LIB, NOOP_OP, Echo, Worker, breakdown, interleave, paired,  # noqa: E402
                              timed_calls)

NOOP_C_OP = 0x3F02
NOOP_C = f"""
#include <dspx/dsp.h>
static int noop(void *input, void *output, void *tm) {{ (void)input; (void)output; (void)tm; return 0; }}
int dspx_ops_init(void) {{ return hb_dsp_register_fn({NOOP_C_OP:#x}, noop, 0); }}
"""
PACINGS = {"b2b": 0.0, "33ms": 0.033, "100ms": 0.100}
GOALS = [  # (what, numerator, denominator, pacing, goal)
    ("tiny INFER / PING, back to back", "tiny_vm", "ping", "b2b", 2.0),
    ("no-op Python op / PING", "noop_py", "ping", "b2b", 1.5),
    ("no-op C op / PING", "noop_c", "ping", "b2b", 1.5),
    ("PING / bare ping-pong, every 33 ms", "ping", "bare", "33ms", 1.5),
    ("tiny INFER / bare ping-pong, every 33 ms", "tiny_vm", "bare", "33ms", 3.0),
    ("ResNet-18 device / onnxruntime, every 33 ms", "resnet18", "ort", "33ms", 1.05),
    ("ResNet-18 zero copy / onnxruntime, back to back", "resnet18", "ort", "b2b", 1.03),
]


def _device_cpu_share(pid: int, seconds: float) -> float:
    """CPU time of the device's processes (front and cores) over ``seconds``
    of idle, as a share of one CPU."""
    import psutil

    def cpu() -> float:
        procs = [psutil.Process(pid), *psutil.Process(pid).children(recursive=True)]
        total = 0.0
        for p in procs:
            try:
                t = p.cpu_times()
                total += t.user + t.system
            except psutil.Error:
                pass
        return total

    before, t0 = cpu(), time.monotonic()
    time.sleep(seconds)
    return (cpu() - before) / (time.monotonic() - t0)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=400, help="back-to-back calls per candidate")
    ap.add_argument("--paced-runs", type=int, default=40, help="frame-paced calls per candidate and pacing")
    ap.add_argument("--threads", type=int, default=2, help="the device's and onnxruntime's threads")
    ap.add_argument("--idle-s", type=float, default=5.0, help="seconds of idle for the device's CPU share")
    ap.add_argument("--legs", action="store_true", help="and a call's legs after 0, 10, 33 and 100 ms of idle")
    a = ap.parse_args()

    import tempfile

    from dspx import sdk
    from dspx.abi import protocol as P
    from dspx.compiler.examples import random_inputs
    from dspx.host.client import Client
    from dspx.host.launcher import PrivateDevice
    from dspx.host.tasks import Tasks
    from dspx.host.vm import VirtualMachine

    print("modules: the 7-input example and ResNet-18 (from the tests' cache) ...", file=sys.stderr)
    tiny, _ = example("multi_input")
    resnet, resnet_onnx = example("resnet18", kernels=True)
    with tempfile.TemporaryDirectory(prefix="dspx-callpath-") as tmp:
        src = os.path.join(tmp, "noop.c")
        with open(src, "w") as f:
            f.write(NOOP_C)
        noop_c = sdk.build_ops([src], os.path.join(tmp, "noop.so"), ["-O2"], echo=False).read_bytes()
    dev = PrivateDevice(extra_args=["--threads", str(a.threads)])
    ort = Worker("ort", resnet_onnx, a.threads)
    opened = []
    try:
        def vm_of(module):
            import json

            meta = json.loads((module / "metadata.json").read_text())
            staging = (module / "model.so").stat().st_size + (1 << 20)
            vm = VirtualMachine(module, client=Client(dev.path, staging_size=staging, kv_size=0))
            opened.append(vm)
            return vm, random_inputs(meta)

        vm_tiny, x_tiny = vm_of(tiny)
        vm_nc, _ = vm_of(tiny)
        xd_tiny = [vm_nc.create_input(t.shape, t.dtype) for t in x_tiny]
        for d, x in zip(xd_tiny, x_tiny):
            d[...] = x
        vm_rn, x_rn = vm_of(resnet)
        xd_rn = [vm_rn.create_input(t.shape, t.dtype) for t in x_rn]
        for d, x in zip(xd_rn, x_rn):
            d[...] = x
        ucp = Tasks(socket=dev.path)
        ucp.load_ops(NOOP_LIB)
        ucp.load_ops(noop_c)
        i_mem, o_mem = ucp.malloc(64), ucp.malloc(64)
        bare = Echo(bytes(P.Ping().encode()))
        calls = {"bare": bare, "ping": lambda: vm_tiny.client.request(P.Ping()),
                 "tiny_vm": lambda: vm_tiny["main"](*x_tiny), "tiny_nocopy": lambda: vm_nc.run_nocopy(*xd_tiny),
                 "noop_py": lambda: ucp.run(NOOP_OP, i_mem, o_mem), "noop_c": lambda: ucp.run(NOOP_C_OP, i_mem, o_mem),
                 "resnet18": lambda: vm_rn.run_nocopy(*xd_rn)}
        for f in calls.values():
            for _ in range(20):
                f()  # warm-up
        ort.run(5)
        result = {"cpus": os.cpu_count(), "threads": a.threads, "load_before": os.getloadavg()[0], "pacings": {}}
        for name, period in PACINGS.items():
            print(f"{name}: {len(calls) + 1} candidates ...", file=sys.stderr)
            if period:
                cands = {k: timed_calls(f, before=lambda p=period: time.sleep(p)) for k, f in calls.items()}
                cands["ort"] = lambda n, p=period: ort.run(n, p)
                runs, batch = a.paced_runs, 5
            else:
                cands = {k: timed_calls(f) for k, f in calls.items()}
                cands["ort"] = ort.run
                runs, batch = a.runs, 25
            times, per_round = interleave(cands, runs, batch, settle=0.005)
            result["pacings"][name] = {
                "period_s": period,
                "median_us": {k: round(statistics.median(v) * 1e6, 1) for k, v in times.items()},
                "per_round": per_round}
        result["ratios"] = [{"what": what, "pacing": pacing, "goal": goal,
                             "paired": round(paired(result["pacings"][pacing]["per_round"], num, den), 3)}
                            for what, num, den, pacing, goal in GOALS]
        bare.close()
        ucp.close()
        print(f"idle: {a.idle_s:g} s ...", file=sys.stderr)
        result["idle_cpu_share"] = round(_device_cpu_share(dev.proc.pid, a.idle_s), 4)
        result["load_after"] = os.getloadavg()[0]
    finally:
        for vm in opened:
            c = vm.client
            vm.close()
            c.close()
        ort.close()
        dev.stop()

    rows = list(calls) + ["ort"]
    print(f"\ncall path, medians in µs (load {result['load_before']:.2f} → {result['load_after']:.2f}, "
          f"{a.threads} threads)")
    print(f"{'':>12}" + "".join(f"{p:>12}" for p in PACINGS))
    for r in rows:
        print(f"{r:>12}" + "".join(f"{result['pacings'][p]['median_us'][r]:>12.1f}" for p in PACINGS))
    print("\npaired ratios (median over rounds)")
    for row in result["ratios"]:
        mark = "met" if row["paired"] <= row["goal"] else "NOT met"
        print(f"  {row['what']:<50} {row['paired']:>7.3f}   goal <= {row['goal']:g}: {mark}")
    share = result["idle_cpu_share"]
    print(f"  {'idle device CPU share':<50} {share * 100:>6.2f} %   goal < 1 %: {'met' if share < 0.01 else 'NOT met'}")
    if a.legs:
        idles = (0.0, 0.010, 0.033, 0.100)
        print("legs of one zero-copy call of the 7-input module ...", file=sys.stderr)
        legs = result["legs_us"] = {f"{int(i * 1e3)}ms": breakdown(tiny, a.threads, 60 if i else 300, settle=i)
                                    for i in idles}
        print("\nlegs of one zero-copy call, 7-input module, medians in µs, after an idle of")
        print(f"{'':>32}" + "".join(f"{k:>10}" for k in legs))
        for leg in LEGS:
            print(f"{leg:>32}" + "".join(f"{legs[k][leg]['median_us']:>10.1f}" for k in legs))
    print("written", write_json(f"callpath-{time.strftime('%Y%m%d-%H%M%S')}.json", result))


if __name__ == "__main__":
    main()
