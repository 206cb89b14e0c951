"""The host client: embedded default device, explicit sockets, version
check, timeouts and a device that dies."""
import errno
import json
import os
import socket
import struct
import subprocess
import sys
import threading
import time

import numpy as np
import onnxruntime as ort
import pytest

import dspx
from dspx.abi import layout
from dspx.compiler.examples import random_inputs
from dspx.errors import DeviceLost, DeviceTimeout, DspxError, VersionMismatch
from dspx.host.vm import VirtualMachine


def test_embedded_default_starts_and_stops_a_private_device(monkeypatch, tmp_path):
    monkeypatch.delenv("DSPX_SOCKET", raising=False)
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path))  # no device listens at the default path
    with dspx.Client(staging_size=1 << 20) as c:
        assert c.device is not None
        proc = c.device.proc
        assert c.ping()["version"] == "3.0.0"
        assert c.socket_path != os.path.join(str(tmp_path), f"dspx-{os.getuid()}", "dsp0.sock")
    assert proc.wait(10) == 0  # stopped when done


def test_default_socket_is_used_when_a_device_listens(monkeypatch, tmp_path):
    from dspx.transport import default_socket_path, is_listening
    monkeypatch.delenv("DSPX_SOCKET", raising=False)
    monkeypatch.delenv("DSPX_PRIVATE", raising=False)  # conftest's: a private device even when one listens
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path))
    path = default_socket_path()
    assert path == os.path.join(str(tmp_path), f"dspx-{os.getuid()}", "dsp0.sock")
    proc = subprocess.Popen([sys.executable, "-m", "dspx.device", "--quiet", "--carveout-size", "64M"])
    try:
        deadline = time.monotonic() + 30
        while not is_listening(path):
            assert time.monotonic() < deadline and proc.poll() is None
            time.sleep(0.01)
        assert os.stat(os.path.dirname(path)).st_mode & 0o777 == 0o700
        with dspx.Client(staging_size=0) as c:
            assert c.device is None and c.socket_path == path
    finally:
        proc.terminate()
        proc.wait(10)
    assert not os.path.exists(path)


def test_explicit_socket_without_device_is_a_clear_error(monkeypatch, tmp_path):
    monkeypatch.setenv("DSPX_SOCKET", str(tmp_path / "none.sock"))
    with pytest.raises(DspxError, match="no device is listening"):
        dspx.Client()


def fake_device(tmp_path, answer):
    """A one-connection SEQPACKET server that answers each request with answer(req)."""
    path = str(tmp_path / "fake.sock")
    srv = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    srv.bind(path)
    srv.listen(1)

    def run():
        while True:  # the launcher's liveness probe is a connection too
            conn, _ = srv.accept()
            while True:
                try:
                    req = conn.recv(512)
                except OSError:
                    break
                if not req:
                    break
                out = answer(req)
                if out is None:
                    continue
                if out == "die":
                    conn.close()
                    break
                conn.send(out)

    threading.Thread(target=run, daemon=True).start()
    return path


def test_major_version_mismatch_names_both(tmp_path):
    def answer(req):
        _, seq, _, _ = struct.unpack_from("<IIIi", req)
        return struct.pack("<IIIiII", 0x1001, seq, 24, 0, 0x040102, 1)
    path = fake_device(tmp_path, answer)
    with pytest.raises(VersionMismatch, match=r"host speaks 3\.0\.0, device speaks 4\.1\.2"):
        dspx.Client(path)


def test_minor_version_difference_is_accepted(tmp_path):
    def answer(req):
        t, seq, _, _ = struct.unpack_from("<IIIi", req)
        return struct.pack("<IIIiII", 0x1001, seq, 24, 0, 0x030105, 1)
    with dspx.Client(fake_device(tmp_path, answer), staging_size=0, printf_size=0) as c:
        assert c.device_version == 0x030105


def test_silent_device_times_out(tmp_path):
    path = fake_device(tmp_path, lambda req: None)
    t0 = time.monotonic()
    with pytest.raises(DeviceTimeout, match="PING"):
        dspx.Client(path, timeout=0.5)
    dt = time.monotonic() - t0
    assert dt < 5, f"timed out after {dt:.3f} s for a 0.5 s timeout"


def test_device_that_dies_mid_call_raises_device_lost(tmp_path):
    path = fake_device(tmp_path, lambda req: "die")
    with pytest.raises(DeviceLost):
        dspx.Client(path, timeout=5)


# A device that answers INFER with a forged output descriptor table: its
# replies are hand-written bytes (docs/protocol.md's layouts), the buffers it
# "attaches" sit at addresses it picks.
IN_ADDR, OUT_ADDR, OUT_SIZE = 0x10000000, 0x20000000, 8192


def hostile_device(tmp_path, num_outputs: int, descs_addr: int, descs_size: int) -> str:
    def answer(req):
        t, seq, _, _ = struct.unpack_from("<IIIi", req)
        if t == 0x0001:  # PING_RESP: version 3.0.0
            return struct.pack("<IIIiII", 0x1001, seq, 24, 0, 0x030000, 1)
        if t == 0x0040:  # BUF_ATTACH_RESP: input_buf first, then output_buf
            (size,) = struct.unpack_from("<Q", req, 16)
            return struct.pack("<IIIiQQ", 0x1040, seq, 32, 0, OUT_ADDR if size == OUT_SIZE else IN_ADDR, size)
        if t == 0x0021:  # INFER_RESP, success, no inline descriptors
            return struct.pack("<IIIi" "iQIIQIIIIQ", 0x1021, seq, 68, 0,
                               0, 1000, num_outputs, 0, descs_addr, descs_size, 0, 0, 0, 0)
        return struct.pack("<IIIi", 0x1000 | t, seq, 16, 0)  # BUF_DETACH and the rest: done
    return fake_device(tmp_path, answer)


