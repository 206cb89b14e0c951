"""The firmware kernel library (the MMALIB analogue).

Compiled modules do not carry their heavy operators: they call these kernels
by name (``R.call_dps_packed("dspx.kernels.conv2d", ...)``), and the name is
resolved against the firmware when the module's VM is created. A module
whose import is not in :func:`names` must be refused at DYN_LOAD with
ERR_SYMBOL naming it.

Calling convention (destination passing, checked against TVM 0.27): every
kernel is called ``fn(*inputs, *attrs, *outputs)``. Inputs and outputs are
TVM tensors (we take zero-copy numpy / torch views through DLPack and write
the outputs in place); attributes are ``R.prim_value`` ints/floats or
``R.shape`` tuples, passed as extra arguments. The spec of every kernel is in
:data:`KERNELS` and docs/kernels.md.

Backends (measured choices, docs/kernels.md): onnxruntime single-op sessions
on one process-wide thread pool for convolution, pooling, large dense layers
and quantized GEMV (MatMulNBits); PyTorch's oneDNN convolution with prepacked
weights as the alternative (``configure_backend("torch")``); numpy for the
small and memory-bound rest. Every kernel has a numpy fallback, so torch and
onnxruntime stay optional. All of them release the interpreter lock while
computing.
"""

from __future__ import annotations

import logging
import os
import threading
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np

log = logging.getLogger(__name__)

from ...abi.kernels import (ACT_NONE, ACT_RELU, IN_BLOCKED, KERNELS as ABI, LAYOUT_NCHW, LAYOUT_NHWC,
                           OUT_BLOCKED, PREFIX, RES_BLOCKED, SUBGRAPH_OPS, SUBGRAPH_WEIGHTS_KEY)


class KernelError(ValueError):
    """A kernel was called with arguments that break its documented contract."""


@dataclass(frozen=True)
class KernelSpec:
    name: str
    fn: Callable[..., None]
    inputs: tuple[str, ...]
    attrs: tuple[str, ...]
    outputs: tuple[str, ...]
    backend: str
    doc: str = field(default="")

    @property
    def signature(self) -> str:
        return f"{self.name}({', '.join(self.inputs + self.attrs + self.outputs)})"


KERNELS: dict[str, KernelSpec] = {}


def _kernel(short: str, backend: str, site: bool = False):
    """Implement the ABI's kernel ``short``; its parameters must be the ABI's arguments.

    site=True: ``fn`` may return a zero-argument run bound to this call's
    memory (an onnxruntime session on an IOBinding); the registered kernel then
    replays it for every later call with the same arguments (see _sites).
    """
    abi = ABI[short]

    def deco(fn):
        params = fn.__code__.co_varnames[:fn.__code__.co_argcount]
        if params != abi.args:
            raise TypeError(f"kernel {short}{params} does not match its ABI {abi.args}")
        name = PREFIX + short
        entry = _site_cached(short, fn) if site else fn
        KERNELS[name] = KernelSpec(name, entry, abi.inputs, abi.attrs, abi.outputs, backend,
                                   (fn.__doc__ or "").strip())
        return fn
    return deco


# A call site of a loaded module passes the same tensors (the VM's memory plan
# alternates between two buffer sets in ResNet-18) and attributes on every
# call.  Keyed by those addresses, shapes and attribute values, its bound run
# is replayed with one dict lookup and a 16-value weight check: no DLPack
# views, no weight cache key.  The key holds no reference to the tensors (an
# address can come back as another buffer, which then has the same shape and
# is just as valid to bind); clear_caches() drops every entry with the module.
_sites: dict[tuple, tuple] = {}  # key -> (run, weight sample view, its bytes then)
_MAX_SITES = 4096  # a ResNet-50 needs ~110 (55 kernel calls x 2 buffer sets)


def _site_key(short: str, args: tuple) -> tuple | None:
    key: list = [short]
    for a in args:
        if isinstance(a, (int, float, tuple)):  # prim values; R.shape arrives as a tuple subclass
            key.append(a)
        elif hasattr(a, "data_ptr"):
            key += (a.data_ptr(), a.shape)
        else:  # an ffi Array (a Python tuple passed through the FFI)
            try:
                key.append(tuple(a))
            except TypeError:
                return None
    return tuple(key)


def _site_cached(short: str, fn: Callable, weight_of: Callable[[tuple], Any] | None = None):
    """fn's kernel with call-site replay.  weight_of(args): the argument whose
    contents the bound run holds a copy of (default: argument 1 of a kernel
    with a weight), checked by a sample before each replay."""
    if weight_of is None and "weight" in ABI[short].inputs:
        def weight_of(args):
            return args[1]

    def kernel(*args):
        key = _site_key(short, args)
        hit = _sites.get(key) if key is not None else None
        if hit is not None and (hit[1] is None or hit[1].tobytes() == hit[2]):
            hit[0]()
            return
        run = fn(*args)
        if key is not None and callable(run):
            if len(_sites) >= _MAX_SITES:  # addresses that never repeat: do not grow without end
                _sites.clear()
            w = weight_of(args) if weight_of is not None else None
            sample = _weight_sample(_np(w)) if w is not None else None
            _sites[key] = (run, sample, None if sample is None else sample.tobytes())
    kernel.__name__ = kernel.__qualname__ = fn.__name__
    kernel.__doc__ = fn.__doc__
    return kernel


