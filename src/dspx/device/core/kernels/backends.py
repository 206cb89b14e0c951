"""Which library computes, and how: the backend choice (onnxruntime | torch |
numpy), the thread budget, onnxruntime sessions bound to the caller's memory,
and onnxruntime's NCHWc layout plans.

Measured choices (docs/kernels.md): onnxruntime single-op sessions for
convolution, pooling, large dense layers and quantized GEMV (MatMulNBits);
PyTorch's oneDNN convolution with prepacked weights as the alternative
(``configure_backend("torch")``); numpy for the small and memory-bound rest.
torch and onnxruntime stay optional: every kernel has a numpy fallback.

The settings live in one object, :data:`state`, changed only through the
``configure*`` functions of this package.
"""

from __future__ import annotations

import ctypes
import logging
import os
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np

from ....abi.kernels import ACT_NONE, ACT_RELU
from .caches import clear_caches
from .registry import KernelError, addr

log = logging.getLogger(__name__)

BACKENDS = ("onnxruntime", "torch", "numpy")


@dataclass
class State:
    """The kernel library's settings in this process, and the optional libraries it found."""
    threads: int = 2  # configure_threads: the core's thread budget
    backend: str = "auto"  # configure_backend (DSPX_KERNEL_BACKEND at import)
    # configure(optimize=...): onnxruntime's optimized form of a model (None: optimize_model here)
    optimize: Callable[[bytes], bytes] | None = None
    gemv_exact: bool = False  # configure_gemv (the llm family)
    torch: Any = None  # the torch module, once imported
    torch_checked: bool = False
    have_ort: bool | None = None  # onnx and onnxruntime import (None: not tried yet)
    global_pool_sized: bool = False  # DSPX_ORT_POOL=global: onnxruntime's pool set up


def _backend_from_env() -> str:
    # Convolution/pooling backend. onnxruntime first: measured here its thread
    # pool keeps its speed when other processes share the cores (a 64ch 3x3 conv:
    # 1.8 ms median vs 17.9 ms for torch's OpenMP, both 1.0-1.1 ms on idle
    # cores), and the device shares its cores with the host and the other DSP
    # cores. torch (oneDNN, NHWC, prepacked) is ~7 % faster on idle cores.
    name = os.environ.get("DSPX_KERNEL_BACKEND", "auto")
    if name not in BACKENDS + ("auto",):
        log.warning("DSPX_KERNEL_BACKEND=%r is not one of auto, %s; using auto",
                    name, ", ".join(BACKENDS))
        name = "auto"
    return name


state = State(backend=_backend_from_env())


def configure(*, optimize: Callable[[bytes], bytes] | None = None) -> None:
    """Hand the library what turns a model into onnxruntime's optimized form
    (the NCHWc plans need it).  onnxruntime writes that form only to a file: a
    sandboxed core, which creates no files, passes its planner process's
    ``optimize`` (device/core/planner.py); None computes it here (optimize_model)."""
    state.optimize = optimize


# ---------------------------------------------------------------- threads

def get_torch():
    """torch is optional: import it once, lazily; without it warn in one line."""
    if not state.torch_checked:
        state.torch_checked = True
        try:
            import torch
            torch.set_num_threads(state.threads)
            state.torch = torch
        except ImportError:
            log.warning("dspx kernels: torch not installed; convolution and pooling use the "
                        "numpy fallback (2x slower) -- pip install 'dspx[kernels]'")
    return state.torch


def configure_threads(n: int) -> None:
    """Give every threaded backend of this process the core's thread budget ``n``.

    One threaded backend per process is the rule (oversubscription cost 5-20x
    here); torch's OpenMP pool and onnxruntime's global pool are sized to n.
    numpy's OpenBLAS pool can only be sized before numpy loads
    (OPENBLAS_NUM_THREADS), which the device core process does.
    """
    if n < 1:
        raise KernelError(f"thread budget must be >= 1, got {n}")
    state.threads = n
    if state.torch is not None:
        state.torch.set_num_threads(n)
    # numpy's BLAS only does the small leftovers (attention, batched matmul)
    # once a threaded backend exists: keep it to one thread so it never spins
    # against that backend's pool.
    set_blas_threads(n if backend() == "numpy" else 1)


def set_blas_threads(n: int) -> bool:
    """Resize the OpenBLAS pool numpy loaded (numpy has no API for it)."""
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


