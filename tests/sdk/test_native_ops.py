"""Native op libraries (C/C++ against dspx/dsp.h): every SDK call in a task,
the checks before a library is mapped, and — through a running device —
crashes, time limits and two cores running native ops in parallel."""
from __future__ import annotations

import ctypes
import json
import mmap
import struct
import subprocess
import sys
import threading
from pathlib import Path

import numpy as np
import pytest
import scipy.special

from dspx import sdk
from dspx.abi.protocol import Status
from dspx.device.core import builtin_ops, ops, runtime as rt
from dspx.device.core.errors import OpBusy, OpLoadError, OpSymbolError, UnknownLibrary
from dspx.memory import L2_SIZE, AddressSpace, Region

from conftest import SMALL, Device

ROOT = Path(__file__).resolve().parents[2]
NATIVE = ROOT / "tests" / "native"
EXAMPLE = ROOT / "examples" / "softmax_c"
ARGS_ADDR, DATA_ADDR, OUT_ADDR = 0xC000_0000, 0xC010_0000, 0xD000_0000
BUF = 1 << 20
ARGS = struct.Struct("<QIi16i")  # struct args in tests/native/sdk_ops.c


def build(tmp_path: Path, name: str, code: str | None = None, sources=(), flags=()) -> bytes:
    if code is not None:
        src = tmp_path / name
        src.write_text(code)
        sources = [src]
    out = tmp_path / (Path(name).stem + ".so")
    return sdk.build_ops(list(sources), out, flags, echo=False).read_bytes()


@pytest.fixture(scope="module")
def sdk_ops(tmp_path_factory) -> bytes:
    return build(tmp_path_factory.mktemp("sdkops"), "sdk_ops.so", sources=[NATIVE / "sdk_ops.c"],
                 flags=["-Wall", "-Wextra", "-Werror"])


@pytest.fixture(scope="module")
def softmax_c(tmp_path_factory) -> bytes:
    """The seed's softmax_ivp.cc as the example ships it (cmd 0x3402)."""
    return build(tmp_path_factory.mktemp("softmaxc"), "softmax_c.so",
                 sources=[EXAMPLE / "softmax_ivp.cc", EXAMPLE / "register.cc"])


class Dev:
    """A registry with the built-ins, one core and a connection with an
    argument buffer, a data buffer and an output buffer (1 MiB each)."""

    def __init__(self, lib: bytes | None = None, data_size: int = BUF, out_size: int = BUF):
        self.core = rt.CoreRuntime()
        self.reg = ops.OpRegistry()
        builtin_ops.register(self.reg)
        self.space = AddressSpace()
        self.mm = {}
        for i, (addr, size) in enumerate(((ARGS_ADDR, 4096), (DATA_ADDR, data_size), (OUT_ADDR, out_size))):
            self.add(i + 1, addr, mmap.mmap(-1, size))
        self.args = np.frombuffer(self.mm[ARGS_ADDR], np.uint8)
        self.data = np.frombuffer(self.mm[DATA_ADDR], np.uint8)
        self.out = np.frombuffer(self.mm[OUT_ADDR], np.uint8)
        self.handle = self.reg.load_library(lib, "test.so") if lib is not None else None

    def add(self, buf_id, addr, mm):
        self.space.add(Region(buf_id, addr, len(mm), mm))
        self.mm[addr] = mm

    def run(self, cmd, addr=DATA_ADDR, size=0, mode=0, ints=(), out_size=None, input=None):
        if input is None:
            ARGS.pack_into(self.mm[ARGS_ADDR], 0, addr, size, mode, *(list(ints) + [0] * (16 - len(ints))))
            input = self.args[:ARGS.size]
        out = self.out if out_size is None else self.out[:out_size]
        return self.reg.run(cmd, input, out, rt.TaskContext(self.space, self.core))

    def close(self):
        self.core.close()


@pytest.fixture
def dev(sdk_ops):
    d = Dev(sdk_ops)
    yield d
    d.close()


# ------------------------------------------------------------------ hb_dsp_mem_map / unmap

@pytest.mark.parametrize("mode", [0, 1])  # unmap by pointer, and by the seed's (uint32_t) truncation
def test_mem_map_copies_and_unmaps(dev, mode):
    dev.data[:4096] = np.random.default_rng(mode).integers(0, 256, 4096, dtype=np.uint8)
    r = dev.run(0x5001, DATA_ADDR + 100, 3000, mode)
    assert (r.status, r.return_value) == (0, 0), r.printf
    assert np.array_equal(dev.out[:3000], dev.data[100:3100])


@pytest.mark.parametrize("addr, size", [(0x1000, 16), (DATA_ADDR + BUF - 8, 16), (OUT_ADDR + BUF, 4),
                                        (DATA_ADDR, BUF + 1), (DATA_ADDR - 4, 8), ((1 << 64) - 8, 16)])