def _weight_sample(w: np.ndarray) -> np.ndarray:
    """The weight's fingerprint samples (as _fingerprint) as a view on its raw
    address that holds no reference: it is read only while a call passes a
    live tensor at that address and shape.  A weight rewritten in place (a
    weight fed as an input) then falls back to the full path and re-prepacks."""
    import ctypes

    raw = np.frombuffer((ctypes.c_char * w.nbytes).from_address(_addr(w)), dtype=w.dtype)
    step = max(1, raw.size // 16)
    return raw[::step][:16]


def _small_threads(work: int) -> int | None:
    """One thread for ops whose work (MACs or elements) is below ~2M: waking a
    sleeping pool thread costs 30-300 us on these VMs, more than such an op."""
    return 1 if work < 1 << 21 else None


# ---------------------------------------------------------------- backends

_torch: Any = None
_torch_checked = False
_threads = 2
_lock = threading.Lock()


def _get_torch():
    """torch is optional: import it once, lazily; without it warn in one line."""
    global _torch, _torch_checked
    if not _torch_checked:
        _torch_checked = True
        try:
            import torch
            torch.set_num_threads(_threads)
            _torch = torch
        except ImportError:
            log.warning("dspx kernels: torch not installed; convolution and pooling use the "
                        "numpy fallback (2x slower) -- pip install 'dspx[kernels]'")
    return _torch


def configure_threads(n: int) -> None:
    """Give every threaded backend of this process the core's thread budget ``n``.

    One threaded backend per process is the rule (oversubscription cost 5-20x
    here); torch's OpenMP pool and onnxruntime's global pool are sized to n.
    numpy's OpenBLAS pool can only be sized before numpy loads
    (OPENBLAS_NUM_THREADS), which the device core process does.
    """
    global _threads
    if n < 1:
        raise KernelError(f"thread budget must be >= 1, got {n}")
    _threads = n
    if _torch is not None:
        _torch.set_num_threads(n)
    # numpy's BLAS only does the small leftovers (attention, batched matmul)
    # once a threaded backend exists: keep it to one thread so it never spins
    # against that backend's pool.
    _set_blas_threads(n if backend() == "numpy" else 1)


def _set_blas_threads(n: int) -> bool:
    """Resize the OpenBLAS pool numpy loaded (numpy has no API for it)."""
    import ctypes

    try:
        with open("/proc/self/maps") as f:
            libs = {line.split()[-1] for line in f if "openblas" in line and ".so" in line}
    except OSError:
        return False
    for path in libs:
        lib = ctypes.CDLL(path)
        for sym in ("scipy_openblas_set_num_threads64_", "openblas_set_num_threads"):
            fn = getattr(lib, sym, None)
            if fn is not None:
                fn(ctypes.c_int(n))
                return True
    return False


BACKENDS = ("onnxruntime", "torch", "numpy")
# Convolution/pooling backend. onnxruntime first: measured here its thread
# pool keeps its speed when other processes share the cores (a 64ch 3x3 conv:
# 1.8 ms median vs 17.9 ms for torch's OpenMP, both 1.0-1.1 ms on idle
# cores), and the device shares its cores with the host and the other DSP
# cores. torch (oneDNN, NHWC, prepacked) is ~7 % faster on idle cores.
_backend = os.environ.get("DSPX_KERNEL_BACKEND", "auto")
if _backend not in BACKENDS + ("auto",):
    log.warning("DSPX_KERNEL_BACKEND=%r is not one of auto, %s; using auto",
                _backend, ", ".join(BACKENDS))
    _backend = "auto"


def configure_backend(name: str) -> str:
    """Pick the convolution/pooling/dense backend: auto | onnxruntime | torch | numpy.

    Switch only while no module is loaded: blocked tensors are in the
    backend's private layout.
    """
    global _backend
    if name not in BACKENDS + ("auto",):
        raise KernelError(f"unknown kernel backend {name!r}; "
                          f"choose from auto, {', '.join(BACKENDS)}")
    _backend = name
    clear_caches()
    return backend()


def backend() -> str:
    """The convolution/pooling backend in use (resolving "auto")."""
    if _backend != "auto":
        if _backend == "torch" and _get_torch() is None:
            return "numpy"
        if _backend == "onnxruntime" and not _have_ort():
            return "numpy"
        return _backend
    if _have_ort():
        return "onnxruntime"
    return "torch" if _get_torch() is not None else "numpy"


_ort_checked: bool | None = None


def _have_ort() -> bool:
    global _ort_checked
    if _ort_checked is None:
        try:
            import onnx  # noqa: F401
            import onnxruntime  # noqa: F401
            _ort_checked = True
        except ImportError:
            _ort_checked = False
    return _ort_checked


class _OrtOp:
    """A one-node (or tiny) ONNX graph in a session on the shared pool.

    Runs with an IOBinding straight on the caller's memory: no copies in or out.
    """

    def __init__(self, nodes, inputs: list[tuple[str, tuple]], out: tuple[str, tuple],
                 inits: dict[str, np.ndarray], opset: int = 17, threads: int | None = None, domains=()):
        import onnxruntime as ort
        from onnx import TensorProto, helper, numpy_helper

        g = helper.make_graph(
            nodes, "k", [helper.make_tensor_value_info(n, TensorProto.FLOAT, list(sh))
                         for n, sh in inputs],
            [helper.make_tensor_value_info(out[0], TensorProto.FLOAT, list(out[1]))],
            [numpy_helper.from_array(np.ascontiguousarray(v), k) for k, v in inits.items()])
        m = helper.make_model(g, opset_imports=[helper.make_opsetid("", opset),
                                                *(helper.make_opsetid(d, v) for d, v in domains)])
        m.ir_version = 8
        self.sess = ort.InferenceSession(m.SerializeToString(), ort_session_options(threads),
                                         providers=["CPUExecutionProvider"])
        self.names = [n for n, _ in inputs]
        self.out = out[0]
        self._runs = {}  # input/output addresses -> the run bound to them

    def __call__(self, arrays: list[np.ndarray], out: np.ndarray) -> Callable[[], None]:
        """Run on these arrays; returns the run bound to their addresses.

        The VM's memory plan alternates between a few buffer sets from call to
        call (two in ResNet-18): one IOBinding per address set, so no call
        rebinds (~10 us each)."""
        ptrs = tuple(_addr(a) for a in arrays) + (_addr(out),)
        runs = self._runs
        run = runs.get(ptrs)
        if run is None:
            if len(runs) >= 16:
                runs.clear()
            io = self.sess.io_binding()
            for name, a, p in zip(self.names, arrays, ptrs):
                io.bind_input(name, "cpu", 0, np.float32, list(a.shape), p)
            io.bind_output(self.out, "cpu", 0, np.float32, list(out.shape), ptrs[-1])
            run = runs[ptrs] = _bound_run(self.sess, io)
        run()
        return run


def _bound_run(sess, io) -> Callable[[], None]:
    """sess.run_with_iobinding(io) without the Python wrapper's per-call checks
    (WebGPU graph capture) when the binding's C object is reachable."""
    import functools

    c_sess, c_io = getattr(sess, "_sess", None), getattr(io, "_iobinding", None)
    if c_sess is None or c_io is None:
        return functools.partial(sess.run_with_iobinding, io)
    return functools.partial(c_sess.run_with_iobinding, c_io, None)


def _addr(a: np.ndarray) -> int:
    return a.__array_interface__["data"][0]


def _np(t) -> np.ndarray:
    return np.from_dlpack(t)


def _ints(shape) -> list[int]:
    return [int(v) for v in shape]


# Prepacked weights, keyed by the constant's address and shape. Module
# constants live as long as the module, so the address is stable; a
# fingerprint of sampled values guards against a later module reusing the
# address. The loader calls clear_caches() on DYN_UNLOAD anyway.
_cache: dict[tuple, tuple[bytes, Any]] = {}


def _fingerprint(a: np.ndarray) -> bytes:
    flat = a.reshape(-1)
    step = max(1, flat.size // 16)
    return flat[::step][:16].tobytes()


def _cached(a: np.ndarray, extra: tuple, make: Callable[[], Any]) -> Any:
    key = (a.ctypes.data, a.shape, a.dtype.str) + extra
    fp = _fingerprint(a)
    hit = _cache.get(key)
    if hit is not None and hit[0] == fp:
        return hit[1]
    with _lock:
        value = make()
        _cache[key] = (fp, value)
    return value


_other_caches: list[dict] = []  # caches of other kernel files (llm_kernels' RoPE tables)


def clear_caches() -> None:
    """Drop every prepacked weight and per-weight session (call on DYN_UNLOAD)."""
    with _lock:
        _cache.clear()
        _sites.clear()
        _pool_ops.clear()
        for c in _other_caches:
            c.clear()


def cache_size() -> int:
    return len(_cache)


# ---------------------------------------------------------------- convolution

def _conv_out(size: int, k: int, s: int, p0: int, p1: int, d: int) -> int:
    return (size + p0 + p1 - d * (k - 1) - 1) // s + 1


def _conv_numpy(x, w, b, strides, pads, dil, groups):
    """NCHW im2col + matmul; x (N,C,H,W), w (O,C/g,KH,KW) -> (N,O,Ho,Wo)."""
    n, c, h, wd = x.shape
    o, cg, kh, kw = w.shape
    pt, pl, pb, pr = pads
    xp = np.pad(x, ((0, 0), (0, 0), (pt, pb), (pl, pr)))
    ho = _conv_out(h, kh, strides[0], pt, pb, dil[0])
    wo = _conv_out(wd, kw, strides[1], pl, pr, dil[1])
    ekh, ekw = dil[0] * (kh - 1) + 1, dil[1] * (kw - 1) + 1
    win = np.lib.stride_tricks.sliding_window_view(xp, (ekh, ekw), axis=(2, 3))
    win = win[:, :, ::strides[0], ::strides[1], ::dil[0], ::dil[1]][:, :, :ho, :wo]
    og = o // groups
    cols = win.reshape(n, groups, cg, ho, wo, kh, kw).transpose(0, 1, 3, 4, 2, 5, 6)
    cols = cols.reshape(n, groups, ho * wo, cg * kh * kw)
    wm = w.reshape(groups, og, cg * kh * kw).transpose(0, 2, 1)
    y = np.matmul(cols, wm)  # (n, g, ho*wo, og)
    y = y.transpose(0, 1, 3, 2).reshape(n, o, ho, wo)
    if b is not None:
        y += b.reshape(1, o, 1, 1)
    return y


def _restore(w: np.ndarray, scale: np.ndarray | None, axis: int) -> np.ndarray:
    """A reduced-precision weight as float32 (dspx compile --weights): float16
    cast, or int8 times its per-channel scale along ``axis``.  Done once per
    weight and cached beside the prepacked weights (the stored weight lives as
    long as its module, so its address is a stable key)."""
    if w.dtype == np.float32 and scale is None:
        return w

    def make():
        f = w.astype(np.float32)
        if scale is not None:
            shape = [1] * f.ndim
            shape[axis] = -1
            f *= scale.reshape(shape)
        return f
    return _cached(w, ("restore", axis), make)


def _conv2d_impl(x_t, w_t, b_t, r_t, strides, padding, dilation, groups, layout, act, out_t, s_t=None):
    x, out = _np(x_t), _np(out_t)
    w = _restore(_np(w_t), _np(s_t) if s_t is not None else None, 0)
    b = _np(b_t) if b_t is not None else None
    res = _np(r_t) if r_t is not None else None
    strides, pads, dil = _ints(strides), _ints(padding), _ints(dilation)
    groups, layout, act = int(groups), int(layout), int(act)
    flags, layout = layout & ~3, layout & 3
    if len(pads) == 2:
        pads = pads + pads
    if x.ndim != 4 or w.ndim != 4 or out.ndim != 4:
        raise KernelError("conv2d expects 4-D data, weight and output")
    if layout not in (LAYOUT_NCHW, LAYOUT_NHWC):
        raise KernelError(f"conv2d: unknown layout code {layout}")
    cin = x.shape[1] if layout == LAYOUT_NCHW else x.shape[3]
    if cin != w.shape[1] * groups or w.shape[0] % groups:
        raise KernelError(f"conv2d: input channels {cin} do not match weight {w.shape} "
                          f"with groups={groups}")
    be = backend()
    if be == "onnxruntime" and flags:
        if layout != LAYOUT_NCHW:
            raise KernelError("conv2d: blocked tensors must be NCHW-shaped")
        return _conv_nchwc(x, w, b, res, strides, pads, dil, groups, act, flags, out)
    if be == "onnxruntime":
        return _conv_ort(x, w, b, res, strides, pads, dil, groups, layout, act, out)
    torch = _get_torch() if be == "torch" else None
    if torch is None:
        xn = x if layout == LAYOUT_NCHW else x.transpose(0, 3, 1, 2)
        y = _conv_numpy(xn, w, b, strides, pads, dil, groups)
        if layout == LAYOUT_NHWC:
            y = y.transpose(0, 2, 3, 1)
        if res is not None:
            y += res
        if act == ACT_RELU:
            np.maximum(y, 0, out=y)
        out[...] = y
        return
    # NHWC numpy buffers become channels_last torch views: no copies.
    tx = torch.from_numpy(x)
    to = torch.from_numpy(out)
    if layout == LAYOUT_NHWC:
        tx, to = tx.permute(0, 3, 1, 2), to.permute(0, 3, 1, 2)
    pt, pl, pb, pr = pads
    if pt != pb or pl != pr:  # oneDNN takes symmetric padding only
        tx = torch.nn.functional.pad(tx, (pl, pr, pt, pb))
        if layout == LAYOUT_NHWC:
            tx = tx.contiguous(memory_format=torch.channels_last)
        pt = pl = 0
    pad2 = [pt, pl]
    in_shape = list(tx.shape)
    wp = _cached(w, ("conv", tuple(pad2), tuple(strides), tuple(dil), groups, tuple(in_shape)),
                 lambda: torch._C._nn.mkldnn_reorder_conv2d_weight(
                     torch.from_numpy(w).to_mkldnn(), pad2, strides, dil, groups, in_shape))
    tb = torch.from_numpy(b) if b is not None else None
    unary = "relu" if act == ACT_RELU else None
    if res is not None:
        # out = act(conv(x) + b + res), accumulated by oneDNN straight into out.
        tr = torch.from_numpy(res)
        if layout == LAYOUT_NHWC:
            tr = tr.permute(0, 3, 1, 2)
        to.copy_(tr)
        torch.ops.mkldnn._convolution_pointwise_.binary(
            to, tx, wp, tb, pad2, strides, dil, groups, "add", 1.0, unary, [], "")
        return
    y = torch.ops.mkldnn._convolution_pointwise(
        tx, wp, tb, pad2, strides, dil, groups, unary or "none", [], "")
    to.copy_(y)


def _conv_ort(x, w, b, res, strides, pads, dil, groups, layout, act, out):
    """Conv (+Add) (+Relu) as one ORT graph, which ORT fuses into one FusedConv."""
    from onnx import helper

    nhwc = layout == LAYOUT_NHWC
    # ORT convolves NCHW; NHWC data is transposed in and out (correct, slower:
    # compile with layout="NCHW" for this backend).
    xn = np.ascontiguousarray(x.transpose(0, 3, 1, 2)) if nhwc else x
    rn = None
    if res is not None:
        rn = np.ascontiguousarray(res.transpose(0, 3, 1, 2)) if nhwc else res
    on = np.empty(out.transpose(0, 3, 1, 2).shape, np.float32) if nhwc else out
    if not on.flags.c_contiguous or not xn.flags.c_contiguous:
        raise KernelError("conv2d: data and out must be contiguous")

    def make():
        nodes = [helper.make_node("Conv", ["x", "w", "b"], ["c"], strides=strides, pads=
                                  [pads[0], pads[1], pads[2], pads[3]], dilations=dil,
                                  group=groups)]
        last, inputs = "c", [("x", xn.shape)]
        if rn is not None:
            nodes.append(helper.make_node("Add", ["c", "r"], ["a"]))
            last = "a"
            inputs.append(("r", rn.shape))
        if act == ACT_RELU:
            nodes.append(helper.make_node("Relu", [last], ["y"]))
            last = "y"
        bias = b if b is not None else np.zeros(w.shape[0], np.float32)
        return _OrtOp(nodes, inputs, (last, on.shape), {"w": w, "b": bias})

    op = _cached(w, ("ort-conv", tuple(strides), tuple(pads), tuple(dil), groups, act,
                     rn is not None, xn.shape,
                     b.ctypes.data if b is not None else 0), make)
    run = op([xn] if rn is None else [xn, rn], on)
    if nhwc:
        out[...] = on.transpose(0, 2, 3, 1)
        return None
    return run


def optimize_model(model: bytes) -> bytes:
    """onnxruntime's optimized form of a model, which it writes only to a
    file.  A sandboxed core (no new files) replaces this with its planner
    process's (device/core/planner.py)."""
    import tempfile

    import onnxruntime as ort

    with tempfile.TemporaryDirectory() as d:
        so = ort_session_options()
        so.optimized_model_filepath = os.path.join(d, "opt.onnx")
        ort.InferenceSession(model, so, providers=["CPUExecutionProvider"])
        with open(so.optimized_model_filepath, "rb") as f:
            return f.read()


def _nchwc_plan(node, x_shape, y_shape, inits):
    """Let onnxruntime rewrite a one-op graph to NCHWc; return its NCHWc node and
    initializers (the filter comes back in MLAS' blocked order), or None."""
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    g = helper.make_graph([node], "p", [helper.make_tensor_value_info("x", TensorProto.FLOAT,
                                                                      list(x_shape))],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, list(y_shape))],
                          [numpy_helper.from_array(np.ascontiguousarray(v), k)
                           for k, v in inits.items()])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    m.ir_version = 8
    opt = onnx.load_from_string(optimize_model(m.SerializeToString()))
    main = [n for n in opt.graph.node if n.domain == "com.microsoft.nchwc"
            and n.op_type not in ("ReorderInput", "ReorderOutput")]
    if len(main) != 1:
        return None
    reorder_in = any(n.op_type == "ReorderInput" for n in opt.graph.node)
    return main[0], {i.name: numpy_helper.to_array(i) for i in opt.graph.initializer}, reorder_in


