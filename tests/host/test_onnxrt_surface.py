"""onnxruntime's wider surface on dspx.InferenceSession, side by side with
onnxruntime itself on the same model: IOBinding (inputs, allocated and
pre-allocated outputs), profiling to onnxruntime's trace format,
get_modelmeta, what a list feed and the providers argument get."""
from __future__ import annotations

import json

import numpy as np
import onnxruntime as ort
import pytest

import dspx
from dspx.errors import DspxError, InputError

TOL = 1e-4
X = np.random.default_rng(3).standard_normal((2, 32)).astype(np.float32)


@pytest.fixture(scope="module")
def model(example_onnx):
    return example_onnx["multi_output"]


@pytest.fixture(scope="module")
def pair(model, shared_device):
    """(ours, onnxruntime's) on the same ONNX file.  Ours is compiled once
    into the tests' cache (verify=False: this test compares with onnxruntime)."""
    ours = dspx.InferenceSession(str(model), socket=shared_device.path, progress=False,
                                 compile_options={"verify": False})
    yield ours, ort.InferenceSession(str(model), providers=["CPUExecutionProvider"])
    ours.close()


def test_io_binding_like_onnxruntime(pair):
    ours, theirs = pair
    got = {}
    for name, sess in (("ours", ours), ("theirs", theirs)):
        io = sess.io_binding()
        x = X.copy()
        io.bind_input("x", "cpu", 0, np.float32, list(x.shape), x.ctypes.data)  # by pointer
        io.bind_output("relu")  # allocated by the session
        pre = np.full((2, 24), -1, np.float32)
        io.bind_output("softmax", "cpu", 0, np.float32, list(pre.shape), pre.ctypes.data)  # pre-allocated
        sess.run_with_iobinding(io)
        values = io.get_outputs()
        got[name] = (io.copy_outputs_to_cpu(), pre.copy(),
                     [(v.shape(), v.data_type(), v.element_type(), v.device_name()) for v in values])
        io.clear_binding_inputs()
        io.bind_cpu_input("x", X * 2)  # rebinding a name, by array
        sess.run_with_iobinding(io)
        got[name] += (io.copy_outputs_to_cpu(),)
    (o_outs, o_pre, o_meta, o_again), (t_outs, t_pre, t_meta, t_again) = got["ours"], got["theirs"]
    assert o_meta == t_meta  # OrtValue's shape, type, element type, device
    assert len(o_outs) == len(t_outs) == 2
    for mine, ref in zip(o_outs + o_again, t_outs + t_again):
        np.testing.assert_allclose(mine, ref, rtol=0, atol=TOL)
    np.testing.assert_allclose(o_pre, t_pre, rtol=0, atol=TOL)  # the pre-allocated buffer was written
    np.testing.assert_allclose(o_pre, o_outs[1], rtol=0, atol=0)


def test_ortvalues_bind_like_onnxruntime(pair):
    """onnxruntime's own OrtValues bound as input and as a pre-allocated output."""
    written = []
    for sess in pair:
        x = ort.OrtValue.ortvalue_from_numpy(X)
        y = ort.OrtValue.ortvalue_from_shape_and_type([2, 24], np.float32)
        io = sess.io_binding()
        io.bind_ortvalue_input("x", x)
        io.bind_ortvalue_output("tanh", y)
        sess.run_with_iobinding(io)
        written.append(y.numpy())
    np.testing.assert_allclose(written[0], written[1], rtol=0, atol=TOL)
    assert np.any(written[0] != 0)


def test_io_binding_mistakes_are_named(pair):
    ours, theirs = pair
    io, ref = ours.io_binding(), theirs.io_binding()
    io.bind_cpu_input("x", X)
    ref.bind_cpu_input("x", X)
    with pytest.raises(RuntimeError, match="At least one output"):  # onnxruntime: nothing bound to produce
        theirs.run_with_iobinding(ref)
    with pytest.raises(InputError, match="no output is bound"):
        ours.run_with_iobinding(io)
    with pytest.raises(InputError, match="no output named 'nope' \\(outputs: relu, softmax"):
        io.bind_output("nope")
    with pytest.raises(InputError, match="no input named 'y' \\(inputs: x\\)"):
        io.bind_cpu_input("y", X)
    small = np.zeros((2, 23), np.float32)
    with pytest.raises(InputError, match="'relu' is float32\\[2, 24\\]; the bound buffer is float32\\[2, 23\\]"):
        io.bind_output("relu", "cpu", 0, np.float32, small.shape, small.ctypes.data)
    with pytest.raises(InputError, match="device_type 'cuda'"):
        io.bind_output("relu", "cuda")


def test_a_list_feed_is_refused_as_onnxruntime_refuses_it(pair):
    ours, theirs = pair
    with pytest.raises(AttributeError):  # onnxruntime: input_feed must be a dict
        theirs.run(None, [X])
    with pytest.raises(InputError, match="input_feed must be a dict .* got a list: pass \\{'x': ...\\}"):
        ours.run(None, [X])


