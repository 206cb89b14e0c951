"""dspx serve-llm driven by the official ``openai`` client: the text of every
answer (streamed or not) equals the Generator's greedy text for the same
prompt on the same device; usage counts are the tokenizer's; errors come in
OpenAI's shape; concurrent clients are served one at a time in arrival order."""
from __future__ import annotations

import socket
import sys
import threading
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
from conftest import CACHE, Device  # noqa: E402

openai = pytest.importorskip("openai")  # the test extra; absent only outside `make test`
pytest.importorskip("fastapi")

MESSAGES = [{"role": "user", "content": "What is the capital of France?"}]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class _Server:
    """The app on 127.0.0.1 with serve-llm's own uvicorn config (its protocol, timeouts and cap)."""

    def __init__(self, app, limits=None):
        import uvicorn

        from dspx.host.serve_llm import Limits, uvicorn_config

        self.port = _free_port()
        self.server = uvicorn.Server(uvicorn_config(app, "127.0.0.1", self.port, limits or Limits(), "warning"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            assert self.thread.is_alive() and time.monotonic() < deadline, "uvicorn did not start"
            time.sleep(0.02)
        self.url = f"http://127.0.0.1:{self.port}/v1"

    def stop(self):
        self.server.should_exit = True
        self.thread.join(10)


@pytest.fixture(scope="module")
def service():
    from dspx.compiler.llm import compiled_dir
    from dspx.host.client import Client
    from dspx.host.llm import DeviceLLM, Generator
    from dspx.host.serve_llm import LLMService

    dev = Device()
    c = Client(dev.path, timeout=120)
    llm = DeviceLLM(compiled_dir(cache_dir=CACHE, progress=False), client=c, progress=False)
    svc = LLMService(Generator(llm), max_queue=8)
    yield svc
    svc.close()
    llm.close()
    c.close()
    dev.stop()


@pytest.fixture(scope="module")
def server(service):
    from dspx.host.serve_llm import create_app

    s = _Server(create_app(service))
    yield s
    s.stop()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url, api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def greedy(service):
    """The Generator's greedy answers (run before any request, on the same device)."""
    g = service.gen
    return {"chat": g.generate(MESSAGES, 16), "raw": g.generate("The capital of France is", 8, chat=False)}


def test_models(client, service):
    ids = [m.id for m in client.models.list().data]
    assert ids == [service.model]


def test_chat_completion_equals_the_generators_greedy_text(client, greedy, service):
    want = greedy["chat"]
    r = client.chat.completions.create(model="anything", messages=MESSAGES, temperature=0, max_tokens=16)
    assert want.text == "The capital of France is Paris."
    assert r.choices[0].message.content == want.text and r.choices[0].message.role == "assistant"
    assert r.choices[0].finish_reason == "stop" and r.object == "chat.completion"
    prompt = len(service.gen.tok.encode_chat(MESSAGES))
    assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (prompt, len(want.ids) - 1)  # eos not counted
    assert r.usage.total_tokens == prompt + len(want.ids) - 1


def test_chat_stream_equals_the_generators_greedy_text(client, greedy):
    s = client.chat.completions.create(model="x", messages=MESSAGES, temperature=0, max_tokens=16, stream=True,
                                       stream_options={"include_usage": True})
    chunks = list(s)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == greedy["chat"].text
    assert sum(1 for c in chunks if c.choices and c.choices[0].delta.content) >= 5  # streamed token by token
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "stop"
    assert chunks[-1].usage.completion_tokens == len(greedy["chat"].ids) - 1


def test_completions_raw_prompt_stop_and_length(client, greedy):
    want = greedy["raw"]
    r = client.completions.create(model="x", prompt="The capital of France is", temperature=0, max_tokens=8)
    assert r.choices[0].text == want.text and r.choices[0].finish_reason == "length"
    assert r.usage.prompt_tokens == 5 and r.usage.completion_tokens == 8
    cut = want.text.split()[1]  # a word inside the answer: the text ends before it
    s = client.completions.create(model="x", prompt="The capital of France is", temperature=0, max_tokens=8,
                                  stop=[cut], stream=True)
    chunks = list(s)
    text = "".join(c.choices[0].text for c in chunks)
    assert text == want.text[:want.text.index(cut)] and chunks[-1].choices[0].finish_reason == "stop"


def test_a_string_stop_is_one_sequence_not_its_characters(client, greedy, service):
    """Issue 29: "stop": "Paris" cuts at "Paris"; split into characters it would cut at the first "a"."""
    assert greedy["chat"].text == "The capital of France is Paris."
    for stop in ("Paris", ["Paris"], ["Paris", "zebra"]):
        r = client.chat.completions.create(model="x", messages=MESSAGES, temperature=0, max_tokens=16, stop=stop)
        assert r.choices[0].message.content == "The capital of France is ", stop
        assert r.choices[0].finish_reason == "stop"
    assert service.gen.generate(MESSAGES, 16, stop="Paris").text == "The capital of France is "  # the Python API too


def test_sampling_is_seeded(client):
    kw = dict(model="x", messages=[{"role": "user", "content": "Tell me a story."}], temperature=1.0, top_p=0.9,
              max_tokens=12)
    a = client.chat.completions.create(seed=5, **kw).choices[0].message.content
    b = client.chat.completions.create(seed=5, **kw).choices[0].message.content
    assert a == b


def test_errors_in_openais_shape(client, server):
    import urllib.error
    import urllib.request

    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="x", messages=[{"role": "user", "content": "word " * 400}])
    assert e.value.code == "context_length_exceeded" and "context holds 256" in e.value.message
    with pytest.raises(openai.BadRequestError, match="only n=1"):
        client.chat.completions.create(model="x", messages=MESSAGES, n=2)
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="x", messages=MESSAGES, temperature=5)
    assert e.value.param == "temperature"
    with pytest.raises(openai.BadRequestError, match="'messages' must be a non-empty list"):
        client.chat.completions.create(model="x", messages=[])
    with pytest.raises(urllib.error.HTTPError) as e:
        urllib.request.urlopen(server.url + "/nothing-here", timeout=10)
    assert e.value.code == 404
    import json
    assert set(json.loads(e.value.read())["error"]) == {"message", "type", "param", "code"}


