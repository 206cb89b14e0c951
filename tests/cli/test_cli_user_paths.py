"""Issue 30's user mistakes on `dspx run`, `info`, `load-ops`, `unload-ops`,
`build-ops`, `generate` and `--trace`: each gets its one `error:` line (or
the user's file is kept), and what works is checked against numpy, the ONNX
graph itself and the compiler's own recorded decision."""
from __future__ import annotations

import collections
import json
import os
import subprocess
import sys

import numpy as np
import pytest
from click.testing import CliRunner

from conftest import CACHE


def dspx(*args, stdin=None):
    """The command in this process (click's runner): (exit code, stdout, stderr)."""
    from dspx.cli import main

    r = CliRunner().invoke(main, [str(a) for a in args], input=stdin)
    return r.exit_code, r.stdout, r.stderr


def one_error(code, out, err, *words, exit_code=1):
    lines = err.strip().splitlines()
    assert code == exit_code and len(lines) == 1 and lines[0].startswith("error: "), (code, out, err)
    assert "Traceback" not in out + err
    for w in words:
        assert w in lines[0], (w, lines[0])
    return lines[0]


@pytest.fixture(scope="module")
def mod(compiled):
    return compiled("multi_output")  # one input x float32[2, 32]; relu = max(x @ W, 0) first of 7 outputs


@pytest.fixture(scope="module")
def x():
    return np.random.default_rng(30).standard_normal((2, 32)).astype(np.float32)


def _weight():
    from onnx import numpy_helper

    from dspx.compiler import examples
    model = examples.multi_output_model()
    return numpy_helper.to_array(next(i for i in model.graph.initializer if i.name.startswith("w_")))


# ---------------------------------------------------------------- dspx run: inputs and outputs

def test_run_wrong_input_name_lists_the_inputs(mod, x, tmp_path):
    np.save(tmp_path / "x.npy", x)
    one_error(*dspx("run", mod, "-i", f"y={tmp_path / 'x.npy'}"), "no input 'y'", "inputs: x float32[2, 32]")


def test_run_takes_npz_inputs_by_name_and_in_order(mod, x, tmp_path, default_device):
    ref = np.maximum(x @ _weight(), 0)
    np.savez(tmp_path / "named.npz", x=x)
    np.savez(tmp_path / "positional.npz", x)  # arr_0
    for f in ("named.npz", "positional.npz"):
        code, out, err = dspx("run", mod, "-i", tmp_path / f, "-o", tmp_path / f"out-{f}", "--json",
                              "--socket", default_device.path)
        assert code == 0, err
        with np.load(tmp_path / f"out-{f}") as z:
            np.testing.assert_allclose(z["relu"], ref, atol=1e-4)
    np.savez(tmp_path / "odd.npz", a=x, b=x)
    one_error(*dspx("run", mod, "-i", tmp_path / "odd.npz"), "'a', 'b'", "no input's name", "x float32[2, 32]")


def test_run_byte_and_shape_mismatches_name_the_figures(mod, x, tmp_path):
    x[:1].tofile(tmp_path / "half.bin")  # 128 bytes, the input takes 2 * 32 * 4 = 256
    one_error(*dspx("run", mod, "-i", tmp_path / "half.bin"), "holds 128 bytes", "input 'x' float32[2, 32]",
              "takes 256 bytes")
    x.tofile(tmp_path / "x.bin")
    one_error(*dspx("run", mod, "-i", tmp_path / "x.bin", "--shape", "4,32"), "holds 256 bytes",
              "float32[4, 32]", "512 bytes", "input 'x' is float32[2, 32]")
    for bad in ("2,x", "2;32", "-1,32"):
        one_error(*dspx("run", mod, "-i", tmp_path / "x.bin", "--shape", bad), f"--shape {bad!r}", "integers")
    one_error(*dspx("run", mod, "-i", tmp_path / "x.bin", "--dtype", "flaot32"), "--dtype 'flaot32'")
    np.save(tmp_path / "wide.npy", x.astype(np.float64))
    one_error(*dspx("run", mod, "-i", tmp_path / "wide.npy"), "expects float32[2, 32]", "got float64[2, 32]")


def test_run_output_is_npz_or_npy_and_nothing_else_is_written(mod, x, tmp_path):
    np.save(tmp_path / "x.npy", x)
    one_error(*dspx("run", mod, "-i", tmp_path / "x.npy", "-o", tmp_path / "out.txt"), "out.txt", ".npz", ".npy")
    assert not (tmp_path / "out.txt").exists()


