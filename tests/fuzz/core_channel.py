"""Fuzz the core->front channel: a real front whose cores are fakes that
send mutated records.

``python -m tests.fuzz.core_channel front SOCKET`` runs a real front
(dspx.device.front) whose cores are ``fake_core`` below.  A fake core says
Hello (claiming the softmax command), and for every Call it gets it first
writes one mutated record (a bit-flipped, truncated or spliced Done,
Deliver or Hello, or a Done for a job that is not its own, or a pickle
stream), then answers the call with a proper Done carrying a failure
response.  The front must restart the core for every record that is not
valid for it, and keep serving.

``run(count)`` drives it: it starts the front, sends ``count`` RPCs, each
of which must get exactly one answer within the timeout, pings between
them, and returns what it saw (answers, restarts from the log, hangs).
"""
from __future__ import annotations

import argparse
import os
import pickle
import random
import socket
import subprocess
import sys
import tempfile
import time

from dspx.abi import protocol as P
from dspx.abi.protocol import Status
from dspx.device import jobs

SOFTMAX = 0x1402


def mutate(rng: random.Random, data: bytes, pool) -> bytes:
    """``data`` bit-flipped, truncated, spliced with one of ``pool``, grown or given an edge byte."""
    b = bytearray(data)
    how = rng.randrange(5)
    if how == 0:
        for _ in range(rng.randint(1, 4)):
            i = rng.randrange(len(b))
            b[i] ^= 1 << rng.randrange(8)
    elif how == 1:
        del b[rng.randrange(len(b)):]
    elif how == 2:
        other = rng.choice(pool)
        b = b[:rng.randrange(len(b) + 1)] + other[rng.randrange(len(other)):]
    elif how == 3:
        i = rng.randrange(len(b) + 1)
        b[i:i] = rng.randbytes(rng.randint(1, 8))
    else:
        i = rng.randrange(len(b))
        b[i] = rng.choice((0, 1, 0xFF, 0x7F, 0x80))
    return bytes(b)


def mutated(rng: random.Random, job: int, cid: int) -> bytes:
    """One record a hostile core might write: mostly damaged, sometimes valid."""
    seeds = [jobs.encode(jobs.Done(job, int(Status.ERR_CALL), "x" * rng.randrange(40), 1, {"cycles": 3},
                                   response=b"\x01" * 16)),
             jobs.encode(jobs.Deliver(cid, b"\x02" * rng.randrange(64))),
             jobs.encode(jobs.Hello(0, os.getpid(), [(SOFTMAX, "softmax", 0)])),
             jobs.encode(jobs.Done(job + rng.randint(1, 1000), 0, response=b"F" * 16)),  # not its job
             jobs.encode(jobs.Deliver(cid + rng.randint(1, 50), b"F" * 16)),  # not its client
             pickle.dumps(jobs.Done(job))]
    data = rng.choice(seeds)
    return data if rng.randrange(4) == 0 else mutate(rng, data, seeds)  # sometimes the seed as it is


def fake_core(argv=None) -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--fd", type=int, required=True)
    ap.add_argument("--status-fd", type=int)
    ap.add_argument("--index", type=int, default=0)
    ap.add_argument("--threads", type=int, default=0)
    a = ap.parse_args(argv)
    rng = random.Random(int(os.environ.get("DSPX_FUZZ_SEED", "1")) * 1_000_003 + os.getpid())
    ep = jobs.endpoint(socket.socket(fileno=a.fd))
    jobs.send(ep, jobs.Hello(a.index, os.getpid(), [(SOFTMAX, "softmax", 0)]))
    clients: dict[int, int] = {}
    while True:
        try:
            rec, fds = jobs.recv(ep, jobs.FRONT_TO_CORE)
        except Exception:
            return
        for fd in fds:
            os.close(fd)
        cid = rec.spec.cid if isinstance(rec, jobs.Call) and rec.spec is not None else clients.get(rec.job, 0)
        if isinstance(rec, jobs.Call):
            ep.send(mutated(rng, rec.job, cid))
            resp = P.failure_response(P.MsgType.RPC, rec.seq, Status.ERR_CALL).encode()
            jobs.send(ep, jobs.Done(rec.job, int(Status.ERR_CALL), "fake core", rec.seq, response=resp))
        elif rec.job:
            jobs.send(ep, jobs.Done(rec.job))


def front(argv=None) -> None:
    """A real front whose cores are fake_core."""
    from dspx.device.front.cores import CoreProc
    CoreProc.COMMAND = (sys.executable, "-m", "tests.fuzz.core_channel", "core")
    from dspx.device.__main__ import main
    sys.exit(main(argv))


