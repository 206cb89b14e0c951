"""dspx.llm.Tokenizer (SmolLM2, rebuilt from GGUF metadata).

The expected id lists below were produced once and cross-checked three
independent ways, all of which these tests re-run:
  1. a pure-Python byte-level BPE written here (specials split out first,
     numeric characters isolated like HF's Digits(individual_digits=True),
     the GPT-2 pattern by Unicode category, then merges by rank) reading the
     vocabulary and merges straight from the GGUF with the gguf package;
  2. the vocabulary strings of the ids concatenate to the GPT-2 byte-to-
     unicode image of the input's UTF-8 bytes (specials verbatim);
  3. structural facts: every digit is its own token, every control token is a
     single id, no BOS is prepended.
"""

from __future__ import annotations

import unicodedata
import warnings

import gguf
import pytest

from dspx.llm import (
    ChatTemplateError,
    GGUFModel,
    Tokenizer,
    TokenizerError,
    find_default_gguf,
    read_gguf,
    render_chatml,
)

EXPECTED: dict[str, list[int]] = {
    "12345": [33, 34, 35, 36, 37],
    "café naïve": [83, 1939, 2756, 15486, 46494],
    "🙂👍": [10813, 38887, 10813, 235, 231],
    "你好世界": [18645, 250, 48392, 138, 7906, 240, 178, 239, 230],
    "def f(x):\n    return x**2": [1604, 275, 24, 104, 727, 472, 1003, 1792, 828, 34],
    "<|im_start|>user\nhi<|im_end|>": [1, 4093, 198, 6004, 2],
    "Hello world": [19556, 905],
    "I'm sure they'll say it's fine, don't you think?":
        [57, 5248, 2090, 502, 3060, 1643, 357, 506, 4979, 28, 1326, 982, 346, 1510, 47],
    "  leading and trailing  ": [216, 2899, 284, 35079, 256],
    "tabs\tand\nnewlines\r\n": [100, 7366, 197, 397, 198, 2241, 5110, 2738],
    "3.14159 and 1,000,000": [35, 30, 33, 36, 33, 37, 41, 284, 216, 33, 28, 32, 32, 32, 28, 32, 32, 32],
    "x² + ½ = Ⅻ": [104, 19133, 1232, 216, 16738, 446, 216, 173, 223, 121],
    "Ångström résumé": [142, 223, 863, 1321, 45682, 412, 2756, 5422, 2756],
    "<|im_start|>assistant\n<|im_end|><|endoftext|>": [1, 520, 9531, 198, 2, 0],
    "a<|im_end|>b": [81, 2, 82],
    "": [],
    " ": [216],
    "\n\n\n": [16506],
}

FRANCE_PROMPT = (
    "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face"
    "<|im_end|>\n<|im_start|>user\nWhat is the capital of France?<|im_end|>\n"
    "<|im_start|>assistant\n")
FRANCE_IDS = [1, 9690, 198, 2683, 359, 253, 5356, 5646, 11173, 3365, 3511, 308, 34519, 28,
              7018, 411, 407, 19712, 8182, 2, 198, 1, 4093, 198, 1780, 314, 260, 3575, 282,
              4649, 47, 2, 198, 1, 520, 9531, 198]

# Id lists published by independent SmolLM2 projects, produced with the
# Hugging Face tokenizer (tokenizer.json + transformers' chat template): an
# external check that the rebuilt tokenizer is HF's, not just self-consistent.
PUBLISHED_CHAT = {
    "Quelle est la capitale de la France ? Réponds en une phrase.":
        FRANCE_IDS[:24] + [65, 2726, 290, 1264, 2618, 47765, 1121, 367, 2618, 4649, 9148, 428,
                           2756, 96, 19870, 430, 16520, 8715, 30, 2, 198, 1, 520, 9531, 198],
    "hello world": FRANCE_IDS[:24] + [28120, 905, 2, 198, 1, 520, 9531, 198],
}
PUBLISHED_TEXT = {
    "Explain in three short sentences why plants need sunlight.":
        [36971, 281, 1296, 1890, 8545, 1701, 2109, 737, 8118, 30],
    "Hello! How can I help you today?": [19556, 17, 1073, 416, 339, 724, 346, 1834, 47],
    "The capital of France is Paris.": [504, 3575, 282, 4649, 314, 7042, 30],
}


# ---------------------------------------------------------------------------
# fixtures: one GGUF parse for the whole module

@pytest.fixture(scope="module")
def model() -> GGUFModel:
    return read_gguf(find_default_gguf(), progress=False)


@pytest.fixture(scope="module")
def tok(model) -> Tokenizer:
    return Tokenizer.from_gguf(model)


@pytest.fixture(scope="module")
def vocab_data():
    """Vocabulary straight from the file with gguf, not through dspx."""
    r = gguf.GGUFReader(str(find_default_gguf()))
    f = r.fields
    return (f["tokenizer.ggml.tokens"].contents(), f["tokenizer.ggml.merges"].contents(),
            f["tokenizer.ggml.token_type"].contents())


# ---------------------------------------------------------------------------
# the independent encoder