def test_api_key(service, greedy):
    from dspx.host.serve_llm import create_app

    s = _Server(create_app(service, api_key="sekrit"))
    try:
        with pytest.raises(openai.AuthenticationError) as e:
            openai.OpenAI(base_url=s.url, api_key="wrong", max_retries=0).models.list()
        assert e.value.code == "invalid_api_key"
        ok = openai.OpenAI(base_url=s.url, api_key="sekrit", max_retries=0, timeout=120)
        assert ok.chat.completions.create(model="x", messages=MESSAGES, temperature=0,
                                          max_tokens=16).choices[0].message.content == greedy["chat"].text
    finally:
        s.stop()


def test_concurrent_clients_run_one_at_a_time_in_arrival_order(client, service):
    prompts = ["What is the capital of France?", "Name a large ocean.", "What do bees make?"]
    want = {p: service.gen.generate([{"role": "user", "content": p}], 10).text for p in prompts}
    submitted, started, running, peak = [], [], [0], [0]
    lock = threading.Lock()
    real_run, real_submit = service.run, service.submit

    def run(ids, *a, **kw):
        with lock:
            running[0] += 1
            peak[0] = max(peak[0], running[0])
            started.append(ids)
        try:
            return real_run(ids, *a, **kw)
        finally:
            with lock:
                running[0] -= 1

    def submit(fn, *args):
        if fn is run:
            submitted.append(args[0])
        return real_submit(fn, *args)
    gate = threading.Event()
    busy = real_submit(gate.wait, 60)  # the device is busy: every request below must queue
    service.run, service.submit = run, submit
    got = {}
    try:
        def ask(p):
            s = client.chat.completions.create(model="x", messages=[{"role": "user", "content": p}], temperature=0,
                                               max_tokens=10, stream=True)
            got[p] = "".join(c.choices[0].delta.content or "" for c in s if c.choices)
        threads = [threading.Thread(target=ask, args=(p,)) for p in prompts]
        for t in threads:
            t.start()
        deadline = time.monotonic() + 60
        while len(submitted) < len(prompts):
            assert time.monotonic() < deadline, f"only {len(submitted)} requests arrived"
            time.sleep(0.01)
        assert service.waiting == 1 + len(prompts) and not started  # all queued behind the busy device
        gate.set()
        for t in threads:
            t.join(120)
    finally:
        gate.set()
        service.run, service.submit = real_run, real_submit
    assert busy.result() is True
    assert got == want
    assert peak[0] == 1                # one at a time on the device
    assert started == submitted        # in arrival order
