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


# ---------------------------------------------------------------- every accepted spelling (issue 29)
# Each accepted form of each parameter gets a request, and each is checked by
# its effect on the answer, not by its status alone.

RAW = "The capital of France is"


def _ask(client, chat: bool, **kw):
    """One request to /v1/chat/completions or /v1/completions (greedy unless told);
    the answer's text, finish reason and usage (streamed answers joined)."""
    kw.setdefault("temperature", 0)
    api = client.chat.completions if chat else client.completions
    r = api.create(model="x", **({"messages": MESSAGES} if chat else {"prompt": RAW}), **kw)
    if not kw.get("stream"):
        c = r.choices[0]
        return (c.message.content if chat else c.text), c.finish_reason, r.usage
    chunks = list(r)
    text = "".join((c.choices[0].delta.content or "") if chat else c.choices[0].text for c in chunks if c.choices)
    usage = [c.usage for c in chunks if c.usage is not None]
    assert len(usage) <= 1 and (not usage or not chunks[-1].choices), "usage comes once, in a last, empty chunk"
    return text, [c.choices[0].finish_reason for c in chunks if c.choices][-1], usage[0] if usage else None


def _stop_inside(text: str) -> str:
    """A word of ``text`` that a character of it occurs before: cut at its
    characters, the answer would end sooner than at the word."""
    for w in text.split()[1:]:
        if any(ch in text[:text.index(w)] for ch in w):
            return w
    raise AssertionError(f"no word of {text!r} repeats an earlier character")


@pytest.mark.parametrize("chat", [True, False], ids=["chat", "completions"])
@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_stop_as_a_string_or_a_list_cuts_at_the_whole_string(client, greedy, chat, stream):
    full = greedy["chat" if chat else "raw"].text
    stop = _stop_inside(full)
    want = full[:full.index(stop)]
    for form in (stop, [stop], ["zebra", stop], ["zebra", "qqq", "xyzzy", stop]):
        text, finish, _ = _ask(client, chat, max_tokens=16 if chat else 8, stop=form, stream=stream)
        assert (text, finish) == (want, "stop"), form
    for form in (None, []):  # no stop: the whole answer
        text, _, _ = _ask(client, chat, max_tokens=16 if chat else 8, stop=form, stream=stream)
        assert text == full, form


@pytest.mark.parametrize("chat", [True, False], ids=["chat", "completions"])
def test_max_tokens_and_max_completion_tokens_bound_the_answer(client, service, chat):
    g = service.gen
    want = g.generate(MESSAGES, 3) if chat else g.generate(RAW, 3, chat=False)
    bounds = [{"max_tokens": 3}, {"extra_body": {"max_completion_tokens": 3}},
              {"max_tokens": 16, "extra_body": {"max_completion_tokens": 3}}]  # the newer name wins
    if chat:
        bounds.append({"max_completion_tokens": 3})  # the client's own keyword
    for kw in bounds:
        for stream in (False, True):
            usage_kw = {"stream_options": {"include_usage": True}} if stream else {}
            text, finish, usage = _ask(client, chat, stream=stream, **usage_kw, **kw)
            assert (text, finish, usage.completion_tokens) == (want.text, "length", 3), (kw, stream)
    if chat:  # neither: the answer runs to its end of turn
        text, finish, _ = _ask(client, chat)
        assert (text, finish) == (g.generate(MESSAGES, 64).text, "stop")


@pytest.mark.parametrize("chat", [True, False], ids=["chat", "completions"])
def test_stream_with_and_without_stream_options(client, greedy, service, chat):
    want = greedy["chat" if chat else "raw"]
    prompt = len(service.gen.encode(MESSAGES if chat else RAW, chat))
    n = 16 if chat else 8
    completion = len(want.ids) - (want.finish_reason == "eos")
    for opts in (None, {}, {"include_usage": False}, {"include_usage": True}):
        kw = {} if opts is None else {"stream_options": opts}
        text, _, usage = _ask(client, chat, max_tokens=n, stream=True, **kw)
        assert text == want.text, opts
        if opts and opts.get("include_usage"):
            assert (usage.prompt_tokens, usage.completion_tokens, usage.total_tokens) == (
                prompt, completion, prompt + completion)
        else:
            assert usage is None, opts
    text, _, usage = _ask(client, chat, max_tokens=n, stream=False)  # stream: false, said
    assert text == want.text and usage.completion_tokens == completion


def test_sampling_parameters_take_effect(client, greedy, service):
    """temperature, top_p, top_k, seed, repeat_penalty and n, each by its effect."""
    g, want = service.gen, greedy["chat"].text
    story = [{"role": "user", "content": "Tell me a story."}]
    # a candidate set of one token is greedy at any temperature
    assert _ask(client, True, temperature=1.5, top_p=0, max_tokens=16)[0] == want
    assert _ask(client, True, temperature=1.5, extra_body={"top_k": 1}, max_tokens=16)[0] == want
    # no temperature sent: OpenAI's 1.0, the Generator's draw with the same seed
    sampled = client.chat.completions.create(model="x", messages=story, seed=5, max_tokens=12)
    assert sampled.choices[0].message.content == g.generate(story, 12, temperature=1.0, seed=5).text
    nucleus = client.chat.completions.create(model="x", messages=story, seed=5, temperature=0.7, top_p=0.9,
                                             extra_body={"top_k": 40}, max_tokens=12)
    assert nucleus.choices[0].message.content == g.generate(story, 12, temperature=0.7, top_p=0.9, top_k=40,
                                                            seed=5).text
    # seed -1 is llama-server's "random" (as no seed): accepted
    assert client.chat.completions.create(model="x", messages=story, seed=-1, max_tokens=4).choices[0].message.content
    # repeat_penalty: the Generator's greedy answer under that penalty
    penalized = _ask(client, True, max_tokens=16, extra_body={"repeat_penalty": 1.5})[0]
    assert penalized == g.generate(MESSAGES, 16, repeat_penalty=1.5).text
    assert _ask(client, True, max_tokens=16, n=1)[0] == want  # n=1, said


def test_prompt_and_message_spellings(client, greedy, service):
    """A prompt as a string or a list of one; content as a string or text
    parts; a developer message as a system one; the request's model echoed."""
    raw = greedy["raw"].text
    for prompt in (RAW, [RAW]):
        r = client.completions.create(model="my-model", prompt=prompt, temperature=0, max_tokens=8)
        assert r.choices[0].text == raw and r.model == "my-model", prompt
    parts = [{"role": "user", "content": [{"type": "text", "text": "What is the capital "},
                                          {"type": "text", "text": "of France?"}]}]
    r = client.chat.completions.create(model="x", messages=parts, temperature=0, max_tokens=16)
    assert r.choices[0].message.content == greedy["chat"].text
    sys_msgs = [{"role": "system", "content": "Answer in French."}, *MESSAGES]
    want = service.gen.generate(sys_msgs, 16).text
    for role in ("system", "developer"):
        r = client.chat.completions.create(model="x", messages=[{"role": role, "content": "Answer in French."},
                                                                *MESSAGES], temperature=0, max_tokens=16)
        assert r.choices[0].message.content == want, role
