"""Wire protocol v3.0.0 (C7x compute protocol) plus dspx extensions — no I/O.

Every message is one packed little-endian struct, at most 512 bytes, starting
with the 16-byte header ``type u32, seq u32, len u32, status i32``.  A
response's type is ``0x1000 | request type`` and its seq equals the request's.

This module only turns bytes into message objects and back, and states the
size rules; the device service and the host client own the sockets.
See docs/protocol.md for every layout with offsets.
"""
from __future__ import annotations

import enum
import operator
import struct
from dataclasses import dataclass, field
from typing import ClassVar

VERSION = 0x030000  # 3.0.0 as 0xMMmmpp
MAX_MSG = 512
HEADER = struct.Struct("<IIIi")
HEADER_SIZE = HEADER.size  # 16
RESPONSE_BIT = 0x1000
MAX_NDIM = 6

# INFER flags
REPEAT_MASK = 0xFFFF
FLAG_KV_RESIDENT = 1 << 16
# Extension: time every call the entry makes; the rows come back in the printf
# ring (docs/protocol.md, "Profile records").
FLAG_PROFILE = 1 << 17
PROFILE_PREFIX = "#dspx-profile"
INFER_FLAGS_RESERVED = 0xFFFC0000

# DYN_LOAD flags (extension): bit 0 = the staged bytes are an op library
# (Python source, or a native library built with dspx build-ops) rather than a compiled module.
DYN_LOAD_OP_LIBRARY = 1 << 0
# OPS_LOAD flags (extension): bit 0 = a device-wide library, which outlives the
# connection that loaded it and any connection of the device's uid unloads;
# without it a library is its connection's and goes when that one closes.
OPS_LOAD_DEVICE_WIDE = 1 << 0

# RPC core choice
CORE_ANY = -1


def version_str(v: int) -> str:
    return f"{(v >> 16) & 0xFF}.{(v >> 8) & 0xFF}.{v & 0xFF}"


class Status(enum.IntEnum):
    SUCCESS = 0
    ERR_GENERIC = -1
    ERR_INVALID = -2
    ERR_NOMEM = -3
    ERR_BUSY = -4
    ERR_TIMEOUT = -5
    ERR_ADDR = -6
    ERR_SIZE = -7
    ERR_OP = -8
    ERR_LOAD = -9
    ERR_SYMBOL = -10
    ERR_CALL = -11
    ERR_HANDLE = -12
    ERR_WEIGHTS = -13
    ERR_TENSOR = -14

    @classmethod
    def name_of(cls, code: int) -> str:
        try:
            return cls(code).name
        except ValueError:
            return f"STATUS({code})"


class MsgType(enum.IntEnum):
    PING = 0x0001
    GET_STATUS = 0x0003
    DYN_LOAD = 0x0010
    DYN_UNLOAD = 0x0012
    MODEL_LOAD = 0x0020
    INFER = 0x0021
    MODEL_UNLOAD = 0x0022
    INFER_LARGE = 0x0023
    SET_PRINTF_BUF = 0x0030
    # --- dspx extensions ---
    BUF_ATTACH = 0x0040
    BUF_DETACH = 0x0041
    RPC = 0x0050
    OPS_LOAD = 0x0051
    OPS_LIST = 0x0052
    GET_ERROR = 0x0060
    POOL_STATUS = 0x0061
    GET_COST = 0x0062


class DType:
    """DLPack type codes used in tensor descriptors."""

    INT = 0
    UINT = 1
    FLOAT = 2

    _TO_NAME = {(0, 8): "int8", (0, 16): "int16", (0, 32): "int32", (0, 64): "int64",
                (1, 8): "uint8", (1, 16): "uint16", (1, 32): "uint32", (1, 64): "uint64",
                (2, 16): "float16", (2, 32): "float32", (2, 64): "float64"}
    _FROM_NAME = {v: k for k, v in _TO_NAME.items()}

    @classmethod
    def name(cls, code: int, bits: int) -> str | None:
        return cls._TO_NAME.get((code, bits))

    @classmethod
    def code_bits(cls, name: str) -> tuple[int, int]:
        try:
            return cls._FROM_NAME[str(name)]
        except KeyError:
            raise ValueError(f"unsupported dtype {name!r}; supported: {sorted(cls._FROM_NAME)}") from None