def test_mem_map_of_a_bad_range_is_map_failed_and_err_addr(dev, addr, size):
    r = dev.run(0x5001, addr, size)
    assert r.status == r.return_value == Status.ERR_ADDR
    assert f"MapError: mem_map(0x{addr:x}, {size})" in r.printf
    assert "MAP_FAILED == p, returning HB_ERR_MMAP_FAILED" in r.printf  # PRT_IF_COND_RETURN logged it


def test_mem_unmap_twice_is_err_invalid(dev):
    r = dev.run(0x5001, DATA_ADDR, 64, mode=2)
    assert r.status == Status.ERR_INVALID and "hb_dsp_mem_unmap(0x" in r.printf and "already unmapped" in r.printf


def test_an_sdk_failure_the_handler_absorbs_is_success(dev):
    r = dev.run(0x500b, mode=1, ints=[0])
    assert (r.status, r.return_value) == (0, 0) and "MapError" in r.printf
    assert dev.run(0x500b, mode=1, ints=[-1]).status == Status.ERR_ADDR
    assert (dev.run(0x500b, ints=[7]).status, dev.run(0x500b, ints=[7]).return_value) == (0, 7)


# ------------------------------------------------------------------ tile manager

def tiles(dev, specs, align=64, free_twice=False):
    r = dev.run(0x5002, mode=align | int(free_twice), ints=[len(specs), *[v for s in specs for v in s]])
    ptrs = np.frombuffer(dev.out[:8 * len(specs)].tobytes(), np.int64)
    return r, [int(p) - dev.core.l2.ctypes.data if p != -1 else None for p in ptrs]


def test_tiles_in_both_banks_first_fit_and_aligned(dev):
    half = L2_SIZE // 2
    r, offs = tiles(dev, [(1000, 0), (1000, 1), (1000, 0), (4096, 1)], align=4096)
    assert r.status == 0, r.printf
    assert offs == [0, half, 4096, half + 4096]  # bank b is L2's b-th half, holes filled first-fit
    r, offs = tiles(dev, [(100, 0), (100, 0), (half - 256, 0)])
    assert offs == [0, 128, 256] and r.status == 0
    r, offs = tiles(dev, [(half, 0), (half, 1)])
    assert offs == [0, half] and r.status == 0  # a whole bank is one tile


def test_tile_exhaustion_is_null_and_err_nomem(dev):
    half = L2_SIZE // 2
    r, offs = tiles(dev, [(half - 1000, 1), (2000, 1)])
    assert offs == [half, None]
    assert r.status == r.return_value == Status.ERR_NOMEM
    assert (f"TileExhausted: L2 bank 1: cannot allocate a 2000-byte tile (free 1000 of {half} bytes, "
            "largest hole 1000)") in r.printf
    r, offs = tiles(dev, [(half + 1, 0)])
    assert offs == [None] and r.status == Status.ERR_NOMEM


def test_tile_misuse_is_err_invalid(dev):
    r, offs = tiles(dev, [(64, 2)])
    assert offs == [None] and r.status == Status.ERR_INVALID and "bank 0 or 1" in r.printf
    r, offs = tiles(dev, [(64, 0)], align=48)
    assert offs == [None] and r.status == Status.ERR_INVALID and "power of two" in r.printf
    r, _ = tiles(dev, [(64, 0)], free_twice=True)
    assert r.status == Status.ERR_INVALID and "not a live tile (double free" in r.printf


# ------------------------------------------------------------------ IDMA

def test_idma_ddr_to_tile_to_output(dev):
    dev.data[:5000] = np.arange(5000) % 251
    r = dev.run(0x5003, DATA_ADDR, 5000)
    assert (r.status, r.return_value) == (0, 0), r.printf
    assert np.array_equal(dev.out[:5000], dev.data[:5000])


@pytest.mark.parametrize("mode, text", [
    (1, "DMA channel 2 does not exist"),
    (2, "IDMA_COPY of 0 bytes"),
    (3, "is not inside a live tile"),
    (4, "is not inside the task's buffers or a live L2 tile"),
    (5, "is not inside a live tile (freed, or never allocated)"),
    (6, "DMA channel 5 does not exist"),
])
def test_idma_misuse_is_err_invalid(dev, mode, text):
    r = dev.run(0x5003, DATA_ADDR, 4096, mode)
    assert r.status == r.return_value == Status.ERR_INVALID, r.printf
    assert "DmaError" in r.printf and text in r.printf


