"""Check a compiled module against a reference before calling the compile done.

The module runs where it will run, through a ``ModuleRunner`` the caller
passes (``dspx.host.verifier.DeviceVerifier``: on a device, through the real
loader, kernels and weights path; the compiler itself never starts one).
The reference is onnxruntime on the same ONNX graph (with the
reduced-precision weights already applied, so the comparison checks the
compiler and not the rounding), or, when onnxruntime cannot run the model,
TVM's own unoptimized build of the imported graph run in this process.
Inputs are random (fixed seed): standard normal floats, integers in [0, 2)
(valid indices for any non-empty axis), random booleans.

Tolerance (float outputs): max |module - reference| <= RTOL * max(1, max |reference|);
integer and boolean outputs must be equal.  NaNs must sit in the same places.
"""
from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np

from dspx.compiler.checks import CompileError

#: What runs a compiled module for verification: ``runner(outdir, samples)``
#: -> the outputs of each sample (a list of input arrays), all through one
#: load of the module in ``outdir``.
ModuleRunner = Callable[[Path, list[list[np.ndarray]]], list[list[np.ndarray]]]

RTOL = {"float32": 1e-4, "float64": 1e-4, "float16": 1e-2, "bfloat16": 2e-2}
SEED = 20261201


def random_inputs(specs, seed: int = SEED) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    out = []
    for t in specs:
        dt = np.dtype(t["dtype"])
        shape = t["shape"]
        if dt == np.bool_:
            out.append(rng.integers(0, 2, shape).astype(bool))
        elif np.issubdtype(dt, np.integer):
            out.append(rng.integers(0, 2, shape).astype(dt))
        else:
            out.append(rng.standard_normal(shape).astype(dt))
    return out


def compare(name: str, got: np.ndarray, ref: np.ndarray) -> tuple[bool, float, str]:
    """(within tolerance, max abs error, why not) for one output."""
    got, ref = np.asarray(got), np.asarray(ref)
    if got.shape != ref.shape:
        return False, float("inf"), f"shape {list(got.shape)}, reference {list(ref.shape)}"
    if got.size == 0:
        return True, 0.0, ""
    if not np.issubdtype(ref.dtype, np.floating):
        bad = np.flatnonzero(got.reshape(-1) != ref.reshape(-1).astype(got.dtype))
        if bad.size:
            i = int(bad[0])
            return False, float(np.abs(got.reshape(-1)[i].astype(np.float64) - ref.reshape(-1)[i])), \
                f"{bad.size} of {ref.size} values differ (first at flat index {i}: {got.reshape(-1)[i]} vs " \
                f"{ref.reshape(-1)[i]})"
        return True, 0.0, ""
    g, r = got.astype(np.float64), ref.astype(np.float64)
    if not np.array_equal(np.isnan(g), np.isnan(r)):
        return False, float("nan"), "NaNs where the reference has none (or the reverse)"
    finite = np.isfinite(r) & np.isfinite(g)
    if not np.array_equal(g[~finite & ~np.isnan(r)], r[~finite & ~np.isnan(r)]):
        return False, float("inf"), "infinities differ from the reference"
    err = float(np.max(np.abs(g[finite] - r[finite]), initial=0.0))
    scale = max(1.0, float(np.max(np.abs(r[finite]), initial=0.0)))
    tol = RTOL.get(ref.dtype.name, 1e-4) * scale
    if err > tol:
        return False, err, f"max abs error {err:.3g} > tolerance {tol:.3g}"
    return True, err, ""


def ort_reference(model_bytes: bytes, names: list[str], inputs: list[np.ndarray]):
    """onnxruntime's outputs, or None (with the reason) when it cannot run the model."""
    try:
        import onnxruntime as ort
    except ImportError:
        return None, "onnxruntime is not installed"
    try:
        so = ort.SessionOptions()
        so.log_severity_level = 4
        so.intra_op_num_threads = 2
        sess = ort.InferenceSession(model_bytes, so, providers=["CPUExecutionProvider"])
        feed = {i.name: a for i, a in zip(sess.get_inputs(), inputs)}
        return sess.run(names, feed), None
    except Exception as e:  # noqa: BLE001 - any failure means: use the other reference
        return None, f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"


