"""dspx farm serve-llm: serve-llm on Ray Serve, two replicas on a local farm's
two devices.  Every answer equals the Generator's greedy text for the same
messages, computed beforehand on a device leased from the same farm (not
through Serve); two requests at once are answered by the two replicas and a
third, over capacity, gets OpenAI's 503 at once; each turn of a conversation
lands on the replica of its first turn and prefills only what is new there;
without the API key every path but /health gets 401.  The command itself
takes its key from $DSPX_API_KEY and, on Ctrl-C, gives its device back and
frees its port.

The routing rules themselves (conversation keys, the balancer's order and
capacity) are checked first without Ray."""
from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time

import pytest

import dspx.farm  # before ray: it sets Ray's loopback switch, read when Ray is first imported
import ray  # noqa: E402  (part of the test extra)
from conftest import CACHE
from dspx.farm import serve as farm_serve

openai = pytest.importorskip("openai")  # the test extra
requests = pytest.importorskip("requests")  # ray[serve]'s

KEY = "sk-test-farm"
LONG = [  # each answered with >= MIN_LONG tokens, so both answers are still running when a third request comes
    [{"role": "user", "content": "Write a long story about a dragon who learns to bake bread."}],
    [{"role": "user", "content": "Explain in detail how a steam engine works, step by step."}],
]
LONG_TOKENS, MIN_LONG = 200, 120
CONVERSATIONS = {  # how each names itself: by its leading messages, by `user`, by the header
    "messages": ({}, {}, ["What is the capital of France?", "And of Italy?", "Which of the two is bigger?"]),
    "user": ({"user": "alice"}, {}, ["Name a fruit that is red.", "Name another one.", "Which is sweeter?"]),
    "header": ({}, {farm_serve.CONVERSATION_HEADER: "conv-42"},
               ["What is 2 plus 2?", "And 3 plus 3?", "Add the two answers."]),
}
TURN_TOKENS = 16
# One summation order for the reference and both replicas: "auto" times serial and parallel decode on each
# device and keeps the faster, and the two orders part ways after ~100 greedy tokens of a long answer.
DECODE = "serial"


# ---------------------------------------------------------------- routing rules, without Ray

