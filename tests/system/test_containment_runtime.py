"""The runtime checks itself after user code, and attach checks what a core
will do with a buffer (issue 31, findings 5 and 6; docs/containment.md).

A C handler gets an opaque tile-manager handle, not the shim's context: a
handler that finds the context anyway (by scanning its memory, as a real
attacker would) and breaks it — the DMA stop flags, the canaries on either
side, a channel's queue — gets ERR_CALL naming what broke, its core restarts,
and another client's tiled DMA softmax then answers correctly.  Buffers a
core cannot map shared and writable are refused at BUF_ATTACH, and a call
naming one that a core still cannot map gets exactly one answer."""
from __future__ import annotations

import errno
import fcntl
import mmap
import os
import re
import socket
import struct
import subprocess
import time
from pathlib import Path

import numpy as np
import pytest
import scipy.special

import attacks
from conftest import SMALL, Device
from dspx import memory, sdk
from dspx.sdk import gen_wire
from dspx.abi import protocol as P
from dspx.abi.protocol import Status
from dspx.errors import DeviceError
from dspx.host.tasks import Tasks

SHIM = sdk.DSP_DIR / "runtime.c"
SOFTMAX = 0x1402  # the firmware's C softmax (the seed's listing); tcm=1 is its DMA ping-pong
N = 100_000  # floats: two 64 Ki-float tiles, so the ping-pong really alternates


@pytest.fixture(scope="module")
def dev():
    d = Device(*SMALL)
    yield d
    d.stop()


def _shim_structs(place_has_sdk: bool = True) -> str:
    """The shim's own struct definitions (and the sizes they use), so the
    attacker's offsets are the real ones whatever the layout becomes."""
    text = SHIM.read_text()
    defines = re.findall(r"^#define (?:MAX_REGIONS|MAX_MAPS|MAX_TILES|QCAP) .*$", text, re.M)
    structs = re.findall(r"^struct \w+ \{[^\n]*\};$|^struct \w+ \{\n.*?^\};$", text, re.M | re.S)
    # the cost build's clock is no part of the context (and needs dspx/cost.h)
    structs = [s for s in structs if "DSPX_COST" not in s and "dspx_cost" not in s]
    assert any(s.startswith("struct dspx_ctx {") for s in structs)
    # glibc x86-64's sizes: the body sits inside a function, where <pthread.h> cannot go
    pthread = ("typedef unsigned long pthread_t; typedef union { char b[40]; long a; } pthread_mutex_t; "
               "typedef union { char b[48]; long long a; } pthread_cond_t;")
    channels = "" if place_has_sdk else re.search(r"^#define DSPX_DMA_CHANNELS .*$",
                                                  (SHIM.parents[1] / "include/dspx/dsp.h").read_text(), re.M)[0]
    return "\n".join([pthread, channels] + defines + structs)


# The attack's first step: its own /proc/self/maps into ``maps`` (raw calls, no libc).
READ_MAPS = r"""
static char maps[1 << 20];
long fd = sc(2, (long)"/proc/self/maps", 0, 0, 0, 0, 0), n = 0, r;
if (fd < 0) return -98;
while (n < (long)sizeof maps - 1 && (r = sc(0, fd, (long)maps + n, (long)sizeof maps - 1 - n, 0, 0, 0)) > 0) n += r;
sc(3, fd, 0, 0, 0, 0, 0);
maps[n] = 0;
"""

