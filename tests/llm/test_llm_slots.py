"""KV slots and batched decode (``serve-llm --parallel N``): the KV cache of
the default package (float32 KV, context 256, int8 decode activations)
split into 4 slots of 64 positions.

Oracle: each prompt run alone on the one-slot path (slot 0, ``decode``),
itself held to the float32 reference by test_llm_int8_decode.py, and to the
published France ids here.  A batched step must give every slot exactly
what it gets alone — the batch kernels quantize each row and sum it in the
decode GEMV's order, so the logits are equal bit for bit, not just the
greedy tokens."""
from __future__ import annotations

import json
import sys
import threading
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
from conftest import CACHE, llm_on_own_device  # noqa: E402

PROMPTS = ["What is the capital of France?", "Write a haiku about the sea.", "Name three colors.",
           "What is 2+2?"]
FRANCE_IDS = [504, 3575, 282, 4649, 314, 7042, 30, 2]  # "The capital of France is Paris." (docs/llm.md)
STEPS = 10


@pytest.fixture(scope="module")
def llm():
    from dspx.compiler.llm import compiled_dir

    with llm_on_own_device(compiled_dir(cache_dir=CACHE, progress=False)) as m:
        yield m


@pytest.fixture(autouse=True)
def batch_kind_kept(llm):
    """Tests that switch the batch module switch it back: the others see the timed choice."""
    kind = llm.batch_kind
    yield
    llm.use_batch(llm.batch_choice["chosen"] if llm.batch_choice else kind)


@pytest.fixture(scope="module")
def tok():
    from dspx.llm import Tokenizer
    return Tokenizer.from_gguf(None)


@pytest.fixture(scope="module")
def enc(tok):
    return [tok.encode_chat([{"role": "user", "content": p}]) for p in PROMPTS]


@pytest.fixture(scope="module")
def alone(llm, enc):
    """Each prompt on its own, one slot (the whole cache): greedy ids and every step's logits."""
    llm.set_slots(1)
    llm.use_decode("serial")  # what a slot's lone rows run (set_slots); the parallel module sums in another order
    out = []
    for ids in enc:
        logits = [llm.prefill(ids, 0)]
        for k in range(STEPS):
            logits.append(llm.decode(int(np.argmax(logits[-1])), len(ids) + k))
        out.append(([int(np.argmax(x)) for x in logits], np.stack(logits)))
    return out


def _blocks(llm, slot: int) -> slice:
    """The 16-position KV blocks of ``slot`` (the blocked layout: docs/llm-internals.md)."""
    per = llm.slot_tokens // 16
    return slice(slot * per, (slot + 1) * per)


def _kv_blocks(llm):
    """Each KV tensor of the region as (KV heads, blocks, block bytes)."""
    n_blocks = llm.context // 16
    return [llm.client.kv_view(off, llm.kv_shape, llm.kv_dtype).view(np.uint8).reshape(llm.kv_shape[1], n_blocks, -1)
            for off in llm.kv_offsets]


@pytest.mark.parametrize("kind", ["serial", "parallel"])
def test_batched_decode_equals_each_slot_alone(llm, enc, alone, kind):
    """On both batch modules: the parallel one splits the output tiles and the
    (row, KV head) items over the threads, never a sum."""
    assert alone[0][0][:len(FRANCE_IDS)] == FRANCE_IDS
    assert llm.set_slots(4) == 64
    llm.use_batch(kind)
    slots = [3, 1, 0, 2]  # prompt i in slot slots[i]: not in order, and prompt 0 away from slot 0
    ids = [[] for _ in enc]
    logits = [[] for _ in enc]
    for i, p in enumerate(enc):
        logits[i].append(llm.prefill(p, 0, slot=slots[i]))
    for k in range(STEPS):
        # all four slots, then only three (the fourth row is padding: position -1), then four again
        active = [0, 1, 3] if k in (4, 5) else [0, 1, 2, 3]
        rows = [(slots[i], int(np.argmax(logits[i][-1])), len(enc[i]) + len(logits[i]) - 1) for i in active]
        for i, row in zip(active, llm.decode_batch(rows)):
            logits[i].append(row)
        if k == 5:  # prompt 2 catches up: a step on the decode module, then a one-row batched step
            logits[2].append(llm.decode(int(np.argmax(logits[2][-1])), len(enc[2]) + len(logits[2]) - 1,
                                        slot=slots[2]))
            row = (slots[2], int(np.argmax(logits[2][-1])), len(enc[2]) + len(logits[2]) - 1)
            logits[2].append(llm.decode_batch([row])[0])  # the parallel batch module runs it (padding rows)
    for i in range(len(enc)):
        ids[i] = [int(np.argmax(x)) for x in logits[i]]
        assert ids[i] == alone[i][0], (PROMPTS[i], ids[i], alone[i][0])
        np.testing.assert_array_equal(np.stack(logits[i]), alone[i][1])


