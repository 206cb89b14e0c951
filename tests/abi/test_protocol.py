"""The wire layouts of docs/protocol.md, written out by hand (offsets and sizes), and
the encoder/decoder checked against them — not against itself."""
import struct

import pytest

from dspx.abi import layout
from dspx.abi import protocol as P
from dspx.abi.protocol import Status

# (class, request type code, total size, [(offset, struct fmt, field, value)])
LAYOUTS = [
    (P.Ping, 0x0001, 16, []),
    (P.PingResp, 0x1001, 24, [(16, "I", "version", 0x030000), (20, "I", "uptime_ms", 1234)]),
    (P.GetStatus, 0x0003, 16, []),
    (P.StatusResp, 0x1003, 32, [(16, "I", "version", 0x030000), (20, "I", "uptime_ms", 5),
                                (24, "I", "jobs_completed", 7), (28, "I", "jobs_failed", 2)]),
    (P.DynLoad, 0x0010, 32, [(16, "I", "elf_size", 47_000_000), (20, "I", "flags", 1),
                             (24, "I", "reserved0", 5), (28, "I", "reserved1", 6)]),
    (P.DynLoadResp, 0x1010, 68, [(16, "I", "module_handle", 3), (20, "I", "text_size", 100),
                                 (24, "I", "data_size", 200), (28, "I", "oom_requested", 11),
                                 (32, "I", "oom_free", 12), (36, "I", "oom_total", 13),
                                 (40, "Q", "io_input_bytes", 11_802_496), (48, "Q", "io_output_bytes", 24_384_320),
                                 (56, "I", "io_num_inputs", 62), (60, "I", "io_num_outputs", 61),
                                 (64, "I", "io_flags", 1)]),
    (P.DynUnload, 0x0012, 20, [(16, "I", "module_handle", 9)]),
    (P.DynUnloadResp, 0x1012, 16, []),
    (P.ModelLoad, 0x0020, 32, [(16, "I", "weights_size", 999), (20, "I", "flags", 2), (24, "I", "reserved0", 3),
                               (28, "I", "reserved1", 4)]),
    (P.ModelLoadResp, 0x1020, 36, [(16, "I", "model_id", 4), (20, "I", "num_constants", 60),
                                   (24, "I", "oom_requested", 1), (28, "I", "oom_free", 2), (32, "I", "oom_total", 3)]),
    (P.ModelUnload, 0x0022, 20, [(16, "I", "model_id", 4)]),
    (P.ModelUnloadResp, 0x1022, 16, []),
    (P.Infer, 0x0021, 64, [(16, "I", "module_handle", 1), (20, "I", "model_id", 2), (24, "I", "num_inputs", 0),
                           (28, "I", "flags", 0x10003), (32, "Q", "input_dsp_addr", 0xC1000000),
                           (40, "Q", "input_size", 4096), (48, "Q", "result_dsp_addr", 0xC2000000),
                           (56, "Q", "result_size", 8192)]),
    (P.InferLarge, 0x0023, 80, [(16, "I", "module_handle", 1), (20, "I", "model_id", 2), (24, "I", "num_inputs", 62),
                                (28, "I", "flags", 1 << 16), (32, "Q", "descs_addr", 0xC1000000),
                                (40, "I", "descs_size", 4960), (44, "I", "reserved", 8),
                                (48, "Q", "input_dsp_addr", 0xC0F00000), (56, "Q", "input_size", 11_802_496),
                                (64, "Q", "result_dsp_addr", 0xC2000000), (72, "Q", "result_size", 12_583_040)]),
    (P.InferResp, 0x1021, 68, [(16, "i", "return_value", -1), (20, "Q", "cycles", 2**40 + 5),
                               (28, "I", "num_outputs", 6), (32, "I", "printf_size", 77),
                               (36, "Q", "descs_addr", 0xC2000000), (44, "I", "descs_size", 480),
                               (48, "I", "oom_requested", 1), (52, "I", "oom_free", 2), (56, "I", "oom_total", 3),
                               (60, "Q", "result_required", 24_384_320)]),
    (P.SetPrintfBuf, 0x0030, 32, [(16, "Q", "printf_dsp_addr", 0xDE000000), (24, "I", "printf_size", 65536),
                                  (28, "I", "reserved", 9)]),
    (P.SetPrintfBufResp, 0x1030, 16, []),
    (P.InferLargeResp, 0x1023, 68, [(16, "i", "return_value", 7), (20, "Q", "cycles", 2**33 + 9),
                                    (28, "I", "num_outputs", 61), (32, "I", "printf_size", 12),
                                    (36, "Q", "descs_addr", 0xC2000040), (44, "I", "descs_size", 4880),
                                    (48, "I", "oom_requested", 4), (52, "I", "oom_free", 5), (56, "I", "oom_total", 6),
                                    (60, "Q", "result_required", 2**35 + 64)]),
    # Extensions (docs/protocol.md, "Extensions"): every field a distinct value, so
    # two fields swapped on the wire fail.
    (P.BufAttach, 0x0040, 32, [(16, "Q", "size", 2**33 + 4096), (24, "I", "flags", 1), (28, "I", "kv_size", 12 << 20)]),
    (P.BufAttachResp, 0x1040, 32, [(16, "Q", "dsp_addr", 0xDD400000), (24, "Q", "size", 2**32 + 64)]),
    (P.BufDetach, 0x0041, 24, [(16, "Q", "dsp_addr", 0xC0001000)]),
    (P.BufDetachResp, 0x1041, 16, []),
    (P.Rpc, 0x0050, 64, [(16, "I", "cmd", 0x1402), (20, "i", "core", -1), (24, "I", "priority", 200),
                         (28, "I", "timeout_ms", 5000), (32, "Q", "input_dsp_addr", 0xC0000000),
                         (40, "Q", "input_size", 13), (48, "Q", "output_dsp_addr", 0xC1000000),
                         (56, "Q", "output_size", 256)]),
    (P.RpcResp, 0x1050, 40, [(16, "i", "return_value", -3), (20, "I", "core", 1), (24, "Q", "cycles", 2**40 + 1),
                             (32, "I", "printf_size", 99), (36, "I", "queued_us", 1234)]),
    (P.OpsLoad, 0x0051, 40, [(16, "Q", "src_dsp_addr", 0xC0008000), (24, "Q", "src_size", 131072),
                             (32, "I", "flags", 2), (36, "I", "reserved", 3)]),
    (P.OpsLoadResp, 0x1051, 28, [(16, "I", "lib_handle", 17), (20, "I", "num_ops", 3), (24, "i", "error_line", -4)]),
    (P.OpsList, 0x0052, 20, [(16, "I", "start", 9)]),
    (P.OpsListResp, 0x1052, 24, [(16, "I", "total", 12), (20, "I", "count", 0)]),
    (P.GetError, 0x0060, 16, []),
    (P.GetErrorResp, 0x1060, 24, [(16, "I", "error_seq", 41), (20, "i", "error_status", -6)]),
    (P.PoolStatus, 0x0061, 16, []),
    (P.PoolStatusResp, 0x1061, 88, [(16, "Q", "ddr_total", 2**30), (24, "Q", "ddr_used", 5 << 20),
                                    (32, "Q", "ddr_peak", 7 << 20), (40, "Q", "carveout_total", 2**31),
                                    (48, "Q", "carveout_used", 1_183_744), (56, "I", "l2_total", 1 << 20),
                                    (60, "I", "l2_used", 64), (64, "I", "connections", 2), (68, "I", "modules", 3),
                                    (72, "I", "cores", 4), (76, "I", "op_count", 5), (80, "Q", "rss_bytes", 2**34 + 3)]),
    (P.GetCost, 0x0062, 16, []),
    (P.GetCostResp, 0x1062, 200, [(16, "I", "cost_seq", 77), (20, "I", "core", 2), (24, "I", "flags", 1),
                                  (28, "I", "reserved", 6), (32, "32s", "profile", b"j6-vision".ljust(32, b"\0")),
                                  (64, "Q", "cycles", 2**40 + 10), (72, "Q", "overhead", 500),
                                  (80, "Q", "compute", 2**40), (88, "Q", "ddr_stall", 7), (96, "Q", "dma_wait", 3),
                                  (104, "Q", "ddr_loads", 25_001), (112, "Q", "ddr_stores", 25_002),
                                  (120, "Q", "tcm_loads", 25_003), (128, "Q", "tcm_stores", 25_004),
                                  (136, "Q", "ops_alu", 2**33 + 1), (144, "Q", "ops_mul", 2**33 + 2),
                                  (152, "Q", "ops_special", 2**33 + 3), (160, "Q", "ops_move", 2**33 + 4),
                                  (168, "Q", "dma_bytes_0", 409_600), (176, "Q", "dma_bytes_1", 409_664),
                                  (184, "Q", "dma_transfers_0", 50), (192, "Q", "dma_transfers_1", 51)]),
]


