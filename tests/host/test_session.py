"""host/session.py with no socket: seqs and the stash, failures as typed
exceptions with their numbers, and the io capacity rules of docs/protocol.md, "Capacity" with the
input layout of an inference.  Wire bytes and offsets are written out by hand
from docs/protocol.md, not produced by the encoder under test."""
from __future__ import annotations

import errno
import struct

import numpy as np
import pytest

from dspx.abi import protocol as P
from dspx.errors import CapacityError, CapacityLocked, CapacityWarning, DeviceError, OutOfMemory, OutputTooSmall
from dspx.host.session import IoCapacity, Session, failure

IN, OUT, KV = 0xC010_0000, 0xC020_0000, 0xDD40_0000


def header(msg_type, seq, length, status=0) -> bytes:
    return struct.pack("<IIIi", msg_type, seq, length, status)


def ping_resp(seq, uptime_ms) -> bytes:
    return header(0x1001, seq, 24) + struct.pack("<II", 0x030000, uptime_ms)


def get_error_resp(seq, error_seq, error_status, text: bytes) -> bytes:
    return header(0x1060, seq, 24 + len(text)) + struct.pack("<Ii", error_seq, error_status) + text


def desc(addr, size, code, bits, shape) -> bytes:
    """One 80-byte tensor descriptor, packed field by field as docs/protocol.md lists them."""
    return (struct.pack("<QQ", addr, size) + struct.pack("<iiii", len(shape), code, bits, 0)
            + b"".join(struct.pack("<q", s) for s in list(shape) + [0] * (6 - len(shape))))


# ================================================================ seqs
def test_seqs_count_from_one_and_are_in_the_header():
    s = Session()
    ping, status = P.Ping(), P.GetStatus()
    assert s.start(ping) == bytes.fromhex("01000000" "01000000" "10000000" "00000000")
    assert s.start(status) == bytes.fromhex("03000000" "02000000" "10000000" "00000000")
    assert (ping.seq, status.seq) == (1, 2)


def test_responses_to_other_requests_wait_for_their_own_waiter():
    s = Session()
    s.start(P.Ping())
    s.start(P.Ping())
    s.receive(ping_resp(2, 222))  # the second answer arrives first
    assert s.take(1) is None
    s.receive(ping_resp(1, 111))
    assert s.take(1).uptime_ms == 111
    assert s.take(2).uptime_ms == 222


def test_duplicates_and_strangers_are_dropped_not_stashed():
    s = Session()
    s.start(P.Ping())
    s.receive(ping_resp(1, 10))
    s.receive(ping_resp(1, 20))  # a duplicate before the first is taken: the first stands
    assert s.take(1).uptime_ms == 10
    s.receive(ping_resp(1, 30))  # a duplicate after: seq 1 is no longer outstanding
    assert s.take(1) is None
    s.receive(ping_resp(7, 70))  # an answer to a seq never sent
    for _ in range(6):
        s.start(P.Ping())  # seqs 2..7
    assert s.take(7) is None  # the stray answer was not kept for the later request 7
    s.receive(ping_resp(7, 77))
    assert s.take(7).uptime_ms == 77


# ================================================================ failures
def test_failure_carries_status_numbers_and_the_error_text():
    dyn_load = header(0x1010, 3, 68, -3) + struct.pack("<IIIIIIQQIII", 0, 0, 0, 5000, 1000, 32768, 0, 0, 0, 0, 0)
    text = b"module segments need 5000 bytes, DDR pool has 1000"
    e = failure(P.decode(dyn_load), "DYN_LOAD", P.decode(get_error_resp(4, 3, -3, text)))
    assert type(e) is OutOfMemory and e.status == -3 and e.status_name == "ERR_NOMEM"
    assert (e.oom_requested, e.oom_free, e.oom_total) == (5000, 1000, 32768)
    assert str(e) == ("ERR_NOMEM (-3) on DYN_LOAD: module segments need 5000 bytes, DDR pool has 1000 "
                      "[oom_requested=5000, oom_free=1000, oom_total=32768]")


