"""The front<->core record format (device/jobs.py): byte layouts written out
by hand, every kind of bad input refused with BadRecord, direction checks,
and a bounded fuzz of the core->front decoder."""
from __future__ import annotations

import os
import pickle
import struct

import pytest

from dspx.device import jobs
from tests.fuzz import core_channel
from dspx.device.jobs import BadRecord

C2F, F2C = jobs.CORE_TO_FRONT, jobs.FRONT_TO_CORE


def u32(n):
    return struct.pack("<I", n)


def text(s: bytes):
    return u32(len(s)) + s


# ---------------------------------------------------------------- byte layouts

def test_a_call_naming_its_plan_is_tag_fixed_fields_then_empty_list_and_absent_spec():
    rec = jobs.Call(job=5, plan=7, seq=9, queued_us=3)
    # tag 7 | job u64, drop_bufs u8, plan u64, seq u32, new_conn u8, queued_us u64 | new_bufs count | spec absent
    want = struct.pack("<BQBQIBQ", 7, 5, 0, 7, 9, 0, 3) + u32(0) + b"\x00"
    assert jobs.encode(rec) == want
    assert jobs.decode(want, F2C) == rec


def test_a_done_with_an_error_numbers_and_a_value():
    rec = jobs.Done(4, 3, "é", 2, {"oom_free": 5, "cycles": 9}, jobs.WeightsLoaded(2, 4096))
    want = (struct.pack("<BQiI", 38, 4, 3, 2) + text("é".encode())
            + bytes([0b100010]) + struct.pack("<QQ", 5, 9)  # oom_free is key 1, cycles key 5
            + b"\x01" + struct.pack("<BQQ", 36, 2, 4096)  # value present: WeightsLoaded
            + b"\x00")  # no response
    assert jobs.encode(rec) == want
    assert jobs.decode(want, C2F) == rec


def test_hello_deliver_and_a_loaded_signature_by_hand():
    hello = struct.pack("<BII", 32, 1, 1234) + u32(1) + u32(0x10) + text(b"add") + u32(5)
    assert jobs.decode(hello, C2F) == jobs.Hello(1, 1234, [(0x10, "add", 5)])
    assert jobs.encode(jobs.Hello(1, 1234, [(0x10, "add", 5)])) == hello
    deliver = struct.pack("<BQ", 39, 3) + text(b"hi")
    assert jobs.decode(deliver, C2F) == jobs.Deliver(3, b"hi")
    assert jobs.encode(jobs.Switched(7)) == struct.pack("<BQ", 40, 7)
    sig = jobs.ModuleSig(True, [jobs.TensorSig("x", (2, 8), "float32")])
    loaded = (struct.pack("<BQQQ", 35, 100, 20, 0)
              + b"\x01" + struct.pack("<IIQQI", 1, 1, 64, 32, 1)  # io_meta
              + b"\x01" + struct.pack("<BB", 34, 1) + u32(1)  # ModuleSig: separate weights, 1 input
              + bytes([33]) + text(b"x") + u32(2) + struct.pack("<qq", 2, 8) + text(b"float32"))
    rec = jobs.Loaded(100, 20, 0, (1, 1, 64, 32, 1), sig)
    assert jobs.encode(rec) == loaded
    assert jobs.decode(loaded, F2C + (jobs.Loaded,)) == rec


def test_every_record_round_trips():
    spec = jobs.InferSpec(1, 2, 3, [(1, 0, (1, 3), "float32")], (1, 2, 3, 4), (5, 6, 7, 8), True, 2, (1, 2, 3),
                          0x8005, True)
    rpc = jobs.RpcSpec(1, 0x3000, (1, 0, 8), (2, 0, 8), [(1, 0x1000, 4096)], None)
    for rec in (jobs.LoadModule(1, [(3, 4096)], True, 7, 3, 4096, 1 << 62), jobs.UnloadModule(handle=2),
                jobs.LoadWeights(model_id=4, buf=3, size=9), jobs.UnloadWeights(model_id=4),
                jobs.Call(9, [], False, 1, 2, spec, True, 5), jobs.Call(9, spec=rpc),
                jobs.LoadOps(handle=1, source=b"\x7fELF", filename="<oplib>"), jobs.UnloadOps(handle=1),
                jobs.Forget(plans=[1, 2], conns=[3], bufs=[])):
        assert jobs.decode(jobs.encode(rec), F2C) == rec
    for rec in (jobs.Done(1, value=jobs.OpsLoaded([(1, "a", 0)])), jobs.Done(1, response=b"r" * 512),
                jobs.Done(1, value=jobs.Loaded(1, 2, 3, None, None))):
        assert jobs.decode(jobs.encode(rec), C2F) == rec


