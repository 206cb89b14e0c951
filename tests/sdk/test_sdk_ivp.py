"""dspx/ivp.h, the Vision DSP intrinsics emulation: every intrinsic the
seed's softmax uses against a numpy reference written from the semantics in
the header, the exp tables, and the seed's own vector functions (compiled
unchanged from examples/softmax_c/softmax_ivp.cc) against numpy."""
from __future__ import annotations

import ctypes
import mmap
import os
import pickle
import struct
from pathlib import Path

import numpy as np
import pytest

from dspx import sdk
from dspx.device.core import native
from dspx.memory import AddressSpace, Region

ROOT = Path(__file__).resolve().parents[2]
SEED = ROOT / "examples" / "softmax_c" / "softmax_ivp.cc"
F32, I32, I16, I64, U32 = np.float32, np.int32, np.int16, np.int64, np.uint32
P = ctypes.c_void_p
rng = np.random.default_rng(11)


@pytest.fixture(scope="module")
def h(tmp_path_factory):
    native.shim()  # the SDK functions the seed's code calls resolve against it
    out = tmp_path_factory.mktemp("ivp") / "ivp_harness.so"
    sdk.build_ops([ROOT / "tests" / "native" / "ivp_harness.cc"], out, [f'-DDSPX_SEED="{SEED}"'], echo=False)
    lib = ctypes.CDLL(str(out))
    for name in ("t_radd", "t_movf32", "t_vecmaxf", "t_vecsum"):
        getattr(lib, name).restype = ctypes.c_float
    lib.t_vecexpf.argtypes = [P, P, ctypes.c_int, ctypes.c_float]
    lib.t_vecmul.argtypes = [P, P, ctypes.c_float, ctypes.c_int]
    lib.t_tables.restype = P
    return lib


def ptr(a: np.ndarray) -> ctypes.c_void_p:
    return ctypes.c_void_p(a.ctypes.data)


def padded(n: int, dtype=F32, fill=0) -> np.ndarray:
    """n elements with room after them: the seed's vecmul reads a vector past its end."""
    return np.full(n + 64, fill, dtype)[:n]


def vec(dtype=F32, n=16, lo=-100, hi=100):
    if dtype == F32:
        return rng.uniform(lo, hi, n).astype(F32)
    info = np.iinfo(dtype)
    return rng.integers(info.min, info.max, n, dtype=dtype, endpoint=True)


SPECIAL = np.array([np.nan, 1, np.inf, -np.inf, 0, -0.0, np.nan, 5, 3, np.nan, -2, 7, 1e30, -1e30, 2, 2], F32)


# ------------------------------------------------------------------ float lanes

@pytest.mark.parametrize("op, ref", [(0, np.add), (1, np.subtract), (2, np.multiply), (3, np.fmax)])
def test_float_binary_ops(h, op, ref):
    for a, b in ((vec(), vec()), (SPECIAL, SPECIAL[::-1].copy())):
        o = np.empty(16, F32)
        with np.errstate(all="ignore"):
            want = ref(a, b)
        h.t_binf(op, ptr(a), ptr(b), ptr(o))
        assert np.array_equal(o, want, equal_nan=True)


def test_mula_is_unfused(h):
    acc, a, b = vec(), vec(), vec()
    # (1 + 2^-12)^2 rounds to 1 + 2^-11 (a tie, to even): a fused multiply-add would keep the 2^-24
    a[0], b[0], acc[0] = F32(1 + 2 ** -12), F32(1 + 2 ** -12), F32(-(1 + 2 ** -11))
    o = np.empty(16, F32)
    h.t_mula(ptr(acc), ptr(a), ptr(b), ptr(o))
    assert np.array_equal(o, acc + a * b)
    assert o[0] == 0


def test_radd_is_the_documented_tree(h):
    a = rng.uniform(-1, 1, 16).astype(F32) * F32(1e4)
    s = a[:8] + a[8:]
    s = s[:4] + s[4:]
    s = s[:2] + s[2:]
    assert h.t_radd(ptr(a)) == s[0] + s[1]


@pytest.mark.parametrize("n", [-3, 0, 1, 7, 15, 16, 40])
def test_predicated_forms_and_ltrs(h, n):
    r, a, b = vec(), vec(), vec()
    mask = np.arange(16) < n
    m = np.empty(16, I32)
    h.t_ltrs(n, ptr(m))
    assert np.array_equal(m, np.where(mask, -1, 0))
    for op, want in ((0, np.where(mask, np.fmax(a, b), r)), (1, np.where(mask, a + b, r)), (2, np.where(mask, a, b))):
        o = np.empty(16, F32)
        h.t_pred(op, ptr(r), ptr(a), ptr(b), n, ptr(o))
        assert np.array_equal(o, want)


