"""Back-pressure: floods of requests, connections and allocations get
ERR_BUSY / ERR_NOMEM answers (or a refused connection), never a hang or an
unbounded queue; a client that never reads its responses cannot make the
device's memory grow; the front answers at once while a core is busy; one
process gets only its share of the connections; the front spends one fd per
buffer and stays up at its fd limit.  Limits: docs/reliability.md."""
from __future__ import annotations

import errno
import os
import re
import resource
import signal
import socket
import struct
import subprocess
import sys
import textwrap
import time

import numpy as np
import psutil
import pytest

from dspx.abi import protocol as P
from dspx.errors import DeviceError, OutOfMemory
from dspx.host.client import Client
from dspx.host.tasks import Tasks
import spin_ops
from spin_ops import NOP, SPIN

HDR = struct.Struct("<IIIi")
PER_CONN, TOTAL, MAX_CONNS, MAX_BUFS = 256, 4096, 512, 128  # service.py limits


@pytest.fixture(scope="module")
def bdev():
    d = spin_ops.device("--carveout-size", "64M", "--ddr-pool-size", "64M")
    yield d
    d.stop()


def block_core(u: Tasks, ms: int):
    i = u.malloc(4)
    i.view(np.int32, 1)[0] = ms
    return u.submit(u.rpc(SPIN, i, u.malloc(8)), core=0)


def test_in_flight_limit_per_connection_is_err_busy(bdev):
    with Tasks(socket=bdev.path) as u:
        blocker = block_core(u, 300)
        i, o = u.malloc(4), u.malloc(4)
        extra = 40
        seqs = [u.client.send(P.Rpc(cmd=NOP, core=0, input_dsp_addr=i.phy, input_size=4, output_dsp_addr=o.phy,
                                    output_size=4)) for _ in range(PER_CONN - 1 + extra)]
        statuses = [u.client.wait(s, 30).status for s in seqs]
        u.wait(blocker, 30_000)
        assert statuses.count(P.Status.ERR_BUSY) == extra
        assert statuses.count(P.Status.SUCCESS) == PER_CONN - 1
        assert statuses[-extra:] == [P.Status.ERR_BUSY] * extra  # the ones past the limit
        assert u.run(NOP, i, o).return_value == 0  # and it serves normally afterwards


