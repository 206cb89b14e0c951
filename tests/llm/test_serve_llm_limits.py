"""serve-llm's limits, over real sockets to the real server on 127.0.0.1 (issue 31, finding 7): a body
over the limit gets 413 without being held (RSS does not grow by it); tokenization runs off the event
loop (/health answers meanwhile); slow headers, idle connections and stalled bodies are dropped; past
the connection cap new connections are shed and old ones kept; non-finite numbers, bad seeds and deep
JSON get OpenAI-shaped 400s; a non-streaming request whose client went away stops generating."""
from __future__ import annotations

import contextlib
import http.client
import json
import select
import socket
import sys
import threading
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
from test_serve_llm import _Server, service  # noqa: E402,F401 - the device and model fixture

psutil = pytest.importorskip("psutil")
MiB = 1 << 20


@contextlib.contextmanager
def _serving(service, **limits):
    from dspx.host.serve_llm import Limits, create_app

    lim = Limits(**limits)
    s = _Server(create_app(service, limits=lim), lim)
    try:
        yield s
    finally:
        s.stop()


def _post(port: int, path: str, raw: bytes | str, guard: float = 120) -> tuple[int, dict]:
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=guard)
    try:
        c.request("POST", path, body=raw.encode() if isinstance(raw, str) else raw,
                  headers={"content-type": "application/json"})
        r = c.getresponse()
        return r.status, json.loads(r.read())
    finally:
        c.close()


def _get(port: int, path: str, guard: float = 30) -> tuple[int, dict]:
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=guard)
    try:
        c.request("GET", path)
        r = c.getresponse()
        return r.status, json.loads(r.read())
    finally:
        c.close()


def _read_response(s: socket.socket, guard: float = 60) -> tuple[int, dict, bytes]:
    """One HTTP/1.1 response with a content-length, read off a raw socket."""
    s.settimeout(guard)
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = s.recv(65536)
        assert chunk, f"closed before a response: {data!r}"
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    headers = {k.strip().lower(): v.strip() for k, v in (line.split(":", 1) for line in lines[1:])}
    while len(body) < int(headers["content-length"]):
        chunk = s.recv(65536)
        assert chunk, "closed mid-body"
        body += chunk
    return int(lines[0].split()[1]), headers, body


def _closed_by_server(s: socket.socket, guard: float) -> bool:
    """True when the server closes s (EOF or reset) within guard seconds; what it sent first is ignored."""
    s.settimeout(guard)
    try:
        while s.recv(65536):
            pass
    except ConnectionResetError:
        pass
    except socket.timeout:
        return False
    return True


def _error(message, type_="invalid_request_error", param=None, code=None) -> dict:
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


