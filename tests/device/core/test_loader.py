"""DLOAD in-process: ELF checks, export table, kernel imports, weights,
zero-copy inputs, outputs against onnxruntime, unload without leaks, a module
entry that raises (ERR_CALL); and through a device, a module that crashes
the loader, which costs only the forked probe child."""
from __future__ import annotations

import json
import os
import re
import subprocess

import numpy as np
import onnxruntime as ort
import psutil
import pytest

from dspx.device.core import exports, loader
from dspx.device.core.errors import LoadError, NoMemError, SymbolError, TensorError, WeightsError
from dspx.abi.protocol import Status
from dspx.errors import ModuleLoadError

TOL = 1e-4


def _inputs(sig, seed=0) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    out = []
    for t in sig.inputs:
        if np.issubdtype(np.dtype(t.dtype), np.integer):
            out.append(rng.integers(-3, 4, t.shape).astype(t.dtype))
        else:
            out.append(rng.standard_normal(t.shape).astype(t.dtype))
    return out


def _ort_session(path) -> ort.InferenceSession:
    # Once the kernel library has set up onnxruntime's process-wide pool, every
    # session must be created on it.
    try:
        from dspx.device.core.kernels import ort_session_options
    except ImportError:
        return ort.InferenceSession(str(path))
    return ort.InferenceSession(str(path), ort_session_options())


def _check_against_ort(mod, onnx_path, inputs, weights=None):
    outs = mod.run(inputs, weights)
    ref = _ort_session(onnx_path).run(None, {t.name: a for t, a in zip(mod.signature.inputs, inputs)})
    assert len(outs) == len(ref) == len(mod.signature.outputs)
    for o, r, spec in zip(outs, ref, mod.signature.outputs):
        assert o.shape == r.shape == spec.shape and o.dtype == r.dtype, spec.name
        np.testing.assert_allclose(o, r, rtol=0, atol=TOL, err_msg=spec.name)


def _load(directory, kernel_names=frozenset()):
    return loader.load_module((directory / "model.so").read_bytes(), kernel_names)


def _kernel_library():
    from dspx.device.core import kernels
    kernels.register_all()
    return kernels.names()


@pytest.mark.parametrize("name", ["multi_input", "multi_output", "resnet18"])
def test_examples_match_onnxruntime(name, compiled, example_onnx):
    mod = _load(compiled(name))
    assert mod.entry == "main" and mod.text_size > 0 and mod.data_size > 0
    assert mod.io_meta.num_inputs == len(mod.signature.inputs)
    _check_against_ort(mod, example_onnx[name], _inputs(mod.signature))
    mod.unload()


@pytest.mark.parametrize("name", ["multi_input", "multi_output"])
def test_separate_weights_match_onnxruntime(name, compiled, example_onnx):
    out = compiled(name, separate=True)
    mod = _load(out)
    assert mod.signature.weights == "separate"
    data = (out / "weights.bin").read_bytes()
    inputs = _inputs(mod.signature, seed=1)
    _check_against_ort(mod, example_onnx[name], inputs, loader.parse_weights(data))  # a MODEL_LOAD slot
    assert mod.set_weights(data) == mod.signature.num_weights  # the module's own weights
    _check_against_ort(mod, example_onnx[name], inputs)
    mod.unload()


def test_resnet18_with_kernels_and_separate_weights(compiled, example_onnx):
    names = _kernel_library()
    out = compiled("resnet18", separate=True, kernels=True)
    mod = _load(out, names)
    assert set(mod.signature.kernel_imports) <= names and mod.signature.kernel_imports
    mod.set_weights((out / "weights.bin").read_bytes())
    _check_against_ort(mod, example_onnx["resnet18"], _inputs(mod.signature))
    mod.unload()


def test_modules_loaded_together_stay_apart(compiled, example_onnx):
    # Each module must get its own library even when loads and unloads interleave.
    a = _load(compiled("multi_input"))
    b = _load(compiled("multi_output"))
    a.unload()
    c = _load(compiled("multi_input", separate=True))
    c.set_weights((compiled("multi_input", separate=True) / "weights.bin").read_bytes())
    _check_against_ort(b, example_onnx["multi_output"], _inputs(b.signature))
    _check_against_ort(c, example_onnx["multi_input"], _inputs(c.signature))
    b.unload()
    c.unload()


