"""The KV dtype option: float16 KV holds 512 tokens in the 12 MiB KV region,
int8 KV with a float32 scale per head and position 1,024 (float32: 256).
Oracle: the float32 numpy reference (float32 KV).

Float16 rounds each cached K/V element to 11 significant bits (relative error
<= 2^-11); int8 to 1/254 of its row's largest magnitude.  Through 30 layers
that moves the logits by up to LOGIT_TOL[dtype] (3x the measured figure
below).  A greedy token may differ from the float32 reference only where the
reference's top-2 logit gap is below 2 × that tolerance (docs/llm.md, "KV dtype").
"""
from __future__ import annotations

import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
from conftest import CACHE, Device  # noqa: E402
from test_llm_device import PROMPTS, _ref_greedy  # noqa: E402

# max |Δlogit| vs the float32 reference over a 450-token prompt + 5 decode steps: 3x the measured figure
LOGIT_TOL = {"float16": 0.04,   # measured 0.013
             "int8": 1.2}       # measured 0.41
CONTEXT = {"float16": 512, "int8": 1024}
_REF: dict = {}

SMOL = SimpleNamespace(n_layers=30, hidden_size=576, n_heads=9, n_kv_heads=3, head_dim=64, ffn_size=1536,
                       vocab_size=49152, rope_theta=100000.0, rms_eps=1e-5, rope_dim=64)


@pytest.fixture(scope="module")
def device():
    d = Device()
    yield d
    d.stop()


@pytest.fixture(scope="module", params=["float16", "int8"])
def llm16(request, device):
    """The model compiled with a narrower KV (one at a time on one device)."""
    from dspx.compiler.llm import compiled_dir
    from dspx.host.client import Client
    from dspx.host.llm import DeviceLLM

    path = compiled_dir(cache_dir=CACHE, progress=False, context=CONTEXT[request.param], kv_dtype=request.param,
                        decode_activations="float32")  # held to the float32 reference's tolerance
    c = Client(device.path, timeout=120)
    m = DeviceLLM(path, client=c, progress=False)
    yield m
    m.close()
    c.close()


@pytest.fixture(scope="module")
def f16_dir():
    from dspx.compiler.llm import compiled_dir
    return compiled_dir(cache_dir=CACHE, progress=False, context=512, kv_dtype="float16",
                        decode_activations="float32")  # the package llm16 loads


@pytest.fixture(scope="module")
def tok():
    from dspx.llm import Tokenizer
    return Tokenizer.from_gguf(None)


@pytest.fixture(scope="module")
def ref():
    import llm_reference as R
    return R.ReferenceLlama(max_seq=512)


def test_context_option_names_the_largest_that_fits():
    from dspx.compiler.llm import LLMCompileError, dims_of

    d = dims_of(SMOL, 512, 64, "float16")
    assert d.kv_shape == (1, 3, 512, 64) and d.kv_bytes == 196_608
    with pytest.raises(LLMCompileError, match=r"context 1024 does not fit: its float16 KV cache takes 23,592,960 "
                                              r"bytes and the KV region holds 12,582,912; the largest context "
                                              r"that fits with float16 KV is 512"):
        dims_of(SMOL, 1024, 64, "float16")
    with pytest.raises(LLMCompileError, match=r"largest context that fits with float32 KV is 256"):
        dims_of(SMOL, 320, 64, "float32")
    with pytest.raises(LLMCompileError, match=r"largest context that fits with int8 KV is 1024"):
        dims_of(SMOL, 1088, 64, "int8")
    assert dims_of(SMOL, 1024, 64, "int8").kv_shape == (1, 3, 1024, 68)  # 64 values + a float32 scale per row
    with pytest.raises(LLMCompileError, match=r"KV dtype 'int4' is not one of float32, float16, int8"):
        dims_of(SMOL, 256, 64, "int4")


def test_f16_package_layout(f16_dir):
    import json

    meta = json.loads((f16_dir / "metadata.json").read_text())
    kv = meta["kv"]
    assert meta["context"] == 512 and kv["dtype"] == "float16" and kv["shape"] == [1, 3, 512, 64]
    assert kv["total_bytes"] == 60 * 3 * 512 * 64 * 2 == 11_796_480 <= 12 << 20
    assert all(t["dtype"] == "float16" for t in meta["modules"]["decode"]["inputs"][3:])  # after ids, positions, bases


@pytest.mark.parametrize("prompt", PROMPTS)
def test_narrow_kv_greedy_matches_f32_reference(llm16, ref, tok, prompt):
    from dspx.host.llm import Generator

    ids = tok.encode_chat([{"role": "user", "content": prompt}])
    if prompt not in _REF:  # the reference's answer, once for both dtypes
        _REF[prompt] = _ref_greedy(ref, ids, 32)
    want, gaps = _REF[prompt]
    got = Generator(llm16, tok).generate(ids, 32).ids
    near_tie = 2 * LOGIT_TOL[llm16.kv_dtype]
    tie = next((i for i, gp in enumerate(gaps) if gp < near_tie), len(want))
    same = next((i for i, (a, b) in enumerate(zip(got, want)) if a != b), min(len(got), len(want)))
    print(f"{prompt!r}: {llm16.kv_dtype} KV == f32 reference for {same} of {len(want)} tokens (first gap < "
          f"{near_tie} at {tie}); {tok.decode(got)!r}")
    assert got[:tie] == want[:tie]
    if tie == len(want):
        assert got == want


def test_narrow_kv_past_256_positions(llm16, ref, tok):
    """A 450-token prompt (more than float32 KV holds) and decode up to position 455, against the reference."""
    words = ("The quick brown fox jumps over the lazy dog while the cat sleeps in the warm sun. " * 30).split()
    ids = tok.encode_chat([{"role": "user", "content": " ".join(words)[:1800] + "\nSummarize."}])
    ids = ids[:450 - 5] + ids[-5:]
    assert 256 < len(ids) <= 450
    if "long" not in _REF:  # the reference's prefill + 5 decode steps (its own argmax fed back), once
        steps = [ref.prefill(ids)[-1]]
        for i in range(5):
            steps.append(ref.decode(int(steps[-1].argmax()), len(ids) + i))
        _REF["long"] = steps
    want = _REF["long"]
    # stale bytes past the position must never reach the output: fill the whole KV region with
    # 0xFF (NaN in float16 and in the int8 rows' float32 scales; the kernels read whole 16-position
    # blocks and must mask the positions after the query's)
    for off in llm16.kv_offsets:
        llm16.client.kv_view(off, llm16.kv_shape, llm16.kv_dtype).view(np.uint8)[...] = 0xFF
    errs = [float(np.abs(llm16.prefill(ids, 0) - want[0]).max())]
    chosen = llm16.decode_kind
    try:  # both decode modules (decode_parallel splits each KV head's ~28 blocks of 16 positions in two)
        for kind in ("serial", "parallel"):
            llm16.use_decode(kind)
            for i in range(5):
                d = llm16.decode(int(want[i].argmax()), len(ids) + i)
                errs.append(float(np.abs(d - want[i + 1]).max()))
    finally:
        llm16.use_decode(chosen)
    print(f"{len(ids)}-token prompt: max |Δlogit| {llm16.kv_dtype} KV vs f32 reference {max(errs):.3f} "
          f"(prefill + 5 decode steps)")
    assert max(errs) < LOGIT_TOL[llm16.kv_dtype], errs