def _bytes_to_unicode() -> dict[int, str]:
    keep = list(range(33, 127)) + list(range(161, 173)) + list(range(174, 256))
    table, extra = {b: chr(b) for b in keep}, 0
    for b in range(256):
        if b not in table:
            table[b] = chr(256 + extra)
            extra += 1
    return table


B2U = _bytes_to_unicode()


def _cat(c: str) -> str:
    return unicodedata.category(c)[0]  # 'L' letters, 'N' numbers, ...


def _gpt2_split(s: str) -> list[str]:
    """'s|'t|'re|'ve|'m|'ll|'d| ?\\p{L}+| ?\\p{N}+| ?[^\\s\\p{L}\\p{N}]+|\\s+(?!\\S)|\\s+"""
    out, i, n = [], 0, len(s)
    classes = (lambda c: _cat(c) == "L", lambda c: _cat(c) == "N",
               lambda c: not (c.isspace() or _cat(c) in "LN"))
    while i < n:
        if s[i] == "'":
            suf = next((x for x in ("s", "t", "re", "ve", "m", "ll", "d") if s.startswith(x, i + 1)), None)
            if suf:
                out.append(s[i:i + 1 + len(suf)])
                i += 1 + len(suf)
                continue
        j = i + 1 if s[i] == " " else i  # the optional leading space
        for cls in classes:
            k = j
            while k < n and cls(s[k]):
                k += 1
            if k > j:
                break
        else:
            k = i
            while k < n and s[k].isspace():
                k += 1
            if k < n and k - 1 > i:  # \s+(?!\S): leave one space for the next word
                k -= 1
        out.append(s[i:k])
        i = k
    return out


class IndependentBPE:
    def __init__(self, tokens, merges, types):
        self.vocab = {t: i for i, t in enumerate(tokens)}
        self.rank = {tuple(m.split(" ")): r for r, m in enumerate(merges)}
        self.specials = [t for t, ty in zip(tokens, types) if ty == 3]

    def _bpe(self, word: str) -> list[int]:
        syms = list(word)
        while len(syms) > 1:
            r, i = min((self.rank.get(p, 1 << 30), i) for i, p in enumerate(zip(syms, syms[1:])))
            if r == 1 << 30:
                break
            syms[i:i + 2] = [syms[i] + syms[i + 1]]
        return [self.vocab[s] for s in syms]

    def encode(self, text: str) -> list[int]:
        ids = []
        while text:
            hits = [(text.find(s), -len(s), s) for s in self.specials if s in text]
            special = None
            if hits:
                at, _, special = min(hits)
                before, text = text[:at], text[at + len(special):]
            else:
                before, text = text, ""
            pieces, cur = [], ""
            for c in before:  # Digits(individual_digits=True): every numeric char alone
                if c.isnumeric():
                    pieces += [cur, c] if cur else [c]
                    cur = ""
                else:
                    cur += c
            if cur:
                pieces.append(cur)
            for piece in pieces:
                for w in _gpt2_split(piece):
                    ids += self._bpe("".join(B2U[b] for b in w.encode("utf-8")))
            if special:
                ids.append(self.vocab[special])
        return ids


# ---------------------------------------------------------------------------

@pytest.mark.parametrize("text", list(EXPECTED))
def test_encode_fixed_ids(tok, text):
    assert tok.encode(text) == EXPECTED[text]


def test_matches_published_hf_ids(tok):
    assert tok.encode_chat([{"role": "user", "content": "What is the capital of France?"}]) == FRANCE_IDS
    for content, ids in PUBLISHED_CHAT.items():
        assert tok.encode_chat([{"role": "user", "content": content}]) == ids, content
    for text, ids in PUBLISHED_TEXT.items():
        assert tok.encode(text) == ids, text


def test_independent_bpe_agrees_with_fixed_ids(vocab_data):
    ind = IndependentBPE(*vocab_data)
    for text, ids in EXPECTED.items():
        assert ind.encode(text) == ids, text
    assert ind.encode(FRANCE_PROMPT) == FRANCE_IDS


def test_ids_spell_the_byte_level_input(vocab_data):
    tokens, _, types = vocab_data
    for text, ids in EXPECTED.items():
        got = "".join(tokens[i] for i in ids)
        want, rest = "", text
        # control tokens stand for themselves; everything else is byte-level
        for part in _split_keep(rest, [t for t, ty in zip(tokens, types) if ty == 3]):
            want += part[1] if part[0] else "".join(B2U[b] for b in part[1].encode("utf-8"))
        assert got == want, text


def _split_keep(text: str, specials: list[str]) -> list[tuple[bool, str]]:
    out = []
    while text:
        hits = [(text.find(s), s) for s in specials if s in text]
        if not hits:
            out.append((False, text))
            break
        at, s = min(hits)
        if at:
            out.append((False, text[:at]))
        out.append((True, s))
        text = text[at + len(s):]
    return out


def test_digits_are_single_tokens(tok):
    for text in ("12345", "3.14159 and 1,000,000", "year 2024: 99 problems"):
        for i in tok.encode(text):
            s = tok.token_bytes(i).decode("utf-8")
            assert sum(c.isdigit() for c in s) <= 1, (text, s)
            if any(c.isdigit() for c in s):
                assert len(s) == 1, (text, s)  # the space before a number stays separate


