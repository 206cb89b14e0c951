"""`dspx farm ops`: a native op library's cases spread over a farm of two
small devices, judged against numpy's answer for each case; the library
reaches the node once (its cache); failing cases are named and the exit
code says so; bad case files get one line."""
from __future__ import annotations

import json

import numpy as np
import pytest
from click.testing import CliRunner

import dspx.farm  # before ray: it sets Ray's loopback switch, read when Ray is first imported
import ray
from dspx import sdk
from dspx.cli import main
from dspx.farm import actors

SMALL = ["--carveout-size", "64M", "--ddr-pool-size", "64M"]
ADD_ONE, MISSING = 0x3B01, 0x3B7F
N_BYTES = 16

# Input: uint32 n, then n bytes; output: each byte + 1 (mod 256).  n == 0 returns 7.
SOURCE = r"""
#include <dspx/dsp.h>

static int add_one(void *input, void *output, void *tm) {
    (void)tm;
    const uint8_t *in = input;
    uint8_t *out = output;
    uint32_t n;
    memcpy(&n, in, 4);
    if (n == 0)
        return 7;
    for (uint32_t i = 0; i < n; i++)
        out[i] = (uint8_t)(in[4 + i] + 1);
    return 0;
}

int dspx_ops_init(void) { return hb_dsp_register_fn(0x3B01, add_one, 0); }
"""


@pytest.fixture(scope="module")
def farm(tmp_path_factory):
    cache = tmp_path_factory.mktemp("farm-ops-cache")
    with dspx.farm.LocalFarm(2, device_args=SMALL, env={"DSPX_CACHE": str(cache)}) as f:
        yield f


@pytest.fixture(scope="module")
def library(tmp_path_factory):
    d = tmp_path_factory.mktemp("addone")
    (d / "add_one.c").write_text(SOURCE)
    return sdk.build_ops([d / "add_one.c"], d / "add_one.so", ["-Wall", "-Werror"], echo=False)


def _cases(n: int, seed: int):
    """n cases of add_one, with numpy's answer for each: the independent reference."""
    rng = np.random.default_rng(seed)
    data = rng.integers(0, 256, (n, N_BYTES), dtype=np.uint8)
    inp = np.concatenate([np.full((n, 1), N_BYTES, "<u4").view(np.uint8), data], axis=1)
    expected = ((data.astype(np.int32) + 1) % 256).astype(np.uint8)
    return inp, expected


def _fetched() -> int:
    return sum(ray.get(h.info.remote(), timeout=60)["fetched"] for h in actors.find_devices("sim").values())


def test_cases_run_across_the_farm_and_match_numpy(farm, library, tmp_path):
    inp, expected = _cases(40, seed=0)
    before = _fetched()
    np.savez(tmp_path / "cases.npz", input=inp, cmd=np.int64(ADD_ONE), expected=expected)
    out = tmp_path / "out.npz"
    cli = CliRunner().invoke(main, ["farm", "ops", str(library), "--cases", str(tmp_path / "cases.npz"),
                                    "--farm", farm.address, "-o", str(out), "--chunk", "4", "--json"])
    assert cli.exit_code == 0, cli.output
    summary = json.loads(cli.stdout)
    assert (summary["cases"], summary["failed"], summary["checked"]) == (40, 0, True)
    assert [r["index"] for r in summary["results"]] == list(range(40))
    assert all(r["passed"] and r["return_value"] == 0 and r["attempt"] == 1 for r in summary["results"])
    assert set(summary["devices"]) == {"sim-0", "sim-1"}  # spread over both
    with np.load(out) as w:
        assert w["output"].dtype == np.uint8 and np.array_equal(w["output"], expected)
        assert w["passed"].all() and (w["return_value"] == 0).all()
    assert _fetched() - before == 1  # one node: the library came to it once
    assert "farm ops: 40/40" in cli.stderr


