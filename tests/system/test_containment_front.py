"""The front confines itself (issue 31, docs/containment.md "The front's
own confinement"): it is non-dumpable, runs under its own seccomp filter
once started (no execve, no new sockets), and its cores are started and
restarted by the core spawner (device/front/spawner.py)."""
from __future__ import annotations

import os
import signal
import struct
import subprocess
import sys
import time

import psutil
import pytest

import attacks
from conftest import Device
from dspx.errors import CallFailed, DeviceError
from dspx.host.client import Client
from dspx.host.tasks import Tasks

FAULT_CRASH = 0xFA01  # dspx.abi.ops.FAULT_CRASH_CMD, written out
CAP_SYS_PTRACE = 19


def _device(*args, faults: bool = False) -> Device:
    old = os.environ.copy()
    if faults:
        os.environ["DSPX_FAULT_INJECTION"] = "1"
    try:
        return Device("--carveout-size", "64M", "--ddr-pool-size", "32M", *args)
    finally:
        os.environ.clear()
        os.environ.update(old)


def _kids(d: Device) -> dict[int, str]:
    return {p.pid: p.name() for p in psutil.Process(d.proc.pid).children()}


def _spawner(d: Device) -> int:
    (pid,) = [p for p, name in _kids(d).items() if name == "dspx-spawner"]
    return pid


def _cores(d: Device) -> set[int]:
    return {p for p, name in _kids(d).items() if name != "dspx-spawner"}


def _status(pid: int) -> dict[str, str]:
    with open(f"/proc/{pid}/status") as f:
        return dict(line.rstrip("\n").split(":\t", 1) for line in f if ":\t" in line)


def _ping(path: str) -> None:
    with Client(path, staging_size=0, printf_size=0, timeout=20) as c:
        c.ping()


@pytest.fixture(scope="module")
def dev():
    d = _device("--cores", "1", faults=True)
    yield d
    d.stop()


# ---------------------------------------------------------------- non-dumpable, filtered

# Run as root without CAP_SYS_PTRACE (a core's standing once its
# capabilities are dropped), a device and a plain process are started with
# the same capabilities, so only dumpability decides: /proc/<pid>/fd and /mem
# of a non-dumpable process are closed, of a dumpable one open.
PROBE = r"""
import os, subprocess, sys, time
import psutil
from dspx.transport import is_listening
path = sys.argv[1]
plain = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
dev = subprocess.Popen([sys.executable, "-m", "dspx.device", "--socket", path, "--quiet"])
try:
    deadline = time.monotonic() + 60
    while not is_listening(path):
        assert time.monotonic() < deadline and dev.poll() is None
        time.sleep(0.02)
    (spawner,) = [p.pid for p in psutil.Process(dev.pid).children() if p.name() == "dspx-spawner"]
    for who, pid in (("plain", plain.pid), ("front", dev.pid), ("spawner", spawner)):
        for what in ("fd/0", "mem"):
            try:
                os.close(os.open(f"/proc/{pid}/{what}", os.O_RDONLY))
                print("open", who, what)
            except OSError as e:
                print("refused", who, what, e.errno)
finally:
    dev.terminate(); plain.kill(); dev.wait(20); plain.wait(20)
"""


def test_the_front_is_under_seccomp_from_start(dev):
    _ping(dev.path)  # answered only once the front has started (its filter is on)
    st = _status(dev.proc.pid)
    assert st["Seccomp"] == "2" and st["NoNewPrivs"] == "1", st


def test_the_front_and_its_spawner_are_non_dumpable(tmp_path):
    out = subprocess.run(["setpriv", "--bounding-set=-sys_ptrace", sys.executable, "-c", PROBE,
                          str(tmp_path / "dsp0.sock")], capture_output=True, text=True, timeout=120)
    lines = out.stdout.split("\n")
    assert "open plain fd/0" in lines and "open plain mem" in lines, out  # the probe can open a dumpable peer's
    for who in ("front", "spawner"):  # the spawner is a fork of the front
        for what in ("fd/0", "mem"):
            assert f"refused {who} {what} 13" in lines, out  # EACCES