def test_a_body_over_the_limit_gets_413_and_is_never_held(service):
    with _serving(service, max_body=MiB) as srv:
        # announced too large: refused on the headers, before any body byte
        with socket.create_connection(("127.0.0.1", srv.port), timeout=30) as s:
            s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                      b"Content-Length: 209715200\r\n\r\n")
            status, headers, body = _read_response(s)
        assert status == 413 and headers["connection"] == "close"
        assert json.loads(body) == _error("the request body is 209715200 bytes; this server takes at most "
                                          "1048576 (--max-body)", code="request_too_large")

        # 200 MiB chunked (no length to refuse on): answered once 1 MiB has passed; RSS must not grow by it
        proc, peak, sampling = psutil.Process(), [0], threading.Event()

        def sample():
            while not sampling.is_set():
                peak[0] = max(peak[0], proc.memory_info().rss)
                time.sleep(0.005)
        base = proc.memory_info().rss
        sampler = threading.Thread(target=sample, daemon=True)
        sampler.start()
        block = memoryview(b"x" * MiB)
        sent = 0
        try:
            with socket.create_connection(("127.0.0.1", srv.port), timeout=60) as s:
                s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                          b"Transfer-Encoding: chunked\r\n\r\n")
                with contextlib.suppress(BrokenPipeError, ConnectionResetError):
                    while sent < 200 * MiB and not select.select([s], [], [], 0)[0]:
                        s.sendall(b"%x\r\n" % len(block) + block + b"\r\n")
                        sent += len(block)
                    if sent == 200 * MiB:  # all of it went in: end the body (a server that took it answers)
                        s.sendall(b"0\r\n\r\n")
                status, headers, body = _read_response(s)
        finally:
            sampling.set()
            sampler.join(10)
        assert peak[0] - base < 64 * MiB, f"RSS grew by {(peak[0] - base) / MiB:.0f} MiB for a 200 MiB body"
        assert status == 413 and sent < 200 * MiB
        assert json.loads(body) == _error("the request body is more than 1048576 bytes; this server takes at "
                                          "most 1048576 (--max-body)", code="request_too_large")

        # just under the limit is served
        padded = json.dumps({"prompt": "Hi", "max_tokens": 1}).replace(",", "," + " " * (MiB - 100), 1)
        assert MiB - 100 < len(padded) <= MiB
        status, got = _post(srv.port, "/v1/completions", padded)
        assert status == 200 and got["usage"]["completion_tokens"] == 1


def test_health_answers_while_a_huge_prompt_is_tokenized(service):
    """The prompt's tokenization waits (hang guard 60 s) until /health has answered: done on the event loop,
    /health could not answer first and the GET fails on its 30 s guard."""
    entered, health_answered, got = threading.Event(), threading.Event(), {}
    real_encode = service.encode

    def encode(prompt, chat):
        entered.set()
        health_answered.wait(60)
        return real_encode(prompt, chat)
    prompt = " ".join(["word"] * 800_000)  # 4 MB: "word", then " word" 799,999 times, one token each
    with _serving(service, max_body=16 * MiB) as srv:
        service.encode = encode
        try:
            t = threading.Thread(target=lambda: got.update(r=_post(srv.port, "/v1/completions",
                                                                   json.dumps({"prompt": prompt}), guard=300)))
            t.start()
            assert entered.wait(60), "the request never reached tokenization"
            assert _get(srv.port, "/health", guard=30)[0] == 200
            health_answered.set()
            t.join(300)
        finally:
            health_answered.set()
            del service.encode
    status, body = got["r"]
    assert status == 400 and body["error"]["code"] == "context_length_exceeded"
    assert body["error"]["message"] == (f"the prompt is {800_000} tokens; this model's context holds "
                                        f"{service.gen.context} (prompt + answer)")


def test_slow_headers_are_dropped_after_the_header_timeout(service):
    with _serving(service, header_timeout=1.0, idle_timeout=60) as srv:
        # slowloris: a header line every 0.2 s; the idle timeout never fires, the 1 s header timeout must
        with socket.create_connection(("127.0.0.1", srv.port), timeout=30) as s:
            s.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n")
            closed = False
            for i in range(150):  # 30 s hang guard
                try:
                    s.sendall(b"X-Slow-%d: y\r\n" % i)
                except (BrokenPipeError, ConnectionResetError):
                    closed = True
                    break
                if select.select([s], [], [], 0.2)[0]:
                    closed = _closed_by_server(s, 5)
                    break
            assert closed, "a connection dripping headers for 30 s was never closed"
        assert _get(srv.port, "/health")[0] == 200  # everyone else is still served


def test_idle_connections_and_stalled_bodies_are_dropped_after_the_idle_timeout(service):
    with _serving(service, header_timeout=60, idle_timeout=1.0) as srv:
        # silent after a response (keep-alive)
        with socket.create_connection(("127.0.0.1", srv.port), timeout=30) as s:
            s.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
            assert _read_response(s)[0] == 200
            assert _closed_by_server(s, 30)
        # a body that stops arriving: 408
        with socket.create_connection(("127.0.0.1", srv.port), timeout=30) as s:
            s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n{\"prompt\": ")
            status, headers, body = _read_response(s, guard=30)
            assert status == 408 and headers["connection"] == "close"
            assert json.loads(body) == _error("no request body bytes for 1.0 s (--idle-timeout)",
                                              code="request_timeout")
        assert _get(srv.port, "/health")[0] == 200


