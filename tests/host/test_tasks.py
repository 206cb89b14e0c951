"""Custom operators through the real device: UCP-style tasks, op libraries
sent at runtime, several cores, priorities, timeouts and failures."""
import json
import os
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest
import scipy.special

from dspx.errors import (BadHandle, Busy, CallFailed, DeviceTimeout, MissingSymbol, ModuleLoadError, OpFailed,
                         UnknownOp)
from dspx.host.tasks import SOFTMAX_CMD, Tasks, softmax_param
from conftest import Device

# An op library for these tests: a busy loop that holds the interpreter (so
# parallel cores prove separate interpreters), and a recorder of start order.
TEST_OPS = textwrap.dedent("""
    import numpy as np
    from dspx.device.core import runtime as rt

    _order = [0]

    @rt.register_op(0x3001, latency_us=200000)
    def spin(inp, out, tm):
        ms = int(np.frombuffer(inp, np.int32, count=1)[0])
        t0 = rt.cycles()
        n = 0
        while rt.cycles() - t0 < ms * 1_000_000:
            n += 1  # pure Python: holds this core's GIL the whole time
        out[:8] = np.frombuffer(np.int64(n).tobytes(), np.uint8)
        return 0

    @rt.register_op(0x3002)
    def record(inp, out, tm):
        _order[0] += 1
        out[:4] = np.frombuffer(np.int32(_order[0]).tobytes(), np.uint8)
        return 0

    @rt.register_op(0x3003)
    def boom(inp, out, tm):
        rt.printf("about to fail\\n")
        raise ValueError("deliberate failure in a handler")

    @rt.register_op(0x3004)
    def peek(inp, out, tm):
        addr, n = np.frombuffer(inp, np.uint64, count=2)
        src = rt.mem_map(int(addr), int(n))
        out[:int(n)] = src
        return 7
""")


@pytest.fixture(scope="module")
def dev2():
    d = Device("--carveout-size", "256M", "--cores", "2")
    yield d
    d.stop()


@pytest.fixture
def ucp(dev2):
    with Tasks(socket=dev2.path) as u:
        yield u


@pytest.fixture(scope="module")
def test_lib(dev2):
    with Tasks(socket=dev2.path) as u:
        handle, n = u.load_ops(TEST_OPS, device_wide=True)  # the tests use it from sessions of their own
    assert n == 4
    yield handle


def i32(mem, value):
    mem.view(np.int32, 1)[0] = value
    return mem


@pytest.mark.parametrize("n", [1, 7, 100_000, (1 << 18) + 3])
def test_softmax_direct_and_tiled_match_scipy(ucp, n):
    data = ucp.malloc(4 * n)
    x = data.view(np.float32)
    x[:] = np.random.default_rng(n).standard_normal(n).astype(np.float32) * 4
    param, out_d, out_t = ucp.malloc(24), ucp.malloc(4 * n), ucp.malloc(4 * n)
    softmax_param(param, data, n, tiled=False)
    t1 = ucp.run(SOFTMAX_CMD, param, out_d)
    softmax_param(param, data, n, tiled=True)
    t2 = ucp.run(SOFTMAX_CMD, param, out_t)
    ref = scipy.special.softmax(x.astype(np.float64))
    d, t = out_d.view(np.float32), out_t.view(np.float32)
    assert np.max(np.abs(d - ref) / ref) < 1e-5
    assert np.max(np.abs(t - d) / d) <= 1e-6
    assert t1.return_value == 0 and t1.cycles > 0 and t2.cycles > 0
    assert "cycles" in t1.printf and "ping-pong" in t2.printf


def test_param_struct_is_the_seeds_c_layout(ucp):
    p, data = ucp.malloc(24), ucp.malloc(64)
    softmax_param(p, data, 16, tiled=True)
    raw = bytes(p.vir[:24])
    assert raw[:4] == (64).to_bytes(4, "little")
    assert raw[8:16] == data.phy.to_bytes(8, "little") and raw[16] == 1