def test_failing_cases_are_named_and_the_exit_code_says_so(farm, library, tmp_path):
    inp, expected = _cases(6, seed=1)
    inp[2, :4] = 0                      # n = 0: the op returns 7 and writes nothing
    expected[3] ^= 1                    # a wrong expectation: the op is right, the case is not
    cmd = np.full(6, ADD_ONE)
    cmd[4] = MISSING                    # no such op on the device
    rv = np.zeros(6, np.int64)
    rv[2] = 7
    rv[5] = 3                           # its output is right, its return code (0) is not the one expected
    expected[2] = 0                     # the output buffer is zeroed before each case
    np.savez(tmp_path / "cases.npz", input=inp, cmd=cmd, expected=expected, return_value=rv)
    cli = CliRunner().invoke(main, ["farm", "ops", str(library), "--cases", str(tmp_path / "cases.npz"),
                                    "--farm", farm.address, "--chunk", "1"])
    assert cli.exit_code == 1, cli.output
    lines = cli.stdout.splitlines()
    assert any(ln.startswith("case 3 FAILED") and "output differs from expected" in ln for ln in lines), lines
    assert any(ln.startswith("case 4 FAILED") and "0x3b7f" in ln.lower() for ln in lines), lines
    assert any(ln.startswith("case 5 FAILED") and "returned 0, expected 3" in ln for ln in lines), lines
    assert not any(ln.startswith(("case 0 ", "case 1 ", "case 2 ")) for ln in lines), lines
    assert lines[-1] == "6 case(s) on 2 device(s): 3 passed, 3 failed"


@pytest.mark.parametrize("arrays, message", [
    ({"cmd": np.int64(ADD_ONE), "expected": np.zeros((2, 4), np.uint8)}, "no 'input' array"),
    ({"input": np.zeros((2, 8), np.uint8), "cmd": np.int64(ADD_ONE)}, "give 'expected'"),
    ({"input": np.zeros((2, 8), np.uint8), "cmd": np.zeros(3, np.int64), "output_bytes": np.int64(4)},
     "'cmd' must be a scalar or one per case, shape (2,)"),
    ({"input": np.zeros((2, 8), np.uint8), "cmd": np.int64(1), "expected": np.zeros((3, 4), np.uint8)},
     "'expected' must be (N, ...) with N = 2"),
    ({"input": np.zeros((2, 8), np.uint8), "cmd": np.float32(1.5), "output_bytes": np.int64(4)},
     "'cmd' must hold integers"),
    ({"input": np.zeros((2, 8), np.uint8), "cmd": np.int64(1), "output_bytes": np.int64(4), "exepcted": 1},
     "unknown array(s) exepcted"),
])
def test_bad_case_files_get_one_line(farm, library, tmp_path, arrays, message):
    np.savez(tmp_path / "cases.npz", **arrays)
    cli = CliRunner().invoke(main, ["farm", "ops", str(library), "--cases", str(tmp_path / "cases.npz"),
                                    "--farm", farm.address])
    assert cli.exit_code == 1 and message in cli.output, cli.output
    assert "Traceback" not in cli.output


def test_c_source_is_refused_with_the_build_command(farm, tmp_path):
    (tmp_path / "op.c").write_text(SOURCE)
    inp, expected = _cases(2, seed=2)
    np.savez(tmp_path / "cases.npz", input=inp, cmd=np.int64(ADD_ONE), expected=expected)
    cli = CliRunner().invoke(main, ["farm", "ops", str(tmp_path / "op.c"), "--cases", str(tmp_path / "cases.npz"),
                                    "--farm", farm.address])
    assert cli.exit_code == 1 and "build it first with `dspx build-ops" in cli.output, cli.output


def test_an_existing_or_non_npz_output_is_refused_before_anything_runs(library, tmp_path):
    inp, expected = _cases(2, seed=3)
    np.savez(tmp_path / "cases.npz", input=inp, cmd=np.int64(ADD_ONE), expected=expected)
    mine = tmp_path / "mine.npz"
    mine.write_bytes(b"a user's file")
    args = ["farm", "ops", str(library), "--cases", str(tmp_path / "cases.npz"), "--farm", "127.0.0.1:9"]
    cli = CliRunner().invoke(main, [*args, "-o", str(mine)])
    assert cli.exit_code == 2 and "exists: it is not overwritten" in cli.output, cli.output
    assert mine.read_bytes() == b"a user's file"
    cli = CliRunner().invoke(main, [*args, "-o", str(tmp_path / "out.txt")])
    assert cli.exit_code == 2 and "the outputs are written as .npz" in cli.output, cli.output
    assert not (tmp_path / "out.txt").exists()