@pytest.mark.parametrize("cls,code,size,fields", LAYOUTS, ids=[c[0].__name__ for c in LAYOUTS])
def test_layout_against_spec(cls, code, size, fields):
    values = [v for *_, v in fields]
    assert len(set(values)) == len(values), "distinct values, or a swap of two fields goes unseen"
    msg = cls(seq=0xA5A5, status=-3, **{name: value for _, _, name, value in fields})
    raw = msg.encode()
    assert len(raw) == size == cls.fixed_size()
    assert struct.unpack_from("<IIIi", raw, 0) == (code, 0xA5A5, size, -3)
    for off, fmt, _, value in fields:
        assert struct.unpack_from("<" + fmt, raw, off)[0] == value
    # Build the same bytes by hand and decode them.
    hand = bytearray(size)
    struct.pack_into("<IIIi", hand, 0, code, 0xA5A5, size, -3)
    for off, fmt, _, value in fields:
        struct.pack_into("<" + fmt, hand, off, value)
    assert bytes(hand) == raw
    back = P.decode(bytes(hand))
    assert type(back) is cls and back.seq == 0xA5A5 and back.status == -3
    for _, _, name, value in fields:
        assert getattr(back, name) == value


def test_tensor_descriptor_layout():
    d = P.TensorDesc(0xC0001000, 4000, 2, 2, 32, (1, 1000))
    raw = d.encode()
    assert len(raw) == 80 == P.TensorDesc.SIZE
    assert struct.unpack_from("<Q", raw, 0)[0] == 0xC0001000
    assert struct.unpack_from("<Q", raw, 8)[0] == 4000
    assert struct.unpack_from("<iiii", raw, 16) == (2, 2, 32, 0)
    assert struct.unpack_from("<6q", raw, 32) == (1, 1000, 0, 0, 0, 0)
    assert P.TensorDesc.decode(raw) == d
    assert d.check() is None and d.dtype == "float32"


