"""Shares per client process, not per connection (issue 31, finding 8): the
carveout window, the DDR pool and the connections are counted over every
connection of one peer process (SO_PEERCRED pid), so a second connection or a
second load of the same model takes nothing more from another process.
docs/reliability.md §6 "Shares per client process" states the defaults."""
from __future__ import annotations

import re
import subprocess
import sys
import time

import pytest

from dspx.device.front.state import Limits
from dspx.errors import DeviceError, OutOfMemory
from dspx.host.client import Client
from conftest import Device

MiB = 1 << 20


def in_another_process(code: str) -> str:
    """Run ``code`` (``dev`` is the device's socket path) in a fresh Python process; its stdout."""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    return out.stdout.strip()


def test_the_per_process_shares_are_three_quarters_and_an_eighth_of_the_connections_is_kept():
    lim = Limits.for_device(1024, 512 * MiB, None, 352 * MiB)
    assert (lim.peer_bytes, lim.peer_ddr) == (384 * MiB, 264 * MiB)
    assert (lim.conns, lim.conns_per_peer, lim.conns_reserved) == (256, 64, 32)
    assert Limits.for_device(16, 64 * MiB, None, 0).conns_reserved == 1  # never none


@pytest.fixture
def dev():
    d = Device("--carveout-size", "64M", "--ddr-pool-size", "64M")
    yield d
    d.stop()


def test_two_connections_of_one_process_cannot_take_more_than_its_window_share(dev):
    """48 MiB of the 64 MiB window per process while another process is
    connected: before, each connection had 48 MiB, two took the whole window
    and another process's default client could not attach its 64 KiB printf ring."""
    a = Client(dev.path, staging_size=0, printf_size=0, timeout=30)
    b = Client(dev.path, staging_size=0, printf_size=0, timeout=30)
    other = _holder(dev.path, 1)
    try:
        assert _until_held(other)[0] == 1
        a.alloc(32 * MiB)
        with pytest.raises(OutOfMemory) as e:
            b.alloc(32 * MiB)
        pid = re.search(r"process (\d+)'s", str(e.value))
        assert pid and int(pid.group(1)) == __import__("os").getpid(), e.value
        assert f"process quota: {32 * MiB} bytes requested, {32 * MiB} of {48 * MiB} attached" in str(e.value)
        assert b.alloc(16 * MiB)  # up to the share
        got = in_another_process(f"from dspx.host.client import Client; c = Client({dev.path!r}); "
                                 f"print(c.ping()['version'], c.alloc(8 << 20).size)")  # a default client
        assert got == f"3.0.0 {8 * MiB}"
    finally:
        other.stdin.close()
        other.wait(30)
        a.close()
        b.close()


def test_a_process_alone_on_the_device_may_use_all_of_it(dev):
    """The shares bind while another process is connected: alone, two
    connections take 32 + 24 MiB of the 64 MiB window (past the 48 MiB share)."""
    with Client(dev.path, staging_size=0, printf_size=0, timeout=30) as a, \
            Client(dev.path, staging_size=0, printf_size=0, timeout=30) as b:
        a.alloc(32 * MiB)
        assert b.alloc(24 * MiB).size == 24 * MiB


@pytest.fixture
def small_ddr_dev():
    """An 8 MiB DDR pool: its 6 MiB share fills in ~60 loads (the 64 MiB pool's 48 took ~480, 83 s)."""
    d = Device("--carveout-size", "64M", "--ddr-pool-size", "8M")
    yield d
    d.stop()


def test_loading_the_same_module_again_and_again_stops_at_the_process_ddr_share(small_ddr_dev, compiled):
    dev = small_ddr_dev
    elf = (compiled("multi_output") / "model.so").read_bytes()
    other = _holder(dev.path, 1)  # another process is connected: the share binds
    assert _until_held(other)[0] == 1
    with Client(dev.path, staging_size=1 * MiB, timeout=60) as c:
        first = c.load_module(elf)
        one = c.pools()["ddr_used"]
        assert one > 0
        share = 8 * MiB * 3 // 4  # three quarters of the pool per process while another is connected
        n = 1
        with pytest.raises(OutOfMemory) as e:
            for _ in range(share // one + 2):
                c.load_module(elf)
                n += 1
        assert n == share // one, (n, one)  # as many as fit in the share, by hand
        assert "process quota: module needs" in str(e.value) and f"of its {share}" in str(e.value), e.value
        assert e.value.status_name == "ERR_NOMEM"
        assert c.pools()["ddr_used"] == n * one  # the refused copy was unloaded again
        # another process's load still fits
        got = in_another_process(f"from dspx.host.client import Client; import pathlib; "
                                 f"c = Client({dev.path!r}, staging_size=1 << 20); "
                                 f"print(c.load_module(pathlib.Path({str(compiled('multi_output') / 'model.so')!r})"
                                 f".read_bytes()).handle > 0)")
        assert got == "True"
        c.unload_module(first.handle)
    other.stdin.close()
    other.wait(30)


def _holder(path: str, n: int) -> subprocess.Popen:
    """A process that opens ``n`` raw connections (each PINGed: a refused one
    answers ERR_BUSY), says how many it got, and holds them until stdin closes."""
    code = f"""
import socket, struct, sys
held = []
for seq in range(1, {n} + 1):
    s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    s.settimeout(30)
    s.connect({path!r})
    s.send(struct.pack("<IIIi", 1, seq, 16, 0))  # PING
    status = struct.unpack_from("<IIIi", s.recv(64))[3]
    if status != 0:
        s.send(struct.pack("<IIIi", 0x60, 99, 16, 0))  # GET_ERROR: which limit
        print("refused", s.recv(4096)[24:].decode(errors="replace").replace(chr(10), " "), flush=True)
        break
    held.append(s)
print("held", len(held), flush=True)
sys.stdin.read()
"""
    return subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)


