"""The model's tokenizer, rebuilt from GGUF metadata with ``tokenizers``.

SmolLM2 (``tokenizer.ggml.model = gpt2``, ``tokenizer.ggml.pre = smollm``) is a
byte-level BPE whose Hugging Face ``tokenizer.json`` uses::

    pre_tokenizer = Sequence[Digits(individual_digits=True),
                             ByteLevel(add_prefix_space=False, use_regex=True)]
    decoder       = ByteLevel
    no normalizer, no post-processor (no BOS is prepended)

Control tokens (GGUF token type 3: ``<|im_start|>``, ``<|im_end|>``, …) are
registered as special tokens so they encode to single ids when they appear
inline in text. The chat template is ``tokenizer.chat_template`` rendered with
jinja2 the way ``transformers`` renders it, with a hand-written ChatML
renderer as the fallback when jinja2 is missing or fails.
"""

from __future__ import annotations

import codecs
import os
import warnings
from functools import lru_cache
from typing import Any, Iterable, Mapping, Sequence

from tokenizers import AddedToken
from tokenizers import Tokenizer as _HFTokenizer
from tokenizers import decoders, models, pre_tokenizers

from .gguf_model import GGUFModel, LLMError, read_gguf

__all__ = [
    "ChatTemplateError",
    "SMOLLM2_DEFAULT_SYSTEM",
    "StreamDecoder",
    "Tokenizer",
    "TokenizerError",
    "bytes_to_unicode",
    "render_chatml",
]

# GGUF token types (llama.cpp LLAMA_TOKEN_TYPE_*)
_TYPE_NORMAL, _TYPE_UNKNOWN, _TYPE_CONTROL, _TYPE_USER_DEFINED, _TYPE_UNUSED, _TYPE_BYTE = 1, 2, 3, 4, 5, 6

# tokenizer.ggml.pre values whose HF pre-tokenizer is Digits(individual) + ByteLevel
# (llama.cpp gives them all the regexes "\p{N}" then the GPT-2 pattern).
_DIGITS_THEN_BYTELEVEL = {"smollm", "starcoder", "refact", "codeshell"}
_BYTELEVEL_ONLY = {"gpt-2", "gpt2", "default"}

SMOLLM2_DEFAULT_SYSTEM = "You are a helpful AI assistant named SmolLM, trained by Hugging Face"


class TokenizerError(LLMError, ValueError):
    """The GGUF's tokenizer metadata is missing or of an unsupported kind."""


class ChatTemplateError(LLMError, ValueError):
    """Malformed messages, or the chat template could not be rendered."""