def test_descriptor_checks():
    assert "ndim" in P.TensorDesc(0, 0, 7, 2, 32, ()).check()
    assert "dtype" in P.TensorDesc(0, 4, 1, 2, 8, (4,)).check()
    assert "data_size" in P.TensorDesc(0, 15, 1, 2, 32, (4,)).check()
    assert P.TensorDesc.for_array(0, (1, 64), "int64").data_size == 512


def test_io_meta_layout():
    blob = P.IoMeta(62, 61, 11_802_496, 24_384_320, 1).encode()
    assert len(blob) == 40
    assert blob[:4] == b"TIOM"
    assert struct.unpack("<IIIIQQII", blob) == (0x4D4F4954, 1, 62, 61, 11_802_496, 24_384_320, 1, 0)
    assert P.IoMeta.decode(blob).input_bytes == 11_802_496
    with pytest.raises(ValueError, match="magic"):
        P.IoMeta.decode(b"XXXX" + blob[4:])


def test_io_meta_worked_example_from_spec():
    """docs/compiler.md: SmolLM-135M prefill (ids, positions (1,64) int64 + 60 KV (1,3,256,64) f32)."""
    kv = 3 * 256 * 64 * 4
    assert layout.side_bytes([64 * 8, 64 * 8] + [kv] * 60) == 11_802_496
    assert layout.side_bytes([64 * 49152 * 4] + [kv] * 60) == 24_384_320
    assert layout.side_bytes([64 * 49152 * 4]) == 12_583_040


