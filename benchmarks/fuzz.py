"""Long structure-aware fuzz run against a live simulated device.

    .venv/bin/python benchmarks/fuzz.py --messages 1000000 [--seed 1] [--workers 2] [--window 16]
    .venv/bin/python benchmarks/fuzz.py --messages 10000000 --seconds 3000 --expensive-share 0.01 \
        --fixture-every 50000 --reconnect-every 200000 --abuse-rounds 1000 --abuse-every 10   # the long run

Starts its own device (64 MiB window and DDR pool), opens an observer and a
second "victim" connection whose buffer / staging / KV addresses the fuzzer
forges, then runs ``--workers`` fuzz connections (one process each, seeds
seed..seed+workers-1, ``--window`` requests in flight on each) for
``--messages`` datagrams in total (or ``--seconds``), the kinds that cost
module loads held to ``--expensive-share`` of them, and beside them
one process of fd and memory abuse (``--abuse-rounds``, 0 for none): floods
of connections past the per-process share, buffers past the per-connection
limit, a window hog past its connection quota, PINGs and attaches carrying
up to 250 fds, connections abandoned with their buffers attached — every
answer checked, every refusal the expected status.  Prints and
writes benchmarks/results/fuzz.json: messages sent, responses by status,
malformed responses, hangs, crashes, core restarts, and the device's memory
figures (POOL_STATUS; fds and RSS of the front and of each core, cold, after
``--warmup`` messages and at the end).  Exit status 1 if
anything was wrong.  See docs/testing.md.

``--core-channel N`` fuzzes the other direction: a real front whose cores
are fakes that write N mutated records (tests/fuzz/core_channel.py).
"""
from __future__ import annotations

import argparse
import collections
import json
import multiprocessing as mp
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "src"))
sys.path.insert(0, os.path.join(ROOT, "tests"))  # the fuzzer finds its compiled examples through conftest

KEEP = ("carveout_used", "ddr_used", "connections", "modules", "op_count")


# The kinds whose messages cost module loads in the device (a forked probe,
# TVM deserialising: tens of ms each, against tens of µs for the rest): the
# loads themselves, and BUF_DETACH / DYN_UNLOAD, whose success on a fixture
# makes the fuzzer reopen its connection and reload its two modules.
EXPENSIVE = ("DYN_LOAD", "MODEL_LOAD", "OPS_LOAD", "BUF_DETACH", "DYN_UNLOAD")


def kind_weights(share: float | None) -> dict | None:
    """Weights giving the EXPENSIVE kinds ``share`` of the structured messages
    between them (each in its default proportion); None: the defaults."""
    from tests.fuzz import Fuzzer

    if share is None:
        return None
    counts = collections.Counter(Fuzzer.KINDS)
    exp = sum(counts[k] for k in EXPENSIVE)
    scale = share / (1 - share) * (len(Fuzzer.KINDS) - exp) / exp
    return {k: counts[k] * scale for k in EXPENSIVE}


def worker(path, modules, seed, count, foreign, front_pid, a, weights, stop_at, q):
    from tests.fuzz import Fuzzer

    fz = Fuzzer(path, modules, seed=seed, foreign=foreign, front_pid=front_pid, reset_every=a.reconnect_every,
                window=a.window, weights=weights, fixture_every=a.fixture_every)

    def progress(st):
        q.put(("progress", seed, st.sent))

    stats = fz.run(count, progress=(20000, progress), stop_at=stop_at)
    fz.close()
    q.put(("done", seed, stats.as_dict()))


