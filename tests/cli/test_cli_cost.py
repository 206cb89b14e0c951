"""The timing model's switches on the command line: `dspx info --cost-model`
prints a profile, `dspx serve --cost-model` starts a device whose calls are
counted (docs/cost-model.md)."""
from __future__ import annotations

import json
import os
import shutil
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
    procs, dirs = [], []

    def start(*extra):
        d = tempfile.mkdtemp(prefix="dspx-test-")
        dirs.append(d)
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
    for d in dirs:
        shutil.rmtree(d, ignore_errors=True)


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
    d = tempfile.mkdtemp()
    r = dspx("serve", "--socket", os.path.join(d, "s.sock"), "--cost-model", "no-such-board")
    shutil.rmtree(d)
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


# ---------------------------------------------------------------- board-time estimates (compile, info, run, generate)

C7X = json.loads((Path(__file__).parents[2] / "src" / "dspx" / "costmodel" / "profiles" / "c7x-j722s.json")
                 .read_text())["params"]


def _c7x(name: str) -> float:
    return C7X[name]["value"]


def _one_conv(path: Path) -> Path:
    """x (1, 8, 16, 16) -> a 3x3 conv, 16 filters, pad 1, no bias -> y (1, 16, 16, 16)."""
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    w = (np.random.default_rng(0).standard_normal((16, 8, 3, 3)) * 0.1).astype(np.float32)
    g = helper.make_graph([helper.make_node("Conv", ["x", "w"], ["y"], pads=[1, 1, 1, 1], name="conv")], "one_conv",
                          [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 8, 16, 16])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 16, 16, 16])],
                          [numpy_helper.from_array(w, "w")])
    onnx.save(helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)]), path)
    return path


def _one_conv_cycles_by_hand() -> float:
    macs = 16 * 16 * 16 * (8 * 3 * 3)  # output elements x (C/group x kh x kw)
    ddr = 16 * 8 * 3 * 3 * 4 + 8 * 16 * 16 * 4 + 16 * 16 * 16 * 4  # weights + input + output, float32, all fit L2
    assert (macs, ddr) == (294_912, 29_184)
    return max(macs / _c7x("vector_fp32_macs_per_cycle"), ddr / _c7x("ddr_bandwidth_bytes_per_cycle")) \
        + _c7x("kernel_call_overhead_cycles")


def _env(**extra):
    env = {k: v for k, v in os.environ.items() if k != "DSPX_COST_MODEL"}
    return env | extra


@pytest.fixture(scope="module")
def one_conv(tmp_path_factory):
    """(module dir compiled by `dspx compile --cost-model c7x-j722s`, an input .npy)."""
    d = tmp_path_factory.mktemp("one-conv")
    out = d / "module"
    r = dspx("compile", str(_one_conv(d / "conv.onnx")), "-o", str(out), "--no-verify", "--cost-model", "c7x-j722s",
             env=_env())
    assert r.returncode == 0, r.stderr
    assert "ESTIMATE on c7x-j722s" in r.stdout and "assumed:" in r.stdout
    np.save(d / "x.npy", np.ones((1, 8, 16, 16), np.float32))
    return out, d / "x.npy"


def test_compile_records_the_estimate_and_info_shows_it(one_conv):
    out, _ = one_conv
    est = json.loads((out / "metadata.json").read_text())["cost_estimate"]
    assert est["profile"] == "c7x-j722s" and est["estimate"] is True and est["calls"] == 1
    assert est["total_cycles"] == _one_conv_cycles_by_hand() == 20_432
    info = dspx("info", str(out), env=_env())
    assert info.returncode == 0, info.stderr
    block = [ln for ln in info.stdout.splitlines() if "estimate" in ln.lower() or "assumed:" in ln]
    assert "ESTIMATE on c7x-j722s" in block[0] and "20,432 cycles" in block[0] and "not a measurement" in block[0]
    assert "assumed:" in block[1] and "per call 2,000 cycles (assumed)" in block[1]
    facts = json.loads(dspx("info", str(out), "--json", env=_env()).stdout)
    assert facts["cost_estimate"]["total_cycles"] == 20_432 and facts["cost_estimate"]["profile"] == "c7x-j722s"


def test_info_of_a_module_without_an_estimate_is_unchanged(one_conv, tmp_path):
    out, _ = one_conv
    plain = tmp_path / "plain"
    plain.mkdir()
    (plain / "model.so").write_bytes((out / "model.so").read_bytes())
    meta = json.loads((out / "metadata.json").read_text())
    del meta["cost_estimate"]
    (plain / "metadata.json").write_text(json.dumps(meta))
    info = dspx("info", str(plain), "--json", env=_env())
    assert info.returncode == 0 and "cost_estimate" not in json.loads(info.stdout)
    assert "ESTIMATE" not in dspx("info", str(plain), env=_env()).stdout
    r = dspx("run", str(plain), "-i", str(one_conv[1]), "--cost-model", "c7x-j722s", env=_env())
    assert r.returncode == 1 and r.stderr.count("\n") == 1 and "--cost-model c7x-j722s" in r.stderr


