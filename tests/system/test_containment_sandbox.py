"""Issue 31, findings 2-4: code on a core cannot reach other processes.

Every attack runs from each place a client's code runs (tests/attacks.py:
an operator, a library's init, a module's constructor) against a real
device.  docs/containment.md "The seccomp filters" states
the rules these tests hold it to."""
from __future__ import annotations

import ctypes
import errno
import os
import re
import subprocess
import sys
import time

import psutil
import pytest

import attacks
from conftest import SMALL, Device
from dspx.device import sandbox
from dspx.host.tasks import Tasks

pytestmark = [attacks.needs_cc, pytest.mark.skipif(not sandbox.supported(), reason="the sandbox is x86-64 Linux")]

MARKER = b"victim-secret-31"  # 16 bytes at the start of the victim's buffer
EXIT_OPENED, EXIT_FOUND = 77, 78  # how an attack that got something says so from any place


@pytest.fixture(scope="module")
def dev():
    d = Device(*SMALL, "--cores", "1")
    yield d
    d.stop()


def _front(dev) -> psutil.Process:
    return psutil.Process(dev.proc.pid)


def _tree(dev) -> set[int]:
    return {p.pid for p in _front(dev).children(recursive=True)}


def _core(dev) -> psutil.Process:
    (core,) = [p for p in _front(dev).children() if "dspx.device.core" in " ".join(p.cmdline())]
    return core


def _status(pid: int) -> dict[str, str]:
    with open(f"/proc/{pid}/status") as f:
        return dict(line.rstrip("\n").split(":\t", 1) for line in f if ":\t" in line)


def _assert_refused_in_probe(place: str, got: attacks.Outcome) -> None:
    """From a library's init or a module's constructor, the probe's filter ended the probe: the load is refused."""
    assert got.status == "ERR_LOAD" and "SIGSYS" in got.error, (place, got)


# ---------------------------------------------------------------- finding 2: /proc/<front>/fd
READ_FRONT_FDS = r"""
static const char marker[16] = "victim-secret-31";
long opened = 0, found = 0, err = 0;
for (int n = 0; n < 512; n++) {
    char path[64], digits[24];
    int len = 0, d = 0;
    const char *head = "/proc/";
    for (const char *c = head; *c; c++) path[len++] = *c;
    unsigned long v = ATTACK_ARG;
    do { digits[d++] = '0' + v % 10; v /= 10; } while (v);
    while (d) path[len++] = digits[--d];
    for (const char *c = "/fd/"; *c; c++) path[len++] = *c;
    v = (unsigned long)n;
    do { digits[d++] = '0' + v % 10; v /= 10; } while (v);
    while (d) path[len++] = digits[--d];
    path[len] = 0;
    long fd = sc(2, (long)path, 0, 0, 0, 0, 0);  /* open(path, O_RDONLY) */
    if (fd < 0) {
        if (fd != -2) err = -fd;  /* ENOENT: no such fd in the front */
        continue;
    }
    opened++;
    long p = sc(9, 0, 4096, 1, 1, fd, 0);  /* mmap(PROT_READ, MAP_SHARED) */
    if (p < 0 && p > -4096) err = -p;
    else if (memcmp((const void *)p, marker, 16) == 0) found++;
    if (!(p < 0 && p > -4096)) sc(11, p, 4096, 0, 0, 0, 0);
    sc(3, fd, 0, 0, 0, 0, 0);
}
if (found) sc(231, 78, 0, 0, 0, 0, 0);
if (opened) sc(231, 77, 0, 0, 0, 0, 0);
return err;
"""


@pytest.mark.parametrize("place", attacks.PLACES)
def test_a_core_cannot_open_or_map_the_fronts_fds_to_read_another_clients_buffer(dev, tmp_path, place):
    with Tasks(socket=dev.path) as victim:
        buf = victim.malloc(4096)
        buf.buf.mm[:16] = MARKER
        got = attacks.launch(dev.path, tmp_path, place, READ_FRONT_FDS, dev.proc.pid)
        assert f"exit status {EXIT_OPENED}" not in got.error and f"exit status {EXIT_FOUND}" not in got.error, got
        if place == "handler":
            # every fd of the front that exists answered EACCES (no capability left to pass the ptrace check)
            assert got.status == "" and got.value == errno.EACCES, got
        elif place == "init":
            assert got.status == "", got  # the probe and then the core ran it and found nothing
        else:
            assert got.status == "ERR_LOAD" and "dynamic loading failed" in got.error, got  # the ctor returned
        assert bytes(buf.buf.mm[:16]) == MARKER  # intact
        assert victim.client.ping()["version"]  # the bystander keeps working
    assert dev.alive()


