"""dspx.InferenceSession side by side with onnxruntime.InferenceSession on the
same model: the same NodeArgs, the same outputs for the same feeds."""
from __future__ import annotations

import numpy as np
import onnxruntime as ort
import pytest

import dspx
from dspx.errors import InputError

TOL = 1e-4


@pytest.fixture(scope="module")
def sessions(example_onnx, shared_device, tmp_path_factory):
    path = example_onnx["multi_output"]
    cache = tmp_path_factory.mktemp("sessions")
    # verify=False: this test compares with onnxruntime itself
    ours = dspx.InferenceSession(str(path), socket=shared_device.path, cache_dir=cache, progress=False,
                                 compile_options={"verify": False})
    theirs = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    yield ours, theirs, path, cache
    ours.close()


def test_node_args_match_onnxruntime(sessions):
    ours, theirs, _, _ = sessions
    for mine, ref in ((ours.get_inputs(), theirs.get_inputs()), (ours.get_outputs(), theirs.get_outputs())):
        assert [(a.name, a.shape, a.type) for a in mine] == [(a.name, a.shape, a.type) for a in ref]


def test_run_matches_onnxruntime(sessions):
    ours, theirs, _, _ = sessions
    x = np.random.default_rng(7).standard_normal((2, 32)).astype(np.float32)
    everything = ours.run(None, {"x": x})
    for got, ref, arg in zip(everything, theirs.run(None, {"x": x}), theirs.get_outputs()):
        assert got.dtype == ref.dtype and got.shape == ref.shape, arg.name
        np.testing.assert_allclose(got, ref, rtol=0, atol=TOL, err_msg=arg.name)
    some = ["tanh", "relu", "argmax"]
    for got, ref in zip(ours.run(some, {"x": x}), theirs.run(some, {"x": x})):
        np.testing.assert_allclose(got, ref, rtol=0, atol=TOL)


def test_mistakes_are_named(sessions):
    ours, _, _, _ = sessions
    x = np.zeros((2, 32), np.float32)
    with pytest.raises(InputError, match="no output named 'nope'"):
        ours.run(["nope"], {"x": x})
    with pytest.raises(InputError, match="has no input 'y'"):
        ours.run(None, {"y": x})
    with pytest.raises(InputError, match="expects float32\\[2, 32\\]; got float64\\[2, 32\\]"):
        ours.run(None, {"x": x.astype(np.float64)})


def test_second_session_loads_from_the_cache(sessions, shared_device):
    ours, _, path, cache = sessions
    assert ours.compiled_now
    with dspx.InferenceSession(str(path), socket=shared_device.path, cache_dir=cache, progress=False,
                               compile_options={"verify": False}) as again:
        assert not again.compiled_now and again.module_dir == ours.module_dir
        x = np.ones((2, 32), np.float32)
        np.testing.assert_array_equal(again.run(["relu"], {"x": x})[0], ours.run(["relu"], {"x": x})[0])


def test_a_serialized_model_works_too(sessions, shared_device):
    ours, _, path, cache = sessions
    with dspx.InferenceSession(path.read_bytes(), socket=shared_device.path, cache_dir=cache, progress=False,
                               compile_options={"verify": False}) as from_bytes:
        assert not from_bytes.compiled_now and from_bytes.module_dir == ours.module_dir  # same content, same key
