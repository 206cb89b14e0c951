"""The timing model's switches on the command line: `dspx info --cost-model`
prints a profile, `dspx serve --cost-model` starts a device whose calls are
counted (docs/cost-model.md)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import pytest

from dspx.errors import UnknownOp
from dspx.host.tasks import Tasks, softmax_param
from dspx.transport import is_listening

LIBRARY = Path(__file__).parents[2] / "examples" / "softmax" / "softmax_ops.py"


def dspx(*args, env=None):
    return subprocess.run([sys.executable, "-m", "dspx.cli", *args], capture_output=True, text=True, timeout=120,
                          env=env)


def test_info_prints_every_parameter_with_its_status_and_source():
    r = dspx("info", "--cost-model", "j6-vision", "--json")
    assert r.returncode == 0, r.stderr
    prof = json.loads(r.stdout)["profile"]
    assert prof["name"] == "j6-vision" and prof["origin"] == "builtin"
    for name in ("clock_hz", "vector_bits", "ddr_load_latency_cycles", "idma_channels", "idma_setup_cycles",
                 "idma_bandwidth_bytes_per_cycle", "tcm_banks", "call_overhead_cycles"):
        p = prof["params"][name]
        assert p["status"] in ("public", "assumed", "calibrated") and p["source"]
        assert p["status"] != "assumed" or len(p["range"]) == 2
    text = dspx("info", "--cost-model", "c7x-j722s")
    assert text.returncode == 0 and "mma_int8_macs_per_cycle" in text.stdout and "l2_bytes" in text.stdout


def test_a_users_profile_file_is_printed_and_a_bad_one_is_one_line(tmp_path):
    mine = json.loads(dspx("info", "--cost-model", "j6-vision", "--json").stdout)["profile"]
    mine = {k: mine[k] for k in ("name", "title", "kind", "params")} | {"name": "my-dsp"}
    f = tmp_path / "my-dsp.json"
    f.write_text(json.dumps(mine))
    r = dspx("info", "--cost-model", str(f), "--json")
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["profile"]["origin"] == str(f)
    bad = dspx("info", "--cost-model", "no-such-board")
    assert bad.returncode == 1 and bad.stderr.count("\n") == 1 and "no-such-board" in bad.stderr
    assert "Traceback" not in bad.stderr
    nothing = dspx("info")
    assert nothing.returncode == 2 and "--cost-model" in nothing.stderr


@pytest.fixture
def served(request):
    """`dspx serve --socket P [--cost-model NAME]` in the background."""
    procs = []

    def start(*extra):
        d = tempfile.mkdtemp(prefix="dspx-test-")
        path = os.path.join(d, "dsp0.sock")
        env = {k: v for k, v in os.environ.items() if k != "DSPX_COST_MODEL"}
        p = subprocess.Popen([sys.executable, "-m", "dspx.cli", "serve", "--socket", path, "--carveout-size", "64M",
                              "--ddr-pool-size", "32M", *extra], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                             env=env)
        procs.append(p)
        deadline = time.monotonic() + 60
        while not is_listening(path):
            assert p.poll() is None, p.stderr.read().decode()
            assert time.monotonic() < deadline, "device did not start"
            time.sleep(0.02)
        return path
    yield start
    for p in procs:
        p.terminate()
        p.wait(10)


def _two_softmax_calls(socket: str) -> list[dict]:
    n = 4096
    with Tasks(socket=socket) as ucp:
        ucp.load_ops(LIBRARY)
        x = ucp.malloc(n * 4)
        x.view(np.float32)[:] = np.linspace(-3, 3, n, dtype=np.float32)
        out, param = ucp.malloc(n * 4), ucp.malloc(24)
        softmax_param(param, x, n, tiled=True)
        records = []
        for _ in range(2):
            task = ucp.run(0x2402, param, out, core=0, priority=0)
            rec = ucp.last_cost()
            assert rec["seq"] == task.seq and rec["cycles"] == task.cycles
            records.append(rec)
        return records


def test_serve_with_a_cost_model_counts_every_call_the_same_way(served):
    first, second = _two_softmax_calls(served("--cost-model", "j6-vision"))
    assert first["profile"] == "j6-vision" and first["estimate"] is True
    assert first["cycles"] == first["overhead"] + first["compute"] + first["ddr_stall"] + first["dma_wait"]
    # the ping-pong path moves its data by iDMA, not by DDR vector loads
    assert first["ddr_loads"] == 0 and sum(first["dma_transfers"]) > 0
    same = {k: v for k, v in first.items() if k != "seq"}
    assert same == {k: v for k, v in second.items() if k != "seq"}


def test_serve_without_a_cost_model_counts_nothing(served):
    socket = served()
    with Tasks(socket=socket) as ucp:
        ucp.client.ping()
        with pytest.raises(UnknownOp):
            ucp.last_cost()


def test_serve_refuses_an_unknown_profile_before_it_starts():
    r = dspx("serve", "--socket", os.path.join(tempfile.mkdtemp(), "s.sock"), "--cost-model", "no-such-board")
    assert r.returncode == 1 and "no-such-board" in r.stderr and "Traceback" not in r.stderr


def _undefined_symbols(so: Path) -> set[str]:
    from elftools.elf.elffile import ELFFile

    with open(so, "rb") as f:
        dynsym = ELFFile(f).get_section_by_name(".dynsym")
        return {s.name for s in dynsym.iter_symbols() if s["st_shndx"] == "SHN_UNDEF" and s.name}


def test_build_ops_with_a_cost_model_makes_a_counted_library(tmp_path):
    """`dspx build-ops --cost-model`: the seed's listing built to count itself
    (it reads the shim's counters); the plain build does not."""
    sources = [str(p) for p in sorted((Path(__file__).parents[2] / "examples" / "softmax_c").glob("*.cc"))]
    counted, plain = tmp_path / "counted.so", tmp_path / "plain.so"
    r = dspx("build-ops", *sources, "-o", str(counted), "--cost-model")
    assert r.returncode == 0, r.stderr
    assert dspx("build-ops", *sources, "-o", str(plain)).returncode == 0
    assert "dspx_cost_tls" in _undefined_symbols(counted)
    assert "dspx_cost_tls" not in _undefined_symbols(plain)