def test_infer_with_inline_descriptors():
    descs = [P.TensorDesc.for_array(0xC1000080 + 64 * i, (4,), "float32") for i in range(5)]
    msg = P.Infer(module_handle=1, num_inputs=5, descs=descs)
    raw = msg.encode()
    assert len(raw) == 64 + 80 * 5 == 464
    assert P.decode(raw).descs == descs
    with pytest.raises(P.ProtocolError):
        P.Infer(num_inputs=6, descs=descs + descs[:1]).encode()  # 544 > 512
    assert P.MAX_INLINE_INPUTS == 5 and P.MAX_INLINE_OUTPUTS == 5
    resp = P.InferResp(num_outputs=5, descs=descs).encode()
    assert len(resp) == 68 + 400


def test_status_codes():
    assert [s.value for s in Status] == [0, -1, -2, -3, -4, -5, -6, -7, -8, -9, -10, -11, -12, -13, -14]
    assert Status.ERR_TENSOR.name == "ERR_TENSOR"


def test_infer_flags():
    assert P.FLAG_KV_RESIDENT == 0x10000 and P.REPEAT_MASK == 0xFFFF and P.INFER_FLAGS_RESERVED == 0xFFFC0000 \
        and P.FLAG_PROFILE == 0x20000


@pytest.mark.parametrize("data,status,seq", [
    (b"", Status.ERR_INVALID, None),
    (b"\x01\x00\x00\x00\x07\x00\x00\x00", Status.ERR_INVALID, 7),
    (struct.pack("<IIIi", 1, 9, 17, 0), Status.ERR_INVALID, 9),          # len != datagram size
    (struct.pack("<IIIi", 1, 9, 20, 0) + b"\0" * 4, Status.ERR_INVALID, 9),  # PING with a body
    (struct.pack("<IIIi", 0x77, 5, 16, 0), Status.ERR_OP, 5),
    (struct.pack("<IIIi", 1, 4, 600, 0) + b"\0" * 584, Status.ERR_INVALID, 4),
])
def test_decode_errors(data, status, seq):
    with pytest.raises(P.ProtocolError) as e:
        P.decode(data)
    assert e.value.status == status and e.value.seq == seq


def test_unknown_type_error_response():
    raw = P.error_response(0x77, 5, Status.ERR_OP)
    assert raw == struct.pack("<IIIi", 0x1077, 5, 16, -8)


def test_every_message_class_has_a_hand_written_layout():
    """A message added to protocol.py without its offsets here fails."""
    assert {c[0] for c in LAYOUTS} == set(P._REGISTRY.values())


def test_ops_list_entries_layout():
    """OPS_LIST_RESP entries after the 24-byte head: cmd u32, latency_us u32,
    lib_handle u32, flags u32, name char[32] (48 bytes each)."""
    entries = [(0x1402, 500, 0, 0, "softmax"), (0x2402, 7, 9, 0, "x" * 32)]
    raw = P.OpsListResp(seq=3, total=40, count=2, payload=P.OpsListResp.pack_entries(entries)).encode()
    hand = struct.pack("<IIIi", 0x1052, 3, 24 + 96, 0) + struct.pack("<II", 40, 2)
    hand += struct.pack("<IIII", 0x1402, 500, 0, 0) + b"softmax".ljust(32, b"\0")
    hand += struct.pack("<IIII", 0x2402, 7, 9, 0) + b"x" * 32
    assert raw == hand
    assert P.decode(hand).entries() == entries
    assert P.OpsListResp.MAX_ENTRIES == (512 - 24) // 48 == 10


def test_get_error_text_layout():
    raw = P.GetErrorResp(seq=4, error_seq=3, error_status=-6, payload=b"input range 0x0+8").encode()
    assert raw == struct.pack("<IIIiIi", 0x1060, 4, 24 + 17, 0, 3, -6) + b"input range 0x0+8"
    assert P.GetErrorResp.MAX_TEXT == 488


def test_extension_messages_fit_and_roundtrip():
    for cls in (P.BufAttach, P.BufAttachResp, P.BufDetach, P.Rpc, P.RpcResp, P.OpsLoad, P.OpsLoadResp,
                P.OpsList, P.GetError, P.PoolStatus, P.PoolStatusResp):
        raw = cls(seq=3).encode()
        assert len(raw) <= 512
        assert type(P.decode(raw)) is cls
    entries = [(0x1402 + i, i, 0, 0, f"op{i}") for i in range(P.OpsListResp.MAX_ENTRIES)]
    r = P.OpsListResp(total=100, count=len(entries), payload=P.OpsListResp.pack_entries(entries))
    assert len(r.encode()) <= 512
    assert P.decode(r.encode()).entries() == entries