def test_failure_ignores_error_text_about_another_seq():
    infer = header(0x1021, 9, 68, -7) + struct.pack("<iQIIQIIIIQ", 0, 0, 0, 0, 0, 0, 0, 0, 0, 74240)
    e = failure(P.decode(infer), "INFER", P.decode(get_error_resp(10, 8, -2, b"an older failure")))
    assert type(e) is OutputTooSmall and e.status_name == "ERR_SIZE" and e.result_required == 74240
    assert e.detail == "" and str(e) == "ERR_SIZE (-7) on INFER [result_required=74240]"


def test_failure_with_an_unknown_status_is_a_plain_device_error():
    e = failure(P.decode(header(0x1001, 1, 24, -99) + bytes(8)), "PING")
    assert type(e) is DeviceError and e.status_name == "STATUS(-99)"


# ================================================================ capacity (docs/protocol.md, "Capacity")
def with_buffers(input_size=4096, output_size=4096, num_inputs=1) -> IoCapacity:
    io = IoCapacity()
    io.reserve(input_size, output_size, num_inputs)
    io.replaced("input", input_size, IN)
    io.replaced("output", output_size, OUT)
    return io


def test_reserve_grows_never_shrinks_and_create_input_locks():
    io = IoCapacity()
    assert io.reserve(1000, 2000, num_inputs=2) == [("input", 1000), ("output", 2000)]
    io.replaced("input", 4096, IN)
    io.replaced("output", 4096, OUT)
    assert io.reserve(3000, 100) == []  # both fit already: never shrinks
    assert not io.locked
    assert io.create_input(64) == 192  # after the descriptor region of 2 inputs (160 -> 192)
    assert io.create_input(10) == 256
    assert io.create_input(8) == 320  # 266 rounded up to 64
    assert io.locked
    with pytest.raises(CapacityLocked, match="locked at input 4096 / output 4096"):
        io.reserve(8192, 0)


def test_only_an_inference_that_handed_back_outputs_locks():
    io = with_buffers()
    io.completed(P.InferResp(num_outputs=0))
    assert not io.locked
    assert io.reserve(8192, 0) == [("input", 8192)]  # still allowed
    io.completed(P.InferResp(num_outputs=2))
    assert io.locked
    with pytest.raises(CapacityLocked):
        io.reserve(8192, 0)


def test_planning_an_inference_does_not_lock_only_its_success_does():
    """docs/protocol.md, "Capacity": a too-small reservation can still be grown
    after an inference that failed, so the lock waits for the response."""
    io = with_buffers()
    plan = io.plan_infer(1, [np.zeros((1, 16), np.float32)], [None])
    assert not io.locked and plan.message.num_inputs == 1
    io.completed(P.InferResp(status=-7, num_outputs=0))  # ERR_SIZE: no outputs handed back
    assert not io.locked
    assert io.reserve(8192, 8192) == [("input", 8192), ("output", 8192)]


def test_a_bigger_declaration_grows_after_the_lock():
    io = IoCapacity()
    assert io.declare(1088, 192, num_inputs=7) == [("input", 1088), ("output", 192)]
    io.replaced("input", 4096, IN)
    io.replaced("output", 4096, OUT)
    old = [io.create_input(64), io.create_input(64)]
    assert old == [576, 640] and io.locked  # 7 descriptors: 560 -> 576
    assert io.declare(602240, 4160, num_inputs=1) == [("input", 602240), ("output", 4160)]
    io.replaced("input", 606208, IN + 0x10_0000)
    io.replaced("output", 8192, OUT + 0x10_0000)
    assert (io.input, io.output, io.locked) == (606208, 8192, True)
    assert io.create_input(64) == 576  # bump allocation starts over in the new input_buf
    assert io.declare(4096, 4096, num_inputs=1) == []  # never shrinks


def test_an_unmeetable_declaration_is_advisory():
    io = IoCapacity()
    assert io.declare(384, 1 << 50, num_inputs=1) == [("input", 384), ("output", 1 << 50)]
    io.replaced("input", 4096, IN)  # the client got the input side only
    w = io.unmet([("output", 1 << 50, "ERR_NOMEM")])
    assert isinstance(w, CapacityWarning)
    assert str(w) == ("io declaration could not be met: output declared 1125899906842624 bytes, allocated 0 "
                      "(ERR_NOMEM) — call reserve_io() with the real figures before the first inference")
    assert (io.input, io.output, io.locked) == (4096, 0, False)
    with pytest.raises(CapacityError):  # no output_buf yet
        io.plan_infer(1, [np.zeros((1, 64), np.float32)], [None])
    assert io.reserve(384, 74240) == [("output", 74240)]  # the caller's real figure


