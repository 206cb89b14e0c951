"""The compiler: io_meta and signature symbols, metadata.json, weights files,
examples, errors, CLI.  Byte layouts are written out by hand from docs/compiler.md."""
from __future__ import annotations

import json

import numpy as np
import onnx
import pytest
from click.testing import CliRunner
from elftools.elf.elffile import ELFFile
from onnx import TensorProto, helper

from dspx.compiler import examples
from dspx.compiler import module as fmt
from dspx.compiler.onnx import CompileError, compile_onnx
from dspx.compiler.target import detect_mcpu, make_target


def _dynsyms(path) -> dict:
    with open(path, "rb") as f:
        elf = ELFFile(f)
        return {s.name: s for s in elf.get_section_by_name(".dynsym").iter_symbols() if s.name}


def _symbol_bytes(path, name: str) -> bytes:
    with open(path, "rb") as f:
        elf = ELFFile(f)
        sym = next(s for s in elf.get_section_by_name(".dynsym").iter_symbols() if s.name == name)
        sec = elf.get_section(sym["st_shndx"])
        f.seek(sec["sh_offset"] + sym["st_value"] - sec["sh_addr"])
        return f.read(sym["st_size"])


def test_io_meta_bytes_match_hand_layout(compiled):
    # multi_input: a,b (1,16) f32, c (4,4) f32, d (2,8) f32, e (16,) f32 = 64 B each,
    # idx (1,16) int64 = 128 B, s (1,) f16 = 2 B -> 64.  Descriptors 7 x 80 = 560 -> 576.
    # input_bytes = 576 + 5*64 + 128 + 64 = 1088; output y (1,16) f32: 128 + 64 = 192.
    expected = bytes.fromhex(
        "54494f4d"            # magic "TIOM" (0x4D4F4954 little endian)
        "01000000"            # version 1
        "07000000"            # num_inputs 7
        "01000000"            # num_outputs 1
        "4004000000000000"    # input_bytes 1088
        "c000000000000000"    # output_bytes 192
        "01000000"            # flags: bit 0 sizes exact
        "00000000")           # reserved
    assert len(expected) == 40
    so = compiled("multi_input") / "model.so"
    assert _symbol_bytes(so, "_binary_tvm_dsp_io_meta_start") == expected


def test_io_meta_spec_worked_example():
    kv = [fmt.TensorSpec(f"kv{i}", (1, 3, 256, 64), "float32") for i in range(60)]
    ins = [fmt.TensorSpec("ids", (1, 64), "int64"), fmt.TensorSpec("pos", (1, 64), "int64")] + kv
    outs = [fmt.TensorSpec("logits", (1, 64, 49152), "float32")] + kv
    meta = fmt.make_io_meta(ins, outs)
    assert (meta.input_bytes, meta.output_bytes) == (11_802_496, 24_384_320)


def test_objcopy_style_symbols(compiled):
    so = compiled("multi_output") / "model.so"
    syms = _dynsyms(so)
    for name, size in (("tvm_dsp_io_meta", 40), ("dspx_signature", None)):
        start, end, sz = (syms[f"_binary_{name}_{k}"] for k in ("start", "end", "size"))
        assert sz["st_shndx"] == "SHN_ABS"
        assert end["st_value"] - start["st_value"] == sz["st_value"] == start["st_size"]
        if size:
            assert sz["st_value"] == size
    sig = json.loads(_symbol_bytes(so, "_binary_dspx_signature_start"))
    assert sig["format"] == "dspx-signature/1"
    assert sig["entry"] == "main"
    assert [t["name"] for t in sig["outputs"]] == ["relu", "softmax", "argmax", "rowsum", "transposed",
                                                   "scaled", "tanh"]
    assert sig["outputs"][2] == {"name": "argmax", "shape": [2], "dtype": "int64"}
    assert sig["kernel_imports"] == []
    assert sig["weights"] == "embedded" and sig["weights_digest"] is None
    assert sig["workspace_bytes"] >= 2 * 24 * 4  # at least the matmul result lives in workspace


