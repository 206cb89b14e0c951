"""Machine profiles (dspx.costmodel.profile): the shipped ones carry a status
and a source for every parameter and a range for every assumed one; a user's
file loads by path or through DSPX_COST_MODEL; a bad file is refused with one
error naming the file and the key."""
from __future__ import annotations

import copy
import json

import pytest

from dspx import costmodel
from dspx.costmodel import profile as prof

C7X_EXTRA = ("mma_int8_macs_per_cycle", "mma_fp32_macs_per_cycle", "vector_fp32_macs_per_cycle", "l2_bytes",
             "kernel_call_overhead_cycles")


def raw(name: str) -> dict:
    return json.loads(prof._profiles_dir().joinpath(f"{name}.json").read_text())


def test_shipped_profiles():
    assert costmodel.names() == ["c7x-j722s", "j6-vision"]


@pytest.mark.parametrize("name", ["j6-vision", "c7x-j722s"])
def test_every_param_has_status_source_and_an_assumed_range(name):
    p = costmodel.load(name)
    assert p.name == name and p.origin == "builtin" and p.kind == "vector-dsp" and p.title
    assert set(prof.REQUIRED) <= set(p.params)
    for n, param in p.params.items():
        assert param.status in ("public", "assumed", "calibrated"), n
        assert len(param.source) > 20, n  # says where the figure comes from
        assert param.unit, n
        if param.status == "assumed":
            lo, hi = param.range
            assert lo <= param.value <= hi, n
    assert p.assumed() == {n: q.value for n, q in p.params.items() if q.status == "assumed"}


def test_the_seed_devices_facts():
    j6 = costmodel.load("j6-vision")
    assert (j6.param("vector_bits"), j6.param("idma_channels"), j6.param("tcm_banks"), j6.param("ddr_cached")) == \
        (512, 2, 2, 0)
    c7x = costmodel.load("c7x-j722s")
    assert set(C7X_EXTRA) <= set(c7x.params)
    assert (c7x.param("vector_bits"), c7x.param("mma_int8_macs_per_cycle"), c7x.param("l2_bytes")) == \
        (256, 32 * 32, 1280 * 1024)
    assert c7x.params["mma_int8_macs_per_cycle"].status == "public"


def test_describe_and_json_text_round_trip():
    p = costmodel.load("j6-vision")
    d = p.describe()
    assert d["name"] == "j6-vision" and d["params"]["clock_hz"]["status"] == "assumed"
    assert d["params"]["clock_hz"]["range"] == list(p.params["clock_hz"].range)
    json.dumps(d)  # plain data, for --json
    again = costmodel.load(p.to_json())
    assert again.values() == p.values() and again.describe()["params"] == d["params"]


def test_profile_is_frozen():
    p = costmodel.load("j6-vision")
    with pytest.raises(AttributeError):
        p.name = "x"
    with pytest.raises(TypeError):
        p.params["clock_hz"] = None
    with pytest.raises(costmodel.ProfileError, match="no parameter 'warp_drive'"):
        p.param("warp_drive")


def test_a_user_file_loads_by_path_and_through_the_environment(tmp_path):
    data = raw("j6-vision")
    data["name"] = "my-board"
    data["params"]["clock_hz"] = {"value": 8e8, "unit": "Hz", "status": "calibrated", "source": "our bench, 2026-11"}
    path = tmp_path / "my-board.json"
    path.write_text(json.dumps(data))
    p = costmodel.load(str(path))
    assert (p.name, p.origin, p.param("clock_hz")) == ("my-board", str(path), 8e8)
    env = {costmodel.ENV: str(path)}
    assert costmodel.from_env(env).values() == p.values()
    # the front hands its cores the profile itself, never the path
    resolved = costmodel.resolve_env(env)
    assert resolved.name == "my-board" and env[costmodel.ENV].startswith("{")
    path.unlink()
    assert costmodel.from_env(env).values() == p.values()


def test_off_and_builtin_names_in_the_environment():
    assert costmodel.from_env({}) is None
    assert costmodel.from_env({costmodel.ENV: ""}) is None
    env = {costmodel.ENV: "j6-vision"}
    assert costmodel.resolve_env(env).name == "j6-vision" and env[costmodel.ENV] == "j6-vision"