def test_input_over_capacity_is_efbig_before_a_plan_exists():
    io = with_buffers()
    with pytest.raises(CapacityError) as ei:
        io.plan_infer(1, [np.zeros((1, 16), np.float32), np.zeros((2, 4096), np.float32)], [None, None])
    e = ei.value
    # 2 descriptors: 160 -> 192; 64 bytes at 192; 32 KiB at 256
    assert e.errno == errno.EFBIG and (e.requested, e.capacity) == (256 + 32768, 4096)
    with pytest.raises(CapacityError) as ei:
        io.create_input(4096)
    assert (ei.value.requested, ei.value.capacity) == (128 + 4096, 4096)
    assert not io.locked


FIVE = [np.zeros((1, 16), np.float32), np.zeros((4, 4), np.float32), np.zeros(3, np.float32),
        np.zeros((1, 16), np.int64), np.zeros(1, np.float16)]
# docs/protocol.md, docs/compiler.md: descriptor region 5 x 80 = 400 -> 448, each tensor 64-aligned after it
FIVE_DESCS = [desc(IN + 448, 64, 2, 32, (1, 16)), desc(IN + 512, 64, 2, 32, (4, 4)), desc(IN + 576, 12, 2, 32, (3,)),
              desc(IN + 640, 128, 0, 64, (1, 16)), desc(IN + 768, 2, 2, 16, (1,))]


def test_up_to_max_inline_inputs_go_inline_in_infer():
    assert P.MAX_INLINE_INPUTS == len(FIVE)  # (512 - 80-byte INFER) // 80
    plan = with_buffers().plan_infer(3, FIVE, [None] * 5, model_id=2)
    m = plan.message
    assert type(m) is P.Infer and plan.table == b""
    assert (m.module_handle, m.model_id, m.num_inputs, m.flags) == (3, 2, 5, 0)
    assert (m.input_dsp_addr, m.input_size, m.result_dsp_addr, m.result_size) == (IN, 4096, OUT, 4096)
    assert [d.encode() for d in m.descs] == FIVE_DESCS
    assert [off for off, _ in plan.copies] == [448, 512, 576, 640, 768]
    assert all(a is b for (_, a), b in zip(plan.copies, FIVE))


def test_more_inputs_than_fit_inline_go_out_of_band_in_infer_large():
    six = FIVE + [np.zeros((2, 8), np.float32)]
    plan = with_buffers().plan_infer(3, six, [None] * 6)
    m = plan.message
    assert type(m) is P.InferLarge and len(m.encode()) == 80
    assert (m.num_inputs, m.descs_addr, m.descs_size, m.input_dsp_addr, m.input_size) == (6, IN, 480, IN, 4096)
    # 6 x 80 = 480 -> 512, then the same tensors 64-aligned
    assert plan.table == b"".join([desc(IN + 512, 64, 2, 32, (1, 16)), desc(IN + 576, 64, 2, 32, (4, 4)),
                                   desc(IN + 640, 12, 2, 32, (3,)), desc(IN + 704, 128, 0, 64, (1, 16)),
                                   desc(IN + 832, 2, 2, 16, (1,)), desc(IN + 896, 64, 2, 32, (2, 8))])
    assert [off for off, _ in plan.copies] == [512, 576, 640, 704, 832, 896]


def test_in_place_and_kv_inputs_are_not_copied():
    io = with_buffers(num_inputs=3)
    io.kv_addr = KV
    x = np.zeros((1, 16), np.float32)
    off = io.create_input(x.nbytes)
    assert off == 256  # 3 descriptors: 240 -> 256
    y = np.ones((1, 16), np.float32)
    plan = io.plan_infer(1, [x, y], [off, None], repeat=3, kv_resident=True,
                         kv_inputs=[(1, 4096, (1, 3, 4, 4), "float32")])
    m = plan.message
    assert m.flags == 0x1_0003  # repeat 3 | KV_RESIDENT (bit 16)
    assert [d.encode() for d in m.descs] == [desc(IN + 256, 64, 2, 32, (1, 16)),
                                             desc(KV + 4096, 192, 2, 32, (1, 3, 4, 4)),
                                             desc(IN + 320, 64, 2, 32, (1, 16))]  # after the created array
    assert [(o, a is y) for o, a in plan.copies] == [(320, True)]