def test_comparisons_count_nan_as_unordered(h):
    a, b = SPECIAL, np.array([1, np.nan, np.inf, 0, 0, 0, 3, 5, 4, 1, -2, 8, 1e30, 0, 3, 1], F32)
    un = np.isnan(a) | np.isnan(b)
    with np.errstate(invalid="ignore"):
        wants = [un, (a <= b) | un, (a == b) | un]
    for op, want in enumerate(wants):
        o = np.empty(16, I32)
        h.t_cmp(op, ptr(a), ptr(b), ptr(o))
        assert np.array_equal(o, np.where(want, -1, 0))


@pytest.mark.parametrize("k", [1, 2, 4, 8])
def test_sel_rotates_the_concatenation(h, k):
    a, b, o = vec(), vec(), np.empty(16, F32)
    h.t_sel(ptr(a), ptr(b), k, ptr(o))
    assert np.array_equal(o, np.concatenate([b, a])[k:k + 16])
    h.t_sel(ptr(a), ptr(a), k, ptr(o))
    assert np.array_equal(o, np.roll(a, -k))
    assert h.t_movf32(ptr(a)) == a[0]


# ------------------------------------------------------------------ conversions and int lanes

@pytest.mark.parametrize("s", [0, 1, 24, 31])
def test_trunc_and_float(h, s):
    a = np.concatenate([vec(n=10, lo=-300, hi=300), np.array([np.nan, np.inf, -np.inf, 1e20, -1e20, -0.75], F32)])
    o = np.empty(16, I32)
    h.t_trunc(ptr(a), s, ptr(o))
    with np.errstate(invalid="ignore"):
        y = a.astype(np.float64) * 2.0 ** s
        want = np.where(np.isnan(y), 0, np.clip(np.trunc(np.nan_to_num(y)), -2 ** 31, 2 ** 31 - 1)).astype(I32)
    assert np.array_equal(o, want)
    x, f = vec(I32), np.empty(16, F32)
    h.t_float(ptr(x), s, ptr(f))
    assert np.array_equal(f, x.astype(F32) * F32(2.0 ** -s))


def test_reinterpretations(h):
    x = vec(I32)
    f, s16 = np.empty(16, F32), np.empty(32, I16)
    h.t_movfi(ptr(x), ptr(f))
    assert np.array_equal(f.view(I32), x)
    h.t_mov16(ptr(x), ptr(s16))
    assert np.array_equal(s16, x.view(I16))  # lane 2i = low half of lane i (little endian)


def test_int_lanes_wrap_and_shift_logically(h):
    a, b, o = vec(I32), vec(I32), np.empty(16, I32)
    with np.errstate(over="ignore"):
        for op, want in ((0, a + b), (1, a - b)):
            h.t_bini(op, ptr(a), ptr(b), ptr(o))
            assert np.array_equal(o, want)
    for s in (1, 22, 31):
        h.t_shift(0, ptr(a), s, ptr(o))
        assert np.array_equal(o, (a.view(U32) << U32(s)).view(I32))
        for op in (1, 2):
            h.t_shift(op, ptr(a), s, ptr(o))
            assert np.array_equal(o, (a.view(U32) >> U32(s)).view(I32))


def test_16x32_multiplies_compose_an_exact_32x32_product(h):
    x, hv = vec(I32), vec(I32)
    halves = hv.view(I16)
    w0, w1 = np.empty(16, I64), np.empty(16, I64)
    h.t_mul0(ptr(halves), ptr(x), ptr(w0))
    assert np.array_equal(w0, halves[0::2].view(np.uint16).astype(I64) * x.astype(I64))
    h.t_mulah(ptr(w0), ptr(halves), ptr(x), ptr(w1))
    assert np.array_equal(w1, w0 + ((halves[1::2].astype(I64) * x.astype(I64)) << 16))
    assert [int(v) for v in w1] == [int(p) * int(q) for p, q in zip(hv, x)]


@pytest.mark.parametrize("s", [1, 22, 40, 63])
def test_packs(h, s):
    w = rng.integers(-2 ** 62, 2 ** 62, 16, dtype=I64)
    o = np.empty(16, I32)
    h.t_packvr(ptr(w), s, ptr(o))
    low32 = [(((int(v) + (1 << (s - 1))) >> s) + 2 ** 31) % 2 ** 32 - 2 ** 31 for v in w]  # no saturation
    assert [int(v) for v in o] == low32
    h.t_packh(ptr(w), ptr(o))
    assert np.array_equal(o, (w >> 32).astype(I32))


