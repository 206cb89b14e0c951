"""Round-trip latency, one run, side by side:

  (a) dspx client PING to the simulated device (full protocol, both sides)
  (b) a bare Python SEQPACKET ping-pong between two processes (the floor)
  (c) multiprocessing.Pipe between two processes

and the C host library (libdspx), measured by one C program that alternates
them per round trip so machine noise falls on both alike:

  (d) libdspx C client PING (c7x_client_ping) to the same device as (a)
  (e) a bare C SEQPACKET ping-pong with that device: the same 16-byte PING,
      send() + recv() on a socket of its own, no library (the floor for (d))
  (f) a bare C SEQPACKET ping-pong between two C processes (echo)

Prints a table (median, p99 in µs) and writes benchmarks/results/ping.json.
Goals: (a) ≤ 1.5 × (b); (d) ≤ 1.3 × (e).
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


C_PING = r"""
/* (d) c7x_client_ping and (e) a bare PING on a socket of its own, alternating;
 * or (f) with argv[1] == "echo": a bare ping-pong with a forked C echo. */
#define _GNU_SOURCE
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "c7x_client.h"

static long long ns(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (long long)t.tv_sec * 1000000000LL + t.tv_nsec;
}

static int bare(int fd, uint32_t seq) {
    uint32_t msg[4] = {DSPX_MSG_PING, seq, 16, 0};
    unsigned char buf[DSPX_WIRE_MAX_MSG + 1];
    return send(fd, msg, 16, 0) == 16 && recv(fd, buf, sizeof buf, 0) >= 16 ? 0 : -1;
}