def test_idma_copies_run_while_the_handler_computes(dev):
    n = 512 << 10
    dev.data[:n] = np.arange(n) % 253 + 1  # the last byte differs from the output's 0
    dev.out[:] = 0
    r = dev.run(0x500d, DATA_ADDR, n)
    assert (r.status, r.return_value) == (0, 0), r.printf
    submitted, landed, wait_called = struct.unpack_from("<3Q", dev.mm[OUT_ADDR], n)
    assert submitted < landed < wait_called  # the copy finished with nobody waiting for it
    assert np.array_equal(dev.out[:n], dev.data[:n])


# ------------------------------------------------------------------ C7x-style auto-increment transfers

def autoinc(dev, src_off, sync, scnt, sdim, dcnt, ddim, out_bytes, tile=False):
    return dev.run(0x5004, DATA_ADDR + src_off, BUF - src_off, int(tile),
                   [sync, *scnt, *sdim, *dcnt, *ddim], out_size=out_bytes)


@pytest.mark.parametrize("tile", [False, True])
def test_autoinc_2d_block_against_numpy(dev, tile):
    img = np.random.default_rng(2).standard_normal((40, 64)).astype(np.float32)  # H x W in DDR
    dev.data[:img.nbytes] = img.view(np.uint8).ravel()
    r0, c0, h, w = 5, 7, 11, 13
    for sync, triggers in ((0, h), (1, 1)):  # a row per trigger, then the block in one
        r = autoinc(dev, (r0 * 64 + c0) * 4, sync, [w * 4, h, 1, 1], [64 * 4, 0, 0], [w * 4, h, 1, 1],
                    [w * 4, 0, 0], h * w * 4, tile)
        assert (r.status, r.return_value) == (0, triggers), r.printf
        assert np.array_equal(dev.out[:h * w * 4].view(np.float32).reshape(h, w), img[r0:r0 + h, c0:c0 + w])


def test_autoinc_3d_with_strided_destination_and_fourth_loop(dev):
    vol = np.random.default_rng(3).integers(0, 1 << 30, (6, 8, 10), dtype=np.int32)  # C x H x W
    dev.data[:vol.nbytes] = vol.view(np.uint8).ravel()
    # every other channel, rows 1..6, cols 2..7, in 2 groups of (channel pairs);
    # written to a destination whose rows are padded to 9 elements
    c_sel, rows, cols = slice(0, 6, 2), slice(1, 7), slice(2, 8)
    src_off = (1 * 10 + 2) * 4
    scnt, sdim = [6 * 4, 6, 1, 3], [10 * 4, 0, 2 * 8 * 10 * 4]
    dcnt, ddim = [6 * 4, 6, 1, 3], [9 * 4, 0, 6 * 9 * 4]
    out_bytes = 3 * 6 * 9 * 4
    dev.out[:out_bytes] = 0
    r = autoinc(dev, src_off, 2, scnt, sdim, dcnt, ddim, out_bytes)
    assert (r.status, r.return_value) == (0, 3), r.printf  # SYNC_3D: one trigger per icnt3
    want = np.zeros((3, 6, 9), np.int32)
    want[:, :, :6] = vol[c_sel, rows, cols]
    assert np.array_equal(dev.out[:out_bytes].view(np.int32).reshape(3, 6, 9), want)


def test_autoinc_reshapes_and_flips_with_negative_strides(dev):
    a = np.arange(12 * 16, dtype=np.int32).reshape(12, 16)
    dev.data[:a.nbytes] = a.view(np.uint8).ravel()
    # source rows bottom-up (negative dim1); destination in 32-byte rows: a byte stream, re-cut
    r = autoinc(dev, 11 * 16 * 4, 3, [64, 12, 1, 1], [-64, 0, 0], [32, 24, 1, 1], [32, 0, 0], a.nbytes)
    assert (r.status, r.return_value) == (0, 1), r.printf
    assert np.array_equal(dev.out[:a.nbytes].view(np.int32).reshape(12, 16), a[::-1])
    # a 2-D sync over a 3-D pattern: icnt2 x icnt3 triggers
    r = autoinc(dev, 0, 1, [16, 2, 3, 2], [64, 16, 6 * 64], [16, 2, 3, 2], [16, 32, 96], 16 * 12)
    assert (r.status, r.return_value) == (0, 6), r.printf
    src = np.lib.stride_tricks.as_strided(dev.data, (2, 3, 2, 16), (6 * 64, 16, 64, 1))
    assert np.array_equal(dev.out[:16 * 12].reshape(2, 3, 2, 16), src)


def test_autoinc_trigger_past_the_last_block_is_err_invalid(dev):
    r = dev.run(0x5004, DATA_ADDR, 4096, 2, [1, 16, 4, 1, 1, 64, 0, 0, 16, 4, 1, 1, 16, 0, 0], out_size=64)
    assert r.status == Status.ERR_INVALID and "all 1 blocks of channel 1 already triggered" in r.printf


