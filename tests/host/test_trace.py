"""Timeline trace (dspx.trace): a host program run with DSPX_TRACE against a
device started with it gives one Chrome trace whose tracks nest, whose DMA
transfers overlap the ping-pong softmax's tile compute, and whose host and
device events share one clock (a host wait brackets the core's job)."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

import numpy as np
import pytest

from dspx.trace import parts_dir
from dspx.transport import is_listening

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "softmax" / "softmax_ops.py"

HOST_PROGRAM = r'''
import sys
import numpy as np
from dspx.host.tasks import Tasks, softmax_param
from dspx.host.vm import VirtualMachine

example, module = sys.argv[1], sys.argv[2]
n = 1 << 20  # 8 tiles of 128 Ki floats: three ping-pong passes
with Tasks() as u:
    u.load_ops(example)
    data, param, out = u.malloc(4 * n), u.malloc(24), u.malloc(4 * n)
    x = np.random.default_rng(1).standard_normal(n).astype(np.float32)
    data.view(np.float32)[:] = x
    softmax_param(param, data, n, tiled=True)
    t = u.run(0x2402, param, out)
    e = np.exp(x - x.max())
    np.testing.assert_allclose(out.view(np.float32), e / e.sum(), rtol=1e-4, atol=1e-9)
    print("rpc seq", t.seq)
    n = 1 << 18  # the built-in C softmax: its DMA threads are C (sdk/dsp/runtime.c)
    data, out = u.malloc(4 * n), u.malloc(4 * n)
    data.view(np.float32)[:] = x[:n]
    softmax_param(param, data, n, tiled=True)
    u.run(0x1402, param, out)
with VirtualMachine(module) as vm:
    ins = [np.ones(s["shape"], s["dtype"]) for s in vm.metadata["inputs"]]
    vm["main"](*ins)
'''


@pytest.fixture(scope="module")
def traced(compiled):
    """Run HOST_PROGRAM with DSPX_TRACE set against a device started with it; the merged trace."""
    d = tempfile.mkdtemp(prefix="dspx-trace-")
    out = os.path.join(d, "trace.json")
    sock = os.path.join(d, "dsp.sock")
    env = dict(os.environ, DSPX_TRACE=out, DSPX_SOCKET=sock)
    log = open(os.path.join(d, "device.log"), "w+b")
    dev = subprocess.Popen([sys.executable, "-m", "dspx.device", "--socket", sock, *["--carveout-size", "64M"]],
                           env=env, stdout=log, stderr=log)
    try:
        deadline = time.monotonic() + 60
        while not is_listening(sock):
            assert dev.poll() is None and time.monotonic() < deadline, "device did not start"
            time.sleep(0.02)
        r = subprocess.run([sys.executable, "-c", HOST_PROGRAM, str(EXAMPLE), str(compiled("multi_output"))],
                           env=env, capture_output=True, text=True, timeout=120)
        assert r.returncode == 0, r.stderr
    finally:
        dev.terminate()
        dev.wait(10)
        log.close()
    data = json.loads(Path(out).read_text())
    shutil.rmtree(d, ignore_errors=True)
    return data, int(r.stdout.split("rpc seq")[1])


def _tracks(events):
    names = {e["pid"]: e["args"]["name"] for e in events if e["ph"] == "M" and e["name"] == "process_name"}
    threads = {(e["pid"], e["tid"]): e["args"]["name"] for e in events if e["ph"] == "M" and e["name"] == "thread_name"}
    tracks = defaultdict(list)
    for e in events:
        if e["ph"] == "X":
            tracks[(e["pid"], e["tid"])].append(e)
    return names, threads, tracks


def _end(e):
    return e["ts"] + e["dur"]


EPS = 1e-3  # timestamps are microseconds with ns resolution


def test_trace_parses_and_every_track_nests(traced):
    data, _ = traced
    events = data["traceEvents"]
    assert all(e["ph"] in ("X", "M") for e in events)
    names, threads, tracks = _tracks(events)
    assert sorted(names.values()) == ["device core 0", "device front", "host"]
    for key, evs in tracks.items():
        stack = []
        for e in sorted(evs, key=lambda e: (e["ts"], -e["dur"])):
            assert e["dur"] >= 0
            while stack and _end(stack[-1]) <= e["ts"] + EPS:
                stack.pop()
            if stack:  # overlaps its predecessor: must lie inside it
                assert _end(e) <= _end(stack[-1]) + EPS, f"{threads.get(key)}: {e} crosses {stack[-1]}"
            stack.append(e)


def test_every_leg_has_its_track(traced):
    data, _ = traced
    names, threads, tracks = _tracks(data["traceEvents"])
    by_proc = defaultdict(set)
    for (pid, tid), evs in tracks.items():
        by_proc[names[pid]].update(e["name"] for e in evs)
    # every span site of each side (docs/profiling.md's table), so a hook left off shows here
    assert {"encode", "encode (layout)", "copy-in", "sync read", "send", "wait", "infer", "load module",
            "request PING", "submit task", "wait task", "vm['main'] (infer + copy-out)"} <= by_proc["host"]
    assert {"receive", "core message", "validate INFER", "validate RPC", "queue", "to core",
            "respond"} <= by_proc["device front"]
    core = by_proc["device core 0"]
    assert {"call job", "job LoadModule", "op 0x2402", "op 0x1402", "dma wait ch0", "entry main", "tile 0",
            "tile 7"} <= core, core
    assert any(not n.startswith(("vm.", "tile", "dma", "job", "call",
                                                                                      "entry")) for n in core)
    dma = [k for k, v in threads.items() if v.startswith("dma channel")]
    assert sorted(threads[k] for k in dma) == ["dma channel 0", "dma channel 0 (native)", "dma channel 1",
                                               "dma channel 1 (native)"]
    for k in dma:
        assert all(e["name"] == "dma copy" and e["args"]["bytes"] > 0 for e in tracks[k])


def test_dma_is_in_flight_during_ping_pong_tile_compute(traced):
    """Ping-pong by the trace's own stamps: a copy is in flight during a tile when the
    task queued it before the tile's compute began and first waited on its channel
    after the compute ended.  Whether the bytes move during the compute too is up
    to the scheduler (most do on a quiet machine; none may on a loaded one), so the
    count is of the program's order, not of wall-clock overlap."""
    data, _ = traced
    names, threads, tracks = _tracks(data["traceEvents"])
    core = next(k for k, v in threads.items() if v == "core 0")
    tiles = [e for e in tracks[core] if e["name"].startswith("tile ")]
    copies = [(int(v[-1]), e) for k, v in threads.items() if v in ("dma channel 0", "dma channel 1")
              for e in tracks[k]]
    # 3 passes x 8 tiles; each pass fetches 8 tiles, the last two write 8 back
    assert len(tiles) == 24 and len(copies) == 8 * 3 + 8 * 2
    assert sum(c["args"]["bytes"] for _, c in copies) == 40 * (128 << 10) * 4
    waits = {ch: sorted(e["ts"] for e in tracks[core] if e["name"] == f"dma wait ch{ch}") for ch in (0, 1)}

    def in_flight(tile, ch, copy):
        issued = copy["args"]["issued"]
        first_wait = next((w for w in waits[ch] if w >= issued), float("inf"))
        return issued <= tile["ts"] and first_wait >= _end(tile)
    covered = [t for t in tiles if any(in_flight(t, ch, c) for ch, c in copies)]
    # tile k of a pass computes while tile k+1's fetch is in flight (7 of 8), and the last tile
    # while the previous tile's write-back is (passes 2 and 3): 7 + 8 + 8
    assert len(covered) == 23, f"{len(covered)} of {len(tiles)} tiles compute with a copy in flight"