def test_out_of_band_descriptors_may_not_overwrite_created_arrays():
    io = with_buffers(num_inputs=1)
    assert io.create_input(64) == 128
    seven = [np.zeros(4, np.float32)] * 7
    with pytest.raises(CapacityError, match="descriptor region needs 560 bytes"):
        io.plan_infer(1, seven, [None] * 7)  # 7 x 80 bytes would cover the array at 128


# ---------------------------------------------------------------- edges (each kills a mutant that survived)

def test_failure_text_of_invalid_utf8_is_replaced_not_an_error():
    resp = P.DynLoadResp(seq=4, status=P.Status.ERR_LOAD)
    err = failure(resp, "DYN_LOAD", P.GetErrorResp(error_seq=4, error_status=-9, payload=b"bad \xff byte"))
    assert "bad \ufffd byte" in str(err) and err.status_name == "ERR_LOAD"
    assert failure(resp, "DYN_LOAD", P.GetErrorResp(error_seq=3, payload=b"older")).detail == ""


def test_unmet_names_each_side_joined_by_semicolons():
    io = IoCapacity()
    w = io.unmet([("input", 100, "ERR_NOMEM"), ("output", 200, "window full")])
    assert str(w).startswith("io declaration could not be met: input declared 100 bytes, allocated 0 (ERR_NOMEM); "
                             "output declared 200 bytes, allocated 0 (window full) — ")


def test_create_input_starts_past_the_declared_descriptor_region_and_fills_to_the_last_byte():
    io = with_buffers(4096, 4096, num_inputs=3)  # 240 -> 256
    assert io.create_input(100) == 256
    assert io.create_input(4096 - 384) == 384  # 356 -> 384, ends exactly at 4096
    with pytest.raises(CapacityError) as e:
        io.create_input(1)
    assert (e.value.requested, e.value.capacity) == (4096 + 1, 4096)


def test_create_input_needs_an_input_buffer():
    io = IoCapacity()
    with pytest.raises(CapacityError) as e:
        io.create_input(64)
    assert (e.value.requested, e.value.capacity) == (64, 0) and not io.locked


def test_arrays_handed_out_from_offset_0_leave_no_room_for_a_descriptor_table():
    io = with_buffers(8192, 4096, num_inputs=0)
    assert io.create_input(64) == 0
    six = [np.zeros(4, np.float32)] * 6  # INFER_LARGE: 480-byte table at input_buf's start
    with pytest.raises(CapacityError) as e:
        io.plan_infer(1, six, [None] * 6)
    assert (e.value.requested, e.value.capacity) == (480, 0)


def test_a_new_input_buffer_forgets_the_arrays_of_the_old_one():
    io = with_buffers()
    io.create_input(64)
    before = io.state()
    io.replaced("input", 8192, IN + 0x10_0000)
    assert io.state() != before and io.create_input(64) == 128  # bump allocation starts over


def test_the_first_handed_out_array_bounds_the_descriptor_table():
    io = with_buffers(8192, 4096, num_inputs=0)
    assert (io.create_input(600), io.create_input(64)) == (0, 640)
    with pytest.raises(CapacityError, match="descriptor region"):
        io.plan_infer(1, [np.zeros(4, np.float32)] * 6, [None] * 6)
    with pytest.raises(CapacityError, match="create_input needs 8256 bytes but input_buf holds 8192"):
        io.create_input(7552)  # from 704 (after the two arrays): 64 bytes too many


def test_a_reservation_without_an_input_count_reserves_no_descriptor_region():
    io = IoCapacity()
    io.reserve(4096, 4096)
    io.replaced("input", 4096, IN)
    io.replaced("output", 4096, OUT)
    assert io.create_input(64) == 0