def test_the_first_slots_time_both_batch_modules_and_leave_the_kv_as_it_was(llm):
    """The choice runs a 4-row step at cache positions 0..3 of each module; every
    KV byte is put back (a slot may hold a conversation by then)."""
    from dspx.llm import LLMError

    llm.set_slots(4)
    first = llm.batch_choice  # made by the first set_slots(4)
    assert first["chosen"] in ("serial", "parallel") and first["serial_ms"] > 0 and first["parallel_ms"] > 0
    rng = np.random.default_rng(7)
    kv = _kv_blocks(llm)
    for t in kv:
        t[...] = rng.integers(0, 256, t.shape, dtype=np.uint8)
    before = [t.copy() for t in kv]
    again = llm._choose_batch()
    assert llm.batch_kind == again["chosen"]
    for t, b in zip(kv, before):
        np.testing.assert_array_equal(t, b)
    llm._threads = "parallel"  # DeviceLLM(decode_threads=...) / $DSPX_LLM_DECODE decide the batch module too
    try:
        assert llm._choose_batch() == {"chosen": "parallel", "why": "asked"} and llm.batch_kind == "parallel"
    finally:
        llm._threads = None
    with pytest.raises(LLMError, match="batch module 'both': use serial or parallel"):
        llm.use_batch("both")


def test_a_slot_reads_only_its_own_kv_and_padding_rows_write_none(llm, enc, alone):
    """Every other slot's KV bytes are NaN (0xFF) while slot 2 decodes: its logits stay the alone
    ones; and a three-row step leaves the idle slot's bytes untouched."""
    llm.set_slots(4)
    kv = _kv_blocks(llm)
    for t in kv:
        t[...] = 0xFF
    logits = [llm.prefill(enc[1], 0, slot=2)]
    for k in range(3):
        logits.append(llm.decode_batch([(2, int(np.argmax(logits[-1])), len(enc[1]) + k)])[0])
    np.testing.assert_array_equal(np.stack(logits), alone[1][1][:4])
    others = [s for s in range(4) if s != 2]
    assert all((t[:, _blocks(llm, s)] == 0xFF).all() for t in kv for s in others)  # nothing written there
    # a batched step of slots 0, 1, 2: slot 3 (the padding row's neighbour) still all 0xFF
    firsts = {s: llm.prefill(enc[s], 0, slot=s) for s in (0, 1)}
    rows = [(0, int(np.argmax(firsts[0])), len(enc[0])), (1, int(np.argmax(firsts[1])), len(enc[1])),
            (2, int(np.argmax(logits[-1])), len(enc[1]) + 3)]
    out = llm.decode_batch(rows)
    np.testing.assert_array_equal(out[0], alone[0][1][1])
    np.testing.assert_array_equal(out[1], alone[1][1][1])
    np.testing.assert_array_equal(out[2], alone[1][1][4])
    assert all((t[:, _blocks(llm, 3)] == 0xFF).all() for t in kv)


def test_a_full_slot_is_a_context_error_naming_the_slot(llm, enc):
    from dspx.host.llm import ContextFullError
    from dspx.llm import LLMError

    llm.set_slots(4)
    msg = r"is 65 tokens; each of the 4 KV slots holds 64 \(prompt \+ answer\)"
    with pytest.raises(ContextFullError, match=msg):
        llm.decode(1, 64, slot=1)
    with pytest.raises(ContextFullError, match=msg):
        llm.decode_batch([(0, 1, 3), (1, 1, 64)])
    with pytest.raises(ContextFullError, match=r"is 70 tokens; each of the 4 KV slots holds 64"):
        llm.prefill(list(range(40)), 30, slot=3)
    with pytest.raises(LLMError, match=r"KV slot 4 does not exist \(4 slots\)"):
        llm.decode(1, 0, slot=4)
    with pytest.raises(LLMError, match=r"17 KV slots do not fit a 256-token context: each needs at least 16 "
                                       r"positions \(at most 16 slots\)"):
        llm.set_slots(17)
    assert llm.set_slots(3) == 80  # 256 / 3 = 85, down to whole 16-position blocks


