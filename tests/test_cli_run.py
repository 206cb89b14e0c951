"""``dspx run`` as a user runs it: a subprocess, one JSON line on stdout,
outputs written with --output, errors as JSON with the device's status."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import onnxruntime as ort
import pytest

from conftest import Device

TOL = 1e-4


@pytest.fixture(scope="module")
def cli_device():
    # `dspx run` opens its client with the default staging (468 MiB + 12 MiB
    # KV): a device with the default carveout.  Pages are only touched as used.
    d = Device("--ddr-pool-size", "96M")
    yield d
    d.stop()


def dspx_run(*args, env=None, timeout=120):
    p = subprocess.run([sys.executable, "-m", "dspx.cli", "run", *map(str, args)], capture_output=True,
                       text=True, env=env, timeout=timeout)
    lines = p.stdout.splitlines()
    assert len(lines) == 1, (p.stdout, p.stderr)
    return p.returncode, json.loads(lines[0]), p.stderr


def _meta(d):
    return json.loads((d / "metadata.json").read_text())


def _inputs(meta, tmp_path, seed=0):
    rng = np.random.default_rng(seed)
    arrays, paths = [], []
    for t in meta["inputs"]:
        if np.issubdtype(np.dtype(t["dtype"]), np.integer):
            a = rng.integers(-3, 4, t["shape"]).astype(t["dtype"])
        else:
            a = rng.standard_normal(t["shape"]).astype(t["dtype"])
        p = tmp_path / f"{t['name']}.npy"
        np.save(p, a)
        arrays.append(a)
        paths.append(p)
    return arrays, paths


def _ort(onnx_path, meta, arrays):
    so = ort.SessionOptions()
    so.intra_op_num_threads = 1
    sess = ort.InferenceSession(str(onnx_path), so, providers=["CPUExecutionProvider"])
    return sess.run(None, {t["name"]: a for t, a in zip(meta["inputs"], arrays)})


@pytest.mark.parametrize("name", ["multi_input", "multi_output", "resnet18"])
def test_run_matches_onnxruntime(name, cli_device, compiled, example_onnx, tmp_path):
    d = compiled(name, kernels=(name == "resnet18"))
    meta = _meta(d)
    arrays, paths = _inputs(meta, tmp_path)
    out = tmp_path / "out.npz"
    args = [d] + [a for p in paths for a in ("--input", p)] + ["--output", out, "--socket", cli_device.path]
    code, res, _ = dspx_run(*args)
    assert code == 0 and res["status"] == "ok", res
    assert res["cycles"] > 0 and res["num_outputs"] == len(meta["outputs"])
    for desc, spec in zip(res["outputs"], meta["outputs"]):
        dt = np.dtype(spec["dtype"])
        assert desc["shape"] == spec["shape"] and desc["ndim"] == len(spec["shape"])
        assert (desc["dtype_code"], desc["dtype_bits"]) == ({"i": 0, "u": 1, "f": 2}[dt.kind], dt.itemsize * 8)
        assert desc["data_size"] == spec["nbytes"]
    ref = _ort(example_onnx[name], meta, arrays)
    with np.load(out) as z:
        got = [z[f"arr_{i}"] for i in range(len(ref))]
    for g, r, spec in zip(got, ref, meta["outputs"]):
        assert g.shape == r.shape and g.dtype == r.dtype, spec["name"]
        np.testing.assert_allclose(g, r, rtol=0, atol=TOL, err_msg=spec["name"])


def test_run_raw_input_npy_and_bin_output_repeat(cli_device, compiled, tmp_path):
    d = compiled("multi_output")
    x = np.random.default_rng(3).standard_normal((2, 32)).astype(np.float32)
    x.tofile(tmp_path / "x.bin")
    code, res, err = dspx_run(d, "-i", tmp_path / "x.bin", "--shape", "2,32", "--dtype", "float32",
                              "-o", tmp_path / "relu.npy", "--repeat", "3", "--socket", cli_device.path)
    assert code == 0 and res["num_outputs"] == 7
    np.testing.assert_allclose(np.load(tmp_path / "relu.npy"), np.maximum(x @ _weight(), 0),
                               atol=TOL)
    assert [ln.split(":")[0] for ln in err.splitlines() if ln.startswith("run ")] == ["run 0", "run 1", "run 2"]
    code, res, _ = dspx_run(d, "-i", tmp_path / "x.bin", "--shape", "2,32", "--dtype", "float32",
                            "-o", tmp_path / "relu.bin", "--socket", cli_device.path)
    assert code == 0
    np.testing.assert_array_equal(np.fromfile(tmp_path / "relu.bin", np.float32).reshape(2, 24),
                                  np.load(tmp_path / "relu.npy"))


def _weight():
    """The example's MatMul weight, from the ONNX model built with the same seed."""
    from onnx import numpy_helper

    from dspx.compiler import examples
    model = examples.multi_output_model()
    return numpy_helper.to_array(next(i for i in model.graph.initializer if i.name.startswith("w_")))