def test_a_conversation_key_stays_the_same_across_turns():
    first = {"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]}
    later = {"messages": first["messages"] + [{"role": "assistant", "content": "Hello!"},
                                              {"role": "user", "content": "How are you?"}]}
    key = farm_serve.conversation_key
    assert key({}, first) == key({}, later) is not None
    assert key({}, {"messages": [{"role": "user", "content": "Bye"}]}) != key({}, first)
    assert key({}, {**first, "user": "bob"}) == key({}, {"user": "bob", "messages": [{"role": "user", "content": "x"}]})
    assert key({farm_serve.CONVERSATION_HEADER: "c1"}, first) == key({farm_serve.CONVERSATION_HEADER: "c1"}, None)
    assert key({}, {"prompt": "Once upon a time"}) == key({}, {"prompt": ["Once upon a time"]})
    assert key({}, None) is None and key({}, {"input": "x"}) is None


def test_the_balancer_prefers_home_then_a_free_replica_then_says_busy():
    b = farm_serve.Balancer(3, parallel=1, max_queue=1)
    k = next(f"k{i}" for i in range(100) if farm_serve.home(f"k{i}", 3) == 1)
    assert b.pick(k, True) == 1                       # its home, free
    assert b.pick(k, True) in (0, 2)                  # home busy: a free replica, not home's queue
    assert b.pick(k, True) in (0, 2)
    assert b.pick(k, True) == 1                       # no free slot anywhere: wait at home
    assert [b.pick(k, True) for _ in range(2)] in ([0, 2], [2, 0])
    assert b.pick(k, True) is None and b.load == [2, 2, 2]     # full: 503
    assert b.pick(k, False) == 1 and b.load == [2, 2, 2]       # a request that holds no device is not counted
    b.done(2)
    assert b.pick(None, True) == 2
    now = [0.0]
    b = farm_serve.Balancer(2, parallel=1, max_queue=0, clock=lambda: now[0])
    b.unavailable(farm_serve.home(k, 2), seconds=30)  # it did not answer: idle as it looks, it is tried last
    assert b.pick(k, True) != farm_serve.home(k, 2)
    assert b.pick(k, True) == farm_serve.home(k, 2)   # still better than 503 when it is all that is left
    now[0] = 31.0
    b.load = [0, 0]
    assert b.pick(k, True) == farm_serve.home(k, 2)   # back after its time out


def test_replicas_go_where_the_devices_are_free_ones_first_spread_over_nodes():
    where = {"sim-0": "A", "sim-1": "A", "sim-2": "A", "sim-3": "B", "sim-4": "C"}
    assert farm_serve.replica_nodes(where, set(), 3) == ["A", "B", "C"]          # spread
    assert farm_serve.replica_nodes(where, set(), 5) == ["A", "B", "C", "A", "A"]  # at most its devices per node
    assert farm_serve.replica_nodes(where, {"sim-3", "sim-4"}, 3) == ["A", "A", "A"]  # free devices first
    assert farm_serve.replica_nodes(where, {"sim-0", "sim-1", "sim-2"}, 3) == ["B", "C", "A"]
    with pytest.raises(dspx.farm.FarmError, match="6 replica"):
        farm_serve.replica_nodes(where, set(), 6)


# ---------------------------------------------------------------- on a farm

def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def farm():
    """Two devices of the default size (an LLM's KV and weights need it)."""
    with dspx.farm.LocalFarm(2) as f:
        yield f


@pytest.fixture(scope="module")
def model_dir():
    from dspx.compiler.llm import compiled_dir

    return compiled_dir(cache_dir=CACHE, progress=False)


def _conversation(turns: list[str], answers: list[str], upto: int) -> list[dict]:
    msgs = []
    for q, a in zip(turns[:upto + 1], answers[:upto] + [None]):
        msgs.append({"role": "user", "content": q})
        if a is not None:
            msgs.append({"role": "assistant", "content": a})
    return msgs


@pytest.fixture(scope="module")
def reference(farm, model_dir):
    """The Generator's greedy answers, on a device leased from the farm
    before anything is served (so not through Serve, nor the code under test)."""
    from dspx.host.llm import DeviceLLM, Generator

    with dspx.farm.lease("sim", timeout=600, queue_timeout=60) as dev:
        llm = DeviceLLM(model_dir, client=dev.client, progress=False, decode_threads=DECODE)
        try:
            g = Generator(llm)
            long = [g.generate(m, LONG_TOKENS) for m in LONG]
            turns = {}
            for name, (_, _, questions) in CONVERSATIONS.items():
                # As a replica runs a conversation's turns one after the other: each turn reuses the KV of
                # the turns before (their answers' KV was written by decode steps, which round otherwise
                # than a prefill of the same tokens, so a fresh prefill may answer otherwise).
                g.cached, answers = [], []
                for t in range(len(questions)):
                    answers.append(g.generate(_conversation(questions, answers, t), TURN_TOKENS,
                                              reuse_cache=True).text)
                turns[name] = answers
            prompt_tokens = {name: [len(g.encode(_conversation(q, turns[name], t)))
                                    for t in range(len(q))] for name, (_, _, q) in CONVERSATIONS.items()}
        finally:
            llm.close()
    assert all(len(r.ids) >= MIN_LONG for r in long), [len(r.ids) for r in long]  # the premise of the 503 test
    return {"long": [r.text for r in long], "long_tokens": [r.prompt_tokens + len(r.ids) for r in long],
            "turns": turns, "prompt_tokens": prompt_tokens}


def test_the_cli_refuses_more_replicas_than_devices(farm):
    cli = subprocess.run([sys.executable, "-m", "dspx.cli", "farm", "serve-llm", "--replicas", "3", "--farm",
                          farm.address, "--port", str(_free_port())], capture_output=True, text=True, timeout=120)
    assert cli.returncode != 0
    assert "--replicas 3 needs as many devices under dspx:sim; the farm has 2 (sim-0, sim-1)" in cli.stderr


def test_the_cli_serves_until_interrupted_and_gives_the_device_back(farm, model_dir, reference):
    """The command end to end: the key from $DSPX_API_KEY, one replica, Ctrl-C (SIGINT) stops it."""
    port, url = _free_port(), None
    proc = subprocess.Popen([sys.executable, "-m", "dspx.cli", "farm", "serve-llm", "--replicas", "1", "--farm",
                             farm.address, "--port", str(port), "--model", str(model_dir)],
                            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "DSPX_API_KEY": KEY, "DSPX_LLM_DECODE": DECODE})
    lines, ready = [], threading.Event()

    def read():
        for line in proc.stderr:
            lines.append(line)
            if "serving the device LLM on" in line:
                ready.set()
        ready.set()  # it exited
    threading.Thread(target=read, daemon=True).start()
    try:
        assert ready.wait(300) and proc.poll() is None, "".join(lines)
        url = f"http://127.0.0.1:{port}"
        assert f"serving the device LLM on {url}/v1 with 1 replica(s) (0: sim-" in "".join(lines)
        assert requests.get(url + "/v1/models", timeout=30).status_code == 401  # $DSPX_API_KEY was taken
        messages = _conversation(CONVERSATIONS["messages"][2], [], 0)
        r = requests.post(url + "/v1/chat/completions", headers={"authorization": f"Bearer {KEY}"}, timeout=120,
                          json={"model": "x", "messages": messages, "temperature": 0, "max_tokens": TURN_TOKENS})
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["message"]["content"] == reference["turns"]["messages"][0]
        assert dspx.farm.status()["keys"]["sim"]["held"] == 1
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(120)
        except subprocess.TimeoutExpired:
            proc.kill()
            raise
    assert proc.returncode == 0, "".join(lines)
    assert dspx.farm.status()["keys"]["sim"]["held"] == 0  # its replica gave the device back
    deadline = time.monotonic() + 30
    while True:  # and Serve's proxy, shut down with the last application, freed the port
        try:
            requests.get(url + "/health", timeout=5)
        except requests.ConnectionError:
            break
        assert time.monotonic() < deadline, "the port still answers 30 s after the command stopped"
        time.sleep(0.5)