def test_metadata_json(compiled):
    out = compiled("multi_input", separate=True)
    meta = json.loads((out / "metadata.json").read_text())
    assert meta["entry"] == "main" and meta["module"] == "model.so"
    assert [t["name"] for t in meta["inputs"]] == ["a", "b", "c", "d", "e", "idx", "s"]
    assert meta["inputs"][5] == {"name": "idx", "shape": [1, 16], "dtype": "int64", "nbytes": 128}
    assert meta["inputs"][6] == {"name": "s", "shape": [1], "dtype": "float16", "nbytes": 2}
    assert meta["outputs"] == [{"name": "y", "shape": [1, 16], "dtype": "float32", "nbytes": 64}]
    assert meta["io"] == {"num_inputs": 7, "num_outputs": 1, "input_bytes": 1088, "output_bytes": 192, "flags": 1}
    assert meta["io_reserve"] is None
    w = meta["weights"]
    assert w["mode"] == "separate" and w["file"] == "weights.bin" and w["count"] == 1
    assert w["digest"] == fmt.read_weights((out / "weights.bin").read_bytes()).digest
    assert meta["kernel_imports"] == []
    assert meta["target"]["kind"] == "llvm" and meta["target"]["mtriple"] == "x86_64-linux-gnu"
    assert meta["target"]["mcpu"] not in ("native", "generic")
    assert meta["tvm_version"]


def test_target_detection():
    t = make_target("native")
    assert t["mcpu"] == detect_mcpu() and t["mcpu"] not in ("", "native", "generic")
    assert t["num-cores"] >= 1
    assert make_target()["mcpu"] == "x86-64-v3"  # the portable default (this machine has AVX2)


def test_weights_file_roundtrip_and_layout():
    a = np.arange(12, dtype=np.float32).reshape(3, 4)
    b = np.array([1, -2, 3], dtype=np.int64)
    data = fmt.encode_weights([("conv.w", a), ("b", b)])
    assert data[:8] == b"DSPXWTS\0"
    assert int.from_bytes(data[8:12], "little") == 1 and int.from_bytes(data[12:16], "little") == 2
    header = int.from_bytes(data[16:24], "little")
    assert header % 64 == 0 and len(data) == header + int.from_bytes(data[24:32], "little")
    w = fmt.read_weights(data)
    assert [t.name for t in w.tensors] == ["conv.w", "b"]
    np.testing.assert_array_equal(w.tensors[0].array, a)
    np.testing.assert_array_equal(w.tensors[1].array, b)
    payload = np.frombuffer(data, np.uint8).ctypes.data + header
    assert [t.array.ctypes.data - payload for t in w.tensors] == [0, 64]  # zero-copy, 64-aligned
    assert w.digest.startswith("sha256:")


@pytest.mark.parametrize("damage, message", [
    (lambda d: d[:40], "shorter than"),
    (lambda d: d[:-1], "truncated"),
    (lambda d: d + b"\0", "truncated or padded"),
    (lambda d: b"NOTWEIGH" + d[8:], "not a dspx weights file"),
    (lambda d: d[:8] + (9).to_bytes(4, "little") + d[12:], "version 9"),
    (lambda d: d[:-3] + bytes([d[-3] ^ 0xFF]) + d[-2:], "digest"),
])
def test_weights_file_damage(damage, message):
    data = fmt.encode_weights([("w", np.ones((8, 8), np.float32))])
    with pytest.raises(fmt.WeightsError, match=message):
        fmt.read_weights(damage(data))


def test_examples_are_deterministic(tmp_path):
    a = examples.multi_output(tmp_path / "a.onnx").read_bytes()
    b = examples.multi_output(tmp_path / "b.onnx").read_bytes()
    assert a == b


def test_example_shapes(example_onnx):
    r = onnx.load(example_onnx["resnet18"], load_external_data=False).graph
    assert [d.dim_value for d in r.input[0].type.tensor_type.shape.dim] == [1, 3, 224, 224]
    assert sum(n.op_type == "Conv" for n in r.node) == 20  # 1 stem + 16 block + 3 downsample
    mi = onnx.load(example_onnx["multi_input"]).graph
    assert len(mi.input) >= 6 and TensorProto.INT64 in {i.type.tensor_type.elem_type for i in mi.input}
    assert len(onnx.load(example_onnx["multi_output"]).graph.output) >= 6