def test_modelmeta_matches_onnxruntime(pair, compiled, shared_device):
    ours, theirs = pair
    mine, ref = ours.get_modelmeta(), theirs.get_modelmeta()
    for field in ("producer_name", "graph_name", "domain", "description", "graph_description", "version",
                  "custom_metadata_map"):
        assert getattr(mine, field) == getattr(ref, field), field
    assert mine.producer_name  # the example model names its producer
    with dspx.InferenceSession(str(compiled("multi_output")), socket=shared_device.path) as from_dir:
        assert from_dir.get_modelmeta().producer_name == ""  # a module directory has no ONNX file


def _events(path):
    with open(path) as f:
        events = json.load(f)
    assert isinstance(events, list) and events
    return events


def test_profiling_writes_onnxruntimes_trace_format(model, shared_device, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    so_ref = ort.SessionOptions()
    so_ref.enable_profiling = True
    theirs = ort.InferenceSession(str(model), so_ref, providers=["CPUExecutionProvider"])
    theirs.run(None, {"x": X})
    ref = _events(theirs.end_profiling())
    so = dspx.SessionOptions()
    so.enable_profiling = True
    so.profile_file_prefix = "dspx_profile"
    with dspx.InferenceSession(str(model), so, socket=shared_device.path, progress=False,
                               compile_options={"verify": False}) as ours:
        y1 = ours.run(["relu"], {"x": X})[0]
        ours.run(None, {"x": X})
        path = ours.end_profiling()
        assert ours.end_profiling() == "" == theirs.end_profiling()  # onnxruntime's answer once it ended
        np.testing.assert_allclose(y1, theirs.run(["relu"], {"x": X})[0], rtol=0, atol=TOL)
    assert path.startswith("dspx_profile_") and path.endswith(".json") and (tmp_path / path).is_file()
    events = _events(tmp_path / path)
    assert all(set(e) == set(ref[0]) and e["ph"] == "X" for e in events)  # the same event fields
    runs = [e for e in events if e["name"] == "model_run"]
    nodes = [e for e in events if e["cat"] == "Node"]
    assert len(runs) == 2 and {"model_run", "session_initialization"} <= {e["name"] for e in ref}
    assert nodes and all(e["name"].endswith("_kernel_time") and e["args"]["provider"] == "DSPExecutionProvider"
                         and e["args"]["op_name"] for e in nodes)
    first = runs[0]
    inside = [e for e in nodes if first["ts"] <= e["ts"] < runs[1]["ts"]]
    assert inside and all(e["dur"] >= 0 for e in inside)
    # an onnxruntime SessionOptions works too
    with dspx.InferenceSession(str(model), so_ref, socket=shared_device.path, progress=False,
                               compile_options={"verify": False}) as again:
        again.run(None, {"x": X})
        assert again.end_profiling().startswith("onnxruntime_profile_")


def test_session_options_take_only_what_dspx_reads():
    so = dspx.SessionOptions()
    assert (so.enable_profiling, so.profile_file_prefix) == (False, ort.SessionOptions().profile_file_prefix)
    with pytest.raises(AttributeError, match="intra_op_num_threads: dspx reads only enable_profiling"):
        so.intra_op_num_threads = 2


@pytest.mark.parametrize("providers, words", [
    (["CUDAExecutionProvider"], ["unknown execution provider 'CUDAExecutionProvider'", "DSPExecutionProvider"]),
    ("DSPExecutionProvider", ["a list of names", "['DSPExecutionProvider']"]),
    (["CPUExecutionProvider"], ["host CPU only", "onnxruntime.InferenceSession"]),
])
def test_providers_are_checked_before_anything_is_compiled(model, tmp_path, providers, words):
    with pytest.raises(DspxError) as e:
        dspx.InferenceSession(str(model), providers=providers, cache_dir=tmp_path)
    for w in words:
        assert w in str(e.value), (w, str(e.value))
    assert not any(tmp_path.iterdir())  # refused before a compile started


def test_the_providers_dspx_accepts(pair, model, shared_device):
    assert "CPUExecutionProvider" in ort.get_available_providers()  # the fallback name onnxruntime uses
    for providers in (["DSPExecutionProvider"], ["DspxExecutionProvider", "CPUExecutionProvider"],
                      [("DSPExecutionProvider", {}), "CPUExecutionProvider"]):
        with dspx.InferenceSession(str(model), providers=providers, socket=shared_device.path, progress=False,
                                   compile_options={"verify": False}) as s:
            assert s.get_providers() == ["DSPExecutionProvider"]


def test_a_profile_file_never_replaces_one_that_exists(tmp_path, monkeypatch):
    import datetime
    import types

    from dspx.host import onnxrt

    moment = datetime.datetime(2026, 12, 3, 17, 4, 41, 86000)
    monkeypatch.setattr(onnxrt, "datetime", types.SimpleNamespace(datetime=types.SimpleNamespace(now=lambda: moment)))
    monkeypatch.chdir(tmp_path)
    mine = tmp_path / "onnxruntime_profile__2026-12-03_17-04-41_086.json"  # onnxruntime's name for that moment
    mine.write_text("the user's")
    p = onnxrt.Profiler("onnxruntime_profile_")
    p.add("Session", "model_run", 0, 5)
    path = p.write()
    assert path == "onnxruntime_profile__2026-12-03_17-04-41_086_1.json" and mine.read_text() == "the user's"
    assert json.loads((tmp_path / path).read_text())[0]["name"] == "model_run"