def test_several_tasks_in_flight_and_pinned_cores(ucp, test_lib):
    ins = [i32(ucp.malloc(4), 100) for _ in range(2)]
    outs = [ucp.malloc(8) for _ in range(2)]
    tasks, submitted = [], []
    for i in range(2):
        submitted.append(time.monotonic())
        tasks.append(ucp.submit(ucp.rpc(0x3001, ins[i], outs[i]), core=i))
    for t in tasks:
        ucp.wait(t, 5000)
    assert [t.core for t in tasks] == [0, 1]
    assert all(t.state == "done" for t in tasks)
    assert_ran_together(tasks, submitted)


def assert_ran_together(tasks, submitted):
    """From each task's own figures (queued_us, then cycles at 1 GHz): both
    started before either ended, overlapping for at least half the shorter run
    (one after the other they would not overlap at all)."""
    spans = [(s + t.queued_us / 1e6, s + t.queued_us / 1e6 + t.cycles / 1e9) for s, t in zip(submitted, tasks)]
    overlap = min(e for _, e in spans) - max(b for b, _ in spans)
    shorter = min(e - b for b, e in spans)
    assert overlap > shorter / 2, (f"runs overlapped {overlap * 1000:.0f} ms of {shorter * 1000:.0f} ms "
                                   f"(spans from submission: {[(round(b - submitted[0], 3), round(e - submitted[0], 3)) for b, e in spans]})")


def test_two_cores_really_run_in_parallel(ucp, test_lib):
    """Two 200 ms pure-Python ops given to any core run on both at once."""
    ins = [i32(ucp.malloc(4), 200) for _ in range(2)]
    outs = [ucp.malloc(8) for _ in range(2)]
    tasks, submitted = [], []
    for i in range(2):
        submitted.append(time.monotonic())
        tasks.append(ucp.submit(ucp.rpc(0x3001, ins[i], outs[i])))
    for t in tasks:
        ucp.wait(t, 5000)
    assert sorted(t.core for t in tasks) == [0, 1]  # ANY spread them
    assert_ran_together(tasks, submitted)


def test_priorities_drain_highest_first(dev2, test_lib):
    with Tasks(socket=dev2.path) as u:
        block = u.submit(u.rpc(0x3001, i32(u.malloc(4), 300), u.malloc(8)), core=0)
        time.sleep(0.05)  # core 0 is now busy
        prios = [3, 200, 0, 90, 255, 17]
        tasks = [u.submit(u.rpc(0x3002, u.malloc(4), u.malloc(4)), core=0, priority=p) for p in prios]
        u.wait(block, 5000)
        for t in tasks:
            u.wait(t, 5000)
        started = [int(t.output.view(np.int32, 1)[0]) for t in tasks]
        order = [p for _, p in sorted(zip(started, prios))]
        assert order == sorted(prios, reverse=True)


def test_a_running_op_past_its_limit_is_stopped_without_costing_its_core():
    """A Python op past its limit is interrupted in its own code (ERR_TIMEOUT)
    and its core serves the next task: under --job-timeout, and under the
    task's own timeout_ms."""
    import psutil

    d = Device("--carveout-size", "64M", "--cores", "1", "--job-timeout", "0.3")
    try:
        with Tasks(socket=d.path) as u:
            u.load_ops(TEST_OPS)
            cores = {p.pid for p in psutil.Process(d.proc.pid).children()}
            for timeout_ms in (0, 200):  # the device's limit, then the task's own
                t = u.submit(u.rpc(0x3001, i32(u.malloc(4), 30_000), u.malloc(8)), timeout_ms=timeout_ms)
                with pytest.raises(Exception) as e:
                    u.wait(t, 20_000)
                assert getattr(e.value, "status_name", "") == "ERR_TIMEOUT", e.value
            ok = u.run(0x3001, i32(u.malloc(4), 10), u.malloc(8))  # 10 ms: within the limit
            assert ok.state == "released"
            assert {p.pid for p in psutil.Process(d.proc.pid).children()} == cores  # no core was killed
    finally:
        d.stop()