def test_run_print_shows_the_values(mod, x, tmp_path, default_device):
    np.save(tmp_path / "x.npy", x)
    code, out, err = dspx("run", mod, "-i", tmp_path / "x.npy", "--print", "--socket", default_device.path)
    assert code == 0, err
    lines = out.splitlines()
    assert "the module's first call, cold" in lines[1]  # one call, no warm-up to drop: said
    at = lines.index(next(ln for ln in lines if ln.split()[:2] == ["output", "argmax"]))
    assert lines[at].split()[2] == "int64[2]"
    assert lines[at + 1].strip() == np.array2string(np.argmax(x @ _weight(), axis=1), separator=", ")
    transposed = lines.index(next(ln for ln in lines if ln.split()[:2] == ["output", "transposed"]))
    assert any("..." in ln for ln in lines[transposed + 1:transposed + 12])  # 64 values: numpy's summary
    code, out, _ = dspx("run", mod, "-i", tmp_path / "x.npy", "--print", "--json", "--socket", default_device.path)
    relu = json.loads(out)["outputs"][0]
    assert relu["name"] == "relu"
    np.testing.assert_allclose(np.array(relu["values"], np.float32), np.maximum(x @ _weight(), 0), atol=1e-4)


def test_run_repeat_reports_the_warm_up_on_its_own(mod, x, tmp_path, default_device):
    np.save(tmp_path / "x.npy", x)
    code, out, err = dspx("run", mod, "-i", tmp_path / "x.npy", "--repeat", "4", "--json",
                          "--socket", default_device.path)
    assert code == 0, err
    rep = json.loads(out)["repeat"]
    assert rep["runs"] == 4 and len(rep["cycles"]) == 4 and rep["warmup_cycles"] > 0
    assert rep["min_ms"] == min(rep["cycles"]) / 1e6
    code, out, _ = dspx("run", mod, "-i", tmp_path / "x.npy", "--repeat", "2", "--socket", default_device.path)
    assert "2 run(s)" in out and "warm-up" in out and "not counted" in out


# ---------------------------------------------------------------- file types, on the host

def test_wrong_file_types_are_one_line_saying_what_to_do(example_onnx, tmp_path):
    onnx_path = example_onnx["multi_output"]
    one_error(*dspx("run", onnx_path, "-i", "x.npy"), "is an ONNX model", "dspx compile")
    one_error(*dspx("load-ops", onnx_path), "is an ONNX model", "dspx compile")
    bare = tmp_path / "model"  # no extension: told by its content
    with open(onnx_path, "rb") as f:
        bare.write_bytes(f.read())
    one_error(*dspx("run", bare, "-i", "x.npy"), "is an ONNX model")
    (tmp_path / "op.c").write_text("#include <dspx/dsp.h>\nint dspx_ops_init(void) { return 0; }\n")
    one_error(*dspx("load-ops", tmp_path / "op.c"), "C/C++ source", "dspx build-ops", "op.so")
    one_error(*dspx("build-ops", onnx_path, "-o", tmp_path / "x.so"), "ONNX model", "dspx compile")
    (tmp_path / "ops.py").write_text("x = 1\n")
    one_error(*dspx("build-ops", tmp_path / "ops.py", "-o", tmp_path / "x.so"), "dspx load-ops")
    (tmp_path / "notes.txt").write_text("hello\n")
    one_error(*dspx("build-ops", tmp_path / "notes.txt", "-o", tmp_path / "x.so"), "not C or C++ source")
    assert not (tmp_path / "x.so").exists()


def test_info_of_an_onnx_model_describes_it_and_what_dspx_offloads(example_onnx, compiled):
    import onnx

    path = example_onnx["resnet18"]
    code, out, err = dspx("info", path, "--json")
    assert code == 0, err
    info = json.loads(out)
    model = onnx.load(str(path))
    assert info["kind"] == "onnx" and info["opset"] == {"ai.onnx": model.opset_import[0].version}
    assert info["inputs"] == [{"name": "input", "dtype": "float32", "shape": [1, 3, 224, 224]}]
    assert info["outputs"] == [{"name": "logits", "dtype": "float32", "shape": [1, 1000]}]
    assert info["operators"] == dict(collections.Counter(n.op_type for n in model.graph.node))
    # what the compiler itself decided for this model (its metadata.json), by default with kernels
    recorded = json.loads((compiled("resnet18", kernels=True) / "metadata.json").read_text())["subgraphs"]
    assert info["offload"]["subgraph"] == recorded[0]
    code, out, _ = dspx("info", path)
    assert code == 0 and "onnx_subgraph" in out and "dspx compile" in out and "Conv 20" in out


# ---------------------------------------------------------------- unload-ops and the library list

LIB = """from dspx.device.core.runtime import register_op, Status

@register_op(0x3E31, latency_us=1)
def fill30(input, output, tm):
    output[:] = {value}
    return Status.SUCCESS
"""


def _fill(sock) -> int:
    from dspx.host.tasks import Tasks

    with Tasks(socket=sock) as ucp:
        inp, out = ucp.malloc(64), ucp.malloc(64)
        ucp.run(0x3E31, inp, out, timeout_ms=30_000)
        return int(out.vir[0])


