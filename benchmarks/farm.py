"""Farm throughput: jobs/s for 1, 2 and 4 devices, and Ray's cost per job.

    .venv/bin/python benchmarks/farm.py [--jobs 200] [--service-ms 20] [--sim-jobs 64] [--sim-module resnet18]
                                        [--chunk 8] [--rounds 5] [--skip stub|sim]

- ``stub``: a board-bound device stub, an actor that holds each call for a
  fixed service time (as a host waits on a board) behind the same
  ``dspx.farm.map``; 1, 2 and 4 stubs on one farm.  Goal: >= 3.5x at 4.
- ``sim``: the simulated device, CPU-bound, on a farm of 1 and then 2
  devices (one core, one thread each), the median of ``--rounds`` batches.
  Goal: >= 1.6x at 2 on 2 cores.
- ``overhead``: the sim module item by item through a local
  ``VirtualMachine`` against ``map`` on a 1-device farm, one item per call
  and ``--chunk`` items per call, in interleaved rounds (medians): Ray's
  cost per job, and how much of it batching takes away.  Goal: <= 5 %.

Every farm is a ``LocalFarm`` on loopback, started and stopped here (each
start takes ~15 s).  Writes benchmarks/results/farm-<timestamp>.json.
"""
from __future__ import annotations

import argparse
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "src"))

import dspx.farm  # noqa: E402  (before ray: the loopback switch)
import numpy as np  # noqa: E402
import ray  # noqa: E402

from benchmarks._results import example, write_json  # noqa: E402
from dspx.farm.cluster import NAMESPACE  # noqa: E402

SMALL = ["--carveout-size", "128M", "--ddr-pool-size", "128M"]


@ray.remote(num_cpus=0)
class BoardStub:
    """A device that only waits: ``service_s`` per item, no CPU."""

    def __init__(self, name: str, service_s: float):
        self.name, self.service_s = name, service_s

    def endpoint(self):  # what the lease broker asks of a device it grants
        return {"device": self.name, "node": ray.get_runtime_context().get_node_id(), "host": "", "socket": ""}

    def info(self):
        return {"device": self.name}

    def run(self, digest, module_box, batch):
        time.sleep(self.service_s * len(batch))
        return [{"outputs": {}, "node": "stub", "device": self.name, "attempt": 1} for _ in batch]


def _example(name: str, kernels: bool = False):
    return example(name, kernels)[0]


def _items(module, n: int, seed: int = 0) -> list[dict]:
    from dspx.host.inputs import specs
    from dspx.host.vm import find_module

    _, meta = find_module(module)
    rng = np.random.default_rng(seed)
    return [{s.name: rng.standard_normal(s.shape).astype(s.dtype) for s in specs(meta)} for _ in range(n)]


def _timed_map(module, items, **kw) -> float:
    t0 = time.perf_counter()
    dspx.farm.map(module, items, **kw)
    return time.perf_counter() - t0


def stub_part(module, jobs: int, service_ms: float, chunk: int) -> dict:
    out, batched = {}, {}
    with dspx.farm.LocalFarm(1, device_args=SMALL):
        items = _items(module, jobs)
        for n in (1, 2, 4):
            key = f"stub{n}"
            stubs = [BoardStub.options(name=f"{key}-{i}", namespace=NAMESPACE).remote(f"{key}-{i}", service_ms / 1e3)
                     for i in range(n)]
            ray.get([s.run.remote("", [], []) for s in stubs])
            out[n] = round(jobs / _timed_map(module, items, key=key), 2)
            batched[n] = round(jobs / _timed_map(module, items, key=key, chunk=chunk), 2)
            for s in stubs:
                ray.kill(s)
    ideal = 1e3 / service_ms
    return {"service_ms": service_ms, "jobs": jobs, "jobs_per_s": out, "ideal_per_device": ideal,
            "speedup_4": round(out[4] / out[1], 2), "chunk": chunk, f"jobs_per_s_chunk{chunk}": batched,
            f"speedup_4_chunk{chunk}": round(batched[4] / batched[1], 2)}