def abuse(path, rounds, every, stop, q):
    """fd and memory abuse shapes, one round every ``every`` s (at most
    ``rounds``) until ``stop`` is set; report counts and problems."""
    import socket
    import struct

    from dspx.abi import protocol as P
    from dspx.errors import DeviceError
    from dspx.host.client import Client

    hdr = struct.Struct("<IIIi")
    st = collections.Counter()
    problems = []

    def expect(cond, what):
        if not cond:
            problems.append(what)

    def ping_raw(s, seq, fds=()):
        st["sent"] += 1
        try:
            if fds:
                socket.send_fds(s, [hdr.pack(P.MsgType.PING, seq, 16, 0)], fds)
            else:
                s.send(hdr.pack(P.MsgType.PING, seq, 16, 0))
            r = s.recv(64)
        except (ConnectionError, OSError):
            r = b""
        return hdr.unpack_from(r) if len(r) >= 16 else None

    devnull = [os.open(os.devnull, os.O_RDONLY) for _ in range(250)]
    for rnd in range(rounds):
        started = time.monotonic()
        if stop.is_set():
            break
        # 1. one process past its connection share: newcomers ERR_BUSY or closed, the rest served
        socks = []
        for _ in range(200):
            c = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
            c.connect(path)
            c.settimeout(30)
            socks.append(c)
        for i, c in enumerate(socks):
            h = ping_raw(c, i + 1)
            if h is None:
                st["conn_closed"] += 1
            elif h[3] == P.Status.ERR_BUSY:
                st["conn_refused_busy"] += 1
            else:
                expect(h[:4] == (0x1001, i + 1, 24, 0), f"round {rnd}: PING on connection {i}: {h}")
                st["conn_served"] += 1
        for c in socks:
            c.close()
        # 2. PING and BUF_ATTACH carrying 250 fds
        s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        s.connect(path)
        s.settimeout(30)
        h = ping_raw(s, 7, devnull)
        expect(h is not None and h[:4] == (0x1001, 7, 24, 0), f"round {rnd}: PING with 250 fds: {h}")
        socket.send_fds(s, [P.BufAttach(seq=8, size=4096).encode()], devnull)
        st["sent"] += 1
        r = s.recv(64)
        expect(hdr.unpack_from(r)[:4] == (0x1040, 8, 32, P.Status.ERR_INVALID), f"round {rnd}: attach, 250 fds")
        s.close()
        # 3. buffers past the per-connection limit, then a window hog past its quota
        with Client(path, staging_size=0, printf_size=0, timeout=60) as c:
            bufs = []
            try:
                for _ in range(200):
                    bufs.append(c.alloc(4096))
                    st["sent"] += 1
                problems.append(f"round {rnd}: 200 buffers attached")
            except DeviceError as e:
                st["sent"] += 1
                expect(e.status_name == "ERR_NOMEM" and "limit" in str(e), f"round {rnd}: buffers: {e}")
                st["bufs_refused"] += 1
            for b in bufs:
                c.detach(b)
                st["sent"] += 1
            big = []
            try:
                for _ in range(64):
                    big.append(c.alloc(4 << 20))
                    st["sent"] += 1
                problems.append(f"round {rnd}: 256 MiB attached by one connection")
            except DeviceError as e:
                st["sent"] += 1
                expect(e.status_name == "ERR_NOMEM", f"round {rnd}: hog: {e}")
                st["hog_refused"] += 1
            for b in big:
                c.detach(b)
                st["sent"] += 1
        # 4. connections abandoned with buffers attached (the device frees them)
        for _ in range(4):
            c = Client(path, staging_size=0, printf_size=0, timeout=60)
            for _ in range(32):
                c.alloc(4096)
                st["sent"] += 1
            c.ep.close()  # no detach: abandoned
            for b in c.bufs:
                b.close()
        st["rounds"] += 1
        q.put(("progress", -1, st["sent"]))
        stop.wait(max(0.0, every - (time.monotonic() - started)))
    for fd in devnull:
        os.close(fd)
    q.put(("done", -1, {"abuse": dict(st), "problems": problems}))


