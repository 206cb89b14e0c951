"""Compiled modules at runtime: latency through the device vs in-process vs onnxruntime.

    python benchmarks/infer.py [--runs 40] [--slow-runs 3] [--threads 2] [--batch 2] [--no-slow]
                               [--models resnet18,resnet50,shufflenet] [--portable] [--subgraph on|off|both]

Models: ResNet-18 (dspx.compiler.examples, fixed seed), and the onnx wheel's
light ResNet-50 and ShuffleNet (grouped and depthwise convolutions, channel
shuffles), re-weighted at random (examples.light).  --portable adds ResNet-18
compiled with --target x86-64-v3 (the cost of a module that travels).
--subgraph: the modules as the compiler builds them by default (one
onnx_subgraph call for the supported prefix), op by op, or both.
For each compiled module (compiled here with `dspx compile`, timed per stage,
verification included) it measures, medians of --runs calls:

- ``tvm``:      the module loaded in-process with the device's own loader
                (+ ``kernels.register_all()``), its entry called through TVM
                (``relax.VirtualMachine["main"]`` on a TVM tensor, no copies);
- ``vm``:       ``VirtualMachine["main"](x)`` through a real device process
                (input copied into input_buf, output copied out);
- ``nocopy``:   ``create_input`` + ``run_nocopy`` (zero copy both ways);
- ``ort``:      onnxruntime in-process on the ONNX file.

Every candidate has its own process and the same thread budget (--threads,
default 2): the in-process TVM and onnxruntime paths run in worker processes,
the device is a ``python -m dspx.device --threads N`` with one core.  Calls are
interleaved in small batches (shuffled order, a 50 ms pause between batches so
spinning thread pools go to sleep) so load spikes on this shared machine hit
every candidate alike.  The same is done, with --slow-runs calls,
for the ``--no-kernels`` module (pure TVM codegen, ~2.7 s per call).  A tiny
module (the 7-input example) gives the fixed per-call cost of the device hop.

Prints a table; writes JSON to benchmarks/results/infer-<timestamp>.json.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
sys.path.insert(0, str(ROOT / "src"))
from dspx.compiler.examples import random_inputs  # noqa: E402
BUILD = RESULTS / "build"


def _threads_env(n: int) -> dict:
    env = dict(os.environ)
    for var in ("OMP_NUM_THREADS", "TVM_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS"):
        env[var] = str(n)
    env["PYTHONPATH"] = str(ROOT / "src") + os.pathsep + env.get("PYTHONPATH", "")
    return env


# ------------------------------------------------------------------ workers
def worker(kind: str, target: str, threads: int) -> None:
    """Line protocol on stdin/stdout: 'N [PERIOD]' -> JSON list of N call times (s)."""
    import numpy as np

    if kind == "tvm":
        from dspx.device.core import kernels, loader
        kernels.configure_threads(threads)
        kernels.register_all()
        meta = json.loads((Path(target) / "metadata.json").read_text())
        mod = loader.load_module((Path(target) / "model.so").read_bytes(), kernels.names())
        args = [loader.as_tensor(a)[0] for a in random_inputs(meta)]
        func = mod._func

        def call():
            return func(*args)

        def first_output():
            out = call()
            out = out[0] if not hasattr(out, "numpy") else out
            return out.numpy()
    else:
        import onnxruntime as ort

        so = ort.SessionOptions()
        so.intra_op_num_threads = threads
        so.inter_op_num_threads = 1
        so.log_severity_level = 3
        sess = ort.InferenceSession(target, so, providers=["CPUExecutionProvider"])
        meta = {"inputs": [{"name": i.name, "shape": i.shape,
                            "dtype": {"tensor(float)": "float32", "tensor(int64)": "int64",
                                      "tensor(float16)": "float16"}[i.type]} for i in sess.get_inputs()]}
        feed = {t["name"]: a for t, a in zip(meta["inputs"], random_inputs(meta))}

        def call():
            return sess.run(None, feed)

        def first_output():
            return call()[0]

    out = first_output()  # warm-up + reference output for the main process
    print(json.dumps({"ready": True, "out": np.asarray(out, dtype=np.float64).ravel().tolist()}), flush=True)
    for line in sys.stdin:
        n, _, period = line.partition(" ")  # 'N [PERIOD]': N calls, PERIOD s of idle before each (untimed)
        ts = []
        for _ in range(int(n)):
            if period.strip():
                time.sleep(float(period))
            t0 = time.perf_counter()
            call()
            ts.append(time.perf_counter() - t0)
        print(json.dumps(ts), flush=True)


_SUFFIX = {"0": "", "1": "-sg"}  # module directory suffix per DSPX_SUBGRAPH value

TS_ENV = "DSPX_BENCH_TS"  # --breakdown: where the instrumented front and core log their stamps


def core_worker(argv) -> None:
    """A core whose call path logs (t_in, entry start, entry end, t_out) per call."""
    from dspx.device.core import loader, worker

    log = open(os.environ[TS_ENV] + ".core", "w", buffering=1)
    call, entry = worker.CoreWorker.call, loader.MappedModule.call
    stamps = []

    def timed_entry(self, args):
        stamps.append(time.perf_counter_ns())
        try:
            return entry(self, args)
        finally:
            stamps.append(time.perf_counter_ns())

    def timed_call(self, rec, *more):
        stamps[:] = [time.perf_counter_ns()]
        call(self, rec, *more)
        log.write(json.dumps(stamps[:3] + [time.perf_counter_ns()]) + "\n")

    worker.CoreWorker.call, loader.MappedModule.call = timed_call, timed_entry
    worker.main(argv)


def front_worker(sock: str, threads: int) -> None:
    """A device whose front logs (request in, job sent) per call, with instrumented cores."""
    from dspx.device import jobs
    from dspx.device.front import cores, loop, scheduler

    log = open(os.environ[TS_ENV] + ".front", "w", buffering=1)
    on_conn, start_job = loop.Service._on_conn, scheduler.Scheduler._start_job
    last_in = [0]

    def timed_on_conn(self, conn, events):
        last_in[0] = time.perf_counter_ns()
        return on_conn(self, conn, events)

    def timed_start_job(self, c, job):
        start_job(self, c, job)
        if isinstance(job.rec, jobs.Call):
            log.write(json.dumps([last_in[0], time.perf_counter_ns()]) + "\n")

    loop.Service._on_conn, scheduler.Scheduler._start_job = timed_on_conn, timed_start_job
    cores.CoreProc.COMMAND = (sys.executable, __file__, "--worker", "core")
    os.environ.update(_threads_env(threads))
    loop.Service(sock, cores=1, threads=threads).serve_forever()


LEGS = ("client: before send", "client -> front", "front: decode, plan, dispatch", "front -> core",
        "core: before entry", "entry call", "core: outputs, answer", "core -> client", "client: after receive",
        "total", "total - entry call")


def breakdown(module: Path, threads: int, runs: int, settle: float = 0.05) -> dict:
    """Median time of each leg of a zero-copy call (create_input + run_nocopy),
    from CLOCK_MONOTONIC stamps taken in the client, the front and the core.
    ``settle`` seconds before each call, as between interleave()'s batches:
    back to back, the legs meet the previous call's spinning pool instead."""
    from dspx.host.client import Client
    from dspx.host.vm import VirtualMachine
    from dspx.transport import is_listening

    tmp = tempfile.mkdtemp(prefix="dspx-bench-")
    sock, ts_log = os.path.join(tmp, "dsp0.sock"), os.path.join(tmp, "ts")
    front = subprocess.Popen([sys.executable, __file__, "--worker", "front", "--target", sock, "--threads",
                              str(threads)], env={**_threads_env(threads), TS_ENV: ts_log})
    try:
        while not is_listening(sock):
            time.sleep(0.05)
        meta = json.loads((module / "metadata.json").read_text())
        c = Client(sock, staging_size=(module / "model.so").stat().st_size + (1 << 20), kv_size=0)
        vm = VirtualMachine(module, client=c)
        xd = [vm.create_input(a.shape, a.dtype) for a in random_inputs(meta)]
        for _ in range(5):
            vm.run_nocopy(*xd)
        client_ts, real_send, real_receive = [], c._send_bytes, c._receive

        def send_bytes(*a, **kw):
            client_ts[-1].append(time.perf_counter_ns())
            return real_send(*a, **kw)

        def receive(*a, **kw):
            real_receive(*a, **kw)
            client_ts[-1].append(time.perf_counter_ns())

        c._send_bytes, c._receive = send_bytes, receive
        for _ in range(runs):
            time.sleep(settle)
            client_ts.append([time.perf_counter_ns()])
            vm.run_nocopy(*xd)
            client_ts[-1].append(time.perf_counter_ns())
        vm.close()
        c.close()
    finally:
        front.terminate()
        front.wait(10)
    fr = [json.loads(line) for line in open(ts_log + ".front")][-runs:]
    co = [json.loads(line) for line in open(ts_log + ".core")][-runs:]
    legs = {k: [] for k in LEGS}
    for ts, (f_in, f_out), (c_in, e0, e1, c_out) in zip(client_ts, fr, co):
        t0, t_send, t_recv, t_end = ts[0], ts[1], ts[-2], ts[-1]
        vals = (t_send - t0, f_in - t_send, f_out - f_in, c_in - f_out, e0 - c_in, e1 - e0, c_out - e1,
                t_recv - c_out, t_end - t_recv, t_end - t0, t_end - t0 - (e1 - e0))
        for k, v in zip(LEGS, vals):
            legs[k].append(v / 1e3)
    # (core -> client overlaps the core's last steps: c_out is taken after its send returned)
    return {k: {"median_us": statistics.median(v), "p90_us": sorted(v)[int(0.9 * len(v))]} for k, v in legs.items()}