def test_unsupported_operator_is_named(tmp_path):
    g = helper.make_graph([helper.make_node("Det", ["x"], ["d"]), helper.make_node("Relu", ["d"], ["y"])], "g",
                          [helper.make_tensor_value_info("x", TensorProto.FLOAT, [3, 3])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, [])])
    path = tmp_path / "det.onnx"
    onnx.save(helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)]), path)
    with pytest.raises(CompileError, match="Det") as e:
        compile_onnx(path, tmp_path / "out", progress=False, verify=False)
    assert e.value.operators == ["Det"]


def test_verification_needs_a_verifier(tmp_path):
    # the compiler starts no device of its own: whoever asks for verification says what runs the module
    with pytest.raises(CompileError, match="verify=True needs a verifier"):
        compile_onnx(tmp_path / "never-read.onnx", tmp_path / "out", progress=False)


def test_dynamic_shape_refused(tmp_path):
    g = helper.make_graph([helper.make_node("Relu", ["x"], ["y"])], "g",
                          [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 4])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", 4])])
    path = tmp_path / "dyn.onnx"
    onnx.save(helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)]), path)
    with pytest.raises(CompileError, match="dynamic shape"):
        compile_onnx(path, tmp_path / "out", progress=False, verify=False)


def test_cli_compile(example_onnx, tmp_path):
    from dspx.cli import main

    r = CliRunner().invoke(main, ["compile", str(example_onnx["multi_output"]), "-o", str(tmp_path / "m"),
                                  "--separate-weights", "--no-kernels", "--json"])
    assert r.exit_code == 0, r.output
    out = json.loads(r.stdout)
    assert out["status"] == "ok" and out["weights"]["mode"] == "separate"
    assert {p.name for p in (tmp_path / "m").iterdir()} == {"model.so", "metadata.json", "weights.bin"}
    r = CliRunner().invoke(main, ["compile", str(example_onnx["multi_output"]), "-o", str(tmp_path / "h"),
                                  "--no-kernels"])
    assert r.exit_code == 0 and "outputs   relu float32[2, 24]" in r.stdout


# ---------------------------------------------------------------- verification, errors, shapes, target

@pytest.fixture(scope="module")
def verifier():
    """One private device for every verification in this file (its core stays warm)."""
    from dspx.host.verifier import DeviceVerifier

    with DeviceVerifier() as v:
        yield v

def _save(tmp_path, nodes, inputs, outputs, inits=(), name="m.onnx", opset=17):
    g = helper.make_graph(nodes, "g", inputs, outputs, list(inits))
    path = tmp_path / name
    onnx.save(helper.make_model(g, opset_imports=[helper.make_opsetid("", opset)]), path)
    return path


def _relu_conv(tmp_path):
    rng = np.random.default_rng(0)
    w = onnx.numpy_helper.from_array(rng.standard_normal((16, 3, 3, 3)).astype(np.float32), "w")
    return _save(tmp_path, [helper.make_node("Conv", ["x", "w"], ["c"], pads=[1, 1, 1, 1]),
                            helper.make_node("Relu", ["c"], ["y"])],
                 [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 3, 8, 8])],
                 [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 16, 8, 8])], [w])


def test_verification_passes_and_is_recorded(tmp_path, verifier):
    meta = compile_onnx(_relu_conv(tmp_path), tmp_path / "out", progress=False, verifier=verifier)
    v = meta["verify"]
    assert v["reference"] == "onnxruntime" and v["max_abs_error"]["y"] <= 1e-4
    assert json.loads((tmp_path / "out" / "metadata.json").read_text())["verify"] == v


