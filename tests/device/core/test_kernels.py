"""Every firmware kernel against an independent numpy reference.

Kernels are called through the TVM FFI global registry with TVM tensors, the
way a loaded module calls them. The convolution/pooling references are direct
loops over kernel taps, not the library's own im2col.
"""
from __future__ import annotations

import numpy as np
import pytest

import tvm  # noqa: E402
from dspx.abi import kernels as ABI  # noqa: E402
from dspx.device.core import kernels as K  # noqa: E402

K.register_all()
RNG = np.random.default_rng(1234)


def call(name, *args, out_shape, out_dtype="float32"):
    """Call kernel `name` via the FFI registry; arrays go in as TVM tensors."""
    conv = [tvm.runtime.tensor(np.ascontiguousarray(a)) if isinstance(a, np.ndarray) else a
            for a in args]
    out = tvm.runtime.tensor(np.full(out_shape, np.nan, dtype=out_dtype))
    tvm.get_global_func(K.PREFIX + name)(*conv, out)
    return out.numpy()


def rand(*shape):
    return RNG.standard_normal(shape).astype(np.float32)


@pytest.fixture(params=["onnxruntime", "torch", "numpy"])
def backend(request):
    """Run the test on each convolution/pooling backend (numpy = no optional deps)."""
    assert K.configure_backend(request.param) == request.param
    yield request.param
    K.configure_backend("auto")


# ---------------------------------------------------------------- references

def ref_conv(x, w, b, stride, pads, dil, groups):
    n, c, h, wd = x.shape
    o, cg, kh, kw = w.shape
    pt, pl, pb, pr = pads
    xp = np.pad(x.astype(np.float64), ((0, 0), (0, 0), (pt, pb), (pl, pr)))
    ho = (h + pt + pb - dil[0] * (kh - 1) - 1) // stride[0] + 1
    wo = (wd + pl + pr - dil[1] * (kw - 1) - 1) // stride[1] + 1
    y = np.zeros((n, o, ho, wo))
    og = o // groups
    for g in range(groups):
        for i in range(kh):
            for j in range(kw):
                patch = xp[:, g * cg:(g + 1) * cg,
                           i * dil[0]: i * dil[0] + stride[0] * (ho - 1) + 1: stride[0],
                           j * dil[1]: j * dil[1] + stride[1] * (wo - 1) + 1: stride[1]]
                y[:, g * og:(g + 1) * og] += np.einsum("nchw,oc->nohw", patch,
                                                       w[g * og:(g + 1) * og, :, i, j])
    if b is not None:
        y += b.reshape(1, o, 1, 1)
    return y