# ------------------------------------------------------------------ loads and stores

def test_aligning_loads_at_any_alignment(h):
    base = vec(n=64)
    for off in (0, 1, 3, 16):
        o = np.empty(32, F32)
        assert h.t_la(ptr(base[off:]), ptr(o)) == 128
        assert np.array_equal(o, base[off:off + 32])


@pytest.mark.parametrize("n", [-8, 0, 4, 6, 28, 64, 100])
def test_variable_loads_and_stores_take_clamped_tails(h, n):
    src = vec(n=32)
    k = max(0, min(n, 64))
    o = np.empty(16, F32)
    assert h.t_lavn(ptr(src), n, ptr(o)) == k
    want = np.zeros(64, np.uint8)
    want[:k] = src.view(np.uint8)[:k]
    assert np.array_equal(o.view(np.uint8), want)
    dst = np.full(32, -7, F32)
    assert h.t_savn(ptr(src), ptr(dst), n) == k
    want = np.full(32, -7, F32).view(np.uint8)
    want[:k] = src.view(np.uint8)[:k]
    assert np.array_equal(dst.view(np.uint8), want)
    dst[:] = 0
    assert h.t_san(ptr(src), ptr(dst)) == 64
    assert np.array_equal(dst[:16], src[:16]) and not dst[16:].any()


def test_scalar_loads_broadcast(h):
    x = vec(I32, n=8)
    o = np.empty(16, I32)
    h.t_lsn(ptr(x), 12, ptr(o))
    assert (o == x[3]).all()
    f, of = vec(n=8), np.empty(16, F32)
    assert h.t_lsrn(ptr(f[2:]), -8, ptr(of)) == -8
    assert (of == f[2]).all()


def test_exp_tables(h):
    tbl = np.frombuffer(ctypes.string_at(h.t_tables(0), 28), F32)
    xs = np.linspace(0, 1, 10001)
    assert np.max(np.abs(np.polyval(tbl.astype(np.float64), xs) / 2 ** xs - 1)) < 2e-8  # p0 is x^6's
    assert np.frombuffer(ctypes.string_at(h.t_tables(1), 4), I32)[0] == round(2 ** 30 / np.log(2))
    mm = np.frombuffer(ctypes.string_at(h.t_tables(2), 8), F32)
    assert mm[1] == F32(np.log(np.finfo(F32).max)) and np.exp(np.float64(mm[0])) < 2e-45
    assert np.frombuffer(ctypes.string_at(h.t_tables(3), 4), F32)[0] == -np.inf
    assert np.frombuffer(ctypes.string_at(h.t_tables(4), 4), F32)[0] == np.inf


# ------------------------------------------------------------------ the seed's vector functions

TAILS = [1, 7, 15, 16, 17, 31, 32, 33, 1000, 100_000]


@pytest.mark.parametrize("n", TAILS)
def test_seed_vector_functions_against_numpy(h, n):
    x = padded(n)
    x[:] = rng.uniform(-20, 5, n).astype(F32)
    assert h.t_vecmaxf(ptr(x), n) == x.max()
    m = F32(x.max())
    z = padded(n, fill=-1)
    h.t_vecexpf(ptr(z), ptr(x), n, m)
    ref = np.exp((x - m).astype(np.float64))  # x - m rounds to float32 first, as in the seed
    assert np.max(np.abs(z - ref) / ref) < 5e-7  # a few float32 ulp: Q24 input, degree-6 polynomial
    assert abs(h.t_vecsum(ptr(z), n) - ref.sum()) / ref.sum() < 1e-5
    y = padded(n, fill=-1)
    h.t_vecmul(ptr(y), ptr(z), F32(0.37), n)
    assert np.array_equal(y, z * F32(0.37))
    assert np.frombuffer(z.base, F32)[n] == -1 and np.frombuffer(y.base, F32)[n] == -1  # tails stop at n


@pytest.mark.parametrize("n", TAILS)
def test_seed_softmax_within_1e6_of_numpy(h, n):
    x = padded(n)
    x[:] = 1 + np.arange(n, dtype=F32) / F32(n)  # the seed's data
    x[::3] += rng.standard_normal(x[::3].size).astype(F32)
    out = padded(n)
    assert h.t_softmax(ptr(x), n, ptr(out)) == 0
    e = np.exp(x.astype(np.float64) - x.max())
    ref = e / e.sum()
    assert np.max(np.abs(out - ref) / ref) <= 1e-6


# ------------------------------------------------------------------ tails at a page end, in a task

