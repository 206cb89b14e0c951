"""The device service over its real socket: a raw client using only socket
and struct, every kind of bad input, isolation between connections, the
rules that need a running job (a busy buffer, an unknown command), and clean
shutdown (SIGTERM, Ctrl-C)."""
import os
import signal
import socket
import struct
import subprocess
import sys
import textwrap
import time

import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from dspx.errors import Busy, OpFailed
from dspx.host.tasks import Tasks

HDR = struct.Struct("<IIIi")


def raw_conn(path):
    s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    s.settimeout(10)
    s.connect(path)
    return s


def xfer(s, data):
    s.send(data)
    return s.recv(4096)


def test_raw_ping_and_status_byte_for_byte(shared_device):
    s = raw_conn(shared_device.path)
    r = xfer(s, struct.pack("<IIIi", 0x0001, 41, 16, 0))
    assert len(r) == 24
    typ, seq, ln, status, version, uptime = struct.unpack("<IIIiII", r)
    assert (typ, seq, ln, status, version) == (0x1001, 41, 24, 0, 0x030000)
    assert 0 <= uptime < 600_000
    r = xfer(s, struct.pack("<IIIi", 0x0003, 42, 16, 0))
    assert len(r) == 32
    typ, seq, ln, status, version, uptime2, done, failed = struct.unpack("<IIIiIIII", r)
    assert (typ, seq, ln, status, version) == (0x1003, 42, 32, 0, 0x030000)
    assert uptime2 >= uptime  # (done and failed are u32 counters: any value is well-formed)
    s.close()


BAD = [
    ("empty datagram", b"", 0x1000, 0, -2),
    ("shorter than a header", struct.pack("<II", 1, 77), 0x1001, 77, -2),
    ("len field too small", struct.pack("<IIIi", 1, 78, 15, 0), 0x1001, 78, -2),
    ("len field too large", struct.pack("<IIIi", 1, 79, 24, 0), 0x1001, 79, -2),
    ("over 512 bytes", struct.pack("<IIIi", 1, 80, 600, 0) + bytes(584), 0x1001, 80, -2),
    ("unknown type", struct.pack("<IIIi", 0x0777, 81, 16, 0), 0x1777, 81, -8),
    ("response type sent as request", struct.pack("<IIIi", 0x1001, 82, 16, 0), 0x1001, 82, -8),
    ("PING with a body", struct.pack("<IIIi", 1, 83, 20, 0) + bytes(4), 0x1001, 83, -2),
    ("DYN_UNLOAD without its body", struct.pack("<IIIi", 0x12, 84, 16, 0), 0x1012, 84, -2),
]


@pytest.mark.parametrize("name,data,rtype,seq,status", BAD, ids=[b[0] for b in BAD])
def test_bad_framing(shared_device, name, data, rtype, seq, status):
    s = raw_conn(shared_device.path)
    r = xfer(s, data)
    assert len(r) >= 16
    t, sq, ln, st_ = HDR.unpack_from(r)
    assert (t, sq, st_) == (rtype, seq, status)
    assert ln == len(r)
    if status == -8:
        assert len(r) == 16
    # The device keeps serving this connection.
    assert struct.unpack_from("<IIIi", xfer(s, HDR.pack(1, 99, 16, 0)))[3] == 0
    s.close()


def test_known_type_wrong_body_size_gets_typed_response(shared_device):
    s = raw_conn(shared_device.path)
    r = xfer(s, HDR.pack(0x0021, 5, 20, 0) + bytes(4))  # INFER needs 64 + 80n
    t, seq, ln, status = HDR.unpack_from(r)
    assert (t, seq, status) == (0x1021, 5, -2) and ln == len(r)


def test_address_outside_connection_is_err_addr(shared_device, client_of):
    c = client_of(shared_device.path, staging_size=0)
    from dspx.abi import protocol as P
    from dspx.errors import BadAddress
    for addr in (0, 0x7E00_0000, 0x1_0200_0000, 0xC000_0000 + (63 << 20), 2**64 - 16):
        with pytest.raises(BadAddress) as e:
            c.request(P.SetPrintfBuf(printf_dsp_addr=addr, printf_size=4096))
        assert e.value.status_name == "ERR_ADDR" and "not inside" in str(e.value)
    buf = c.alloc(8192)
    # Overflow-safe: a range starting inside but wrapping 2^64 is refused.
    with pytest.raises(BadAddress):
        c.request(P.SetPrintfBuf(printf_dsp_addr=buf.dsp_addr + 4096, printf_size=8192))
    c.request(P.SetPrintfBuf(printf_dsp_addr=buf.dsp_addr, printf_size=8192))


