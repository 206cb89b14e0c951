"""What code a client sends to run on a core (op libraries and their
handlers) can do to the device, against real devices: fail its own call
only.  A handler that loops is stopped at its time limit, one that raises
anything is ERR_CALL, a library whose top level misbehaves, exits or hangs on
one core is refused everywhere, and no library replaces another's ops.
docs/reliability.md states the rules."""
from __future__ import annotations

import textwrap
import time

import numpy as np
import pytest

from dspx.abi import protocol as P
from dspx.errors import DeviceError, OpFailed
from dspx.host.tasks import Tasks
from conftest import Device
from spin_ops import FOREVER, SPIN, STUBBORN


def children(d: Device) -> set[int]:
    return set(d.core_pids())


# ---------------------------------------------------------------- 2. job time limits

def test_looping_handlers_are_stopped_at_their_limit_and_the_core_serves_the_next_task(spin_device):
    with Tasks(socket=spin_device.path) as u:
        before = children(spin_device)
        t = u.submit(u.rpc(FOREVER, u.malloc(4), u.malloc(8)), core=1, timeout_ms=200)
        with pytest.raises(DeviceError) as e:
            u.wait(t, 10_000)
        assert e.value.status_name == "ERR_TIMEOUT"
        assert children(spin_device) == before  # interrupted in its own code: the core was kept
        t = u.submit(u.rpc(STUBBORN, u.malloc(4), u.malloc(8)), core=1, timeout_ms=200)
        with pytest.raises(DeviceError) as e:
            u.wait(t, 10_000)
        assert e.value.status_name == "ERR_TIMEOUT" and "restarted" in str(e.value)
        # that core was replaced: the reply goes out first, the new process follows (under a CPU hog it
        # was not there yet when the reply arrived)
        deadline = time.monotonic() + 30
        while len(children(spin_device) - before) != 1:
            assert time.monotonic() < deadline, (before, children(spin_device))
            time.sleep(0.02)
        assert len(before - children(spin_device)) == 1
        ok = u.run(SPIN, u.malloc(4), u.malloc(8), core=1)  # the new core 1 serves (libraries sent again)
        assert ok.return_value == 0


# ---------------------------------------------------------------- 6. user code fails only its own call

BAD_OPS = {
    "keyboard_interrupt": ("raise KeyboardInterrupt", "KeyboardInterrupt"),
    "huge_message": ("raise ValueError('m' * (2 << 20))", "ValueError: mmmm"),
    "system_exit": ("raise SystemExit(0)", "SystemExit"),
}


@pytest.mark.parametrize("name", sorted(BAD_OPS))
def test_a_handler_that_raises_anything_fails_only_its_own_call(spin_device, name):
    body, expect = BAD_OPS[name]
    src = textwrap.dedent(f"""
        from dspx.device.core import runtime as rt

        @rt.register_op(0x3D00)
        def bad(inp, out, tm):
            {body}
    """)
    before = children(spin_device)
    with Tasks(socket=spin_device.path) as u:
        h, _ = u.load_ops(src)
        try:
            for core in (0, 1):
                with pytest.raises(DeviceError) as e:
                    u.run(0x3D00, u.malloc(4), u.malloc(4), core=core)
                assert e.value.status_name == "ERR_CALL"
            assert expect in str(e.value)
            assert u.run(SPIN, u.malloc(4), u.malloc(8), core=1).return_value == 0
        finally:
            u.unload_ops(h)
    assert children(spin_device) == before  # no core died


@pytest.mark.parametrize("top, status, expect", [
    ("raise KeyboardInterrupt", "ERR_LOAD", "KeyboardInterrupt"),
    ("raise ValueError('m' * (2 << 20))", "ERR_LOAD", "ValueError: mmmm"),
    ("rt.register_op(0x3D10, lambda i, o, t: 0, name=lambda: 0)", "ERR_LOAD", "an op name is a non-empty str"),
    ("rt.register_op(0x3D11, lambda i, o, t: 0, name='bad\\udc80')", "ERR_LOAD", "cannot be encoded as UTF-8"),
])
def test_a_library_whose_top_level_misbehaves_is_refused_and_cores_live(spin_device, top, status, expect):
    src = "from dspx.device.core import runtime as rt\n" + top + "\nrt.register_op(0x3D20, lambda i, o, t: 0)\n"
    before = children(spin_device)
    with Tasks(socket=spin_device.path) as u:
        with pytest.raises(DeviceError) as e:
            u.load_ops(src)
        assert e.value.status_name == status and expect in str(e.value), e.value
        ops = u.client.request(P.OpsList(start=0))  # OPS_LIST still answers for everyone
        assert ops.total >= 4
    assert children(spin_device) == before