def test_wait_timeout_and_device_side_queue_timeout(dev2, test_lib):
    with Tasks(socket=dev2.path) as u:
        long = u.submit(u.rpc(0x3001, i32(u.malloc(4), 400), u.malloc(8)), core=1)
        with pytest.raises(DeviceTimeout):
            u.wait(long, timeout_ms=50)
        # Queued behind it with a 50 ms device-side limit: ERR_TIMEOUT, never started.
        late = u.submit(u.rpc(0x3002, u.malloc(4), u.malloc(4)), core=1, timeout_ms=50)
        with pytest.raises(Exception) as e:
            u.wait(late, 5000)
        assert getattr(e.value, "status_name", "") == "ERR_TIMEOUT"
        u.wait(long, 5000)  # the long one still completes
        assert long.state == "done"


def test_handler_exception_is_err_call_with_traceback_and_device_keeps_serving(ucp, test_lib, capsys):
    with pytest.raises(CallFailed) as e:
        ucp.run(0x3003, ucp.malloc(4), ucp.malloc(4))
    assert e.value.status_name == "ERR_CALL"
    printed = capsys.readouterr().err
    assert "about to fail" in printed and "Traceback" in printed and "deliberate failure" in printed
    t = ucp.run(0x3002, ucp.malloc(4), ucp.malloc(4))
    assert t.return_value == 0 and t.state == "released"


def test_mem_map_respects_connection_buffers(dev2, test_lib):
    with Tasks(socket=dev2.path) as a, Tasks(socket=dev2.path) as b:
        src = a.malloc(64)
        src.vir[:] = np.arange(64, dtype=np.uint8)
        inp = a.malloc(16)
        inp.view(np.uint64)[:] = [src.phy, 64]
        out = a.malloc(64)
        with pytest.raises(OpFailed) as e:  # peek returns 7 after its copy
            a.run(0x3004, inp, out)
        assert e.value.return_value == 7 and bytes(out.vir) == bytes(range(64))
        # Another connection naming a's buffer: ERR_ADDR from mem_map.
        inp_b = b.malloc(16)
        inp_b.view(np.uint64)[:] = [src.phy, 64]
        with pytest.raises(Exception) as e:
            b.run(0x3004, inp_b, b.malloc(64))
        assert e.value.status_name == "ERR_ADDR"


def test_unknown_cmd_and_bad_core(ucp):
    with pytest.raises(UnknownOp):
        ucp.run(0x7777, ucp.malloc(4), ucp.malloc(4))
    with pytest.raises(Exception) as e:
        ucp.run(SOFTMAX_CMD, ucp.malloc(24), ucp.malloc(4), core=5)
    assert e.value.status_name == "ERR_INVALID"


def test_op_library_refusals(ucp):
    with pytest.raises(MissingSymbol, match="os"):
        ucp.load_ops("import os\nfrom dspx.device.core import runtime as rt\n")
    with pytest.raises(ModuleLoadError) as e:
        ucp.load_ops("from dspx.device.core import runtime as rt\n\ndef f(:\n    pass\n")
    assert e.value.error_line == 3 and "line 3" in str(e.value)
    with pytest.raises(Busy, match="0x1402"):
        ucp.load_ops("from dspx.device.core import runtime as rt\nrt.register_op(0x1402, lambda i, o, t: 0)\n")
    assert [o["cmd"] for o in ucp.ops()].count(0x1402) == 1


def test_unload_unregisters(ucp):
    src = "from dspx.device.core import runtime as rt\nrt.register_op(0x3100, lambda i, o, t: 5)\n"
    h, n = ucp.load_ops(src)
    assert n == 1
    with pytest.raises(OpFailed, match="returned 5"):
        ucp.run(0x3100, ucp.malloc(4), ucp.malloc(4))
    ucp.unload_ops(h)
    assert 0x3100 not in [o["cmd"] for o in ucp.ops()]
    with pytest.raises(UnknownOp):
        ucp.run(0x3100, ucp.malloc(4), ucp.malloc(4))
    with pytest.raises(BadHandle):
        ucp.unload_ops(h)


