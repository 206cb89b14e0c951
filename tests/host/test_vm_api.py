"""VirtualMachine as TVM users call it, and the host's input checks: wrong
inputs are refused by name before anything reaches the device; lists, torch
tensors and named inputs work; results against onnxruntime."""
from __future__ import annotations

import json
import shutil

import numpy as np
import onnxruntime as ort
import pytest

from dspx.errors import ClosedError, InputError
from dspx.host.vm import VirtualMachine

TOL = 1e-4


def _ort(path, feeds):
    return ort.InferenceSession(str(path), providers=["CPUExecutionProvider"]).run(None, feeds)


def _jobs(c):
    st = c.status()
    return st["jobs_completed"] + st["jobs_failed"]


@pytest.fixture
def vm(shared_device, client_of, compiled):
    c = client_of(shared_device.path)
    with VirtualMachine(compiled("multi_output"), client=c) as v:
        yield v


X = np.random.default_rng(11).standard_normal((2, 32)).astype(np.float32)


@pytest.mark.parametrize("call, words", [
    (lambda f: f(X.astype(np.float64)), ["input 'x'", "expects float32[2, 32]", "got float64[2, 32]", "astype"]),
    (lambda f: f(X.T), ["expects float32[2, 32]", "got float32[32, 2]"]),
    (lambda f: f(X, X), ["main takes 1 input (x); 2 given"]),
    (lambda f: f(), ["missing 'x'"]),
    (lambda f: f(y=X), ["has no input 'y' (inputs: x)"]),
    (lambda f: f(X, x=X), ["'x' given twice"]),
    (lambda f: f([["a"] * 32] * 2), ["expects float32", "str"]),
    (lambda f: f([[1.0] * 32, [1.0]]), ["not a rectangular array"]),
])
def test_wrong_inputs_are_refused_on_the_host(vm, call, words):
    c = vm.client
    before = _jobs(c)
    with pytest.raises(InputError) as ei:
        call(vm["main"])
    for w in words:
        assert w in str(ei.value), (w, str(ei.value))
    assert _jobs(c) == before  # nothing was sent


def test_lists_named_and_torch_inputs(vm, example_onnx):
    import torch

    ref = _ort(example_onnx["multi_output"], {"x": X})
    t = torch.tensor(X, requires_grad=True)
    for got in (vm["main"](X), vm["main"](x=X), vm["main"]({"x": X}), vm["main"](X.tolist()), vm["main"](t)):
        for g, r in zip(got, ref):
            np.testing.assert_allclose(g, r, rtol=0, atol=TOL)
    ints = vm["main"]([[1] * 32] * 2)  # int values fit float32: converted
    np.testing.assert_allclose(ints[0], _ort(example_onnx["multi_output"], {"x": np.ones((2, 32), np.float32)})[0],
                               rtol=0, atol=TOL)


def test_stateful_calls_like_tvm(vm, example_onnx):
    ref = _ort(example_onnx["multi_output"], {"x": X})
    vm.set_input("main", X)
    vm.invoke_stateful("main")
    for g, r in zip(vm.get_outputs("main"), ref):
        np.testing.assert_allclose(g, r, rtol=0, atol=TOL)
    with pytest.raises(InputError):
        vm.set_input("main", X.T)
    with pytest.raises(KeyError, match="no function 'nope'"):
        vm.set_input("nope", X)


def test_time_evaluator_repeats_on_the_device(vm):
    c = vm.client
    before = _jobs(c)
    res = vm.time_evaluator("main", number=4, repeat=3)(X)
    assert _jobs(c) == before + 1  # one INFER: the device ran the entry 12 times
    assert len(res.results) == 3 and all(r > 0 for r in res.results)
    assert res.min <= res.median <= res.max and res.min <= res.mean <= res.max
    assert res.mean == pytest.approx(sum(res.results) / 3) and res.std >= 0
    assert "mean (ms)" in str(res) and "device clock" in str(res)
    vm.set_input("main", X)
    res = vm.time_evaluator("invoke_stateful", None, number=2)("main")
    assert len(res.results) == 1 and res.results[0] > 0
    with pytest.raises(ValueError):
        vm.time_evaluator("main", number=0)


def test_calls_after_close_are_a_clear_error(shared_device, client_of, compiled):
    v = VirtualMachine(compiled("multi_output"), client=client_of(shared_device.path))
    v.close()
    for call in (lambda: v["main"](X), lambda: v.run_nocopy(X), lambda: v.set_input("main", X),
                 lambda: v.create_input((2, 32))):
        with pytest.raises(ClosedError, match="closed"):
            call()


def test_several_entries(shared_device, client_of, compiled, example_onnx, tmp_path):
    """A package of several modules (as compile-llm writes): each is an entry."""
    meta = {"format": "dspx-llm/1", "modules": {}}
    for entry, name in (("first", "multi_output"), ("second", "multi_input")):
        d = compiled(name)
        shutil.copy(d / "model.so", tmp_path / f"{entry}.so")
        meta["modules"][entry] = {**json.loads((d / "metadata.json").read_text()), "module": f"{entry}.so"}
    (tmp_path / "metadata.json").write_text(json.dumps(meta))
    rng = np.random.default_rng(2)
    feeds = {t["name"]: (rng.integers(0, 16, t["shape"]) if t["dtype"] == "int64" else
                         rng.standard_normal(t["shape"])).astype(t["dtype"])
             for t in meta["modules"]["second"]["inputs"]}
    with VirtualMachine(tmp_path, client=client_of(shared_device.path)) as v:
        assert v.entries == ["first", "second"]
        np.testing.assert_allclose(v["first"](X)[0], _ort(example_onnx["multi_output"], {"x": X})[0], atol=TOL)
        np.testing.assert_allclose(v["second"](**feeds), _ort(example_onnx["multi_input"], feeds)[0], atol=1e-3)
        with pytest.raises(InputError, match="second has no input 'x'"):
            v["second"](x=X)


def test_client_calls_after_close_are_a_clear_error(shared_device):
    from dspx.host.client import Client

    c = Client(shared_device.path, staging_size=1 << 20, kv_size=0)
    c.reserve_io(4096, 4096, 1)
    c.close()
    for call in (c.ping, c.status, c.read_printf, lambda: c.create_input((2,), "float32"), lambda: c.alloc(64),
                 lambda: c.load_module(b"\x7fELF"), lambda: c.infer(1, [np.zeros(2, np.float32)])):
        with pytest.raises(ClosedError, match="Client is closed"):
            call()


def test_a_tvm_device_argument_is_taken_as_tvm_code_passes_it(shared_device, compiled, example_onnx):
    import tvm

    with VirtualMachine(compiled("multi_output"), tvm.cpu(), socket=shared_device.path) as v:
        np.testing.assert_allclose(v["main"](X)[0], _ort(example_onnx["multi_output"], {"x": X})[0], atol=TOL)