PAGE = mmap.PAGESIZE
TASK = struct.Struct("<iif4xQQ")  # struct task_args in tests/native/ivp_harness.cc
libc = ctypes.CDLL(None, use_errno=True)
libc.mprotect.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]


class PageEnd:
    """A page of data followed by a PROT_NONE page: a read past the data's
    end faults.  ``put(a)`` places a at the very end of the first page."""

    def __init__(self):
        self.mm = mmap.mmap(-1, 2 * PAGE)
        self.base = ctypes.addressof(ctypes.c_char.from_buffer(self.mm))
        assert libc.mprotect(self.base + PAGE, PAGE, 0) == 0, os.strerror(ctypes.get_errno())
        self.page = np.frombuffer(self.mm, np.uint8, PAGE)

    def put(self, a: np.ndarray) -> int:
        self.page[PAGE - a.nbytes:] = a.view(np.uint8)
        return self.base + PAGE - a.nbytes


def in_child(fn):
    """fn() in a forked child: its result, or a failure naming the signal
    that ended the child (a fault must fail this test, not end the run)."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(r)
        try:
            data = pickle.dumps(("ok", fn()))
        except BaseException as e:  # noqa: BLE001 - reported to the parent
            data = pickle.dumps(("raised", repr(e)))
        with os.fdopen(w, "wb") as f:
            f.write(data)
        os._exit(0)
    os.close(w)
    with os.fdopen(r, "rb") as f:
        data = f.read()
    _, st = os.waitpid(pid, 0)
    assert not os.WIFSIGNALED(st), f"the task died of signal {os.WTERMSIG(st)} (a read past the page end?)"
    kind, value = pickle.loads(data)
    assert kind == "ok", value
    return value


def run_at_page_end(h, *tasks):
    """The harness's tasks (op, x, s, with_z), each on x placed at a page end
    (and, with_z, writing an output z of x's size at the end of another), in
    one forked child: [(out[:16], z)] in order."""
    def run_all():
        got = []
        ctx = native.Context(np.zeros(1 << 16, np.uint8))
        for op, x, s, with_z in tasks:
            src, dst = PageEnd(), PageEnd()
            px, pz = src.put(x), dst.put(np.zeros_like(x)) if with_z else 0
            space = AddressSpace()
            space.add(Region(1, 0xC000_0000, PAGE, memoryview(src.mm)[:PAGE]))
            space.add(Region(2, 0xC010_0000, PAGE, memoryview(dst.mm)[:PAGE]))
            args = np.frombuffer(bytearray(TASK.pack(op, x.size, s, px, pz)), np.uint8)
            out = np.zeros(16, F32)
            fault, rv, *_ = ctx.run(ctypes.cast(h.t_task, ctypes.c_void_p).value, args, out, space)
            assert (fault, rv) == (0, 0), (op, fault, rv)
            got.append((out, dst.page[PAGE - x.nbytes:].view(F32).copy() if with_z else None))
        return got
    return in_child(run_all)


#: every tail length 1..15, a whole vector and a tail, and whole vectors
#: (whose over-read starts exactly at the next, unmapped, page)
PAGE_END_SIZES = [*range(1, 16), 16, 17, 23, 31, 32, 33, 47]


@pytest.mark.parametrize("n", PAGE_END_SIZES)
def test_seed_functions_on_data_ending_at_a_page_end(h, n):
    x = rng.uniform(-20, 5, n).astype(F32)
    m = F32(x.max())
    ref = np.exp((x - m).astype(np.float64))
    z = (ref * (1 + rng.uniform(-1e-7, 1e-7, n))).astype(F32)  # vecmul's input: any floats
    (mx, _), (sm, _), (_, ez), (_, y) = run_at_page_end(h, (0, x, 0.0, False), (1, x, 0.0, False),
                                                        (2, x, float(m), True), (3, z, 0.37, True))
    assert mx[0] == m
    assert abs(sm[0] - x.astype(np.float64).sum()) <= 1e-5 * np.abs(x).sum()
    assert np.max(np.abs(ez - ref) / ref) < 5e-7
    assert np.array_equal(y, z * F32(0.37))  # vecmul: a whole-vector load over the tail


@pytest.mark.parametrize("n", range(1, 17))
def test_an_aligning_load_over_a_page_end_reads_the_tail_and_zeros(h, n):
    x = rng.uniform(-100, 100, n).astype(F32)
    [(out, _)] = run_at_page_end(h, (4, x, 0.0, False))
    assert np.array_equal(out, np.concatenate([x, np.zeros(16 - n, F32)]))  # lanes past the buffer read 0
