"""The front trusts nothing a core sends (issue 31, finding 1), against a
real device: C code finds its channel fd in /proc/self/cmdline (``--fd N``)
and writes a pickle payload, a Deliver to other connections and Dones for
jobs that are not its core's.  No payload runs, no forged byte reaches
another client, the attacker gets a status, the core comes back and the
bystander keeps working."""
from __future__ import annotations

import pickle
import socket
import time

import numpy as np
import psutil
import pytest

import attacks
from conftest import SMALL, Device
from dspx.device import jobs
from dspx.transport import Timeout
from dspx.host.client import Client
from dspx.errors import OpFailed
from dspx.host.tasks import SOFTMAX_CMD, Tasks, softmax_param

CORES = 2


class Evil:
    def __init__(self, path):
        self.path = path

    def __reduce__(self):
        import os
        return os.system, (f"touch {self.path}",)


@pytest.fixture(scope="module")
def dev():
    d = Device(*SMALL, "--cores", str(CORES))
    yield d
    d.stop()


def _c_bytes(name: str, data: bytes) -> str:
    return f"static const unsigned char {name}[{len(data)}] = {{{', '.join(str(b) for b in data)}}};\n"


def write_to_channel(datagrams: list[bytes]) -> str:
    """C that finds the core's channel fd and writes each datagram to it; returns the fd (or -1)."""
    arrays = "".join(_c_bytes(f"d{i}", d) for i, d in enumerate(datagrams))
    writes = "".join(f"sc(1, chan, (long)d{i}, sizeof d{i}, 0, 0, 0);\n" for i in range(len(datagrams)))
    return arrays + r"""
char buf[4096];
long fd = sc(257, -100, (long)"/proc/self/cmdline", 0, 0, 0, 0);  /* openat, O_RDONLY */
if (fd < 0) return -1;
long n = sc(0, fd, (long)buf, sizeof buf - 1, 0, 0, 0);
sc(3, fd, 0, 0, 0, 0, 0);
long chan = -1;
for (long i = 0; i + 5 < n; i++)
    if (memcmp(buf + i, "--fd", 5) == 0) {
        chan = 0;
        for (long j = i + 5; j < n && buf[j]; j++) chan = chan * 10 + (buf[j] - '0');
        break;
    }
if (chan < 0) return -1;
""" + writes + """/* wait to be killed: the front restarts this core for what it wrote */
struct { long s, ns; } ts = {1, 0};
if (ATTACK_ARG == 1) for (;;) sc(35, (long)&ts, 0, 0, 0, 0, 0);
return chan;"""


def _cores_alive(dev) -> int:
    return sum(1 for p in psutil.Process(dev.proc.pid).children() if "dspx.device.core" in " ".join(p.cmdline()))


def _wait_cores(dev) -> int:
    deadline = time.monotonic() + 60
    while _cores_alive(dev) != CORES and time.monotonic() < deadline:
        time.sleep(0.05)
    return _cores_alive(dev)


def _bystander_works(dev, bystander: Client) -> None:
    """No forged byte is waiting on the bystander's socket; ping and a real softmax RPC work."""
    with pytest.raises(BlockingIOError):
        bystander.ep.sock.recv(4096, socket.MSG_DONTWAIT)
    assert "uptime_ms" in bystander.ping()
    with Tasks(socket=dev.path) as u:
        x = np.linspace(-2, 2, 64, dtype=np.float32)
        data, param, out = u.malloc(x.nbytes), u.malloc(4096), u.malloc(x.nbytes)
        data.buf.mm[:x.nbytes] = x.tobytes()
        softmax_param(param, data, x.size, False)
        u.run(SOFTMAX_CMD, param, out)
        got = np.frombuffer(bytes(out.buf.mm[:x.nbytes]), np.float32)
        want = np.exp(x - x.max()) / np.exp(x - x.max()).sum()
        np.testing.assert_allclose(got, want, rtol=1e-5)


def _attack(dev, tmp_path, place, datagrams):
    with Client(dev.path, staging_size=1 << 20, timeout=60) as bystander:
        # a handler then waits to be killed (its success would go through the
        # status page, not the channel, and could beat the front to the record)
        got = attacks.launch(dev.path, tmp_path, place, write_to_channel(datagrams), arg=int(place == "handler"))
        assert dev.alive(), dev.output()
        assert _wait_cores(dev) == CORES, dev.output()
        _bystander_works(dev, bystander)
    assert dev.alive()
    return got