def ref_pool(x, kind, k, s, pads, dil, ceil, cip):
    n, c, h, w = x.shape
    pt, pl, pb, pr = pads

    def osz(size, kk, ss, p0, p1, d):
        eff = d * (kk - 1) + 1
        if ceil:
            o = -(-(size + p0 + p1 - eff) // ss) + 1
            if (o - 1) * ss >= size + p0:
                o -= 1
            return o
        return (size + p0 + p1 - eff) // ss + 1
    ho, wo = osz(h, k[0], s[0], pt, pb, dil[0]), osz(w, k[1], s[1], pl, pr, dil[1])
    y = np.zeros((n, c, ho, wo))
    for i in range(ho):
        for j in range(wo):
            vals, cnt = [], 0
            for a in range(k[0]):
                for bb in range(k[1]):
                    r, q = i * s[0] - pt + a * dil[0], j * s[1] - pl + bb * dil[1]
                    inside = 0 <= r < h and 0 <= q < w
                    in_pad = -pt <= r < h + pb and -pl <= q < w + pr
                    if inside:
                        vals.append(x[:, :, r, q])
                    if inside or (cip and in_pad):
                        cnt += 1
            st = np.stack(vals)
            y[:, :, i, j] = st.max(0) if kind == "max" else st.sum(0) / cnt
    return y


def to_layout(a, layout):
    return a if layout == K.LAYOUT_NCHW else a.transpose(0, 2, 3, 1)


# ---------------------------------------------------------------- convolution

CONV_CASES = [
    # (N, C, H, W, O, kh, kw, stride, pads(t,l,b,r), dil, groups, bias, act)
    (1, 3, 7, 9, 5, 3, 3, (1, 1), (1, 1, 1, 1), (1, 1), 1, True, K.ACT_RELU),
    (2, 6, 11, 8, 9, 3, 2, (2, 1), (0, 1, 2, 0), (1, 1), 3, True, K.ACT_NONE),  # odd, groups, asym
    (1, 4, 13, 13, 8, 3, 3, (1, 1), (2, 2, 2, 2), (2, 2), 2, False, K.ACT_RELU),  # dilation
    (1, 16, 9, 9, 24, 1, 1, (1, 1), (0, 0, 0, 0), (1, 1), 1, True, K.ACT_NONE),  # 1x1
    (1, 8, 10, 7, 8, 3, 3, (2, 2), (1, 1, 1, 1), (1, 1), 8, True, K.ACT_RELU),  # depthwise
    (1, 3, 17, 17, 16, 7, 7, (2, 2), (3, 3, 3, 3), (1, 1), 1, True, K.ACT_RELU),  # stem
    (1, 6, 8, 8, 12, 3, 3, (1, 1), (1, 1, 1, 1), (3, 2), 6, True, K.ACT_NONE),  # dw multiplier 2
]


@pytest.mark.parametrize("layout", [K.LAYOUT_NCHW, K.LAYOUT_NHWC])
@pytest.mark.parametrize("case", CONV_CASES)
def test_conv2d(case, layout, backend):
    n, c, h, w, o, kh, kw, stride, pads, dil, groups, has_bias, act = case
    x, wt = rand(n, c, h, w), rand(o, c // groups, kh, kw)
    b = rand(o) if has_bias else np.zeros(o, np.float32)
    ref = ref_conv(x, wt, b, stride, pads, dil, groups)
    if act == K.ACT_RELU:
        ref = np.maximum(ref, 0)
    ref = to_layout(ref, layout)
    got = call("conv2d", to_layout(x, layout), wt, b, stride, pads, dil, groups, layout, act,
               out_shape=ref.shape)
    np.testing.assert_allclose(got, ref, rtol=1e-4, atol=1e-4)
    # a second call hits the prepacked-weight cache and must agree
    again = call("conv2d", to_layout(x, layout), wt, b, stride, pads, dil, groups, layout, act,
                 out_shape=ref.shape)
    np.testing.assert_array_equal(got, again)


@pytest.mark.parametrize("layout", [K.LAYOUT_NCHW, K.LAYOUT_NHWC])
@pytest.mark.parametrize("act", [K.ACT_NONE, K.ACT_RELU])
def test_conv2d_add(layout, act, backend):
    x, wt, b = rand(1, 8, 9, 11), rand(8, 8, 3, 3), rand(8)
    res = rand(1, 8, 9, 11)
    ref = ref_conv(x, wt, b, (1, 1), (1, 1, 1, 1), (1, 1), 1) + res
    if act:
        ref = np.maximum(ref, 0)
    got = call("conv2d_add", to_layout(x, layout), wt, b, to_layout(res, layout), (1, 1),
               (1, 1, 1, 1), (1, 1), 1, layout, act, out_shape=to_layout(ref, layout).shape)
    np.testing.assert_allclose(got, to_layout(ref, layout), rtol=1e-4, atol=1e-4)


def test_blocked_chain(backend):
    """conv -> maxpool -> conv+residual -> depthwise -> global pool with every
    intermediate in the backend's blocked layout (layout flags) equals the plain chain."""
    x = rand(1, 3, 15, 13)
    w1, b1 = rand(16, 3, 3, 3), rand(16)
    w2, b2 = rand(16, 16, 3, 3) * 0.1, rand(16)
    wd, bd = rand(16, 1, 3, 3), rand(16)
    ref1 = np.maximum(ref_conv(x, w1, b1, (1, 1), (1, 1, 1, 1), (1, 1), 1), 0)
    refp = ref_pool(ref1, "max", (3, 3), (2, 2), (1, 1, 1, 1), (1, 1), 0, 0)
    ref2 = np.maximum(ref_conv(refp, w2, b2, (1, 1), (1, 1, 1, 1), (1, 1), 1) + refp, 0)
    ref3 = ref_conv(ref2, wd, bd, (1, 1), (1, 1, 1, 1), (1, 1), 16)
    ref = ref3.mean(axis=(2, 3), keepdims=True)
    T = tvm.runtime.tensor
    IN, OUT, RES = K.IN_BLOCKED, K.OUT_BLOCKED, K.RES_BLOCKED
    c1, p1 = T(np.zeros(ref1.shape, np.float32)), T(np.zeros(refp.shape, np.float32))
    c2, c3 = T(np.zeros(ref2.shape, np.float32)), T(np.zeros(ref3.shape, np.float32))
    g = T(np.zeros(ref.shape, np.float32))
    one, pad1 = (1, 1), (1, 1, 1, 1)
    for _ in range(2):  # second pass: cached sessions, bound buffers
        K.conv2d(T(x), T(w1), T(b1), one, pad1, one, 1, OUT, K.ACT_RELU, c1)
        K.max_pool2d(c1, (3, 3), (2, 2), pad1, one, 0, IN | OUT, p1)
        K.conv2d_add(p1, T(w2), T(b2), p1, one, pad1, one, 1, IN | OUT | RES, K.ACT_RELU, c2)
        K.conv2d(c2, T(wd), T(bd), one, pad1, one, 16, IN | OUT, K.ACT_NONE, c3)
        K.global_avg_pool2d(c3, IN, g)
        np.testing.assert_allclose(g.numpy(), ref, rtol=1e-4, atol=1e-4)


def test_blocked_conv_as_first_onnxruntime_use():
    """The NCHWc path must set up the process-wide pool itself (fresh process)."""
    import subprocess
    import sys
    code = (
        "import numpy as np, tvm\n"
        "from dspx.device.core import kernels as K\n"
        "T = tvm.runtime.tensor\n"
        "o = T(np.zeros((1, 16, 5, 5), np.float32))\n"
        "K.conv2d(T(np.ones((1, 16, 5, 5), np.float32)), T(np.ones((16, 16, 1, 1), np.float32)),"
        " T(np.zeros(16, np.float32)), (1, 1), (0, 0, 0, 0), (1, 1), 1, K.IN_BLOCKED, 0, o)\n"
        "print(K.backend(), float(o.numpy().sum()))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split()[0] == "onnxruntime"


def test_conv2d_rejects_bad_groups():
    with pytest.raises(K.KernelError):
        K.conv2d(tvm.runtime.tensor(rand(1, 6, 5, 5)), tvm.runtime.tensor(rand(4, 4, 3, 3)),
                 tvm.runtime.tensor(rand(4)), (1, 1), (0, 0, 0, 0), (1, 1), 2, 0, 0,
                 tvm.runtime.tensor(rand(1, 4, 3, 3)))


def test_weight_cache_detects_reused_address(backend):
    """A new weight at the same address (after unload) must not hit a stale prepack."""
    x = rand(1, 4, 6, 6)
    w = rand(4, 4, 3, 3)
    b = np.zeros(4, np.float32)
    wt = tvm.runtime.tensor(w)
    out = tvm.runtime.tensor(np.zeros((1, 4, 4, 4), np.float32))
    args = ((1, 1), (0, 0, 0, 0), (1, 1), 1, 0, 0)
    K.conv2d(tvm.runtime.tensor(x), wt, tvm.runtime.tensor(b), *args, out)
    np.from_dlpack(wt)[...] = -w  # same address, new contents
    K.conv2d(tvm.runtime.tensor(x), wt, tvm.runtime.tensor(b), *args, out)
    np.testing.assert_allclose(out.numpy(), -ref_conv(x, w, b, (1, 1), (0, 0, 0, 0), (1, 1), 1),
                               rtol=1e-4, atol=1e-4)


# ---------------------------------------------------------------- pooling

POOL_CASES = [
    # (kind, shape, k, s, pads, dil, ceil, count_include_pad)
    ("max", (1, 3, 9, 9), (3, 3), (2, 2), (1, 1, 1, 1), (1, 1), 0, 0),
    ("max", (2, 4, 10, 7), (2, 3), (2, 1), (0, 1, 0, 1), (1, 1), 1, 0),
    ("max", (1, 2, 11, 11), (3, 3), (1, 1), (2, 2, 2, 2), (2, 2), 0, 0),
    ("max", (1, 2, 8, 8), (3, 3), (2, 2), (0, 0, 1, 1), (1, 1), 0, 0),  # asym
    ("avg", (1, 3, 9, 9), (3, 3), (2, 2), (1, 1, 1, 1), (1, 1), 0, 0),
    ("avg", (1, 3, 9, 9), (3, 3), (2, 2), (1, 1, 1, 1), (1, 1), 0, 1),
    ("avg", (1, 3, 10, 9), (3, 2), (2, 2), (1, 1, 1, 1), (1, 1), 1, 1),
    ("avg", (1, 3, 8, 8), (2, 2), (2, 2), (0, 0, 1, 1), (1, 1), 1, 0),
]


@pytest.mark.parametrize("layout", [K.LAYOUT_NCHW, K.LAYOUT_NHWC])
@pytest.mark.parametrize("case", POOL_CASES)
def test_pool2d(case, layout, backend):
    kind, shape, k, s, pads, dil, ceil, cip = case
    x = rand(*shape)
    ref = to_layout(ref_pool(x, kind, k, s, pads, dil, ceil, cip), layout)
    xl = to_layout(x, layout)
    if kind == "max":
        got = call("max_pool2d", xl, k, s, pads, dil, ceil, layout, out_shape=ref.shape)
    else:
        got = call("avg_pool2d", xl, k, s, pads, dil, ceil, cip, layout, out_shape=ref.shape)
    np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("layout", [K.LAYOUT_NCHW, K.LAYOUT_NHWC])
def test_global_avg_pool2d(layout):
    x = rand(2, 5, 7, 3)
    ref = x.mean(axis=(2, 3), keepdims=True)
    got = call("global_avg_pool2d", to_layout(x, layout), layout,
               out_shape=to_layout(ref, layout).shape)
    np.testing.assert_allclose(got, to_layout(ref, layout), rtol=1e-5, atol=1e-6)


# ---------------------------------------------------------------- matmul class

@pytest.mark.parametrize("trans_b", [0, 1])
@pytest.mark.parametrize("act", [K.ACT_NONE, K.ACT_RELU])
@pytest.mark.parametrize("lead", [(1,), (7,), (2, 3)])
def test_dense(trans_b, act, lead, backend):
    x, w, b = rand(*lead, 33), rand(19, 33), rand(19)
    ref = x.astype(np.float64) @ w.T.astype(np.float64) + b
    if act:
        ref = np.maximum(ref, 0)
    got = call("dense", x, w if trans_b else np.ascontiguousarray(w.T), b, trans_b, act,
               out_shape=ref.shape)
    np.testing.assert_allclose(got, ref, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("trans_b", [0, 1])
def test_dense_large_uses_backend(trans_b, backend):
    """Large enough (>= 256k MACs) to take the onnxruntime Gemm path."""
    x, w, b = rand(3, 257), rand(2049, 257), rand(2049)
    ref = np.maximum(x.astype(np.float64) @ w.T.astype(np.float64) + b, 0)
    for _ in range(2):  # second call reuses the bound buffers
        got = call("dense", x, w if trans_b else np.ascontiguousarray(w.T), b, trans_b,
                   K.ACT_RELU, out_shape=ref.shape)
        np.testing.assert_allclose(got, ref, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("shapes", [((3, 5, 7), (3, 7, 4)), ((2, 1, 5, 7), (3, 7, 2)),
                                    ((1, 577), (577, 31))])
@pytest.mark.parametrize("trans_b", [0, 1])
def test_matmul(shapes, trans_b):
    a, b = rand(*shapes[0]), rand(*shapes[1])
    ref = np.matmul(a.astype(np.float64), b)
    bb = np.ascontiguousarray(np.swapaxes(b, -1, -2)) if trans_b else b
    got = call("matmul", a, bb, trans_b, out_shape=ref.shape)
    np.testing.assert_allclose(got, ref, rtol=1e-4, atol=1e-4)


def quant_weights(n, k, block):
    q8 = RNG.integers(-127, 128, (n, k), dtype=np.int8)
    q4 = RNG.integers(0, 256, (n, k // 2), dtype=np.uint8)
    scales = (RNG.random((n, k // block)) * 0.02 + 0.001).astype(np.float32)
    mins = ((RNG.random((n, k // block)) - 0.5) * 0.1).astype(np.float32)
    return q8, q4, scales, mins


def dequant_ref(kind, q, scales, mins, block):
    """Independent dequantization: per element, not per block reshape."""
    n = q.shape[0]
    if kind == "q8":
        vals = q.astype(np.float64)
    else:
        vals = np.empty((n, q.shape[1] * 2))
        vals[:, 0::2] = q & 0xF
        vals[:, 1::2] = q >> 4
    k = vals.shape[1]
    idx = np.arange(k) // block
    if kind == "q4":
        vals = vals - 8
    vals = vals * scales[:, idx]
    if kind == "q4_1":
        vals = vals + mins[:, idx]
    return vals


@pytest.mark.parametrize("exact", [False, True])
@pytest.mark.parametrize("kind,n,k,block", [
    ("q8", 96, 576, 32), ("q8", 33, 576, 576), ("q4", 96, 576, 32), ("q4", 17, 64, 16),
    ("q4_1", 40, 576, 32), ("q8", 5, 96, 48)])
@pytest.mark.parametrize("rows", [1, 3])
def test_gemv_quantized(kind, n, k, block, rows, exact):
    K.configure_gemv(exact=exact)
    try:
        q8, q4, scales, mins = quant_weights(n, k, block)
        x = rand(rows, k)
        q = q8 if kind == "q8" else q4
        ref = x.astype(np.float64) @ dequant_ref(kind, q, scales, mins, block).T
        args = (x, q, scales) + ((mins,) if kind == "q4_1" else ()) + (block,)
        got = call("gemv_" + kind, *args, out_shape=ref.shape)
        # fast path: ORT MatMulNBits with int8 activations (~0.5 % of the output scale)
        tol = 1e-4 if exact else 2e-2
        assert np.abs(got - ref).max() <= tol * max(1.0, np.abs(ref).max())
    finally:
        K.configure_gemv(exact=False)


def test_gemv_rejects_inconsistent_scales():
    q8, _, scales, _ = quant_weights(8, 64, 32)
    t = tvm.runtime.tensor
    with pytest.raises(K.KernelError, match="inconsistent"):
        K.gemv_q8(t(rand(1, 64)), t(q8), t(scales[:, :1].copy()), 32, t(rand(1, 8)))
    # through the FFI the message survives (the type becomes RuntimeError)
    with pytest.raises(Exception, match="inconsistent"):
        call("gemv_q8", rand(1, 64), q8, scales[:, :1].copy(), 32, out_shape=(1, 8))


# ---------------------------------------------------------------- normalisation etc.

@pytest.mark.parametrize("axis", [-1, 0, 1])
def test_softmax(axis):
    x = rand(5, 7, 3) * 10
    e = np.exp(x.astype(np.float64) - x.max(axis=axis, keepdims=True))
    ref = e / e.sum(axis=axis, keepdims=True)
    got = call("softmax", x, axis, out_shape=x.shape)
    np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-7)


def test_rmsnorm():
    x, w = rand(3, 4, 576), rand(576)
    x64 = x.astype(np.float64)
    ref = x64 / np.sqrt((x64 ** 2).mean(-1, keepdims=True) + 1e-5) * w
    got = call("rmsnorm", x, w, 1e-5, out_shape=x.shape)
    np.testing.assert_allclose(got, ref, rtol=1e-4, atol=1e-5)


def test_layernorm():
    x, g, b = rand(2, 5, 33) + 3, rand(33), rand(33)
    x64 = x.astype(np.float64)
    ref = (x64 - x64.mean(-1, keepdims=True)) / np.sqrt(x64.var(-1, keepdims=True) + 1e-5) * g + b
    got = call("layernorm", x, g, b, 1e-5, out_shape=x.shape)
    np.testing.assert_allclose(got, ref, rtol=1e-4, atol=1e-5)


def test_silu_mul():
    g, u = rand(1, 1536) * 4, rand(1, 1536)
    g64 = g.astype(np.float64)
    ref = g64 / (1 + np.exp(-g64)) * u
    got = call("silu_mul", g, u, out_shape=g.shape)
    np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("mode", [ABI.ROPE_HALF, ABI.ROPE_INTERLEAVED])
def test_rope(mode):
    s, h, d, theta = 3, 2, 8, 10000.0
    x = rand(1, s, h, d)
    pos = np.array([0, 5, 100], dtype=np.int64)
    ref = np.empty((1, s, h, d))
    for i, p in enumerate(pos):
        for j in range(d // 2):
            ang = p * theta ** (-2 * j / d)
            a, b = ((j, j + d // 2) if mode == ABI.ROPE_HALF else (2 * j, 2 * j + 1))
            xa, xb = x[0, i, :, a].astype(np.float64), x[0, i, :, b].astype(np.float64)
            ref[0, i, :, a] = xa * np.cos(ang) - xb * np.sin(ang)
            ref[0, i, :, b] = xb * np.cos(ang) + xa * np.sin(ang)
    got = call("rope", x, pos, theta, mode, out_shape=x.shape)
    np.testing.assert_allclose(got, ref, rtol=1e-4, atol=1e-5)


def test_attention_decode():
    b, hq, hkv, t, d, length = 1, 9, 3, 256, 64, 101
    q, k, v = rand(b, hq, d), rand(b, hkv, t, d), rand(b, hkv, t, d)
    k[:, :, length:] = np.nan  # never read past the valid length
    v[:, :, length:] = np.nan
    scale = 1 / np.sqrt(d)
    ref = np.empty((b, hq, d))
    for h in range(hq):
        kv = h // (hq // hkv)
        sc = k[0, kv, :length].astype(np.float64) @ q[0, h] * scale
        p = np.exp(sc - sc.max())
        ref[0, h] = (p / p.sum()) @ v[0, kv, :length]
    got = call("attention_decode", q, k, v, length, scale, out_shape=q.shape)
    np.testing.assert_allclose(got, ref, rtol=1e-4, atol=1e-5)


def test_kv_update_copy_and_in_place():
    cache, new = rand(1, 3, 16, 8), rand(1, 3, 2, 8)
    ref = cache.copy()
    ref[:, :, 5:7] = new
    np.testing.assert_array_equal(call("kv_update", cache, new, 5, out_shape=cache.shape), ref)
    t = tvm.runtime.tensor(cache)  # the same buffer in and out: rows written in place
    K.kv_update(t, tvm.runtime.tensor(new), 5, t)
    np.testing.assert_array_equal(t.numpy(), ref)
    with pytest.raises(K.KernelError, match="outside"):
        K.kv_update(t, tvm.runtime.tensor(new), 15, t)


# ---------------------------------------------------------------- registry

def test_registry_documents_every_kernel():
    assert K.names() == set(K.KERNELS)
    for name, spec in K.KERNELS.items():
        # one output each, but the subgraph kernel: its graph's outputs, however many
        assert name.startswith(K.PREFIX) and spec.doc
        assert spec.outputs == ("out",) or (name == K.PREFIX + "onnx_subgraph" and spec.outputs == ("outputs...",))
        assert tvm.get_global_func(name) is not None


def test_rewrite_emits_only_exported_kernels():
    from dspx.compiler import kernel_rewrite
    assert kernel_rewrite.EMITTED <= K.names()


def test_clear_caches(backend):
    x, w = rand(1, 4, 6, 6), rand(4, 4, 3, 3)
    call("conv2d", x, w, np.zeros(4, np.float32), (1, 1), (0, 0, 0, 0), (1, 1), 1, 0, 0,
         out_shape=(1, 4, 4, 4))
    if backend != "numpy":
        assert K.cache_size() > 0
    K.clear_caches()
    assert K.cache_size() == 0


def test_without_torch_falls_back_to_numpy(monkeypatch):
    monkeypatch.setattr(K.backends.state, "torch", None)
    monkeypatch.setattr(K.backends.state, "torch_checked", True)
    K.configure_backend("torch")
    try:
        assert K.backend() == "numpy"
    finally:
        K.configure_backend("auto")


def test_configure_backend_rejects_unknown():
    with pytest.raises(K.KernelError, match="unknown kernel backend"):
        K.configure_backend("mmalib")


def test_configure_threads_rejects_zero():
    with pytest.raises(K.KernelError):
        K.configure_threads(0)


def test_call_site_replay_follows_data_and_weight_changes():
    """A repeated call with the same tensors replays its bound session (one
    site entry); new data in the same buffers and a weight rewritten in place
    both give the new result (the weight check falls back and re-prepacks)."""
    if K.backend() != "onnxruntime":
        pytest.skip("site replay binds onnxruntime sessions")
    K.clear_caches()
    x, w, b = rand(1, 16, 8, 8), rand(16, 16, 3, 3), rand(16)
    tx, tw, tb = (tvm.runtime.tensor(a) for a in (x, w, b))
    out = tvm.runtime.tensor(np.zeros((1, 16, 8, 8), np.float32))
    f = tvm.get_global_func(K.PREFIX + "conv2d")
    attrs = ((1, 1), (1, 1, 1, 1), (1, 1), 1, 0, 0)
    for _ in range(3):
        f(tx, tw, tb, *attrs, out)
    assert len(K.registry.sites) == 1
    np.testing.assert_allclose(out.numpy(), ref_conv(x, w, b, (1, 1), (1, 1, 1, 1), (1, 1), 1),
                               atol=1e-4)
    x2 = rand(1, 16, 8, 8)
    tx.copyfrom(x2)
    f(tx, tw, tb, *attrs, out)
    np.testing.assert_allclose(out.numpy(), ref_conv(x2, w, b, (1, 1), (1, 1, 1, 1), (1, 1), 1),
                               atol=1e-4)
    w2 = rand(16, 16, 3, 3)
    tw.copyfrom(w2)
    f(tx, tw, tb, *attrs, out)
    np.testing.assert_allclose(out.numpy(), ref_conv(x2, w2, b, (1, 1), (1, 1, 1, 1), (1, 1), 1),
                               atol=1e-4)
    K.clear_caches()
    assert not K.registry.sites