class _NchwcOp(_OrtOp):
    """One NCHWc op with reorders only where a neighbour is not blocked."""

    def __init__(self, main, inits, reorder_in, x_shape, y_shape, channels_out,
                 in_blocked, out_blocked, res_shape=None, res_blocked=False, act=ACT_NONE,
                 threads: int | None = None):
        from onnx import helper

        nodes, feeds = [], [("x", x_shape)]
        xin = "x"
        if reorder_in and not in_blocked:
            nodes.append(helper.make_node("ReorderInput", ["x"], ["xb"],
                                          domain="com.microsoft.nchwc", channels_last=0))
            xin = "xb"
        elif in_blocked and not reorder_in:
            raise KernelError("conv2d: onnxruntime will not take this input blocked")
        ins = [xin] + list(main.input[1:])
        if res_shape is not None:
            feeds.append(("r", res_shape))
            if res_blocked:
                ins.append("r")
            else:
                nodes.append(helper.make_node("ReorderInput", ["r"], ["rb"],
                                              domain="com.microsoft.nchwc", channels_last=0))
                ins.append("rb")
            while len(ins) < 4:  # Sum is the 4th input; keep B's slot
                ins.insert(2, "")
        attrs = {a.name: helper.get_attribute_value(a) for a in main.attribute}
        if act == ACT_RELU:
            attrs["activation"] = "Relu"
        out = "y" if out_blocked else "yb"
        nodes.append(helper.make_node(main.op_type, ins, [out], domain="com.microsoft.nchwc",
                                      **attrs))
        if not out_blocked:
            nodes.append(helper.make_node("ReorderOutput", ["yb"], ["y"],
                                          domain="com.microsoft.nchwc", channels_last=0,
                                          channels=channels_out))
        super().__init__(nodes, feeds, ("y", y_shape), inits, threads=threads,
                         domains=(("com.microsoft.nchwc", 1),))


