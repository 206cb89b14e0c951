"""A Generator on a KV slot hands in its next decode before it yields the
token (``SlotLLM.decode_ahead``), so that the caller's work on the token
(serve-llm streams it out) overlaps the batched step instead of delaying it,
and an answer that ends with such a step under way waits for it before the
slot can be reused.  Checked on a stand-in slot that logs the order of
events, with the real tokenizer: no device."""
from __future__ import annotations

import numpy as np
import pytest

from dspx.host.llm.device import Traffic
from dspx.host.llm.generator import Generator


@pytest.fixture(scope="module")
def tok():
    from dspx.llm import Tokenizer

    return Tokenizer.from_gguf(None)


class LoggingSlot:
    """What a Generator uses of a SlotLLM: every logit vector prefers ``token``."""

    context = 256

    def __init__(self, token: int, vocab: int):
        self.events: list[tuple[str, int]] = []
        self.traffic = Traffic()
        self.logits = np.zeros(vocab, np.float32)
        self.logits[token] = 1.0

    def prefill(self, ids, start=0):
        self.events.append(("prefill", len(ids)))
        return self.logits

    def decode(self, token, pos, resident=True):
        self.events.append(("decode", pos))
        return self.logits

    def decode_ahead(self, token, pos):
        self.events.append(("ahead", pos))
        slot = self

        class Pending:
            def result(self):
                slot.events.append(("collect", pos))
                return slot.logits
        return Pending()


def _word(tok) -> int:
    return tok.encode(" the")[-1]


def test_the_next_decode_is_handed_in_before_the_token_is_yielded(tok):
    slot = LoggingSlot(_word(tok), tok.vocab_size)
    g = Generator(slot, tok)
    n = len(g.encode("Hi"))
    for k, (token, _) in enumerate(g.stream("Hi", max_tokens=3)):
        if token >= 0:
            slot.events.append(("yield", k))
    assert slot.events == [("prefill", n), ("ahead", n), ("yield", 0), ("collect", n),
                           ("ahead", n + 1), ("yield", 1), ("collect", n + 1),
                           ("yield", 2)]  # the last token (max_tokens): nothing handed in after it


def test_an_answer_stopped_between_tokens_waits_for_the_step_it_handed_in(tok):
    slot = LoggingSlot(_word(tok), tok.vocab_size)
    g = Generator(slot, tok)
    n = len(g.encode("Hi"))
    yielded = []
    for token, _ in g.stream("Hi", max_tokens=10, should_stop=lambda: len(yielded) >= 2):
        if token >= 0:
            yielded.append(token)
    ahead = [p for e, p in slot.events if e == "ahead"]
    collect = [p for e, p in slot.events if e == "collect"]
    assert ahead == collect == [n, n + 1]  # the step after the second token was handed in, and collected


def test_a_stop_string_hands_in_nothing_after_it(tok):
    slot = LoggingSlot(_word(tok), tok.vocab_size)
    g = Generator(slot, tok)
    text = "".join(piece for _, piece in g.stream("Hi", max_tokens=10, stop="the"))
    assert text == " "  # the answer up to the stop string
    assert not any(e == "ahead" for e, _ in slot.events)


def test_a_device_without_decode_ahead_decodes_after_the_yield(tok):
    class Plain(LoggingSlot):
        decode_ahead = None

    slot = Plain(_word(tok), tok.vocab_size)
    g = Generator(slot, tok)
    n = len(g.encode("Hi"))
    for k, (token, _) in enumerate(g.stream("Hi", max_tokens=2)):
        if token >= 0:
            slot.events.append(("yield", k))
    assert slot.events == [("prefill", n), ("yield", 0), ("decode", n), ("yield", 1)]