int main(int argc, char **argv) {
    int n = argc > 2 ? atoi(argv[2]) : 1000;
    if (argc > 1 && !strcmp(argv[1], "echo")) {
        int sv[2];
        if (socketpair(AF_UNIX, SOCK_SEQPACKET, 0, sv)) return 1;
        pid_t child = fork();
        if (child == 0) {
            close(sv[0]);
            unsigned char buf[DSPX_WIRE_MAX_MSG + 1];
            for (;;) {
                ssize_t k = recv(sv[1], buf, sizeof buf, 0);
                if (k <= 0) _exit(0);
                send(sv[1], buf, (size_t)k, 0);
            }
        }
        close(sv[1]);
        for (int i = 0; i < 200 + n; i++) {
            long long t0 = ns();
            if (bare(sv[0], (uint32_t)i + 1)) return 2;
            if (i >= 200) printf("%lld\n", ns() - t0);
        }
        close(sv[0]);
        waitpid(child, NULL, 0);
        return 0;
    }
    c7x_client_opts_t o = C7X_CLIENT_OPTS_INIT;
    o.printf_size = 0;
    c7x_client_t *c = NULL;
    if (c7x_client_open_ex(&c, &o)) {
        fprintf(stderr, "%s\n", c7x_client_open_error());
        return 3;
    }
    int fd = socket(AF_UNIX, SOCK_SEQPACKET, 0);
    struct sockaddr_un sa;
    memset(&sa, 0, sizeof sa);
    sa.sun_family = AF_UNIX;
    snprintf(sa.sun_path, sizeof sa.sun_path, "%s", getenv("DSPX_SOCKET"));
    if (connect(fd, (struct sockaddr *)&sa, sizeof sa)) return 1;
    uint32_t v;
    for (int i = 0; i < 200 + n; i++) {
        long long t0 = ns();
        if (bare(fd, (uint32_t)i + 1)) return 2;
        long long t1 = ns();
        if (c7x_client_ping(c, &v, NULL)) return 4;
        long long t2 = ns();
        if (i >= 200) printf("%lld %lld\n", t2 - t1, t1 - t0);
    }
    c7x_client_close(c);
    close(fd);
    return 0;
}
"""


def bench_c(n):
    """{(d), (e), (f)} samples from the C program, or a reason it could not run."""
    import subprocess
    import tempfile

    from dspx.sdk import libdspx

    with tempfile.TemporaryDirectory(prefix="dspx-cping-") as tmp:
        src = os.path.join(tmp, "cping.c")
        with open(src, "w") as f:
            f.write(C_PING)
        exe = libdspx.compile_program([src], os.path.join(tmp, "cping"))
        with dspx.Client(staging_size=0, printf_size=0) as c:  # the device (a) used: private unless one runs
            env = {**os.environ, "DSPX_SOCKET": c.socket_path}
            out = subprocess.run([str(exe), "device", str(n)], capture_output=True, text=True, env=env,
                                 timeout=600, check=True).stdout
        pairs = [line.split() for line in out.splitlines()]
        echo = subprocess.run([str(exe), "echo", str(n)], capture_output=True, text=True, timeout=600,
                              check=True).stdout
    return ([int(a) for a, _ in pairs], [int(b) for _, b in pairs], [int(x) for x in echo.split()])


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("-n", type=int, default=20000)
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results", "ping.json"))
    ap.add_argument("--plot", action="store_true", help="also write ping.png: the latency distributions (plot extra)")
    a = ap.parse_args()
    samples = {"dspx client PING": bench_dspx(a.n), "bare SEQPACKET ping-pong": bench_seqpacket(a.n),
               "multiprocessing.Pipe": bench_pipe(a.n)}
    rows = {k: stats(v) for k, v in samples.items()}
    floor = rows["bare SEQPACKET ping-pong"]["median_us"]
    print(f"{'path':28} {'median µs':>10} {'p99 µs':>10} {'÷ SEQPACKET':>12}")
    for name, r in rows.items():
        r["ratio_to_seqpacket"] = round(r["median_us"] / floor, 3)
        print(f"{name:28} {r['median_us']:10.1f} {r['p99_us']:10.1f} {r['ratio_to_seqpacket']:12.2f}")
    goal = rows["dspx client PING"]["ratio_to_seqpacket"] <= 1.5
    print(f"goal dspx ≤ 1.5 × SEQPACKET: {'met' if goal else 'NOT met'}")

    c_rows, c_goal = {}, None
    try:
        d, e, f = bench_c(a.n)
    except Exception as ex:  # no compiler, build failure: the Python rows still stand
        print(f"C rows skipped: {ex}")
    else:
        samples.update({"C client PING (libdspx)": d, "bare C PING to the device": e, "bare C ping-pong (C echo)": f})
        c_rows = {k: stats(samples[k]) for k in ("C client PING (libdspx)", "bare C PING to the device",
                                                 "bare C ping-pong (C echo)")}
        c_floor = c_rows["bare C PING to the device"]["median_us"]
        print(f"\n{'C path':28} {'median µs':>10} {'p99 µs':>10} {'÷ bare C':>12}")
        for name, r in c_rows.items():
            r["ratio_to_bare_c"] = round(r["median_us"] / c_floor, 3)
            print(f"{name:28} {r['median_us']:10.1f} {r['p99_us']:10.1f} {r['ratio_to_bare_c']:12.2f}")
        c_goal = c_rows["C client PING (libdspx)"]["ratio_to_bare_c"] <= 1.3
        print(f"goal C client ≤ 1.3 × bare C PING to the same device: {'met' if c_goal else 'NOT met'}")
        rows.update(c_rows)
    os.makedirs(os.path.dirname(a.out), exist_ok=True)
    with open(a.out, "w") as f:
        json.dump({"n": a.n, "results": rows, "goal_met": goal, "c_goal_met": c_goal, "cpus": os.cpu_count()}, f,
                  indent=2)
    print(f"wrote {a.out}")
    if a.plot:
        import plots
        base = {k: ("bare C PING to the device" if k.startswith(("C client", "bare C")) else "bare SEQPACKET ping-pong")
                for k in samples}
        print("wrote", plots.latency({k: [x / 1e9 for x in v] for k, v in samples.items()},
                                     os.path.splitext(a.out)[0] + ".png",
                                     f"PING round trip, {a.n} calls each, against the bare socket baselines",
                                     baseline=base.get))


if __name__ == "__main__":
    main()
