"""``dspx info`` against independent readings of the same files (nm, the
metadata written by the compiler, a GGUF written here with gguf's writer) and
``dspx devices`` against devices started here."""
from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys

import numpy as np

from conftest import SMALL, Device

DSPX = [sys.executable, "-m", "dspx.cli"]


def dspx(*args, env=None):
    r = subprocess.run([*DSPX, *map(str, args)], capture_output=True, text=True, timeout=60,
                       env={**os.environ, **(env or {})})
    assert r.returncode == 0 and "Traceback" not in r.stderr, r.stderr
    return r.stdout


def _nm_imports(so) -> list[str]:
    out = subprocess.run(["nm", "-D", "--undefined-only", str(so)], capture_output=True, text=True, check=True).stdout
    return sorted({ln.split()[-1].split("@")[0] for ln in out.splitlines() if ln.split()[0] == "U"})


def test_info_of_a_module(compiled):
    d = compiled("multi_output", separate=True)
    meta = json.loads((d / "metadata.json").read_text())
    info = json.loads(dspx("info", d, "--json"))
    assert info["kind"] == "module" and info["imports"] == _nm_imports(d / "model.so")
    assert "expf" in info["imports"]
    io = meta["io"]
    assert info["io_meta"] == {"num_inputs": io["num_inputs"], "num_outputs": io["num_outputs"],
                               "input_bytes": io["input_bytes"], "output_bytes": io["output_bytes"],
                               "exact": bool(io["flags"] & 1)}
    assert [t["name"] for t in info["outputs"]] == [t["name"] for t in meta["outputs"]]
    assert info["inputs"] == [{"name": "x", "dtype": "float32", "shape": [2, 32]}]
    assert info["weights"] == {"mode": "separate", "file": "weights.bin", "count": meta["weights"]["count"],
                               "bytes": (d / "weights.bin").stat().st_size}
    assert info["target_cpu"] == meta["target"]["mcpu"]
    text = dspx("info", d / "model.so")
    assert "inputs     x float32[2, 32]" in text and f"for CPU {meta['target']['mcpu']}" in text
    assert "weights    separate: weights.bin" in text and "expf" in text


def test_info_of_an_llm_package(compiled, tmp_path):
    """A package laid out as compile-llm writes it (a small module stands in
    for prefill.so): context, KV layout and chat template come from its metadata."""
    d = compiled("multi_output")
    shutil.copy(d / "model.so", tmp_path / "prefill.so")
    mod = json.loads((d / "metadata.json").read_text())
    kv = {"order": "k0, v0", "shape": [1, 3, 256, 64], "dtype": "float32", "tensor_bytes": 196608, "count": 2,
          "total_bytes": 393216, "tensors": [{"name": "k0"}, {"name": "v0"}]}
    (tmp_path / "metadata.json").write_text(json.dumps({
        "format": "dspx-llm/1", "model": {"name": "tiny", "architecture": "llama", "n_layers": 1},
        "tokenizer": {"source": "gguf", "chat_template": "tokenizer.chat_template"}, "context": 256,
        "prefill_chunk": 64, "kv": kv, "weights": {"file": "weights.bin", "bytes": 123, "count": 4, "storage": "f32"},
        "compiler": {"target": {"mcpu": "x86-64"}}, "modules": {"prefill": {**mod, "module": "prefill.so"}}}))
    info = json.loads(dspx("info", tmp_path, "--json"))
    assert info["kind"] == "llm" and info["context"] == 256 and info["target_cpu"] == "x86-64"
    assert info["kv"] == {k: v for k, v in kv.items() if k != "tensors"}
    assert info["chat_template"] == "tokenizer.chat_template"
    assert info["modules"]["prefill"]["imports"] == _nm_imports(tmp_path / "prefill.so")
    text = dspx("info", tmp_path)
    assert "context    256 tokens" in text and "KV cache   2 tensors float32[1, 3, 256, 64]" in text


def test_info_of_a_gguf(tmp_path):
    import gguf  # the llm extra
    path = tmp_path / "tiny.gguf"
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_name("tiny test")
    w.add_context_length(128)
    w.add_block_count(2)
    w.add_embedding_length(8)
    w.add_head_count(2)
    w.add_head_count_kv(1)
    w.add_chat_template("{% for m in messages %}{{ m.content }}{% endfor %}")
    w.add_tensor("tok_embd.weight", np.zeros((4, 8), np.float32))
    w.add_tensor("out.weight", np.zeros((4, 8), np.float16))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    info = json.loads(dspx("info", path, "--json"))
    assert (info["kind"], info["name"], info["architecture"], info["context_length"], info["layers"]) == \
        ("gguf", "tiny test", "llama", 128, 2)
    assert (info["heads"], info["kv_heads"], info["tensors"]) == (2, 1, 2)
    assert info["tensor_types"] == {"F32": 1, "F16": 1} and info["weights_bytes"] == 4 * 8 * 4 + 4 * 8 * 2
    assert info["chat_template"] == "{% for m in messages %}{{ m.content }}{% endfor %}"


def test_devices_lists_running_and_stale(tmp_path):
    rt = tmp_path / "rt"
    user_dir = rt / f"dspx-{os.getuid()}"
    user_dir.mkdir(parents=True, mode=0o700)
    stale = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    stale.bind(str(user_dir / "dead.sock"))  # bound, never listening: what a killed device leaves
    stale.close()
    dev = Device(*SMALL, "--cores", "2")
    other = str(user_dir / "dsp0.sock")
    try:
        env = {"XDG_RUNTIME_DIR": str(rt), "DSPX_SOCKET": dev.path}
        out = json.loads(dspx("devices", "--json", env=env))["devices"]
        by_path = {d["socket"]: d for d in out}
        mine = by_path[dev.path]
        assert (mine["state"], mine["found_by"], mine["cores"], mine["version"]) == ("running", "$DSPX_SOCKET", 2,
                                                                                      "3.0.0")
        assert mine["carveout_total"] == 64 << 20 and mine["ddr_total"] == 64 << 20 and mine["uptime_ms"] > 0
        assert by_path[str(user_dir / "dead.sock")]["state"] == "stale"
        assert other not in by_path  # no file there: not listed
        text = dspx("devices", env=env)
        assert f"{dev.path}  device 3.0.0, 2 core(s)" in text and "dead.sock  stale" in text
    finally:
        dev.stop()
