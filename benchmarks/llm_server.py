"""Aggregate decode throughput of `dspx serve-llm` with parallel KV slots.

    .venv/bin/python benchmarks/llm_server.py [--rounds 3] [--max-tokens 64] [--kv-dtype float16] [--decode serial]

Starts two devices and two `dspx serve-llm` servers on them, one with
`--parallel 1` and one with `--parallel 4` (same compiled package), then in
each of --rounds rounds drives each server in turn with 1, 2 and 4
concurrent chat clients (greedy, `max_tokens` each, client i always sends
prompt i).  A measurement is the wall time from the first request to the last
answer; aggregate tok/s = completion tokens of all clients / that time.
Ratios are paired per round (against the same round's `--parallel 1` with 1
client, and with as many clients) and the table shows their medians; the
goal is 4 clients on 4 slots >= 2.5x.  By default (--decode auto) each server
runs as a user gets it: the one-slot server's decode and the four-slot
server's batched step each on the module its load-time timing chose (one
thread or two; `/props` says which, and the JSON records it); --decode
serial or parallel forces both (`DSPX_LLM_DECODE`).

Before the rounds, each server answers every prompt alone (one client): every
answer of a round must equal that server's alone-answer for its prompt (the
greedy text, i.e. the same tokens), and where both servers decode a lone row
on the same module the two servers' alone-answers must be equal too (the
parallel decode sums attention in another order).  A mismatch is listed and
the exit status is 1.

Prints a table and writes benchmarks/results/llm_server.json.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "src"))

from _results import write_json  # noqa: E402

PROMPTS = ["Write a short story about a lighthouse keeper.",
           "Explain how a bicycle works, step by step.",
           "Describe a walk through a forest in autumn.",
           "Write a letter to a friend about learning to cook."]
CLIENTS = (1, 2, 4)
SLOTS = (1, 4)
START_TIMEOUT = 600.0  # seconds for a server to compile (first time) and load


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """A device and `dspx serve-llm --parallel N` on it, as subprocesses."""

    def __init__(self, parallel: int, kv_dtype: str, context: int, workdir: str, decode: str):
        from dspx.transport import is_listening

        env = dict(os.environ, PYTHONPATH=os.path.join(ROOT, "src"), DSPX_LLM_DECODE=decode)
        self.parallel, self.port = parallel, _free_port()
        self.sock = os.path.join(workdir, f"dev{parallel}.sock")
        self.log = open(os.path.join(workdir, f"server{parallel}.log"), "w+b")
        self.device = subprocess.Popen([sys.executable, "-m", "dspx.device", "--socket", self.sock],
                                       stdout=self.log, stderr=self.log, env=env)
        deadline = time.monotonic() + START_TIMEOUT
        while not is_listening(self.sock):
            self._check(deadline)
        self.server = subprocess.Popen(
            [sys.executable, "-m", "dspx.cli", "serve-llm", "--port", str(self.port), "--socket", self.sock,
             "--kv-dtype", kv_dtype, "--context", str(context), "--parallel", str(parallel)],
            stdout=self.log, stderr=self.log, env=env)
        while True:
            self._check(deadline)
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/health", timeout=5) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass

    def _check(self, deadline: float) -> None:
        for p in (self.device, getattr(self, "server", None)):
            if p is not None and p.poll() is not None:
                raise SystemExit(f"server --parallel {self.parallel} exited:\n{self.output()}")
        if time.monotonic() > deadline:
            raise SystemExit(f"server --parallel {self.parallel} did not start in {START_TIMEOUT:.0f} s:\n"
                             f"{self.output()}")
        time.sleep(0.2)

    def output(self) -> str:
        self.log.flush()
        self.log.seek(0)
        return self.log.read().decode(errors="replace")[-4000:]

    def chat(self, prompt: str, max_tokens: int) -> dict:
        body = json.dumps({"model": "smollm2", "messages": [{"role": "user", "content": prompt}],
                           "temperature": 0, "max_tokens": max_tokens}).encode()
        req = urllib.request.Request(f"http://127.0.0.1:{self.port}/v1/chat/completions", body,
                                     {"content-type": "application/json"})
        with urllib.request.urlopen(req, timeout=600) as r:
            out = json.loads(r.read())
        return {"text": out["choices"][0]["message"]["content"], "tokens": out["usage"]["completion_tokens"]}

    def props(self) -> dict:
        with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/props", timeout=30) as r:
            return json.loads(r.read())["dspx"]

    def stop(self) -> None:
        for p in (self.server, self.device):
            if p.poll() is None:
                p.terminate()
                try:
                    p.wait(30)
                except subprocess.TimeoutExpired:
                    p.kill()
        self.log.close()


def concurrent_round(server: Server, clients: int, max_tokens: int) -> tuple[float, list[dict]]:
    """``clients`` chats at once (client i sends prompt i); (wall seconds, answers)."""
    answers: list = [None] * clients
    errors: list = []

    def one(i):
        try:
            answers[i] = server.chat(PROMPTS[i], max_tokens)
        except Exception as e:  # noqa: BLE001 - reported after the round
            errors.append(f"client {i}: {type(e).__name__}: {e}")
    threads = [threading.Thread(target=one, args=(i,)) for i in range(clients)]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join(900)
    wall = time.perf_counter() - t0
    if errors or any(a is None for a in answers):
        raise SystemExit(f"--parallel {server.parallel}, {clients} clients: " + "; ".join(errors or ["timed out"]))
    return wall, answers


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=64, help="completion tokens per client (greedy)")
    ap.add_argument("--kv-dtype", default="float16", choices=["float32", "float16", "int8"],
                    help="float16: 512 tokens, 128 per slot with 4 slots")
    ap.add_argument("--decode", default="auto", choices=["serial", "parallel", "auto"],
                    help="the decode and batched-step modules of both servers (DSPX_LLM_DECODE)")
    a = ap.parse_args()
    from dspx.abi.llmpack import DEFAULT_CONTEXT

    context = DEFAULT_CONTEXT[a.kv_dtype]
    work = tempfile.mkdtemp(prefix="dspx-llm-server-")
    servers = {}
    try:
        for n in SLOTS:  # one after the other: the first compiles the package into the cache
            servers[n] = Server(n, a.kv_dtype, context, work, a.decode)
        chosen = {n: servers[n].props() for n in SLOTS}
        for n in SLOTS:
            print(f"--parallel {n}: {chosen[n]}", file=sys.stderr)
        alone = {n: [servers[n].chat(p, a.max_tokens) for p in PROMPTS] for n in SLOTS}
        # a lone row runs the serial decode with slots; the one-slot server's may be the parallel one
        same_decode = chosen[1]["decode"] == chosen[4]["decode"]
        mismatches = [f"prompt {i}: --parallel 1 and 4 answer differently alone"
                      for i in range(len(PROMPTS)) if same_decode and alone[1][i]["text"] != alone[4][i]["text"]]
        tok_s: dict = {(n, c): [] for n in SLOTS for c in CLIENTS}
        for rnd in range(a.rounds):
            for n in SLOTS:
                for c in CLIENTS:
                    wall, answers = concurrent_round(servers[n], c, a.max_tokens)
                    tok_s[n, c].append(sum(x["tokens"] for x in answers) / wall)
                    mismatches += [f"round {rnd}, --parallel {n}, {c} clients: client {i}'s answer differs "
                                   f"from its alone-answer" for i, x in enumerate(answers)
                                   if x["text"] != alone[n][i]["text"]]
            print(f"round {rnd + 1}/{a.rounds}: " + ", ".join(f"p{n}/{c}c {tok_s[n, c][-1]:.1f}"
                                                              for n in SLOTS for c in CLIENTS), file=sys.stderr)
    finally:
        for s in servers.values():
            s.stop()
        shutil.rmtree(work, ignore_errors=True)
    base = tok_s[1, 1]
    rows = []
    print(f"\nserve-llm aggregate decode throughput, SmolLM2-135M, {a.kv_dtype} KV (context {context}; "
          f"{context // 4} tokens per slot with 4), {a.max_tokens} greedy tokens per client, {a.rounds} rounds, "
          f"--decode {a.decode}: 1 slot decodes on the {chosen[1]['decode']} module, 4 slots batch on the "
          f"{chosen[4]['batch']} one; load {os.getloadavg()[0]:.2f}")
    print(f"{'slots':>5s} {'clients':>7s} {'tok/s (median)':>15s} {'min-max':>13s} {'x 1 slot 1 client':>18s} "
          f"{'x 1 slot same clients':>22s}")
    for n in SLOTS:
        for c in CLIENTS:
            v = tok_s[n, c]
            ratio = statistics.median(x / b for x, b in zip(v, base))
            same = statistics.median(x / b for x, b in zip(v, tok_s[1, c]))
            rows.append({"slots": n, "clients": c, "tok_s": [round(x, 2) for x in v],
                         "tok_s_median": round(statistics.median(v), 2), "ratio_median": round(ratio, 3),
                         "ratio_same_clients_median": round(same, 3)})
            print(f"{n:5d} {c:7d} {statistics.median(v):15.1f} {min(v):6.1f}-{max(v):<6.1f} {ratio:18.2f} "
                  f"{same:22.2f}")
    goal = next(r["ratio_median"] for r in rows if r["slots"] == 4 and r["clients"] == 4)
    print(f"\n4 clients on 4 slots / 1 client on 1 slot: {goal:.2f}x (goal 2.5x); greedy answers equal "
          f"their alone-answers: {'yes' if not mismatches else 'NO'}")
    for m in mismatches:
        print("  " + m)
    path = write_json("llm_server.json", {
        "kv_dtype": a.kv_dtype, "decode": a.decode, "context": context, "max_tokens": a.max_tokens, "rounds": a.rounds,
        "load_avg_end": os.getloadavg(), "chosen": {str(n): chosen[n] for n in SLOTS}, "rows": rows, "goal_ratio": goal, "answers_equal": not mismatches,
        "mismatches": mismatches, "alone_answers": {str(n): [x["text"] for x in alone[n]] for n in SLOTS}})
    print(f"wrote {path}")
    return 1 if mismatches else 0


if __name__ == "__main__":
    sys.exit(main())