def test_error_response_without_type_or_seq_is_a_bare_0x1000_header():
    assert P.error_response(None, None, Status.ERR_INVALID) == struct.pack("<IIIi", 0x1000, 0, 16, -2)
    assert P.error_response(0x21, 0xFFFFFFFF, Status.ERR_ADDR) == struct.pack("<IIIi", 0x1021, 0xFFFFFFFF, 16, -6)


def test_decode_errors_carry_the_type_they_could_read():
    with pytest.raises(P.ProtocolError) as e:
        P.decode(struct.pack("<IIIi", 0x21, 5, 17, 0))
    assert (e.value.msg_type, e.value.seq, e.value.status) == (0x21, 5, Status.ERR_INVALID)
    assert str(e.value) == "len field 17 != datagram size 16"
    with pytest.raises(P.ProtocolError) as e:
        P.Infer(num_inputs=6, descs=[P.TensorDesc.for_array(0, (1,), "int8")] * 6).encode()
    assert (e.value.status, e.value.seq, e.value.msg_type) == (Status.ERR_INVALID, None, None)


def test_ops_list_names_that_are_not_utf8_are_replaced():
    raw = P.OpsListResp.pack_entries([(1, 0, 0, 0, "x")])
    raw = raw[:16] + b"\xffop".ljust(32, b"\0")
    assert P.OpsListResp(total=1, count=1, payload=raw).entries() == [(1, 0, 0, 0, "\ufffdop")]
    raw = P.OpsListResp.pack_entries([(2, 0, 0, 0, "opX")])  # only the NUL padding is cut
    assert P.OpsListResp(total=1, count=1, payload=raw).entries() == [(2, 0, 0, 0, "opX")]


def test_version_string_and_message_class():
    assert P.version_str(0x030000) == "3.0.0" and P.version_str(0x0A0B0C) == "10.11.12"
    assert P.version_str(0x01FF0203) == "255.2.3"  # only the low 24 bits
    assert P.message_class(0x1061) is P.PoolStatusResp and P.message_class(0x77) is None


def test_failure_response_saturates_each_figure_to_its_fields_width():
    """A figure from elsewhere (a damaged module's 2^63-byte segment) must not
    make the failure response unencodable (docs/reliability.md §1)."""
    r = P.failure_response(P.MsgType.DYN_LOAD, 7, Status.ERR_NOMEM, oom_requested=1 << 63, oom_free=-5,
                           oom_total=(1 << 32) - 1, io_input_bytes=1 << 70, not_a_field=3)
    assert (r.seq, r.status, r.oom_requested, r.oom_free, r.oom_total) == (7, -3, (1 << 32) - 1, 0, (1 << 32) - 1)
    assert r.io_input_bytes == (1 << 64) - 1 and not hasattr(r, "not_a_field")
    assert len(r.encode()) == P.DynLoadResp.SIZE
    i = P.failure_response(P.MsgType.INFER, 1, Status.ERR_SIZE, return_value=1 << 40, result_required=-1,
                           cycles=1 << 65)
    assert (i.return_value, i.result_required, i.cycles) == ((1 << 31) - 1, 0, (1 << 64) - 1)
    j = P.failure_response(P.MsgType.INFER, 1, Status.ERR_SIZE, return_value=-(1 << 40))
    assert j.return_value == -(1 << 31)
    k = P.failure_response(P.MsgType.OPS_LOAD, 2, Status.ERR_LOAD, error_line=-7, num_ops=(1 << 32) + 1)
    assert (k.error_line, k.num_ops) == (-7, (1 << 32) - 1) and P.decode(k.encode()).error_line == -7
    assert (P.failure_response(P.MsgType.INFER, 1, -2, return_value=(1 << 31) - 1).return_value,
            P.failure_response(P.MsgType.INFER, 1, -2, result_required=(1 << 64) - 1).result_required) == \
        ((1 << 31) - 1, (1 << 64) - 1)


H = struct.Struct("<IIIi")