def test_one_clock_host_send_and_wait_bracket_the_device_job(traced):
    """Host and device stamp events with CLOCK_MONOTONIC, system-wide: for
    every call the core ran, the host's send of that request starts before
    the front receives it, the front receives it before the core's job
    starts, and the host's wait for its seq ends after the job's compute
    (the entry call or the op) ends."""
    data, rpc_seq = traced
    names, threads, tracks = _tracks(data["traceEvents"])
    evs = [e for v in tracks.values() for e in v]
    host = sorted((e for e in evs if names[e["pid"]] == "host"), key=lambda e: e["ts"])
    receives = [e for e in evs if e["name"] == "receive"]
    jobs = [e for e in evs if e["name"] == "call job"]
    assert len(jobs) >= 2 and rpc_seq in {j["args"]["seq"] for j in jobs}  # the RPC and the INFER
    for job in jobs:
        send = [e for e in host if e["name"] == "send" and e["ts"] <= job["ts"]][-1]
        # seqs are per connection (the program has two): the first wait for it after the send
        wait = next(e for e in host if e["name"] == "wait" and e["args"]["seq"] == job["args"]["seq"]
                    and e["ts"] >= send["ts"])
        compute = next(e for e in evs if e["pid"] == job["pid"] and e["name"].startswith(("entry ", "op 0x"))
                       and job["ts"] <= e["ts"] <= _end(job))
        assert send["ts"] <= job["ts"] and _end(compute) <= _end(wait), (send, job, compute, wait)
        assert any(send["ts"] <= r["ts"] <= job["ts"] for r in receives), (send, job)