def test_past_the_connection_cap_new_connections_are_shed_and_old_ones_kept(service):
    with _serving(service, max_connections=3, header_timeout=60) as srv:
        old = [socket.create_connection(("127.0.0.1", srv.port), timeout=30) for _ in range(3)]
        try:
            for s in old:
                s.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n")  # open, headers not finished
            deadline = time.monotonic() + 30  # all three accepted before the fourth arrives
            while len(srv.server.server_state.connections) < 3:
                assert time.monotonic() < deadline, "the server did not accept three connections"
                time.sleep(0.01)
            with socket.create_connection(("127.0.0.1", srv.port), timeout=30) as s:
                with contextlib.suppress(BrokenPipeError, ConnectionResetError):
                    s.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
                status, headers, body = _read_response(s)
                assert status == 503 and headers["connection"] == "close"
                assert json.loads(body) == _error("server busy: 3 connections are open (--max-connections); "
                                                  "retry later", "server_error", code="server_busy")
                assert _closed_by_server(s, 30)
            for s in old:  # the three old ones finish their requests and are answered
                s.sendall(b"Connection: close\r\n\r\n")
                status, _, body = _read_response(s)
                assert status == 200 and json.loads(body)["status"] == "ok"
        finally:
            for s in old:
                s.close()
        for _ in range(100):  # once they are gone, new connections are served again (5 s hang guard)
            with contextlib.suppress(ConnectionError):
                if _get(srv.port, "/health")[0] == 200:
                    break
            time.sleep(0.05)
        else:
            pytest.fail("the server did not take new connections after the old ones closed")


def test_non_finite_numbers_bad_seeds_and_deep_json_get_openai_400s(service):
    with _serving(service) as srv:
        def post(raw):
            return _post(srv.port, "/v1/completions", raw)
        for const in ("NaN", "Infinity", "-Infinity"):
            for name in ("temperature", "top_p"):
                status, body = post('{"prompt": "Hi", "%s": %s}' % (name, const))
                assert (status, body) == (400, _error(f"the request body is not JSON: {const} is not a JSON "
                                                      f"number")), (name, const)
        assert post('{"prompt": "Hi", "temperature": 1e999}') == (  # json parses 1e999 as inf
            400, _error("'temperature' must be a finite number, got inf", param="temperature"))
        assert post('{"prompt": "Hi", "top_p": -1e999}') == (
            400, _error("'top_p' must be a finite number, got -inf", param="top_p"))
        for seed, shown in (("1.5", "1.5"), ('"5"', "'5'"), ("true", "True"), ("[1]", "[1]")):
            assert post('{"prompt": "Hi", "seed": %s}' % seed) == (
                400, _error(f"'seed' must be an integer, got {shown}", param="seed")), seed
        for seed in ("-2", "18446744073709551616", "-9223372036854775809"):
            assert post('{"prompt": "Hi", "seed": %s}' % seed) == (
                400, _error(f"'seed' must be between -1 and 18446744073709551615, got {seed}", param="seed"))
        for seed in ("-1", "0", "18446744073709551615"):  # -1: random, as llama-server; the rest: uint64
            status, body = post('{"prompt": "Hi", "seed": %s, "temperature": 1, "max_tokens": 1}' % seed)
            assert status == 200 and body["object"] == "text_completion", (seed, body)

        deep = _error("the request body nests deeper than 32 levels of arrays/objects")
        assert post("[" * 100_000 + "]" * 100_000) == (400, deep)
        assert post('{"prompt": "Hi", "x": ' + "[" * 32 + "]" * 32 + "}") == (400, deep)  # 33 levels
        # 32 levels (inside a field the server takes: an unknown one is refused by name)
        status, body = post('{"prompt": "Hi", "max_tokens": 1, "stream_options": {"x": ' + "[" * 30 + "]" * 30 + "}}")
        assert status == 200 and body["usage"]["completion_tokens"] == 1
        assert _get(srv.port, "/health")[0] == 200