@pytest.mark.parametrize("data,status,seq,mtype,text", [
    (b"\x01\x00\x00", Status.ERR_INVALID, None, None, "message of 3 bytes is shorter than the 16-byte header"),
    (b"\xff\xff\xff\xff", Status.ERR_INVALID, None, 0xFFFFFFFF, "message of 4 bytes is shorter than the 16-byte header"),
    (b"\x01\x00\x00\x00\xff\xff\xff", Status.ERR_INVALID, None, 1, "message of 7 bytes is shorter than the 16-byte header"),
    (b"\x01\x00\x00\x00\xfe\xff\xff\xff", Status.ERR_INVALID, 0xFFFFFFFE, 1,
     "message of 8 bytes is shorter than the 16-byte header"),
    (H.pack(0xFFFFFF00, 0xFFFFFFF0, 513, 0) + bytes(497), Status.ERR_INVALID, 0xFFFFFFF0, 0xFFFFFF00,
     "message of 513 bytes exceeds 512"),
    (H.pack(0x77, 5, 16, 0), Status.ERR_OP, 5, 0x77, "unknown message type 0x0077"),
    (H.pack(1, 6, 20, 0) + bytes(4), Status.ERR_INVALID, 6, 1, "Ping must be 16 bytes, got 20"),
    (H.pack(0x21, 7, 100, 0) + bytes(84), Status.ERR_INVALID, 7, 0x21,
     "Infer: descriptor tail of 36 bytes is not a multiple of 80"),
])
def test_decode_error_table(data, status, seq, mtype, text):
    with pytest.raises(P.ProtocolError) as e:
        P.decode(data)
    assert (e.value.status, e.value.seq, e.value.msg_type, str(e.value)) == (status, seq, mtype, text)


def test_a_datagram_of_exactly_512_bytes_decodes():
    r = P.GetErrorResp(seq=1, error_seq=2, error_status=-2, payload=b"x" * P.GetErrorResp.MAX_TEXT)
    raw = r.encode()
    assert len(raw) == 512 and P.decode(raw).payload == b"x" * 488
    assert P.decode(memoryview(raw)).payload == b"x" * 488 and P.decode(bytearray(raw)).error_seq == 2


# ---------------------------------------------------------------- edges (each kills a mutant that survived)

def _desc_bytes(ndim, code=2, bits=32, reserved=0, shape=(2, 3, 4, 5, 6, 7), size=0) -> bytes:
    """docs/protocol.md: data_addr u64 @0, data_size u64 @8, ndim i32 @16, dtype_code i32 @20,
    dtype_bits i32 @24, reserved i32 @28, shape i64 x 6 @32."""
    return struct.pack("<QQiiii6q", 0x1000, size, ndim, code, bits, reserved, *shape)


def test_a_scalar_descriptor_decodes_to_an_empty_shape():
    d = P.TensorDesc.decode(_desc_bytes(0, size=4))
    assert (d.ndim, d.shape, d.check()) == (0, (), None)


@pytest.mark.parametrize("ndim", [-1, 7, 1 << 30])
def test_a_descriptor_with_ndim_out_of_range_keeps_all_six_extents_and_is_refused(ndim):
    d = P.TensorDesc.decode(_desc_bytes(ndim))
    assert d.shape == (2, 3, 4, 5, 6, 7) and d.check() == f"ndim {ndim} outside 0..6"


def test_a_descriptors_reserved_field_is_decoded_and_refused():
    d = P.TensorDesc.decode(_desc_bytes(1, reserved=5, shape=(3, 0, 0, 0, 0, 0), size=12))
    assert d.reserved == 5 and d.check() == "reserved field is 5, must be 0"


def test_an_oversized_message_is_refused_naming_its_size():
    descs = [P.TensorDesc.for_array(0, (1,), "float32")] * 6  # docs/protocol.md: 64 + 80·6 = 544 bytes
    with pytest.raises(P.ProtocolError) as e:
        P.Infer(descs=descs).encode()
    assert str(e.value) == "Infer would be 544 bytes > 512"