def test_two_clients_see_only_their_own_buffers(shared_device, client_of):
    from dspx.abi import protocol as P
    from dspx.errors import BadAddress
    a = client_of(shared_device.path)
    b = client_of(shared_device.path)
    ba = a.alloc(4096)
    bb = b.alloc(4096)
    assert ba.dsp_addr != bb.dsp_addr
    # Each names its own buffer fine, the other's is ERR_ADDR.
    a.request(P.SetPrintfBuf(printf_dsp_addr=ba.dsp_addr, printf_size=4096))
    with pytest.raises(BadAddress):
        a.request(P.SetPrintfBuf(printf_dsp_addr=bb.dsp_addr, printf_size=4096))
    with pytest.raises(BadAddress):
        b.request(P.BufDetach(dsp_addr=ba.dsp_addr))
    with pytest.raises(BadAddress):  # nor the other's staging
        b.request(P.SetPrintfBuf(printf_dsp_addr=a.staging.dsp_addr, printf_size=4096))


def test_first_allocation_at_window_base(device, client_of):
    c = client_of(device.path)
    assert c.staging.dsp_addr == 0xC000_0000
    pools = c.pools()
    assert pools["carveout_used"] == c.staging.size + c.printf_buf.size


def test_disconnect_frees_everything(device, client_of):
    a = client_of(device.path)
    base = client_of(device.path, staging_size=0, printf_size=0)
    before = base.pools()
    for _ in range(3):
        a.alloc(1 << 20)
    assert base.pools()["carveout_used"] > before["carveout_used"]
    a.close()
    deadline = time.monotonic() + 2
    while base.pools()["carveout_used"] != before["carveout_used"] - a.staging.size - a.printf_buf.size:
        assert time.monotonic() < deadline
        time.sleep(0.01)
    assert base.pools()["connections"] == 1


def test_window_exhaustion_is_err_nomem_with_numbers(device, client_of):
    from dspx.errors import OutOfMemory
    c = client_of(device.path)
    with pytest.raises(OutOfMemory) as e:
        c.alloc(100 << 20)  # the test device has a 64 MiB window
    assert "ERR_NOMEM" in str(e.value) and "total 67108864" in str(e.value)
    c.alloc(4096)  # still serving


def test_attach_refuses_unsealed_or_short_fds(shared_device):
    s = raw_conn(shared_device.path)
    fd = os.memfd_create("x")
    os.ftruncate(fd, 4096)
    socket.send_fds(s, [struct.pack("<IIIiQII", 0x40, 1, 32, 0, 4096, 0, 0)], [fd])
    r = s.recv(512)
    assert HDR.unpack_from(r)[3] == -2  # not sealed
    r = xfer(s, struct.pack("<IIIiQII", 0x40, 2, 32, 0, 4096, 0, 0))  # no fd at all
    assert HDR.unpack_from(r)[3] == -2
    os.close(fd)


def test_many_connections(shared_device):
    socks = [raw_conn(shared_device.path) for _ in range(50)]
    for i, s in enumerate(socks):
        s.send(HDR.pack(1, i, 16, 0))
    for i, s in enumerate(socks):
        assert HDR.unpack_from(s.recv(64))[:2] == (0x1001, i)
        s.close()


@settings(max_examples=1500, deadline=None, suppress_health_check=list(HealthCheck))
@given(st.one_of(
    st.binary(max_size=600),
    st.builds(lambda t, seq, body, fix: (struct.pack("<IIIi", t, seq, 16 + len(body) if fix else len(body), 0) + body),
              st.sampled_from([1, 3, 0x10, 0x12, 0x20, 0x21, 0x22, 0x23, 0x30, 0x40, 0x41, 0x50, 0x51, 0x52,
                               0x60, 0x61, 0x1001, 0xFFFF]) | st.integers(0, 2**32 - 1),
              st.integers(0, 2**32 - 1), st.binary(max_size=496), st.booleans()),
))
def test_fuzz_device_keeps_answering(fuzz_conn, data):
    s = fuzz_conn
    s.send(data)
    r = s.recv(4096)
    assert len(r) >= 16 and HDR.unpack_from(r)[2] == len(r)
    assert HDR.unpack_from(r)[0] & 0x1000


@pytest.fixture(scope="module")
def fuzz_conn(shared_device):
    s = raw_conn(shared_device.path)
    yield s
    # After thousands of random datagrams the device still answers PING.
    assert struct.unpack("<IIIiII", xfer(s, HDR.pack(1, 7, 16, 0)))[:4] == (0x1001, 7, 24, 0)
    assert shared_device.alive()
    s.close()


def test_other_uid_is_refused(device):
    # Root ignores file modes, so open them up and prove SO_PEERCRED does the refusing.
    os.chmod(os.path.dirname(device.path), 0o755)
    os.chmod(device.path, 0o777)
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        try:
            os.setuid(65534)
            s = raw_conn(device.path)
            s.send(HDR.pack(1, 1, 16, 0))
            got = s.recv(64)
            os.write(w, b"answered" if got else b"refused")
        except (ConnectionError, OSError) as e:
            os.write(w, b"refused" if not isinstance(e, PermissionError) else b"eacces")
        finally:
            os._exit(0)
    os.waitpid(pid, 0)
    assert os.read(r, 64) == b"refused"


