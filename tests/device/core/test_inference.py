"""Compiled modules at runtime, end to end through a real device process:
outputs against onnxruntime, every way a request can be wrong (and the
device still serving after it), load/unload cycles without leaks, which
buffers an inference syncs, the capacity rules of docs/protocol.md,
"Capacity", and KV_RESIDENT outputs packed from the KV region's base."""
from __future__ import annotations

import errno
import io
import json
import struct
import warnings

import numpy as np
import onnxruntime as ort
import pytest
from elftools.elf.elffile import ELFFile

from dspx.abi import layout
from dspx.abi import protocol as P
from dspx.compiler.examples import random_inputs
from dspx.errors import (BadAddress, BadHandle, BadTensor, BadWeights, CapacityError, CapacityLocked,
                         CapacityWarning, InvalidRequest, MissingSymbol, ModuleLoadError, OutOfMemory,
                         OutputTooSmall)
from dspx.host.vm import VirtualMachine

from conftest import Device

TOL = 1e-4
MiB = 1 << 20


# ---------------------------------------------------------------- helpers
def _meta(directory) -> dict:
    return json.loads((directory / "metadata.json").read_text())


def _ort(onnx_path, meta: dict, inputs) -> list[np.ndarray]:
    so = ort.SessionOptions()
    so.intra_op_num_threads = 1
    sess = ort.InferenceSession(str(onnx_path), so, providers=["CPUExecutionProvider"])
    return sess.run(None, {t["name"]: a for t, a in zip(meta["inputs"], inputs)})


def _assert_close(outs, ref, meta):
    outs = outs if isinstance(outs, list) else [outs]
    assert len(outs) == len(ref) == len(meta["outputs"])
    for o, r, spec in zip(outs, ref, meta["outputs"]):
        assert o.shape == r.shape == tuple(spec["shape"]) and o.dtype == r.dtype, spec["name"]
        np.testing.assert_allclose(o, r, rtol=0, atol=TOL, err_msg=spec["name"])


def _spy(client) -> list:
    """Record (request, response) of every successful request on ``client``,
    decoded from the bytes that went out."""
    log, sent = [], {}
    real_send, real_wait = client._send_bytes, client.wait

    def send_bytes(data, seq, name, fds=()):
        sent[seq] = P.decode(bytes(data))
        return real_send(data, seq, name, fds)

    def wait(seq, timeout=None, request=""):
        resp = real_wait(seq, timeout, request)
        if resp.status == 0 and seq in sent:
            log.append((sent.pop(seq), resp))
        return resp

    client._send_bytes, client.wait = send_bytes, wait
    return log


def _serving(c):
    """The device still answers on this connection and keeps its accounting."""
    assert c.ping()["version"] == "3.0.0"
    return c.pools()


def _core_barrier(c):
    """Wait until the core has done everything queued before now: DYN_UNLOAD
    is answered by the front while the core frees the module, and POOL_STATUS
    reads the core's RSS; a load the core must refuse goes through it."""
    with pytest.raises(ModuleLoadError):
        c.load_module(b"\0" * 64)


def _module_dir(compiled, name):
    return compiled(name, kernels=(name == "resnet18"))  # ResNet-18 with kernels: ~50 ms, not 2.7 s


def _client_for(client_of, path, directory, **kw):
    kw.setdefault("staging_size", max(1 * MiB, (directory / "model.so").stat().st_size + 64 * 1024))
    return client_of(path, **kw)


# ---- ELF surgery: the loader checks the staged bytes before mapping anything
def _dynstr_rename(so: bytes, old: str, new: str) -> bytes:
    assert len(old) == len(new)
    sec = ELFFile(io.BytesIO(so)).get_section_by_name(".dynstr")
    a, b = sec["sh_offset"], sec["sh_offset"] + sec["sh_size"]
    key = b"\0" + old.encode() + b"\0"
    assert key in so[a:b], old
    return so[:a] + so[a:b].replace(key, b"\0" + new.encode() + b"\0") + so[b:]


def _symbol_offset(so: bytes, name: str) -> tuple[int, int]:
    elf = ELFFile(io.BytesIO(so))
    sym = next(s for s in elf.get_section_by_name(".dynsym").iter_symbols() if s.name == name)
    sec = elf.get_section(sym["st_shndx"])
    return sec["sh_offset"] + sym["st_value"] - sec["sh_addr"], sym["st_size"]


