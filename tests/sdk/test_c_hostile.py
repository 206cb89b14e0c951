"""libdspx against a hostile device: a SEQPACKET peer (``Hostile``) that
answers every request, and answers the one under test wrong — wrong sizes,
forged output addresses and descriptor tables (outside the client's
buffers), replies to other seqs, duplicates, truncation, floods.  The C
client (hostile_driver.c: the library's sources with
-fsanitize=address,undefined, leaks included) must give each a clear error
code and text, never a memory error, and drop unmatched replies (bounded) as
docs/protocol.md says and the Python session does."""
from __future__ import annotations

import errno
import mmap
import os
import struct
import subprocess
import time
from pathlib import Path

import pytest

from dspx.abi import protocol as P

import sanitized
from test_c_api import FakeDevice

HERE = Path(__file__).resolve().parent
TIMEOUT_MS = 3000
F32 = "float32"


@pytest.fixture(scope="module")
def driver(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("hostile")
    return sanitized.build(HERE / "hostile_driver.c", d / "hostile_driver")


class Hostile(FakeDevice):
    """A device that answers everything; ``replies[NAME](msg)`` gives the datagrams
    sent for a request of that name instead of the right answer (``self.right(msg)``);
    a float among them is a pause."""

    def __init__(self, tmp: Path, **replies):
        self.replies = replies
        self.bufs: dict[int, mmap.mmap] = {}  # dsp_addr -> the client's dmabuf, mapped here too
        self.next_addr = 0xC000_0000
        self.failed_seq = 0
        super().__init__(tmp)

    def _serve(self, conn):
        with conn:
            for msg, fds in self._requests(conn):
                if isinstance(msg, P.BufAttach) and fds:
                    self.bufs[self.next_addr] = mmap.mmap(fds[0], msg.size)
                for fd in fds:
                    os.close(fd)
                try:
                    for d in self.replies.get(msg.NAME, self.right)(msg):
                        time.sleep(d) if isinstance(d, float) else conn.send(d)
                except OSError:
                    return

    def right(self, msg) -> list[bytes]:
        """The correct answer."""
        s = msg.seq
        if isinstance(msg, P.BufAttach):
            addr = self.next_addr
            self.next_addr += (msg.size + 0xFFFF) & ~0xFFFF
            return [P.BufAttachResp(seq=s, dsp_addr=addr, size=msg.size).encode()]
        if isinstance(msg, P.Infer):
            return [self.infer_resp(msg).encode()]
        if isinstance(msg, P.GetError):
            return [P.GetErrorResp(seq=s, error_seq=self.failed_seq, error_status=-2,
                                   payload=b"the hostile device says no").encode()]
        resp = P._REGISTRY[msg.TYPE | P.RESPONSE_BIT](seq=s)
        if isinstance(msg, P.Ping):
            resp.version = P.VERSION
        if isinstance(msg, P.DynLoad):
            resp.module_handle = 1
        return [resp.encode()]

    def infer_resp(self, msg, *descs, **fields) -> P.InferResp:
        """A successful INFER_RESP: one float32[16] output at output_buf + 64 unless ``descs``."""
        descs = list(descs) or [P.TensorDesc.for_array(msg.result_dsp_addr + 64, (16,), F32)]
        fields = {"num_outputs": len(descs), **fields}
        return P.InferResp(seq=msg.seq, descs=descs, **fields)

    def close(self):
        super().close()
        for m in self.bufs.values():
            m.close()


@pytest.fixture
def device(tmp_path):
    made = []

    def make(**replies) -> Hostile:
        made.append(Hostile(tmp_path, **replies))
        return made[-1]

    yield make
    for d in made:
        d.close()


def run(driver, dev: Hostile, timeout_ms: int = TIMEOUT_MS, rounds: int = 1, api: str = "c7x") -> dict:
    p = subprocess.run([str(driver), dev.path, str(timeout_ms), str(rounds), api], capture_output=True, text=True,
                       timeout=120, env=dict(os.environ, **sanitized.ENV))
    assert not sanitized.reports(p.stderr), p.stderr
    assert p.returncode == 0, p.stderr
    out: dict = {}
    for line in p.stdout.splitlines():
        k, _, v = line.partition(" ")
        out.setdefault(k, []).append(v)
    got = {k: v[-1] for k, v in out.items()}
    got["all"] = out
    return got


def rc(r: dict, what: str) -> int:
    return int(r[f"{what}_rc"])


def settled(r: dict) -> None:
    """The calls after the hostile reply work, and nothing is kept for nobody."""
    for what in ("ping", "status", "pool"):
        assert rc(r, what) == 0, r[f"{what}_error"]
    assert r["pool_stash"] == "0" and r["pool_pending"] == "0"


def bare(msg, status: int = 0) -> bytes:
    return P.HEADER.pack(msg.TYPE | P.RESPONSE_BIT, msg.seq, P.HEADER_SIZE, status)


def with_len(data: bytes, length: int) -> bytes:
    return data[:8] + struct.pack("<I", length) + data[12:]


# ================================================================ the right answers
def test_a_well_behaved_reply_is_decoded(driver, device):
    d = device()
    r = run(driver, d)
    assert rc(r, "open") == 0 and rc(r, "reserve") == 0
    assert rc(r, "infer") == 0, r["infer_error"]
    assert r["infer_outputs"] == "1" and r["out0"] == "64 64 1"
    settled(r)


# ================================================================ wrong sizes, truncation
@pytest.mark.parametrize("name,make,text", [
    ("short body", lambda d, m: with_len(d.infer_resp(m).encode()[:40], 40),
     "INFER_RESP of 40 bytes: its size is 68 + 80 per"),
    ("half a descriptor", lambda d, m: with_len(d.infer_resp(m).encode() + bytes(40), 188),
     "INFER_RESP of 188 bytes: its size is 68 + 80 per descriptor"),
    ("bare header with success", lambda d, m: bare(m), "INFER_RESP of 16 bytes"),
    ("fewer descriptors than outputs", lambda d, m: d.infer_resp(m, num_outputs=3).encode(),
     "INFER_RESP of 148 bytes holds fewer than 3 descriptors"),
    ("len field says more", lambda d, m: with_len(d.infer_resp(m).encode(), 200),
     "response len field 200 != datagram size 148"),
    ("len field says less", lambda d, m: with_len(d.infer_resp(m).encode(), 68),
     "response len field 68 != datagram size 148"),
    ("shorter than a header", lambda d, m: d.infer_resp(m).encode()[:10], "datagram of 10 bytes is shorter than"),
    ("longer than 512", lambda d, m: with_len(d.infer_resp(m).encode() + bytes(600), 748),
     "datagram from the device is longer than 512 bytes"),
    ("another type", lambda d, m: P.PingResp(seq=m.seq).encode(), "response type 0x1001 to INFER, expected 0x1021"),
    ("unknown status", lambda d, m: P.InferResp(seq=m.seq, status=-99).encode(), "STATUS (-99) on INFER"),
])
def test_wrong_sizes_and_truncation_are_eproto(driver, device, name, make, text):
    d = device()
    d.replies["INFER"] = lambda m: [make(d, m)]
    r = run(driver, d)
    assert rc(r, "infer") == -errno.EPROTO, (name, r["infer_error"])
    assert text in r["infer_error"], (name, r["infer_error"])
    settled(r)


def test_a_bare_failure_header_is_the_device_status(driver, device):
    """docs/protocol.md: an undecodable request is answered with a bare 16-byte header."""
    d = device()
    d.replies["INFER"] = lambda m: (setattr(d, "failed_seq", m.seq), [bare(m, P.Status.ERR_INVALID)])[1]
    r = run(driver, d)
    assert rc(r, "infer") == -errno.EINVAL
    assert r["infer_error"] == "ERR_INVALID (-2) on INFER: the hostile device says no"
    settled(r)


@pytest.mark.parametrize("request_name,call", [("PING", "open"), ("GET_STATUS", "status"), ("POOL_STATUS", "pool"),
                                                ("BUF_ATTACH", "open")])  # the printf ring's
@pytest.mark.parametrize("delta", [-4, 8])
def test_every_other_reply_of_the_wrong_size_is_eproto(driver, device, request_name, call, delta):
    d = device()
    d.replies[request_name] = lambda m: [with_len((d.right(m)[0] + bytes(16))[:len(d.right(m)[0]) + delta],
                                                  len(d.right(m)[0]) + delta)]
    r = run(driver, d)
    assert rc(r, call) == -errno.EPROTO
    assert "_RESP of " in r[f"{call}_error"] and "bytes: its size is" in r[f"{call}_error"]


@pytest.mark.parametrize("addr", [0, (1 << 64) - 4096])
def test_a_forged_attach_address_is_refused(driver, device, addr):
    d = device()
    d.replies["BUF_ATTACH"] = lambda m: [P.BufAttachResp(seq=m.seq, dsp_addr=addr, size=m.size).encode()]
    r = run(driver, d)
    assert rc(r, "open") == -errno.EPROTO and "BUF_ATTACH_RESP gave address" in r["open_error"]


# ================================================================ forged output addresses (from_wire, dspx_buf_contains)
def _desc(addr, size, shape=None, ndim=None, code=2, bits=32):
    shape = shape if shape is not None else (size // (bits // 8),)
    return P.TensorDesc(addr, size, len(shape) if ndim is None else ndim, code, bits, tuple(shape))


OB_SIZE = 4096  # the driver's reserve_io output, page aligned
FORGED = {  # name: descriptor from (output_buf address, input_buf address)
    "in input_buf": lambda ob, ib: _desc(ib + 64, 64),
    "one byte before output_buf": lambda ob, ib: _desc(ob - 4, 64),
    "straddling the end": lambda ob, ib: _desc(ob + OB_SIZE - 32, 64),
    "one past the end": lambda ob, ib: _desc(ob + OB_SIZE, 4),
    "larger than output_buf": lambda ob, ib: _desc(ob, OB_SIZE + 64),
    "wrapping 2^64": lambda ob, ib: _desc((1 << 64) - 32, 64),
    "size near 2^64": lambda ob, ib: _desc(ob + 64, (1 << 64) - 64, shape=(1 << 60,), bits=8, code=1),
    "a size its shape does not say": lambda ob, ib: _desc(ob + 64, 64, shape=(4,)),
    "2^58 int64s said to be 0 bytes": lambda ob, ib: _desc(ob + 64, 0, shape=(1 << 58,), bits=64, code=0),
    "ndim 7": lambda ob, ib: _desc(ob + 64, 64, ndim=7),
    "ndim -1": lambda ob, ib: _desc(ob + 64, 64, ndim=-1),
    "dtype float8": lambda ob, ib: _desc(ob + 64, 64, bits=8),
    "negative extent": lambda ob, ib: _desc(ob + 64, 0, shape=(-16,)),
}


@pytest.mark.parametrize("name", list(FORGED))
def test_forged_output_descriptors_are_refused(driver, device, name):
    d = device()
    d.replies["INFER"] = lambda m: [d.infer_resp(m, FORGED[name](m.result_dsp_addr, m.input_dsp_addr)).encode()]
    r = run(driver, d)
    assert rc(r, "infer") == -errno.EPROTO, (name, r["infer_error"])
    assert "output descriptor" in r["infer_error"]
    assert "out0" not in r  # nothing handed back
    settled(r)


def test_exact_fit_at_the_end_of_output_buf_is_accepted(driver, device):
    d = device()
    d.replies["INFER"] = lambda m: [d.infer_resp(m, _desc(m.result_dsp_addr + OB_SIZE - 64, 64),
                                                 _desc(m.result_dsp_addr + OB_SIZE, 0)).encode()]
    r = run(driver, d)
    assert rc(r, "infer") == 0, r["infer_error"]
    assert r["all"]["out0"] == [f"{OB_SIZE - 64} 64 1"] and r["all"]["out1"] == [f"{OB_SIZE} 0 1"]


def _table(d: Hostile, m, descs, at: int, size: int | None = None, **fields) -> list[bytes]:
    """INFER_RESP naming a descriptor table the device wrote into output_buf at offset ``at``."""
    ob = d.bufs[m.result_dsp_addr]
    blob = P.encode_descs(descs)
    if 0 <= at <= len(ob) - len(blob):
        ob[at:at + len(blob)] = blob
    size = len(blob) if size is None else size
    return [P.InferResp(seq=m.seq, num_outputs=len(descs), descs_addr=m.result_dsp_addr + at, descs_size=size,
                        **fields).encode()]


def test_a_descriptor_table_in_output_buf_is_read_there(driver, device):
    d = device()
    d.replies["INFER"] = lambda m: _table(d, m, [_desc(m.result_dsp_addr + 1024 + 64 * i, 64) for i in range(4)],
                                          at=3072)
    r = run(driver, d)
    assert rc(r, "infer") == 0, r["infer_error"]
    assert [r["all"][f"out{i}"][0] for i in range(4)] == [f"{1024 + 64 * i} 64 1" for i in range(4)]


@pytest.mark.parametrize("name,at,size", [("straddling the end", OB_SIZE - 80, None), ("past the end", OB_SIZE, None),
                                          ("before output_buf", -80, None),
                                          ("smaller than its outputs", 0, 80 * 2 - 1),
                                          ("size 2^32-1", 0, (1 << 32) - 1)])
def test_a_forged_descriptor_table_is_refused(driver, device, name, at, size):
    d = device()
    d.replies["INFER"] = lambda m: _table(d, m, [_desc(m.result_dsp_addr + 64 * i, 64) for i in range(2)], at, size)
    r = run(driver, d)
    assert rc(r, "infer") == -errno.EPROTO, (name, r["infer_error"])
    assert "output descriptor region" in r["infer_error"] and "is outside output_buf" in r["infer_error"]
    settled(r)


def test_a_table_of_forged_descriptors_is_refused(driver, device):
    d = device()
    d.replies["INFER"] = lambda m: _table(d, m, [_desc(m.result_dsp_addr + 64, 64), _desc(m.input_dsp_addr, 64)], 0)
    r = run(driver, d)
    assert rc(r, "infer") == -errno.EPROTO and "is outside output_buf" in r["infer_error"]


def test_a_forged_printf_ring_reads_nothing_outside_it(driver, device):
    d = device()

    def infer(m):
        ring = d.bufs[0xC000_0000]  # the printf ring is attached first
        for widx, size in ((1 << 31, 64), (10, 1 << 31), (100, 17)):
            ring[:16] = struct.pack("<IIII", 0x544E5250, widx, size, 0)
        return [d.infer_resp(m, printf_size=1 << 20).encode()]

    d.replies["INFER"] = infer
    r = run(driver, d)
    assert rc(r, "infer") == 0, r["infer_error"]


# ================================================================ other seqs, duplicates, floods
def test_replies_to_other_seqs_are_dropped(driver, device):
    d = device()
    d.replies["INFER"] = lambda m: [P.InferResp(seq=s).encode() for s in (m.seq + 1, m.seq + 1000, m.seq - 1, 0)] \
        + [d.infer_resp(m).encode()]
    r = run(driver, d)
    assert rc(r, "infer") == 0 and r["out0"] == "64 64 1"
    assert r["infer_stash"] == "0" and r["infer_dropped"] == "4" and r["infer_pending"] == "0"
    settled(r)


def test_a_duplicate_is_dropped_and_never_answers_the_next_request(driver, device):
    d = device()
    late = []
    # INFER answered twice; the next request's (PING) answer comes after the duplicate
    d.replies["INFER"] = lambda m: [d.infer_resp(m).encode()] * 2
    d.replies["PING"] = lambda m: late.append(m) or [P.InferResp(seq=m.seq - 1).encode(), *d.right(m)]
    r = run(driver, d, rounds=2)
    assert r["all"]["infer_rc"] == ["0", "0"]
    assert rc(r, "ping") == 0 and r["ping_stash"] == "0"
    assert int(r["pool_dropped"]) >= 3  # the INFER duplicates and the stale one before PING_RESP
    settled(r)


def test_a_flood_of_unmatched_replies_is_dropped_not_kept(driver, device):
    """Before: every one kept (2,000 × 528 bytes, until close)."""
    d = device()
    d.replies["INFER"] = lambda m: [P.InferResp(seq=m.seq + 1 + i).encode() for i in range(2000)] \
        + [d.infer_resp(m).encode()]
    r = run(driver, d)
    assert rc(r, "infer") == 0
    assert r["infer_stash"] == "0" and r["infer_dropped"] == "2000"
    settled(r)


def test_a_late_reply_after_a_timeout_is_dropped(driver, device):
    d = device()
    d.replies["INFER"] = lambda m: [1.3, d.infer_resp(m).encode()]  # the device answers PING after this
    r = run(driver, d, timeout_ms=1000)
    assert rc(r, "infer") == -errno.ETIMEDOUT and "no response to INFER within 1000 ms" in r["infer_error"]
    assert r["infer_pending"] == "0"
    settled(r)  # the late INFER_RESP arrives while PING waits: dropped
    assert int(r["pool_dropped"]) == 1


def test_a_stream_of_replies_to_others_does_not_outlast_the_wait(driver, device):
    d = device()
    d.replies["INFER"] = lambda m: [x for i in range(400) for x in (P.InferResp(seq=m.seq + 1).encode(), 0.002)]
    t0 = time.monotonic()
    r = run(driver, d, timeout_ms=300)
    assert rc(r, "infer") == -errno.ETIMEDOUT
    assert time.monotonic() - t0 < 30
    assert r["infer_stash"] == "0"


# ================================================================ the Horizon API (hbUCP tasks)
def test_ucp_a_wrong_size_rpc_reply_fails_the_task_clearly(driver, device):
    d = device()
    d.replies["RPC"] = lambda m: [with_len(d.right(m)[0][:24], 24)]
    r = run(driver, d, api="ucp")
    assert r["all"]["wait_rc"] == [str(-errno.EPROTO)] * 2 and r["all"]["wait2_rc"] == [str(-errno.EPROTO)] * 2
    assert "RPC_RESP of 24 bytes: its size is 40" in r["wait_error"]
    assert r["all"]["release_rc"] == ["0", "0"] and r["release_pending"] == "0"


def test_ucp_replies_to_others_and_duplicates_are_dropped(driver, device):
    d = device()
    d.replies["RPC"] = lambda m: [P.RpcResp(seq=m.seq + 7).encode(), *d.right(m) * 3]
    r = run(driver, d, api="ucp")
    assert r["all"]["wait_rc"] == ["0", "0"] and r["release_stash"] == "0" and r["release_pending"] == "0"
    assert int(r["dropped"]) >= 4  # one to a seq never sent, the duplicates of the first task at least


def test_ucp_a_task_that_timed_out_gets_its_late_reply(driver, device):
    """Unlike a c7x call, a task that timed out stays pending: waited again, its late answer is there."""
    d = device()
    d.replies["RPC"] = lambda m: [0.5, *d.right(m)]
    r = run(driver, d, timeout_ms=300, api="ucp")
    assert r["all"]["wait_rc"][0] == str(-errno.ETIMEDOUT) and r["all"]["wait2_rc"][0] == "0"
    assert r["release_pending"] == "0" and r["release_stash"] == "0"