def _conv_nchwc(x, w, b, res, strides, pads, dil, groups, act, flags, out):
    from onnx import helper

    def make():
        node = helper.make_node("Conv", ["x", "w", "b"], ["y"], strides=strides, pads=pads,
                                dilations=dil, group=groups)
        bias = b if b is not None else np.zeros(w.shape[0], np.float32)
        plan = _nchwc_plan(node, x.shape, out.shape, {"w": w, "b": bias})
        if plan is None:
            raise KernelError("conv2d: onnxruntime has no NCHWc kernel for this convolution; "
                              "compile with blocked=False")
        main, inits, reorder_in = plan
        return _NchwcOp(main, inits, reorder_in, x.shape, out.shape, w.shape[0],
                        bool(flags & IN_BLOCKED), bool(flags & OUT_BLOCKED),
                        res.shape if res is not None else None, bool(flags & RES_BLOCKED), act)

    op = _cached(w, ("nchwc-conv", tuple(strides), tuple(pads), tuple(dil), groups, act, flags,
                     res is not None, x.shape, b.ctypes.data if b is not None else 0), make)
    return op([x] if res is None else [x, res], out)


@_kernel("conv2d", "torch oneDNN (prepacked weights) | numpy im2col", site=True)
def conv2d(data, weight, bias, strides, padding, dilation, groups, layout, act, out):
    """2-D convolution, out = act(conv(data, weight) + bias).

    data NCHW (layout=0) or NHWC (layout=1); weight OIHW (always, I = C/groups);
    bias (O,); strides (sh, sw); padding (top, left, bottom, right);
    dilation (dh, dw); groups int; act 0 = none, 1 = ReLU; out in data's layout.
    """
    return _conv2d_impl(data, weight, bias, None, strides, padding, dilation, groups, layout, act, out)