def _with_io_output_bytes(so: bytes, output_bytes: int) -> bytes:
    off, size = _symbol_offset(so, "_binary_tvm_dsp_io_meta_start")
    assert size == 40
    return so[:off + 24] + struct.pack("<Q", output_bytes) + so[off + 32:]


def _without_io_meta(so: bytes) -> bytes:
    return _dynstr_rename(so, "_binary_tvm_dsp_io_meta_start", "_binary_tvm_dsp_io_meta_stArt")


# ---------------------------------------------------------------- a module with large outputs

@pytest.fixture(scope="module")
def wide(tmp_path_factory, compiled, device_verifier):  # `compiled` first: it owns the TVM import
    from dspx.compiler import examples
    from dspx.compiler.onnx import compile_onnx

    d = tmp_path_factory.mktemp("wide")
    compile_onnx(examples.wide(d / "wide.onnx"), d / "out", kernels=False, progress=False, verifier=device_verifier)
    return d / "out"


WIDE_IN, WIDE_OUT = 384, 74240  # io_meta: 128 + 256 | 256 + 256 + 24576 + 49152


def _wide_expected(x):
    return [x * 2, np.broadcast_to(x, (96, 64)), np.broadcast_to(x, (192, 64))]


# ================================================================ 1. outputs = onnxruntime
@pytest.mark.parametrize("name", ["multi_input", "multi_output", "resnet18"])
def test_outputs_match_onnxruntime(name, shared_device, client_of, compiled, example_onnx):
    d = _module_dir(compiled, name)
    meta = _meta(d)
    c = _client_for(client_of, shared_device.path, d)
    log = _spy(c)
    x = random_inputs(meta)
    ref = _ort(example_onnx[name], meta, x)
    with VirtualMachine(d, client=c) as vm:
        outs = vm["main"](*x)  # copy in, copy out
        _assert_close(outs, ref, meta)
        req, resp = log[-1]
        if len(meta["inputs"]) > P.MAX_INLINE_INPUTS:  # 7 inputs: descriptors in input_buf
            assert isinstance(req, P.InferLarge) and req.descs_addr == c.input_buf.dsp_addr
        else:
            assert isinstance(req, P.Infer)
        if len(meta["outputs"]) > P.MAX_INLINE_OUTPUTS:  # 7 outputs: descriptors in output_buf
            assert resp.descs == [] and resp.descs_addr == c.output_buf.dsp_addr
            assert resp.descs_size == 80 * len(meta["outputs"])
        else:
            assert len(resp.descs) == len(meta["outputs"]) and resp.descs_size == 0
        assert resp.cycles > 0 and vm.last_cycles == resp.cycles

        # zero copy: inputs created in input_buf, outputs as views of output_buf
        xd = [vm.create_input(a.shape, a.dtype) for a in x]
        for dst, a in zip(xd, x):
            dst[...] = a
        views = vm.run_nocopy(*xd)
        _assert_close(views, ref, meta)
        req, _ = log[-1]
        descs = req.descs if isinstance(req, P.Infer) else P.decode_descs(c.input_buf.mm, req.num_inputs)
        for desc, a in zip(descs, xd):  # the device read the created arrays in place
            assert desc.data_addr == c.input_buf.dsp_addr + c.in_input_buf(a)
        out_base = np.frombuffer(c.output_buf.mm, np.uint8).ctypes.data
        for v in views if isinstance(views, list) else [views]:
            assert out_base <= v.ctypes.data < out_base + c.output_buf.size
    _serving(c)


def test_copies_survive_and_views_follow_the_next_call(shared_device, client_of, compiled):
    d = compiled("multi_output")
    c = client_of(shared_device.path)
    with VirtualMachine(d, client=c) as vm:
        x0, x1 = random_inputs(_meta(d), 0), random_inputs(_meta(d), 1)
        kept = vm["main"](*x0)
        views = vm.run_nocopy(*x0)
        before = [v.copy() for v in views]
        vm.run_nocopy(*x1)  # overwrites output_buf
        assert not np.array_equal(views[0], before[0])  # the views see the new outputs
        for k, b in zip(kept, before):  # the copies do not
            np.testing.assert_array_equal(k, b)