@pytest.mark.parametrize("scnt, sdim, dcnt, ddim, text", [
    ([16, 4, 1, 1], [64, 0, 0], [16, 5, 1, 1], [16, 0, 0], "source moves 64 bytes"),
    ([0, 4, 1, 1], [64, 0, 0], [0, 4, 1, 1], [16, 0, 0], "every icnt must be >= 1"),
    ([16, 4, 1, 1], [BUF, 0, 0], [16, 4, 1, 1], [16, 0, 0], "not inside the task's buffers"),
    ([16, 4, 1, 1], [64, 0, 0], [16, 4, 1, 1], [1 << 28, 0, 0], "not inside the task's buffers"),
])
def test_autoinc_misuse_is_err_invalid(dev, scnt, sdim, dcnt, ddim, text):
    r = autoinc(dev, 0, 1, scnt, sdim, dcnt, ddim, 4096)
    assert r.status == Status.ERR_INVALID and text in r.printf, r.printf


# ------------------------------------------------------------------ auto-increment range checks at the edges

GUARD = 4096


@pytest.fixture
def edged(sdk_ops):
    """dev, with the data buffer inside a bigger mapping: a guard page of
    0xEE on each side, so a transfer let through past either end reads
    mapped memory (its bytes show in the output) instead of faulting."""
    d = Dev(sdk_ops)
    whole = mmap.mmap(-1, BUF + 2 * GUARD)
    whole[:] = b"\xee" * len(whole)
    view = memoryview(whole)[GUARD:GUARD + BUF]
    d.add(2, DATA_ADDR, view)
    d.data = np.frombuffer(view, np.uint8)
    d.data[:] = np.arange(BUF) % 251
    yield d
    d.close()


def strided(data: np.ndarray, off: int, cnt, dim) -> np.ndarray:
    """The bytes a 4-loop pattern at data[off] reads, in order (numpy's view of it)."""
    idx = (off + np.arange(cnt[0])[None, None, None, :] + np.arange(cnt[1])[None, None, :, None] * dim[0]
           + np.arange(cnt[2])[None, :, None, None] * dim[1] + np.arange(cnt[3])[:, None, None, None] * dim[2])
    return data[idx.ravel()]


# (source offset, icnt0..3, dim1..3): each reaches exactly the first or the last byte of the buffer
EXACT = [
    (0, [BUF, 1, 1, 1], [0, 0, 0]),  # the whole buffer
    (BUF - 256, [64, 4, 1, 1], [64, 0, 0]),  # rows up to the last byte
    (BUF - 64 - 3 * 100, [64, 1, 1, 4], [0, 0, 100]),  # the fourth loop to the last byte
    (192, [64, 4, 1, 1], [-64, 0, 0]),  # rows bottom-up, the last one at byte 0
    (2 * 40, [16, 1, 3, 1], [0, -40, 0]),  # a negative dim2 to byte 0
    (3 * 72, [8, 2, 1, 4], [5, 0, -72]),  # a negative dim3 beside a positive dim1
    (BUF - 64 - 8, [64, 2, 2, 1], [-8, 8, 0]),  # both signs: to the last byte and back
]


@pytest.mark.parametrize("off, cnt, dim", EXACT)
def test_autoinc_exactly_to_the_buffer_edges_is_allowed_and_right(edged, off, cnt, dim):
    n = int(np.prod(cnt))
    r = autoinc(edged, off, 3, cnt, dim, [n, 1, 1, 1], [0, 0, 0], n)
    assert (r.status, r.return_value) == (0, 1), r.printf
    assert np.array_equal(edged.out[:n], strided(edged.data, off, cnt, dim))


def one_past(off, cnt, dim):
    """The same pattern reaching one byte further out: before byte 0 when
    it reached byte 0, past the end when it reached the last byte."""
    lo = off + sum(min(0, (c - 1) * d) for c, d in zip(cnt[1:], dim))
    return (off - 1 if lo == 0 else off + 1), cnt, dim


@pytest.mark.parametrize("off, cnt, dim", [one_past(*e) for e in EXACT[1:]] + [
    (0, [64, 4, 1, 1], [-64, 0, 0]),  # the issue's: 192 bytes before the buffer
    (0, [1, 2, 1, 1], [-1, 0, 0]),  # one byte before
    (BUF - 1, [2, 1, 1, 1], [0, 0, 0]),  # one byte past the end
])
def test_autoinc_one_byte_past_either_edge_is_err_invalid(edged, off, cnt, dim):
    n = int(np.prod(cnt))
    edged.out[:n] = 0
    r = autoinc(edged, off, 3, cnt, dim, [n, 1, 1, 1], [0, 0, 0], n)
    assert r.status == r.return_value == Status.ERR_INVALID, r.printf
    assert "not inside the task's buffers" in r.printf
    assert not edged.out[:n].any()  # nothing was copied