def test_run_prints_the_hand_counted_estimate_after_its_own_output(one_conv):
    out, x = one_conv
    r = dspx("run", str(out), "-i", str(x), "--cost-model", "c7x-j722s", env=_env())
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    first = next(i for i, ln in enumerate(lines) if ln.startswith("ESTIMATE on c7x-j722s"))
    assert any(ln.startswith("  output   y") for ln in lines[:first])  # the run's own report comes first
    assert lines[first + 1].startswith("  assumed:") and "DDR 12 B/cycle (assumed)" in lines[first + 1]
    row = next(ln for ln in lines[first:] if ln.split()[:1] == ["conv"])
    assert "294,912" in row and "29,184" in row and row.split()[-2] == "20,432" and row.endswith("compute")
    assert "(estimate): 20,432 cycles = 0.020 ms" in lines[-1]
    j = json.loads(dspx("run", str(out), "-i", str(x), "--cost-model", "c7x-j722s", "--json", env=_env()).stdout)
    assert j["status"] == "ok" and j["cost_estimate"]["total_cycles"] == _one_conv_cycles_by_hand()
    assert j["cycles"] > 0 and j["clock"]  # the host's clock, beside the estimate


def test_run_under_the_environment_and_its_errors(one_conv):
    out, x = one_conv
    j = json.loads(dspx("run", str(out), "-i", str(x), "--json", env=_env(DSPX_COST_MODEL="c7x-j722s")).stdout)
    assert j["cost_estimate"]["profile"] == "c7x-j722s"
    # j6-vision in the environment: its private device counts Python ops; no MMA, so no board estimate, no error
    j6 = dspx("run", str(out), "-i", str(x), "--json", env=_env(DSPX_COST_MODEL="j6-vision"))
    assert j6.returncode == 0, j6.stderr
    assert "cost_estimate" not in json.loads(j6.stdout)
    assert "cost_estimate" not in json.loads(dspx("run", str(out), "-i", str(x), "--json", env=_env()).stdout)
    for name, words in (("j6-vision", "mma_int8_macs_per_cycle"), ("no-such-board", "no-such-board")):
        bad = dspx("run", str(out), "-i", str(x), "--cost-model", name, env=_env())
        assert bad.returncode == 1 and bad.stderr.count("\n") == 1 and words in bad.stderr, bad.stderr
        assert "Traceback" not in bad.stderr and name in bad.stderr
        bad = dspx("run", str(out), "-i", str(x), "--cost-model", name, "--json", env=_env())
        assert bad.returncode == 1 and json.loads(bad.stdout)["status"] == "error"


def test_run_table_of_resnet18_matches_its_kernel_calls(compiled, tmp_path):
    """The rows are the module's kernel calls: each node of its onnx_subgraph
    call (metadata "subgraphs"), the bias/residual Adds and Relus fused into
    the convs and the dense, views left out; they add up to the total."""
    out = compiled("resnet18", kernels=True, cost_model="c7x-j722s")
    meta = json.loads((out / "metadata.json").read_text())
    ops = dict(meta["subgraphs"][0]["ops"])
    for fused_or_view in ("Add", "Relu", "Flatten", "Identity"):
        ops.pop(fused_or_view, None)
    np.save(tmp_path / "x.npy", np.random.default_rng(0).standard_normal((1, 3, 224, 224)).astype(np.float32))
    r = dspx("run", str(out), "-i", str(tmp_path / "x.npy"), "--cost-model", "c7x-j722s", "--json", env=_env())
    assert r.returncode == 0, r.stderr
    est = json.loads(r.stdout)["cost_estimate"]
    kernels = [row["kernel"] for row in est["layers"]]
    assert {k: kernels.count("onnx_subgraph:" + k) for k in ops} == ops == \
        {"Conv": 20, "MaxPool": 1, "GlobalAveragePool": 1, "MatMul": 1}
    assert len(kernels) == est["calls"] == sum(ops.values())
    assert sum(row["cycles"] for row in est["layers"]) == pytest.approx(est["total_cycles"])
    stem = est["layers"][0]  # 7x7 stride-2 conv, 3 -> 64 channels, 112x112 out
    assert stem["macs"] == 64 * 112 * 112 * 3 * 7 * 7
    assert est["profile"] == "c7x-j722s" and est["param_status"]["ddr_bandwidth_bytes_per_cycle"] == "assumed"
    text = dspx("run", str(out), "-i", str(tmp_path / "x.npy"), "--cost-model", "c7x-j722s", env=_env()).stdout
    table = text[text.index("ESTIMATE on c7x-j722s"):].splitlines()
    assert sum(1 for ln in table if "onnx_subgraph:" in ln) == len(kernels)


# ---------------------------------------------------------------- the LLM: compile-llm and generate

SMOLLM2 = {"name": "smollm2", "architecture": "llama", "n_layers": 30, "dim": 576, "n_heads": 9, "n_kv": 3,
           "head_dim": 64, "ffn": 1536, "vocab": 49152, "chunk": 64, "kv_dtype": "int8"}