def test_separate_weights_match_onnxruntime(shared_device, client_of, compiled, example_onnx):
    d = compiled("multi_output", separate=True)
    meta = _meta(d)
    x = random_inputs(meta)
    c = client_of(shared_device.path)
    with VirtualMachine(d, client=c) as vm:  # loads weights.bin with MODEL_LOAD
        assert vm.model_id
        _assert_close(vm["main"](*x), _ort(example_onnx["multi_output"], meta, x), meta)
    assert c.pools()["ddr_used"] == 0


def test_repeat_reports_per_run_cycles(shared_device, client_of, compiled):
    d = compiled("multi_input")
    c = client_of(shared_device.path)
    with VirtualMachine(d, client=c) as vm:
        vm.run_nocopy(*random_inputs(_meta(d)), repeat=3)
        lines = vm.last_printf.splitlines()
        assert [ln.split(":")[0] for ln in lines] == ["run 0", "run 1", "run 2"]
        assert all(ln.endswith(" cycles") and int(ln.split()[2]) > 0 for ln in lines)


# ================================================================ 2. bad input; the device keeps serving
def _elf_cases(so: bytes, so_k: bytes):
    yield "not an ELF", b"MZ\x90\x00 this is a PE file, not an ELF " * 8, ModuleLoadError, "not an ELF"
    yield "other machine", so[:18] + struct.pack("<H", 183) + so[20:], ModuleLoadError, "EM_AARCH64"
    yield "32-bit", so[:4] + b"\x01" + so[5:], ModuleLoadError, "ELFCLASS32"
    yield "executable", so[:16] + struct.pack("<H", 2) + so[18:], ModuleLoadError, "ET_EXEC"
    yield "truncated", so[:4096], ModuleLoadError, "malformed ELF"
    yield "no entry", _dynstr_rename(so, "__tvm_ffi__library_bin", "__tvm_ffi__library_biX"), MissingSymbol, \
        "'__tvm_ffi__library_bin'"
    yield "import outside the export table", _dynstr_rename(so, "expf", "kill"), MissingSymbol, "'kill'"
    off, size = _symbol_offset(so_k, "_binary_dspx_signature_start")
    sig = so_k[off:off + size].replace(b'"dspx.kernels.softmax"', b'"dspx.kernels.softmaX"')
    yield "kernel outside the library", so_k[:off] + sig + so_k[off + size:], MissingSymbol, \
        "'dspx.kernels.softmaX'"


def test_bad_modules_are_refused_by_name(shared_device, client_of, compiled):
    so = (compiled("multi_output") / "model.so").read_bytes()
    so_k = (compiled("multi_output", kernels=True, op_by_op=True) / "model.so").read_bytes()  # imports softmax
    c = client_of(shared_device.path)
    start = c.pools()
    for what, data, exc, text in _elf_cases(so, so_k):
        with pytest.raises(exc) as ei:
            c.load_module(data)
        e = ei.value
        assert e.status_name == {ModuleLoadError: "ERR_LOAD", MissingSymbol: "ERR_SYMBOL"}[exc], what
        assert text in str(e), (what, str(e))  # the device's text, fetched with GET_ERROR
        p = _serving(c)
        assert p["ddr_used"] == start["ddr_used"] and p["modules"] == start["modules"], what
    # and a good module still loads and runs after all that
    with VirtualMachine(compiled("multi_output"), client=c) as vm:
        vm.run_nocopy(*random_inputs(_meta(compiled("multi_output"))))