NOOP_OP = 0x3F01
NOOP_LIB = f"""
from dspx.device.core.runtime import register_op

@register_op({NOOP_OP:#x}, name="noop")
def noop(input, output, tm):
    return 0
"""


def _echo(sock, other) -> None:
    other.close()  # the fork inherited the parent's end: EOF needs it closed
    while True:
        d = sock.recv(512)
        if not d:
            return
        sock.send(d)


class Echo:
    """A forked process that echoes SEQPACKET datagrams: calling it is one bare
    Python round trip between two processes, the floor of every call path."""

    def __init__(self, msg: bytes):
        import multiprocessing as mp
        import socket

        self.msg = msg
        self.sock, other = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self.proc = mp.get_context("fork").Process(target=_echo, args=(other, self.sock))
        self.proc.start()
        other.close()

    def __call__(self) -> None:
        self.sock.send(self.msg)
        self.sock.recv(512)

    def close(self) -> None:
        self.sock.close()
        self.proc.join(10)


def timed_calls(f, before=None):
    """An interleave() candidate: n calls of ``f``, each timed (s); ``before``
    (untimed) runs ahead of each call."""
    def run(n):
        ts = []
        for _ in range(n):
            if before is not None:
                before()
            t0 = time.perf_counter_ns()
            f()
            ts.append((time.perf_counter_ns() - t0) / 1e9)
        return ts
    return run