def test_cli_load_ops_and_ops_json(dev2):
    env = {"DSPX_SOCKET": dev2.path, "PATH": "/usr/bin:/bin",  # the checkout under test, not the venv's install
           **{k: os.environ[k] for k in ("PYTHONPATH",) if k in os.environ}}
    r = subprocess.run([sys.executable, "-m", "dspx.cli", "load-ops", "examples/softmax/softmax_ops.py", "--json"],
                       capture_output=True, text=True, env=env, timeout=60)
    assert r.returncode == 0, r.stderr
    loaded = json.loads(r.stdout)
    assert loaded["status"] == "ok" and [o["cmd"] for o in loaded["ops"]] == [0x2402]
    r = subprocess.run([sys.executable, "-m", "dspx.cli", "ops", "--json"], capture_output=True, text=True,
                       env=env, timeout=60)
    listing = json.loads(r.stdout)["ops"]
    assert {"cmd": 0x1402, "name": "softmax", "latency_us": 0, "library": 0} in listing
    assert any(o["cmd"] == 0x2402 and o["library"] == loaded["library"] for o in listing)


def test_loaded_library_softmax_matches_builtin(dev2):
    with Tasks(socket=dev2.path) as u:
        if 0x2402 not in [o["cmd"] for o in u.ops()]:
            u.load_ops(open("examples/softmax/softmax_ops.py").read())
        n = 10_001
        data = u.malloc(4 * n)
        data.view(np.float32)[:] = np.linspace(-5, 5, n, dtype=np.float32)
        p, o1, o2 = u.malloc(24), u.malloc(4 * n), u.malloc(4 * n)
        softmax_param(p, data, n, tiled=True)
        u.run(SOFTMAX_CMD, p, o1)
        u.run(0x2402, p, o2)
        assert np.max(np.abs(o1.view(np.float32) - o2.view(np.float32)) / o1.view(np.float32)) <= 1e-6


def test_op_library_over_the_size_limit_is_err_size(ucp):
    from dspx.errors import OutputTooSmall
    big = "from dspx.device.core import runtime as rt\n" + "#" * (200 << 10) + "\n"
    with pytest.raises(OutputTooSmall, match="131072"):
        ucp.load_ops(big)
    assert ucp.run(SOFTMAX_CMD, ucp.malloc(24), ucp.malloc(4)).state == "released"


def test_an_op_that_returns_non_zero_raises_with_its_name_and_value(ucp):
    """As the C hbUCPWaitTaskDone (-EREMOTEIO): the op ran, returned -7, and
    wait/run say so, naming the op; the task keeps the code and can be released."""
    src = ("from dspx.device.core import runtime as rt\n"
           "rt.register_op(0x3110, lambda i, o, t: -7, name='fails_on_purpose')\n"
           "rt.register_op(0x3111, lambda i, o, t: 0, name='succeeds')\n")
    h, _ = ucp.load_ops(src)
    try:
        task = ucp.submit(ucp.rpc(0x3110, ucp.malloc(4), ucp.malloc(4)), core=0)
        with pytest.raises(OpFailed) as e:
            ucp.wait(task, timeout_ms=30_000)
        assert (e.value.cmd, e.value.name, e.value.return_value, e.value.core) == (0x3110, "fails_on_purpose", -7, 0)
        assert "op 0x3110 (fails_on_purpose) returned -7" in str(e.value) and e.value.task is task
        assert task.state == "failed" and task.return_value == -7
        with pytest.raises(OpFailed):  # waiting again says the same
            ucp.wait(task)
        ucp.release(task)
        with pytest.raises(OpFailed, match="returned -7") as e:  # run: the same, and the task released
            ucp.run(0x3110, ucp.malloc(4), ucp.malloc(4))
        assert e.value.task.state == "released"
        assert ucp.run(0x3111, ucp.malloc(4), ucp.malloc(4)).return_value == 0
    finally:
        ucp.unload_ops(h)