COST_DICT = {"profile": "j6-vision", "estimate": True, "cycles": 110, "overhead": 10, "compute": 60,
             "ddr_stall": 30, "dma_wait": 10, "ddr_loads": 1, "ddr_stores": 2, "tcm_loads": 3, "tcm_stores": 4,
             "ops_alu": 5, "ops_mul": 6, "ops_special": 7, "ops_move": 8, "dma_bytes": [4096, 0],
             "dma_transfers": [1, 0]}


def test_a_cost_record_by_hand():
    """tag 41 | job u64, cid u64, seq u32, counted u8 | profile str | the 13 counts u64 | 2 x (bytes, transfers)."""
    rec = jobs.Cost.of(5, 3, 9, COST_DICT)
    counts = [COST_DICT[k] for k in jobs.COST_COUNTS]
    want = (struct.pack("<BQQI?", 41, 5, 3, 9, True) + text(b"j6-vision") + struct.pack("<13Q", *counts)
            + struct.pack("<QQ", 4096, 0) + struct.pack("<QQ", 1, 0))
    assert jobs.encode(rec) == want
    assert jobs.decode(want, C2F) == rec
    assert rec.figures() == {k: COST_DICT[k] for k in jobs.COST_COUNTS}
    assert (rec.dma_bytes, rec.dma_transfers, rec.counted) == ((4096, 0), (1, 0), True)
    assert jobs.Cost.of(5, 3, 9, dict(COST_DICT, counted=False)).counted is False
    with pytest.raises(BadRecord, match="a Cost where only"):
        jobs.decode(want, F2C)  # a core's record, never the front's


@pytest.mark.parametrize("change, words", [
    ({"profile": "p" * (jobs.MAX_PROFILE + 1)}, ["Cost.profile", "33 bytes exceed the limit of 32"]),
    ({"cycles": -1}, ["Cost.counts", "[0]", "-1 is outside"]),
    ({"ops_move": 1 << 64}, ["Cost.counts", "[12]", "outside"]),
    ({"dma_bytes": [1, 2, 3]}, ["Cost.dma_bytes", "not a tuple of 2"]),
    ({"dma_transfers": [0, -4]}, ["Cost.dma_transfers", "[1]", "-4"]),
], ids=["long-profile", "negative", "past-u64", "three-channels", "negative-channel"])
def test_a_cost_record_out_of_range_is_bad_record(change, words):
    with pytest.raises(BadRecord) as e:
        jobs.encode(jobs.Cost.of(1, 1, 1, dict(COST_DICT, **change)))
    for w in words:
        assert w in str(e.value)


def test_a_decoded_cost_is_checked_like_every_record():
    good = jobs.encode(jobs.Cost.of(1, 1, 1, COST_DICT))
    with pytest.raises(BadRecord, match=r"Cost.*bool item 3 is 2"):
        jobs.decode(good[:21] + b"\x02" + good[22:], C2F)  # counted
    with pytest.raises(BadRecord, match="Cost.dma_transfers.*truncated"):
        jobs.decode(good[:-1], C2F)
    with pytest.raises(BadRecord, match="Cost.*1 bytes after"):
        jobs.decode(good + b"\0", C2F)


# ---------------------------------------------------------------- bad input

DONE = jobs.encode(jobs.Done(4, 3, "err", 2, {"error_line": 1}))
DONE_HEAD = struct.pack("<BQiI", 38, 4, 3, 2)


class Evil:
    """Unpickling this would create ``path``."""

    def __init__(self, path):
        self.path = path

    def __reduce__(self):
        return os.system, (f"touch {self.path}",)


@pytest.mark.parametrize("data, words", [
    (DONE[:-1], ["Done.", "truncated"]),
    (DONE + b"\0", ["Done", "1 bytes after"]),
    (b"\xff" + DONE[1:], ["unknown tag 255"]),
    (b"", ["truncated"]),
    (DONE_HEAD + u32(jobs.MAX_TEXT + 1), ["Done.error", f"length {jobs.MAX_TEXT + 1}", str(jobs.MAX_TEXT)]),
    (DONE_HEAD + text(b"\xff\xfe") + b"\0\0\0", ["Done.error", "not UTF-8", "byte 0"]),
    (DONE_HEAD + text(b"") + b"\x40" + b"\0\0", ["Done.numbers", "0x40"]),  # key bit 6: there are 6 keys
    (DONE_HEAD + text(b"") + b"\0" + b"\x02" + b"\0", ["Done.value", "presence flag 2"]),
    (DONE_HEAD + text(b"") + b"\0" + b"\x01" + bytes([32]) + struct.pack("<II", 0, 0) + u32(0) + b"\0",
     ["Done.value", "a Hello where only Loaded/WeightsLoaded/OpsLoaded"]),
    (DONE_HEAD + text(b"") + b"\0\0\x01" + u32(jobs.MAX_RESPONSE + 1), ["Done.response", "513"]),
    (struct.pack("<BII", 32, 0, 1) + u32(jobs.MAX_ITEMS + 1), ["Hello.ops", f"count {jobs.MAX_ITEMS + 1}"]),
    (jobs.encode(jobs.Call(job=1, plan=2)), ["a Call where only Hello/Done/Deliver/Switched"]),
    (pickle.dumps(jobs.Done(1)), ["unknown tag 128"]),
], ids=["truncated", "trailing", "unknown-tag", "empty", "long-string", "bad-utf8", "numbers-mask",
        "presence-flag", "wrong-nested-type", "long-response", "too-many-items", "front-to-core-type", "pickle"])