def test_verification_catches_a_wrong_module(tmp_path, monkeypatch, verifier):
    # A compiler bug: the rewrite drops the ReLU after the convolution (act code 0).
    # The module then runs on the device, and only the reference can tell.
    from dspx.compiler import kernel_rewrite

    real = kernel_rewrite._Matcher.match_conv

    def no_relu(self, var):
        p = real(self, var)
        if p is not None:
            p.args[-1] = kernel_rewrite._i(kernel_rewrite.ACT_NONE)
        return p

    monkeypatch.setattr(kernel_rewrite._Matcher, "match_conv", no_relu)
    with pytest.raises(CompileError, match=r"verification failed: output 'y' differs from onnxruntime"):
        compile_onnx(_relu_conv(tmp_path), tmp_path / "out", kernels=True, progress=False, verifier=verifier,
                     subgraph=False)
    # --no-verify keeps the (wrong) module
    meta = compile_onnx(_relu_conv(tmp_path), tmp_path / "out2", kernels=True, progress=False, verify=False,
                        subgraph=False)
    assert meta["verify"] is None


def test_tvm_reference_when_onnxruntime_cannot_run(tmp_path, verifier):
    # PyTorch-style per-channel PReLU (slope (C,) on NCHW): strict ONNX broadcasting
    # refuses it, onnxruntime too; dspx compiles it per channel and verifies
    # against TVM's own unoptimized build.
    slope = np.array([0.1, 0.5, 2.0], np.float32)
    path = _save(tmp_path, [helper.make_node("PRelu", ["x", "s"], ["y"], name="act")],
                 [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3, 4, 5])],
                 [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 3, 4, 5])],
                 [onnx.numpy_helper.from_array(slope, "s")])
    meta = compile_onnx(path, tmp_path / "out", progress=False, verifier=verifier)
    assert meta["verify"]["reference"] == "tvm-unoptimized"
    from dspx.compiler.verify import random_inputs

    x = random_inputs(meta["inputs"], seed=3)[0]
    y = verifier.run(tmp_path / "out", [x])[0]
    want = np.where(x < 0, x * slope.reshape(1, 3, 1, 1), x)
    np.testing.assert_allclose(y, want, rtol=1e-6)


@pytest.mark.parametrize("build, message", [
    (lambda: ([helper.make_node("Relu", ["x"], ["y"])],
              [helper.make_tensor_value_info("x", TensorProto.STRING, [2])],
              [helper.make_tensor_value_info("y", TensorProto.STRING, [2])]),
     "graph input 'x' is a string tensor: the device has no strings"),
    (lambda: ([helper.make_node("Gradient", ["x"], ["g"], name="grad", domain="ai.onnx.preview.training",
                                xs=["x"], y="x")],
              [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2])],
              [helper.make_tensor_value_info("g", TensorProto.FLOAT, [2])]),
     "node 'grad' (Gradient) is a training operator"),
    (lambda: ([helper.make_node("SequenceConstruct", ["x"], ["s"], name="seq")],
              [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2])],
              [helper.make_tensor_sequence_value_info("s", TensorProto.FLOAT, [2])]),
     "graph output 's' is a sequence, not a tensor"),
    (lambda: ([helper.make_node("Expand", ["x", "shape"], ["y"], name="grow")],
              [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 3, 1]),
               helper.make_tensor_value_info("shape", TensorProto.INT64, [2])],
              [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)]),
     "node 'grow' (Expand): TVM cannot convert it"),
])
def test_failures_are_one_line_naming_the_cause(tmp_path, build, message, verifier):
    nodes, ins, outs = build()
    path = _save(tmp_path, nodes, ins, outs)
    with pytest.raises(CompileError) as e:
        compile_onnx(path, tmp_path / "out", progress=False, verifier=verifier)
    text = str(e.value)
    assert message in text and "\n" not in text, text