@pytest.mark.parametrize("ddim", [64, 65])
def test_autoinc_into_a_tile_exactly_its_size_and_one_byte_more(edged, ddim):
    """The destination is a 256-byte tile: rows of 64 at a 64-byte pitch fill
    it exactly; at a 65-byte pitch the last row ends 3 bytes past it."""
    r = autoinc(edged, 0, 3, [64, 4, 1, 1], [64, 0, 0], [64, 4, 1, 1], [ddim, 0, 0], 256, tile=True)
    if ddim == 64:
        assert (r.status, r.return_value) == (0, 1), r.printf
        assert np.array_equal(edged.out[:256], edged.data[:256])
    else:
        assert r.status == r.return_value == Status.ERR_INVALID, r.printf
        assert "is not inside a live tile" in r.printf


@pytest.mark.parametrize("sign", [1, -1])
def test_autoinc_spans_beyond_64_bits_are_err_invalid(edged, sign):
    big, dim = (1 << 31) - 1, (1 << 31) - 1 if sign > 0 else -(1 << 31)
    cnt, dims = [1, big, big, big], [dim, dim, dim]  # three spans of ~2^62 bytes: 64-bit sums overflow
    r = autoinc(edged, 4096, 3, cnt, dims, cnt, dims, 4096)
    assert r.status == r.return_value == Status.ERR_INVALID, r.printf
    assert "DmaError" in r.printf


# ------------------------------------------------------------------ printf, logs, cycles

def test_printf_logs_and_time_stamp(dev):
    r = dev.run(0x5005, out_size=4000)
    assert (r.status, r.return_value) == (0, 0), r.printf
    assert r.printf == "printf 42 text 1.50|info 3\nE: error 7\n"  # DSP_LOGD compiled out
    elapsed, in_size, out_size = struct.unpack_from("<3Q", dev.mm[OUT_ADDR])
    assert 0 < elapsed <= r.cycles and (in_size, out_size) == (ARGS.size, 4000)
    assert dev.reg.ops()[1:3] == [ops.OpInfo(0x5001, "op_map", 0, dev.handle),
                                  ops.OpInfo(0x5002, "op_tiles", 0, dev.handle)]
    assert ops.OpInfo(0x5005, "op_print", 250, dev.handle) in dev.reg.ops()


def test_printf_overflow_keeps_the_newest_text(dev):
    r = dev.run(0x500c)
    assert r.status == 0
    assert "earlier bytes dropped" in r.printf and r.printf.endswith("line 19999\n")


# ------------------------------------------------------------------ softmax in C

SIZES = [1, 7, 16, 65535, 65537, 100_000]  # the C softmax tiles are 64 Ki floats


@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("cmd", [0x1402, 0x3402])
def test_c_softmax_paths_agree_with_scipy(softmax_c, n, cmd):
    d = Dev(softmax_c, data_size=4 * n + 4096, out_size=4 * n + 4096)
    try:
        x = d.data[:4 * n].view(np.float32)
        x[:] = 1 + np.arange(n, dtype=np.float32) / np.float32(n)
        ref = scipy.special.softmax(x.astype(np.float64))
        res = []
        for tcm in (0, 1):
            struct.pack_into("<i4xQB", d.mm[ARGS_ADDR], 0, 4 * n, DATA_ADDR, tcm)
            r = d.run(cmd, input=d.args[:24])
            assert (r.status, r.return_value) == (0, 0), r.printf
            assert ("ping-pong" if tcm else "ddr") in r.printf
            res.append(d.out[:4 * n].view(np.float32).copy())
        assert np.max(np.abs(res[0] - ref) / ref) <= 1e-6
        assert np.max(np.abs(res[1] - ref) / ref) <= 1e-6
        if cmd == 0x1402:  # the same operations per element on both paths
            assert np.array_equal(res[0], res[1])
        assert "not waited" not in r.printf and "tiles allocated" not in r.printf
    finally:
        d.close()