def call_path(sock: str, module: Path, runs: int, batch: int = 25) -> dict:
    """The fixed cost of a call, side by side in one run: PING, a bare Python
    SEQPACKET ping-pong (the floor), the tiny 7-input module through
    vm["main"] and zero-copy, and a no-op Python custom op (RPC)."""
    from dspx.abi import protocol as P
    from dspx.host.client import Client
    from dspx.host.tasks import Tasks
    from dspx.host.vm import VirtualMachine

    bare = Echo(bytes(P.Ping().encode()))
    meta = json.loads((module / "metadata.json").read_text())
    x = random_inputs(meta)
    staging = (module / "model.so").stat().st_size + (1 << 20)
    vm = VirtualMachine(module, client=Client(sock, staging_size=staging, kv_size=0))
    vm_nc = VirtualMachine(module, client=Client(sock, staging_size=staging, kv_size=0))
    xd = [vm_nc.create_input(t.shape, t.dtype) for t in x]
    ucp = Tasks(socket=sock)
    ucp.load_ops(NOOP_LIB)
    i_mem, o_mem = ucp.malloc(64), ucp.malloc(64)
    ping_client = vm.client
    cands = {"ping": timed_calls(lambda: ping_client.request(P.Ping())), "bare": timed_calls(bare),
             "tiny_vm": timed_calls(lambda: vm["main"](*x)),
             "tiny_nocopy": timed_calls(lambda: vm_nc.run_nocopy(*xd)),
             "noop_op": timed_calls(lambda: ucp.run(NOOP_OP, i_mem, o_mem))}
    try:
        for f in cands.values():
            f(100)  # warm-up
        times, per_round = interleave(cands, runs, batch, settle=0.005)
    finally:
        ucp.close()
        for v in (vm, vm_nc):
            cl = v.client
            v.close()
            cl.close()
        bare.close()
    res = {k: {"median_us": statistics.median(v) * 1e6, "p90_us": sorted(v)[int(0.9 * len(v))] * 1e6,
               "n": len(v)} for k, v in times.items()}
    res["ratios_paired"] = {"tiny_vm/ping": paired(per_round, "tiny_vm", "ping"),
                            "tiny_nocopy/ping": paired(per_round, "tiny_nocopy", "ping"),
                            "noop_op/ping": paired(per_round, "noop_op", "ping"),
                            "ping/bare": paired(per_round, "ping", "bare")}
    return res