def test_run_errors_are_one_json_line(cli_device, compiled, tmp_path):
    d = compiled("multi_output")
    x = tmp_path / "x.npy"
    np.save(x, np.zeros((2, 32), np.float32))
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "model.so").write_bytes(b"#!/bin/sh\necho not a module\n" * 4)
    code, res, _ = dspx_run(bad, "-i", x, "--socket", cli_device.path)
    assert code == 1 and res["status"] == "error" and res["error"] == "ERR_LOAD" and res["code"] == -9
    assert "not an ELF" in res["message"]

    np.save(tmp_path / "wrong.npy", np.zeros((32, 2), np.float32))
    code, res, _ = dspx_run(d, "-i", tmp_path / "wrong.npy", "--socket", cli_device.path)
    assert (code, res["error"], res["code"]) == (1, "ERR_TENSOR", -14)
    assert "float32[2, 32]" in res["message"] and "float32[32, 2]" in res["message"]

    code, res, _ = dspx_run(d, "-i", x, "-i", x, "--socket", cli_device.path)
    assert (code, res["error"]) == (1, "ERR_TENSOR") and "takes 1 inputs, 2 given" in res["message"]

    code, res, _ = dspx_run(d, "-i", tmp_path / "x.bin_missing_shape.bin", "--socket", cli_device.path)
    assert code == 1 and res["status"] == "error"

    np.save(tmp_path / "huge.npy", np.zeros((2, 32 << 10), np.float32))  # over input_buf: EFBIG on the host
    code, res, _ = dspx_run(d, "-i", tmp_path / "huge.npy", "--socket", cli_device.path)
    assert (code, res["error"], res["code"]) == (1, "CapacityError", -27)

    code, res, _ = dspx_run(d, "-i", x, "--socket", cli_device.path)  # the device is still serving
    assert code == 0 and res["status"] == "ok"


def test_run_without_a_device_starts_a_private_one(compiled, tmp_path):
    d = compiled("multi_input")
    arrays, paths = _inputs(_meta(d), tmp_path)
    env = {k: v for k, v in os.environ.items() if k != "DSPX_SOCKET"}
    env["XDG_RUNTIME_DIR"] = str(tmp_path)  # nothing listens at the default path there
    code, res, _ = dspx_run(d, *[a for p in paths for a in ("-i", p)], env=env)
    assert code == 0 and res["status"] == "ok" and res["num_outputs"] == 1


def test_run_module_with_separate_weights(cli_device, compiled, example_onnx, tmp_path):
    """The weights file named by metadata.json goes to the device with MODEL_LOAD."""
    d = compiled("multi_output", separate=True)
    assert (d / "weights.bin").is_file()
    meta = _meta(d)
    arrays, paths = _inputs(meta, tmp_path)
    code, res, _ = dspx_run(d, "-i", paths[0], "-o", tmp_path / "out.npz", "--socket", cli_device.path)
    assert code == 0 and res["status"] == "ok", res
    ref = _ort(example_onnx["multi_output"], meta, arrays)
    with np.load(tmp_path / "out.npz") as z:
        for i, r in enumerate(ref):
            np.testing.assert_allclose(z[f"arr_{i}"], r, rtol=0, atol=TOL)