def test_bad_weights_are_err_weights(shared_device, client_of, compiled):
    d = compiled("multi_output", separate=True)
    w = (d / "weights.bin").read_bytes()
    other = (compiled("multi_input", separate=True) / "weights.bin").read_bytes()
    c = client_of(shared_device.path)
    corrupt = bytearray(w)
    corrupt[-1] ^= 0xFF  # payload no longer matches its digest
    for what, data in (("truncated", w[:len(w) // 2]), ("corrupt", bytes(corrupt)),
                       ("bad magic", b"NOTWTS\0\0" + w[8:]), ("header only", w[:64])):
        with pytest.raises(BadWeights) as ei:
            c.load_weights(data)
        assert ei.value.status_name == "ERR_WEIGHTS", what
        _serving(c)
    vm = VirtualMachine(d, client=c)
    try:
        x = random_inputs(_meta(d))
        with pytest.raises(BadWeights, match="separate weights"):  # no weights passed
            c.infer(vm.handle, x, model_id=0)
        wrong, _ = c.load_weights(other)  # a valid file, of another model
        with pytest.raises(BadWeights, match="another model"):
            c.infer(vm.handle, x, model_id=wrong)
        c.unload_weights(wrong)
        _serving(c)
        vm.run_nocopy(*x)  # the right weights still work
    finally:
        vm.close()


@pytest.fixture
def loaded(shared_device, client_of, compiled):
    """(client, handle, x) with multi_output loaded; x already in input_buf."""
    d = compiled("multi_output")
    c = client_of(shared_device.path)
    vm = VirtualMachine(d, client=c)
    x = vm.create_input((2, 32), "float32")
    x[...] = random_inputs(_meta(d))[0]
    yield c, vm.handle, x
    vm.close()


def _infer_msg(c, handle, descs, **kw) -> P.Infer:
    f = dict(module_handle=handle, model_id=0, num_inputs=len(descs), flags=0,
             input_dsp_addr=c.input_buf.dsp_addr, input_size=c.input_buf.size,
             result_dsp_addr=c.output_buf.dsp_addr, result_size=c.output_buf.size, descs=descs)
    f.update(kw)
    return P.Infer(**f)


def _x_desc(c, x, **kw) -> P.TensorDesc:
    d = dict(data_addr=c.input_buf.dsp_addr + c.in_input_buf(x), data_size=x.nbytes, ndim=2, dtype_code=2,
             dtype_bits=32, shape=(2, 32))
    d.update(kw)
    return P.TensorDesc(**d)


def _still_runs(c, handle, x):
    _serving(c)
    r = c.request(_infer_msg(c, handle, [_x_desc(c, x)]))
    assert r.status == 0 and r.num_outputs == 7


TENSOR_CASES = {
    "shape": dict(shape=(32, 2)),
    "dtype": dict(dtype_code=0),  # int32 of the same size
    "size vs shape": dict(data_size=200),
    "ndim": dict(ndim=3, shape=(2, 32, 1)),
    "ndim > 6": dict(ndim=7),
    "unknown dtype": dict(dtype_bits=24, data_size=192),
    "negative extent": dict(shape=(-2, -32)),
}


@pytest.mark.parametrize("case", list(TENSOR_CASES))
def test_descriptor_disagreeing_with_the_module_is_err_tensor(loaded, case):
    c, handle, x = loaded
    with pytest.raises(BadTensor) as ei:
        c.request(_infer_msg(c, handle, [_x_desc(c, x, **TENSOR_CASES[case])]))
    assert ei.value.status_name == "ERR_TENSOR" and "input 0" in str(ei.value)
    _still_runs(c, handle, x)


def test_wrong_number_of_inputs_is_err_tensor(loaded):
    c, handle, x = loaded
    with pytest.raises(BadTensor, match="takes 1 inputs, 2 given"):
        c.request(_infer_msg(c, handle, [_x_desc(c, x), _x_desc(c, x)]))
    _still_runs(c, handle, x)


def test_addresses_outside_the_connection_are_err_addr(loaded, shared_device, client_of, compiled):
    c, handle, x = loaded
    other = client_of(shared_device.path)
    other_vm = VirtualMachine(compiled("multi_output"), client=other)
    ib, ob, ob2 = c.input_buf, c.output_buf, other.input_buf
    good = _x_desc(c, x)
    cases = {
        "input range nowhere": dict(input_dsp_addr=0x1000),
        "input range wraps": dict(input_dsp_addr=(1 << 64) - 64, input_size=128),
        "input range past its buffer": dict(input_size=ib.size + 1),
        "input range in another connection": dict(input_dsp_addr=ob2.dsp_addr, input_size=ob2.size),
        "result range past its buffer": dict(result_dsp_addr=ob.dsp_addr + ob.size, result_size=64),
        "result range too long": dict(result_size=ob.size + 4096),
        "result range in another connection": dict(result_dsp_addr=other.output_buf.dsp_addr),
        "tensor data outside the input range": dict(descs=[_x_desc(c, x, data_addr=ob.dsp_addr)]),
        "tensor data straddles the range end": dict(descs=[_x_desc(c, x, data_addr=ib.dsp_addr + ib.size - 64)]),
        "tensor data in another connection": dict(descs=[_x_desc(c, x, data_addr=ob2.dsp_addr + 128)]),
    }
    try:
        for what, kw in cases.items():
            with pytest.raises(BadAddress) as ei:
                c.request(_infer_msg(c, handle, **{"descs": [good], **kw}))
            assert ei.value.status_name == "ERR_ADDR", what
            _still_runs(c, handle, x)
    finally:
        other_vm.close()


def test_infer_large_descriptor_table_outside_is_err_addr(shared_device, client_of, compiled):
    d = compiled("multi_input")
    c = client_of(shared_device.path)
    with VirtualMachine(d, client=c) as vm:
        x = random_inputs(_meta(d))
        vm.run_nocopy(*x)  # writes a valid descriptor table at the front of input_buf
        base = dict(module_handle=vm.handle, model_id=0, num_inputs=7, flags=0, descs_addr=c.input_buf.dsp_addr,
                    descs_size=7 * 80, input_dsp_addr=c.input_buf.dsp_addr, input_size=c.input_buf.size,
                    result_dsp_addr=c.output_buf.dsp_addr, result_size=c.output_buf.size)
        assert c.request(P.InferLarge(**base)).status == 0
        for addr in (0x2000, c.input_buf.dsp_addr + c.input_buf.size - 80, (1 << 64) - 80):
            with pytest.raises(BadAddress, match="descriptor table"):
                c.request(P.InferLarge(**{**base, "descs_addr": addr}))
            _serving(c)
        with pytest.raises(InvalidRequest):  # descs_size must be num_inputs x 80
            c.request(P.InferLarge(**{**base, "descs_size": 7 * 80 - 1}))
        vm.run_nocopy(*x)


def test_unknown_or_foreign_handles_are_err_handle(loaded, shared_device, client_of, compiled):
    c, handle, x = loaded
    other = client_of(shared_device.path)
    theirs = VirtualMachine(compiled("multi_output"), client=other)
    try:
        for h in (0, 0xDEAD, theirs.handle):
            with pytest.raises(BadHandle) as ei:
                c.request(_infer_msg(c, h, [_x_desc(c, x)]))
            assert ei.value.status_name == "ERR_HANDLE" and str(h) in str(ei.value)
            with pytest.raises(BadHandle):
                c.unload_module(h)
            _still_runs(c, handle, x)
        with pytest.raises(BadHandle, match="model id"):
            c.request(_infer_msg(c, handle, [_x_desc(c, x)], model_id=4242))
        with pytest.raises(BadHandle):
            c.unload_weights(4242)
        theirs.run_nocopy(*random_inputs(_meta(compiled("multi_output"))))  # untouched by all that
    finally:
        theirs.close()
    # a handle is dead after unload
    h2 = c.load_module((compiled("multi_input") / "model.so").read_bytes()).handle
    c.unload_module(h2)
    with pytest.raises(BadHandle):
        c.unload_module(h2)
    _still_runs(c, handle, x)


@pytest.mark.parametrize("flags", [1 << 18, 1 << 31, P.INFER_FLAGS_RESERVED | 1])
def test_reserved_infer_flags_are_err_invalid(loaded, flags):
    c, handle, x = loaded
    with pytest.raises(InvalidRequest, match="reserved bits") as ei:
        c.request(_infer_msg(c, handle, [_x_desc(c, x)], flags=flags))
    assert ei.value.status_name == "ERR_INVALID"
    _still_runs(c, handle, x)


def test_kv_resident_without_kv_region_is_err_invalid(shared_device, client_of, compiled):
    d = compiled("multi_output")
    c = client_of(shared_device.path, kv_size=0)
    with VirtualMachine(d, client=c) as vm:
        x = random_inputs(_meta(d))
        with pytest.raises(InvalidRequest, match="KV region"):
            vm.run_nocopy(*x, kv_resident=True)
        _serving(c)
        vm.run_nocopy(*x)


def test_module_too_large_for_the_pool_is_err_nomem(client_of, compiled):
    dev = Device("--carveout-size", "8M", "--ddr-pool-size", "32K")
    try:
        c = client_of(dev.path)
        with pytest.raises(OutOfMemory) as ei:
            c.load_module((compiled("multi_output") / "model.so").read_bytes())
        e = ei.value
        assert e.status_name == "ERR_NOMEM"
        assert e.oom_total == 32 << 10 and e.oom_free == 32 << 10 and e.oom_requested > e.oom_free
        assert f"oom_requested={e.oom_requested}" in str(e) and "DDR pool" in str(e)
        p = _serving(c)
        assert p["ddr_used"] == 0 and p["modules"] == 0
    finally:
        dev.stop()


# ================================================================ capacity (docs/protocol.md, "Capacity")
def _sync_state(c):
    return {name: (dict(b.synced), b.sync_calls) for name, b in
            (("staging", c.staging), ("printf", c.printf_buf), ("input", c.input_buf), ("output", c.output_buf))
            if b is not None}


def test_input_over_capacity_is_efbig_before_anything_is_staged(loaded):
    c, handle, x = loaded
    before, status = _sync_state(c), c.status()
    with pytest.raises(CapacityError) as ei:
        c.infer(handle, [np.zeros((2, 4096), np.float32)])
    assert ei.value.errno == errno.EFBIG and ei.value.requested > ei.value.capacity == c.input_buf.size
    with pytest.raises(CapacityError):
        c.create_input((4096, 4), "float32")
    assert _sync_state(c) == before  # nothing was written to any buffer
    assert c.status()["jobs_completed"] == status["jobs_completed"]  # nor sent
    assert c.status()["jobs_failed"] == status["jobs_failed"]


def test_output_too_small_then_reserve_and_retry(shared_device, client_of, wide):
    """A module without io_meta: reserve_io sizes the buffers; ERR_SIZE names
    result_required, stopping at the first tensor that does not fit; a failed
    call does not lock capacity, so the caller can grow and retry."""
    c = client_of(shared_device.path)
    so = _without_io_meta((wide / "model.so").read_bytes())
    mod = c.load_module(so)
    assert mod.io_input_bytes == mod.io_output_bytes == 0 and c.input_buf is None
    x = np.arange(64, dtype=np.float32).reshape(1, 64)
    with pytest.raises(CapacityError):  # nothing reserved yet
        c.infer(mod.handle, [x])
    c.reserve_io(WIDE_IN, 1)
    required = []
    for _ in range(3):
        try:
            res = c.infer(mod.handle, [x])
            break
        except OutputTooSmall as e:
            assert e.status_name == "ERR_SIZE" and e.result_required > c.output_capacity
            assert f"result_required={e.result_required}" in str(e)
            assert not c.io_locked
            required.append(e.result_required)
            _serving(c)
            c.reserve_io(WIDE_IN, e.result_required)  # not locked by the failure
    else:
        pytest.fail(f"still ERR_SIZE after {required}")
    # stops at the first tensor that does not fit: mid (ends at 25088), then big (74240)
    assert required == [layout.align(256 + 256 + 96 * 64 * 4, 64), WIDE_OUT]
    for d, want in zip(res.descs, _wide_expected(x)):
        np.testing.assert_array_equal(c.output_view(d), want)
    assert c.io_locked
    with pytest.raises(CapacityLocked):
        c.reserve_io(WIDE_IN, 2 * WIDE_OUT)
    c.unload_module(mod.handle)


@pytest.mark.parametrize("declared", [256 * MiB, 1 << 50])
def test_unmeetable_declaration_is_advisory(shared_device, client_of, wide, declared):
    c = client_of(shared_device.path)
    so = _with_io_output_bytes((wide / "model.so").read_bytes(), declared)
    with pytest.warns(CapacityWarning) as rec:
        mod = c.load_module(so)
    text = str(rec[0].message)
    assert f"output declared {declared} bytes, allocated 0" in text and "reserve_io" in text
    assert mod.io_output_bytes == declared and c.input_capacity >= WIDE_IN  # kept what it could
    _serving(c)
    c.reserve_io(WIDE_IN, WIDE_OUT)  # the real figure
    x = np.ones((1, 64), np.float32)
    res = c.infer(mod.handle, [x])
    for d, want in zip(res.descs, _wide_expected(x)):
        np.testing.assert_array_equal(c.output_view(d), want)
    c.unload_module(mod.handle)


def test_capacity_grows_never_shrinks_and_locks_on_first_use(shared_device, client_of, compiled, wide):
    c = client_of(shared_device.path)
    small = c.load_module((compiled("multi_output") / "model.so").read_bytes())
    cap0 = (c.input_capacity, c.output_capacity)
    assert cap0[0] >= 384 and cap0[1] >= 1792
    big = c.load_module((wide / "model.so").read_bytes())
    assert c.output_capacity >= WIDE_OUT and c.input_capacity == cap0[0]  # grew where needed
    cap1 = (c.input_capacity, c.output_capacity)
    again = c.load_module((compiled("multi_output") / "model.so").read_bytes())
    assert (c.input_capacity, c.output_capacity) == cap1  # never shrinks
    assert not c.io_locked
    c.reserve_io(8192, 0)  # grows the input side only
    assert c.input_capacity == 8192 and c.output_capacity == cap1[1]
    x = c.create_input((2, 32), "float32")  # first use: locked
    assert c.io_locked
    with pytest.raises(CapacityLocked, match="locked"):
        c.reserve_io(16384, 0)
    x[...] = 1
    c.infer(small.handle, [x])
    with warnings.catch_warnings():
        warnings.simplefilter("error", CapacityWarning)  # met in full: no warning
        late = c.load_module(_with_io_output_bytes((wide / "model.so").read_bytes(), 4 * WIDE_OUT))
    assert c.input_capacity == 8192 and c.output_capacity >= 4 * WIDE_OUT  # a later declaration grows it, locked
    assert c.io_locked
    y = np.ones((1, 64), np.float32)
    for d, want in zip(c.infer(big.handle, [y]).descs, _wide_expected(y)):
        np.testing.assert_array_equal(c.output_view(d), want)
    for m in (small, big, again, late):
        c.unload_module(m.handle)


def test_completed_inference_locks_capacity(shared_device, client_of, compiled):
    d = compiled("multi_output")
    c = client_of(shared_device.path)
    with VirtualMachine(d, client=c) as vm:
        assert not c.io_locked
        vm["main"](*random_inputs(_meta(d)))
        assert c.io_locked
        with pytest.raises(CapacityLocked):
            vm.reserve_io(1 << 20, 1 << 20)


def test_out_of_band_output_descriptors_are_readable(shared_device, client_of, compiled):
    d = compiled("multi_output")
    meta = _meta(d)
    c = client_of(shared_device.path)
    log = _spy(c)
    with VirtualMachine(d, client=c) as vm:
        vm.run_nocopy(*random_inputs(meta))
        _, resp = log[-1]
        assert resp.num_outputs == 7 and resp.descs == [] and resp.descs_size == 7 * 80
        table = P.decode_descs(c.output_buf.mm, 7, resp.descs_addr - c.output_buf.dsp_addr)
        pos = layout.align(7 * 80, 64)
        for desc, spec in zip(table, meta["outputs"]):
            assert desc.check() is None and list(desc.shape) == spec["shape"] and desc.dtype == spec["dtype"]
            assert desc.data_addr == c.output_buf.dsp_addr + pos  # packed 64-aligned after the table
            pos = layout.align(pos + desc.data_size, 64)
        assert pos == meta["io"]["output_bytes"]


# ================================================================ 4. which buffers an inference syncs
@pytest.mark.parametrize("name", ["multi_output", "multi_input"])
def test_inference_syncs_only_input_and_output_buf(name, shared_device, client_of, compiled):
    d = compiled(name)
    c = client_of(shared_device.path)
    with VirtualMachine(d, client=c) as vm:
        x = random_inputs(_meta(d))
        xd = None
        for call in ("copy", "nocopy"):
            if call == "nocopy":
                xd = [vm.create_input(a.shape, a.dtype) for a in x]
            before = _sync_state(c)
            vm["main"](*x) if call == "copy" else vm.run_nocopy(*xd)
            after = _sync_state(c)
            for buf in ("staging", "printf"):
                assert after[buf] == before[buf], (call, buf)
            (bw, bn), (aw, an) = before["input"], after["input"]
            assert an == bn + 1 and aw["write"] == bw["write"] + c.input_buf.size and aw["read"] == bw["read"]
            (bw, bn), (aw, an) = before["output"], after["output"]
            assert an == bn + 1 and aw["read"] == bw["read"] + c.output_buf.size and aw["write"] == bw["write"]


# ================================================================ 3. load -> infer -> unload cycles
def test_fifty_cycles_leave_the_pool_and_rss_where_they_were(shared_device, client_of, compiled):
    d = compiled("multi_output")
    x = random_inputs(_meta(d))
    c = client_of(shared_device.path)
    start = c.pools()
    first = None
    for i in range(50):
        with VirtualMachine(d, client=c) as vm:
            assert c.pools()["ddr_used"] > start["ddr_used"]
            vm["main"](*x)
        _core_barrier(c)
        p = c.pools()
        assert (p["ddr_used"], p["modules"]) == (start["ddr_used"], start["modules"]), i
        first = first or p  # input_buf/output_buf exist from the first load on
        assert p["carveout_used"] == first["carveout_used"], i
    assert p["ddr_peak"] == first["ddr_peak"]
    assert abs(p["rss_bytes"] - first["rss_bytes"]) < 5 * MiB, (first["rss_bytes"], p["rss_bytes"])


def test_resnet_cycles_with_separate_weights_do_not_leak(shared_device, client_of, compiled):
    """ResNet-18 (kernels, 46 MB of weights through MODEL_LOAD): module, model
    slot, constants and kernel caches all go at unload."""
    d = compiled("resnet18", separate=True, kernels=True)
    x = random_inputs(_meta(d))
    c = client_of(shared_device.path, staging_size=(d / "weights.bin").stat().st_size + MiB)
    start = c.pools()
    rss = []
    for i in range(5):
        with VirtualMachine(d, client=c) as vm:
            vm.run_nocopy(*x)
        _core_barrier(c)
        p = c.pools()
        assert p["ddr_used"] == start["ddr_used"] and p["modules"] == start["modules"], i
        rss.append(p["rss_bytes"])
    assert abs(rss[-1] - rss[0]) < 5 * MiB, rss


def test_kv_resident_outputs_are_packed_from_the_kv_regions_base(default_device, client_of, compiled):
    """The copy branch: multi_output's outputs 1..6 are new arrays, copied into
    the KV region at the offsets layout.pack gives; output 0 goes to output_buf."""
    from dspx.compiler.examples import random_inputs

    d = compiled("multi_output")
    meta = json.loads((d / "metadata.json").read_text())
    x = random_inputs(meta, seed=3)
    c = client_of(default_device.path, kv_size=1 << 16)
    m = c.load_module((d / "model.so").read_bytes())
    plain = c.infer(m.handle, x)
    want = [np.array(c.output_view(desc)) for desc in plain.descs]
    assert len(want) == 7
    kv = c.kv_view(0, (1 << 16,), np.uint8)
    kv[:] = 0xEE  # anything the device does not write stays visible
    res = c.infer(m.handle, x, kv_resident=True)
    assert len(res.descs) == 1
    np.testing.assert_array_equal(c.output_view(res.descs[0]), want[0])
    offsets, end = layout.pack(a.nbytes for a in want[1:])
    assert offsets[0] == 0
    for off, w in zip(offsets, want[1:]):
        np.testing.assert_array_equal(c.kv_view(off, w.shape, w.dtype), w)
    assert (kv[end:] == 0xEE).all()
    c.unload_module(m.handle)


def test_kv_resident_outputs_past_the_kv_region_are_err_size(default_device, client_of, compiled):
    from dspx.errors import OutputTooSmall
    from dspx.compiler.examples import random_inputs

    d = compiled("multi_output")
    meta = json.loads((d / "metadata.json").read_text())
    c = client_of(default_device.path, kv_size=64)
    m = c.load_module((d / "model.so").read_bytes())
    with pytest.raises(OutputTooSmall) as e:
        c.infer(m.handle, random_inputs(meta, seed=3), kv_resident=True)
    assert e.value.status_name == "ERR_SIZE" and "KV region holds 64" in str(e.value)
    assert c.ping()["version"] == "3.0.0"