class Worker:
    def __init__(self, kind: str, target, threads: int, extra_env: dict | None = None):
        self.kind = kind
        self.proc = subprocess.Popen([sys.executable, __file__, "--worker", kind, "--target", str(target),
                                      "--threads", str(threads)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     env={**_threads_env(threads), **(extra_env or {})}, text=True)
        first = json.loads(self.proc.stdout.readline())
        self.out = first["out"]

    def run(self, n: int, period: float = 0.0) -> list[float]:
        self.proc.stdin.write(f"{n} {period}\n" if period else f"{n}\n")
        self.proc.stdin.flush()
        return json.loads(self.proc.stdout.readline())

    def close(self):
        self.proc.stdin.close()
        self.proc.wait(30)


# ------------------------------------------------------------------ device side
class DevicePaths:
    """Two connections to one device: one for vm["main"] (copies), one for
    create_input + run_nocopy (input capacity is taken by the created array)."""

    def __init__(self, socket_path: str, module: Path, staging: int):
        import numpy as np

        from dspx.host.client import Client
        from dspx.host.vm import VirtualMachine

        meta = json.loads((module / "metadata.json").read_text())
        self.x = random_inputs(meta)
        self.vm = VirtualMachine(module, client=Client(socket_path, staging_size=staging, kv_size=0))
        self.vm_nc = VirtualMachine(module, client=Client(socket_path, staging_size=staging, kv_size=0))
        self.x_dev = [self.vm_nc.create_input(a.shape, a.dtype) for a in self.x]
        for d, a in zip(self.x_dev, self.x):
            d[...] = a
        self.cycles = {"vm": [], "nocopy": []}
        out = self.vm["main"](*self.x)
        out = out[0] if isinstance(out, list) else out
        self.out = np.asarray(out, dtype=np.float64).ravel().tolist()
        self.vm_nc.run_nocopy(*self.x_dev)

    def run(self, which: str, n: int) -> list[float]:
        ts = []
        for _ in range(n):
            if which == "vm":
                t0 = time.perf_counter()
                self.vm["main"](*self.x)
                ts.append(time.perf_counter() - t0)
                self.cycles["vm"].append(self.vm.last_cycles)
            else:
                t0 = time.perf_counter()
                self.vm_nc.run_nocopy(*self.x_dev)
                ts.append(time.perf_counter() - t0)
                self.cycles["nocopy"].append(self.vm_nc.last_cycles)
        return ts

    def close(self):
        for v in (self.vm, self.vm_nc):
            c = v.client
            v.close()
            c.close()


def interleave(cands: dict, runs: int, batch: int, settle: float = 0.05) -> tuple[dict, list[dict]]:
    """All call times per candidate, and per round the median of each one's batch.

    The order is shuffled every round (a fixed seed): thread pools spin for a
    while after a burst of work (onnxruntime's do), so whoever runs right
    after a given candidate pays for it; a rotation would keep the same
    neighbours.  ``settle`` seconds between batches let those threads sleep."""
    import random

    rng = random.Random(0)
    times = {k: [] for k in cands}
    per_round = []
    rounds = max(1, -(-runs // batch))
    keys = list(cands)
    for r in range(rounds):
        order = keys[:]
        rng.shuffle(order)
        this = {}
        for k in order:
            time.sleep(settle)
            ts = cands[k](batch)
            times[k] += ts
            this[k] = statistics.median(ts)
        per_round.append(this)
    return times, per_round


def paired(per_round: list[dict], a: str, b: str) -> float:
    """Median over rounds of a/b measured in the same round: the machine's
    load drifts between rounds, much less within one."""
    return statistics.median(r[a] / r[b] for r in per_round)


def summarize(times: list[float]) -> dict:
    ms = [t * 1e3 for t in times]
    q = statistics.quantiles(ms, n=4) if len(ms) >= 2 else [ms[0]] * 3
    p10 = sorted(ms)[len(ms) // 10]
    return {"median_ms": statistics.median(ms), "p10_ms": p10, "p25_ms": q[0], "p75_ms": q[2], "min_ms": min(ms),
            "n": len(ms)}


def compile_module(onnx: Path, out: Path, kernels: bool, threads: int, target: str = "native",
                   extra_env: dict | None = None) -> dict:
    cmd = [sys.executable, "-m", "dspx.cli", "compile", str(onnx), "-o", str(out), "--json", "--target", target]
    if not kernels:
        cmd.append("--no-kernels")
    t0 = time.perf_counter()
    p = subprocess.run(cmd, capture_output=True, text=True, env={**_threads_env(threads), **(extra_env or {})})
    wall = time.perf_counter() - t0
    if p.returncode:
        raise SystemExit(f"compile failed: {p.stdout}\n{p.stderr}")
    meta = json.loads(p.stdout.strip().splitlines()[-1])
    return {"wall_s": wall, "stages_s": meta.get("timings", {}), "command": " ".join(cmd[1:])}


def bench_model(label: str, module: Path, onnx: Path, sock: str, threads: int, runs: int, batch: int,
                ort_worker=None) -> dict:
    import numpy as np

    tvm_w = Worker("tvm", module, threads)
    dev = DevicePaths(sock, module, staging=(module / "model.so").stat().st_size + (1 << 20))
    ort_w = ort_worker or Worker("ort", onnx, threads)
    try:
        ref = np.array(ort_w.out)
        diffs = {k: float(np.max(np.abs(np.array(o) - ref))) for k, o in
                 (("tvm", tvm_w.out), ("device", dev.out))}
        cands = {"tvm": tvm_w.run, "vm": lambda n: dev.run("vm", n), "nocopy": lambda n: dev.run("nocopy", n),
                 "ort": ort_w.run}
        times, per_round = interleave(cands, runs, batch)
        res = {k: summarize(v) for k, v in times.items()}
        res["samples_s"] = times  # every call, for --plot
        res["ratios_paired"] = {"vm/tvm": paired(per_round, "vm", "tvm"),
                                "nocopy/tvm": paired(per_round, "nocopy", "tvm"),
                                "vm/ort": paired(per_round, "vm", "ort"),
                                "nocopy/ort": paired(per_round, "nocopy", "ort"),
                                "tvm/ort": paired(per_round, "tvm", "ort")}
        for k in ("vm", "nocopy"):
            res[k]["device_call_ms"] = statistics.median(dev.cycles[k]) / 1e6  # 1 GHz nominal: ns
        t = res["tvm"]["median_ms"]
        res["ratios_p10"] = {k: res[a]["p10_ms"] / res[b]["p10_ms"] for k, (a, b) in
                             {"vm/tvm": ("vm", "tvm"), "nocopy/tvm": ("nocopy", "tvm"), "vm/ort": ("vm", "ort"),
                              "nocopy/ort": ("nocopy", "ort"), "tvm/ort": ("tvm", "ort")}.items()}
        res["ratios_min"] = {"vm/tvm": res["vm"]["min_ms"] / res["tvm"]["min_ms"],
                             "nocopy/tvm": res["nocopy"]["min_ms"] / res["tvm"]["min_ms"],
                             "nocopy/ort": res["nocopy"]["min_ms"] / res["ort"]["min_ms"]}
        res["ratios"] = {"vm/tvm": res["vm"]["median_ms"] / t, "nocopy/tvm": res["nocopy"]["median_ms"] / t,
                         "vm/ort": res["vm"]["median_ms"] / res["ort"]["median_ms"],
                         "nocopy/ort": res["nocopy"]["median_ms"] / res["ort"]["median_ms"],
                         "tvm/ort": t / res["ort"]["median_ms"]}
        res["max_abs_diff_vs_ort"] = diffs
        res["label"] = label
        return res
    finally:
        tvm_w.close()
        dev.close()
        if ort_worker is None:
            ort_w.close()


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--runs", type=int, default=40)
    ap.add_argument("--slow-runs", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--batch", type=int, default=2, help="calls per candidate per interleaving round")
    ap.add_argument("--no-slow", action="store_true", help="skip the --no-kernels module")
    ap.add_argument("--worker", choices=["tvm", "ort", "front"], help=argparse.SUPPRESS)
    ap.add_argument("--target", help=argparse.SUPPRESS)
    ap.add_argument("--breakdown", action="store_true", help="also time each leg of a device call")
    ap.add_argument("--plot", action="store_true", help="also write infer-<model>.png latency distributions "
                                                        "(plot extra; per-layer bars: benchmarks/profile.py --plot)")
    ap.add_argument("--models", default="resnet18,resnet50,shufflenet",
                    help="comma-separated: resnet18 (dspx example) and light models of the onnx wheel "
                         "(resnet50, shufflenet, densenet121, ...; re-weighted at random)")
    ap.add_argument("--subgraph", choices=["off", "on", "both"], default="on",
                    help="compile the kernel modules with their supported prefix in one onnx_subgraph call "
                         "(on, the compiler's default), op by op (off, DSPX_SUBGRAPH=0), or both, each "
                         "paired against onnxruntime")
    ap.add_argument("--portable", action="store_true",
                    help="also time ResNet-18 compiled with --target x86-64-v3 (the cost of a portable module)")
    argv = sys.argv[1:] if argv is None else argv
    sys.path.insert(0, str(ROOT / "src"))
    if argv[:2] == ["--worker", "core"]:
        core_worker(argv[2:])
        return
    a = ap.parse_args(argv)
    if a.worker == "front":
        front_worker(a.target, a.threads)
        return
    if a.worker:
        worker(a.worker, a.target, a.threads)
        return

    os.environ.update(_threads_env(a.threads))
    from dspx.compiler import examples

    onnx = examples.build_all(BUILD / "onnx")
    models = [m.strip() for m in a.models.split(",") if m.strip()]
    for m in models:
        if m != "resnet18":
            onnx[m] = examples.light(m, BUILD / "onnx" / f"light-{m}.onnx")
    report = {"date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "host": platform.node(),
              "cpus": os.cpu_count(), "threads": a.threads, "runs": a.runs, "slow_runs": a.slow_runs,
              "loadavg_start": os.getloadavg(), "command": " ".join([Path(sys.argv[0]).name] + sys.argv[1:])}
    report["compile"] = {}
    variants = {"off": [("", "0")], "on": [(" subgraph", "1")], "both": [("", "0"), (" subgraph", "1")]}[a.subgraph]
    for m in models:
        for tag, flag in variants:
            print(f"compiling {m}{tag} ...", file=sys.stderr)
            report["compile"][m + tag] = compile_module(onnx[m], BUILD / f"{m}-k{_SUFFIX[flag]}", True, a.threads,
                                                        extra_env={"DSPX_SUBGRAPH": flag})
    if a.portable:
        report["compile"]["resnet18 x86-64-v3"] = compile_module(onnx["resnet18"], BUILD / "resnet18-k-v3", True,
                                                                 a.threads, target="x86-64-v3")
    if not a.no_slow:
        report["compile"]["resnet18 no_kernels"] = compile_module(onnx["resnet18"], BUILD / "resnet18", False,
                                                                  a.threads)
    compile_module(onnx["multi_input"], BUILD / "multi_input", False, a.threads)

    from dspx.host.launcher import PrivateDevice

    dev = PrivateDevice(cores=1, extra_args=["--threads", a.threads, "--quiet"])  # environment set above
    sock = dev.path
    try:
        from dspx.host.client import Client
        with Client(sock, staging_size=1 << 20, kv_size=0) as c:
            pings = sorted(c.ping()["rtt_us"] for _ in range(200))
        report["ping_rtt_us_median"] = pings[len(pings) // 2]

        for m in models:
            ort_w = Worker("ort", onnx[m], a.threads)
            try:
                for tag, flag in variants:
                    print(f"{m} (kernels{tag}) ...", file=sys.stderr)
                    report[f"{m}_kernels{_SUFFIX[flag]}"] = bench_model(
                        f"{m} (kernels{tag})", BUILD / f"{m}-k{_SUFFIX[flag]}", onnx[m], sock, a.threads,
                        a.runs, a.batch, ort_w)
                if m == "resnet18" and a.portable:
                    report["resnet18_v3"] = bench_model("resnet18 (x86-64-v3)", BUILD / "resnet18-k-v3",
                                                        onnx[m], sock, a.threads, a.runs, a.batch, ort_w)
                if m == "resnet18" and not a.no_slow:
                    print("ResNet-18 (--no-kernels) ...", file=sys.stderr)
                    report["resnet18_no_kernels"] = bench_model("resnet18 (--no-kernels)", BUILD / "resnet18",
                                                                onnx[m], sock, a.threads, a.slow_runs, 1, ort_w)
            finally:
                ort_w.close()
        print("call path: PING, bare ping-pong, tiny INFER, no-op op ...", file=sys.stderr)
        report["call_path"] = call_path(sock, BUILD / "multi_input", max(10 * a.runs, 500))
        print("tiny module (7 inputs, INFER_LARGE) ...", file=sys.stderr)
        report["tiny_multi_input"] = bench_model("multi_input (7 inputs)", BUILD / "multi_input",
                                                 onnx["multi_input"], sock, a.threads, max(a.runs, 100), 10)
    finally:
        dev.stop()
    if a.breakdown:
        print("breakdown of a zero-copy call ...", file=sys.stderr)
        tag, flag = variants[-1]  # the module the run compiled (the subgraph one with --subgraph on|both)
        report["breakdown"] = {f"resnet18 (kernels{tag})": breakdown(BUILD / f"resnet18-k{_SUFFIX[flag]}",
                                                                     a.threads, a.runs),
                               "multi_input (7 inputs)": breakdown(BUILD / "multi_input", a.threads,
                                                                   max(a.runs, 100))}
    report["loadavg_end"] = os.getloadavg()

    RESULTS.mkdir(parents=True, exist_ok=True)
    path = RESULTS / f"infer-{time.strftime('%Y%m%d-%H%M%S', time.gmtime())}.json"
    path.write_text(json.dumps(report, indent=2))

    print(f"\n1x3x224x224 float32, {a.threads} threads, medians "
          f"(load avg {report['loadavg_start'][0]:.2f} -> {report['loadavg_end'][0]:.2f}); "
          f"PING round trip {report['ping_rtt_us_median']:.0f} us")
    print(f"{'module':26} {'TVM in-proc':>11} {'vm[main]':>10} {'nocopy':>10} {'device call':>11} "
          f"{'ORT':>9} {'vm/tvm':>7} {'nc/tvm':>7} {'vm/ort':>7} {'nc/ort':>7}")
    for key in [f"{m}_kernels{_SUFFIX[f]}" for m in models for _, f in variants] + [
            "resnet18_v3", "resnet18_no_kernels", "tiny_multi_input"]:
        r = report.get(key)
        if not r:
            continue
        q = r["ratios"]
        print(f"{r['label']:26} {r['tvm']['median_ms']:9.3f}ms {r['vm']['median_ms']:8.3f}ms "
              f"{r['nocopy']['median_ms']:8.3f}ms {r['nocopy']['device_call_ms']:9.3f}ms "
              f"{r['ort']['median_ms']:7.3f}ms {q['vm/tvm']:7.3f} {q['nocopy/tvm']:7.3f} "
              f"{q['vm/ort']:7.3f} {q['nocopy/ort']:7.3f}")
        q = r["ratios_paired"]
        print(f"{'  (paired per round)':26} {'':>11} {'':>10} {'':>10} {'':>11} {'':>9} {q['vm/tvm']:7.3f} "
              f"{q['nocopy/tvm']:7.3f} {q['vm/ort']:7.3f} {q['nocopy/ort']:7.3f}")
        q = r["ratios_p10"]
        print(f"{'  (10th percentile)':26} {r['tvm']['p10_ms']:9.3f}ms {r['vm']['p10_ms']:8.3f}ms "
              f"{r['nocopy']['p10_ms']:8.3f}ms {'':>11} {r['ort']['p10_ms']:7.3f}ms {q['vm/tvm']:7.3f} "
              f"{q['nocopy/tvm']:7.3f} {q['vm/ort']:7.3f} {q['nocopy/ort']:7.3f}")
        m = r["ratios_min"]
        print(f"{'  (minimum of the runs)':26} {r['tvm']['min_ms']:9.3f}ms {r['vm']['min_ms']:8.3f}ms "
              f"{r['nocopy']['min_ms']:8.3f}ms {'':>11} {r['ort']['min_ms']:7.3f}ms {m['vm/tvm']:7.3f} "
              f"{m['nocopy/tvm']:7.3f} {'':>7} {m['nocopy/ort']:7.3f}")
    cp = report["call_path"]
    print("\ncall path, medians in us (paired ratios per round): " + ", ".join(
        f"{k} {cp[k]['median_us']:.1f}" for k in ("bare", "ping", "tiny_nocopy", "tiny_vm", "noop_op")))
    print("  " + ", ".join(f"{k} {v:.2f}" for k, v in cp["ratios_paired"].items()))
    print("  goals: tiny INFER / PING <= 2.0, no-op op / PING <= 1.3, PING / bare <= 1.5")
    for label, legs in report.get("breakdown", {}).items():
        print(f"\nlegs of one create_input + run_nocopy call, {label} (median / p90, us):")
        for k, v in legs.items():
            print(f"  {k:26} {v['median_us']:10.1f} {v['p90_us']:10.1f}")
    for k, v in report["compile"].items():
        st = ", ".join(f"{s} {t:.2f}" for s, t in v["stages_s"].items())
        print(f"compile {k}: {v['wall_s']:.1f} s wall incl. interpreter + TVM import ({st})")
    print("goals: ResNet-18 vm/tvm <= 1.03, nocopy/tvm <= 1.01 and below vm/tvm (paired); device/ORT: "
          "ResNet-18 <= 1.0, ResNet-50 <= 1.1; nocopy no slower than vm; ResNet-50 compile <= 60 s")
    print(f"JSON: {path.relative_to(ROOT)}")
    if a.plot:
        import plots
        for key, r in report.items():
            if isinstance(r, dict) and "samples_s" in r:
                print("plot:", plots.latency(r["samples_s"], RESULTS / f"infer-{key}.png",
                                             f"{r['label']}: latency per call against TVM in-process and "
                                             f"onnxruntime ({a.threads} threads)", baseline="tvm", unit="ms"))


if __name__ == "__main__":
    main()