def test_shape_and_dim_options(tmp_path, verifier):
    from dspx.cli import main

    path = _save(tmp_path, [helper.make_node("MatMul", ["a", "b"], ["y"])],
                 [helper.make_tensor_value_info("a", TensorProto.FLOAT, ["N", 4]),
                  helper.make_tensor_value_info("b", TensorProto.FLOAT, [4, "M"])],
                 [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", "M"])])
    with pytest.raises(CompileError, match=r"input 'a' has a dynamic shape \[N,4\].*--dim N=VALUE"):
        compile_onnx(path, tmp_path / "o0", progress=False, verifier=verifier)
    r = CliRunner().invoke(main, ["compile", str(path), "-o", str(tmp_path / "o1"), "--dim", "N=3",
                                  "--shape", "b=4,5", "--json"])
    assert r.exit_code == 0, r.output
    out = json.loads(r.stdout)
    assert out["inputs"][0]["shape"] == [3, 4] and out["outputs"] == [
        {"name": "y", "shape": [3, 5], "dtype": "float32", "nbytes": 60}]
    r = CliRunner().invoke(main, ["compile", str(path), "-o", str(tmp_path / "o2"), "--dim", "Q=3", "--json"])
    assert r.exit_code == 1 and "--dim names Q, not a symbolic dimension" in r.stdout
    r = CliRunner().invoke(main, ["compile", str(path), "-o", str(tmp_path / "o3"), "--shape", "a=3,5"])
    assert r.exit_code == 1 and "dimension 1 is fixed at 4 in the model, not 5" in r.output


def test_target_recorded_and_checked_by_the_loader(tmp_path, device, client_of, verifier):
    from dspx.errors import ModuleLoadError

    path = _relu_conv(tmp_path)
    meta = compile_onnx(path, tmp_path / "v3", progress=False, target="x86-64-v3", verifier=verifier)
    assert meta["target"]["mcpu"] == "x86-64-v3" and "avx2" in meta["cpu_features"]
    assert "avx512f" not in meta["cpu_features"]
    # A CPU with features this machine lacks: not verifiable here, refused by the loader.
    from dspx.compiler.target import cpu_features
    from dspx.device.core.cpu import missing_features

    # AMD's sse4a on an Intel machine, Intel's avx512_fp16/AMX on an AMD one, AVX-512 on an older one
    lacking = next((cpu, missing_features(cpu_features(cpu))[0])
                   for cpu in ("znver4", "sapphirerapids", "x86-64-v4") if missing_features(cpu_features(cpu)))
    meta = compile_onnx(path, tmp_path / "foreign", progress=False, target=lacking[0], verifier=verifier)
    assert meta["verify"]["skipped"].startswith("this machine lacks")
    c = client_of(device.path, staging_size=8 << 20)
    with pytest.raises(ModuleLoadError, match=rf"needs .*{lacking[1]}.*which this device's CPU lacks"):
        c.load_module((tmp_path / "foreign" / "model.so").read_bytes())
    c.load_module((tmp_path / "v3" / "model.so").read_bytes())  # the portable one loads
    with pytest.raises(CompileError, match="unknown --target 'pentium9'"):
        compile_onnx(path, tmp_path / "bad", progress=False, target="pentium9", verifier=verifier)


def test_batchnorm_folded_and_sum_fused_into_the_conv_kernel(tmp_path, verifier):
    # Conv -> BatchNormalization -> Sum(residual) -> Relu, as Caffe2/old exporters write ResNets:
    # one conv2d_add kernel call, matching onnxruntime on the unfolded graph.
    rng = np.random.default_rng(2)
    arr = onnx.numpy_helper.from_array
    inits = [arr(rng.standard_normal((8, 8, 3, 3)).astype(np.float32) * 0.2, "w"),
             arr(rng.uniform(0.5, 1.5, 8).astype(np.float32), "g"), arr(rng.uniform(-1, 1, 8).astype(np.float32), "b"),
             arr(rng.uniform(-1, 1, 8).astype(np.float32), "m"), arr(rng.uniform(0.5, 2, 8).astype(np.float32), "v")]
    path = _save(tmp_path, [helper.make_node("Conv", ["x", "w"], ["c"], pads=[1, 1, 1, 1]),
                            helper.make_node("BatchNormalization", ["c", "g", "b", "m", "v"], ["n"], epsilon=1e-3),
                            helper.make_node("Sum", ["n", "x"], ["s"]),
                            helper.make_node("Relu", ["s"], ["y"])],
                 [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 8, 6, 6])],
                 [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 8, 6, 6])], inits)
    meta = compile_onnx(path, tmp_path / "out", progress=False, verifier=verifier, subgraph=False)
    assert meta["kernel_imports"] == ["dspx.kernels.conv2d_add"]
    assert meta["verify"]["reference"] == "onnxruntime" and meta["verify"]["max_abs_error"]["y"] < 1e-4