def _until_held(p: subprocess.Popen) -> tuple[int, str]:
    refused = ""
    for line in p.stdout:
        if line.startswith("refused"):
            refused = line
        if line.startswith("held"):
            return int(line.split()[1]), refused
    raise AssertionError("holder ended early")


def test_greedy_processes_leave_the_last_connections_to_processes_with_none():
    """At a 64-fd limit: 16 connections, 4 per process, the last 2 kept for
    processes that have none.  Before, four greedy processes took all 16 and
    a fifth was locked out."""
    d = Device("--carveout-size", "64M", "--ddr-pool-size", "64M", prefix=("prlimit", "--nofile=64:64"))
    holders = []
    try:
        deadline = time.monotonic() + 30
        while "listening on" not in d.output():  # the line comes just after the socket listens
            assert time.monotonic() < deadline, d.output()[-2000:]
            time.sleep(0.05)
        assert "16 connections (4 per process), the last 2 kept for new processes" in d.output(), d.output()
        got = []
        for _ in range(4):  # 4 + 4 + 4 + 2: the fourth stops at 14
            holders.append(_holder(d.path, 4))
            got.append(_until_held(holders[-1]))
        assert [n for n, _ in got] == [4, 4, 4, 2], got
        assert "the last 2 are kept for processes with none" in got[3][1], got[3]
        for _ in range(2):  # newcomers still get in, one connection each
            holders.append(_holder(d.path, 1))
            assert _until_held(holders[-1])[0] == 1
    finally:
        for p in holders:
            p.stdin.close()
            p.wait(30)
        d.stop()


# ---------------------------------------------------------------- time limits (finding 9)

def test_a_job_time_limit_is_on_by_default():
    from click.testing import CliRunner

    from dspx.abi.protocol import DEFAULT_JOB_TIMEOUT_S
    from dspx.cli import main
    assert DEFAULT_JOB_TIMEOUT_S == 120.0
    out = CliRunner().invoke(main, ["serve", "--help"]).output
    assert re.search(r"--job-timeout.*\[default: 120\.0;", " ".join(out.split())), out
    dev = subprocess.run([sys.executable, "-m", "dspx.device", "--help"], capture_output=True, text=True,
                         timeout=60).stdout
    assert "default 120" in " ".join(dev.split()), dev


LOOPS_AT_IMPORT = """
from dspx.device.core import runtime as rt
while True:
    pass
"""


def test_a_library_whose_top_level_loops_holds_one_core_not_all():
    """Libraries load on core 0 first: while its top level loops there (until
    the 10 s limit), core 1 serves a bystander; before, it looped on both."""
    import threading

    from dspx.host.tasks import SOFTMAX_CMD, Tasks, softmax_param
    import numpy as np

    d = Device("--carveout-size", "64M", "--cores", "2", "--job-timeout", "10")
    try:
        result = {}

        def load():
            with Tasks(socket=d.path) as u:
                try:
                    u.load_ops(LOOPS_AT_IMPORT)
                except DeviceError as e:
                    result["error"] = e

        t = threading.Thread(target=load)
        t.start()
        deadline = time.monotonic() + 30
        while not any(p for p in __import__("psutil").Process(d.proc.pid).children()
                                              if p.cpu_percent(0.05) > 50):
            assert time.monotonic() < deadline, "the loading core never got busy"
        with Tasks(socket=d.path) as b:
            x = np.linspace(-1, 1, 256, dtype=np.float32)
            data, param, out = b.malloc(x.nbytes), b.malloc(4096), b.malloc(x.nbytes)
            data.buf.mm[:x.nbytes] = x.tobytes()
            softmax_param(param, data, x.size, False)
            b.run(SOFTMAX_CMD, param, out, core=1, timeout_ms=60_000)
            served_during_load = t.is_alive()
            got = np.frombuffer(bytes(out.buf.mm[:x.nbytes]), np.float32)
        np.testing.assert_allclose(got, np.exp(x - x.max()) / np.exp(x - x.max()).sum(), rtol=1e-5)
        assert served_during_load, "core 1 answered only after the load ended"
        t.join(60)
        e = result["error"]
        assert e.status_name in ("ERR_LOAD", "ERR_TIMEOUT") and str(e).split(": ", 1)[1].startswith("core 0:"), e
    finally:
        d.stop()


def test_two_default_clients_share_a_default_device():
    d = Device()  # the default sizes: 512 MiB window
    try:
        a, b = Client(d.path), Client(d.path)
        pools = a.pools()
        # PING-only clients: their printf rings, no staging, no KV
        assert pools["carveout_used"] == 2 * (64 << 10), pools
        assert a.staging is None and b.staging is None
        # staging on first need, sized to it (1 MiB here); the KV region when first used
        src = b"x" * 1000
        a._stage(src, "test")
        assert a.staging.size == 1 << 20
        kv = a.kv_view(0, (4,), "float32")
        kv[:] = [1, 2, 3, 4]
        assert a.staging.size == (1 << 20) + a.kv_size
        a._stage(b"y" * (3 << 20), "test")  # grows; the KV contents come along
        assert a.staging.size == (3 << 20) + a.kv_size
        assert list(a.kv_view(0, (4,), "float32")) == [1, 2, 3, 4]
        # both clients can take memory; neither can take the whole window
        keep = [b.alloc(64 << 20) for _ in range(2)]
        with pytest.raises(OutOfMemory) as e:
            for _ in range(8):
                keep.append(a.alloc(64 << 20))
        assert "connection quota" in str(e.value) and "of 402653184" in str(e.value), e.value
        assert b.alloc(1 << 20)  # the other client still gets memory
        a.close()
        b.close()
    finally:
        d.stop()