def test_module_without_dspx_blobs(tmp_path):
    # A plain TVM export: no io_meta ("no metadata", not an error), no signature.
    import tvm
    from tvm.script import relax as R

    @tvm.script.ir_module
    class Add:
        @R.function
        def main(x: R.Tensor((4,), "float32"), y: R.Tensor((4,), "float32")):
            return R.add(x, y)

    tvm.compile(Add, "llvm").export_library(str(tmp_path / "add.so"))
    mod = loader.load_module((tmp_path / "add.so").read_bytes())
    assert mod.io_meta is None and mod.signature is None and mod.entry == "main"
    assert loader.describe(mod)["io_meta"] is None
    x = np.arange(4, dtype=np.float32)
    np.testing.assert_array_equal(mod.run([x, x])[0], 2 * x)
    mod.unload()


def test_describe(compiled):
    mod = _load(compiled("multi_output"))
    d = loader.describe(mod)
    assert d["io_meta"] == {"num_inputs": 1, "num_outputs": 7, "input_bytes": 384, "output_bytes": 1792, "flags": 1}
    assert d["signature"]["weights"] == "embedded" and d["text_size"] == mod.text_size
    assert d["workspace_bytes"] == mod.signature.workspace_bytes
    mod.unload()


def test_zero_copy_inputs():
    buf = np.empty(4096 + 64, np.uint8)
    skip = -buf.ctypes.data % 64
    aligned = buf[skip:skip + 4096].view(np.float32).reshape(32, 32)
    t, zero_copy = loader.as_tensor(aligned)
    assert zero_copy and np.from_dlpack(t).ctypes.data == aligned.ctypes.data
    unaligned = buf[skip + 4:skip + 4 + 4032].view(np.float32)
    t, zero_copy = loader.as_tensor(unaligned)
    copied = np.from_dlpack(t)
    assert not zero_copy
    assert copied.ctypes.data % 64 == 0 and copied.ctypes.data != unaligned.ctypes.data
    np.testing.assert_array_equal(copied, unaligned)


def test_no_fd_or_thread_left_behind(compiled):
    data = (compiled("multi_output") / "model.so").read_bytes()
    fds, threads = set(os.listdir("/proc/self/fd")), len(os.listdir("/proc/self/task"))
    mod = loader.load_module(data)
    mod.run(_inputs(mod.signature))
    assert len(os.listdir("/proc/self/task")) == threads  # the core's thread budget is not ours to grow
    mod.unload()
    assert set(os.listdir("/proc/self/fd")) == fds
    assert not any("dspx-module" in line for line in open("/proc/self/maps"))


# ---------------------------------------------------------------- refusals

def _gcc_so(tmp_path, source: str) -> bytes:
    src, so = tmp_path / "m.c", tmp_path / "m.so"
    src.write_text(source)
    subprocess.run(["gcc", "-shared", "-fPIC", "-o", str(so), str(src)], check=True)
    return so.read_bytes()


def _patched(data: bytes, offset: int, value: bytes) -> bytes:
    return data[:offset] + value + data[offset + len(value):]


@pytest.fixture(scope="module")
def good_elf(compiled) -> bytes:
    return (compiled("multi_output") / "model.so").read_bytes()