@attacks.needs_cc
@pytest.mark.parametrize("place", attacks.PLACES)
def test_a_pickle_payload_written_to_the_channel_never_runs_in_the_front(dev, tmp_path, place):
    marker = tmp_path / "MARKER"
    got = _attack(dev, tmp_path, place, [pickle.dumps(Evil(marker))])
    time.sleep(0.5)  # the front has read the datagram long before: a hang guard for the check below
    assert not marker.exists()
    # The probe has no channel (its fds are closed); the handler, and the init
    # and constructor when the core loads the code for real, write to it: the
    # front restarts that core and the call or load fails.
    if place == "ctor" and got.status == "ERR_LOAD":
        # In DYN_LOAD's probe the channel's fd number can be the probe's own
        # result pipe (the probe child closed the core's fds, and the zygote
        # that forked it reuses low numbers): the payload lands there, the
        # probe's answer is not "returned", and the load is refused first.
        assert "ended the loading process" in got.error, got
        return
    assert got.status == "ERR_CALL", got
    assert "sent an invalid record" in got.error and "unknown tag 128" in got.error, got
    assert "sent an invalid record: unknown tag 128" in dev.output()


@attacks.needs_cc
def test_a_deliver_to_another_connection_restarts_the_core_and_reaches_nobody(dev, tmp_path):
    forged = b"\x01\x80\x00\x00" + b"F" * 12
    got = _attack(dev, tmp_path, "handler", [jobs.encode(jobs.Deliver(cid, forged)) for cid in range(1, 65)])
    assert got.status == "ERR_CALL", got
    assert "which core 0 does not serve" in got.error or "which core 1 does not serve" in got.error, got


@attacks.needs_cc
def test_a_done_for_jobs_not_its_core_s_restarts_the_core(dev, tmp_path):
    forged = b"\x01\x80\x00\x00" + b"F" * 12
    got = _attack(dev, tmp_path, "handler",
                  [jobs.encode(jobs.Done(j, 0, response=forged)) for j in range(1, 400)] +
                  [jobs.encode(jobs.Done(1 << 40, 0, response=forged))])
    assert got.status == "ERR_CALL", got
    assert "which was never sent to core" in got.error, got


@attacks.needs_cc
def test_a_cost_record_from_a_core_without_a_cost_model_restarts_the_core(dev, tmp_path):
    """The timing model off, a core has nothing to report: any Cost is a forgery."""
    got = _attack(dev, tmp_path, "handler", [jobs.encode(jobs.Cost(j, cid, 1, "j6-vision"))
                                             for j in range(1, 20) for cid in (1, 2)])
    assert got.status == "ERR_CALL", got
    assert "runs without a cost model" in got.error, got


@attacks.needs_cc
def test_a_second_hello_restarts_the_core(dev, tmp_path):
    got = _attack(dev, tmp_path, "handler", [jobs.encode(jobs.Hello(0, 1, [(0x1402, "mine", 0)]))])
    assert got.status == "ERR_CALL" and "a second Hello" in got.error, got


# In the load probe (a fork of the core, so its parent is not the front) the
# only fds above stdio are its result pipe and the library being loaded: a
# crash says otherwise.
PROBE_FDS = r"""
if (sc(110, 0, 0, 0, 0, 0, 0) != (long)ATTACK_ARG) {  /* getppid: not the front, so the probe */
    int open_fds = 0;
    for (long fd = 3; fd < 65536; fd++)
        if (sc(72, fd, 1, 0, 0, 0, 0) >= 0) open_fds++;  /* fcntl(F_GETFD) */
    if (open_fds > 2) *(volatile int *)0 = open_fds;
}
return 0;
"""


@attacks.needs_cc
def test_the_load_probe_holds_no_fd_of_the_core(dev, tmp_path):
    # (a module's constructor probe runs under a filter that refuses fcntl
    # itself; both probes are the same probe.in_child)
    got = attacks.launch(dev.path, tmp_path, "init", PROBE_FDS, arg=dev.proc.pid)
    assert got.status == "", got


SOCKETS = r"""
unsigned char st[144];
long n = 0;
for (long fd = 0; fd < 4096; fd++)
    if (sc(5, fd, (long)st, 0, 0, 0, 0) == 0 && ((*(unsigned int *)(st + 24)) & 0170000) == 0140000) n++;
return n;
"""