@lru_cache(maxsize=1)
def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte → printable-character map used by ByteLevel."""
    bs = (list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
          + list(range(ord("®"), ord("ÿ") + 1)))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {b: chr(c) for b, c in zip(bs, cs)}


class StreamDecoder:
    """Incremental detokenizer: text can be printed token by token.

    A byte-level token may end in the middle of a UTF-8 sequence (an emoji is
    often 2–4 tokens); the tail is held back until it completes, so no
    replacement characters appear mid-stream. Concatenating every ``push``
    and the final ``flush`` equals ``Tokenizer.decode`` of the same ids.
    """

    def __init__(self, tokenizer: "Tokenizer", skip_special_tokens: bool = False):
        self._tok = tokenizer
        self._skip = skip_special_tokens
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def push(self, token_id: int) -> str:
        """Text completed by this token ('' while a UTF-8 sequence is pending)."""
        if self._skip and token_id in self._tok.special_ids:
            return ""
        return self._utf8.decode(self._tok.token_bytes(token_id))

    def flush(self) -> str:
        """End of stream: whatever is pending (a broken tail becomes U+FFFD)."""
        return self._utf8.decode(b"", final=True)


class Tokenizer:
    """Byte-level BPE tokenizer built from a GGUF file's metadata."""

    def __init__(self, tokens: Sequence[str], merges: Sequence[str], token_types: Sequence[int],
                 *, pre: str = "smollm", chat_template: str | None = None,
                 eos_token: str = "<|im_end|>", bos_id: int | None = None):
        if len(tokens) != len(token_types):
            raise TokenizerError(f"{len(tokens)} tokens but {len(token_types)} token types")
        vocab: dict[str, int] = {}
        for i, t in enumerate(tokens):
            if t in vocab:
                raise TokenizerError(f"duplicate token {t!r} at ids {vocab[t]} and {i}")
            vocab[t] = i
        pairs = []
        for m in merges:
            a, sep, b = m.partition(" ")  # byte-level symbols never hold a real space
            if not sep:
                raise TokenizerError(f"malformed merge {m!r}")
            pairs.append((a, b))

        self._tokens = list(tokens)
        self._types = [int(t) for t in token_types]
        bpe = models.BPE(vocab=vocab, merges=pairs, fuse_unk=False, byte_fallback=False)
        tk = _HFTokenizer(bpe)
        byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
        if pre in _DIGITS_THEN_BYTELEVEL:
            tk.pre_tokenizer = pre_tokenizers.Sequence(
                [pre_tokenizers.Digits(individual_digits=True), byte_level])
        elif pre in _BYTELEVEL_ONLY:
            tk.pre_tokenizer = byte_level
        else:
            raise TokenizerError(f"unsupported tokenizer.ggml.pre {pre!r}")
        tk.decoder = decoders.ByteLevel()
        added = []
        for i, (t, ty) in enumerate(zip(self._tokens, self._types)):
            if ty == _TYPE_CONTROL:
                added.append(AddedToken(t, special=True, normalized=False))
            elif ty == _TYPE_USER_DEFINED:
                added.append(AddedToken(t, special=False, normalized=False))
        tk.add_special_tokens([a for a in added if a.special])
        tk.add_tokens([a for a in added if not a.special])
        self._tk = tk

        self.special_ids = frozenset(i for i, ty in enumerate(self._types) if ty == _TYPE_CONTROL)
        self._added_ids = frozenset(i for i, ty in enumerate(self._types)
                                    if ty in (_TYPE_CONTROL, _TYPE_USER_DEFINED))
        eos = vocab.get(eos_token)
        if eos is None:
            raise TokenizerError(f"end-of-turn token {eos_token!r} not in the vocabulary")
        self.eos_id: int = eos
        #: the model's BOS id; informational only — SmolLM2 prepends no BOS.
        self.bos_id = bos_id
        self.chat_template = chat_template
        self.pre = pre
        u2b = {c: b for b, c in bytes_to_unicode().items()}
        self._u2b = u2b

    # -- construction ---------------------------------------------------
    @classmethod
    def from_gguf(cls, source: GGUFModel | str | os.PathLike[str] | None = None) -> "Tokenizer":
        """Build from a parsed :class:`GGUFModel`, a GGUF path, or the default GGUF."""
        model = source if isinstance(source, GGUFModel) else read_gguf(source, progress=False)
        kind = model.metadata("tokenizer.ggml.model", None)
        if kind is None:
            raise TokenizerError(f"{model.path} carries no tokenizer (tokenizer.ggml.model)")
        if kind != "gpt2":
            raise TokenizerError(f"unsupported tokenizer.ggml.model {kind!r} "
                                 "(only byte-level BPE 'gpt2' is supported)")
        try:
            tokens = model.metadata("tokenizer.ggml.tokens")
            merges = model.metadata("tokenizer.ggml.merges")
            types = model.metadata("tokenizer.ggml.token_type")
        except LLMError as exc:
            raise TokenizerError(str(exc)) from exc
        if model.metadata("tokenizer.ggml.add_bos_token", False):
            # Not the case for SmolLM2; refuse rather than silently differ.
            raise TokenizerError("tokenizer.ggml.add_bos_token is set; BOS prepending "
                                 "is not implemented")
        return cls(tokens, merges, types,
                   pre=str(model.metadata("tokenizer.ggml.pre", "default")),
                   chat_template=model.metadata("tokenizer.chat_template", None),
                   bos_id=model.metadata("tokenizer.ggml.bos_token_id", None))

    # -- vocabulary -----------------------------------------------------
    @property
    def hf(self) -> _HFTokenizer:
        """The underlying ``tokenizers.Tokenizer``."""
        return self._tk

    @property
    def vocab_size(self) -> int:
        return len(self._tokens)

    def id_to_token(self, token_id: int) -> str:
        """The vocabulary string (byte-level alphabet for normal tokens)."""
        return self._tokens[token_id]

    def token_to_id(self, token: str) -> int | None:
        return self._tk.token_to_id(token)

    def token_bytes(self, token_id: int) -> bytes:
        """The exact bytes a token stands for."""
        if not 0 <= token_id < len(self._tokens):
            raise TokenizerError(f"token id {token_id} out of range 0..{len(self._tokens) - 1}")
        s = self._tokens[token_id]
        if token_id in self._added_ids:
            return s.encode("utf-8")
        try:
            return bytes(self._u2b[c] for c in s)
        except KeyError:  # not byte-level alphabet: behave like the HF decoder
            return s.encode("utf-8")

    # -- text <-> ids ---------------------------------------------------
    def encode(self, text: str) -> list[int]:
        if not isinstance(text, str):
            raise TypeError(f"encode() takes str, not {type(text).__name__}")
        return self._tk.encode(text, add_special_tokens=False).ids

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = False) -> str:
        ids = [int(i) for i in ids]
        for i in ids:
            if not 0 <= i < len(self._tokens):
                raise TokenizerError(f"token id {i} out of range 0..{len(self._tokens) - 1}")
        return self._tk.decode(ids, skip_special_tokens=skip_special_tokens)

    def stream(self, skip_special_tokens: bool = False) -> StreamDecoder:
        """A fresh incremental decoder (see :class:`StreamDecoder`)."""
        return StreamDecoder(self, skip_special_tokens)

    # -- chat -----------------------------------------------------------
    def apply_chat_template(self, messages: Sequence[Mapping[str, Any]],
                            add_generation_prompt: bool = True,
                            renderer: str = "auto") -> str:
        """Render a conversation as the model's prompt text.

        ``renderer``: ``"jinja"`` (the GGUF's template through jinja2),
        ``"builtin"`` (hand-written ChatML, SmolLM2's format) or ``"auto"``
        (jinja, falling back to builtin with a warning if it cannot render).
        """
        msgs = _check_messages(messages)
        if renderer == "builtin":
            return render_chatml(msgs, add_generation_prompt)
        if renderer not in ("auto", "jinja"):
            raise ValueError(f"renderer must be 'auto', 'jinja' or 'builtin', not {renderer!r}")
        try:
            if not self.chat_template:
                raise ChatTemplateError("the GGUF has no tokenizer.chat_template")
            return _render_jinja(self.chat_template, msgs, add_generation_prompt,
                                 bos=self._tokens[self.bos_id] if self.bos_id is not None else "",
                                 eos=self._tokens[self.eos_id])
        except ChatTemplateError as exc:
            if renderer == "jinja":
                raise
            warnings.warn(f"chat template not rendered with jinja2 ({exc}); "
                          "using the built-in ChatML renderer", RuntimeWarning, stacklevel=2)
            return render_chatml(msgs, add_generation_prompt)

    def encode_chat(self, messages: Sequence[Mapping[str, Any]],
                    add_generation_prompt: bool = True) -> list[int]:
        return self.encode(self.apply_chat_template(messages, add_generation_prompt))