def test_io_meta_decodes_every_field_back():
    m = P.IoMeta(3, 2, 1 << 20, (1 << 40) + 7, flags=1, reserved=9)
    raw = m.encode()
    # docs/protocol.md (io_meta): magic "TIOM" u32, version u32, counts u32 x2, bytes u64 x2, flags, reserved
    assert raw == struct.pack("<IIIIQQII", 0x4D4F4954, 1, 3, 2, 1 << 20, (1 << 40) + 7, 1, 9)
    assert P.IoMeta.decode(raw) == m


@pytest.mark.parametrize("raw,text", [
    (bytes(39), "io_meta blob is 39 bytes, expected 40"),
    (struct.pack("<IIIIQQII", 0x4D4F4955, 1, 0, 0, 0, 0, 0, 0), "io_meta magic 0x4D4F4955, expected 0x4D4F4954"),
    (struct.pack("<IIIIQQII", 0x4D4F4954, 2, 0, 0, 0, 0, 0, 0), "io_meta version 2, expected 1"),
])
def test_io_meta_refusals_name_the_numbers(raw, text):
    with pytest.raises(ValueError) as e:
        P.IoMeta.decode(raw)
    assert str(e.value) == text


def test_an_unsupported_dtype_is_named_with_the_supported_ones():
    with pytest.raises(ValueError) as e:
        P.DType.code_bits("complex64")
    assert str(e.value) == ("unsupported dtype 'complex64'; supported: ['float16', 'float32', 'float64', 'int16', "
                            "'int32', 'int64', 'int8', 'uint16', 'uint32', 'uint64', 'uint8']")


@pytest.mark.parametrize("desc,ok", [
    (P.TensorDesc(0, 4, 0, 2, 32, ()), True),               # a scalar: ndim 0
    (P.TensorDesc(0, 4, 6, 2, 32, (1,) * 6), True),         # ndim 6
    (P.TensorDesc(0, 0, 2, 2, 32, (0, 5)), True),           # an empty tensor
    (P.TensorDesc(0, 2, 1, 1, 8, (2,)), True),              # uint8: 1 byte each
    (P.TensorDesc(0, 3, 1, 2, 16, (2,)), False),            # float16 x2 is 4 bytes, not 3
])
def test_descriptor_edges(desc, ok):
    assert (desc.check() is None) == ok, desc.check()


def test_descriptor_size_text_names_bytes_per_element():
    assert P.TensorDesc(0, 5, 1, 0, 16, (2,)).check() == "data_size 5 != 2 elements x 2 bytes for shape [2]"


def test_get_cost_resp_by_hand_and_its_record():
    """GET_COST_RESP written out field by field (docs/protocol.md), decoded
    into the record the host hands out (COST-SPEC names, 2 iDMA channels)."""
    counts = [1000 + i for i in range(13)]
    counts[0] = counts[1] + counts[2] + counts[3] + counts[4]  # cycles = overhead + compute + ddr_stall + dma_wait
    hand = (struct.pack("<IIIi", 0x1062, 9, 200, 0) + struct.pack("<IIII", 8, 1, 1, 0) + b"c7x-j722s" + b"\0" * 23
            + struct.pack("<13Q", *counts) + struct.pack("<QQQQ", 4096, 8192, 1, 2))
    msg = P.decode(hand)
    assert type(msg) is P.GetCostResp and msg.encode() == hand
    names = ["cycles", "overhead", "compute", "ddr_stall", "dma_wait", "ddr_loads", "ddr_stores", "tcm_loads",
             "tcm_stores", "ops_alu", "ops_mul", "ops_special", "ops_move"]
    assert msg.record() == {"profile": "c7x-j722s", "estimate": True, "seq": 8, "core": 1, "counted": True,
                            **dict(zip(names, counts)), "dma_bytes": [4096, 8192], "dma_transfers": [1, 2]}
    assert P.GetCostResp(profile=b"x").record()["counted"] is False  # flags bit 0 clear: not counted
    assert P.COST_FIELDS == tuple(names) and P.COST_PROFILE_LEN == 32 and P.COST_COUNTED == 1
    assert P.decode(P.GetCost(seq=4).encode()).seq == 4 and len(P.GetCost().encode()) == 16
    with pytest.raises(P.ProtocolError, match="must be 16 bytes"):
        P.decode(struct.pack("<IIIi", 0x0062, 1, 20, 0) + b"\0" * 4)  # GET_COST has no body
