"""``dspx run`` as a user runs it: a subprocess; with --json one JSON line on
stdout, else readable lines; outputs written with --output (.npz keyed by
output name); errors as JSON with the device's status or the host's check."""
from __future__ import annotations

import json
import os
import re
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
    p = subprocess.run([sys.executable, "-m", "dspx.cli", "run", "--json", *map(str, args)], capture_output=True,
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
    assert res["time_ms"] == res["cycles"] / 1e6 and "1 GHz" in res["clock"]
    for desc, spec in zip(res["outputs"], meta["outputs"]):
        assert desc["name"] == spec["name"] and desc["dtype"] == spec["dtype"]
        assert desc["shape"] == spec["shape"] and desc["ndim"] == len(spec["shape"])
        assert desc["data_size"] == spec["nbytes"]
    ref = _ort(example_onnx[name], meta, arrays)
    with np.load(out) as z:
        assert sorted(z.files) == sorted(t["name"] for t in meta["outputs"])
        got = [z[t["name"]] for t in meta["outputs"]]
    for g, r, spec in zip(got, ref, meta["outputs"]):
        assert g.shape == r.shape and g.dtype == r.dtype, spec["name"]
        np.testing.assert_allclose(g, r, rtol=0, atol=TOL, err_msg=spec["name"])


def test_run_raw_input_npy_output_repeat(cli_device, compiled, tmp_path):
    d = compiled("multi_output")
    x = np.random.default_rng(3).standard_normal((2, 32)).astype(np.float32)
    x.tofile(tmp_path / "x.bin")
    code, res, err = dspx_run(d, "-i", tmp_path / "x.bin", "--shape", "2,32", "--dtype", "float32",
                              "-o", tmp_path / "relu.npy", "--repeat", "3", "--socket", cli_device.path)
    assert code == 0 and res["num_outputs"] == 7
    np.testing.assert_allclose(np.load(tmp_path / "relu.npy"), np.maximum(x @ _weight(), 0),
                               atol=TOL)
    rep = res["repeat"]
    assert rep["runs"] == 3 and len(rep["cycles"]) == 3 and "run 0" not in err
    assert rep["min_ms"] == min(rep["cycles"]) / 1e6 and rep["max_ms"] == max(rep["cycles"]) / 1e6
    assert rep["min_ms"] <= rep["median_ms"] <= rep["p90_ms"] <= rep["max_ms"]
    code, res, _ = dspx_run(d, "-i", tmp_path / "x.bin", "-o", tmp_path / "relu2.npy",  # shape from metadata
                            "--socket", cli_device.path)
    assert code == 0
    np.testing.assert_array_equal(np.load(tmp_path / "relu2.npy"), np.load(tmp_path / "relu.npy"))
    code, res, _ = dspx_run(d, "-i", tmp_path / "x.bin", "--shape", "2,32", "--dtype", "float32",
                            "-o", tmp_path / "relu.bin", "--socket", cli_device.path)
    assert code == 1 and ".npz" in res["message"] and not (tmp_path / "relu.bin").exists()  # raw output: refused


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

    # Checked on the host against metadata.json, before anything is staged.
    np.save(tmp_path / "wrong.npy", np.zeros((32, 2), np.float32))
    code, res, _ = dspx_run(d, "-i", tmp_path / "wrong.npy", "--socket", cli_device.path)
    assert (code, res["error"]) == (1, "InputError")
    assert "'x'" in res["message"] and "float32[2, 32]" in res["message"] and "float32[32, 2]" in res["message"]

    code, res, _ = dspx_run(d, "-i", x, "-i", x, "--socket", cli_device.path)
    assert (code, res["error"]) == (1, "InputError") and "takes 1 input (x); 2 given" in res["message"]

    code, res, _ = dspx_run(d, "-i", tmp_path / "missing.bin", "--socket", cli_device.path)
    assert code == 1 and res["status"] == "error" and "missing.bin" in res["message"]

    np.save(tmp_path / "f64.npy", np.zeros((2, 32), np.float64))
    code, res, _ = dspx_run(d, "-i", tmp_path / "f64.npy", "--socket", cli_device.path)
    assert (code, res["error"]) == (1, "InputError") and "float64[2, 32]" in res["message"]

    code, res, _ = dspx_run(d, "-i", x, "--socket", cli_device.path)  # the device is still serving
    assert code == 0 and res["status"] == "ok"


def test_run_without_a_device_starts_a_private_one(compiled, tmp_path):
    d = compiled("multi_input")
    arrays, paths = _inputs(_meta(d), tmp_path)
    env = {k: v for k, v in os.environ.items() if k != "DSPX_SOCKET"}
    env["XDG_RUNTIME_DIR"] = str(tmp_path)  # nothing listens at the default path there
    code, res, _ = dspx_run(d, *[a for p in paths for a in ("-i", p)], env=env)
    assert code == 0 and res["status"] == "ok" and res["num_outputs"] == 1 and res["private_device"] is True


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
        for t, r in zip(meta["outputs"], ref):
            np.testing.assert_allclose(z[t["name"]], r, rtol=0, atol=TOL)


def test_run_inputs_by_name_and_readable_output(cli_device, compiled, example_onnx, tmp_path):
    """--input NAME=FILE in any order; without --json, lines for people naming
    the outputs, their dtypes and the time with its unit and clock."""
    d = compiled("multi_input")
    meta = _meta(d)
    arrays, paths = _inputs(meta, tmp_path, seed=5)
    named = [a for t, p in reversed(list(zip(meta["inputs"], paths))) for a in ("-i", f"{t['name']}={p}")]
    p = subprocess.run([sys.executable, "-m", "dspx.cli", "run", str(d), *named, "-o", str(tmp_path / "y.npz"),
                        "--socket", cli_device.path, "--repeat", "4"], capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    lines = p.stdout.splitlines()
    assert "4 run(s) on the device" in lines[0]
    assert re.search(r"min [\d.]+ (ns|µs|ms), median [\d.]+ (ns|µs|ms), p90 [\d.]+ (ns|µs|ms) over 4 runs "
                     r"\(device clock: 1 GHz", lines[1]), lines[1]
    assert lines[2].startswith("  warm-up ") and "not counted" in lines[2]  # run 0, as TVM discards it
    assert lines[3].split() == ["output", "y", "float32[1,", "16]"]
    ref = _ort(example_onnx["multi_input"], meta, arrays)
    with np.load(tmp_path / "y.npz") as z:
        np.testing.assert_allclose(z["y"], ref[0], rtol=0, atol=TOL)