def test_native_op_dma_is_stamped_on_the_same_clock(traced):
    """The C shim's DMA threads stamp transfers with clock_gettime(CLOCK_MONOTONIC)
    in C; they must fall inside the core's op span, stamped in Python."""
    data, _ = traced
    names, threads, tracks = _tracks(data["traceEvents"])
    op = next(e for v in tracks.values() for e in v if e["name"] == "op 0x1402")
    native = [e for k, v in threads.items() if v.endswith("(native)") for e in tracks[k]]
    assert len(native) >= 4 and all(e["args"]["bytes"] > 0 for e in native)
    assert all(op["ts"] <= e["ts"] and _end(e) <= _end(op) for e in native), op


def test_the_recorder_imports_nothing_else_of_dspx():
    """dspx.trace is the bottom of every side: host, front and core record
    through it, so it must reach none of them (no import of dspx at all)."""
    import ast

    import dspx.trace

    tree = ast.parse(Path(dspx.trace.__file__).read_text())
    imports = [n for n in ast.walk(tree) if isinstance(n, (ast.Import, ast.ImportFrom))]
    assert not [n for n in imports if isinstance(n, ast.ImportFrom) and n.level], "a relative import"
    names = [a.name for n in imports if isinstance(n, ast.Import) for a in n.names]
    names += [n.module for n in imports if isinstance(n, ast.ImportFrom)]
    assert not [m for m in names if m.split(".")[0] == "dspx"], names


def test_an_untraced_process_is_off_and_a_traced_one_on(tmp_path):
    """Without DSPX_TRACE nothing starts a recorder (every span's site tests
    trace.on, so none records); with it, importing dspx.host starts the
    host's, and the classes keep their own methods (nothing is patched)."""
    code = ("import dspx.host, dspx.host.vm as vm, dspx.host.client as client, dspx.trace as t\n"
            "from dspx.device.core import runtime, worker\n"
            "from dspx.device.front import loop\n"
            "fns = [client.Client.infer, client.Client._send_bytes, vm.VirtualMachine.__getitem__,"
            " runtime.DmaEngine.wait, runtime.DmaEngine._do_copy, worker.CoreWorker.call, loop.Service._on_conn]\n"
            "print(t.on, t.recorder() is None, *{f.__code__.co_filename.rsplit('/', 1)[1] for f in fns})")
    env = {k: v for k, v in os.environ.items() if k != "DSPX_TRACE"}
    off = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60)
    assert off.returncode == 0, off.stderr
    files = {"client.py", "vm.py", "runtime.py", "worker.py", "loop.py"}  # where each is written: not trace.py
    assert off.stdout.split()[:2] == ["False", "True"] and set(off.stdout.split()[2:]) == files
    env["DSPX_TRACE"] = str(tmp_path / "t.json")
    on = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60)
    assert on.returncode == 0, on.stderr
    assert on.stdout.split()[:2] == ["True", "False"] and set(on.stdout.split()[2:]) == files
    assert json.loads((tmp_path / "t.json").read_text())["traceEvents"]  # merged at exit: the host's metadata


# ---------------------------------------------------------------- the trace is complete (issue 29)

def _spans_of(data):
    """{process name: [(span name, args)]} of a merged trace, and the host's pid."""
    events = data["traceEvents"]
    names = {e["pid"]: e["args"]["name"] for e in events if e["ph"] == "M" and e["name"] == "process_name"}
    by_proc = defaultdict(list)
    for e in events:
        if e["ph"] == "X":
            by_proc[names.get(e["pid"])].append((e["name"], e.get("args", {})))
    return by_proc, next(p for p, n in names.items() if n == "host")


def test_dspx_run_trace_has_the_device_spans_of_its_calls_every_time(compiled, tmp_path):
    """`dspx run DIR --trace OUT` 20 times against a shared traced device: each
    merged trace holds, beside the host's spans, the front's receive of the
    command's last request and the core's job of its INFER, both naming the
    command's pid (the host waits for them before it merges), and nothing is
    said missing.  A shared device keeps the part directory (it still writes
    there); a private one is covered by test_profile's CLI test and the
    late-part test below."""
    module = compiled("multi_output")
    meta = json.loads((module / "metadata.json").read_text())
    np.save(tmp_path / "x.npy", np.ones(meta["inputs"][0]["shape"], meta["inputs"][0]["dtype"]))
    d = tempfile.mkdtemp(prefix="dspx-trace-")  # 0700: a socket directory the device accepts
    out, sock = tmp_path / "out.json", os.path.join(d, "dsp.sock")
    env = {k: v for k, v in os.environ.items() if k != "DSPX_SOCKET"}
    log = open(tmp_path / "device.log", "w+b")
    dev = subprocess.Popen([sys.executable, "-m", "dspx.device", "--socket", sock, "--carveout-size", "64M"],
                           env=dict(env, DSPX_TRACE=str(out)), stdout=log, stderr=log)
    try:
        deadline = time.monotonic() + 60
        while not is_listening(sock):
            assert dev.poll() is None and time.monotonic() < deadline, "device did not start"
            time.sleep(0.02)
        for run in range(20):
            r = subprocess.run([sys.executable, "-m", "dspx.cli", "run", str(module), "-i", str(tmp_path / "x.npy"),
                                "--socket", sock, "--trace", str(out)], env=env, capture_output=True, text=True,
                               timeout=120)
            assert r.returncode == 0 and "merged without" not in r.stderr, (run, r.stderr)
            data = json.loads(out.read_text())
            spans, host = _spans_of(data)
            assert "missing" not in data["otherData"], (run, data["otherData"])
            assert {"infer", "send", "wait", "load module"} <= {n for n, _ in spans["host"]}, run
            last_seq = max(a["seq"] for n, a in spans["host"] if n == "wait")
            front = [a for n, a in spans["device front"] if n == "receive" and a.get("peer") == host]
            assert last_seq in {a["seq"] for a in front}, (run, last_seq, front)
            jobs = [a for n, a in spans["device core 0"] if n == "call job" and a["peer"] == host]
            assert len(jobs) == 1, (run, jobs)  # the INFER of this command: events from its start only
            assert "entry main" in {n for n, _ in spans["device core 0"]}, run
    finally:
        dev.terminate()
        dev.wait(10)
        log.close()
        shutil.rmtree(d, ignore_errors=True)
    assert parts_dir(out).is_dir()  # the device was alive at every merge: its part stays


