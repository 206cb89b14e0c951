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

import numpy as np
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


# ---- llama-server's surface (issue 30) --------------------------------------------------------------------------
def _post_json(server, path: str, body: dict) -> tuple[int, dict]:
    import json
    import urllib.error
    import urllib.request

    req = urllib.request.Request(server.url.removesuffix("/v1") + path, json.dumps(body).encode(),
                                 {"content-type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=120) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def _get_text(server, path: str) -> str:
    import urllib.request

    with urllib.request.urlopen(server.url.removesuffix("/v1") + path, timeout=30) as r:
        return r.read().decode()


def test_tokenize_and_detokenize_in_llama_servers_shapes(server):
    status, body = _post_json(server, "/tokenize", {"content": RAW, "add_special": False})
    assert status == 200 and len(body["tokens"]) == 5  # the prompt_tokens the usage test counts
    _, pieces = _post_json(server, "/tokenize", {"content": RAW, "with_pieces": True})
    assert [p["id"] for p in pieces["tokens"]] == body["tokens"]
    assert "".join(p["piece"] for p in pieces["tokens"]) == RAW
    assert _post_json(server, "/detokenize", {"tokens": body["tokens"]}) == (200, {"content": RAW})
    status, err = _post_json(server, "/detokenize", {"tokens": [10**9]})
    assert status == 400 and "outside this model's vocabulary" in err["error"]["message"]


def _metrics(server) -> dict:
    from prometheus_client.parser import text_string_to_metric_families

    return {s.name: s.value for fam in text_string_to_metric_families(_get_text(server, "/metrics"))
            for s in fam.samples}


def test_metrics_count_tokens_in_prometheus_text_with_llama_servers_names(client, server):
    before = _metrics(server)
    r = client.completions.create(model="x", prompt="Once upon a time", temperature=0, max_tokens=3)
    after = _metrics(server)
    assert r.usage.completion_tokens == 3
    assert after["llamacpp:tokens_predicted_total"] - before["llamacpp:tokens_predicted_total"] == 3
    prompt = after["llamacpp:prompt_tokens_total"] - before["llamacpp:prompt_tokens_total"]
    assert 1 <= prompt <= r.usage.prompt_tokens  # a cached prefix is not run again
    assert after["llamacpp:n_decode_total"] - before["llamacpp:n_decode_total"] == 1 + 2  # one prefill chunk, 2 decodes
    assert after["llamacpp:requests_processing"] == 0 and after["llamacpp:requests_deferred"] == 0
    assert after["llamacpp:prompt_seconds_total"] > before["llamacpp:prompt_seconds_total"]
    assert 0 < after["llamacpp:kv_cache_usage_ratio"] <= 1


def test_props_and_slots(server, service):
    import json

    props = json.loads(_get_text(server, "/props"))
    assert props["default_generation_settings"]["n_ctx"] == 256 and props["total_slots"] == 1
    assert "<|im_start|>" in props["chat_template"] and props["eos_token"] == "<|im_end|>"
    mods = props["dspx"]  # one slot: the load's decode choice, no batched step (4 slots: test_llm_slots.py)
    assert mods["decode"] == mods["decode_timing"]["chosen"] in ("serial", "parallel") and "batch" not in mods
    slots = json.loads(_get_text(server, "/slots"))
    assert [(s["id"], s["n_ctx"], s["is_processing"]) for s in slots] == [(0, 256, False)]


def test_every_request_gets_a_log_line(client, caplog):
    import logging

    with caplog.at_level(logging.INFO, logger="dspx.serve_llm.requests"):
        client.completions.create(model="x", prompt=RAW, temperature=0, max_tokens=2)
        list(client.completions.create(model="x", prompt=RAW, temperature=0, max_tokens=3, stream=True))
        with pytest.raises(openai.BadRequestError):
            client.chat.completions.create(model="x", messages=[])
    lines = [r.getMessage() for r in caplog.records if r.name == "dspx.serve_llm.requests"]
    assert len(lines) == 3, lines
    assert " POST /v1/completions 200 5+2 tokens " in lines[0] and lines[0].endswith(" s")
    assert " POST /v1/completions 200 5+3 tokens " in lines[1]  # a stream's line comes at its end
    assert " POST /v1/chat/completions 400 - " in lines[2]


def _log_softmax(z: np.ndarray) -> np.ndarray:
    z = z.astype(np.float64)
    m = z.max()
    return z - m - np.log(np.sum(np.exp(z - m)))


def test_logprobs_are_the_log_softmax_of_the_models_logits(client, service):
    r = client.chat.completions.create(model="x", messages=MESSAGES, temperature=0, max_tokens=3, logprobs=True,
                                       top_logprobs=3)
    got = r.choices[0].logprobs.content
    # the same steps on the device, by hand: prefill, then one decode per token
    g, llm = service.gen, service.gen.llm
    ids = g.tok.encode_chat(MESSAGES)
    logits = [llm.prefill(ids, 0)]
    chosen = [int(np.argmax(logits[0]))]
    for i in range(2):
        logits.append(llm.decode(chosen[-1], len(ids) + i))
        chosen.append(int(np.argmax(logits[-1])))
    g.cached = []  # the cache now holds this by-hand run
    assert len(got) == 3
    for entry, z, tok in zip(got, logits, chosen):
        lp = _log_softmax(z)
        assert entry.token == g.tok.decode([tok]) and entry.bytes == list(g.tok.decode([tok]).encode())
        assert entry.logprob == pytest.approx(lp[tok], abs=1e-4)
        top = np.argsort(-lp)[:3]
        assert [t.token for t in entry.top_logprobs] == [g.tok.decode([int(i)]) for i in top]
        assert [t.logprob for t in entry.top_logprobs] == pytest.approx(lp[top], abs=1e-4)
    # streamed: the same entries, spread over the chunks
    s = client.chat.completions.create(model="x", messages=MESSAGES, temperature=0, max_tokens=3, logprobs=True,
                                       top_logprobs=3, stream=True)
    streamed = [e for c in s if c.choices and c.choices[0].logprobs for e in c.choices[0].logprobs.content]
    assert [(e.token, round(e.logprob, 4)) for e in streamed] == [(e.token, round(e.logprob, 4)) for e in got]
    # completions: OpenAI's legacy shape, logprobs=N alternatives
    c = client.completions.create(model="x", prompt=RAW, temperature=0, max_tokens=2, logprobs=2).choices[0]
    assert len(c.logprobs.tokens) == len(c.logprobs.token_logprobs) == 2 == len(c.logprobs.top_logprobs)
    assert "".join(c.logprobs.tokens) == c.text and c.logprobs.text_offset == [0, len(c.logprobs.tokens[0])]
    assert all(len(t) == 2 and max(t.values()) >= lp for t, lp in zip(c.logprobs.top_logprobs,
                                                                      c.logprobs.token_logprobs))


def test_unsupported_fields_get_a_400_naming_them(client):
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {}}}}]
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="x", messages=MESSAGES, tools=tools)
    assert e.value.param == "tools" and "unsupported field 'tools'" in e.value.message
    assert e.value.code == "unsupported_parameter"
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="x", messages=MESSAGES, response_format={"type": "json_object"},
                                       extra_body={"min_p": 0.1})
    assert "'response_format', 'min_p'" in e.value.message
    with pytest.raises(openai.BadRequestError, match="'suffix'"):
        client.completions.create(model="x", prompt=RAW, suffix="!")
    # values that ask for nothing are accepted, as is null ("not given")
    r = client.chat.completions.create(model="x", messages=MESSAGES, max_tokens=1, response_format={"type": "text"},
                                       presence_penalty=0, extra_body={"tools": None})
    assert r.choices[0].finish_reason == "length"


