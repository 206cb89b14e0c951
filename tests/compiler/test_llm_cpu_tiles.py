"""The LLM's GEMMs on every register tiling they can be built with (the
prefill micro-tiles, the decode GEMV slices): each gives the numpy
reference's values and the very same bits as the others, for AVX2 and
AVX-512 code alike (whichever this CPU can run; the rest is compiled and its
CPU features named), and the measured choice of the prefill tile is cached
per CPU."""
from __future__ import annotations

import json

import numpy as np
import pytest

pytest.importorskip("tvm")

import tvm  # noqa: E402

from dspx.compiler.llm import Dims, decode_slice, prefill_tile, vector_lanes  # noqa: E402
from dspx.compiler.llm.tir.gemv import _q4_1_decode, _q4_1_prefill, _q8_0_decode  # noqa: E402
from dspx.compiler.llm.tuning import CANDIDATES, prefill_tile_for  # noqa: E402
from dspx.compiler.target import cpu_features  # noqa: E402
from dspx.device.core.cpu import missing_features  # noqa: E402

M, K, N = 64, 96, 128  # 3 blocks of 32 along K, 2 tiles of 64 outputs
TARGETS = {"x86-64-v3": 8, "x86-64-v4": 16}  # AVX2 (16 ymm) and AVX-512 (32 zmm)