def run(count: int, seed: int = 1, cores: int = 2, timeout: float = 30.0) -> dict:
    """Start a front with fake cores, send ``count`` RPCs; what happened."""
    from dspx.host.client import Client
    from dspx.transport import is_listening

    d = tempfile.mkdtemp(prefix="dspx-corefuzz-")
    path = os.path.join(d, "dsp.sock")
    log = open(os.path.join(d, "front.log"), "w+b")
    env = dict(os.environ, DSPX_FUZZ_SEED=str(seed))
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH", "")) if p)
    proc = subprocess.Popen([sys.executable, "-m", "tests.fuzz.core_channel", "front", "--socket", path,
                             "--cores", str(cores), "--carveout-size", "64M", "--ddr-pool-size", "64M"],
                            stdout=log, stderr=log, env=env, cwd=root)
    out = {"sent": 0, "answered": 0, "hangs": 0, "front_died": False, "by_status": {}}
    try:
        deadline = time.monotonic() + 60
        while not is_listening(path):
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError("front did not start: " + _text(log))
            time.sleep(0.01)
        c = None
        for i in range(count):
            if c is None:
                c = Client(path, staging_size=1 << 16, timeout=timeout)
                buf = c.alloc(4096)
            out["sent"] += 1
            req = P.Rpc(cmd=SOFTMAX, input_dsp_addr=buf.dsp_addr, input_size=64,
                        output_dsp_addr=buf.dsp_addr + 64, output_size=64, core=P.CORE_ANY)
            try:
                r = c.wait(c.send(req), timeout, req.NAME)
            except P.ProtocolError:
                # A valid Deliver to the core's own client with damaged bytes:
                # the core could write those on that client's socket anyway.
                out["garbage_to_own_client"] = out.get("garbage_to_own_client", 0) + 1
                c.close()
                c = None
                continue
            except Exception as e:  # noqa: BLE001 - a hang or a lost device is what we count
                out["hangs"] += 1
                out["last_error"] = repr(e)
                break
            out["answered"] += 1
            name = Status(r.status).name
            out["by_status"][name] = out["by_status"].get(name, 0) + 1
            if i % 50 == 0:
                c.ping()
        if c is not None:
            c.ping()
            c.close()
        with Client(path, staging_size=0, printf_size=0, timeout=timeout) as observer:
            out["ping_after"] = "uptime_ms" in observer.ping()
    finally:
        out["front_died"] = proc.poll() is not None
        text = _text(log)
        out["invalid_records"] = text.count("sent an invalid record")
        out["tracebacks"] = text.count("Traceback") + text.count("internal error")
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()
    return out


def _text(log) -> str:
    log.flush()
    log.seek(0)
    return log.read().decode(errors="replace")


if __name__ == "__main__":
    if sys.argv[1] == "core":
        fake_core(sys.argv[2:])
    elif sys.argv[1] == "front":
        front(sys.argv[2:])
    else:
        print(run(int(sys.argv[1])))


# ---------------------------------------------------------------- the decoder alone

# Valid core->front records that the mutations start from.
SEEDS = [jobs.encode(r) for r in (
    jobs.Hello(0, 4242, [(0x10, "add", 5), (0x11, "mul", 0)]),
    jobs.Done(7, 0, "", 3, {}, jobs.Loaded(1, 2, 3, (1, 1, 64, 64, 1),
                                           jobs.ModuleSig(False, [jobs.TensorSig("x", (1, 3, 224, 224), "float32")]))),
    jobs.Done(8, 5, "boom\n" * 20, 4, {"oom_requested": 1 << 40, "error_line": 3}, None, b"\x01" * 40),
    jobs.Done(9, value=jobs.OpsLoaded([(0x3000, "op", 1)])),
    jobs.Done(10, value=jobs.WeightsLoaded(3, 99)),
    jobs.Deliver(2, b"\x02" * 64),
)]


def decoder_fuzz(count: int, seed: int = 1) -> dict:
    """Decode ``count`` mutated core->front records in this process: each must
    be refused with BadRecord or be a valid record that encodes to the same
    bytes (the format is canonical).  Anything else is counted in ``other``
    (an exception that is not BadRecord) or ``non_canonical``."""
    rng = random.Random(seed)
    out = {"inputs": count, "valid": 0, "bad": 0, "other": 0, "non_canonical": 0, "examples": []}
    for _ in range(count):
        data = mutate(rng, rng.choice(SEEDS), SEEDS)
        try:
            rec = jobs.decode(data, jobs.CORE_TO_FRONT)
        except jobs.BadRecord:
            out["bad"] += 1
            continue
        except Exception as e:  # noqa: BLE001 - what the fuzz is looking for
            out["other"] += 1
            if len(out["examples"]) < 5:
                out["examples"].append((data.hex(), repr(e)))
            continue
        if type(rec) not in jobs.CORE_TO_FRONT or jobs.encode(rec) != data:
            out["non_canonical"] += 1
            if len(out["examples"]) < 5:
                out["examples"].append((data.hex(), repr(rec)[:200]))
            continue
        out["valid"] += 1
    return out