def test_a_fixed_library_is_reloaded_without_restarting_the_device(tmp_path, default_device):
    from dspx.host.tasks import Tasks

    s = ("--socket", default_device.path)
    (tmp_path / "v1.py").write_text(LIB.format(value=1))
    (tmp_path / "v2.py").write_text(LIB.format(value=2))
    code, out, err = dspx("load-ops", tmp_path / "v1.py", "--json", *s)
    assert code == 0, err
    v1 = json.loads(out)["library"]
    code, out, _ = dspx("ops", "--libraries", *s)
    assert f"library {v1}: 0x3e31 fill30" in out.splitlines()
    one_error(*dspx("load-ops", tmp_path / "v2.py", *s), "ERR_BUSY", f"dspx unload-ops {v1}", "--replace")
    code, out, err = dspx("unload-ops", v1, *s)
    assert code == 0 and out.strip() == f"unloaded library {v1}", err
    one_error(*dspx("unload-ops", v1, *s), "ERR_HANDLE", f"no op library {v1}")
    assert dspx("load-ops", tmp_path / "v2.py", *s)[0] == 0
    code, out, err = dspx("load-ops", tmp_path / "v1.py", "--replace", "--json", *s)  # and back, in one step
    assert code == 0 and len(json.loads(out)["replaced"]) == 1, err
    assert _fill(default_device.path) == 1
    # A library a program still connected loaded is that program's: refused, naming it.
    with Tasks(socket=default_device.path) as other:
        held, _ = other.load_ops(LIB.format(value=3).replace("0x3E31", "0x3E32"))
        one_error(*dspx("unload-ops", held, *s), "ERR_HANDLE", "only that connection", str(os.getpid()))
        code, out, _ = dspx("unload-ops", "--all", "--json", *s)
        res = json.loads(out)
        assert code == 0 and [k["library"] for k in res["kept"]] == [held] and len(res["unloaded"]) >= 1
    assert 0x3E31 not in {o["cmd"] for o in json.loads(dspx("ops", "--json", *s)[1])["ops"]}


# ---------------------------------------------------------------- generate

@pytest.fixture(scope="module")
def llm_dir():
    from dspx.compiler.llm import compiled_dir
    return compiled_dir(cache_dir=CACHE, progress=False)


def test_generate_refuses_what_the_server_refuses_and_fixed_package_options(llm_dir):
    one_error(*dspx("generate", "hi", "-t", "-1"), "--temperature", "-1", exit_code=2)
    one_error(*dspx("generate", "hi", "--top-p", "1.5"), "--top-p", exit_code=2)
    meta = json.loads((llm_dir / "metadata.json").read_text())
    other = next(d for d in ("float32", "float16", "int8") if d != meta["kv"]["dtype"])
    one_error(*dspx("generate", "hi", "--model", llm_dir, "--kv-dtype", other, "--context", meta["context"]),
              f"--kv-dtype {other}", f"{meta['kv']['dtype']} KV cache", str(meta["context"]), exit_code=2)
    assert meta["model"]["decode_activations"] == "int8"  # the default package
    one_error(*dspx("generate", "hi", "--model", llm_dir, "--decode-activations", "float32"),
              "--decode-activations float32", "decode activations int8", exit_code=2)
    one_error(*dspx("serve-llm", "--model", llm_dir, "--decode-activations", "float32", "--port", "0"),
              "--decode-activations float32", "decode activations int8", exit_code=2)
    one_error(*dspx("generate", "-", stdin=""), "stdin", exit_code=2)


def test_generate_dash_reads_the_prompt_from_stdin(llm_dir, default_device):
    p = subprocess.run([sys.executable, "-m", "dspx.cli", "generate", "-", "--model", str(llm_dir), "--raw", "-n", "3",
                        "--json", "--socket", default_device.path], input="The capital of France is\n",
                       capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr
    res = json.loads(p.stdout)
    assert res["prompt_tokens"] > 1 and "Paris" in res["text"], res  # not the one token of a literal '-'


# ---------------------------------------------------------------- --trace leaves no parts behind

def test_trace_removes_its_parts_and_keeps_a_users_file(mod, x, tmp_path, default_device):
    np.save(tmp_path / "x.npy", x)
    env = {k: v for k, v in os.environ.items() if k not in ("DSPX_SOCKET", "DSPX_TRACE")}
    env["XDG_RUNTIME_DIR"] = str(tmp_path)  # no device there: a private one, traced too
    (tmp_path / "kept.json.parts").mkdir()
    (tmp_path / "kept.json.parts" / "notes.txt").write_text("mine\n")
    for name, where in (("out.json", ["--socket", default_device.path]), ("kept.json", [])):
        p = subprocess.run([sys.executable, "-m", "dspx.cli", "run", str(mod), "-i", str(tmp_path / "x.npy"),
                            "--trace", str(tmp_path / name), *where], capture_output=True, text=True, timeout=180,
                           env=env)
        assert p.returncode == 0, p.stderr
        assert ("the device does not trace" in p.stderr) is bool(where), p.stderr  # the shared one was not told to
        events = json.loads((tmp_path / name).read_text())["traceEvents"]
        assert "host" in {e["args"]["name"] for e in events if e.get("name") == "process_name"}
    assert not (tmp_path / "out.json.parts").exists()
    # the private device's parts and the host's are gone once merged; the user's file stays
    assert os.listdir(tmp_path / "kept.json.parts") == ["notes.txt"]
    assert (tmp_path / "kept.json.parts" / "notes.txt").read_text() == "mine\n"