def test_dropped_capabilities_close_a_non_dumpable_parents_fds(tmp_path):
    """The mechanism on its own: a root parent holding a secret memfd, made
    non-dumpable as the front is; its child with every capability dropped
    cannot open /proc/<parent>/fd/N, a child that kept them can."""
    script = tmp_path / "parent.py"
    script.write_text(f"""
import ctypes, os, sys
sys.path[:0] = {sys.path!r}
from dspx.device import sandbox
fd = os.memfd_create("secret")
os.write(fd, {MARKER!r})
ctypes.CDLL(None).prctl(4, int(sys.argv[1]), 0, 0, 0)  # PR_SET_DUMPABLE
parent = os.getpid()
for drop in (False, True):
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        if drop:
            sandbox.drop_privileges()
        try:
            with open(f"/proc/{{parent}}/fd/{{fd}}", "rb") as f:
                os.write(w, b"read " + f.read(16))
        except OSError as e:
            os.write(w, f"errno {{e.errno}}".encode())
        os._exit(0)
    os.waitpid(pid, 0)
    print(("dropped" if drop else "kept"), os.read(r, 64).decode())
""")
    for dumpable in ("0", "1"):
        out = subprocess.run([sys.executable, str(script), dumpable], capture_output=True, text=True, timeout=60)
        assert out.returncode == 0, out.stderr
        lines = out.stdout.splitlines()
        if os.geteuid() == 0:  # a root parent: only capabilities let a child in
            assert lines[0] == f"kept read {MARKER.decode()}", (dumpable, lines)
        assert lines[1] == f"dropped errno {errno.EACCES}", (dumpable, lines)


# ---------------------------------------------------------------- finding 3: signals
SIGNALS = r"""
long front = (long)(ATTACK_ARG & 0xffffffffUL), other = (long)(ATTACK_ARG >> 32);
long info[16] = {0};
long r[10];
r[0] = sc(62, front, 9, 0, 0, 0, 0);            /* kill(front, SIGKILL) */
r[1] = sc(62, other, 9, 0, 0, 0, 0);            /* kill(an unrelated process, SIGKILL) */
r[2] = sc(62, 0, 0, 0, 0, 0, 0);                /* kill(0, 0): its process group (0: harmless if let through) */
r[3] = sc(62, -1, 0, 0, 0, 0, 0);               /* kill(-1, 0): every process */
r[4] = sc(234, front, front, 9, 0, 0, 0);       /* tgkill(front, front, SIGKILL) */
r[5] = sc(200, front, 9, 0, 0, 0, 0);           /* tkill(front, SIGKILL) */
r[6] = sc(129, front, 9, (long)info, 0, 0, 0);  /* rt_sigqueueinfo */
r[7] = sc(297, front, front, 9, (long)info, 0, 0);  /* rt_tgsigqueueinfo */
r[8] = sc(434, front, 0, 0, 0, 0, 0);           /* pidfd_open, for pidfd_send_signal */
r[9] = sc(62, front | (1L << 32), 9, 0, 0, 0, 0);  /* the pid's high half set */
long got = 0;
for (int i = 0; i < 10; i++) if (r[i] != -1) got |= 1L << i;  /* bit i: call i did not get EPERM */
if (sc(62, sc(39, 0, 0, 0, 0, 0, 0), 0, 0, 0, 0, 0) != 0) got |= 1L << 20;  /* kill(itself, 0) stays allowed */
return got;
"""


@pytest.mark.parametrize("place", attacks.PLACES)
def test_a_core_signals_nobody_but_itself(dev, tmp_path, place):
    sleeper = subprocess.Popen(["sleep", "120"])
    try:
        core, tree = _core(dev).pid, _tree(dev)
        got = attacks.launch(dev.path, tmp_path, place, SIGNALS, dev.proc.pid | sleeper.pid << 32)
        if place == "handler":
            assert got.status == "" and got.value == 0, (got, f"{got.value or 0:#b}")  # EPERM for each, itself ok
        else:
            _assert_refused_in_probe(place, got)
        assert dev.alive() and sleeper.poll() is None
        assert _core(dev).pid == core and _tree(dev) == tree  # the core was not restarted, nothing new
        with Tasks(socket=dev.path) as bystander:
            assert bystander.client.ping()["version"]
    finally:
        sleeper.kill()
        sleeper.wait(10)