# Find the context as an attacker would: scan every private writable mapping
# for its (input, output, input size, output size) fields, then break it
# the way ATTACK_ARG says.  Returns -99 if the context was not found.
FIND_AND_BREAK = _shim_structs() + READ_MAPS + r"""
struct dspx_ctx *c = 0;
uint64_t want[4] = {(uint64_t)input, (uint64_t)output, dspx_input_size(), dspx_output_size()};
for (char *p = maps; *p && !c;) {
    uint64_t lo = 0, hi = 0;
    for (; (*p >= '0' && *p <= '9') || (*p >= 'a' && *p <= 'f'); p++) lo = lo * 16 + (uint64_t)(*p <= '9' ? *p - '0' : *p - 'a' + 10);
    p++;
    for (; (*p >= '0' && *p <= '9') || (*p >= 'a' && *p <= 'f'); p++) hi = hi * 16 + (uint64_t)(*p <= '9' ? *p - '0' : *p - 'a' + 10);
    if (p[1] == 'r' && p[2] == 'w' && p[4] == 'p')
        for (uint64_t *w = (uint64_t *)lo; (uint64_t)(w + 4) <= hi; w++)
            if (w[0] == want[0] && w[1] == want[1] && w[2] == want[2] && w[3] == want[3]
                && (uint64_t)w - offsetof(struct dspx_ctx, in) >= lo) {
                c = (struct dspx_ctx *)((char *)w - offsetof(struct dspx_ctx, in));
                break;
            }
    while (*p && *p != '\n') p++;
    if (*p) p++;
}
if (!c) return -99;
switch (ATTACK_ARG) {
case 1: c->ch[0].stop = 1; c->ch[1].stop = 1; break;            /* finding 5: DMA ends for everyone */
case 2: memset((char *)c, 0x41, 8); break;                       /* the context's first bytes */
case 3: memset((char *)c + sizeof *c - 8, 0x41, 8); break;       /* its last bytes */
case 4: c->ch[1].done = c->ch[1].submitted + 3; break;           /* a channel's queue */
}
return 0;
"""

BROKEN = {1: "DMA channel 0's stop flag was set", 2: "canary before the runtime context",
          3: "canary after the runtime context", 4: "DMA channel 1's queue is inconsistent"}


def _softmax(u: Tasks, inp, out, x: np.ndarray) -> np.ndarray:
    """The bystander: the seed's tiled softmax, DMA ping-pong through L2."""
    out.buf.mm[:4 * N] = b"\0" * (4 * N)
    r = u.run(SOFTMAX, inp, out, core=0, timeout_ms=60_000)  # a hang guard only
    assert r.return_value == 0 and "ping-pong" in r.printf, r.printf
    return np.frombuffer(out.buf.mm, np.float32, count=N).copy()


def _bystander_softmax(bystander: Tasks):
    """A bystander's tiled softmax of N floats, run once (so the shim's context
    exists) and checked: (input, output, x, reference) for the runs after."""
    data, inp, out = bystander.malloc(4 * N), bystander.malloc(64), bystander.malloc(4 * N)
    x = 1 + np.arange(N, dtype=np.float32) / np.float32(N)
    data.buf.mm[:4 * N] = x.tobytes()
    inp.buf.mm[:17] = struct.pack("<i4xQB", 4 * N, data.phy, 1)
    ref = scipy.special.softmax(x.astype(np.float64))
    assert np.max(np.abs(_softmax(bystander, inp, out, x) - ref) / ref) <= 1e-6
    return inp, out, x, ref


def _restarted_then_serves(dev, before: int, bystander: Tasks, inp, out, x, ref) -> None:
    """The core restarts for the broken runtime (one more log line than ``before``), then the bystander's softmax is right."""
    deadline = time.monotonic() + 30
    while dev.output().count("core 0 died (exit 76: user code broke its runtime); restarting") <= before:
        assert time.monotonic() < deadline, dev.output()[-2000:]
        time.sleep(0.05)
    assert np.max(np.abs(_softmax(bystander, inp, out, x) - ref) / ref) <= 1e-6


@attacks.needs_cc
@pytest.mark.parametrize("mode", sorted(BROKEN))
def test_a_handler_that_breaks_the_shim_gets_err_call_and_the_core_restarts_clean(dev, tmp_path, mode):
    with Tasks(socket=dev.path) as bystander:
        inp, out, x, ref = _bystander_softmax(bystander)
        before = dev.output().count("core 0 died (exit 76: user code broke its runtime); restarting")

        got = attacks.launch(dev.path, tmp_path, "handler", FIND_AND_BREAK, arg=mode)

        assert got.status == "ERR_CALL", got
        assert BROKEN[mode] in got.error and "the core restarts" in got.error, got
        _restarted_then_serves(dev, before, bystander, inp, out, x, ref)
    assert dev.alive()