@_kernel("conv2d_add", "torch oneDNN (sum post-op, in place) | numpy im2col", site=True)
def conv2d_add(data, weight, bias, residual, strides, padding, dilation, groups, layout, act, out):
    """Convolution with a fused residual: out = act(conv(data, weight) + bias + residual).

    Same attributes as conv2d; residual has out's shape and layout.
    """
    return _conv2d_impl(data, weight, bias, residual, strides, padding, dilation, groups, layout, act, out)


@_kernel("conv2d_qw", "as conv2d, int8 weight restored once", site=True)
def conv2d_qw(data, weight, bias, wscale, strides, padding, dilation, groups, layout, act, out):
    """conv2d with an int8 weight (O, C/groups, KH, KW) and its per-output-channel scales (O,)."""
    return _conv2d_impl(data, weight, bias, None, strides, padding, dilation, groups, layout, act, out, wscale)


@_kernel("conv2d_add_qw", "as conv2d_add, int8 weight restored once", site=True)
def conv2d_add_qw(data, weight, bias, residual, wscale, strides, padding, dilation, groups, layout, act, out):
    """conv2d_add with an int8 weight and its per-output-channel scales (O,)."""
    return _conv2d_impl(data, weight, bias, residual, strides, padding, dilation, groups, layout, act, out, wscale)


# ---------------------------------------------------------------- pooling