def test_concurrent_generators_batch_their_steps_and_answer_as_alone(llm, tok, alone):
    """Three requests at once on a SlotPool: each answer is its alone-answer (greedy; one with a stop
    string, one seeded sample repeated), and the steps were batched."""
    from dspx.host.llm.batch import SlotPool

    pool = SlotPool(llm, tok, 4)
    try:
        out: dict = {}

        def run(i, kw):
            with pool.acquire(tok.encode_chat([{"role": "user", "content": PROMPTS[i]}])) as g:
                out[i, tuple(kw)] = g.generate(PROMPTS[i], STEPS + 1, **kw)
        jobs = [(0, {}), (1, {}), (3, {}), (0, {"stop": ["Paris"]})]
        threads = [threading.Thread(target=run, args=job) for job in jobs]
        for t in threads:
            t.start()
        for t in threads:
            t.join(300)
        for i in (0, 1, 3):
            assert out[i, ()].ids == alone[i][0][:len(out[i, ()].ids)]
            assert len(out[i, ()].ids) == STEPS + 1 or out[i, ()].finish_reason == "eos"
        assert out[0, ("stop",)].text == "The capital of France is " and out[0, ("stop",)].finish_reason == "stop"
        assert pool.batcher.step_rows > pool.batcher.steps  # some step decoded several slots at once
        seeded = []
        for _ in range(2):
            with pool.acquire([]) as g:
                seeded.append(g.generate(PROMPTS[2], 8, temperature=0.9, seed=7).ids)
        assert seeded[0] == seeded[1]
        assert [s["n_ctx"] for s in pool.info()] == [64] * 4 and not any(s["is_processing"] for s in pool.info())
    finally:
        pool.close()
        llm.set_slots(1)


def test_serve_llm_parallel_answers_concurrent_clients_as_alone(llm, tok):
    """serve-llm's service with 4 slots: three streaming clients at once get their alone-answers (the
    one-slot Generator's greedy text); a prompt longer than a slot is a 400 naming the slot's size."""
    openai = pytest.importorskip("openai")
    pytest.importorskip("fastapi")
    from test_serve_llm import _get_text, _Server

    from dspx.host.llm import Generator
    from dspx.host.serve_llm import LLMService, create_app

    prompts = PROMPTS[:3]
    gen = Generator(llm, tok)
    llm.use_decode("serial")  # what the slots' lone rows run (alone() sets it too; this test may run without it)
    want = {p: gen.generate([{"role": "user", "content": p}], 10).text for p in prompts}
    svc = LLMService(gen, max_queue=4, parallel=4)
    server = _Server(create_app(svc))
    try:
        client = openai.OpenAI(base_url=server.url, api_key="unused", max_retries=0, timeout=120)
        got = {}

        def ask(p):
            st = client.chat.completions.create(model="x", messages=[{"role": "user", "content": p}],
                                                temperature=0, max_tokens=10, stream=True)
            got[p] = "".join(c.choices[0].delta.content or "" for c in st if c.choices)
        threads = [threading.Thread(target=ask, args=(p,)) for p in prompts]
        for t in threads:
            t.start()
        for t in threads:
            t.join(300)
        assert got == want
        with pytest.raises(openai.BadRequestError, match=r"this model's context holds 64 \(prompt \+ answer\)"):
            client.chat.completions.create(model="x", messages=[{"role": "user", "content": "word " * 60}])
        # /props: a lone row on the serial decode (slots sum as it does), the batched step on the timed winner
        mods = json.loads(_get_text(server, "/props"))["dspx"]
        timing = mods["batch_timing"]
        assert mods["decode"] == "serial" and mods["batch"] == timing["chosen"] == llm.batch_kind
        assert timing["serial_ms"] > 0 and timing["parallel_ms"] > 0
    finally:
        server.stop()
        svc.close()
        llm.set_slots(1)