@attacks.needs_cc
def test_writing_through_tm_faults_only_the_attackers_call(dev, tmp_path):
    """tm is no address: a write through it faults the core (ERR_CALL) and
    the restarted core serves the next call."""
    got = attacks.launch(dev.path, tmp_path, "handler", "*(volatile uint64_t *)tm = 0; return 0;")
    assert got.status == "ERR_CALL" and "crashed" in got.error, got
    assert attacks.launch(dev.path, tmp_path, "handler", "return 7;").value == 7


FORGED = r"""
static uint64_t stale;
uint64_t forged[] = {0x1234, (uint64_t)input, (uint64_t)tm ^ 1, stale, (uint64_t)&forged};
int refused = 0;
for (unsigned i = 0; i < sizeof forged / sizeof forged[0]; i++) {
    refused += xvAllocateBuffer((xvTileManager *)forged[i], 64, 0, 64) == NULL;
    refused += xvFreeBuffer((xvTileManager *)forged[i], input) == XVTM_ERROR;
}
void *t = xvAllocateBuffer((xvTileManager *)tm, 64, 0, 64);   /* the real one still works */
int ok = t != NULL && xvFreeBuffer((xvTileManager *)tm, t) == XVTM_SUCCESS;
int32_t *res = output;
res[0] = refused, res[1] = ok, res[2] = stale != 0 && stale != (uint64_t)tm;
stale = (uint64_t)tm;
return 0;  /* the refusals were absorbed: the task succeeds */
"""


@attacks.needs_cc
def test_a_forged_or_stale_tm_is_refused_and_the_core_lives(dev, tmp_path):
    with Tasks(socket=dev.path) as u:
        elf = attacks.build(tmp_path, "handler", FORGED)
        h, _ = u.load_ops(elf)
        inp, out = u.malloc(4096), u.malloc(4096)
        pid = _core_pid(dev)
        for _ in range(2):  # the second task also tries the first one's handle, now stale
            r = u.run(attacks.ATTACK_CMD, inp, out, core=0)
            # 5 handles x (allocate, free), each refused; the real one works
            assert r.return_value == 0 and list(out.view(np.int32, 3)) == [10, 1, _ > 0], r.printf
            assert r.printf.count("is not the running task's tile manager") == 10, r.printf
        assert _core_pid(dev) == pid  # the same core process: nothing restarted
        u.unload_ops(h)
    assert dev.alive()


# ---------------------------------------------------------------- buffers a core can map

def _memfd(size: int = 1 << 16, extra_seals: int = 0, flags: int = 0) -> int:
    fd = os.memfd_create("dspx-test", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING | flags)
    os.ftruncate(fd, size)
    fcntl.fcntl(fd, fcntl.F_ADD_SEALS, memory.REQUIRED_SEALS & ~fcntl.F_SEAL_SEAL)
    if extra_seals:
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, extra_seals)
    fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SEAL)
    return fd


def _hugetlb_fd() -> int | None:
    """A 2 MiB MFD_HUGETLB memfd, or None when the kernel refuses to make one."""
    try:
        return _memfd(2 << 20, flags=os.MFD_HUGETLB)
    except OSError:
        return None


class Raw:
    """A bare protocol connection: messages written out by hand."""

    def __init__(self, path: str):
        self.s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self.s.connect(path)
        self.s.settimeout(30)  # hang guard

    def ask(self, msg: P.Message, fds=()) -> P.Message:
        socket.send_fds(self.s, [msg.encode()], list(fds)) if fds else self.s.send(msg.encode())
        return P.decode(self.s.recv(P.MAX_MSG))

    def no_more(self) -> bool:
        self.s.settimeout(1.0)
        try:
            return not self.s.recv(P.MAX_MSG)
        except TimeoutError:
            return True
        finally:
            self.s.settimeout(30)

    def close(self):
        self.s.close()


@pytest.mark.parametrize("seal, name", [(fcntl.F_SEAL_WRITE, "F_SEAL_WRITE"),
                                        (memory.F_SEAL_FUTURE_WRITE, "F_SEAL_FUTURE_WRITE")])