def test_builtin_c_softmax_at_2_pow_24_plus_3_with_page_end_buffers():
    """2^24 + 3 floats, input and output each ending where the next page is
    unmapped: the seed's vecmul reads a vector past its end, which must not
    fault."""
    n = (1 << 24) + 3
    size = -(-4 * n // 4096) * 4096
    d = Dev(data_size=4096, out_size=4096)
    libc = ctypes.CDLL(None)
    try:
        for addr in (DATA_ADDR, OUT_ADDR):
            big = mmap.mmap(-1, size + 4096)
            base = np.frombuffer(big, np.uint8).ctypes.data
            assert libc.mprotect(ctypes.c_void_p(base + size), 4096, 0) == 0  # PROT_NONE after the buffer
            view = memoryview(big)[size - 4 * n:size]
            d.space.remove(addr)
            d.space.add(Region(9, addr, 4 * n, view))
            d.mm[addr] = view
        x = np.frombuffer(d.mm[DATA_ADDR], np.float32)
        x[:] = np.arange(n, dtype=np.float32) / np.float32(n) + np.float32(1)
        ref = scipy.special.softmax(x.astype(np.float64))
        for tcm in (1, 0):
            struct.pack_into("<i4xQB", d.mm[ARGS_ADDR], 0, 4 * n, DATA_ADDR, tcm)
            r = d.reg.run(0x1402, d.args[:24], np.frombuffer(d.mm[OUT_ADDR], np.uint8), rt.TaskContext(d.space, d.core))
            assert (r.status, r.return_value) == (0, 0), r.printf
            assert np.max(np.abs(np.frombuffer(d.mm[OUT_ADDR], np.float32) - ref) / ref) <= 1e-6
    finally:
        d.close()


# ------------------------------------------------------------------ checks before loading

FORBIDDEN = {
    "system": '#include <stdlib.h>\nint f(void *i, void *o, void *t) { return system("true"); }',
    "fopen": '#include <stdio.h>\n#undef printf\nint f(void *i, void *o, void *t) { return fopen("/x", "r") != 0; }',
    "socket": '#include <sys/socket.h>\nint f(void *i, void *o, void *t) { return socket(1, 1, 0); }',
    "dlopen": '#include <dlfcn.h>\nint f(void *i, void *o, void *t) { return dlopen("x", 2) != 0; }',
    "fork": '#include <unistd.h>\nint f(void *i, void *o, void *t) { return fork(); }',
}
REGISTER = "\nint dspx_ops_init(void) { return hb_dsp_register_fn(0x6001, f, 0); }\n"


@pytest.mark.parametrize("symbol", sorted(FORBIDDEN))
def test_a_forbidden_import_is_err_symbol_naming_it(tmp_path, symbol):
    lib = build(tmp_path, "bad.c", "#include <dspx/dsp.h>\n" + FORBIDDEN[symbol] + REGISTER)
    reg = ops.OpRegistry()
    with pytest.raises(OpSymbolError) as ei:
        reg.load_library(lib, "bad.so")
    assert ei.value.symbol == symbol and ei.value.status == Status.ERR_SYMBOL and repr(symbol) in str(ei.value)
    assert reg.ops() == []


CTORS = {  # (an empty one would be optimised away)
    "constructor": "volatile int seen;\n__attribute__((constructor)) static void early(void) { seen = 1; }\n",
    "destructor": "volatile int seen;\n__attribute__((destructor)) static void late(void) { seen = 2; }\n",
}


@pytest.mark.parametrize("kind", sorted(CTORS))
def test_constructors_and_destructors_are_refused(tmp_path, kind):
    code = "#include <dspx/dsp.h>\n" + CTORS[kind] + "static int f(void *i, void *o, void *t) { return 0; }" + REGISTER
    with pytest.raises(OpLoadError) as ei:
        ops.OpRegistry().load_library(build(tmp_path, "ctor.c", code), "ctor.so")
    assert ei.value.status == Status.ERR_LOAD
    assert ("early" if kind == "constructor" else "late") in str(ei.value) and "constructors" in str(ei.value)


def test_a_cpp_static_object_with_a_constructor_is_refused(tmp_path):
    code = ("#include <dspx/dsp.h>\nstruct S { int v; S() : v((int)dspx_cycles()) {} };\nstatic S s;\n"
            "static int f(void *, void *, void *) { return s.v; }\n"
            'extern "C" int dspx_ops_init(void) { return hb_dsp_register_fn(0x6001, f, 0); }\n')
    with pytest.raises(OpLoadError, match=r"\.init_array runs _GLOBAL__sub_I"):
        ops.OpRegistry().load_library(build(tmp_path, "obj.cc", code), "obj.so")


def test_a_custom_dt_init_and_extra_needed_libraries_are_refused(tmp_path):
    code = "#include <dspx/dsp.h>\nvoid boot(void) { }\nstatic int f(void *i, void *o, void *t) { return 0; }" + REGISTER
    with pytest.raises(OpLoadError, match="DT_INIT points at"):
        ops.OpRegistry().load_library(build(tmp_path, "init.c", code, flags=["-Wl,-init=boot"]), "init.so")
    lib = build(tmp_path, "needed.c", code, flags=["-Wl,--no-as-needed", "-lz"])
    with pytest.raises(OpSymbolError) as ei:
        ops.OpRegistry().load_library(lib, "needed.so")
    assert ei.value.symbol == "libz.so.1"
    # the dynamic linker reads PT_DYNAMIC: renaming the .dynamic section does not hide libz from the check
    assert lib.count(b".dynamic\x00") == 1
    with pytest.raises(OpLoadError) as ei:
        ops.OpRegistry().load_library(lib.replace(b".dynamic\x00", b".dynamix\x00"), "renamed.so")
    assert str(ei.value) == "renamed.so: the .dynamic section is not the PT_DYNAMIC segment the dynamic linker reads"


def test_elf_identity_is_checked(tmp_path, sdk_ops):
    for patch, text in (((4, 1), "ELFCLASS64"), ((18, 0x28), "EM_ARM"), ((16, 2), "ET_EXEC")):
        bad = bytearray(sdk_ops)
        bad[patch[0]] = patch[1]
        with pytest.raises(OpLoadError, match=text):
            ops.OpRegistry().load_library(bytes(bad), "bad.so")
    src = tmp_path / "main.c"
    src.write_text("int dspx_ops_init(void) { return 0; }\nint main(void) { return 0; }\n")
    exe = tmp_path / "main"
    subprocess.run(["cc", "-pie", "-fPIE", str(src), "-o", str(exe)], check=True)
    with pytest.raises(OpLoadError, match="PT_INTERP"):
        ops.OpRegistry().load_library(exe.read_bytes(), "main")
    with pytest.raises(OpLoadError, match="malformed ELF"):
        ops.OpRegistry().load_library(sdk_ops[:2000], "cut.so")


@pytest.mark.parametrize("init, error", [
    ("", r"no exported dspx_ops_init"),
    ("int dspx_ops_init(void) { return 0; }", "registers no operators"),
    ("int dspx_ops_init(void) { hb_dsp_register_fn(0x6001, f, 0); return 3; }", r"dspx_ops_init\(\) returned 3"),
    ("int dspx_ops_init(void) { return hb_dsp_register_fn(-5, f, 0); }", "a negative command id"),
    ("int dspx_ops_init(void) { volatile int *p = 0; return *p; }", r"dspx_ops_init crashed \(SIGSEGV\)"),
])
def test_bad_registration_is_refused(tmp_path, init, error):
    code = "#include <dspx/dsp.h>\nstatic int f(void *i, void *o, void *t) { return 0; }\n" + init + "\n"
    reg = ops.OpRegistry()
    with pytest.raises((OpLoadError, OpSymbolError), match=error):
        reg.load_library(build(tmp_path, "reg.c", code), "reg.so")
    assert reg.ops() == []


def test_a_taken_cmd_refuses_the_whole_library_and_unload_unregisters(tmp_path):
    code = ("#include <dspx/dsp.h>\nstatic int f(void *i, void *o, void *t) { return 0; }\n"
            "int dspx_ops_init(void) { return hb_dsp_register_fn(0x6001, f, 0) | hb_dsp_register_fn(0x%x, f, 0); }\n")
    d = Dev()
    try:
        with pytest.raises(OpBusy) as ei:
            d.reg.load_library(build(tmp_path, "busy.c", code % 0x1402), "busy.so")
        assert ei.value.cmd == 0x1402 and "built-in" in str(ei.value)
        assert 0x6001 not in d.reg and d.reg.libraries() == []
        with pytest.raises(OpBusy):
            d.reg.load_library(build(tmp_path, "dup.c", code % 0x6001), "dup.so")
        h = d.reg.load_library(build(tmp_path, "ok.c", code % 0x6002), "ok.so")
        assert d.run(0x6002).status == 0
        d.reg.unload_library(h)
        assert 0x6001 not in d.reg and 0x6002 not in d.reg
        with pytest.raises(UnknownLibrary):
            d.reg.unload_library(h)
        h = d.reg.load_library(build(tmp_path, "ok.c", code % 0x6002), "ok.so")  # the ids are free again
        assert d.run(0x6001).status == 0
    finally:
        d.close()


def test_native_handlers_release_the_gil(sdk_ops):
    """Two registries (two cores' worth) in one process, two threads, two
    200 ms native ops: both start before either ends."""
    devs = [Dev(sdk_ops), Dev(sdk_ops)]
    try:
        threads = [threading.Thread(target=d.run, args=(0x5006,), kwargs={"ints": [200]}) for d in devs]
        for t in threads:
            t.start()
        for t in threads:
            t.join(10)
        (s0, e0), (s1, e1) = (struct.unpack_from("<2Q", d.mm[OUT_ADDR]) for d in devs)
        assert e0 - s0 >= 200_000_000 and e1 - s1 >= 200_000_000
        assert max(s0, s1) < min(e0, e1)
    finally:
        for d in devs:
            d.close()


# ------------------------------------------------------------------ through a device

@pytest.fixture(scope="module")
def device2():
    d = Device("--cores", "2", *SMALL)
    yield d
    d.stop()


@pytest.fixture(scope="module")
def loaded(device2, sdk_ops):
    """sdk_ops loaded once into device2 (op libraries are device-wide)."""
    from dspx.host.client import Client
    from dspx.host.tasks import Tasks

    c = Client(device2.path, timeout=20, staging_size=1 << 20, kv_size=1 << 16)
    Tasks(c).load_ops(sdk_ops)
    yield device2
    c.close()


def _tasks(client):
    from dspx.host.tasks import Tasks
    return Tasks(client)


def test_tasks_load_ops_takes_the_path_of_a_so(device, sdk_ops, tmp_path):
    from dspx.host.tasks import Tasks

    lib = tmp_path / "ops.so"
    lib.write_bytes(sdk_ops)
    with Tasks(socket=device.path) as u:
        handle, n = u.load_ops(lib)
        names = {o["name"] for o in u.ops() if o["library"] == handle}
    assert n >= 1 and len(names) == n


def _args(ucp, ints=(), mode=0):
    m = ucp.malloc(ARGS.size)
    m.buf.mm[:ARGS.size] = ARGS.pack(0, 0, mode, *(list(ints) + [0] * (16 - len(ints))))
    return m


def test_load_ops_cli_takes_a_so_and_names_a_forbidden_symbol(device, sdk_ops, tmp_path):
    so = tmp_path / "sdk_ops.so"
    so.write_bytes(sdk_ops)
    cmd = [sys.executable, "-m", "dspx.cli", "load-ops", str(so), "--socket", device.path, "--json"]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stdout + p.stderr
    out = json.loads(p.stdout)
    assert out["status"] == "ok" and {"cmd": 0x5006, "name": "op_busy", "latency_us": 0,
                                      "library": out["library"]} in out["ops"]
    bad = tmp_path / "bad.so"
    bad.write_bytes(build(tmp_path, "bad.c", "#include <dspx/dsp.h>\n" + FORBIDDEN["system"] + REGISTER))
    cmd[4] = str(bad)
    out = json.loads(subprocess.run(cmd, capture_output=True, text=True, timeout=60).stdout)
    assert out["code"] == Status.ERR_SYMBOL and "'system'" in out["message"]


def test_a_crashing_native_op_is_err_call_and_the_device_keeps_serving(loaded, client_of):
    from dspx.errors import CallFailed

    ucp, other = _tasks(client_of(loaded.path)), _tasks(client_of(loaded.path))
    i, o = _args(ucp), ucp.malloc(64)
    oi, oo = _args(other), other.malloc(64)
    for cmd in (0x5007, 0x5009):  # SIGSEGV, abort()
        with pytest.raises(CallFailed):
            ucp.run(cmd, i, o, core=0)
        assert ucp.run(0x500a, i, o, core=0).return_value == 0  # the restarted core has the library again
        assert other.run(0x500a, oi, oo).return_value == 0
    assert loaded.alive()


def test_a_looping_native_op_times_out_and_the_device_keeps_serving(loaded, client_of):
    from dspx.errors import TaskTimeout

    ucp = _tasks(client_of(loaded.path))
    i, o = _args(ucp), ucp.malloc(64)
    t = ucp.submit(ucp.rpc(0x5008, i, o), core=1, timeout_ms=500)
    with pytest.raises(TaskTimeout):
        ucp.wait(t, timeout_ms=20_000)
    assert ucp.run(0x500a, i, o, core=1).return_value == 0
    assert loaded.alive()


def test_two_native_ops_run_in_parallel_on_two_cores(loaded, client_of):
    ucp = _tasks(client_of(loaded.path))
    i, outs = _args(ucp, [200]), [ucp.malloc(16), ucp.malloc(16)]
    tasks = [ucp.submit(ucp.rpc(0x5006, i, o), core=c) for c, o in enumerate(outs)]
    for t in tasks:
        ucp.wait(t)
    (s0, e0), (s1, e1) = (struct.unpack("<2Q", bytes(o.buf.mm[:16])) for o in outs)
    assert {t.core for t in tasks} == {0, 1}
    assert e0 - s0 >= 200_000_000 and e1 - s1 >= 200_000_000
    assert max(s0, s1) < min(e0, e1)  # both started before either ended (one CLOCK_MONOTONIC)


def test_the_documented_export_table_is_the_checked_one():
    from dspx.device.core import native_exports
    assert native_exports.markdown() in (ROOT / "docs" / "custom-ops.md").read_text()