def sim_part(module, jobs: int, chunk: int, rounds: int) -> dict:
    from dspx.host.launcher import PrivateDevice
    from dspx.host.vm import VirtualMachine

    items = _items(module, jobs, seed=1)
    rates, per_job = {}, {"local": [], "farm_chunk1": [], f"farm_chunk{chunk}": []}
    for n in (1, 2):
        with dspx.farm.LocalFarm(n, device_args=SMALL):
            _timed_map(module, items[:2 * n])  # every device: its core started, the module loaded
            rates[n] = round(jobs / float(np.median([_timed_map(module, items) for _ in range(rounds)])), 2)
            if n > 1:
                continue
            # Ray's cost per job: the same items through a local VirtualMachine and through this
            # 1-device farm, in interleaved rounds (the machine's noise hits all three alike).
            dev = PrivateDevice(extra_args=["--threads", "1", *SMALL])
            try:
                with VirtualMachine(module, socket=dev.path) as vm:
                    for x in items[:2]:
                        vm["main"](**x)
                    for _ in range(rounds):
                        t0 = time.perf_counter()
                        for x in items:
                            vm["main"](**x)
                        per_job["local"].append((time.perf_counter() - t0) / jobs * 1e3)
                        per_job["farm_chunk1"].append(_timed_map(module, items) / jobs * 1e3)
                        per_job[f"farm_chunk{chunk}"].append(_timed_map(module, items, chunk=chunk) / jobs * 1e3)
            finally:
                dev.stop()
    overhead = {f"{k}_ms": round(float(np.median(v)), 3) for k, v in per_job.items()}
    local = overhead["local_ms"]
    for k in [k for k in overhead if k.startswith("farm_")]:
        overhead[k.replace("_ms", "_overhead_pct")] = round((overhead[k] - local) / local * 100, 1)
    overhead["rounds"] = rounds
    return {"module": str(module), "jobs": jobs, "jobs_per_s": rates, "speedup_2": round(rates[2] / rates[1], 2),
            "overhead": overhead}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--jobs", type=int, default=200, help="stub jobs per device count")
    ap.add_argument("--service-ms", type=float, default=20.0, help="the stub's service time per job")
    ap.add_argument("--sim-jobs", type=int, default=64, help="simulated-device jobs per device count")
    ap.add_argument("--sim-module", default="resnet18", help="the example to run on the simulated devices "
                    "(compiled with firmware kernels, cached with the tests' modules)")
    ap.add_argument("--chunk", type=int, default=8, help="items per call for the batched figures")
    ap.add_argument("--rounds", type=int, default=5, help="interleaved rounds of the per-job cost (medians)")
    ap.add_argument("--skip", choices=["stub", "sim"], default=None, help="leave one part out")
    a = ap.parse_args()
    tiny = _example("multi_input")
    result = {"cpus": os.cpu_count(), "ray": ray.__version__}
    if a.skip != "stub":
        result["stub"] = s = stub_part(tiny, a.jobs, a.service_ms, a.chunk)
        for label, rates, x in (("1 job per call", s["jobs_per_s"], s["speedup_4"]),
                                (f"{a.chunk} jobs per call", s[f"jobs_per_s_chunk{a.chunk}"],
                                 s[f"speedup_4_chunk{a.chunk}"])):
            print(f"stub ({a.service_ms:g} ms per job, {label}): "
                  + ", ".join(f"{n} device(s) {r} jobs/s" for n, r in rates.items()) + f"; {x}x at 4 (goal >= 3.5x)")
    if a.skip != "sim":
        result["sim"] = sim_part(_example(a.sim_module, kernels=True), a.sim_jobs, a.chunk, a.rounds)
        s = result["sim"]
        o = s["overhead"]
        print(f"sim ({a.sim_module}): 1 device {s['jobs_per_s'][1]} jobs/s, 2 devices {s['jobs_per_s'][2]} jobs/s; "
              f"{s['speedup_2']}x at 2 (goal >= 1.6x)")
        print(f"per job, medians of {o['rounds']} interleaved rounds: local {o['local_ms']} ms, "
              f"farm {o['farm_chunk1_ms']} ms "
              f"({o['farm_chunk1_overhead_pct']:+} %), farm chunk {a.chunk} {o[f'farm_chunk{a.chunk}_ms']} ms "
              f"({o[f'farm_chunk{a.chunk}_overhead_pct']:+} %)")
    print("written", write_json(f"farm-{time.strftime('%Y%m%d-%H%M%S')}.json", result))


if __name__ == "__main__":
    main()
