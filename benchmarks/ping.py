"""Round-trip latency, one run, side by side:

  (a) dspx client PING to the simulated device (full protocol, both sides)
  (b) a bare Python SEQPACKET ping-pong between two processes (the floor)
  (c) multiprocessing.Pipe between two processes

Prints a table (median, p99 in µs) and writes benchmarks/results/ping.json.
Goal: (a) ≤ 1.5 × (b).
"""
from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import socket
import statistics
import time

import dspx


def stats(samples_ns):
    s = sorted(samples_ns)
    us = [x / 1000 for x in s]
    return {"median_us": round(statistics.median(us), 2), "p99_us": round(us[int(0.99 * (len(us) - 1))], 2),
            "min_us": round(us[0], 2), "n": len(us)}


def bench_dspx(n):
    with dspx.Client(staging_size=0, printf_size=0) as c:
        from dspx.abi import protocol as P
        for _ in range(200):
            c.request(P.Ping())
        out = []
        for _ in range(n):
            t0 = time.perf_counter_ns()
            c.request(P.Ping())
            out.append(time.perf_counter_ns() - t0)
    return out


def _echo_seqpacket(sock, other):
    other.close()  # the fork inherited the parent's end; EOF needs it closed
    while True:
        d = sock.recv(512)
        if not d:
            return
        sock.send(d)


def bench_seqpacket(n):
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    p = mp.get_context("fork").Process(target=_echo_seqpacket, args=(b, a))
    p.start()
    b.close()
    msg = bytes(16)
    for _ in range(200):
        a.send(msg)
        a.recv(512)
    out = []
    for _ in range(n):
        t0 = time.perf_counter_ns()
        a.send(msg)
        a.recv(512)
        out.append(time.perf_counter_ns() - t0)
    a.close()
    p.join()
    return out


def _echo_pipe(conn, other):
    other.close()
    while True:
        try:
            conn.send_bytes(conn.recv_bytes())
        except EOFError:
            return


def bench_pipe(n):
    a, b = mp.get_context("fork").Pipe()
    p = mp.get_context("fork").Process(target=_echo_pipe, args=(b, a))
    p.start()
    b.close()
    msg = bytes(16)
    for _ in range(200):
        a.send_bytes(msg)
        a.recv_bytes()
    out = []
    for _ in range(n):
        t0 = time.perf_counter_ns()
        a.send_bytes(msg)
        a.recv_bytes()
        out.append(time.perf_counter_ns() - t0)
    a.close()
    p.join()
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("-n", type=int, default=20000)
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results", "ping.json"))
    a = ap.parse_args()
    rows = {"dspx client PING": stats(bench_dspx(a.n)),
            "bare SEQPACKET ping-pong": stats(bench_seqpacket(a.n)),
            "multiprocessing.Pipe": stats(bench_pipe(a.n))}
    floor = rows["bare SEQPACKET ping-pong"]["median_us"]
    print(f"{'path':28} {'median µs':>10} {'p99 µs':>10} {'÷ SEQPACKET':>12}")
    for name, r in rows.items():
        r["ratio_to_seqpacket"] = round(r["median_us"] / floor, 3)
        print(f"{name:28} {r['median_us']:10.1f} {r['p99_us']:10.1f} {r['ratio_to_seqpacket']:12.2f}")
    goal = rows["dspx client PING"]["ratio_to_seqpacket"] <= 1.5
    print(f"goal dspx ≤ 1.5 × SEQPACKET: {'met' if goal else 'NOT met'}")
    os.makedirs(os.path.dirname(a.out), exist_ok=True)
    with open(a.out, "w") as f:
        json.dump({"n": a.n, "results": rows, "goal_met": goal, "cpus": os.cpu_count()}, f, indent=2)
    print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