@pytest.fixture(scope="module")
def served(farm, model_dir, reference):
    """Two replicas, one KV slot each and no queue: capacity two requests."""
    settings = farm_serve.Settings(str(model_dir), replicas=2, max_queue=0, api_key=KEY, lease_timeout=60,
                                   decode_threads=DECODE)
    url = farm_serve.start(settings, "127.0.0.1", _free_port(), timeout=300)
    try:
        yield url
    finally:
        farm_serve.stop()
    assert dspx.farm.status()["keys"]["sim"]["held"] == 0  # the replicas gave their devices back


@pytest.fixture(scope="module")
def client(served):
    return openai.OpenAI(base_url=served + "/v1", api_key=KEY, max_retries=0, timeout=120)


def _replicas(url: str) -> dict[int, dict]:
    r = requests.get(url + "/dspx/replicas", headers={"authorization": f"Bearer {KEY}"}, timeout=30)
    r.raise_for_status()
    return {i["replica"]: i for i in r.json()}


def test_each_replica_holds_a_device_of_the_farm(served):
    info = _replicas(served)
    assert sorted(info) == [0, 1]
    assert sorted(i["device"] for i in info.values()) == ["sim-0", "sim-1"]
    node = ray.get_runtime_context().get_node_id()  # one node: where the replicas' label_selector put them
    assert all(i["node"] == node for i in info.values())
    holders = {h["device"]: h for h in dspx.farm.status()["holders"]}
    assert {i["device"]: i["lease"] for i in info.values()} == {d: h["id"] for d, h in holders.items()}


def _stream(url: str, messages: list[dict], out: dict, first: threading.Event) -> None:
    """A streamed chat answer: its replica, status and text in ``out``; ``first`` set at its first chunk."""
    try:
        with requests.post(url + "/v1/chat/completions", stream=True, timeout=120,
                           headers={"authorization": f"Bearer {KEY}"},
                           json={"model": "x", "messages": messages, "temperature": 0, "max_tokens": LONG_TOKENS,
                                 "stream": True}) as r:
            out["status"], out["replica"] = r.status_code, r.headers.get(farm_serve.REPLICA_HEADER)
            text = []
            for line in r.iter_lines():
                if not line.startswith(b"data: "):
                    continue
                first.set()
                data = line[len(b"data: "):]
                if data == b"[DONE]":
                    break
                chunk = json.loads(data)
                text.append(chunk["choices"][0]["delta"].get("content") or "")
            out["text"] = "".join(text)
    finally:
        first.set()


def test_two_at_once_are_answered_by_both_replicas_and_a_third_gets_503(served, reference):
    outs, firsts = [{}, {}], [threading.Event(), threading.Event()]
    threads = [threading.Thread(target=_stream, args=(served, LONG[i], outs[i], firsts[i]), daemon=True)
               for i in range(2)]
    for t in threads:
        t.start()
    for e in firsts:
        assert e.wait(120), "no first chunk within 120 s"
    assert all(o.get("status", 200) == 200 for o in outs), outs  # both running now
    t0 = time.monotonic()
    over = requests.post(served + "/v1/chat/completions", headers={"authorization": f"Bearer {KEY}"}, timeout=60,
                         json={"model": "x", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4})
    took = time.monotonic() - t0
    for t in threads:
        t.join(120)
        assert not t.is_alive(), "a streamed answer did not end within 120 s"
    assert over.status_code == 503, over.text
    err = over.json()["error"]
    assert err["code"] == "server_busy" and err["type"] == "server_error" and "every replica" in err["message"]
    assert over.headers.get("retry-after") == "1" and took < 10  # at once, not after a wait in a queue
    assert sorted(o["replica"] for o in outs) == ["0", "1"]
    assert [o["text"] for o in outs] == reference["long"]