def _infer_against(path):
    with dspx.Client(path, staging_size=0, printf_size=0, timeout=10) as c:
        c.reserve_io(4096, OUT_SIZE)
        assert (c.output_buf.dsp_addr, c.output_buf.size) == (OUT_ADDR, OUT_SIZE)
        return c.infer(7, [np.zeros(4, np.float32)])


def test_an_output_table_that_ends_on_output_bufs_last_byte_is_read(tmp_path):
    r = _infer_against(hostile_device(tmp_path, 6, OUT_ADDR + OUT_SIZE - 480, 480))
    assert r.cycles == 1000 and len(r.descs) == 6  # the zeros of a fresh output_buf


@pytest.mark.parametrize("num_outputs, descs_addr, descs_size", [
    (6, OUT_ADDR + OUT_SIZE - 479, 480),  # one byte past output_buf's end
    (6, OUT_ADDR - 80, 480),  # starts before output_buf (a negative offset)
    (6, (1 << 64) - 80, 480),  # at the top of the address space
    (6, OUT_ADDR, 400),  # inside, but too small for 6 descriptors
    (3, 0, 0),  # inline, but the reply holds none of its 3
])
def test_a_forged_output_table_is_a_bad_reply_naming_the_numbers(tmp_path, num_outputs, descs_addr, descs_size):
    from dspx.errors import BadReply
    with pytest.raises(BadReply) as e:
        _infer_against(hostile_device(tmp_path, num_outputs, descs_addr, descs_size))
    assert e.value.errno == errno.EPROTO and e.value.num_outputs == num_outputs, e.value
    if descs_size:
        assert (e.value.descs_addr, e.value.descs_size, e.value.output_addr, e.value.output_size) == \
            (descs_addr, descs_size, OUT_ADDR, OUT_SIZE)
        assert f"0x{descs_addr:x}+{descs_size}" in str(e.value) and "output_buf 0x20000000+8192" in str(e.value)
    else:
        assert "holds 0 descriptors for 3 outputs" in str(e.value)


def test_killed_device_gives_device_lost_not_a_hang(device, client_of):
    c = client_of(device.path)
    device.proc.kill()
    device.proc.wait()
    t0 = time.monotonic()
    with pytest.raises(DeviceLost):
        c.ping()
    dt = time.monotonic() - t0
    assert dt < 5, f"DeviceLost after {dt:.3f} s: at once, not after the call's 20 s timeout"


def test_printf_ring_read(device, client_of):
    """Text written into the ring (as the device does) is read back once."""
    from dspx import memory
    c = client_of(device.path)
    mm = c.printf_buf.mm
    text = b"hello from the DSP\n"
    mm[16:16 + len(text)] = text
    struct.pack_into("<IIII", mm, 0, layout.PRINTF_MAGIC, len(text), c.printf_buf.size, 0)
    assert c.read_printf() == text.decode()
    assert c.read_printf() == ""


def test_status_counts_and_pools(device, client_of):
    c = client_of(device.path)
    st = c.status()
    assert st["version"] == "3.0.0" and st["jobs_completed"] == 0 and st["jobs_failed"] == 0
    p = c.pools()
    assert p["ddr_total"] == 64 << 20 and p["ddr_used"] == 0 and p["cores"] == 1


def _ort(onnx_path, meta, inputs):
    sess = ort.InferenceSession(str(onnx_path), providers=["CPUExecutionProvider"])
    return sess.run(None, {t["name"]: a for t, a in zip(meta["inputs"], inputs)})


def _assert_matches(outs, ref):
    outs = outs if isinstance(outs, list) else [outs]
    assert len(outs) == len(ref)
    for o, r in zip(outs, ref):
        assert o.shape == r.shape and o.dtype == r.dtype
        np.testing.assert_allclose(o, r, rtol=0, atol=1e-4)


def test_one_client_loads_a_bigger_module_after_inferring_with_a_smaller_one(device, client_of, compiled,
                                                                              example_onnx):
    """docs/protocol.md, "Capacity": the small module's inference locks capacity, yet the bigger
    module's declaration still grows both buffers; an array create_input
    handed out before stays valid host memory and is copied from then on."""
    small_dir, big_dir = compiled("multi_output"), compiled("resnet18", kernels=True)
    small_meta, big_meta = (json.loads((d / "metadata.json").read_text()) for d in (small_dir, big_dir))
    c = client_of(device.path, staging_size=(big_dir / "model.so").stat().st_size + (64 << 10))
    small = VirtualMachine(small_dir, client=c)
    xs = random_inputs(small_meta)
    small_ref = _ort(example_onnx["multi_output"], small_meta, xs)
    x_dev = small.create_input(xs[0].shape, xs[0].dtype)
    x_dev[...] = xs[0]
    _assert_matches(small["main"](x_dev), small_ref)
    assert c.io_locked and c.input_capacity < big_meta["io"]["input_bytes"]
    assert c.output_capacity < big_meta["io"]["output_bytes"]

    big = VirtualMachine(big_dir, client=c)
    assert c.input_capacity >= big_meta["io"]["input_bytes"] and c.output_capacity >= big_meta["io"]["output_bytes"]
    xb = random_inputs(big_meta)
    _assert_matches(big["main"](*xb), _ort(example_onnx["resnet18"], big_meta, xb))

    assert c.in_input_buf(x_dev) is None  # it lives in the old input_buf, now detached
    np.testing.assert_array_equal(x_dev, xs[0])
    _assert_matches(small["main"](x_dev), small_ref)
    big.close()
    small.close()