def test_attach_refuses_a_memfd_sealed_against_writes(dev, seal, name):
    fd = _memfd(extra_seals=seal)
    raw = Raw(dev.path)
    try:
        resp = raw.ask(P.BufAttach(seq=5, size=1 << 16, flags=0, kv_size=0), [fd])
        assert (resp.seq, resp.status) == (5, Status.ERR_INVALID), resp
        err = raw.ask(P.GetError(seq=6))
        assert f"sealed with {name}" in err.payload.decode(), err
    finally:
        raw.close()
        os.close(fd)


def test_attach_refuses_a_hugetlb_memfd(dev):
    fd = _hugetlb_fd()
    if fd is None:  # the check is by filesystem type; without hugetlbfs there is none to make
        pytest.skip("MFD_HUGETLB memfd_create is refused on this kernel")
    raw = Raw(dev.path)
    try:
        resp = raw.ask(P.BufAttach(seq=9, size=2 << 20, flags=0, kv_size=0), [fd])
        assert (resp.seq, resp.status) == (9, Status.ERR_INVALID), resp
        assert "hugetlb memfd" in raw.ask(P.GetError(seq=10)).payload.decode()
    finally:
        raw.close()
        os.close(fd)


def test_a_plain_memfd_still_attaches(dev):
    fd = _memfd()
    raw = Raw(dev.path)
    try:
        resp = raw.ask(P.BufAttach(seq=3, size=1 << 16, flags=0, kv_size=0), [fd])
        assert (resp.seq, resp.status) == (3, 0) and resp.dsp_addr, resp
    finally:
        raw.close()
        os.close(fd)


def test_every_mapping_failure_in_a_core_gets_exactly_one_answer():
    """A buffer the front accepted but a core cannot map (here: the core's
    address space too small for it) fails the RPC naming it, as input or as
    output, with ERR_NOMEM — one answer each, the core serving on."""
    d = Device(*SMALL)
    try:
        raw = Raw(d.path)
        small, big = _memfd(4096), _memfd(32 << 20)
        a = raw.ask(P.BufAttach(seq=1, size=4096, flags=0, kv_size=0), [small])
        b = raw.ask(P.BufAttach(seq=2, size=32 << 20, flags=0, kv_size=0), [big])
        assert a.status == 0 and b.status == 0, (a, b)
        core = _core_pid(d)
        _limit_address_space(core, 16 << 20)  # from outside, as the kernel's own limit would
        for seq, (i, o) in enumerate([(b, a), (a, b), (b, a)], start=10):
            resp = raw.ask(P.Rpc(seq=seq, cmd=SOFTMAX, core=0, priority=0, timeout_ms=0,
                                 input_dsp_addr=i.dsp_addr, input_size=64, output_dsp_addr=o.dsp_addr,
                                 output_size=64))
            assert (resp.seq, resp.status) == (seq, Status.ERR_NOMEM), resp
            err = raw.ask(P.GetError(seq=100 + seq)).payload.decode()
            assert "cannot map buffer" in err and "shared read-write" in err, err
        assert raw.no_more()  # nothing answered twice
        raw.close()
        assert d.alive()
    finally:
        d.stop()


def _core_pid(d: Device) -> int:
    (core,) = d.core_pids()
    return core


def _limit_address_space(pid: int, extra: int) -> None:
    import psutil
    import resource
    limit = psutil.Process(pid).memory_info().vms + extra
    resource.prlimit(pid, resource.RLIMIT_AS, (limit, limit))


# ---------------------------------------------------------------- the Python runtime's DMA engine

PY_BYSTANDER = """
import numpy as np
from dspx.device.core.runtime import register_op, ping_pong

@register_op(0x3A02)
def doubled(input, output, tm):   # tiled through both L2 banks on both DMA channels
    n = input.nbytes // 4
    x, y = input.view(np.float32), output.view(np.float32)
    ping_pong(x, y, n, lambda t: np.multiply(t, np.float32(2), out=t), tm, tile_elems=4096)
    return 0
"""