def _wait_for(cond, what: str, timeout: float = 60.0):
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, f"timed out ({timeout:g} s) waiting for {what}"
        time.sleep(0.1)


def test_a_client_that_leaves_mid_answer_frees_its_replica(served, reference):
    with requests.post(served + "/v1/chat/completions", stream=True, timeout=120,
                       headers={"authorization": f"Bearer {KEY}"},
                       json={"model": "x", "messages": LONG[0], "temperature": 0, "max_tokens": LONG_TOKENS,
                             "stream": True}) as r:
        replica = int(r.headers[farm_serve.REPLICA_HEADER])
        for line in r.iter_lines():
            if line.startswith(b"data: ") and json.loads(line[6:])["choices"][0]["delta"].get("content"):
                break  # its first token: then the connection closes
    health = lambda: requests.get(served + "/health", timeout=30).json()["replicas"]  # noqa: E731
    _wait_for(lambda: all(h["requests"] == 0 for h in health()), "the ingress to count the request done")
    _wait_for(lambda: _replicas(served)[replica]["waiting"] == 0, "the replica to stop answering")
    # stopped at a token soon after, not after the whole answer (the KV holds what was generated)
    assert _replicas(served)[replica]["cached_tokens"][0] < reference["long_tokens"][0]
    r = requests.post(served + "/v1/chat/completions", headers={"authorization": f"Bearer {KEY}"}, timeout=120,
                      json={"model": "x", "messages": LONG[0], "temperature": 0, "max_tokens": 8,
                            "user": "after-a-leaver"})
    assert r.status_code == 200 and reference["long"][0].startswith(r.json()["choices"][0]["message"]["content"])


def test_a_conversation_stays_on_its_replica_and_reuses_its_kv_prefix(client, served, reference):
    for name, (extra_body, headers, questions) in CONVERSATIONS.items():
        answers, where = reference["turns"][name], []
        for t in range(len(questions)):
            before = _replicas(served)
            raw = client.chat.completions.with_raw_response.create(
                model="x", messages=_conversation(questions, answers, t), temperature=0, max_tokens=TURN_TOKENS,
                extra_body=extra_body or None, extra_headers=headers or None)
            r = raw.parse()
            replica = int(raw.headers[farm_serve.REPLICA_HEADER])
            where.append(replica)
            assert r.choices[0].message.content == answers[t], (name, t)
            want_prompt = reference["prompt_tokens"][name][t]
            assert r.usage.prompt_tokens == want_prompt
            prefilled = _replicas(served)[replica]["prompt_tokens"] - before[replica]["prompt_tokens"]
            if t == 0:  # a new conversation: at most the chat template's default system prompt is reused
                assert 0 < prefilled <= want_prompt, name
            else:
                # the turns before are in that replica's KV: at most the new ones are prefilled
                assert 0 < prefilled <= want_prompt - reference["prompt_tokens"][name][t - 1], (name, t, prefilled)
        assert len(set(where)) == 1, (name, where)


def test_the_api_key_is_required_except_for_health(served):
    assert requests.get(served + "/health", timeout=30).json()["status"] == "ok"
    for headers in ({}, {"authorization": "Bearer wrong"}, {"authorization": KEY}):
        for method, path in (("GET", "/v1/models"), ("POST", "/v1/chat/completions"), ("GET", "/dspx/replicas")):
            r = requests.request(method, served + path, headers=headers, timeout=30,
                                 json={"messages": [{"role": "user", "content": "Hi"}]})
            assert r.status_code == 401, (headers, path, r.text)
            assert r.json()["error"]["code"] == "invalid_api_key"
    wrong = openai.OpenAI(base_url=served + "/v1", api_key="wrong", max_retries=0, timeout=60)
    with pytest.raises(openai.AuthenticationError):
        wrong.models.list()
    ok = requests.get(served + "/v1/models", headers={"authorization": f"Bearer {KEY}"}, timeout=30)
    assert ok.status_code == 200 and ok.json()["data"][0]["object"] == "model"


def test_a_body_over_the_limit_gets_413_before_any_replica(served):
    big = b'{"messages": "' + b"x" * (farm_serve.Limits().max_body + 10) + b'"}'
    r = requests.post(served + "/v1/chat/completions", data=big, timeout=60,
                      headers={"authorization": f"Bearer {KEY}", "content-type": "application/json"})
    assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"
