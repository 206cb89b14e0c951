"""Back-pressure: floods of requests, connections and allocations get
ERR_BUSY / ERR_NOMEM answers (or a refused connection), never a hang or an
unbounded queue; a client that never reads its responses cannot make the
device's memory grow.  Limits: docs/reliability.md."""
from __future__ import annotations

import errno
import socket
import struct
import textwrap
import time

import numpy as np
import psutil
import pytest

from dspx.abi import protocol as P
from dspx.errors import OutOfMemory
from dspx.host.client import Client
from dspx.host.tasks import Tasks
from conftest import Device

HDR = struct.Struct("<IIIi")
SPIN, NOP = 0x3C01, 0x3C02
PER_CONN, TOTAL, MAX_CONNS, MAX_BUFS = 256, 4096, 512, 128  # service.py limits
OPS = textwrap.dedent("""
    import numpy as np
    from dspx.device.core import runtime as rt

    @rt.register_op(0x3C01)
    def spin(inp, out, tm):
        ms = int(np.frombuffer(inp, np.int32, count=1)[0])
        t0 = rt.cycles()
        while rt.cycles() - t0 < ms * 1_000_000:
            pass
        return 0

    @rt.register_op(0x3C02)
    def nop(inp, out, tm):
        return 0
""")


@pytest.fixture(scope="module")
def bdev():
    d = Device("--carveout-size", "64M", "--ddr-pool-size", "64M")
    with Tasks(socket=d.path) as u:
        u.load_ops(OPS)
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