def merge(reports):
    out = {"sent": 0, "by_status": collections.Counter(), "by_type": collections.Counter(),
           "by_kind": collections.Counter(), "by_expectation": collections.Counter(), "malformed": 0,
           "unexpected": 0, "forged_addresses": 0, "fixture_hits": 0, "fixture_redirected": 0, "extra_responses": 0,
           "hangs": 0, "crashes": 0,
           "reconnects": 0, "fds_sent": 0, "max_latency_s": 0.0, "problems": [], "internal_errors": []}
    for r in reports:
        if "abuse" in r:
            out["abuse"] = r["abuse"]
            out["sent"] += r["abuse"].get("sent", 0)
            out["problems"] += r["problems"]
            continue
        for k in ("sent", "malformed", "unexpected", "extra_responses", "hangs", "crashes", "reconnects", "fds_sent",
                  "forged_addresses", "fixture_hits", "fixture_redirected"):
            out[k] += r[k]
        for k in ("by_status", "by_type", "by_kind", "by_expectation"):
            out[k].update(r[k])
        if r["max_latency_s"] >= out["max_latency_s"]:
            out["max_latency_s"], out["slowest_request"] = r["max_latency_s"], r.get("slowest_request", "")
        out["problems"] += r["problems"]
        out["internal_errors"] += r["internal_errors"]
    for k in ("by_status", "by_type", "by_kind", "by_expectation"):
        out[k] = dict(out[k].most_common())
    return out