def test_an_unknown_name_lists_the_shipped_ones():
    with pytest.raises(costmodel.ProfileError, match=r"'j7-vision': no such profile \(shipped: c7x-j722s, j6-vision\)"):
        costmodel.load("j7-vision")
    with pytest.raises(costmodel.ProfileError, match="cannot read the profile file"):
        costmodel.load("/nonexistent/board.json")


def _set(path, value):
    def change(d):
        *keys, last = path
        for k in keys:
            d = d[k]
        if value is _DELETE:
            del d[last]
        else:
            d[last] = value
    return change


def _calibrated(name):
    return _both(_set([P, name, "status"], "calibrated"), _set([P, name, "range"], _DELETE))


def _both(*changes):
    def change(d):
        for c in changes:
            c(d)
    return change


_DELETE = object()
P = "params"
BAD = [
    (_set([P, "clock_hz", "status"], "guess"), "params.clock_hz.status: expected one of public, assumed, calibrated"),
    (_set([P, "clock_hz", "status"], _DELETE), "params.clock_hz.status: expected one of"),
    (_set([P, "clock_hz", "source"], ""), "params.clock_hz.source: expected a non-empty string"),
    (_set([P, "clock_hz", "range"], _DELETE), "params.clock_hz.range: missing; an assumed parameter needs"),
    (_set([P, "clock_hz", "range"], [1, 2]), "params.clock_hz.range: expected low <= value <= high"),
    (_set([P, "clock_hz", "range"], "wide"), "params.clock_hz.range: expected [low, high]"),
    (_set([P, "clock_hz", "value"], "1 GHz"), "params.clock_hz.value: expected a finite number"),
    (_set([P, "clock_hz", "value"], True), "params.clock_hz.value: expected a finite number"),
    (_set([P, "clock_hz", "valu"], 1), "params.clock_hz: unknown key 'valu'"),
    (_set([P, "idma_channels", "value"], 0), "params.idma_channels.value: expected a number above 0"),
    (_both(_calibrated("issue_alu"), _set([P, "issue_alu", "value"], 0)),
     "params.issue_alu.value: expected a number above 0"),
    (_set([P, "idma_channels", "value"], 1.5), "params.idma_channels.value: expected a whole number"),
    (_set([P, "ddr_cached", "value"], 2), "params.ddr_cached.value: expected 0 or 1"),
    (_both(_calibrated("ddr_load_latency_cycles"), _set([P, "ddr_load_latency_cycles", "value"], -1)),
     "params.ddr_load_latency_cycles.value: expected 0 or more"),
    (_set([P, "vector_bits", "value"], 500), "params.vector_bits.value: expected a multiple of 32"),
    (_set([P, "idma_setup_cycles"], _DELETE), "params.idma_setup_cycles: missing"),
    (_set([P, "tcm_banks"], 2), "params.tcm_banks: expected an object"),
    (_set([P], []), "params: expected an object of parameters"),
    (_set(["kind"], "gpu"), "kind: expected one of vector-dsp"),
    (_set(["name"], ""), "name: expected a non-empty string"),
    (_set(["colour"], "red"), "unknown top-level key 'colour'"),
]


@pytest.mark.parametrize("change, message", BAD, ids=[m[:40] for _, m in BAD])
def test_a_bad_file_is_refused_naming_file_and_key(tmp_path, change, message):
    data = copy.deepcopy(raw("j6-vision"))
    change(data)
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(data))
    with pytest.raises(costmodel.ProfileError) as e:
        costmodel.load(str(path))
    assert str(e.value).startswith(f"{path}: ") and message in str(e.value), str(e.value)


def test_not_json_and_not_an_object(tmp_path):
    path = tmp_path / "broken.json"
    path.write_text('{"name": "x",\n  oops}')
    with pytest.raises(costmodel.ProfileError, match=r"broken.json: not valid JSON \(line 2 column 3"):
        costmodel.load(str(path))
    path.write_text("[1, 2]")
    with pytest.raises(costmodel.ProfileError, match="expected a JSON object at the top, got list"):
        costmodel.load(str(path))


def test_the_environment_names_a_bad_profile_clearly():
    with pytest.raises(costmodel.ProfileError, match=r"\$DSPX_COST_MODEL: not valid JSON"):
        costmodel.from_env({costmodel.ENV: "{not json"})
