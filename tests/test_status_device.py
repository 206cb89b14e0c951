"""Rules whose behaviour needs a real device (or a real compiled module):
a buffer a job uses cannot be detached, a module that crashes the loader
costs only the throwaway child, KV_RESIDENT outputs land packed from the KV
region's base, a module entry that raises is ERR_CALL.  See
docs/reliability.md, "Rules and their tests"."""
from __future__ import annotations

import json
import subprocess
import textwrap

import numpy as np
import psutil
import pytest

from dspx.abi import layout
from dspx.abi.protocol import Status
from dspx.errors import Busy, ModuleLoadError

HOLD_OPS = textwrap.dedent("""
    from dspx.device.core import runtime as rt

    @rt.register_op(0x3101)
    def hold(inp, out, tm):
        # runs until the host writes 1 into its input (at most 20 s)
        t0 = rt.cycles()
        while inp[0] == 0 and rt.cycles() - t0 < 20_000_000_000:
            pass
        out[0] = 1
        return 0
""")


@pytest.fixture
def dev(default_device):
    return default_device


def _cores(dev) -> set[int]:
    return {p.pid for p in psutil.Process(dev.proc.pid).children()}


def test_detach_of_a_buffer_a_running_job_uses_is_busy(dev):
    from dspx.host.tasks import Tasks

    with Tasks(socket=dev.path) as u:
        handle, _ = u.load_ops(HOLD_OPS)
        try:
            inp, out = u.malloc(64), u.malloc(64)
            task = u.submit(u.rpc(0x3101, inp, out))
            for mem in (inp, out):
                with pytest.raises(Busy) as e:
                    u.free(mem)
                assert e.value.status_name == "ERR_BUSY" and "in use" in str(e.value)
            inp.vir[0] = 1  # let the job end
            u.wait(task, 20_000)
            assert out.vir[0] == 1
            u.free(inp)  # free once the job is done
            u.free(out)
        finally:
            u.unload_ops(handle)


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


def test_a_module_that_crashes_the_loader_costs_the_probe_child_not_the_core(dev, client_of, tmp_path):
    elf = _crashing_module(tmp_path)
    c = client_of(dev.path)
    cores = _cores(dev)
    with pytest.raises(ModuleLoadError) as e:
        c.load_module(elf)
    # the probe child's end is named (a signal: SIGSEGV, or SIGSYS where the probe runs sandboxed)
    assert e.value.status_name == "ERR_LOAD" and "SIG" in str(e.value), e.value
    assert _cores(dev) == cores  # no core died and none was restarted
    assert c.ping()["version"] == "3.0.0" and c.pools()["modules"] == 0


def test_kv_resident_outputs_are_packed_from_the_kv_regions_base(dev, client_of, compiled):
    """The copy branch: multi_output's outputs 1..6 are new arrays, copied into
    the KV region at the offsets layout.pack gives; output 0 goes to output_buf."""
    from dspx.compiler.examples import random_inputs

    d = compiled("multi_output")
    meta = json.loads((d / "metadata.json").read_text())
    x = random_inputs(meta, seed=3)
    c = client_of(dev.path, kv_size=1 << 16)
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


def test_kv_resident_outputs_past_the_kv_region_are_err_size(dev, client_of, compiled):
    from dspx.errors import OutputTooSmall
    from dspx.compiler.examples import random_inputs

    d = compiled("multi_output")
    meta = json.loads((d / "metadata.json").read_text())
    c = client_of(dev.path, kv_size=64)
    m = c.load_module((d / "model.so").read_bytes())
    with pytest.raises(OutputTooSmall) as e:
        c.infer(m.handle, random_inputs(meta, seed=3), kv_resident=True)
    assert e.value.status_name == "ERR_SIZE" and "KV region holds 64" in str(e.value)
    assert c.ping()["version"] == "3.0.0"


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


def test_an_unknown_rpc_command_is_err_op_and_the_device_keeps_serving(dev, client_of):
    from dspx.abi import protocol as P
    from dspx.errors import UnknownOp

    c = client_of(dev.path)
    b = c.alloc(4096)
    with pytest.raises(UnknownOp) as e:
        c.request(P.Rpc(cmd=0x7ABC, input_dsp_addr=b.dsp_addr, input_size=16, output_dsp_addr=b.dsp_addr,
                        output_size=16))
    assert e.value.status_name == "ERR_OP" and "0x7abc" in str(e.value)
    assert c.ping()["version"] == "3.0.0"