def test_compile_llm_passes_the_cost_model_and_refuses_a_bad_one_first(monkeypatch):
    from click.testing import CliRunner

    import dspx.compiler.llm as llm_compiler
    from dspx.cli import main

    seen = {}

    def fake_build(gguf, outdir, **kw):
        seen.update(kw)
        return {"cost_estimate": {"profile": kw["cost_model"]}}
    monkeypatch.setattr(llm_compiler, "compile_llm", fake_build)
    r = CliRunner().invoke(main, ["compile-llm", "-o", "x", "--cost-model", "c7x-j722s", "--json"])
    assert r.exit_code == 0, r.output
    assert seen["cost_model"] == "c7x-j722s" and json.loads(r.stdout)["cost_estimate"]["profile"] == "c7x-j722s"
    seen.clear()
    r = CliRunner().invoke(main, ["compile-llm", "-o", "x", "--cost-model", "no-such-board"])
    assert r.exit_code == 1 and not seen and "no-such-board" in r.stderr and r.stderr.count("\n") == 1


class _FakeGenerator:
    """Generator's surface that `dspx generate` uses, over SmolLM2's dims (no model, no device)."""

    def __init__(self, **kw):
        self.llm = type("LLM", (), {"meta": {"model": SMOLLM2}})()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False

    def generate(self, prompt, max_tokens, on_text=None, **kw):
        from dspx.host.llm import GenerationResult

        return GenerationResult(prompt_tokens=3, ids=[1, 2], prefilled=3, text="hi", finish_reason="max_tokens",
                                prefill_s=0.1, decode_s=0.1, decode_tokens=2)


def test_generate_prints_the_estimated_tok_s_with_the_statistics(monkeypatch):
    from click.testing import CliRunner

    import dspx.host.llm
    from dspx.cli import main

    monkeypatch.setattr(dspx.host.llm, "Generator", _FakeGenerator)
    monkeypatch.delenv("DSPX_COST_MODEL", raising=False)
    r = CliRunner().invoke(main, ["generate", "hello", "--cost-model", "c7x-j722s"])
    assert r.exit_code == 0, r.output
    stats, est, assumed = r.stderr.splitlines()[-3:]
    assert stats.startswith("[3 prompt tokens")
    assert est.startswith("[ESTIMATE on c7x-j722s") and "prefill" in est and "decode" in est and "tok/s" in est
    assert "assumed:" in assumed and "DDR 12 B/cycle (assumed)" in assumed
    j = json.loads(CliRunner().invoke(main, ["generate", "hello", "--cost-model", "c7x-j722s", "--json"]).stdout)
    d = j["cost_estimate"]["decode"]
    # decode is bound by the weight bytes per token over DDR bandwidth: Q4_1 linear layers, the Q8_0 LM head
    L, dim, ffn, vocab, qkv = 30, 576, 1536, 49152, (9 + 2 * 3) * 64
    weights = L * (dim * qkv + dim * dim + dim * 2 * ffn + ffn * dim) * 20 / 32 + dim * vocab * 34 / 32
    bound = _c7x("ddr_bandwidth_bytes_per_cycle") * _c7x("clock_hz") / weights  # tok/s
    assert 0.8 * bound < d["tok_per_s"] < bound
    assert j["cost_estimate"]["prefill"]["tok_per_s"] > d["tok_per_s"] and j["cost_estimate"]["profile"] == "c7x-j722s"
    plain = CliRunner().invoke(main, ["generate", "hello"])
    assert plain.exit_code == 0 and "ESTIMATE" not in plain.stderr
    assert "cost_estimate" not in json.loads(CliRunner().invoke(main, ["generate", "hello", "--json"]).stdout)
    bad = CliRunner().invoke(main, ["generate", "hello", "--cost-model", "j6-vision"])
    assert bad.exit_code == 1 and "j6-vision" in bad.stderr and bad.stderr.count("\n") == 1


def test_info_of_an_llm_package_shows_its_recorded_tok_s(tmp_path):
    from dspx.costmodel import estimate

    est = estimate.module_estimate({"model": SMOLLM2}, "c7x-j722s")
    (tmp_path / "metadata.json").write_text(json.dumps({"format": "dspx-llm/1", "model": SMOLLM2, "modules": {},
                                                        "cost_estimate": est}))
    r = dspx("info", str(tmp_path), env=_env())
    assert r.returncode == 0, r.stderr
    head, assumed = [ln for ln in r.stdout.splitlines() if "ESTIMATE" in ln or "assumed:" in ln]
    assert "ESTIMATE on c7x-j722s" in head and f"decode {est['decode']['tok_per_s']:,.1f} tok/s" in head
    assert "prefill" in head and "per call 2,000 cycles (assumed)" in assumed
    assert json.loads(dspx("info", str(tmp_path), "--json", env=_env()).stdout)["cost_estimate"] == est
