"""The farm on a local Ray cluster: one machine, two small simulated devices
(one module-scoped farm for every test here).  A farm batch must equal, bit
for bit, the same module run item by item on a local device; a device killed
mid-batch must cost nothing but a retry, shown as attempt 2."""
from __future__ import annotations

import json
import os
import signal

import numpy as np
import pytest
from click.testing import CliRunner

import dspx.farm  # before ray: it sets Ray's loopback switch, read when Ray is first imported
import ray  # part of the test extra: a missing Ray fails this room, it does not skip it
from dspx.cli import main
from dspx.farm import actors
from dspx.host.inputs import specs
from dspx.host.vm import VirtualMachine, find_module

SMALL = ["--carveout-size", "64M", "--ddr-pool-size", "64M"]


@pytest.fixture(scope="module")
def farm(tmp_path_factory):
    """Two small devices; the node's cache is a fresh one, so a module's
    upload to it can be counted."""
    cache = tmp_path_factory.mktemp("farm-node-cache")
    with dspx.farm.LocalFarm(2, device_args=SMALL, env={"DSPX_CACHE": str(cache)}) as f:
        yield f


@pytest.fixture(scope="module")
def module(compiled):
    return compiled("multi_input")


def _inputs(module, n: int, seed: int) -> dict:
    _, meta = find_module(module)
    rng = np.random.default_rng(seed)
    return {s.name: rng.standard_normal((n, *s.shape)).astype(s.dtype) for s in specs(meta)}


def _local(module, data: dict, socket: str) -> list[dict]:
    """Each item run on its own on a local device: the reference."""
    n = len(next(iter(data.values())))
    with VirtualMachine(module, socket=socket) as vm:
        names = [s.name for s in vm.output_specs()]
        out = []
        for i in range(n):
            got = vm["main"](**{k: v[i] for k, v in data.items()})
            out.append(dict(zip(names, got if isinstance(got, list) else [got])))
    return out


def _info():
    return {name: ray.get(h.info.remote(), timeout=30) for name, h in actors.find_devices("sim").items()}


def test_farm_batch_equals_a_local_run(farm, module, shared_device, tmp_path):
    data = _inputs(module, 16, seed=0)
    results = dspx.farm.map(module, data)
    reference = _local(module, data, shared_device.path)
    assert [r.index for r in results] == list(range(16))
    assert {r.device for r in results} <= {"sim-0", "sim-1"} and all(r.attempt == 1 for r in results)
    for r, ref in zip(results, reference):
        assert r.outputs.keys() == ref.keys()
        for name in ref:
            assert r.outputs[name].dtype == ref[name].dtype and np.array_equal(r.outputs[name], ref[name])
    # One node: the module's files came to it once, whichever device asked first.
    assert sum(i["fetched"] for i in _info().values()) == 1

    # The CLI: DATA.npz in, OUT.npz stacked in input order, --json with each item's node, device, attempt.
    np.savez(tmp_path / "data.npz", **data)
    out = tmp_path / "out.npz"
    cli = CliRunner().invoke(main, ["farm", "run", str(module), "--inputs", str(tmp_path / "data.npz"),
                                    "-o", str(out), "--farm", farm.address, "--json"])
    assert cli.exit_code == 0, cli.output
    summary = json.loads(cli.stdout)
    assert summary["items"] == 16 and [r["index"] for r in summary["results"]] == list(range(16))
    assert all(r["device"] in ("sim-0", "sim-1") and r["attempt"] == 1 and r["node"] for r in summary["results"])
    with np.load(out) as written:
        for name in reference[0]:
            assert np.array_equal(written[name], np.stack([ref[name] for ref in reference]))
    assert "farm run: 16/16" in cli.stderr


def test_farm_status_shows_free_devices_per_key(farm):
    cli = CliRunner().invoke(main, ["farm", "status", "--farm", farm.address, "--json"])
    assert cli.exit_code == 0, cli.output
    st = json.loads(cli.stdout)
    assert st["keys"]["sim"] == {"devices": 2, "free": 2, "busy": 0, "other": 0, "held": 0, "restarting": 0,
                                 "pending": 0, "user_cap": 1, "waiting": []}
    assert sorted(d["device"] for d in st["devices"]) == ["sim-0", "sim-1"]


def test_inputs_that_do_not_fit_the_module_are_refused_before_anything_runs(farm, module):
    data = _inputs(module, 4, seed=1)
    wrong = {**data, next(iter(data)): next(iter(data.values()))[..., :1]}
    with pytest.raises(dspx.errors.InputError, match="expected"):
        dspx.farm.map(module, wrong)


def test_a_device_killed_mid_batch_costs_a_retry(farm, module, shared_device):
    data = _inputs(module, 24, seed=2)
    before = _info()
    victim = before["sim-0"]["device_pid"]
    seen = []

    def kill_after_the_third(result):
        seen.append(result)
        if len(seen) == 3:
            os.killpg(victim, signal.SIGKILL)  # the device's front and its cores (their own session)

    results = dspx.farm.map(module, data, on_result=kill_after_the_third)
    reference = _local(module, data, shared_device.path)
    assert [r.index for r in results] == list(range(24))
    for r, ref in zip(results, reference):
        for name in ref:
            assert np.array_equal(r.outputs[name], ref[name]), (r, name)
    retried = [r for r in results if r.attempt > 1]
    assert retried, "no item shows a retry after its device was killed"
    assert all(r.device == "sim-0" and r.attempt == 2 for r in retried)
    after = _info()
    assert after["sim-0"]["restarted"] and after["sim-0"]["device_pid"] != victim
    assert after["sim-1"]["device_pid"] == before["sim-1"]["device_pid"]


def test_a_module_is_put_into_the_object_store_once_while_unchanged(farm, tmp_path):
    lib = tmp_path / "ops.py"
    lib.write_bytes(b"x = 1\n")
    digest, box = dspx.farm.batch.upload([lib])
    assert dspx.farm.batch.upload([lib]) == (digest, box)  # the same ref: no second read, hash or put
    assert ray.get(box[0]) == {"ops.py": b"x = 1\n"}
    lib.write_bytes(b"x = 2\n")  # same size, new content and mtime
    os.utime(lib, ns=(lib.stat().st_atime_ns, lib.stat().st_mtime_ns + 1_000_000))
    digest2, box2 = dspx.farm.batch.upload([lib])
    assert digest2 != digest and ray.get(box2[0]) == {"ops.py": b"x = 2\n"}