def _pool_out(size, k, s, p0, p1, d, ceil):
    eff = d * (k - 1) + 1
    if ceil:
        o = -(-(size + p0 + p1 - eff) // s) + 1
        if (o - 1) * s >= size + p0:  # last window must start inside input or left pad
            o -= 1
        return o
    return (size + p0 + p1 - eff) // s + 1


def _pool_numpy(x, kind, pool, strides, pads, dil, ceil, count_include_pad):
    """NCHW pooling in numpy; returns (N,C,Ho,Wo)."""
    n, c, h, w = x.shape
    pt, pl, pb, pr = pads
    ho = _pool_out(h, pool[0], strides[0], pt, pb, dil[0], ceil)
    wo = _pool_out(w, pool[1], strides[1], pl, pr, dil[1], ceil)
    ekh, ekw = dil[0] * (pool[0] - 1) + 1, dil[1] * (pool[1] - 1) + 1
    eb = max(0, (ho - 1) * strides[0] + ekh - (h + pt + pb))
    er = max(0, (wo - 1) * strides[1] + ekw - (w + pl + pr))
    fill = -np.inf if kind == "max" else 0.0
    xp = np.pad(x, ((0, 0), (0, 0), (pt, pb + eb), (pl, pr + er)), constant_values=fill)

    def windows(a):
        v = np.lib.stride_tricks.sliding_window_view(a, (ekh, ekw), axis=(2, 3))
        return v[:, :, ::strides[0], ::strides[1], ::dil[0], ::dil[1]][:, :, :ho, :wo]

    if kind == "max":
        return windows(xp).max(axis=(4, 5))
    total = windows(xp).sum(axis=(4, 5))
    ones = np.zeros((1, 1) + xp.shape[2:], dtype=x.dtype)
    if count_include_pad:
        ones[..., :h + pt + pb, :w + pl + pr] = 1
    else:
        ones[..., pt:pt + h, pl:pl + w] = 1
    return total / windows(ones).sum(axis=(4, 5))


def _pool_impl(kind, x_t, pool, strides, padding, dilation, ceil_mode, count_include_pad,
               layout, out_t):
    x, out = _np(x_t), _np(out_t)
    pool, strides, pads, dil = _ints(pool), _ints(strides), _ints(padding), _ints(dilation)
    if len(pads) == 2:
        pads = pads + pads
    layout, ceil, cip = int(layout), bool(ceil_mode), bool(count_include_pad)
    flags, layout = layout & ~3, layout & 3
    be = backend()
    if be == "onnxruntime" and flags and kind == "max" and layout == LAYOUT_NCHW:
        return _pool_nchwc(x, pool, strides, pads, dil, ceil, flags, out)
    if be == "onnxruntime" and (kind == "max" or dil == [1, 1]):
        return _pool_ort(kind, x, pool, strides, pads, dil, ceil, cip, layout, out)
    torch = _get_torch() if be == "torch" else None
    pt, pl, pb, pr = pads
    symmetric = pt == pb and pl == pr and 2 * pt <= pool[0] and 2 * pl <= pool[1]
    if torch is not None and symmetric and (kind == "max" or dil == [1, 1]):
        tx, to = torch.from_numpy(x), torch.from_numpy(out)
        if layout == LAYOUT_NHWC:
            tx, to = tx.permute(0, 3, 1, 2), to.permute(0, 3, 1, 2)
        if kind == "max":
            y = torch.nn.functional.max_pool2d(tx, pool, strides, [pt, pl], dil, ceil_mode=ceil)
        else:
            y = torch.nn.functional.avg_pool2d(tx, pool, strides, [pt, pl], ceil_mode=ceil,
                                               count_include_pad=cip)
        to.copy_(y)
        return
    xn = x if layout == LAYOUT_NCHW else x.transpose(0, 3, 1, 2)
    y = _pool_numpy(xn, kind, pool, strides, pads, dil, ceil, cip)
    out[...] = y if layout == LAYOUT_NCHW else y.transpose(0, 2, 3, 1)


_pool_ops: dict[tuple, _OrtOp] = {}


def _pool_ort(kind, x, pool, strides, pads, dil, ceil, cip, layout, out):
    from onnx import helper

    nhwc = layout == LAYOUT_NHWC
    xn = np.ascontiguousarray(x.transpose(0, 3, 1, 2)) if nhwc else np.ascontiguousarray(x)
    on = np.empty(out.transpose(0, 3, 1, 2).shape, np.float32) if nhwc else out
    key = (kind, tuple(pool), tuple(strides), tuple(pads), tuple(dil), ceil, cip, xn.shape)
    op = _pool_ops.get(key)
    if op is None:
        attrs = dict(kernel_shape=pool, strides=strides, pads=pads, ceil_mode=int(ceil))
        if kind == "max":
            node = helper.make_node("MaxPool", ["x"], ["y"], dilations=dil, **attrs)
        else:
            node = helper.make_node("AveragePool", ["x"], ["y"], count_include_pad=int(cip),
                                    **attrs)
        op = _pool_ops[key] = _OrtOp([node], [("x", xn.shape)], ("y", on.shape), {},
                                     threads=_small_threads(on.size * pool[0] * pool[1]))
    run = op([xn], on)
    if nhwc or xn is not x:
        if nhwc:
            out[...] = on.transpose(0, 2, 3, 1)
        return None
    return run


def _pool_nchwc(x, pool, strides, pads, dil, ceil, flags, out):
    from onnx import helper

    key = ("nchwc-max", tuple(pool), tuple(strides), tuple(pads), tuple(dil), ceil, flags,
           x.shape)
    op = _pool_ops.get(key)
    if op is None:
        node = helper.make_node("MaxPool", ["x"], ["y"], kernel_shape=pool, strides=strides,
                                pads=pads, dilations=dil, ceil_mode=int(ceil))
        plan = _nchwc_plan(node, x.shape, out.shape, {})
        if plan is None:
            raise KernelError("max_pool2d: onnxruntime has no NCHWc kernel for this pooling")
        main, inits, reorder_in = plan
        op = _pool_ops[key] = _NchwcOp(main, inits, reorder_in, x.shape, out.shape, x.shape[1],
                                       bool(flags & IN_BLOCKED), bool(flags & OUT_BLOCKED),
                                       threads=_small_threads(out.size * pool[0] * pool[1]))
    xc = np.ascontiguousarray(x)
    run = op([xc], out)
    return run if xc is x else None


@_kernel("max_pool2d", "torch (channels_last) | numpy", site=True)
def max_pool2d(data, pool, strides, padding, dilation, ceil_mode, layout, out):
    """Max pooling. pool (kh, kw); padding (top, left, bottom, right); layout 0 NCHW / 1 NHWC."""
    return _pool_impl("max", data, pool, strides, padding, dilation, ceil_mode, False, layout, out)


@_kernel("avg_pool2d", "torch (channels_last) | numpy", site=True)
def avg_pool2d(data, pool, strides, padding, dilation, ceil_mode, count_include_pad, layout, out):
    """Average pooling; count_include_pad 0/1 as in ONNX AveragePool."""
    return _pool_impl("avg", data, pool, strides, padding, dilation, ceil_mode, count_include_pad,
                      layout, out)


@_kernel("global_avg_pool2d", "numpy", site=True)
def global_avg_pool2d(data, layout, out):
    """Mean over the spatial axes; out (N,C,1,1) for NCHW or (N,1,1,C) for NHWC (any shape with
    the same element count is accepted, e.g. the flattened (N,C))."""
    x, o = _np(data), _np(out)
    layout = int(layout)
    if layout & IN_BLOCKED and backend() == "onnxruntime":
        from onnx import helper

        key = ("nchwc-gap", x.shape)
        op = _pool_ops.get(key)
        if op is None:
            shape = (x.shape[0], x.shape[1], 1, 1)
            plan = _nchwc_plan(helper.make_node("GlobalAveragePool", ["x"], ["y"]), x.shape,
                               shape, {})
            if plan is None:
                raise KernelError("global_avg_pool2d: no NCHWc kernel in onnxruntime")
            op = _pool_ops[key] = _NchwcOp(*plan, x.shape, shape, x.shape[1], True, False,
                                           threads=_small_threads(x.size))
        return op([x], o.reshape(x.shape[0], x.shape[1], 1, 1))
    axes = (2, 3) if layout & 3 == LAYOUT_NCHW else (1, 2)
    o.reshape(-1)[...] = x.mean(axis=axes, dtype=np.float32).reshape(-1)


# ---------------------------------------------------------------- matmul class

def _act_inplace(y: np.ndarray, act: int) -> None:
    if act == ACT_RELU:
        np.maximum(y, 0, out=y)


@_kernel("dense", "onnxruntime Gemm | numpy/OpenBLAS", site=True)
def dense(data, weight, bias, trans_b, act, out):
    """Fully connected: out = act(data @ W + bias).

    data (..., K); weight (N, K) when trans_b=1 (pre-transposed, as stored by
    Linear/Gemm transB=1) or (K, N) when trans_b=0; bias (N,) (pass zeros
    for none); out (..., N).
    """
    return _dense(data, weight, bias, None, trans_b, act, out)


@_kernel("dense_qw", "as dense, int8 weight restored once", site=True)
def dense_qw(data, weight, bias, wscale, trans_b, act, out):
    """dense with an int8 weight and its per-output scales (N,): W = q * wscale along N."""
    return _dense(data, weight, bias, wscale, trans_b, act, out)


def _dense(data, weight, bias, wscale, trans_b, act, out):
    x, b, o = _np(data), _np(bias), _np(out)
    tb, act = int(trans_b), int(act)
    w = _restore(_np(weight), _np(wscale) if wscale is not None else None, 0 if tb else 1)
    wm = w.T if tb else w
    if x.shape[-1] != wm.shape[0]:
        raise KernelError(f"dense: data {x.shape} does not match weight {w.shape} "
                          f"(trans_b={tb})")
    k, n = wm.shape
    rows = x.size // k
    # Tiny GEMMs: one numpy call beats ORT's dispatch. From 256k MACs ORT's
    # pool wins over single-threaded BLAS (1000x512: 26 vs 56 us; 576x1536:
    # 47 vs 154 us; lm head 49152x576: 4.5 vs 8.9 ms, idle machine).
    if (rows * k * n >= 1 << 18 and backend() == "onnxruntime"
            and x.flags.c_contiguous and o.flags.c_contiguous):
        # ORT prepacks the constant weight once; OpenBLAS' own threads stall
        # when another process holds a core (1.9 ms vs 25 us here).
        x2, o2 = x.reshape(-1, k), o.reshape(-1, n)
        op = _cached(w, ("ort-dense", tb, act, x2.shape[0], b.ctypes.data),
                     lambda: _dense_op(w, b, tb, act, x2.shape))
        return op([x2], o2)
    np.matmul(x, wm, out=o)
    o += b
    _act_inplace(o, act)


def _dense_op(w, b, trans_b, act, x_shape):
    from onnx import helper

    nodes = [helper.make_node("Gemm", ["x", "w", "b"], ["g"], transB=trans_b)]
    last = "g"
    if act == ACT_RELU:
        nodes.append(helper.make_node("Relu", ["g"], ["y"]))
        last = "y"
    n = w.shape[0] if trans_b else w.shape[1]
    return _OrtOp(nodes, [("x", x_shape)], (last, (x_shape[0], n)), {"w": w, "b": b},
                  threads=_small_threads(x_shape[0] * x_shape[1] * n))


@_kernel("matmul", "numpy/OpenBLAS")
def matmul(a, b, trans_b, out):
    """(Batched, broadcasting) matmul as numpy.matmul: out = a @ (b or b^T on the last two axes).

    Covers batch matmul (B,M,K)x(B,K,N) and GEMV (1,K)x(K,N).
    """
    x, y, o = _np(a), _np(b), _np(out)
    if int(trans_b):
        y = np.swapaxes(y, -1, -2)
    np.matmul(x, y, out=o)


_ort_ready = False

def ort_session_options(threads: int | None = None, spin: bool = False):
    """SessionOptions for every onnxruntime session of the kernel library.

    threads: this session's pool (default: the core's budget); 1 for ops too
    small to pay for waking a second thread.
    spin: let the pool spin between operators as onnxruntime's own default
    does (the subgraph kernel: one session runs many operators per call).

    Default: a pool per session, sized by configure_threads, with spinning
    off.  onnxruntime's global pool (DSPX_ORT_POOL=global) cannot turn its
    spinning off from Python, and its workers kept both CPUs busy after each
    call, delaying the device's answer and the host: ResNet-18 through the
    device measured 41 vs 56 ms and 54 vs 81 ms (session vs global pools,
    same run).  Spinning, not the number of pools, was what cost 20x in the
    KERNEL-NOTES measurement.
    """
    import onnxruntime as ort

    so = ort.SessionOptions()
    if os.environ.get("DSPX_ORT_POOL", "session") == "global":
        global _ort_ready
        if not _ort_ready:
            try:
                ort.capi._pybind_state.set_global_thread_pool_sizes(_threads, 1)
            except Exception:  # noqa: BLE001 - already created in this process
                pass
            _ort_ready = True
        so.use_per_session_threads = False
    else:
        so.intra_op_num_threads = threads or _threads
        so.inter_op_num_threads = 1
        spin_us = os.environ.get("DSPX_ORT_SPIN_US", "0")
        if spin:
            so.add_session_config_entry("session.intra_op.allow_spinning", "1")
        elif spin_us.isdigit() and int(spin_us) > 0:
            # Candidate for idle cores (docs/kernels.md, Threads): a worker that
            # spins this long after its op keeps its vCPU out of halt, so the
            # next kernel's worker wakes fast.  Off by default: under load
            # (12-14) ResNet-18 went 0.83 -> 1.19 (300 us) and 1.77 (1000 us)
            # paired against onnxruntime.
            so.add_session_config_entry("session.intra_op.allow_spinning", "1")
            so.add_session_config_entry("session.intra_op.spin_duration_us", spin_us)
        else:
            so.add_session_config_entry("session.intra_op.allow_spinning", "0")
    so.log_severity_level = 3
    return so


# ---------------------------------------------------------------- normalisation, activations

@_kernel("softmax", "numpy")
def softmax(data, axis, out):
    """Softmax along axis (negative counts from the end); exact exp, no fast math."""
    x, o = _np(data), _np(out)
    ax = int(axis)
    np.subtract(x, x.max(axis=ax, keepdims=True), out=o)
    np.exp(o, out=o)
    o /= o.sum(axis=ax, keepdims=True)


@_kernel("layernorm", "numpy")
def layernorm(data, gamma, beta, eps, out):
    """out = (data - mean) / sqrt(var + eps) * gamma + beta over the last axis."""
    x, g, b, o = _np(data), _np(gamma), _np(beta), _np(out)
    mu = x.mean(axis=-1, keepdims=True)
    np.subtract(x, mu, out=o)
    var = np.einsum("...i,...i->...", o, o)[..., None] / np.float32(x.shape[-1])
    o *= 1.0 / np.sqrt(var + np.float32(eps))
    o *= g
    o += b


# ---------------------------------------------------------------- subgraphs

# DSPX_SUBGRAPH_SPIN=0 turns the subgraph session's spinning off (default on,
# as onnxruntime's own whole-graph session: one pool, woken once per call).
_SUBGRAPH_SPIN = os.environ.get("DSPX_SUBGRAPH_SPIN", "1") != "0"
# DSPX_SUBGRAPH_BLOCK_BASE=N: onnxruntime's session.dynamic_block_base (work
# split in shrinking blocks, so a descheduled thread's share is taken over);
# a candidate for shared cores, off by default (not measured quietly)
_SUBGRAPH_BLOCK_BASE = os.environ.get("DSPX_SUBGRAPH_BLOCK_BASE", "")


class _Subgraph:
    """One onnxruntime session over a module's offloaded ONNX subgraph
    (dspx.compiler.subgraph): the weights baked in as initializers once (so
    onnxruntime prepacks them), data and outputs bound in place."""

    def __init__(self, graph: np.ndarray, inputs: list[np.ndarray], n_out: int):
        import onnx
        import onnxruntime as ort
        from onnx import numpy_helper

        try:
            m = onnx.ModelProto.FromString(graph.tobytes())
        except Exception as e:  # noqa: BLE001 - protobuf's DecodeError and friends
            raise KernelError(f"onnx_subgraph: graph is not a serialized ONNX model ({e})") from None
        g = m.graph
        _check_subgraph(m)
        meta = {p.key: p.value for p in m.metadata_props}
        n_w = meta.get(SUBGRAPH_WEIGHTS_KEY, "0")
        if not n_w.isdigit() or int(n_w) > len(g.input):
            raise KernelError(f"onnx_subgraph: {SUBGRAPH_WEIGHTS_KEY}={n_w!r} is not a count of the graph's "
                              f"{len(g.input)} inputs")
        n_w = int(n_w)
        if len(inputs) != len(g.input) or n_out != len(g.output):
            raise KernelError(f"onnx_subgraph: the graph has {len(g.input)} inputs and {len(g.output)} outputs, "
                              f"the call passes {len(inputs)} inputs and {n_out} outputs")
        for vi, a in zip(g.input, inputs):
            _check_value(vi, a, "input")
        weights = list(zip(g.input[len(g.input) - n_w:], inputs[len(inputs) - n_w:]))
        for vi, w in weights:
            g.initializer.append(numpy_helper.from_array(w, vi.name))
        data = list(g.input[:len(g.input) - n_w])
        del g.input[:]
        g.input.extend(data)
        self.names = [vi.name for vi in data]
        self.outs = [vi.name for vi in g.output]
        self.out_types = list(g.output)
        so = ort_session_options(spin=_SUBGRAPH_SPIN)
        if _SUBGRAPH_BLOCK_BASE.isdigit():
            so.add_session_config_entry("session.dynamic_block_base", _SUBGRAPH_BLOCK_BASE)
        try:
            self.sess = ort.InferenceSession(m.SerializeToString(), so, providers=["CPUExecutionProvider"])
        except Exception as e:  # noqa: BLE001 - onnxruntime refuses the graph
            raise KernelError(f"onnx_subgraph: onnxruntime cannot build the graph: {str(e).splitlines()[0][:300]}") \
                from None

    def bind(self, data: list[np.ndarray], outs: list[np.ndarray]) -> Callable[[], None]:
        for vi, o in zip(self.out_types, outs):
            _check_value(vi, o, "output")
        io = self.sess.io_binding()
        for name, a in zip(self.names, data):
            io.bind_input(name, "cpu", 0, np.float32, list(a.shape), _addr(a))
        for name, o in zip(self.outs, outs):
            io.bind_output(name, "cpu", 0, np.float32, list(o.shape), _addr(o))
        return _bound_run(self.sess, io)


def _check_subgraph(m) -> None:
    """Refuse what the firmware does not run: other operator domains, operators
    outside SUBGRAPH_OPS, nested graphs, external data (a path on the device)."""
    from onnx import AttributeProto, TensorProto

    for op in m.opset_import:
        if op.domain not in ("", "ai.onnx"):
            raise KernelError(f"onnx_subgraph: operator domain {op.domain!r} is not the firmware's "
                              "(default ONNX domain only)")
    if len(m.functions):
        raise KernelError("onnx_subgraph: the graph defines model-local functions; the firmware runs "
                          "plain operators only")
    g = m.graph
    tensors = list(g.initializer)
    for node in g.node:
        if node.domain not in ("", "ai.onnx") or node.op_type not in SUBGRAPH_OPS:
            raise KernelError(f"onnx_subgraph: node {node.name or node.op_type!r} is {node.domain or 'ai.onnx'}."
                              f"{node.op_type}, not an operator the firmware runs in a subgraph")
        for a in node.attribute:
            if a.type in (AttributeProto.GRAPH, AttributeProto.GRAPHS):
                raise KernelError(f"onnx_subgraph: node {node.name!r} holds a nested graph")
            if a.type == AttributeProto.TENSOR:
                tensors.append(a.t)
    for t in tensors:
        if t.data_location == TensorProto.EXTERNAL or len(t.external_data):
            raise KernelError(f"onnx_subgraph: tensor {t.name!r} refers to external data; weights travel as "
                              "kernel inputs")


def _check_value(vi, a: np.ndarray, kind: str) -> None:
    from onnx import TensorProto

    tt = vi.type.tensor_type
    dims = [d.dim_value if d.HasField("dim_value") else None for d in tt.shape.dim]
    if tt.elem_type != TensorProto.FLOAT or a.dtype != np.float32:
        raise KernelError(f"onnx_subgraph: {kind} {vi.name!r} must be float32 in the graph and the call "
                          f"(got {TensorProto.DataType.Name(tt.elem_type)} and {a.dtype})")
    if dims != list(a.shape):
        raise KernelError(f"onnx_subgraph: {kind} {vi.name!r} is {dims} in the graph, the call passes "
                          f"{list(a.shape)}")
    if not a.flags.c_contiguous:
        raise KernelError(f"onnx_subgraph: {kind} {vi.name!r} must be contiguous")


def onnx_subgraph(*args) -> Callable[[], None]:
    """A run of operators in one call: ``graph`` (uint8, a serialized ONNX
    model of SUBGRAPH_OPS), its inputs in order (data, then weights) and its
    outputs.  One onnxruntime session per graph with the weights prepacked and
    one pool: no per-operator calls, wake-ups or NCHWc reorders between them.
    A call site replays its bound run (see _sites)."""
    graph, inputs, outs, n_w = _subgraph_args(args)
    # one session per graph and weights (not per data: every address set of a call site shares it)
    wkey = tuple((_addr(a), a.shape, _fingerprint(a)) for a in inputs[len(inputs) - n_w:])
    sub = _cached(graph, ("subgraph", wkey, len(outs)), lambda: _Subgraph(graph, inputs, len(outs)))
    run = sub.bind(inputs[:len(sub.names)], outs)
    run()
    return run


def _subgraph_args(args: tuple) -> tuple[np.ndarray, list[np.ndarray], list[np.ndarray], int]:
    """(graph, inputs, outputs, weights among the inputs) of an onnx_subgraph call."""
    if not args:
        raise KernelError("onnx_subgraph: no graph passed")
    arrays = [_np(a) for a in args]
    graph = arrays[0]
    if graph.dtype != np.uint8 or graph.ndim != 1:
        raise KernelError(f"onnx_subgraph: graph must be a 1-D uint8 tensor, got {graph.dtype} {graph.shape}")
    tensors = arrays[1:]
    n_in, n_w = _subgraph_counts(graph)
    if n_in > len(tensors):
        raise KernelError(f"onnx_subgraph: the graph has {n_in} inputs, the call passes {len(tensors)} tensors")
    return graph, tensors[:n_in], tensors[n_in:], n_w


def _subgraph_weight(args: tuple):
    """The first weight of an onnx_subgraph call (what its session baked in), or None."""
    _, inputs, _, n_w = _subgraph_args(args)
    return inputs[len(inputs) - n_w] if n_w else None


def _subgraph_counts(graph: np.ndarray) -> tuple[int, int]:
    """(inputs, of which weights) the graph declares (parsed once per graph
    constant; a count that does not fit is refused by _Subgraph)."""
    def count():
        import onnx

        try:
            m = onnx.ModelProto.FromString(graph.tobytes())
        except Exception as e:  # noqa: BLE001
            raise KernelError(f"onnx_subgraph: graph is not a serialized ONNX model ({e})") from None
        n_w = {p.key: p.value for p in m.metadata_props}.get(SUBGRAPH_WEIGHTS_KEY, "0")
        n_in = len(m.graph.input)
        return n_in, int(n_w) if n_w.isdigit() and int(n_w) <= n_in else 0
    return _cached(graph, ("subgraph-counts",), count)


# registered by hand: its arguments are variadic (the graph's own inputs and outputs)
KERNELS[PREFIX + "onnx_subgraph"] = KernelSpec(
    PREFIX + "onnx_subgraph", _site_cached("onnx_subgraph", onnx_subgraph, _subgraph_weight),
    ABI["onnx_subgraph"].inputs, ABI["onnx_subgraph"].attrs, ABI["onnx_subgraph"].outputs, "onnxruntime",
    onnx_subgraph.__doc__.strip())


# ---------------------------------------------------------------- registry

def names() -> set[str]:
    """Every kernel name the firmware exports (the loader's import check)."""
    return set(KERNELS)


def register_all(override: bool = True) -> None:
    """Register every kernel as a TVM FFI global function in this process."""
    import tvm_ffi

    for spec in KERNELS.values():
        tvm_ffi.register_global_func(spec.name, spec.fn, override=override)


def warmup() -> None:
    """Pay first-call costs (backend imports, thread pools) at load time, not at the
    first INFER. Per-weight sessions/prepacks are still built on a module's first
    call: run it once at load (the loader's warm-up inference) to move those too."""
    be = backend()
    if be == "onnxruntime":
        ort_session_options()
    elif be == "torch":
        _get_torch()


# The LLM kernels (their own file, device/core/llm_kernels.py); importing it
# registers them in KERNELS above.  Re-exported for callers of this module.
from .llm_kernels import (_dequant, attention_decode, configure_gemv, gemv_q4, gemv_q4_1,  # noqa: E402,F401
                          gemv_q8, kv_update, rmsnorm, rope, silu_mul)
from .q8_kernels import conv2d_add_q8, conv2d_q8, dense_q8  # noqa: E402,F401  (--quantize int8)