def test_control_tokens_are_single_special_ids(tok, vocab_data):
    tokens, _, types = vocab_data
    controls = [i for i, ty in enumerate(types) if ty == 3]
    assert controls == list(range(17))
    assert tok.special_ids == frozenset(controls)
    for i in controls:
        assert tok.encode(tokens[i]) == [i]
        assert tok.encode("x" + tokens[i] + "y")[1] == i


def test_eos_bos_and_no_bos_prepended(tok):
    assert tok.eos_id == 2 and tok.id_to_token(2) == "<|im_end|>"
    assert tok.bos_id == 1 and tok.encode("hi")[0] != 1
    assert tok.vocab_size == 49152


@pytest.mark.parametrize("text", list(EXPECTED))
def test_decode_round_trip(tok, text):
    assert tok.decode(EXPECTED[text]) == text


def test_decode_skip_special(tok):
    assert tok.decode(EXPECTED["<|im_start|>user\nhi<|im_end|>"], skip_special_tokens=True) == "user\nhi"


@pytest.mark.parametrize("text", list(EXPECTED))
def test_stream_decode_matches_decode(tok, text):
    sd = tok.stream()
    pieces = [sd.push(i) for i in EXPECTED[text]] + [sd.flush()]
    assert "".join(pieces) == tok.decode(EXPECTED[text]) == text
    assert all("\ufffd" not in p for p in pieces)  # never a half character


def test_stream_holds_partial_utf8(tok):
    sd = tok.stream()
    ids = EXPECTED["🙂👍"]  # F0 9F | 99 82 | F0 9F | 91 | 8D
    assert [sd.push(i) for i in ids] == ["", "🙂", "", "", "👍"]
    assert sd.flush() == ""
    sd = tok.stream()
    assert sd.push(ids[0]) == ""
    assert sd.flush() == "\ufffd"  # a truncated stream ends visibly, not silently


def test_token_bytes(tok):
    assert tok.token_bytes(216) == b" "
    assert tok.token_bytes(198) == b"\n"
    assert tok.token_bytes(2) == b"<|im_end|>"
    with pytest.raises(TokenizerError, match="out of range"):
        tok.token_bytes(49152)
    with pytest.raises(TokenizerError, match="out of range"):
        tok.decode([1, -1])


def test_encode_rejects_bytes(tok):
    with pytest.raises(TypeError):
        tok.encode(b"hi")  # type: ignore[arg-type]


# --- chat template ---------------------------------------------------------

CONVERSATIONS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "system", "content": "Answer in French."}, {"role": "user", "content": "Hi"}],
    [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "4"},
     {"role": "user", "content": "and 3+3? 🙂\n"}],
    [],
]


def test_chat_template_exact(tok):
    assert tok.chat_template.startswith("{% for message in messages %}")
    got = tok.apply_chat_template(CONVERSATIONS[0])
    assert got == FRANCE_PROMPT
    assert tok.encode(got) == FRANCE_IDS == tok.encode_chat(CONVERSATIONS[0])


@pytest.mark.parametrize("conv", CONVERSATIONS)
@pytest.mark.parametrize("gen", [True, False])
def test_jinja_and_builtin_renderers_agree(tok, conv, gen):
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # jinja must render, not fall back
        j = tok.apply_chat_template(conv, add_generation_prompt=gen, renderer="jinja")
        a = tok.apply_chat_template(conv, add_generation_prompt=gen)
    assert j == a == tok.apply_chat_template(conv, add_generation_prompt=gen, renderer="builtin")
    assert j == render_chatml(conv, gen)


def test_system_message_replaces_default(tok):
    s = tok.apply_chat_template(CONVERSATIONS[1], add_generation_prompt=False)
    assert s == ("<|im_start|>system\nAnswer in French.<|im_end|>\n"
                 "<|im_start|>user\nHi<|im_end|>\n")


def test_broken_template_falls_back_or_raises(vocab_data):
    t = Tokenizer(*vocab_data, pre="smollm", chat_template="{% for m in messages %}{{ m.role ")
    with pytest.warns(RuntimeWarning, match="built-in ChatML"):
        assert t.apply_chat_template(CONVERSATIONS[0]) == FRANCE_PROMPT
    with pytest.raises(ChatTemplateError):
        t.apply_chat_template(CONVERSATIONS[0], renderer="jinja")


def test_bad_messages(tok):
    with pytest.raises(ChatTemplateError, match="message 0"):
        tok.apply_chat_template([{"role": "user"}])
    with pytest.raises(ChatTemplateError):
        tok.apply_chat_template("hello")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="renderer"):
        tok.apply_chat_template(CONVERSATIONS[0], renderer="mustache")


def test_unsupported_tokenizer_kinds(vocab_data):
    with pytest.raises(TokenizerError, match="'llama-bpe'"):
        Tokenizer(*vocab_data, pre="llama-bpe")
    tokens, merges, types = vocab_data
    with pytest.raises(TokenizerError, match="token types"):
        Tokenizer(tokens, merges, types[:-1])
