"""A short run of the C decoder fuzzer (c_fuzz.py: Atheris on fuzz_decoder.c
under ASan + UBSan); the long run is benchmarks/fuzz_c.py (docs/testing.md,
"Fuzzing")."""
from __future__ import annotations

import c_fuzz

INPUTS = 20_000


def test_the_c_decoder_survives_fuzzed_replies(tmp_path):
    r = c_fuzz.run(INPUTS, seed=7, workdir=tmp_path)
    assert r["reports"] == [], r["stderr_tail"]
    assert r["returncode"] == 0, r["stderr_tail"]
    assert r["inputs"] == INPUTS and r["unexpected"] == []
    codes = {int(k.split()[0]) for k in r["outcomes"]}
    # every refusal is reached, and so is success with outputs handed back
    assert {0, -71} <= codes
    words = " ".join(r["outcomes"])
    for text in ("shorter than the header", "longer than", "len field", "its size is", "holds fewer than",
                 "descriptor region", "is outside output_buf", "is not a tensor", "response type"):
        assert text in words, text
    assert any(k.startswith("0 ") and not k.startswith("0 0") for k in r["outcomes"])