def growth(a: dict, b: dict) -> dict:
    """Per process (front, each core): fds and RSS MiB at ``a`` -> at ``b``."""
    return {k: {"fds": [a[k]["fds"], b[k]["fds"]] if k in a else [None, b[k]["fds"]],
                "rss_mib": [round(a[k]["rss"] / 2**20, 1) if k in a else None, round(b[k]["rss"] / 2**20, 1)]}
            for k in b}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--messages", type=int, default=1_000_000)
    ap.add_argument("--seconds", type=float, default=None, help="stop the fuzz workers after this long (the "
                    "figures are then of what was sent)")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--window", type=int, default=16, help="requests in flight per fuzz connection")
    ap.add_argument("--expensive-share", type=float, default=0.02,
                    help=f"share of the structured messages of kinds {', '.join(EXPENSIVE)} (their default: "
                         "22%%; -1: the default)")
    ap.add_argument("--reconnect-every", type=int, default=20000, help="messages between a fuzz connection's "
                    "re-opens (each reloads its two modules)")
    ap.add_argument("--fixture-every", type=int, default=0, help="at most one detach / unload aimed at a fuzz "
                    "fixture (which costs a re-open or a module reload) per this many messages (0: no limit)")
    ap.add_argument("--job-timeout", type=float, default=10.0, help="the device's job time limit (s): a "
                    "fuzzed repeat count may ask for minutes of work, which queues the other worker's jobs")
    ap.add_argument("--warmup", type=int, default=100_000, help="messages before the warm fd / RSS figures")
    ap.add_argument("--abuse-rounds", type=int, default=20, help="rounds of fd and memory abuse at most (0: none)")
    ap.add_argument("--abuse-every", type=float, default=0.0, help="seconds between abuse rounds' starts")
    ap.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "results", "fuzz.json"))
    ap.add_argument("--core-channel", type=int, default=0, metavar="N",
                    help="fuzz the core->front channel instead: a real front whose fake cores write N mutated "
                         "records (tests/fuzz/core_channel.py); exit 1 on a hang, a crash or a front traceback")
    ap.add_argument("--decoder", type=int, default=0, metavar="N",
                    help="fuzz the front's decoder of core records in this process with N mutated records "
                         "(tests/fuzz/core_channel.py decoder_fuzz); exit 1 on anything but BadRecord or a "
                         "canonical record")
    a = ap.parse_args()
    if a.decoder:
        from tests.fuzz import core_channel
        t0 = time.monotonic()
        res = core_channel.decoder_fuzz(a.decoder, seed=a.seed)
        res["seconds"] = round(time.monotonic() - t0, 1)
        print(json.dumps(res, indent=1))
        os.makedirs(os.path.dirname(a.out), exist_ok=True)
        with open(a.out, "w") as f:
            json.dump(res, f, indent=1)
        return int(bool(res["other"] or res["non_canonical"]))
    if a.core_channel:
        from tests.fuzz import core_channel
        res = core_channel.run(a.core_channel, seed=a.seed)
        print(json.dumps(res, indent=1))
        return int(bool(res["hangs"] or res["front_died"] or res["tracebacks"] or not res.get("ping_after")))

    from dspx.host.client import Client
    from tests.conftest import SMALL, Device
    from tests.fuzz import compiled_example, device_footprint

    modules = {n: str(compiled_example(n)) for n in ("multi_input", "multi_output")}
    weights = kind_weights(None if a.expensive_share < 0 else a.expensive_share)
    dev = Device(*SMALL, "--job-timeout", str(a.job_timeout))
    t0 = time.monotonic()
    stop_at = t0 + a.seconds if a.seconds else None
    try:
        observer = Client(dev.path, staging_size=0, printf_size=0, timeout=30)
        victim = Client(dev.path, staging_size=1 << 20, kv_size=1 << 16, timeout=30)
        victim.alloc(4096)
        foreign = [(b.dsp_addr, b.size) for b in victim.bufs]
        foreign.append((victim.staging.dsp_addr + victim.staging.size - victim.kv_size, victim.kv_size))
        before, fp_before = observer.pools(), device_footprint(dev.proc.pid)
        fp_warm = None
        ctx = mp.get_context("fork")
        q, stop = ctx.Queue(), ctx.Event()
        per = a.messages // a.workers
        procs = [ctx.Process(target=worker, args=(dev.path, modules, a.seed + i,
                                                  per + (a.messages % a.workers if i == 0 else 0),
                                                  foreign, dev.proc.pid, a, weights, stop_at, q))
                 for i in range(a.workers)]
        if a.abuse_rounds:
            procs.append(ctx.Process(target=abuse, args=(dev.path, a.abuse_rounds, a.abuse_every, stop, q)))
        for p in procs:
            p.start()
        reports, sent = [], {}
        import queue
        fuzz_done = 0
        series = []  # (messages, s, front + cores fds, RSS) after warm-up
        while len(reports) < len(procs):
            try:
                kind, seed, payload = q.get(timeout=5)
            except queue.Empty:
                if not any(p.is_alive() for p in procs):  # a worker died without its report
                    raise RuntimeError("a fuzz worker ended without reporting (see its traceback above)")
                continue
            if kind == "progress":
                sent[seed] = payload
                el = time.monotonic() - t0
                total = sum(sent.values())
                fp = device_footprint(dev.proc.pid)
                if fp_warm is None and total >= a.warmup:
                    fp_warm, warm_at = fp, total
                if fp_warm is not None:  # RSS after warm-up, sampled along the run
                    series.append((total, round(el, 1), fp["fds"], fp["rss"]))
                print(f"  {total:>11,} messages  {el:7.1f} s  {total / el:7.0f}/s  front+cores fds {fp['fds']:4}  "
                      f"RSS {fp['rss'] / 2**20:6.1f} MiB", flush=True)
            else:
                reports.append(payload)
                if seed >= 0:
                    fuzz_done += 1
                    if fuzz_done == a.workers:
                        stop.set()  # the abuse process ends with its round
        for p in procs:
            p.join()
        elapsed = time.monotonic() - t0
        time.sleep(0.5)
        ping = observer.ping()
        after, fp_after = observer.pools(), device_footprint(dev.proc.pid)
        if fp_warm is None:
            fp_warm, warm_at = fp_before, 0
        victim_ok = victim.ping()["version"] == "3.0.0"
        res = merge(reports)
        res.update(elapsed_s=round(elapsed, 1), msgs_per_s=round(res["sent"] / elapsed), workers=a.workers,
                   window=a.window, expensive_share=a.expensive_share, kind_weights=weights,
                   seed=a.seed, device_alive=dev.alive(), ping_after=ping["version"], victim_ok=victim_ok,
                   pools_before={k: before[k] for k in KEEP + ("rss_bytes",)},
                   pools_after={k: after[k] for k in KEEP + ("rss_bytes",)},
                   fds_front_before=fp_before["fds_front"], fds_front_after=fp_after["fds_front"],
                   fds_device_before=fp_before["fds"], fds_device_warm=fp_warm["fds"], fds_device_after=fp_after["fds"],
                   rss_device_before=fp_before["rss"], rss_device_warm=fp_warm["rss"], rss_device_after=fp_after["rss"],
                   warm_at_messages=warm_at, per_process_warm_to_end=growth(fp_warm["procs"], fp_after["procs"]),
                   per_process_cold=fp_before["procs"],
                   rss_device_max_after_warm=max([r for *_, r in series] + [fp_after["rss"]]),
                   series=series[::max(1, len(series) // 300)],
                   core_restarts=len(set(fp_after["cores"]) - set(fp_before["cores"])),
                   load_avg=os.getloadavg(), device_log_tail=dev.output()[-2000:])
        victim.close()
        observer.close()
    finally:
        dev.stop()
    ok = (res["malformed"] == res["extra_responses"] == res["hangs"] == res["crashes"] == 0 and res["device_alive"]
          and not res["problems"] and res.get("unexpected", 0) == 0
          and all(res["pools_before"][k] == res["pools_after"][k] for k in KEEP)
          and res["fds_front_before"] == res["fds_front_after"] and res["fds_device_before"] == res["fds_device_after"]
          and res["core_restarts"] == 0)
    res["ok"] = ok
    os.makedirs(os.path.dirname(a.out), exist_ok=True)
    with open(a.out, "w") as f:
        json.dump(res, f, indent=1)
    print(f"\nfuzz: {res['sent']:,} messages in {res['elapsed_s']} s ({res['msgs_per_s']}/s), "
          f"{a.workers} worker(s) x window {a.window}, seed {a.seed}, load average {os.getloadavg()[0]:.1f}")
    print(f"  {'status':<14}{'responses':>12}")
    for k, v in res["by_status"].items():
        print(f"  {k:<14}{v:>12,}")
    print(f"  malformed {res['malformed']}  unexpected {res.get('unexpected', 0)}  extra {res['extra_responses']}  "
          f"hangs {res['hangs']}  crashes {res['crashes']}  core restarts {res['core_restarts']}  "
          f"reconnects {res['reconnects']}  fixture hits / redirected {res['fixture_hits']} / "
          f"{res['fixture_redirected']}  fds sent {res['fds_sent']}  max latency {res['max_latency_s']} s")
    print(f"  pools before {res['pools_before']}\n  pools after  {res['pools_after']}")
    if "abuse" in res:
        print(f"  abuse: {res['abuse']}")
    print(f"  front fds {res['fds_front_before']} -> {res['fds_front_after']}; front + cores fds cold "
          f"{res['fds_device_before']}, warm {res['fds_device_warm']}, end {res['fds_device_after']}; "
          f"RSS front + cores cold {res['rss_device_before'] / 2**20:.1f}, warm {res['rss_device_warm'] / 2**20:.1f}, "
          f"end {res['rss_device_after'] / 2**20:.1f} MiB; PING after: {res['ping_after']}")
    print(f"  RSS front + cores, highest sampled after warm-up: {res['rss_device_max_after_warm'] / 2**20:.1f} MiB")
    print(f"  warm (after {res['warm_at_messages']:,} messages) -> end, per process:")
    for k, v in res["per_process_warm_to_end"].items():
        print(f"    {k:<12} fds {v['fds'][0]} -> {v['fds'][1]}   RSS {v['rss_mib'][0]} -> {v['rss_mib'][1]} MiB")
    for p in res["problems"][:10]:
        print("  problem:", p)
    for p in res["internal_errors"][:10]:
        print("  ERR_GENERIC:", p[:300])
    print("OK" if ok else "FAILED", "->", a.out)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