def _problem(rows: int):
    rng = np.random.default_rng(rows)
    nb = K // 32
    q = rng.integers(0, 256, (N // 64, nb, 16, 64), dtype=np.uint8)
    d = (rng.uniform(0.5, 2, (N // 64, nb, 64)) * 0.01).astype(np.float16)
    m = (rng.standard_normal((N // 64, nb, 64)) * 0.01).astype(np.float16)
    x = rng.standard_normal((M, K)).astype(np.float32)
    res = rng.standard_normal((M, N)).astype(np.float32)
    pos = np.full((1, M), -1, np.int64)
    pos[0, :rows] = np.arange(rows)
    # Q4_1 by hand: output n = tile n // 64, lane n % 64; element j of block b is the low nibble
    # of byte j, element 16 + j the high one; value = nibble * d + m
    w = np.zeros((K, N))
    for n in range(N):
        t, lane = divmod(n, 64)
        for b in range(nb):
            byte = q[t, b, :, lane].astype(np.int64)
            dd, mm = float(d[t, b, lane]), float(m[t, b, lane])
            w[b * 32:b * 32 + 16, n] = (byte & 15) * dd + mm
            w[b * 32 + 16:b * 32 + 32, n] = (byte >> 4) * dd + mm
    want = res.astype(np.float64) + x.astype(np.float64) @ w
    return [x, pos, q, d, m, res, np.zeros((M, N), np.float32)], want


def _build(tile, mcpu: str):
    f = _q4_1_prefill(M, K, N, tile).with_attr("global_symbol", "g")
    return tvm.compile(tvm.IRModule({"g": f}), target={"kind": "llvm", "mcpu": mcpu})["g"]


@pytest.mark.parametrize("mcpu", sorted(TARGETS))
def test_every_micro_tile_gives_the_reference_and_the_same_bits(mcpu):
    lanes = TARGETS[mcpu]
    assert vector_lanes(cpu_features(mcpu)) == lanes
    tiles = sorted(set(CANDIDATES[lanes]) | {prefill_tile(lanes)})
    fns = {t: _build(t, mcpu) for t in tiles}  # every tile compiles for either CPU
    lacking = missing_features(cpu_features(mcpu))
    if lacking:  # the loader refuses such a module by these names (test_compiler.py checks the refusal)
        assert mcpu == "x86-64-v4" and "avx512f" in lacking
        return
    for rows in (37, 64, 5):  # a partial last group of every tile height, a full chunk, fewer rows than a tile
        args, want = _problem(rows)
        outs = {}
        for t, fn in fns.items():
            targs = [tvm.runtime.tensor(a) for a in args]
            fn(*targs)
            outs[t] = targs[-1].numpy()
        first = outs[tiles[0]][:rows]  # padding rows (position -1) are don't-care: a tile's last group may fill them
        np.testing.assert_allclose(first, want[:rows], rtol=1e-5, atol=1e-4)
        for t in tiles[1:]:
            assert np.array_equal(outs[t][:rows], first), f"tile {t} differs from {tiles[0]} at {rows} rows"


@pytest.mark.parametrize("mcpu", sorted(TARGETS))
def test_every_decode_slice_gives_the_reference_and_the_same_bits(mcpu):
    assert decode_slice(TARGETS[mcpu]) in (32, 64)
    if missing_features(cpu_features(mcpu)):
        return  # compiled by the test above; this CPU cannot run it
    (x, _, q, d, m, res, _), want = _problem(1)
    rng = np.random.default_rng(7)
    q8 = rng.integers(-128, 128, (N // 64, K // 32, 32, 64), dtype=np.int8)
    w8 = q8.astype(np.float64) * d.astype(np.float64)[:, :, None, :]  # (tile, block, element, lane)
    want8 = x[:1].astype(np.float64) @ w8.transpose(1, 2, 0, 3).reshape(K, N)
    outs = {}
    for dv in (64, 32, 16):
        for name, f, args in (("q4_1", _q4_1_decode(K, N, False, dv), [x[:1], q, d, m, res[:1]]),
                              ("q8_0", _q8_0_decode(K, N, False, dv), [x[:1], q8, d])):
            fn = tvm.compile(tvm.IRModule({"g": f.with_attr("global_symbol", "g")}),
                             target={"kind": "llvm", "mcpu": mcpu})["g"]
            out = np.zeros((1, N) if name == "q4_1" else (1, 1, N), np.float32)
            targs = [tvm.runtime.tensor(a) for a in args + [out]]
            fn(*targs)
            outs[name, dv] = targs[-1].numpy().reshape(1, N)
    np.testing.assert_allclose(outs["q4_1", 64], want[:1], rtol=1e-5, atol=1e-4)
    np.testing.assert_allclose(outs["q8_0", 64], want8, rtol=1e-5, atol=1e-4)
    for name, dv in outs:
        assert np.array_equal(outs[name, dv], outs[name, 64]), f"{name} slice {dv} differs from 64"


def test_the_register_count_tiles_fit_the_register_files():
    for lanes, regs in ((8, 16), (16, 32)):
        for rows, outs in CANDIDATES[lanes] + (prefill_tile(lanes),):
            acc = rows * outs // lanes
            assert acc + outs // lanes + 1 <= regs, (lanes, rows, outs)  # accumulators + weights + broadcast


def test_the_measured_tile_is_cached_per_cpu(tmp_path, monkeypatch):
    monkeypatch.setenv("DSPX_CACHE", str(tmp_path))
    d = Dims(n_layers=1, dim=64, n_heads=1, n_kv=1, head_dim=64, ffn=64, vocab=64, theta=1e4, eps=1e-5)
    target = tvm.target.Target({"kind": "llvm", "mcpu": "x86-64-v3"})
    assert prefill_tile_for(d, target, 8, here=False)["tile"] == [6, 16]  # another CPU: the register-count default
    choice = prefill_tile_for(d, target, 8, here=True)
    assert tuple(choice["tile"]) in CANDIDATES[8] and set(choice["us"]) == {"6x16", "4x16", "2x32"}
    assert min(choice["us"], key=choice["us"].get) == "x".join(map(str, choice["tile"]))
    (cached,) = (tmp_path / "llm-tiles").glob("*.json")
    cached.write_text(json.dumps({**choice, "tile": [2, 32], "chosen_by": "planted"}))
    assert prefill_tile_for(d, target, 8, here=True)["chosen_by"] == "planted"  # read back, not timed again
    blocked = tmp_path / "a-file"
    blocked.write_text("")
    monkeypatch.setenv("DSPX_CACHE", str(blocked / "cache"))  # a cache that cannot be made: timed, not cached
    assert tuple(prefill_tile_for(d, target, 8, here=True)["tile"]) in CANDIDATES[8]