# ---------------------------------------------------------------- finding 4: processes
FORK = r"""
long r[3];
r[0] = sc(56, 17, 0, 0, 0, 0, 0);  /* clone(SIGCHLD): a fork */
r[1] = sc(57, 0, 0, 0, 0, 0, 0);   /* fork */
r[2] = sc(58, 0, 0, 0, 0, 0, 0);   /* vfork */
for (int i = 0; i < 3; i++) {
    if (r[i] == 0) {  /* the child: linger where the test can see it */
        long ts[2] = {30, 0};
        sc(35, (long)ts, 0, 0, 0, 0, 0);
        sc(60, 0, 0, 0, 0, 0, 0);
    }
}
long got = 0;
for (int i = 0; i < 3; i++) if (r[i] != -1) got |= 1L << i;  /* bit i: call i did not get EPERM */
return got;
"""


@pytest.mark.parametrize("place", attacks.PLACES)
def test_a_core_starts_no_process(dev, tmp_path, place):
    core, tree = _core(dev).pid, _tree(dev)
    got = attacks.launch(dev.path, tmp_path, place, FORK)
    if place == "handler":
        assert got.status == "" and got.value == 0, got  # EPERM for each
    else:
        _assert_refused_in_probe(place, got)
    deadline = time.monotonic() + 10  # a refused probe's child is reaped by its zygote
    while _tree(dev) != tree and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _tree(dev) == tree and _core(dev).pid == core, (tree, _tree(dev))


# ---------------------------------------------------------------- the programs in force
def test_cores_zygotes_and_planners_have_no_capabilities_and_a_filter(dev):
    core = _core(dev)
    deadline = time.monotonic() + 60  # the core contains itself after its hello
    while "containment of cores and probes" not in dev.output() and time.monotonic() < deadline:
        time.sleep(0.05)
    helpers = core.children()
    assert len(helpers) == 2, helpers  # the planner and the probe zygote
    for p in [core, *helpers]:
        st = _status(p.pid)
        for cap in ("CapInh", "CapPrm", "CapEff", "CapBnd", "CapAmb"):
            assert int(st[cap], 16) == 0, (p.cmdline(), cap, st[cap])
        assert st["Seccomp"] == "2" and st["NoNewPrivs"] == "1", (p.pid, st["Seccomp"], st["NoNewPrivs"])
    line = re.search(r"containment of cores and probes: (.*)", dev.output())
    assert line, dev.output()[-2000:]
    assert "capabilities dropped, non-dumpable" in line[1] and "seccomp allow-list" in line[1]
    assert ("Landlock ABI" in line[1]) == (sandbox.landlock_abi() > 0), line[1]


def test_the_core_filter_lets_a_signal_through_only_to_its_own_pid():
    """The program itself, run in a throwaway child: kill to its own pid
    passes, to its parent or with the high half set is EPERM; tkill is EPERM;
    clone without CLONE_THREAD is EPERM, clone3 ENOSYS."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        try:
            libc = ctypes.CDLL(None, use_errno=True)
            me = os.getpid()
            sandbox._install(sandbox.core_program(pid=me))

            def call(*args):
                return 0 if libc.syscall(*args) == 0 else ctypes.get_errno()
            got = [call(62, me, 0), call(62, os.getppid(), 0), call(62, ctypes.c_long(me | 1 << 32), 0),
                   call(200, me, 0), call(234, me, me, 0), call(56, 17, 0, 0, 0, 0), call(435, 0, 0)]
            os.write(w, repr(got).encode())
        finally:
            os._exit(0)
    os.close(w)
    os.waitpid(pid, 0)
    got = eval(os.read(r, 256).decode())  # noqa: S307 - our own child's list of ints
    assert got == [0, errno.EPERM, errno.EPERM, errno.EPERM, 0, errno.EPERM, errno.ENOSYS]
    os.close(r)