# ---------------------------------------------------------------- the filter, decoded

def _run_bpf(code: bytes, nr: int, args=(0,) * 6, arch: int = 0xC000003E) -> int:
    """A classic-BPF interpreter for the five instructions a seccomp filter
    here uses, over a hand-packed struct seccomp_data."""
    data = struct.pack("<iIQ6Q", nr, arch, 0, *args)
    insns = [struct.unpack_from("<HBBI", code, i) for i in range(0, len(code), 8)]
    pc, acc = 0, 0
    while True:
        op, jt, jf, k = insns[pc]
        if op == 0x20:  # BPF_LD | BPF_W | BPF_ABS
            acc = struct.unpack_from("<I", data, k)[0]
            pc += 1
        elif op == 0x15:  # JEQ K
            pc += 1 + (jt if acc == k else jf)
        elif op == 0x35:  # JGE K
            pc += 1 + (jt if acc >= k else jf)
        elif op == 0x45:  # JSET K
            pc += 1 + (jt if acc & k else jf)
        elif op == 0x06:  # RET K
            return k
        else:
            raise AssertionError(f"unexpected BPF opcode {op:#x}")


KILL, EPERM_, ENOSYS_, ALLOW = 0x80000000, 0x00050001, 0x00050026, 0x7FFF0000


def test_the_fronts_filter_allows_no_exec_no_new_socket_and_accept_only_on_its_listening_socket():
    from dspx.device import sandbox

    lfd = 5
    code = sandbox.front_program(lfd)
    # x86-64 numbers, from asm/unistd_64.h
    for nr, name in ((59, "execve"), (322, "execveat"), (101, "ptrace"), (310, "process_vm_readv"),
                     (311, "process_vm_writev"), (165, "mount"), (313, "finit_module"), (321, "bpf"),
                     (438, "pidfd_getfd")):
        assert _run_bpf(code, nr) == KILL, name
    for nr, name in ((41, "socket"), (53, "socketpair"), (42, "connect"), (49, "bind"), (50, "listen"),
                     (57, "fork"), (58, "vfork")):
        assert _run_bpf(code, nr) == EPERM_, name
    assert _run_bpf(code, 288, (lfd, 0, 0, 0, 0x80800, 0)) == ALLOW  # accept4 on the listening socket
    assert _run_bpf(code, 288, (lfd + 1,) + (0,) * 5) == EPERM_  # on any other socket
    assert _run_bpf(code, 56, (17,) + (0,) * 5) == EPERM_  # clone(SIGCHLD): a process
    assert _run_bpf(code, 56, (0x3D0F00,) + (0,) * 5) == ALLOW  # glibc's pthread_create flags
    assert _run_bpf(code, 435) == ENOSYS_  # clone3: libc falls back to clone
    for nr in (0, 1, 232, 46, 47, 62, 61, 257):  # read write epoll_wait sendmsg recvmsg kill wait4 openat
        assert _run_bpf(code, nr) == ALLOW, nr
    assert _run_bpf(code, 59, arch=0x40000003) == KILL  # i386: another table of numbers
    assert _run_bpf(code, 59 | 0x40000000) == KILL  # x32


# ---------------------------------------------------------------- cores come from the spawner

def test_a_crashed_core_is_restarted_through_the_spawner_and_the_device_serves(dev):
    spawner, (core,) = _spawner(dev), _cores(dev)
    with Tasks(socket=dev.path) as u:
        t = u.submit(u.rpc(FAULT_CRASH, u.malloc(4), u.malloc(4)), core=0)
        with pytest.raises(CallFailed, match="core 0 crashed"):
            u.wait(t, 20_000)
        deadline = time.monotonic() + 60
        while True:  # the restarted core answers
            try:
                u.run(0x1402, u.malloc(24), u.malloc(4), core=0)
                break
            except DeviceError:
                assert time.monotonic() < deadline
                time.sleep(0.1)
    (new,) = _cores(dev)
    assert new != core and psutil.Process(new).ppid() == dev.proc.pid  # the front's own child
    assert _spawner(dev) == spawner  # the same spawner started it
    assert "--index" in psutil.Process(new).cmdline()
    assert "core 0 died (exit 70); restarting" in dev.output()
    _ping(dev.path)