def _count_decodes(llm, per_token_s: float):
    """Wrap llm.decode to count the device's decode steps (slowed, so a client can leave mid-answer)."""
    calls, real = [0], llm.decode

    def decode(*a, **kw):
        calls[0] += 1
        time.sleep(per_token_s)
        return real(*a, **kw)
    llm.decode = decode
    return calls, lambda: llm.__dict__.pop("decode", None)


def test_a_non_streaming_request_whose_client_left_stops_generating(service):
    runs, real_run = [], service.run

    def run(*a, **kw):
        res = real_run(*a, **kw)
        runs.append(res)
        return res
    request = json.dumps({"messages": [{"role": "user", "content": "Write a long story about a dragon."}],
                          "temperature": 0, "max_tokens": 150}).encode()
    head = b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n" \
           b"Content-Length: %d\r\n\r\n" % len(request)
    calls, unwrap = _count_decodes(service.gen.llm, 0.1)
    service.run = run
    try:
        with _serving(service) as srv:
            # running: the client leaves after 3 tokens; the generator stops at the next one
            with socket.create_connection(("127.0.0.1", srv.port), timeout=30) as s:
                s.sendall(head + request)
                deadline = time.monotonic() + 120
                while calls[0] < 3:
                    assert time.monotonic() < deadline, "generation never started"
                    time.sleep(0.01)
            deadline = time.monotonic() + 120
            while not runs:
                assert time.monotonic() < deadline, "the abandoned request kept generating"
                time.sleep(0.01)
            res = runs[0]
            assert res.finish_reason == "interrupted"
            assert len(res.ids) < 20 and calls[0] == res.decode_tokens  # of 150 asked for

            # queued: the client leaves while the device is busy; the request never runs
            gate = threading.Event()
            busy = service.submit(gate.wait, 60)
            try:
                with socket.create_connection(("127.0.0.1", srv.port), timeout=30) as s:
                    s.sendall(head + request)
                    deadline = time.monotonic() + 60
                    while service.waiting < 2:
                        assert time.monotonic() < deadline, "the request never queued"
                        time.sleep(0.01)
                deadline = time.monotonic() + 60
                while service.waiting > 1:  # taken off the queue
                    assert time.monotonic() < deadline, "the abandoned request stayed queued"
                    time.sleep(0.01)
            finally:
                gate.set()
            assert busy.result(60) is True
            assert len(runs) == 1
    finally:
        service.run = real_run
        unwrap()


def test_the_fd_limit_must_hold_the_connection_cap():
    """serve-llm refuses to start when `ulimit -n` cannot hold the cap (accept() would hit EMFILE)."""
    import subprocess

    script = """
import resource, sys
from dspx.errors import DspxError
from dspx.host.serve_llm import check_fd_room
hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
resource.setrlimit(resource.RLIMIT_NOFILE, (int(sys.argv[1]), hard))
try:
    check_fd_room(64)
except DspxError as e:
    print("refused:", e)
else:
    print("ok")
"""
    def run(soft):
        return subprocess.run([sys.executable, "-c", script, str(soft)], capture_output=True, text=True,
                              timeout=60, check=True).stdout.strip()
    out = run(80)  # under 64 connections + 32 spare, whatever else is open
    assert out.startswith("refused: --max-connections 64 needs ") and out.endswith(
        "file descriptors (those open now, the connections and 32 spare); the limit is 80: lower "
        "--max-connections or raise `ulimit -n`"), out
    assert run(1024) == "ok"
