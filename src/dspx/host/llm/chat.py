"""A conversation on a Generator, and the one call ``make demo`` needs."""
from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Callable

from .device import ContextFullError
from .generator import GenerationResult, Generator

__all__ = ["Chat", "Turn", "demo_generate"]


@dataclass
class Turn:
    user: str
    assistant: str


class Chat:
    """A conversation on one Generator with llama.cpp-style context shift.

    Before each answer the history is rendered with the chat template; while
    the prompt plus ``answer_room`` tokens do not fit the context, the oldest
    turn (user + assistant) is dropped and recorded in ``dropped``.  The
    system prompt (the given one, or the template's default) is always kept.
    The cache is kept right by **recomputation**: the shifted conversation
    shares only the system prompt's tokens with what is cached, so the
    Generator's prefix reuse keeps those and re-prefills the kept turns at
    their new positions (no re-rotation of cached keys).
    """

    def __init__(self, gen: Generator, system: str | None = None, answer_room: int | None = None):
        self.gen = gen
        self.system = system
        self.turns: list[Turn] = []
        self.dropped: list[Turn] = []
        self.answer_room = answer_room

    def messages(self, user: str | None = None, turns: list[Turn] | None = None) -> list[dict]:
        msgs = [{"role": "system", "content": self.system}] if self.system else []
        for t in (self.turns if turns is None else turns):
            msgs += [{"role": "user", "content": t.user}, {"role": "assistant", "content": t.assistant}]
        if user is not None:
            msgs.append({"role": "user", "content": user})
        return msgs

    def reset(self) -> None:
        self.turns, self.dropped = [], []

    def ask(self, text: str, max_tokens: int = 256, *, on_text: Callable[[str], None] | None = None,
            **kw) -> GenerationResult:
        """Answer ``text`` in the conversation; shifts the context when needed."""
        ctx = self.gen.context
        room = min(max_tokens, self.answer_room if self.answer_room is not None else ctx // 4)
        while True:
            ids = self.gen.encode(self.messages(text))
            if len(ids) + room <= ctx or not self.turns:
                break
            self.dropped.append(self.turns.pop(0))
        if len(ids) > ctx:  # the question alone (with the system prompt) is too long
            raise ContextFullError(len(ids), ctx, "the question")
        res = self.gen.generate(ids, max_tokens, on_text=on_text, reuse_cache=True, **kw)
        self.turns.append(Turn(text, res.text))
        return res


def demo_generate(question: str = "What is the capital of France?", max_tokens: int = 64,
                  stream=None) -> GenerationResult:
    """For ``make demo``: compile SmolLM2 once (cached under .cache/dspx/llm),
    load it on a private simulated device and stream a greedy answer."""
    out = stream or sys.stdout
    with Generator(progress=True) as g:
        g.llm  # compile (first time) and load before printing the question
        out.write(f"Q: {question}\nA: ")
        out.flush()

        def show(piece: str) -> None:
            out.write(piece)
            out.flush()

        res = g.generate(question, max_tokens, on_text=show)
        out.write("\n")
        out.write(f"[{res.prompt_tokens} prompt tokens: prefill {res.prefill_tok_s:.0f} tok/s; "
                  f"{len(res.ids)} new tokens: decode {res.decode_tok_s:.1f} tok/s, KV-resident, "
                  f"{res.bytes_per_token:,.0f} bytes moved per decoded token]\n")
        out.flush()
        return res