# A stand-in device process: its part file at once, its spans of the host's
# requests (seq 6 a call, seq 7 the last request) 0.5 s later ("late"), or
# never: it ends first ("dead").
DEVICE_PART = r'''
import json, os, sys, time
parts, host, mode = sys.argv[1], int(sys.argv[2]), sys.argv[3]
f = open(os.path.join(parts, f"{os.getpid()}.jsonl"), "a")
f.write(json.dumps({"name": "process_name", "ph": "M", "pid": os.getpid(), "tid": 0,
                    "args": {"name": "device front"}}) + "\n")
f.flush()
if mode == "late":
    time.sleep(0.5)
    for name, seq in (("call job", 6), ("receive", 7), ("receive", 99)):
        f.write(json.dumps({"name": name, "ph": "X", "ts": time.perf_counter_ns() / 1000, "dur": 1,
                            "pid": os.getpid(), "tid": 1, "args": {"peer": host, "seq": seq}}) + "\n")
    f.flush()
    time.sleep(1)  # alive still when the host merges: its part stays
'''

HOST_WAITS = r'''
import json, os, subprocess, sys, time
from dspx import trace
from dspx.host import tracing

out, mode, device = sys.argv[1], sys.argv[2], sys.argv[3]
tracing.WAIT_S = 10.0
tracing.start_host(out)
a = tracing.sent({}, None, 7, trace.clock())  # what a Client records: its last request (seq 7)
a.call = (6, trace.clock())  # and its last call a core answered (seq 6)
dev = subprocess.Popen([sys.executable, "-c", device, str(trace.parts_dir(out)), str(os.getpid()), mode])
while not any(f.stem == str(dev.pid) for f in trace.parts_dir(out).glob("*.jsonl")):
    time.sleep(0.01)
if mode == "dead":
    dev.wait()
t0 = time.monotonic()
tracing.finish()
waited = time.monotonic() - t0
print(json.dumps({"waited": waited, "parts": trace.parts_dir(out).is_dir(),
                  "other": json.loads(open(out).read())["otherData"]}))
dev.wait()
'''


def test_the_host_waits_for_a_late_device_part_and_says_what_is_missing(tmp_path):
    """The host merges only once the device's parts hold its last request's
    receive and its last call's job (a part written 0.5 s late is waited for;
    its part stays, its process being alive); a device process that ends
    without them is not waited for: the trace says what is missing, and the
    parts of processes all gone are removed after the merge."""
    env = {k: v for k, v in os.environ.items() if k != "DSPX_TRACE"}

    def host(mode):
        out = tmp_path / f"{mode}.json"
        r = subprocess.run([sys.executable, "-c", HOST_WAITS, str(out), mode, DEVICE_PART], env=env,
                           capture_output=True, text=True, timeout=60)
        assert r.returncode == 0, r.stderr
        return json.loads(r.stdout.splitlines()[-1]), r.stderr

    late, err = host("late")
    # it waited for the late spans, and no longer than until they came (not WAIT_S)
    assert "missing" not in late["other"] and late["waited"] < 8 and late["parts"], (late, err)
    dead, err = host("dead")
    assert dead["waited"] < 5 and not dead["parts"], dead  # nothing alive to wait for
    assert dead["other"]["missing"] == ["the device's 'call job' span of seq 6",
                                        "the device's 'receive' span of seq 7"], dead
    assert "merged without the device's 'call job' span of seq 6" in err, err