def tvm_reference(mod, params: list, inputs: list[np.ndarray]) -> list[np.ndarray]:
    """The imported relax module built by TVM's default pipeline (no kernels, no
    dspx passes), run in this process."""
    import tvm
    from tvm import relax

    ex = tvm.compile(mod, tvm.target.Target({"kind": "llvm", "mtriple": "x86_64-linux-gnu"}))
    vm = relax.VirtualMachine(ex, tvm.cpu())
    args = [tvm.runtime.tensor(np.ascontiguousarray(a)) for a in inputs] + list(params)
    out = vm["main"](*args)
    outs = list(out) if not hasattr(out, "numpy") else [out]
    return [o.numpy() for o in outs]


def verify(outdir, meta: dict, reference_model: bytes, verifier: ModuleRunner, tvm_module=None, tvm_params=(),
           float32_model: bytes | None = None) -> dict:
    """Run the module (by ``verifier``) and its reference on the same random inputs; raise
    CompileError naming the first output outside tolerance.  Returns the
    report recorded in metadata.json ``verify``.  With ``float32_model`` (the
    original when weights were reduced) the report also gives the module's
    error against it: ``error_vs_float32`` {output: {max_abs, rel}}, rel =
    max_abs / max |reference|."""
    inputs = random_inputs(meta["inputs"])
    names = [t["name"] for t in meta["outputs"]]
    ref, why = ort_reference(reference_model, names, inputs)
    source = "onnxruntime"
    if ref is None:
        if tvm_module is None:
            raise CompileError(f"cannot verify: onnxruntime cannot run the model ({why}) and there is no "
                               "TVM reference; compile with --no-verify to skip the check")
        try:
            ref = tvm_reference(tvm_module, list(tvm_params), inputs)
        except Exception as e:  # noqa: BLE001
            raise CompileError(f"cannot verify: onnxruntime cannot run the model ({why}) and TVM's "
                               f"unoptimized build failed ({type(e).__name__}: {str(e).splitlines()[0][:200]}); "
                               "compile with --no-verify to skip the check") from None
        source = "tvm-unoptimized"
    try:
        got = verifier(Path(outdir), [inputs])[0]
    except CompileError:
        raise
    except Exception as e:  # noqa: BLE001 - a module that does not load or run is a compile failure
        from dspx.errors import CapacityError, OutOfMemory

        text = f"{type(e).__name__}: {str(e).splitlines()[0][:300]}"
        if isinstance(e, (CapacityError, OutOfMemory)):
            raise CompileError(f"the compiled module does not fit a default device ({text}); store the weights "
                               "smaller with --weights float16 or int8 (or --no-verify to keep it)") from None
        raise CompileError(f"the compiled module fails on the device: {text}") from None
    if len(got) != len(ref):
        raise CompileError(f"verification: the module returns {len(got)} outputs, {source} {len(ref)}")
    errors = {}
    for name, g, r in zip(names, got, ref):
        ok, err, why = compare(name, g, r)
        if not ok:
            raise CompileError(f"verification failed: output {name!r} differs from {source} on random inputs "
                               f"({why}); this is a compiler bug, please report it (use --no-verify to keep "
                               f"the module anyway)")
        errors[name] = err
    report = {"reference": source, "max_abs_error": errors, "seed": SEED}
    if float32_model is not None:
        ref32, why = ort_reference(float32_model, names, inputs)
        report["error_vs_float32"] = ({"skipped": f"onnxruntime cannot run the float32 model ({why})"}
                                      if ref32 is None else {})
        for name, g, r in zip(names, got, ref32 or []):
            e = float(np.max(np.abs(g.astype(np.float64) - r), initial=0.0))
            report["error_vs_float32"][name] = {"max_abs": e,
                                                "rel": e / max(float(np.max(np.abs(r), initial=0.0)), 1e-30)}
    return report