@pytest.mark.parametrize("mutate, message", [
    (lambda d: b"MZ\x90\x00" + d[4:], "not an ELF file"),
    (lambda d: b"", "not an ELF file"),
    (lambda d: _patched(d, 4, b"\x01"), "ELFCLASS32"),
    (lambda d: _patched(d, 5, b"\x02"), "not little endian"),
    (lambda d: _patched(d, 18, (183).to_bytes(2, "little")), "ELF for machine EM_AARCH64, this device is EM_X86_64"),
    (lambda d: _patched(d, 16, (2).to_bytes(2, "little")), "ET_EXEC"),
    (lambda d: d[:len(d) // 3], "malformed ELF"),
    (lambda d: d.replace(b"TIOM\x01\0\0\0", b"XIOM\x01\0\0\0", 1), "io_meta magic"),
    (lambda d: d.replace(b'"format":"dspx-signature/1"', b'"format":"dspx-signature/9"', 1), "dspx-signature/9"),
])
def test_bad_elf_is_load_error(good_elf, mutate, message):
    with pytest.raises(LoadError, match=message) as e:
        loader.load_module(mutate(good_elf))
    assert e.value.status == Status.ERR_LOAD


def test_import_outside_export_table(tmp_path):
    elf = _gcc_so(tmp_path, '#include <stdlib.h>\nint run(void) { return system("true"); }\n')
    with pytest.raises(SymbolError, match="'system'") as e:
        loader.load_module(elf)
    assert e.value.symbol == "system" and e.value.status == Status.ERR_SYMBOL


def test_missing_entry(tmp_path):
    elf = _gcc_so(tmp_path, "int add1(int x) { return x + 1; }\n")
    with pytest.raises(SymbolError, match=loader.ENTRY_SYMBOL) as e:
        loader.load_module(elf)
    assert e.value.symbol == loader.ENTRY_SYMBOL


def test_kernel_import_not_exported(compiled):
    _kernel_library()
    out = compiled("multi_output", kernels=True, op_by_op=True)
    sig = _load(out, {"dspx.kernels.dense", "dspx.kernels.softmax"}).signature
    assert sig.kernel_imports
    with pytest.raises(SymbolError, match=sig.kernel_imports[0]) as e:
        _load(out, set(sig.kernel_imports[1:]))
    assert e.value.symbol == sig.kernel_imports[0]


def test_ddr_pool_too_small(good_elf):
    with pytest.raises(NoMemError) as e:
        loader.load_module(good_elf, ddr_free=4096, ddr_total=8192)
    assert e.value.status == Status.ERR_NOMEM
    assert e.value.oom_requested > 4096 and (e.value.oom_free, e.value.oom_total) == (4096, 8192)


def test_export_table():
    assert exports.check_imports(["TVMFFIErrorSetRaisedFromCStrParts", "expf", "memset", "__cxa_finalize",
                                  "TVMBackendAllocWorkspace"]) is None
    assert exports.check_imports(["expf", "system", "fork"]) == "system"


def test_weights_refused(compiled):
    sep = compiled("multi_output", separate=True)
    mod = _load(sep)
    data = (sep / "weights.bin").read_bytes()
    with pytest.raises(WeightsError) as e:
        mod.run(_inputs(mod.signature))
    assert e.value.status == Status.ERR_WEIGHTS
    assert str(e.value) == "module has separate weights and none are loaded (MODEL_LOAD first)"
    with pytest.raises(WeightsError, match="truncated"):
        mod.set_weights(data[:-100])
    with pytest.raises(WeightsError, match="digest"):
        mod.set_weights(data[:-1] + bytes([data[-1] ^ 1]))
    other = (compiled("multi_input", separate=True) / "weights.bin").read_bytes()
    with pytest.raises(WeightsError, match="another model"):
        mod.set_weights(other)
    mod.unload()
    from dspx.device.core.errors import CallError

    with pytest.raises(CallError) as e:
        mod.run(_inputs(mod.signature))
    assert str(e.value) == "module is unloaded"
    embedded = _load(compiled("multi_output"))
    with pytest.raises(WeightsError, match="carries its own weights"):
        embedded.set_weights(data)
    embedded.unload()


def test_wrong_inputs_are_tensor_errors(compiled):
    mod = _load(compiled("multi_output"))
    with pytest.raises(TensorError, match="takes 1 inputs"):
        mod.run([])
    with pytest.raises(TensorError, match=r"expected \[2, 32\] float32"):
        mod.run([np.zeros((2, 32), np.float64)])
    mod.unload()


# ---------------------------------------------------------------- no leaks

def _rss_mb() -> float:
    return psutil.Process().memory_info().rss / 2**20


_CYCLES = """
import json, sys, psutil
from dspx.device.core import loader
data = open(sys.argv[1], "rb").read()
rss = []
for _ in range(50):
    mod = loader.load_module(data)
    mod.unload()
    del mod
    rss.append(psutil.Process().memory_info().rss / 2**20)
print(json.dumps(rss))
"""


def test_resnet18_load_unload_does_not_leak(compiled):
    # In a fresh process, like a device core: this test process carries the
    # allocations of every test before it, which would blur a 5 MB bound.
    import json
    import subprocess
    import sys

    so = compiled("resnet18") / "model.so"
    out = subprocess.run([sys.executable, "-c", _CYCLES, str(so)], capture_output=True, text=True,
                         timeout=600, check=True).stdout
    rss = json.loads(out.strip().splitlines()[-1])
    assert max(rss[1:]) - rss[0] <= 5, f"RSS after cycle 1: {rss[0]:.1f} MB, max after: {max(rss[1:]):.1f} MB"


def test_load_infer_unload_cycles_do_not_leak(compiled):
    data = (compiled("multi_output") / "model.so").read_bytes()
    x = [np.ones((2, 32), np.float32)]
    rss = []
    for _ in range(50):
        mod = loader.load_module(data)
        outs = [o.copy() for o in mod.run(x)]
        mod.unload()
        del mod
        rss.append(_rss_mb())
    assert len(outs) == 7
    assert max(rss[1:]) - rss[0] <= 5


# ---------------------------------------------------------------- refusals at their words (each kills a mutant that survived)

@pytest.mark.parametrize("mutate, text", [
    (lambda d: b"MZ\x90\x00" + d[4:], "not an ELF file (starts with b'MZ\\x90\\x00', {n} bytes)"),
    (lambda d: d[:63], "not an ELF file (starts with b'\\x7fELF', 63 bytes)"),
    (lambda d: _patched(d, 4, b"\x01"), "ELF class 1 (ELFCLASS32), this device loads ELFCLASS64"),
    (lambda d: _patched(d, 4, b"\x03"), "ELF class 3 (unknown), this device loads ELFCLASS64"),
    (lambda d: _patched(d, 5, b"\x02"), "ELF data encoding 2 is not little endian (ELFDATA2LSB)"),
    (lambda d: _patched(d, 16, (2).to_bytes(2, "little")), "ELF type ET_EXEC, a loadable module is a shared object (ET_DYN)"),
    # the section header string table names no .dynsym any more
    (lambda d: d.replace(b".dynsym\0", b".dynsyX\0", 1), "ELF has no dynamic symbol table (.dynsym)"),
], ids=["magic", "63-bytes", "class32", "class3", "big-endian", "exec", "no-dynsym"])
def test_elf_refusals_say_what_they_saw(good_elf, mutate, text):
    bad = mutate(good_elf)
    with pytest.raises(LoadError) as e:
        loader.load_module(bad)
    assert str(e.value) == text.format(n=len(bad))


def test_a_64_byte_elf_header_alone_passes_the_ident_check_and_is_malformed(good_elf):
    with pytest.raises(LoadError) as e:
        loader.load_module(good_elf[:64])
    assert re.match(r"malformed ELF: [A-Z]\w*(Error|Exception): ", str(e.value)), str(e.value)


def test_import_and_entry_refusals_say_what(tmp_path):
    elf = _gcc_so(tmp_path, '#include <stdlib.h>\nint run(void) { return system("true"); }\n')
    with pytest.raises(SymbolError) as e:
        loader.load_module(elf)
    assert str(e.value) == "module imports 'system', which the firmware does not export"
    with pytest.raises(SymbolError) as e:
        loader.load_module(_gcc_so(tmp_path, "int add1(int x) { return x + 1; }\n"))
    assert str(e.value) == ("no TVM module entry: symbol '__tvm_ffi__library_bin' is missing "
                            "(not a library exported by TVM)")


def _gcc_so_linking(tmp_path, *flags: str) -> bytes:
    """A module that names libraries (or a search path) of its own; it calls nothing from them."""
    (tmp_path / "own.c").write_text("int own_fn(void) { return 1; }\n")
    subprocess.run(["gcc", "-shared", "-fPIC", "-o", str(tmp_path / "libown.so"), str(tmp_path / "own.c")], check=True)
    (tmp_path / "m.c").write_text("char __tvm_ffi__library_bin[1];\n")
    so = tmp_path / "m.so"
    subprocess.run(["gcc", "-shared", "-fPIC", "-o", str(so), str(tmp_path / "m.c"), *flags], check=True)
    return so.read_bytes()


def test_a_module_needing_a_library_of_its_own_is_refused_naming_it(tmp_path):
    elf = _gcc_so_linking(tmp_path, f"-L{tmp_path}", "-Wl,--no-as-needed", "-lown")
    with pytest.raises(SymbolError) as e:
        loader.load_module(elf)
    assert e.value.symbol == "libown.so" and e.value.status == Status.ERR_SYMBOL
    assert str(e.value) == ("module needs 'libown.so'; it may link only libc.so.6, libgcc_s.so.1, libm.so.6, "
                            "libstdc++.so.6")


def test_a_module_with_its_own_library_search_path_is_refused(tmp_path):
    with pytest.raises(LoadError) as e:
        loader.load_module(_gcc_so_linking(tmp_path, f"-Wl,-rpath,{tmp_path}"))
    assert str(e.value) == ("module sets RUNPATH; libraries are looked up only where the device's are "
                            "(drop -rpath)")


IO_META_OK = "{0x54,0x49,0x4f,0x4d, 1,0,0,0, 1,0,0,0, 1,0,0,0, 64,0,0,0,0,0,0,0, 64,0,0,0,0,0,0,0, 0,0,0,0, 0,0,0,0}"


@pytest.mark.parametrize("decl, text", [
    ("const unsigned char _binary_tvm_dsp_io_meta_start[39] = {1};", "io_meta blob is 39 bytes, expected 40"),
    ("unsigned char _binary_tvm_dsp_io_meta_start[40];",  # zero-filled: .bss, no bytes in the file
     "symbol _binary_tvm_dsp_io_meta_start (40 bytes) lies outside the file's section .bss"),
    ('__asm__(".globl _binary_tvm_dsp_io_meta_start\\n.set _binary_tvm_dsp_io_meta_start, 0x40");',
     "symbol _binary_tvm_dsp_io_meta_start is not in a section (st_shndx SHN_ABS)"),
    # alone in its section, the blob ends exactly where the section does: it is read, and the
    # module fails only later, when TVM's loader finds no module in the 1-byte library blob
    ('__attribute__((section(".iometa"))) const unsigned char _binary_tvm_dsp_io_meta_start[40] = '
     + IO_META_OK + ";", "dynamic loading failed: "),
], ids=["39-bytes", "bss", "absolute", "section-end"])
def test_io_meta_symbol_refusals(tmp_path, decl, text):
    elf = _gcc_so(tmp_path, "char __tvm_ffi__library_bin[1];\n" + decl + "\n")
    with pytest.raises(LoadError) as e:
        loader.load_module(elf)
    assert str(e.value) == text if not text.endswith(": ") else str(e.value).startswith(text), str(e.value)


def test_ddr_refusal_names_text_data_and_workspace_from_the_segments(good_elf):
    import io

    from elftools.elf.constants import P_FLAGS
    from elftools.elf.elffile import ELFFile

    segs = [s for s in ELFFile(io.BytesIO(good_elf)).iter_segments() if s["p_type"] == "PT_LOAD"]
    text = sum(s["p_memsz"] for s in segs if s["p_flags"] & P_FLAGS.PF_X)
    data = sum(s["p_memsz"] for s in segs if not s["p_flags"] & P_FLAGS.PF_X)
    assert text and data
    mod = loader.load_module(good_elf)
    work = mod.workspace_bytes
    need = text + data + work
    assert (mod.text_size, mod.data_size) == (text, data)
    mod.unload()
    with pytest.raises(NoMemError) as e:
        loader.load_module(good_elf, ddr_free=need - 1)
    assert str(e.value) == (f"module needs {need} bytes of the DDR pool ({text} text + {data} data + {work} "
                            f"workspace), {need - 1} free")
    assert (e.value.oom_requested, e.value.oom_free, e.value.oom_total) == (need, need - 1, 0)
    loader.load_module(good_elf, ddr_free=need).unload()  # exactly enough


def test_a_renamed_dynamic_section_does_not_hide_dt_needed(tmp_path):
    """The dynamic linker reads PT_DYNAMIC, not a section called .dynamic: a
    module that renames the section (so a by-name check finds no DT_NEEDED)
    is refused before anything is mapped, and so is one whose DT_SYMTAB points
    away from the .dynsym the import check reads."""
    elf = _gcc_so_linking(tmp_path, f"-L{tmp_path}", "-Wl,--no-as-needed", "-lown")
    assert elf.count(b".dynamic\x00") == 1
    with pytest.raises(LoadError) as e:
        loader.load_module(elf.replace(b".dynamic\x00", b".dynamix\x00"))
    assert str(e.value) == "module: the .dynamic section is not the PT_DYNAMIC segment the dynamic linker reads"

    from elftools.elf.elffile import ELFFile
    import io
    plain = _gcc_so_linking(tmp_path)
    f = ELFFile(io.BytesIO(plain))
    dynsym = f.get_section_by_name(".dynsym")
    # move the section header's idea of .dynsym by one entry: the linker still reads DT_SYMTAB
    hdr = f["e_shoff"] + f.get_section_index(".dynsym") * f["e_shentsize"]
    moved = bytearray(plain)
    moved[hdr + 16:hdr + 24] = (dynsym["sh_addr"] + 24).to_bytes(8, "little")
    with pytest.raises(LoadError) as e:
        loader.load_module(bytes(moved))
    assert str(e.value) == f"module: DT_SYMTAB 0x{dynsym['sh_addr']:x} is not the .dynsym section"


def _cores(default_device) -> set[int]:
    return {p.pid for p in psutil.Process(default_device.proc.pid).children()}


CRASHING_MODULE = r"""
/* Passes every check before mapping (ELF64 x86-64 shared object, no imports,
   the TVM entry symbol), then segfaults in its constructor when mapped. */
const char __tvm_ffi__library_bin[16] = "not a module";
__attribute__((constructor)) static void crash(void) { *(volatile int *)8 = 1; }
"""


def _crashing_module(tmp_path) -> bytes:
    src = tmp_path / "crash.c"
    src.write_text(CRASHING_MODULE)
    so = tmp_path / "crash.so"
    subprocess.run(["gcc", "-shared", "-fPIC", "-nostdlib", "-O0", "-o", str(so), str(src)], check=True)
    return so.read_bytes()


def test_a_module_that_crashes_the_loader_costs_the_probe_child_not_the_core(default_device, client_of, tmp_path):
    elf = _crashing_module(tmp_path)
    c = client_of(default_device.path)
    cores = _cores(default_device)
    with pytest.raises(ModuleLoadError) as e:
        c.load_module(elf)
    # the probe child's end is named (a signal: SIGSEGV, or SIGSYS where the probe runs sandboxed)
    assert e.value.status_name == "ERR_LOAD" and "SIG" in str(e.value), e.value
    assert _cores(default_device) == cores  # no core died and none was restarted
    assert c.ping()["version"] == "3.0.0" and c.pools()["modules"] == 0


def test_a_module_entry_that_raises_is_err_call(compiled):
    """A real module's entry given arguments it cannot take: TVM raises, the
    loader reports CallError (ERR_CALL) and the module still runs afterwards."""
    import tvm

    from dspx.device.core import loader
    from dspx.device.core.errors import CallError
    from dspx.compiler.examples import random_inputs

    d = compiled("multi_output")
    meta = json.loads((d / "metadata.json").read_text())
    mod = loader.load_module((d / "model.so").read_bytes())
    try:
        wrong = tvm.runtime.tensor(np.zeros((3, 3), np.float32))
        with pytest.raises(CallError) as e:
            mod.call([wrong])
        assert e.value.status == Status.ERR_CALL and "main failed" in str(e.value)
        outs = mod.run(random_inputs(meta, seed=1))
        assert len(outs) == 7
    finally:
        mod.unload()
    with pytest.raises(CallError, match="unloaded"):
        mod.call([])