def test_device_queue_limit_across_connections_is_err_busy(bdev):
    conns = [Tasks(socket=bdev.path) for _ in range(TOTAL // PER_CONN + 1)]
    try:
        blocker = block_core(conns[0], 1500)
        seqs = []
        for k, u in enumerate(conns):
            i, o = u.malloc(4), u.malloc(4)
            n = PER_CONN - 1 if k == 0 else PER_CONN
            msg = dict(cmd=NOP, core=0, input_dsp_addr=i.phy, input_size=4, output_dsp_addr=o.phy, output_size=4)
            seqs.append([u.client.send(P.Rpc(**msg)) for _ in range(n)])
        observer = Client(bdev.path, staging_size=0, printf_size=0, timeout=10)
        rtt = observer.ping()["rtt_us"]
        assert rtt < 5e6, f"PING took {rtt:.0f} us while the queues were full"  # answered, not queued behind them
        observer.close()
        counts = {}
        for u, ss in zip(conns, seqs):
            for s in ss:
                st = u.client.wait(s, 60).status
                counts[st] = counts.get(st, 0) + 1
        conns[0].wait(blocker, 60_000)
        # One blocker running + 4096 queued fill the device; the rest were refused, none lost.
        assert counts[P.Status.ERR_BUSY] == len(conns) * PER_CONN - 1 - TOTAL
        assert counts[P.Status.SUCCESS] == TOTAL
    finally:
        for u in conns:
            u.close()


def test_client_that_never_reads_cannot_grow_device_memory(bdev):
    front = psutil.Process(bdev.proc.pid)
    observer = Client(bdev.path, staging_size=0, printf_size=0, timeout=10)
    base_conns = observer.pools()["connections"]
    rss0 = front.memory_info().rss
    s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    s.connect(bdev.path)
    s.setblocking(False)
    sent = 0
    t0 = time.monotonic()
    # Send PINGs and never read: the device keeps answering until its socket
    # is full, then stops reading ours — so our sends block (EAGAIN here).
    while time.monotonic() - t0 < 5:
        try:
            s.send(HDR.pack(P.MsgType.PING, sent, 16, 0))
            sent += 1
        except BlockingIOError:
            time.sleep(0.05)  # give the device a chance to drain anything it can
            try:
                s.send(HDR.pack(P.MsgType.PING, sent, 16, 0))
                sent += 1
            except BlockingIOError:
                break
    assert time.monotonic() - t0 < 5, "the device kept reading: no flow control"
    assert 100 < sent < 100_000
    growth = front.memory_info().rss - rss0
    print(f"never-reading client: {sent} requests accepted before its send blocked; front RSS +{growth} bytes")
    assert growth < 4 << 20, f"front RSS grew {growth} bytes for {sent} unread responses"
    # Others are served meanwhile.
    rtt = observer.ping()["rtt_us"]
    assert rtt < 5e6, f"PING took {rtt:.0f} us beside a client that never reads"
    # Reading resumes the flow: every request gets exactly one response, in order.
    s.setblocking(True)
    s.settimeout(10)
    for i in range(sent):
        r = s.recv(64)
        assert HDR.unpack_from(r)[:2] == (0x1001, i)
    s.setblocking(False)
    with pytest.raises(BlockingIOError):
        s.recv(64)
    s.close()
    deadline = time.monotonic() + 1
    while observer.pools()["connections"] != base_conns:
        assert time.monotonic() < deadline
        time.sleep(0.01)
    observer.close()


def test_abandoned_client_with_unread_responses_is_freed(bdev):
    """Same, but the client goes away without reading: nothing is left."""
    observer = Client(bdev.path, staging_size=0, printf_size=0, timeout=10)
    base = observer.pools()
    s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    s.connect(bdev.path)
    s.setblocking(False)
    try:
        for i in range(100_000):
            s.send(HDR.pack(P.MsgType.POOL_STATUS, i, 16, 0))
    except BlockingIOError:
        pass
    time.sleep(0.1)
    s.close()
    deadline = time.monotonic() + 1
    while observer.pools()["connections"] != base["connections"]:
        assert time.monotonic() < deadline
        time.sleep(0.01)
    assert observer.pools()["carveout_used"] == base["carveout_used"]
    observer.close()


def test_connection_flood_is_refused_past_the_limit(bdev):
    """One process past its connection share: the newcomers are refused
    (ERR_BUSY or closed), the connections already open keep working."""
    import re
    per_peer = int(re.search(r"connections \((\d+) per process\)", bdev.output()).group(1))
    observer = Client(bdev.path, staging_size=0, printf_size=0, timeout=10)
    base = observer.pools()["connections"]
    socks = []
    try:
        for _ in range(per_peer - 1 + 20):
            c = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
            c.connect(bdev.path)  # blocking: waits while the listen backlog is full
            c.settimeout(10)
            socks.append(c)
        answered = refused = 0
        for i, c in enumerate(socks):
            try:
                c.send(HDR.pack(P.MsgType.PING, i, 16, 0))
                r = c.recv(64)
            except (BrokenPipeError, ConnectionResetError):
                r = b""
            if r and HDR.unpack_from(r)[3] == 0:
                assert HDR.unpack_from(r)[:2] == (0x1001, i)
                answered += 1
            else:  # refused: answered ERR_BUSY, or closed at once
                assert not r or HDR.unpack_from(r)[:4] == (0x1001, i, 24, P.Status.ERR_BUSY)
                refused += 1
        assert answered == per_peer - 1 and refused == 20, (answered, refused)
        assert observer.ping()["version"] == "3.0.0"  # existing connections are unaffected
    finally:
        for c in socks:
            c.close()
    deadline = time.monotonic() + 2
    while observer.pools()["connections"] != base:
        assert time.monotonic() < deadline
        time.sleep(0.01)
    with Client(bdev.path, staging_size=0, printf_size=0, timeout=10) as fresh:
        assert fresh.ping()["version"] == "3.0.0"
    observer.close()


def test_buffer_exhaustion_is_err_nomem_and_recovers(bdev):
    observer = Client(bdev.path, staging_size=0, printf_size=0, timeout=10)
    base = observer.pools()
    with Client(bdev.path, staging_size=0, printf_size=0, timeout=10) as c:
        big = []
        with pytest.raises(OutOfMemory) as e:
            for _ in range(100):
                big.append(c.alloc(4 << 20))
        # the connection's share of the window (3/4 of 64 MiB) ends it first
        assert "connection quota: 4194304 bytes requested" in str(e.value) and "of 50331648" in str(e.value)
        assert len(big) == 12
        # Another client fills the rest of the window: refused with numbers, still served otherwise.
        with pytest.raises(OutOfMemory, match="carveout window has no room.*total 67108864"):
            for _ in range(100):
                big.append(observer.alloc(4 << 20))
        assert observer.ping()["version"] == "3.0.0"
        for b in big[:12]:
            c.detach(b)
        for b in big[12:]:
            observer.detach(b)
        # Per-connection buffer count limit.
        small = []
        with pytest.raises(OutOfMemory, match=f"limit {MAX_BUFS}"):
            for _ in range(MAX_BUFS + 1):
                small.append(c.alloc(4096))
        assert len(small) == MAX_BUFS
        for b in small[:10]:
            c.detach(b)
        c.alloc(4096)  # room again
    deadline = time.monotonic() + 1
    while observer.pools()["carveout_used"] != base["carveout_used"]:
        assert time.monotonic() < deadline
        time.sleep(0.01)
    observer.close()


def test_send_error_on_full_socket_is_eagain_not_a_device_problem():
    """Sanity check of the mechanism the flow control relies on."""
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    a.setblocking(False)
    with pytest.raises(BlockingIOError) as e:
        for _ in range(1_000_000):
            a.send(bytes(64))
    assert e.value.errno == errno.EAGAIN
    a.close()
    b.close()


def test_pipelining_client_never_deadlocks_with_flow_control(bdev):
    """A host that submits thousands of tasks before waiting for any: the
    device stops reading it while its responses sit unread, and the client's
    send takes those responses aside instead of blocking for ever."""
    with Tasks(socket=bdev.path) as u:
        blocker = block_core(u, 200)
        i, o = u.malloc(4), u.malloc(4)
        t0 = time.monotonic()
        seqs = [u.client.send(P.Rpc(cmd=NOP, core=0, input_dsp_addr=i.phy, input_size=4, output_dsp_addr=o.phy,
                                    output_size=4)) for _ in range(5000)]
        statuses = [u.client.wait(s, 30).status for s in seqs]
        u.wait(blocker, 30_000)
        assert time.monotonic() - t0 < 30
        assert set(statuses) <= {P.Status.SUCCESS, P.Status.ERR_BUSY}
        assert statuses.count(P.Status.ERR_BUSY) > 0 and statuses.count(P.Status.SUCCESS) >= PER_CONN - 1


# ---------------------------------------------------------------- a busy core, connection shares, fd budgets

def big_library(cmd: int) -> str:
    """An ordinary op library of ~120 KiB (a table in its source)."""
    table = ",".join(str(i % 251) for i in range(30_000))
    return textwrap.dedent(f"""
        import numpy as np
        from dspx.device.core import runtime as rt
        TABLE = np.array([{table}], np.uint8)

        @rt.register_op({cmd})
        def op(inp, out, tm):
            return int(TABLE[0])
    """)


def raw(path: str) -> socket.socket:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    s.connect(path)  # blocking: waits while the listen backlog is full
    s.settimeout(10)
    return s


def ping_s(s: socket.socket, seq: int = 1) -> float:
    t0 = time.monotonic()
    s.send(HDR.pack(P.MsgType.PING, seq, 16, 0))
    r = s.recv(64)
    assert HDR.unpack_from(r)[:4] == (0x1001, seq, 24, 0), r
    return time.monotonic() - t0


def test_ping_answers_while_a_core_runs_a_long_task_and_libraries_load_and_clients_close(spin_device):
    """A core busy for 8 s does not read its channel; the front still answers
    a bystander's PING within 0.5 s while 120 KiB libraries load (copies queued
    for that core) and clients close with 120 mapped buffers each."""
    busy = Tasks(socket=spin_device.path)
    inp, out = busy.malloc(4), busy.malloc(8)
    inp.view(np.int32, 1)[0] = 8000
    busy.submit(busy.rpc(SPIN, inp, out), core=1)
    while bytes(out.vir[:4]) != b"RUN!":
        time.sleep(0.001)
    by = raw(spin_device.path)
    worst = 0.0
    loaders = [Tasks(socket=spin_device.path) for _ in range(3)]
    import threading
    loads = [threading.Thread(target=u.load_ops, args=(big_library(0x3C00 + i),)) for i, u in enumerate(loaders)]
    try:
        for t in loads:  # each waits until core 1 has it too: the answers come after the 8 s task
            t.start()
        for i in range(10):
            worst = max(worst, ping_s(by, 10 + i))
            time.sleep(0.02)
        for i in range(4):  # clients whose buffers core 1 knows, closing while it is busy
            c = Client(spin_device.path, staging_size=0, printf_size=0, timeout=10)
            t = Tasks(client=c)
            mems = [t.malloc(4096) for _ in range(120)]
            t.wait(t.submit(t.rpc(SPIN, mems[0], mems[1]), core=0), 10_000)  # core 0 maps all 120
            t.submit(t.rpc(SPIN, mems[0], mems[1]), core=1)  # queued behind the long task
            c.close()
            worst = max(worst, ping_s(by, 20 + i))
        for i in range(20):
            worst = max(worst, ping_s(by, 40 + i))
        assert worst < 0.5, f"slowest PING {worst:.3f} s while core 1 was busy"
    finally:
        busy.close()  # aborts the 8 s task
        for t in loads:
            t.join(30)
        for u in loaders:
            u.close()
        by.close()
    with Tasks(socket=spin_device.path) as u:  # core 1 serves again
        t = u.run(SPIN, u.malloc(4), u.malloc(8), core=1)
        assert t.return_value == 0


def test_a_process_past_its_connection_share_is_refused_with_the_numbers_and_others_keep_theirs(spin_device):
    per_peer = int(re.search(r"connections \((\d+) per process\)", spin_device.output()).group(1))
    held = [raw(spin_device.path) for _ in range(per_peer)]
    try:
        for i, s in enumerate(held[:3]):
            ping_s(s, i + 1)
        with pytest.raises(DeviceError) as e:
            Client(spin_device.path, staging_size=0, printf_size=0, timeout=10)
        assert e.value.status_name == "ERR_BUSY"
        assert f"has {per_peer} connections open to this device (limit {per_peer} per process)" in str(e.value)
        # another process is not locked out, and the held connections still work
        out = subprocess.run([sys.executable, "-c", "from dspx.host.client import Client; import sys; "
                              f"print(Client({spin_device.path!r}, staging_size=0, printf_size=0).ping()['version'])"],
                             capture_output=True, text=True, timeout=60)
        assert out.stdout.strip() == "3.0.0", out.stderr
        for i, s in enumerate(held):
            ping_s(s, 100 + i)
    finally:
        for s in held:
            s.close()


def test_front_spends_one_fd_per_buffer(spin_device):
    front = psutil.Process(spin_device.proc.pid)
    with Client(spin_device.path, staging_size=0, printf_size=0, timeout=10) as c:
        c.ping()
        before = front.num_fds()
        bufs = [c.alloc(4096) for _ in range(100)]
        assert front.num_fds() - before == 100
        for b in bufs:
            c.detach(b)
        assert front.num_fds() == before


def _limit_fds(n: int):
    def pre():
        resource.setrlimit(resource.RLIMIT_NOFILE, (n, n))
    return pre


def test_four_clients_with_128_buffers_at_a_1024_fd_limit_get_err_nomem_and_the_device_stays_up(tmp_path):
    path = str(tmp_path / "d" / "dsp0.sock")
    log = open(tmp_path / "device.log", "w+b")
    proc = subprocess.Popen([sys.executable, "-m", "dspx.device", "--socket", path, "--cores", "2",
                             "--carveout-size", "256M"], stdout=log, stderr=log, preexec_fn=_limit_fds(1024))
    try:
        deadline = time.monotonic() + 60
        while "listening on" not in (text := open(tmp_path / "device.log").read()):
            assert proc.poll() is None and time.monotonic() < deadline, text
            time.sleep(0.01)
        assert "fd limit 1024" in text
        total = int(re.search(r"(\d+) buffers \(", text).group(1))
        clients = [Tasks(socket=path, staging_size=0, printf_size=0) for _ in range(4)]
        refused = []
        for u in clients:
            for _ in range(128):
                try:
                    u.malloc(4096)
                except OutOfMemory as e:
                    refused.append(str(e))
        attached = 4 * 128 - len(refused)
        assert attached == total, (attached, total)
        assert refused and all(f"device has {total} buffers attached (limit {total} for all connections, from the "
                                "fd limit 1024)" in r for r in refused), refused[:1]
        # every core can still map what it is given: a task on each core over all 128 buffers of a client
        u = clients[0]
        u.free(u._mems[-1])  # room for the library's source buffer
        u.load_ops(spin_ops.SOURCE)
        i32 = u._mems[0]
        i32.view(np.int32, 1)[0] = 0
        for core in (0, 1):
            assert u.run(SPIN, i32, u._mems[1], core=core).return_value == 0
        with Tasks(socket=path, staging_size=0, printf_size=0) as v:  # a newcomer is still served
            assert v.client.ping()["version"] == "3.0.0"
        # a crashed core restarts under the limit: fault injection is off, so kill it from outside
        core1 = sorted(children_of(proc))[-1]
        os.kill(core1, signal.SIGKILL)
        deadline = time.monotonic() + 20
        while True:
            try:
                # the new core 1 maps that client's 127 buffers again, and has the library again
                assert u.run(SPIN, i32, u._mems[1], core=1).return_value == 0
                break
            except DeviceError:
                assert time.monotonic() < deadline
                time.sleep(0.1)
        for u in clients:
            u.close()
        assert proc.poll() is None
        assert "Too many open files" not in open(tmp_path / "device.log").read()
    finally:
        proc.terminate()
        proc.wait(10)


def children_of(proc) -> set[int]:
    return {p.pid for p in psutil.Process(proc.pid).children()}


def test_ping_carrying_250_fds_gets_ping_resp_and_the_fds_are_closed(spin_device):
    front = psutil.Process(spin_device.proc.pid)
    s = raw(spin_device.path)
    ping_s(s, 1)
    before = front.num_fds()
    fds = [os.open(os.devnull, os.O_RDONLY) for _ in range(250)]
    try:
        socket.send_fds(s, [HDR.pack(P.MsgType.PING, 2, 16, 0)], fds)
        r = s.recv(64)
        assert HDR.unpack_from(r)[:4] == (0x1001, 2, 24, 0) and len(r) == 24
    finally:
        for fd in fds:
            os.close(fd)
    ping_s(s, 3)
    assert front.num_fds() == before
    s.close()