PY_BREAKER = """
from dspx.device.core.runtime import register_op

@register_op(0x3A01)
def breaker(input, output, tm):
    g = getattr(type(tm).alloc, "__globals__")   # the runtime module's own names, past the import check
    engine = g["_current"].get().core.dma

    class Poison(g["_Copy"]):                    # passes the worker's type check, has no 'done' lock
        def __init__(self):
            self.src = self.dst = None

    for q in engine._queues:
        q.put(None if input[0] == 1 else Poison())
    return 0
"""


@pytest.mark.parametrize("mode", [1, 2])
def test_a_python_op_cannot_end_the_dma_engine_for_the_next_client(dev, mode):
    """None in a channel's queue once ended its worker (the next client's
    ping-pong then waited out the DMA timeout); now workers ignore it (if the
    check finds it still queued, the call is ERR_CALL and the core restarts).
    A poisoned copy that kills a worker is always caught: ERR_CALL, restart.
    Either way the bystander's tiled op then answers correctly."""
    n = 3 * 4096 + 5
    with Tasks(socket=dev.path) as bystander, Tasks(socket=dev.path) as attacker:
        hb, _ = bystander.load_ops(PY_BYSTANDER)
        ha, _ = attacker.load_ops(PY_BREAKER)
        try:
            i, o = bystander.malloc(4 * n), bystander.malloc(4 * n)
            x = np.arange(n, dtype=np.float32) - 7
            i.buf.mm[:4 * n] = x.tobytes()
            ai, ao = attacker.malloc(64), attacker.malloc(64)
            ai.buf.mm[0] = mode
            before = dev.output().count("core 0 died (exit 76: user code broke its runtime); restarting")
            try:
                attacker.run(0x3A01, ai, ao, core=0, timeout_ms=60_000)
                broke = False
            except DeviceError as e:
                assert e.status_name == "ERR_CALL" and "DMA channel 0's" in str(e), e
                broke = True
            assert broke or mode == 1
            r = bystander.run(0x3A02, i, o, core=0, timeout_ms=60_000)  # a hang guard only
            assert r.return_value == 0
            assert np.array_equal(np.frombuffer(o.buf.mm, np.float32, count=n), x * 2)
            assert dev.output().count("user code broke its runtime") - before == int(broke), dev.output()[-2000:]
        finally:
            attacker.unload_ops(ha)
            bystander.unload_ops(hb)


# From a library's init or a module's constructor there is no task: find the
# context by its L2 pointer and size, checked against its DMA threads' ids.
FIND_BY_L2 = _shim_structs(place_has_sdk=False) + READ_MAPS + r"""
int hits = 0;
for (char *p = maps; *p;) {
    uint64_t lo = 0, hi = 0;
    for (; (*p >= '0' && *p <= '9') || (*p >= 'a' && *p <= 'f'); p++) lo = lo * 16 + (uint64_t)(*p <= '9' ? *p - '0' : *p - 'a' + 10);
    p++;
    for (; (*p >= '0' && *p <= '9') || (*p >= 'a' && *p <= 'f'); p++) hi = hi * 16 + (uint64_t)(*p <= '9' ? *p - '0' : *p - 'a' + 10);
    if (p[1] == 'r' && p[2] == 'w' && p[4] == 'p')
        for (uint64_t *w = (uint64_t *)lo; (uint64_t)(w + 2) <= hi; w++) {
            struct dspx_ctx *c = (struct dspx_ctx *)((char *)w - __builtin_offsetof(struct dspx_ctx, l2));
            if (w[1] != ATTACK_ARG || !w[0] || (w[0] & 4095) || (uint64_t)c < lo || (uint64_t)(c + 1) > hi)
                continue;
            if (c->ch[0].tid <= 0 || c->ch[1].tid <= 0 || c->ch[0].tid == c->ch[1].tid || c->ch[0].tid > (1 << 22))
                continue;
            c->ch[0].stop = 1; c->ch[1].stop = 1;
            hits++;
        }
    while (*p && *p != '\n') p++;
    if (*p) p++;
}
return hits;
"""