class ProtocolError(ValueError):
    """Bytes that are not a valid message; carries the status to answer with."""

    def __init__(self, message: str, status: int = Status.ERR_INVALID, seq: int | None = None,
                 msg_type: int | None = None):
        super().__init__(message)
        self.status = status
        self.seq = seq
        self.msg_type = msg_type


# ---------------------------------------------------------------- descriptors

@dataclass(frozen=True)
class TensorDesc:
    """80-byte tensor descriptor: data_addr u64, data_size u64, ndim i32,
    dtype_code i32, dtype_bits i32, reserved i32, shape i64 x 6."""

    data_addr: int
    data_size: int
    ndim: int
    dtype_code: int
    dtype_bits: int
    shape: tuple[int, ...]
    reserved: int = 0

    STRUCT: ClassVar[struct.Struct] = struct.Struct("<QQiiii6q")
    SIZE: ClassVar[int] = 80

    @classmethod
    def for_array(cls, addr: int, shape, dtype: str) -> "TensorDesc":
        code, bits = DType.code_bits(dtype)
        shape = tuple(int(s) for s in shape)
        n = 1
        for s in shape:
            n *= s
        return cls(addr, n * bits // 8, len(shape), code, bits, shape)

    def encode(self) -> bytes:
        shape = list(self.shape) + [0] * (MAX_NDIM - len(self.shape))
        return self.STRUCT.pack(self.data_addr, self.data_size, self.ndim, self.dtype_code,
                                self.dtype_bits, self.reserved, *shape[:MAX_NDIM])

    @classmethod
    def decode(cls, buf, offset: int = 0) -> "TensorDesc":
        addr, size, ndim, code, bits, res, *shape = cls.STRUCT.unpack_from(buf, offset)
        nd = ndim if 0 <= ndim <= MAX_NDIM else MAX_NDIM
        return cls(addr, size, ndim, code, bits, tuple(shape[:nd]), res)

    @property
    def dtype(self) -> str | None:
        return DType.name(self.dtype_code, self.dtype_bits)

    def check(self) -> str | None:
        """Why this descriptor is malformed on its own, or None."""
        if not 0 <= self.ndim <= MAX_NDIM:
            return f"ndim {self.ndim} outside 0..{MAX_NDIM}"
        if self.dtype is None:
            return f"unknown dtype (code {self.dtype_code}, bits {self.dtype_bits})"
        if self.reserved:
            return f"reserved field is {self.reserved}, must be 0"
        n = 1
        for s in self.shape:
            if s < 0:
                return f"negative extent in shape {list(self.shape)}"
            n *= s
        if n * self.dtype_bits // 8 != self.data_size:
            return (f"data_size {self.data_size} != {n} elements x {self.dtype_bits // 8} bytes "
                    f"for shape {list(self.shape)}")
        return None


def encode_descs(descs) -> bytes:
    return b"".join(d.encode() for d in descs)


def decode_descs(buf, count: int, offset: int = 0) -> list[TensorDesc]:
    return [TensorDesc.decode(buf, offset + i * TensorDesc.SIZE) for i in range(count)]


@dataclass(frozen=True)
class IoMeta:
    """The 40-byte ``tvm_dsp_io_meta`` blob a module carries."""

    num_inputs: int
    num_outputs: int
    input_bytes: int
    output_bytes: int
    flags: int = 0
    magic: int = 0x4D4F4954
    version: int = 1
    reserved: int = 0

    STRUCT: ClassVar[struct.Struct] = struct.Struct("<IIIIQQII")
    SIZE: ClassVar[int] = 40
    MAGIC: ClassVar[int] = 0x4D4F4954  # "TIOM"
    FLAG_EXACT: ClassVar[int] = 1

    def encode(self) -> bytes:
        return self.STRUCT.pack(self.magic, self.version, self.num_inputs, self.num_outputs,
                                self.input_bytes, self.output_bytes, self.flags, self.reserved)

    @classmethod
    def decode(cls, buf) -> "IoMeta":
        if len(buf) < cls.SIZE:
            raise ValueError(f"io_meta blob is {len(buf)} bytes, expected {cls.SIZE}")
        magic, ver, ni, no, ib, ob, flags, res = cls.STRUCT.unpack_from(buf)
        if magic != cls.MAGIC:
            raise ValueError(f"io_meta magic 0x{magic:08X}, expected 0x{cls.MAGIC:08X}")
        if ver != 1:
            raise ValueError(f"io_meta version {ver}, expected 1")
        return cls(ni, no, ib, ob, flags, magic, ver, res)



# ---------------------------------------------------------------- messages

_REGISTRY: dict[int, type["Message"]] = {}


@dataclass
class Message:
    """Base: a fixed body after the header, optionally followed by a tail of
    80-byte descriptors (``descs``) or free bytes (``payload``)."""

    seq: int = 0
    status: int = 0

    TYPE: ClassVar[int] = 0
    BODY: ClassVar[struct.Struct] = struct.Struct("<")
    FIELDS: ClassVar[tuple[str, ...]] = ()
    TAIL: ClassVar[str | None] = None  # "descs" | "payload" | None

    @classmethod
    def fixed_size(cls) -> int:
        return cls.SIZE

    def _tail(self) -> bytes:
        if self.TAIL == "descs":
            return encode_descs(self.descs)
        if self.TAIL == "payload":
            return bytes(self.payload)
        return b""

    def encode(self) -> bytes:
        tail = self._tail() if self.TAIL else b""
        size = self.SIZE + len(tail)
        if size > MAX_MSG:
            raise ProtocolError(f"{type(self).__name__} would be {size} bytes > {MAX_MSG}")
        return self.FULL.pack(self.TYPE, self.seq & 0xFFFFFFFF, size, self.status, *self._values()) + tail

    @classmethod
    def decode_body(cls, seq: int, status: int, data: memoryview | bytes) -> "Message":
        n = cls.SIZE
        tail_len = len(data) - n
        if tail_len < 0 or (cls.TAIL is None and tail_len != 0):
            raise ProtocolError(
                f"{cls.__name__} must be {n} bytes, got {len(data)}", Status.ERR_INVALID, seq, cls.TYPE)
        # Hot path: fill the instance directly instead of going through __init__.
        msg = cls.__new__(cls)
        d = msg.__dict__
        d.update(zip(cls.FIELDS, cls.BODY.unpack_from(data, HEADER_SIZE)))
        d["seq"] = seq
        d["status"] = status
        if cls.TAIL == "descs":
            if tail_len % TensorDesc.SIZE:
                raise ProtocolError(f"{cls.__name__}: descriptor tail of {tail_len} bytes is not a "
                                    f"multiple of {TensorDesc.SIZE}", Status.ERR_INVALID, seq, cls.TYPE)
            d["descs"] = decode_descs(data, tail_len // TensorDesc.SIZE, n)
        elif cls.TAIL == "payload":
            d["payload"] = bytes(data[n:])
        return msg


def _msg(type_code: int, fmt: str, names: str, tail: str | None = None):
    """Class decorator filling in the wire layout of a message class."""

    def deco(cls):
        cls.TYPE = type_code
        cls.BODY = struct.Struct("<" + fmt)
        cls.FULL = struct.Struct("<IIIi" + fmt)
        cls.SIZE = cls.FULL.size
        cls.FIELDS = tuple(names.split()) if names else ()
        cls.NAME = MsgType(type_code & ~RESPONSE_BIT).name + ("_RESP" if type_code & RESPONSE_BIT else "")
        get = operator.attrgetter(*cls.FIELDS) if cls.FIELDS else (lambda self: ())
        cls._values = (lambda self: (get(self),)) if len(cls.FIELDS) == 1 else (lambda self: get(self))
        cls.TAIL = tail
        _REGISTRY[type_code] = cls
        return cls

    return deco


# Requests ------------------------------------------------------------------

@_msg(MsgType.PING, "", "")
@dataclass
class Ping(Message):
    pass


@_msg(MsgType.PING | RESPONSE_BIT, "II", "version uptime_ms")
@dataclass
class PingResp(Message):
    version: int = VERSION
    uptime_ms: int = 0


@_msg(MsgType.GET_STATUS, "", "")
@dataclass
class GetStatus(Message):
    pass


@_msg(MsgType.GET_STATUS | RESPONSE_BIT, "IIII", "version uptime_ms jobs_completed jobs_failed")
@dataclass
class StatusResp(Message):
    version: int = VERSION
    uptime_ms: int = 0
    jobs_completed: int = 0
    jobs_failed: int = 0


@_msg(MsgType.DYN_LOAD, "IIII", "elf_size flags reserved0 reserved1")
@dataclass
class DynLoad(Message):
    elf_size: int = 0
    flags: int = 0
    reserved0: int = 0
    reserved1: int = 0


@_msg(MsgType.DYN_LOAD | RESPONSE_BIT, "IIIIIIQQIII",
      "module_handle text_size data_size oom_requested oom_free oom_total "
      "io_input_bytes io_output_bytes io_num_inputs io_num_outputs io_flags")
@dataclass
class DynLoadResp(Message):
    module_handle: int = 0
    text_size: int = 0
    data_size: int = 0
    oom_requested: int = 0
    oom_free: int = 0
    oom_total: int = 0
    io_input_bytes: int = 0
    io_output_bytes: int = 0
    io_num_inputs: int = 0
    io_num_outputs: int = 0
    io_flags: int = 0


@_msg(MsgType.DYN_UNLOAD, "I", "module_handle")
@dataclass
class DynUnload(Message):
    module_handle: int = 0


@_msg(MsgType.DYN_UNLOAD | RESPONSE_BIT, "", "")
@dataclass
class DynUnloadResp(Message):
    pass


@_msg(MsgType.MODEL_LOAD, "IIII", "weights_size flags reserved0 reserved1")
@dataclass
class ModelLoad(Message):
    weights_size: int = 0
    flags: int = 0
    reserved0: int = 0
    reserved1: int = 0


@_msg(MsgType.MODEL_LOAD | RESPONSE_BIT, "IIIII", "model_id num_constants oom_requested oom_free oom_total")
@dataclass
class ModelLoadResp(Message):
    model_id: int = 0
    num_constants: int = 0
    oom_requested: int = 0
    oom_free: int = 0
    oom_total: int = 0


@_msg(MsgType.MODEL_UNLOAD, "I", "model_id")
@dataclass
class ModelUnload(Message):
    model_id: int = 0


@_msg(MsgType.MODEL_UNLOAD | RESPONSE_BIT, "", "")
@dataclass
class ModelUnloadResp(Message):
    pass


@_msg(MsgType.INFER, "IIIIQQQQ",
      "module_handle model_id num_inputs flags input_dsp_addr input_size result_dsp_addr result_size",
      tail="descs")
@dataclass
class Infer(Message):
    module_handle: int = 0
    model_id: int = 0
    num_inputs: int = 0
    flags: int = 0
    input_dsp_addr: int = 0
    input_size: int = 0
    result_dsp_addr: int = 0
    result_size: int = 0
    descs: list = field(default_factory=list)


MAX_INLINE_INPUTS = (MAX_MSG - Infer.fixed_size()) // TensorDesc.SIZE  # 5


@_msg(MsgType.INFER_LARGE, "IIIIQIIQQQQ",
      "module_handle model_id num_inputs flags descs_addr descs_size reserved "
      "input_dsp_addr input_size result_dsp_addr result_size")
@dataclass
class InferLarge(Message):
    module_handle: int = 0
    model_id: int = 0
    num_inputs: int = 0
    flags: int = 0
    descs_addr: int = 0
    descs_size: int = 0
    reserved: int = 0
    input_dsp_addr: int = 0
    input_size: int = 0
    result_dsp_addr: int = 0
    result_size: int = 0


_INFER_RESP = ("<iQIIQIIIIQ", "return_value cycles num_outputs printf_size descs_addr descs_size "
               "oom_requested oom_free oom_total result_required")


@dataclass
class _InferRespBase(Message):
    return_value: int = 0
    cycles: int = 0
    num_outputs: int = 0
    printf_size: int = 0
    descs_addr: int = 0
    descs_size: int = 0
    oom_requested: int = 0
    oom_free: int = 0
    oom_total: int = 0
    result_required: int = 0
    descs: list = field(default_factory=list)


@_msg(MsgType.INFER | RESPONSE_BIT, _INFER_RESP[0][1:], _INFER_RESP[1], tail="descs")
@dataclass
class InferResp(_InferRespBase):
    pass


@_msg(MsgType.INFER_LARGE | RESPONSE_BIT, _INFER_RESP[0][1:], _INFER_RESP[1], tail="descs")
@dataclass
class InferLargeResp(_InferRespBase):
    pass


MAX_INLINE_OUTPUTS = (MAX_MSG - InferResp.fixed_size()) // TensorDesc.SIZE  # 5


@_msg(MsgType.SET_PRINTF_BUF, "QII", "printf_dsp_addr printf_size reserved")
@dataclass
class SetPrintfBuf(Message):
    printf_dsp_addr: int = 0
    printf_size: int = 0
    reserved: int = 0


@_msg(MsgType.SET_PRINTF_BUF | RESPONSE_BIT, "", "")
@dataclass
class SetPrintfBufResp(Message):
    pass


# Extensions ----------------------------------------------------------------

ATTACH_STAGING = 1  # BufAttach.flags bit 0: the connection's staging buffer, KV region at its end


@_msg(MsgType.BUF_ATTACH, "QII", "size flags kv_size")
@dataclass
class BufAttach(Message):
    """Attach the dmabuf whose fd travels with this datagram (SCM_RIGHTS).
    With ATTACH_STAGING, its last ``kv_size`` bytes are the KV region."""
    size: int = 0
    flags: int = 0
    kv_size: int = 0


@_msg(MsgType.BUF_ATTACH | RESPONSE_BIT, "QQ", "dsp_addr size")
@dataclass
class BufAttachResp(Message):
    dsp_addr: int = 0
    size: int = 0


@_msg(MsgType.BUF_DETACH, "Q", "dsp_addr")
@dataclass
class BufDetach(Message):
    dsp_addr: int = 0


@_msg(MsgType.BUF_DETACH | RESPONSE_BIT, "", "")
@dataclass
class BufDetachResp(Message):
    pass


@_msg(MsgType.RPC, "IiIIQQQQ",
      "cmd core priority timeout_ms input_dsp_addr input_size output_dsp_addr output_size")
@dataclass
class Rpc(Message):
    cmd: int = 0
    core: int = CORE_ANY
    priority: int = 0
    timeout_ms: int = 0
    input_dsp_addr: int = 0
    input_size: int = 0
    output_dsp_addr: int = 0
    output_size: int = 0


@_msg(MsgType.RPC | RESPONSE_BIT, "iIQII", "return_value core cycles printf_size queued_us")
@dataclass
class RpcResp(Message):
    return_value: int = 0
    core: int = 0
    cycles: int = 0
    printf_size: int = 0
    queued_us: int = 0


@_msg(MsgType.OPS_LOAD, "QQII", "src_dsp_addr src_size flags reserved")
@dataclass
class OpsLoad(Message):
    src_dsp_addr: int = 0
    src_size: int = 0
    flags: int = 0
    reserved: int = 0


@_msg(MsgType.OPS_LOAD | RESPONSE_BIT, "IIi", "lib_handle num_ops error_line")
@dataclass
class OpsLoadResp(Message):
    lib_handle: int = 0
    num_ops: int = 0
    error_line: int = 0


OP_NAME_LEN = 32
OP_ENTRY = struct.Struct(f"<IIII{OP_NAME_LEN}s")  # cmd latency_us lib_handle flags name


@_msg(MsgType.OPS_LIST, "I", "start")
@dataclass
class OpsList(Message):
    start: int = 0


@_msg(MsgType.OPS_LIST | RESPONSE_BIT, "II", "total count", tail="payload")
@dataclass
class OpsListResp(Message):
    total: int = 0
    count: int = 0
    payload: bytes = b""

    MAX_ENTRIES: ClassVar[int] = (MAX_MSG - HEADER_SIZE - 8) // OP_ENTRY.size

    @staticmethod
    def pack_entries(entries) -> bytes:
        return b"".join(OP_ENTRY.pack(c, lat, lib, fl, name.encode()[:OP_NAME_LEN])
                        for c, lat, lib, fl, name in entries)

    def entries(self) -> list[tuple[int, int, int, int, str]]:
        out = []
        for i in range(self.count):
            c, lat, lib, fl, name = OP_ENTRY.unpack_from(self.payload, i * OP_ENTRY.size)
            out.append((c, lat, lib, fl, name.rstrip(b"\0").decode(errors="replace")))
        return out


@_msg(MsgType.GET_ERROR, "", "")
@dataclass
class GetError(Message):
    pass


@_msg(MsgType.GET_ERROR | RESPONSE_BIT, "Ii", "error_seq error_status", tail="payload")
@dataclass
class GetErrorResp(Message):
    """The text of the last failure on this connection (utf-8, truncated to fit)."""
    error_seq: int = 0
    error_status: int = 0
    payload: bytes = b""

    MAX_TEXT: ClassVar[int] = MAX_MSG - HEADER_SIZE - 8


@_msg(MsgType.POOL_STATUS, "", "")
@dataclass
class PoolStatus(Message):
    pass


@_msg(MsgType.POOL_STATUS | RESPONSE_BIT, "QQQQQIIIIIIQ",
      "ddr_total ddr_used ddr_peak carveout_total carveout_used l2_total l2_used "
      "connections modules cores op_count rss_bytes")
@dataclass
class PoolStatusResp(Message):
    ddr_total: int = 0
    ddr_used: int = 0
    ddr_peak: int = 0
    carveout_total: int = 0
    carveout_used: int = 0
    l2_total: int = 0
    l2_used: int = 0
    connections: int = 0
    modules: int = 0
    cores: int = 0
    op_count: int = 0
    rss_bytes: int = 0


# The cost record of the connection's last counted call (the timing model,
# docs/cost-model.md).  ERR_OP when the device has no cost model or no call
# of this connection was counted: the answer an older device gives to a type
# it does not know, so a client treats both alike (GET_ERROR says which).
COST_PROFILE_LEN = 32
COST_COUNTED = 1 << 0  # GetCostResp.flags: the call's code was counted (a plain native build is not)
COST_CHANNELS = 2  # iDMA channels in the record
# The record's cycle and count fields, in wire order (COST-SPEC's names).
COST_FIELDS = ("cycles", "overhead", "compute", "ddr_stall", "dma_wait", "ddr_loads", "ddr_stores", "tcm_loads",
               "tcm_stores", "ops_alu", "ops_mul", "ops_special", "ops_move")


@_msg(MsgType.GET_COST, "", "")
@dataclass
class GetCost(Message):
    pass


@_msg(MsgType.GET_COST | RESPONSE_BIT, f"IIII{COST_PROFILE_LEN}s" + "Q" * (len(COST_FIELDS) + 2 * COST_CHANNELS),
      "cost_seq core flags reserved profile " + " ".join(COST_FIELDS)
      + " dma_bytes_0 dma_bytes_1 dma_transfers_0 dma_transfers_1")
@dataclass
class GetCostResp(Message):
    """An estimate of the call ``cost_seq`` under cost model ``profile``
    (NUL-padded ASCII), run on ``core``."""
    cost_seq: int = 0
    core: int = 0
    flags: int = 0
    reserved: int = 0
    profile: bytes = b""
    cycles: int = 0
    overhead: int = 0
    compute: int = 0
    ddr_stall: int = 0
    dma_wait: int = 0
    ddr_loads: int = 0
    ddr_stores: int = 0
    tcm_loads: int = 0
    tcm_stores: int = 0
    ops_alu: int = 0
    ops_mul: int = 0
    ops_special: int = 0
    ops_move: int = 0
    dma_bytes_0: int = 0
    dma_bytes_1: int = 0
    dma_transfers_0: int = 0
    dma_transfers_1: int = 0

    def record(self) -> dict:
        """The record as COST-SPEC names it (``dma_bytes``/``dma_transfers`` per channel)."""
        out = {"profile": self.profile.rstrip(b"\0").decode("ascii", "replace"), "estimate": True,
               "seq": self.cost_seq, "core": self.core, "counted": bool(self.flags & COST_COUNTED)}
        out.update({k: getattr(self, k) for k in COST_FIELDS})
        out["dma_bytes"] = [self.dma_bytes_0, self.dma_bytes_1]
        out["dma_transfers"] = [self.dma_transfers_0, self.dma_transfers_1]
        return out


# ---------------------------------------------------------------- decoding

def message_class(type_code: int) -> type[Message] | None:
    return _REGISTRY.get(type_code)


def peek_header(data) -> tuple[int, int, int, int] | None:
    """(type, seq, len, status) if at least a header is present."""
    if len(data) < HEADER_SIZE:
        return None
    return HEADER.unpack_from(data)


def decode(data) -> Message:
    """Decode one datagram.  Raises ProtocolError carrying the status to
    answer with (ERR_INVALID for framing, ERR_OP for an unknown type) and the
    seq when it could be read."""
    if len(data) > MAX_MSG:
        hdr = peek_header(data)
        raise ProtocolError(f"message of {len(data)} bytes exceeds {MAX_MSG}", Status.ERR_INVALID,
                            hdr[1] if hdr else None, hdr[0] if hdr else None)
    hdr = peek_header(data)
    if hdr is None:
        # Read what fields the fragment does hold so the answer can echo them.
        mtype = struct.unpack_from("<I", data)[0] if len(data) >= 4 else None
        seq = struct.unpack_from("<I", data, 4)[0] if len(data) >= 8 else None
        raise ProtocolError(f"message of {len(data)} bytes is shorter than the {HEADER_SIZE}-byte header",
                            Status.ERR_INVALID, seq, mtype)
    mtype, seq, length, status = hdr
    if length != len(data):
        raise ProtocolError(f"len field {length} != datagram size {len(data)}", Status.ERR_INVALID, seq, mtype)
    cls = _REGISTRY.get(mtype)
    if cls is None:
        raise ProtocolError(f"unknown message type 0x{mtype:04X}", Status.ERR_OP, seq, mtype)
    return cls.decode_body(seq, status, memoryview(data) if not isinstance(data, memoryview) else data)


def error_response(request_type: int | None, seq: int | None, status: int) -> bytes:
    """A bare 16-byte response with a failure status.  Used when the request
    could not be decoded, so no typed body is available."""
    t = (RESPONSE_BIT | (request_type or 0)) & 0xFFFFFFFF
    return HEADER.pack(t, (seq or 0) & 0xFFFFFFFF, HEADER_SIZE, status)


def failure(req: Message, status: int, **numbers) -> Message:
    """The response to ``req`` with a failure status; ``numbers`` fill fields."""
    return failure_response(req.TYPE, req.seq, status, **numbers)


def failure_response(req_type: int, seq: int, status: int, **numbers) -> Message:
    """The response to a request of ``req_type`` with a failure status.  Fields
    named in ``numbers`` are set, saturated to their width: a figure from a
    damaged module (e.g. a 2^63-byte segment) must not make it unencodable."""
    resp = _REGISTRY[RESPONSE_BIT | req_type](seq=seq, status=int(status))
    widths = dict(zip(resp.FIELDS, resp.BODY.format.lstrip("<")))
    for k, v in numbers.items():
        w = widths.get(k)
        if w is not None:
            bits = 32 if w in "Ii" else 64
            lo, hi = (0, (1 << bits) - 1) if w in "IQ" else (-(1 << bits - 1), (1 << bits - 1) - 1)
            setattr(resp, k, min(max(int(v), lo), hi))
    return resp


# A task's or inference's run time past which it is stopped, unless the
# request names its own (timeout_ms) or the device was started with another
# --job-timeout (0: none).  The longest legitimate single call measured here
# is seconds (an LLM prefill of the whole context; the tests' longest job on
# purpose runs 20 s), so 120 s leaves a loaded 2-core machine 6x and more,
# and still frees a core from a hung handler within two minutes.
DEFAULT_JOB_TIMEOUT_S = 120.0