# ---------------------------------------------------------------- 7. op libraries

def test_builtin_and_other_libraries_ops_cannot_be_replaced(spin_device):
    with Tasks(socket=spin_device.path) as u:
        for cmd, owner in ((0x1402, "built-in"), (SPIN, "op library")):
            src = f"from dspx.device.core import runtime as rt\nrt.register_op({cmd}, lambda i, o, t: 0)\n"
            with pytest.raises(DeviceError) as e:
                u.load_ops(src)
            assert e.value.status_name == "ERR_BUSY" and f"0x{cmd:x}" in str(e.value), e.value
        from dspx.host.tasks import softmax_param
        x = np.linspace(-3, 3, 64, dtype=np.float32)
        data, param, out = u.malloc(256), u.malloc(24), u.malloc(256)
        data.view(np.float32)[:] = x
        softmax_param(param, data, 64, tiled=False)
        u.run(0x1402, param, out)
        ref = np.exp(x - x.max()) / np.exp(x - x.max()).sum()
        np.testing.assert_allclose(out.view(np.float32), ref, rtol=1e-5)


EXIT_ON_CORE1 = textwrap.dedent("""
    from numpy.f2py import os  # an escape from the import check: op libraries are trusted code
    from dspx.device.core import runtime as rt
    fd = os.open("/proc/self/cmdline", 0)
    args = os.read(fd, 4096).split(b"\\0")
    os.close(fd)
    if args[args.index(b"--index") + 1] == b"1":
        os._exit(3)

    @rt.register_op(0x3E01)
    def op(inp, out, tm):
        return 5
""")


def test_a_library_that_exits_on_core_1_only_is_refused_and_unloaded_everywhere(spin_device):
    before = spin_device.output().count("core 1 died")
    with Tasks(socket=spin_device.path) as u:
        with pytest.raises(DeviceError) as e:
            u.load_ops(EXIT_ON_CORE1)
        assert e.value.status_name == "ERR_CALL" and "core 1: core 1 crashed" in str(e.value), e.value
        assert 0x3E01 not in [o["cmd"] for o in u.ops()]
        with pytest.raises(DeviceError) as e:  # nor does core 0 keep it
            u.run(0x3E01, u.malloc(4), u.malloc(4), core=0)
        assert e.value.status_name == "ERR_OP"
        # the command id is free again, and core 1 (restarted once, not in a loop) serves it
        u.load_ops("from dspx.device.core import runtime as rt\nrt.register_op(0x3E01, lambda i, o, t: 9)\n")
        with pytest.raises(OpFailed) as e:  # it returns 9: the op ran on core 1 and said so
            u.run(0x3E01, u.malloc(4), u.malloc(4), core=1)
        assert (e.value.return_value, e.value.core) == (9, 1)
    time.sleep(0.5)
    assert spin_device.output().count("core 1 died") == before + 1


HANG_ON_CORE1 = textwrap.dedent("""
    from numpy.f2py import os
    from dspx.device.core import runtime as rt
    fd = os.open("/proc/self/cmdline", 0)
    args = os.read(fd, 4096).split(b"\\0")
    os.close(fd)
    if args[args.index(b"--index") + 1] == b"1":
        while True:
            try:
                while True:
                    pass
            except BaseException:
                if STUBBORN:
                    continue
                raise

    @rt.register_op(0x3E02)
    def op(inp, out, tm):
        return 5
""")


@pytest.mark.parametrize("stubborn", [False, True])
def test_a_library_that_hangs_at_import_on_one_core_is_refused_everywhere(stubborn):
    # Core 0 loads it first (and must finish within the limit, which also
    # bounds the load: 5 s, room for a loaded machine), then core 1 hangs.
    d = Device("--carveout-size", "64M", "--cores", "2", "--job-timeout", "5")
    try:
        with Tasks(socket=d.path) as u:
            t0 = time.monotonic()
            with pytest.raises(DeviceError) as e:
                u.load_ops(f"STUBBORN = {stubborn}\n" + HANG_ON_CORE1)
            took = time.monotonic() - t0
            assert str(e.value).split(": ", 1)[1].startswith("core 1:"), e.value
            if stubborn:  # it would not stop: its core was killed and restarted
                assert e.value.status_name == "ERR_TIMEOUT" and "restarted" in str(e.value), e.value
            else:  # interrupted in its own code
                assert e.value.status_name == "ERR_LOAD" and "time limit" in str(e.value), e.value
            assert took < 60, f"refused after {took:.1f} s (limit 5 s)"
            assert 0x3E02 not in [o["cmd"] for o in u.ops()]
            with pytest.raises(DeviceError):
                u.run(0x3E02, u.malloc(4), u.malloc(4), core=0)
    finally:
        d.stop()