@attacks.needs_cc
@pytest.mark.parametrize("place", ["init", "ctor"])
def test_stopping_dma_from_an_init_or_constructor_restarts_the_core(dev, tmp_path, place):
    with Tasks(socket=dev.path) as bystander:
        inp, out, x, ref = _bystander_softmax(bystander)
        before = dev.output().count("core 0 died (exit 76: user code broke its runtime); restarting")

        got = attacks.launch(dev.path, tmp_path, place, FIND_BY_L2, arg=memory.L2_SIZE)

        assert got.status == "ERR_CALL" and "stop flag was set" in got.error, got
        _restarted_then_serves(dev, before, bystander, inp, out, x, ref)
    assert dev.alive()


@attacks.needs_cc
@pytest.mark.parametrize("sanitizer", ["address,undefined", "thread"])
def test_the_shims_self_check_under_sanitizers(tmp_path, sanitizer):
    """The shim and its self-check, built together under the sanitizers:
    an intact task passes (and a handle kept from the task before is
    refused), each kind of breakage is named, and no sanitizer reports."""
    exe = tmp_path / "selfcheck"
    subprocess.run([attacks.CC, "-g", "-O1", f"-fsanitize={sanitizer}", "-fno-sanitize-recover=all", "-pthread",
                    f"-I{SHIM.parents[1] / 'include'}", f"-I{SHIM.parent}", f"-I{gen_wire.include_dir(tmp_path)}",
                    "-o", str(exe),
                    str(Path(__file__).parents[1] / "native" / "shim_selfcheck.c"), "-ldl"],
                   check=True, capture_output=True, timeout=300)
    p = subprocess.run([str(exe)], capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr[-3000:]
    lines = p.stdout.splitlines()
    # the first task of each context: no earlier handle, so the refusal is of 0
    assert lines[:2] == ["intact rv=0 fault=-2 copied=1 broken=''"] * 2, p.stdout
    assert lines[2] == "mode 1 broken='DMA channel 1's stop flag was set (its thread ends)'", p.stdout
    assert lines[3].startswith("mode 2 broken='the canary before the runtime context"), p.stdout
    assert lines[4].startswith("mode 3 broken='the canary after the runtime context"), p.stdout
    assert lines[5].startswith("mode 4 broken='DMA channel 0's queue is inconsistent"), p.stdout
    assert "Sanitizer" not in p.stderr, p.stderr[-3000:]


@attacks.needs_cc
def test_a_job_queued_behind_the_breaking_call_runs_on_the_restarted_core(dev, tmp_path):
    """The core says it ends before it answers: the bystander's call, queued
    behind the attacker's on the same core, is not handed to the dying
    process (it would fail as 'crashed') but runs after the restart."""
    elf = attacks.build(tmp_path, "handler", FIND_AND_BREAK)
    with Tasks(socket=dev.path) as bystander, Tasks(socket=dev.path) as attacker:
        data, inp, out = bystander.malloc(4 * N), bystander.malloc(64), bystander.malloc(4 * N)
        x = 1 + np.arange(N, dtype=np.float32) / np.float32(N)
        data.buf.mm[:4 * N] = x.tobytes()
        inp.buf.mm[:17] = struct.pack("<i4xQB", 4 * N, data.phy, 1)
        ref = scipy.special.softmax(x.astype(np.float64))
        _softmax(bystander, inp, out, x)
        h, _ = attacker.load_ops(elf)
        ai, ao = attacker.malloc(4096), attacker.malloc(4096)
        ai.buf.mm[:8] = (1).to_bytes(8, "little")
        for _ in range(3):
            t = attacker.submit(attacker.rpc(attacks.ATTACK_CMD, ai, ao), core=0)
            queued = bystander.submit(bystander.rpc(SOFTMAX, inp, out), core=0)
            with pytest.raises(DeviceError) as e:
                attacker.wait(t, timeout_ms=60_000)
            assert e.value.status_name == "ERR_CALL" and BROKEN[1] in str(e.value), e.value
            assert bystander.wait(queued, timeout_ms=60_000).return_value == 0  # a hang guard only
            assert np.max(np.abs(np.frombuffer(out.buf.mm, np.float32, count=N) - ref) / ref) <= 1e-6
        attacker.unload_ops(h)