def test_embeddings_are_the_mean_pooled_final_hidden_state(client, server, service):
    """Against the numpy reference Llama's own final-norm hidden states (its LM head set to the identity).
    The served package decodes on int8 activations (the default), and an embedding is one decode step per
    token: it carries that arithmetic's noise (measured: cosine 0.9985 to the float32 one, max |Δ| 0.018),
    so it is held to a cosine of 0.995 and to being nearer its own text's reference than the other's; the
    same path on the float32 package is held to 2e-3 (test_llm_device.py)."""
    from llm_reference import ReferenceLlama, default_gguf_path, load_gguf

    texts = ["The capital of France is Paris.", "Dragons"]
    r = client.embeddings.create(model="x", input=texts)  # the openai client asks for base64 and decodes it
    assert [d.index for d in r.data] == [0, 1] and r.object == "list"
    ids = [service.gen.tok.encode(t) for t in texts]
    assert r.usage.prompt_tokens == r.usage.total_tokens == sum(map(len, ids))
    cfg, w, reader = load_gguf(default_gguf_path())
    ref = ReferenceLlama(loaded=(cfg, w, reader), max_seq=64)
    ref.lm_head = np.eye(cfg.dim, dtype=np.float32)  # "logits" = the hidden state after the output norm
    wants = []
    for i in ids:
        want = ref.prefill(i).mean(axis=0)
        wants.append(want / np.linalg.norm(want))
    for k, d in enumerate(r.data):
        got = np.asarray(d.embedding)
        assert got.shape == (576,) and np.linalg.norm(got) == pytest.approx(1, abs=1e-5)
        assert float(got @ wants[k]) > 0.995 and np.abs(got - wants[k]).max() < 0.05
        assert float(got @ wants[k]) > float(got @ wants[1 - k])
    status, floats = _post_json(server, "/v1/embeddings", {"input": ids[1], "encoding_format": "float"})
    assert status == 200 and np.allclose(floats["data"][0]["embedding"], r.data[1].embedding, atol=1e-6)
    status, err = _post_json(server, "/v1/embeddings", {"input": "x", "dimensions": 8})
    assert status == 400 and err["error"]["param"] == "dimensions"