def test_with_the_spawner_gone_the_device_serves_and_a_lost_cores_jobs_fail_with_a_status():
    d = _device("--cores", "2", faults=True)
    try:
        _ping(d.path)  # started: both cores said hello
        os.kill(_spawner(d), signal.SIGKILL)
        deadline = time.monotonic() + 30
        while "core spawner" not in d.output():
            assert time.monotonic() < deadline, d.output()
            time.sleep(0.05)
        with Tasks(socket=d.path) as u:
            t = u.submit(u.rpc(FAULT_CRASH, u.malloc(4), u.malloc(4)), core=0)
            with pytest.raises(CallFailed, match="core 0 crashed"):
                u.wait(t, 20_000)
            for _ in range(2):  # core 0 is lost: a status each time, no hang
                t = u.submit(u.rpc(0x1402, u.malloc(24), u.malloc(4)), core=0)
                with pytest.raises(CallFailed) as e:
                    u.wait(t, 20_000)
                assert e.value.status_name == "ERR_CALL"
            u.run(0x1402, u.malloc(24), u.malloc(4), core=1)  # core 1 still serves
        _ping(d.path)
        assert d.alive()
        out = d.output()
        assert "died (exit -9); the device serves on, but a core that dies now cannot be restarted" in out
        assert "core 0 cannot be restarted: the core spawner" in out
    finally:
        d.stop()


# ---------------------------------------------------------------- attacks from a core

# Opens /proc/<front>/mem and /proc/<front>/fd/0 read-only (the core's
# filter allows read-only opens).  Refused: returns 1; opened: crashes, so
# the place shows it (a failed call, a refused load) as well as the handler.
PROC_OPEN = r"""
char mem[40] = "/proc/", fd[40];
int n = 6; char digits[20]; int k = 0; uint64_t v = ATTACK_ARG;
do { digits[k++] = '0' + v % 10; v /= 10; } while (v);
while (k) mem[n++] = digits[--k];
memcpy(fd, mem, n); memcpy(mem + n, "/mem", 5); memcpy(fd + n, "/fd/0", 6);
long a = sc(2, (long)mem, 0, 0, 0, 0, 0), b = sc(2, (long)fd, 0, 0, 0, 0, 0);
if (a >= 0 || b >= 0) *(volatile int *)0 = 1;
return 1;
"""


@pytest.fixture(scope="module")
def capped():
    """A device without CAP_SYS_PTRACE (the standing of cores once they drop
    their capabilities): the front and its cores hold the same capabilities,
    so only the front's dumpability decides whether a core can open its /proc."""
    d = Device("--carveout-size", "64M", "--ddr-pool-size", "32M", "--cores", "1",
               prefix=("setpriv", "--bounding-set=-sys_ptrace"))
    yield d
    d.stop()


@attacks.needs_cc
@pytest.mark.parametrize("place", attacks.PLACES)
def test_code_on_a_core_cannot_open_the_fronts_fds_or_memory(capped, tmp_path, place):
    _ping(capped.path)
    (core,) = _cores(capped)
    assert not int(_status(core)["CapEff"], 16) >> CAP_SYS_PTRACE & 1  # the kernel lets that cap past dumpability
    front = capped.proc.pid
    got = attacks.launch(capped.path, tmp_path, place, PROC_OPEN, arg=front)
    if place == "handler":
        assert got.status == "" and got.value == 1, got
    elif place == "init":
        assert got.status == "", got
    else:  # the fake module: refused after its constructor ran, and not for a crash
        assert got.status == "ERR_LOAD" and "dynamic loading failed" in got.error, got
    assert capped.alive()
    assert "died" not in capped.output()
    _ping(capped.path)
