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

from dspx.compiler.llm import Dims, decode_slice, prefill_tile, vector_lanes, vnni_lanes  # noqa: E402
from dspx.compiler.llm.tir.gemv import _q4_1_decode, _q4_1_prefill, _q8_0_decode, gemv_q4_1, gemv_q8_0  # noqa: E402
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
    want = res.astype(np.float64) + x.astype(np.float64) @ _dequantized(q, d, m)
    return [x, pos, q, d, m, res, np.zeros((M, N), np.float32)], want


def _dequantized(q, d, m):
    """Q4_1 by hand, (K, N) float64: output n = tile n // 64, lane n % 64; element j of block b is the
    low nibble of byte j, element 16 + j the high one; value = nibble * d + m."""
    w = np.zeros((K, N))
    for n in range(N):
        t, lane = divmod(n, 64)
        for b in range(K // 32):
            byte = q[t, b, :, lane].astype(np.int64)
            dd, mm = float(d[t, b, lane]), float(m[t, b, lane])
            w[b * 32:b * 32 + 16, n] = (byte & 15) * dd + mm
            w[b * 32 + 16:b * 32 + 32, n] = (byte >> 4) * dd + mm
    return w


def _decode_reference(x, q, d, m, res):
    """Decode's Q4_1 GEMV by hand, in numpy integers: each 32-element block of a row of x quantized as
    llama.cpp's Q8_1 (xd = max|x| / 127 and xq = rint(x * (1 / xd)) in float32, clamped to ±127), the
    block's dot product Σ nibble · xq exact, then d · xd · Σ + m · Σx in float64."""
    rows, nb = x.shape[0], K // 32
    xb = x.reshape(rows, nb, 32)
    amax = np.abs(xb).max(axis=2)
    xd = amax / np.float32(127)
    inv = np.where(amax > 0, np.float32(1) / np.where(amax > 0, xd, 1), np.float32(0)).astype(np.float32)
    xq = np.clip(np.rint(xb * inv[:, :, None]), -127, 127).astype(np.int64)
    out = res[:rows].astype(np.float64)
    for n in range(N):
        t, lane = divmod(n, 64)
        byte = q[t, :, :, lane].astype(np.int64)  # (block, 16)
        nib = np.concatenate([byte & 15, byte >> 4], axis=1)  # (block, 32): elements j and 16 + j
        isum = (nib[None] * xq).sum(axis=2)  # (rows, block), exact
        out[:, n] += (d[t, :, lane].astype(np.float64) * xd.astype(np.float64) * isum
                      + m[t, :, lane].astype(np.float64) * xb.astype(np.float64).sum(axis=2)).sum(axis=1)
    return out


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
    want_int8 = _decode_reference(x[:1], q, d, m, res)
    rng = np.random.default_rng(7)
    q8 = rng.integers(-128, 128, (N // 64, K // 32, 32, 64), dtype=np.int8)
    w8 = q8.astype(np.float64) * d.astype(np.float64)[:, :, None, :]  # (tile, block, element, lane)
    want8 = x[:1].astype(np.float64) @ w8.transpose(1, 2, 0, 3).reshape(K, N)
    outs = {}
    for dv in (64, 32, 16):
        for name, f, args in (("q4_1", _q4_1_decode(K, N, False, dv, int8=False), [x[:1], q, d, m, res[:1]]),
                              ("q4_1 int8", _q4_1_decode(K, N, False, dv), [x[:1], q, d, m, res[:1]]),
                              ("q8_0", _q8_0_decode(K, N, False, dv), [x[:1], q8, d])):
            fn = tvm.compile(tvm.IRModule({"g": f.with_attr("global_symbol", "g")}),
                             target={"kind": "llvm", "mcpu": mcpu})["g"]
            out = np.zeros((1, 1, N) if name == "q8_0" else (1, N), np.float32)
            targs = [tvm.runtime.tensor(a) for a in args + [out]]
            fn(*targs)
            outs[name, dv] = targs[-1].numpy().reshape(1, N)
    np.testing.assert_allclose(outs["q4_1", 64], want[:1], rtol=1e-5, atol=1e-4)
    np.testing.assert_allclose(outs["q4_1 int8", 64], want_int8, rtol=1e-5, atol=1e-4)
    np.testing.assert_allclose(outs["q8_0", 64], want8, rtol=1e-5, atol=1e-4)
    for name, dv in outs:
        assert np.array_equal(outs[name, dv], outs[name, 64]), f"{name} slice {dv} differs from 64"


def _run(f, args, out_shape, mcpu: str | None = None):
    target = {"kind": "llvm", "mcpu": mcpu} if mcpu else "llvm"
    fn = tvm.compile(tvm.IRModule({"g": f.with_attr("global_symbol", "g")}), target=target)["g"]
    targs = [tvm.runtime.tensor(a) for a in args + [np.zeros(out_shape, np.float32)]]
    fn(*targs)
    return targs[-1].numpy()


VNNI_CPUS = {"icelake-server": (16, "avx512_vnni"), "alderlake": (8, "avx_vnni")}  # zmm and ymm vpdpbusd


def _edge_rows():
    """Six rows of x and Q4_1 weights at the integer paths' edges (``test_decode_and_batched_rows…``)."""
    (x, _, q, d, m, res, _), _ = _problem(1)
    rows = 6
    x = x[:rows].copy()
    x[1] = np.abs(x[1]) + 1  # every element positive: with all nibbles 15 below, the largest int16 sums
    x[2, 32:64] = 0  # an all-zero block: xd = 0
    x[3, :32] *= -4  # a block whose max |x| is a negative value
    x[4, 5] = 1e6  # one huge element: the rest of its block quantizes to 0
    q = q.copy()
    q[:, :, :, :32] = 0xFF  # outputs 0-31 of each tile: nibbles all 15
    return rows, x, q, d, m, res


@pytest.mark.parametrize("int8", [True, False], ids=["int8", "float32"])
def test_decode_and_batched_rows_give_the_reference_and_the_same_bits(int8):
    """Decode's Q4_1 GEMV on each kind of input (``decode_activations``) against its hand reference, at
    the edges of the integer path's int16 sums (every nibble 15 times ±127: 30,480 of 32,767), an
    all-zero block, a block whose largest value is negative, one huge element, and rows batched 2 and
    4 at a time: each row's bits are decode's own."""
    rows, x, q, d, m, res = _edge_rows()
    if int8:
        want = _decode_reference(x, q, d, m, res)
    else:
        want = res[:rows].astype(np.float64) + x.astype(np.float64) @ _dequantized(q, d, m)
    one = np.concatenate([_run(_q4_1_decode(K, N, False, int8=int8), [x[r:r + 1], q, d, m, res[r:r + 1]], (1, N))
                          for r in range(rows)])
    np.testing.assert_allclose(one, want, rtol=1e-5, atol=1e-4)
    q8 = np.random.default_rng(8).integers(-128, 128, (N // 64, K // 32, 32, 64), dtype=np.int8)
    head = np.concatenate([_run(_q8_0_decode(K, N, False), [x[r:r + 1], q8, d], (1, 1, N))[0] for r in range(rows)])
    for real in (1, 2, 3, 6):  # a lone row; one pair; a group of 4 clamped to the last real row; a group and a pair
        pos = np.full((1, rows), -1, np.int64)
        pos[0, :real] = np.arange(real)
        batched = _run(gemv_q4_1(rows, K, N, False, batch=True, int8=int8), [x, pos, q, d, m, res[:rows]],
                       (rows, N))
        assert np.array_equal(batched[:real], one[:real]), f"{real} batched rows differ from decode's"
        logits = _run(gemv_q8_0(rows, K, N, False, batch=True), [x, pos, q8, d], (1, rows, N))[0]  # the LM head
        assert np.array_equal(logits[:real], head[:real]), f"{real} batched LM head rows differ from decode's"


@pytest.mark.parametrize("mcpu", sorted(VNNI_CPUS))
def test_the_vnni_block_sums_give_the_reference_and_the_int16_paths_bits(mcpu):
    """The VNNI decode and batched rows (vpdpbusd block sums, on zmm or ymm) against the hand reference,
    and bit for bit against the int16 decode on the same CPU, on the same edge rows; where this CPU lacks
    the feature they are compiled and their module names it for the loader to refuse."""
    rows, x, q, d, m, res = _edge_rows()
    width, feature = VNNI_CPUS[mcpu]
    features = cpu_features(mcpu)
    assert vnni_lanes(features) == width and feature in features
    decode = gemv_q4_1(1, K, N, False, vnni=width)
    batch = gemv_q4_1(rows, K, N, False, batch=True, vnni=width)
    reg = "%zmm" if width == 16 else "%ymm"
    for f in (decode, batch):
        asm = tvm.compile(tvm.IRModule({"g": f.with_attr("global_symbol", "g")}),
                          target={"kind": "llvm", "mcpu": mcpu}).mod.inspect_source("asm")
        assert any("vpdpbusd" in line and reg in line for line in asm.splitlines())
    if missing_features(features):
        assert feature in missing_features(features)
        return
    want = _decode_reference(x, q, d, m, res)
    int16 = np.concatenate([_run(_q4_1_decode(K, N, False), [x[r:r + 1], q, d, m, res[r:r + 1]], (1, N), mcpu)
                            for r in range(rows)])  # the same CPU: the same FMA contractions
    vnni = np.concatenate([_run(decode, [x[r:r + 1], q, d, m, res[r:r + 1]], (1, N), mcpu) for r in range(rows)])
    np.testing.assert_allclose(vnni, want, rtol=1e-5, atol=1e-4)
    assert np.array_equal(vnni, int16)
    for real in (1, 2, 3, 6):
        pos = np.full((1, rows), -1, np.int64)
        pos[0, :real] = np.arange(real)
        batched = _run(batch, [x, pos, q, d, m, res[:rows]], (rows, N), mcpu)
        assert np.array_equal(batched[:real], int16[:real]), f"{real} VNNI batched rows differ from decode's"


def test_the_register_count_tiles_fit_the_register_files():
    for lanes, regs in ((8, 16), (16, 32)):
        for rows, outs in CANDIDATES[lanes] + (prefill_tile(lanes),):
            acc = rows * outs // lanes
            assert acc + outs // lanes + 1 <= regs, (lanes, rows, outs)  # accumulators + weights + broadcast


def test_the_measured_tile_is_cached_per_cpu(tmp_path, monkeypatch):
    monkeypatch.setenv("DSPX_CACHE", str(tmp_path))
    d = Dims(n_layers=1, dim=64, n_heads=1, n_kv=1, head_dim=64, ffn=64, vocab=64, theta=1e4, eps=1e-5)
    target = tvm.target.Target({"kind": "llvm", "mcpu": "x86-64-v3"})
    assert prefill_tile_for(d, target, 8, runs_here=False)["tile"] == [6, 16]  # another CPU: the register-count default
    choice = prefill_tile_for(d, target, 8, runs_here=True)
    assert tuple(choice["tile"]) in CANDIDATES[8] and set(choice["us"]) == {"6x16", "4x16", "2x32"}
    assert min(choice["us"], key=choice["us"].get) == "x".join(map(str, choice["tile"]))
    (cached,) = (tmp_path / "llm-tiles").glob("*.json")
    cached.write_text(json.dumps({**choice, "tile": [2, 32], "chosen_by": "planted"}))
    assert prefill_tile_for(d, target, 8, runs_here=True)["chosen_by"] == "planted"  # read back, not timed again
    blocked = tmp_path / "a-file"
    blocked.write_text("")
    monkeypatch.setenv("DSPX_CACHE", str(blocked / "cache"))  # a cache that cannot be made: timed, not cached
    assert tuple(prefill_tile_for(d, target, 8, runs_here=True)["tile"]) in CANDIDATES[8]