def test_bad_core_records_are_bad_record_naming_the_field(data, words):
    with pytest.raises(BadRecord) as e:
        jobs.decode(data, C2F)
    for w in words:
        assert w in str(e.value)


def test_a_bool_of_two_and_a_core_record_sent_to_a_core_are_refused():
    call = bytearray(jobs.encode(jobs.Call(job=1, plan=2)))
    call[9] = 2  # drop_bufs
    with pytest.raises(BadRecord, match=r"Call.*bool item 1 is 2"):
        jobs.decode(bytes(call), F2C)
    with pytest.raises(BadRecord, match="a Done where only"):
        jobs.decode(DONE, F2C)


@pytest.mark.parametrize("rec, words", [
    (jobs.Call(job=-1), ["Call.job", "-1 is outside 0..18446744073709551615"]),
    (jobs.Hello(1 << 32, 1, []), ["Hello.core", "4294967296"]),
    (jobs.Done(1, error="x" * (jobs.MAX_TEXT + 1)), ["Done.error", str(jobs.MAX_TEXT + 1)]),
    (jobs.Done(1, numbers={"pid": 3}), ["Done.numbers", "unknown keys ['pid']"]),
    (jobs.Done(1, numbers={"cycles": -1}), ["Done.numbers", "cycles", "-1"]),
    (jobs.Hello(0, 1, [(1, "x" * (jobs.MAX_NAME + 1), 0)]), ["Hello.ops", "[0]", "[1]", str(jobs.MAX_NAME + 1)]),
    (jobs.Done(1, value=jobs.Hello(0, 0, [])), ["Done.value", "Hello is not one of"]),
    (Evil("/nonexistent"), ["Evil is not a record"]),
])
def test_what_cannot_be_encoded_is_bad_record(rec, words):
    with pytest.raises(BadRecord) as e:
        jobs.encode(rec)
    for w in words:
        assert w in str(e.value)


def test_a_pickle_payload_is_refused_and_never_runs(tmp_path):
    marker = tmp_path / "MARKER"
    payload = pickle.dumps(Evil(marker))
    with pytest.raises(BadRecord):
        jobs.decode(payload, C2F)
    with pytest.raises(BadRecord):
        jobs.decode(payload, F2C)
    assert not marker.exists()


def test_recv_closes_the_fds_of_a_bad_datagram():
    import socket
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    r, w = os.pipe()
    before = len(os.listdir("/proc/self/fd"))
    socket.send_fds(a, [b"\xfe"], [r])
    with pytest.raises(BadRecord, match="unknown tag 254"):
        jobs.recv(jobs.endpoint(b), C2F, timeout=5)
    after = len(os.listdir("/proc/self/fd"))
    for f in (r, w):
        os.close(f)
    a.close()
    b.close()
    assert after == before  # the copy of r that came with it was closed


# ---------------------------------------------------------------- fuzz

def test_fuzzed_core_records_decode_to_a_valid_record_or_bad_record():
    got = core_channel.decoder_fuzz(200_000, seed=31)
    assert got["other"] == 0 and got["non_canonical"] == 0, got["examples"]
    assert got["bad"] > 100_000 and got["valid"] > 1000, got


def test_no_code_in_the_package_can_unpickle():
    """What made the front run a core's code: no module of dspx imports a
    deserializer that can name code (pickle, marshal, shelve, dill) or asks
    numpy to unpickle."""
    import ast
    from pathlib import Path

    import dspx
    found = []
    for path in Path(dspx.__file__).parent.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            names = []
            if isinstance(node, ast.Import):
                names = [a.name.split(".")[0] for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module.split(".")[0]]
            found += [f"{path.name}: import {n}" for n in names if n in ("pickle", "_pickle", "marshal", "shelve",
                                                                          "dill", "cloudpickle")]
            if isinstance(node, ast.keyword) and node.arg == "allow_pickle" and not (
                    isinstance(node.value, ast.Constant) and node.value.value is False):
                found.append(f"{path.name}: allow_pickle={ast.unparse(node.value)}")
    assert found == []