@attacks.needs_cc
def test_a_core_holds_only_its_current_owner_s_client_socket(dev, tmp_path):
    """After another connection's call ran on the core, its socket is gone
    there: the handler counts the same sockets (its channel, its own client's)."""
    elf = attacks.build(tmp_path, "handler", SOCKETS)
    with Tasks(socket=dev.path) as a, Tasks(socket=dev.path) as b:
        h, _ = a.load_ops(elf)
        mems = {}
        for who in (a, b):
            mems[id(who)] = (who.malloc(4096), who.malloc(4096))

        def sockets(who) -> int:
            inp, out = mems[id(who)]
            try:
                return who.run(attacks.ATTACK_CMD, inp, out, core=0).return_value
            except OpFailed as e:  # the count is the handler's (non-zero) return
                return e.return_value

        first = sockets(a)
        assert sockets(b) == first  # a's socket was closed at the switch, b's given
        assert sockets(a) == first
        a.unload_ops(h)


# ---------------------------------------------------------------- owner switches, in-process

class _FakeConn:
    def __init__(self, cid):
        self.cid = cid


def _front_with_switches(tmp_path, monkeypatch):
    """A front (not started) whose core 0 served connection 1, then connection 2
    (an owner switch: 1's socket dropped), with what it forwards recorded."""
    from dspx.device.front.loop import Service
    svc = Service(str(tmp_path / "dsp0.sock"), cores=1, threads=1)
    sent = []
    monkeypatch.setattr(svc.connections, "send", lambda conn, data: sent.append((conn.cid, data)))
    for cid in (1, 2):
        svc.st.conns[cid] = _FakeConn(cid)
    c = svc.cores[0]
    c.known_conns = {1}
    c._drop_bufs(jobs.Call(job=5))  # the switch to connection 2's job
    c.known_conns = {2}
    return svc, c, sent


def test_a_late_answer_for_the_previous_owner_is_forwarded_until_the_core_acknowledges_the_switch(
        tmp_path, monkeypatch):
    """A core that could not send owner 1's answer (socket full) sends it as a
    Deliver before it reads the next owner's job; the front, which may have
    switched already, forwards it.  After the core's Switched (sent before
    the new owner's code runs), a Deliver to 1 can only be that code's forgery."""
    svc, c, sent = _front_with_switches(tmp_path, monkeypatch)
    svc.supervisor.deliver(c, jobs.Deliver(1, b"late"))
    assert sent == [(1, b"late")]
    svc.supervisor.switched(c, jobs.Switched(1))
    with pytest.raises(jobs.BadRecord, match="Deliver to connection 1, which core 0 does not serve"):
        svc.supervisor.deliver(c, jobs.Deliver(1, b"forged"))
    svc.supervisor.deliver(c, jobs.Deliver(2, b"own"))
    assert sent == [(1, b"late"), (2, b"own")]


def test_a_switch_acknowledgement_out_of_turn_is_a_bad_record(tmp_path, monkeypatch):
    svc, c, _ = _front_with_switches(tmp_path, monkeypatch)
    with pytest.raises(jobs.BadRecord, match="Switched #2, but core 0 was sent 1 owner switches"):
        svc.supervisor.switched(c, jobs.Switched(2))
    svc.supervisor.switched(c, jobs.Switched(1))
    with pytest.raises(jobs.BadRecord, match="acknowledged 1"):
        svc.supervisor.switched(c, jobs.Switched(1))


def test_the_core_acknowledges_an_owner_switch_before_anything_else():
    from dspx.device.core.worker import CoreWorker
    front, core = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    try:
        w = CoreWorker(jobs.endpoint(core), 0, 1)
        w._take_fds(jobs.Forget(job=0, drop_bufs=True), [])
        w._take_fds(jobs.Forget(job=0), [])
        w._take_fds(jobs.Forget(job=0, drop_bufs=True), [])
        ep = jobs.endpoint(front)
        got = [jobs.recv(ep, jobs.CORE_TO_FRONT, timeout=5)[0] for _ in range(2)]
        assert got == [jobs.Switched(1), jobs.Switched(2)]
        with pytest.raises(Timeout):
            jobs.recv(ep, jobs.CORE_TO_FRONT, timeout=0.2)  # nothing else was sent
    finally:
        front.close()
        core.close()