def test_start_bytes_writes_the_next_seq_at_offset_4_and_waits_for_it():
    s = Session()
    s.start(P.Ping())  # seq 1
    req = bytearray(header(0x0001, 0, 16))
    assert s.start_bytes(req) == 2
    assert bytes(req) == header(0x0001, 2, 16)  # only bytes 4..8 changed
    s.receive(ping_resp(2, 7))
    assert s.take(2).uptime_ms == 7


def test_seqs_wrap_within_the_32_bit_header_field():
    import itertools

    s = Session()
    s._seqs = itertools.count(0xFFFF_FFFF)  # the 4,294,967,295th request of a connection
    req = bytearray(16)
    assert s.start_bytes(req) == 0xFFFF_FFFF and req[4:8] == b"\xff\xff\xff\xff"
    assert s.start_bytes(req) == 0 and req[4:8] == bytes(4)  # 2**32 wraps to 0
    s.receive(ping_resp(0, 5))
    assert s.take(0).uptime_ms == 5


def test_a_new_session_has_no_buffers_and_an_empty_layout_key():
    io = Session().io
    assert isinstance(io, IoCapacity) and (io.input, io.output, io.locked) == (0, 0, False)
    # sizes, addresses, KV address, descriptor region, created arrays: nothing yet
    assert io.state() == (0, 0, 0, 0, 0, 0, None)


def test_a_declaration_grows_only_a_side_that_is_too_small():
    io = with_buffers(4096, 4096, num_inputs=0)
    assert io.declare(4096, 4096) == []  # exactly the size it has: no new buffer
    assert io.declare(4097, 4096) == [("input", 4097)]
    assert io.tensors_from == 0  # no input count declared: no descriptor region


def test_an_inference_before_any_buffer_names_what_it_needed():
    x = [np.zeros(16, np.float32), np.zeros(8, np.int64)]
    with pytest.raises(CapacityError) as ei:
        IoCapacity().plan_infer(1, x, [None, None])
    e = ei.value
    assert (e.errno, e.requested, e.capacity) == (errno.EFBIG, 128, 0)
    assert str(e).startswith("[Errno 27] inference needs 128 bytes but input_buf holds 0 (EFBIG)"), str(e)


def test_inputs_may_end_on_input_bufs_last_byte():
    io = with_buffers(1024, 4096, num_inputs=1)
    plan = io.plan_infer(1, [np.zeros(1024 - 128, np.uint8)], [None])  # 1 descriptor: 80 -> 128
    assert [off for off, _ in plan.copies] == [128]
    assert plan.message.model_id == 0 and plan.message.flags == 0  # defaults: no weights, no repeat/flags
    with pytest.raises(CapacityError) as ei:
        io.plan_infer(1, [np.zeros(1024 - 127, np.uint8)], [None])
    assert (ei.value.requested, ei.value.capacity) == (1025, 1024)
    assert str(ei.value).startswith("[Errno 27] input needs 1025 bytes but input_buf holds 1024"), str(ei.value)


def test_profile_sets_flag_bit_17():
    m = with_buffers().plan_infer(1, [np.zeros(4, np.float32)], [None], repeat=2, profile=True).message
    assert m.flags == (1 << 17) | 2


def test_inline_descriptors_leave_arrays_handed_out_from_offset_0_alone():
    io = with_buffers(8192, 4096, num_inputs=0)
    x = np.zeros(16, np.float32)
    assert io.create_input(x.nbytes) == 0  # no descriptor region declared
    m = io.plan_infer(1, [x], [0]).message  # INFER: descriptors in the message, not in input_buf
    assert type(m) is P.Infer and [d.encode() for d in m.descs] == [desc(IN, 64, 2, 32, (16,))]


def test_an_out_of_band_table_may_end_where_the_first_handed_out_array_starts():
    io = with_buffers(8192, 4096, num_inputs=8)  # 8 x 80 = 640, already 64-aligned
    assert io.create_input(64) == 640
    plan = io.plan_infer(1, [np.zeros(4, np.float32)] * 8, [None] * 8)
    assert type(plan.message) is P.InferLarge and plan.message.descs_size == 640 and len(plan.table) == 640
    assert plan.copies[0][0] == 704  # after the handed-out array