def small_threads(work: int) -> int | None:
    """One thread for ops whose work (MACs or elements) is below ~2M: waking a
    sleeping pool thread costs 30-300 us on these VMs, more than such an op."""
    return 1 if work < 1 << 21 else None


# ---------------------------------------------------------------- backend choice

def configure_backend(name: str) -> str:
    """Pick the convolution/pooling/dense backend: auto | onnxruntime | torch | numpy.

    Switch only while no module is loaded: blocked tensors are in the
    backend's private layout.
    """
    if name not in BACKENDS + ("auto",):
        raise KernelError(f"unknown kernel backend {name!r}; "
                          f"choose from auto, {', '.join(BACKENDS)}")
    state.backend = name
    clear_caches()
    return backend()


def backend() -> str:
    """The convolution/pooling backend in use (resolving "auto")."""
    if state.backend != "auto":
        if state.backend == "torch" and get_torch() is None:
            return "numpy"
        if state.backend == "onnxruntime" and not _have_ort():
            return "numpy"
        return state.backend
    if _have_ort():
        return "onnxruntime"
    return "torch" if get_torch() is not None else "numpy"


def _have_ort() -> bool:
    if state.have_ort is None:
        try:
            import onnx  # noqa: F401
            import onnxruntime  # noqa: F401
            state.have_ort = True
        except ImportError:
            state.have_ort = False
    return state.have_ort


def warmup() -> None:
    """Pay first-call costs (backend imports, thread pools) at load time, not at the
    first INFER. Per-weight sessions/prepacks are still built on a module's first
    call: run it once at load (the loader's warm-up inference) to move those too."""
    be = backend()
    if be == "onnxruntime":
        ort_session_options()
    elif be == "torch":
        get_torch()


# ---------------------------------------------------------------- onnxruntime sessions

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
        if not state.global_pool_sized:
            try:
                ort.capi._pybind_state.set_global_thread_pool_sizes(state.threads, 1)
            except Exception:  # noqa: BLE001 - already created in this process
                pass
            state.global_pool_sized = True
        so.use_per_session_threads = False
    else:
        so.intra_op_num_threads = threads or state.threads
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


class OrtOp:
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
        ptrs = tuple(addr(a) for a in arrays) + (addr(out),)
        runs = self._runs
        run = runs.get(ptrs)
        if run is None:
            if len(runs) >= 16:
                runs.clear()
            io = self.sess.io_binding()
            for name, a, p in zip(self.names, arrays, ptrs):
                io.bind_input(name, "cpu", 0, np.float32, list(a.shape), p)
            io.bind_output(self.out, "cpu", 0, np.float32, list(out.shape), ptrs[-1])
            run = runs[ptrs] = bound_run(self.sess, io)
        run()
        return run


def bound_run(sess, io) -> Callable[[], None]:
    """sess.run_with_iobinding(io) without the Python wrapper's per-call checks
    (WebGPU graph capture) when the binding's C object is reachable."""
    import functools

    c_sess, c_io = getattr(sess, "_sess", None), getattr(io, "_iobinding", None)
    if c_sess is None or c_io is None:
        return functools.partial(sess.run_with_iobinding, io)
    return functools.partial(c_sess.run_with_iobinding, c_io, None)


# ---------------------------------------------------------------- NCHWc layout plans

def optimize_model(model: bytes) -> bytes:
    """onnxruntime's optimized form of a model, which it writes only to a
    file.  A sandboxed core (no new files) has its planner process run this
    (device/core/planner.py) and hands the library that with configure()."""
    import tempfile

    import onnxruntime as ort

    with tempfile.TemporaryDirectory() as d:
        so = ort_session_options()
        so.optimized_model_filepath = os.path.join(d, "opt.onnx")
        ort.InferenceSession(model, so, providers=["CPUExecutionProvider"])
        with open(so.optimized_model_filepath, "rb") as f:
            return f.read()


def nchwc_plan(node, x_shape, y_shape, inits):
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
    opt = onnx.load_from_string((state.optimize or optimize_model)(m.SerializeToString()))
    main = [n for n in opt.graph.node if n.domain == "com.microsoft.nchwc"
            and n.op_type not in ("ReorderInput", "ReorderOutput")]
    if len(main) != 1:
        return None
    reorder_in = any(n.op_type == "ReorderInput" for n in opt.graph.node)
    return main[0], {i.name: numpy_helper.to_array(i) for i in opt.graph.initializer}, reorder_in


class NchwcOp(OrtOp):
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