def render_chatml(messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = True,
                  default_system: str = SMOLLM2_DEFAULT_SYSTEM) -> str:
    """SmolLM2's chat template by hand (ChatML, default system prompt first)."""
    msgs = _check_messages(messages)
    out = []
    if msgs and msgs[0]["role"] != "system":
        out.append(f"<|im_start|>system\n{default_system}<|im_end|>\n")
    for m in msgs:
        out.append(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n")
    if add_generation_prompt:
        out.append("<|im_start|>assistant\n")
    return "".join(out)


def _check_messages(messages: Sequence[Mapping[str, Any]]) -> list[dict[str, str]]:
    if isinstance(messages, (str, bytes)) or not isinstance(messages, Sequence):
        raise ChatTemplateError("messages must be a list of {'role': ..., 'content': ...}")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, Mapping) or not isinstance(m.get("role"), str) \
                or not isinstance(m.get("content"), str):
            raise ChatTemplateError(f"message {i} needs str 'role' and 'content': {m!r}")
        out.append(dict(m))
    return out


def _render_jinja(template: str, messages: list[dict[str, str]], add_generation_prompt: bool,
                  bos: str, eos: str) -> str:
    # Same environment as transformers' apply_chat_template, so the output
    # matches what the model was fine-tuned on.
    try:
        import jinja2
        from jinja2.sandbox import ImmutableSandboxedEnvironment
    except ImportError as exc:
        raise ChatTemplateError("jinja2 is not installed") from exc

    def raise_exception(message: str) -> None:
        raise ChatTemplateError(f"chat template raised: {message}")

    try:
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                            extensions=["jinja2.ext.loopcontrols"])
        env.globals["raise_exception"] = raise_exception
        return env.from_string(template).render(
            messages=messages, add_generation_prompt=add_generation_prompt,
            bos_token=bos, eos_token=eos)
    except jinja2.TemplateError as exc:
        raise ChatTemplateError(f"{type(exc).__name__}: {exc}") from exc