def test_sigterm_exits_cleanly_and_removes_socket(device):
    assert os.path.exists(device.path)
    device.proc.send_signal(signal.SIGTERM)
    assert device.proc.wait(10) == 0
    assert not os.path.exists(device.path)


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


def test_detach_of_a_buffer_a_running_job_uses_is_busy(default_device):
    with Tasks(socket=default_device.path) as u:
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


def test_a_client_cannot_unload_another_clients_op_library(default_device):
    """docs/protocol.md, ERR_HANDLE: another connection's library handle.
    B's unload is refused, and A's op still runs until A unloads it."""
    from dspx.errors import BadHandle
    src = "from dspx.device.core import runtime as rt\nrt.register_op(0x3102, lambda i, o, t: 7)\n"
    with Tasks(socket=default_device.path) as a, Tasks(socket=default_device.path) as b:
        handle, _ = a.load_ops(src)
        try:
            with pytest.raises(BadHandle) as e:
                b.unload_ops(handle)
            assert e.value.status_name == "ERR_HANDLE"
            assert any(o["cmd"] == 0x3102 and o["library"] == handle for o in b.ops())
            for who in (a, b):  # loaded for every client: the op runs (and returns its 7) for both
                with pytest.raises(OpFailed) as e:
                    who.run(0x3102, who.malloc(4), who.malloc(4))
                assert e.value.return_value == 7
        finally:
            a.unload_ops(handle)
    with Tasks(socket=default_device.path) as c:
        assert 0x3102 not in [o["cmd"] for o in c.ops()]


def test_an_op_library_goes_with_its_connection_and_a_device_wide_one_stays(default_device):
    """docs/protocol.md, OPS_LOAD: A's own library is unloaded when A closes;
    its device-wide one (flags bit 0) stays, serves B, and B unloads it."""
    from dspx.errors import BadHandle, OpFailed, UnknownOp
    src = "from dspx.device.core import runtime as rt\nrt.register_op({:#x}, lambda i, o, t: {})\n"
    with Tasks(socket=default_device.path) as a:
        own, _ = a.load_ops(src.format(0x3103, 3))
        wide, _ = a.load_ops(src.format(0x3104, 4), device_wide=True)
        with pytest.raises(OpFailed) as e:  # each op returns its own code: the answer is from that library
            a.run(0x3103, a.malloc(4), a.malloc(4))
        assert e.value.return_value == 3
    with Tasks(socket=default_device.path) as b:
        deadline = time.monotonic() + 30  # the device handles A's close on its own time
        while 0x3103 in [o["cmd"] for o in b.ops()]:
            assert time.monotonic() < deadline, "A's own library outlived A"
            time.sleep(0.05)
        with pytest.raises(UnknownOp):
            b.run(0x3103, b.malloc(4), b.malloc(4))
        with pytest.raises(BadHandle):
            b.unload_ops(own)
        assert any(o["cmd"] == 0x3104 and o["library"] == wide for o in b.ops())
        with pytest.raises(OpFailed) as e:
            b.run(0x3104, b.malloc(4), b.malloc(4))
        assert e.value.return_value == 4
        b.unload_ops(wide)
        assert 0x3104 not in [o["cmd"] for o in b.ops()]


def test_an_unknown_rpc_command_is_err_op_and_the_device_keeps_serving(default_device, client_of):
    from dspx.abi import protocol as P
    from dspx.errors import UnknownOp

    c = client_of(default_device.path)
    b = c.alloc(4096)
    with pytest.raises(UnknownOp) as e:
        c.request(P.Rpc(cmd=0x7ABC, input_dsp_addr=b.dsp_addr, input_size=16, output_dsp_addr=b.dsp_addr,
                        output_size=16))
    assert e.value.status_name == "ERR_OP" and "0x7abc" in str(e.value)
    assert c.ping()["version"] == "3.0.0"


def test_serve_says_where_it_listens_and_ctrl_c_stops_it_quietly(tmp_path):
    """Ctrl-C reaches the whole process group (front and cores): the device
    stops cleanly, removes its socket, and logs no core death or restart."""
    path = str(tmp_path / "d" / "dsp0.sock")
    log = open(tmp_path / "device.log", "w+b")
    proc = subprocess.Popen([sys.executable, "-m", "dspx.device", "--socket", path, "--cores", "2"],
                            stdout=log, stderr=log, start_new_session=True)
    try:
        deadline = time.monotonic() + 60
        while "listening on" not in (text := open(tmp_path / "device.log").read()):
            assert proc.poll() is None and time.monotonic() < deadline, text
            time.sleep(0.01)
        assert f"listening on {path} with 2 core(s)" in text
        with Tasks(socket=path) as u:  # a connection open at the time
            u.client.ping()
            os.killpg(proc.pid, signal.SIGINT)
            assert proc.wait(20) == 130  # Ctrl-C: 130, as a shell reports it
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    text = open(tmp_path / "device.log").read()
    assert "died" not in text and "restart" not in text and "Traceback" not in text, text
    assert not os.path.exists(path)
