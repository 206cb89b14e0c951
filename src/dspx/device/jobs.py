"""The records the device front and its cores exchange, and their channel.

Records are small typed dataclasses sent over a SEQPACKET socketpair in a
fixed binary format (below).  dmabuf fds ride along (SCM_RIGHTS) the first
time a core needs a buffer (``new_bufs``), and so does a client's own socket
the first time a core answers that client directly (``new_conn``).

The hot calls (INFER, RPC) are *planned*: the front validates a request once
and sends its resolved form (``InferSpec`` / ``RpcSpec``) with the first job
under a plan id; a request whose bytes repeat is a job naming the plan only.
The core then answers the client itself on the client's socket, after
telling the front (``Done``) so the front's state is current before the
client can send anything that depends on it.

The format.  A core runs client code, so whatever it sends is untrusted: the
front decodes it as it decodes a client's messages, and nothing in the
format can name code (there is no pickle anywhere).  Every record has one
schema (``_SCHEMAS``, a table of (field, type)); one codec reads that table
both ways.  A datagram is

    u8 tag | the record's fixed-width fields, packed little-endian in schema
    order (one struct) | its variable fields in schema order

where a variable field is ``str``/``bytes``: u32 length + bytes (UTF-8 for
str), each with a maximum; a list: u32 count + items, with a maximum count;
an optional: u8 0 (absent) or 1 + the value; a nested record: its tag + its
body (only the record types that field allows); ``Numbers``: u8 bitmask over
a fixed key list + one u64 per set bit.  Bools are one byte, 0 or 1.  The
decoder checks every field (known tag allowed in that direction, ints in
range, exact lengths, valid UTF-8, bounded counts, no trailing bytes) and
raises ``BadRecord`` naming the record, the field and the numbers.
"""
from __future__ import annotations

import os
import struct
from dataclasses import dataclass, field, fields

from ..abi.protocol import COST_FIELDS, COST_PROFILE_LEN
from ..transport import Endpoint

MAX_JOB_MSG = 1 << 20
MAX_JOB_FDS = 250  # SCM_MAX_FD: every buffer a connection has, on its first job

# (buf_id, offset) pairs locate bytes in a mapped buffer on the core.


# ---------------------------------------------------------------- front -> core

@dataclass(slots=True)
class Job:
    job: int = 0  # 0: nothing to answer
    new_bufs: list = field(default_factory=list)  # [(buf_id, size)], fds in the same order
    # First unmap every buffer, drop every plan and every client socket: this
    # job is another connection's (or the device's), and a core holds one
    # owner's buffers and socket only.
    drop_bufs: bool = False


@dataclass(slots=True)
class LoadModule(Job):
    handle: int = 0
    buf: int = 0
    size: int = 0
    ddr_free: int = 0


@dataclass(slots=True)
class UnloadModule(Job):
    handle: int = 0


@dataclass(slots=True)
class LoadWeights(Job):
    model_id: int = 0
    buf: int = 0
    size: int = 0


@dataclass(slots=True)
class UnloadWeights(Job):
    model_id: int = 0


@dataclass(slots=True)
class InferSpec:
    """An INFER resolved by the front: every address is (buf_id, offset)."""
    cid: int
    handle: int
    model_id: int
    inputs: list  # [(buf_id, offset, shape, dtype)]
    result: tuple  # (buf_id, offset, size, dsp_addr)
    kv: tuple | None  # (buf_id, offset, size, dsp_addr)
    kv_resident: bool
    repeat: int
    printf: tuple | None  # (buf_id, offset, size)
    resp_type: int  # INFER_RESP or INFER_LARGE_RESP
    profile: bool = False  # FLAG_PROFILE: time every call of the entry (core/inference.py)


@dataclass(slots=True)
class RpcSpec:
    cid: int
    cmd: int
    input: tuple  # (buf_id, offset, size)
    output: tuple
    regions: list  # the connection's buffers: [(buf_id, dsp_addr, size)]
    printf: tuple | None


@dataclass(slots=True)
class Call(Job):
    """Run plan ``plan`` (``spec`` the first time) and answer ``seq`` on the
    client's socket.  ``new_conn``: that socket's fd comes first in the fds."""
    plan: int = 0
    seq: int = 0
    spec: InferSpec | RpcSpec | None = None
    new_conn: bool = False
    queued_us: int = 0


@dataclass(slots=True)
class LoadOps(Job):
    handle: int = 0
    source: bytes = b""
    filename: str = ""


@dataclass(slots=True)
class UnloadOps(Job):
    handle: int = 0


@dataclass(slots=True)
class Forget(Job):
    """Drop plans, then connections' sockets, then buffer mappings."""
    plans: list = field(default_factory=list)
    conns: list = field(default_factory=list)
    bufs: list = field(default_factory=list)


# ---------------------------------------------------------------- core -> front

@dataclass(slots=True)
class Hello:
    core: int
    pid: int
    ops: list  # [(cmd, name, latency_us)] of the firmware's built-in operators


@dataclass(slots=True)
class TensorSig:
    name: str
    shape: tuple  # (int, ...)
    dtype: str


@dataclass(slots=True)
class ModuleSig:
    """What the front checks an INFER against (from the module's signature)."""
    separate_weights: bool  # weights come from MODEL_LOAD
    inputs: list  # [TensorSig]


@dataclass(slots=True)
class Loaded:
    text_size: int
    data_size: int
    workspace_bytes: int
    io_meta: tuple | None  # (num_inputs, num_outputs, input_bytes, output_bytes, flags)
    signature: ModuleSig | None


@dataclass(slots=True)
class WeightsLoaded:
    num_constants: int
    nbytes: int


@dataclass(slots=True)
class OpsLoaded:
    ops: list  # [(cmd, name, latency_us)]


@dataclass(slots=True)
class Done:
    """A job ended.  For a Call the core has answered (or is about to answer)
    the client itself; ``numbers`` are response fields for a failure
    (``NUMBERS`` names the ones there are)."""
    job: int
    status: int = 0
    error: str = ""
    seq: int = 0  # a Call's request seq (for GET_ERROR)
    numbers: dict = field(default_factory=dict)
    value: Loaded | WeightsLoaded | OpsLoaded | None = None
    response: bytes | None = None  # a Call's answer, for the front to send (the core holds no socket for it)


@dataclass(slots=True)
class Deliver:
    """A response the core could not send (the client's socket was full):
    the front queues it in the connection's outbox."""
    cid: int
    data: bytes


@dataclass(slots=True)
class Switched:
    """The core took its ``count``-th owner switch (a job with ``drop_bufs``),
    before any code of the new owner runs.  A Deliver for a connection the
    switch dropped is that connection's own late answer until this arrives,
    and a forgery after it (front/supervisor.py CoreSupervisor.deliver)."""
    count: int


@dataclass(slots=True)
class Cost:
    """The timing model's record of a call the core ran (docs/cost-model.md):
    sent before the call's answer, only when a cost model is on, so the
    front holds it (per connection) when the client asks GET_COST.  The
    fields are the cost record's (docs/cost-model.md); ``cid``/``seq``: whose
    call it was."""
    job: int
    cid: int
    seq: int
    profile: str
    counted: bool = True  # False: code the model could not count (a plain native build)
    counts: tuple = (0,) * 13  # the figures named by COST_COUNTS, in that order (cycles first)
    dma_bytes: tuple = (0, 0)  # per iDMA channel
    dma_transfers: tuple = (0, 0)

    def figures(self) -> dict:
        """``counts`` by name."""
        return dict(zip(COST_COUNTS, self.counts))

    @classmethod
    def of(cls, job: int, cid: int, seq: int, record: dict) -> "Cost":
        """The record of a call from the cost dict a prepared call's outcome carries."""
        return cls(job, cid, seq, record["profile"], bool(record.get("counted", True)),
                   tuple(record[k] for k in COST_COUNTS), tuple(record["dma_bytes"]), tuple(record["dma_transfers"]))


# The device's cost model (a profile name or file): set, cores count and send
# Cost records; unset, no counting code runs and a Cost is a bad record.
COST_MODEL_ENV = "DSPX_COST_MODEL"
COST_COUNTS = COST_FIELDS  # Cost's cycle and count fields, in GET_COST_RESP's order


# A core's status page, shared with the front (a memfd both map): the id of
# the last Call the core finished with SUCCESS, and a flag the front raises
# when it wants a Done datagram for it (it has work queued behind the call).
# A successful call thus costs the front no wake-up: the front reads the page
# when it next needs to know (the client's next request, scheduling,
# housekeeping).  Failures always send their Done, which carries the error.
# Each side writes only its own word: done_job (u64 at 0) is the core's, wake
# (u64 at 8) the front's.
STATUS_WORD = struct.Struct("<Q")
STATUS_DONE, STATUS_WAKE = 0, 8
# Raised by a core before the Done of a job whose user code broke its
# runtime: the core ends after answering, and the front gives it nothing more.
STATUS_RESTART = 16
EXIT_RUNTIME_BROKEN = 76  # that core's exit status
STATUS_SIZE = 4096


# ================================================================ the format

class BadRecord(ValueError):
    """A datagram that is not a valid record for its direction: the message
    names the record, the field and the numbers."""


class RecordTooLarge(BadRecord):
    """A record that does not fit one internal message (MAX_JOB_MSG)."""


class _Int:
    """A fixed-width integer (or bool): part of its record's one struct."""

    def __init__(self, code: str, lo: int, hi: int):
        self.code, self.lo, self.hi = code, lo, hi

    def check(self, v) -> str:
        if self.code == "?":
            return "" if isinstance(v, bool) or v in (0, 1) else f"{v!r} is not a bool"
        if not isinstance(v, int):
            return f"{type(v).__name__} {v!r} is not an int"
        return "" if self.lo <= v <= self.hi else f"{v} is outside {self.lo}..{self.hi}"


def _uint(bits: int, code: str) -> _Int:
    return _Int(code, 0, (1 << bits) - 1)


U32, U64, BOOL = _uint(32, "I"), _uint(64, "Q"), _Int("?", 0, 1)
I32, I64 = _Int("i", -(1 << 31), (1 << 31) - 1), _Int("q", -(1 << 63), (1 << 63) - 1)
_LEN = struct.Struct("<I")


def _need(buf, pos: int, n: int, what: str) -> None:
    if pos + n > len(buf):
        raise BadRecord(f"truncated: {what} needs {n} bytes at offset {pos}, {len(buf) - pos} left")


class _Blob:
    """u32 length + bytes (``text``: UTF-8), at most ``limit`` bytes."""

    def __init__(self, limit: int, text: bool):
        self.limit, self.text = limit, text

    def enc(self, out: bytearray, v) -> None:
        if self.text:
            if not isinstance(v, str):
                raise BadRecord(f"{type(v).__name__} is not a str")
            v = v.encode("utf-8")
        elif not isinstance(v, (bytes, bytearray, memoryview)):
            raise BadRecord(f"{type(v).__name__} is not bytes")
        if len(v) > self.limit:
            raise BadRecord(f"{len(v)} bytes exceed the limit of {self.limit}")
        out += _LEN.pack(len(v))
        out += v

    def dec(self, buf, pos: int):
        _need(buf, pos, 4, "a length")
        (n,) = _LEN.unpack_from(buf, pos)
        if n > self.limit:
            raise BadRecord(f"length {n} exceeds the limit of {self.limit} bytes")
        pos += 4
        _need(buf, pos, n, f"a {'string' if self.text else 'byte string'} of {n} bytes")
        raw = bytes(buf[pos:pos + n])
        if self.text:
            try:
                return raw.decode("utf-8"), pos + n
            except UnicodeDecodeError as e:
                raise BadRecord(f"not UTF-8 (byte {e.start} of {n}: {e.reason})") from None
        return raw, pos + n


def _str(limit: int) -> _Blob:
    return _Blob(limit, True)


def _bytes(limit: int) -> _Blob:
    return _Blob(limit, False)


class _Tup:
    """A fixed sequence of values; all fixed-width ones pack as one struct."""

    def __init__(self, *kinds):
        self.kinds = kinds
        self.fixed = all(isinstance(k, _Int) for k in kinds)
        if self.fixed:
            self.st = struct.Struct("<" + "".join(k.code for k in kinds))
            self.bools = [i for i, k in enumerate(kinds) if k.code == "?"]

    def enc(self, out: bytearray, v) -> None:
        if not isinstance(v, (tuple, list)) or len(v) != len(self.kinds):
            raise BadRecord(f"{v!r} is not a tuple of {len(self.kinds)}")
        if self.fixed:
            try:
                out += self.st.pack(*v)
                return
            except struct.error:
                pass  # say which item is wrong
        for i, (k, x) in enumerate(zip(self.kinds, v)):
            try:
                _enc(k, out, x)
            except BadRecord as e:
                raise BadRecord(f"[{i}]: {e}") from None

    def dec(self, buf, pos: int):
        if self.fixed:
            _need(buf, pos, self.st.size, f"a tuple of {len(self.kinds)}")
            v = self.st.unpack_from(buf, pos)
            _check_bools(buf, pos, self.st, self.bools)
            return v, pos + self.st.size
        out = []
        for i, k in enumerate(self.kinds):
            try:
                x, pos = _dec(k, buf, pos)
            except BadRecord as e:
                raise BadRecord(f"[{i}]: {e}") from None
            out.append(x)
        return tuple(out), pos


class _List:
    """u32 count + that many items, at most ``limit``."""

    def __init__(self, kind, limit: int):
        self.kind, self.limit = kind, limit

    def enc(self, out: bytearray, v) -> None:
        if not isinstance(v, (list, tuple)):
            raise BadRecord(f"{type(v).__name__} is not a list")
        if len(v) > self.limit:
            raise BadRecord(f"{len(v)} items exceed the limit of {self.limit}")
        out += _LEN.pack(len(v))
        for i, x in enumerate(v):
            try:
                _enc(self.kind, out, x)
            except BadRecord as e:
                raise BadRecord(f"[{i}]: {e}") from None

    def dec(self, buf, pos: int):
        _need(buf, pos, 4, "a count")
        (n,) = _LEN.unpack_from(buf, pos)
        if n > self.limit:
            raise BadRecord(f"count {n} exceeds the limit of {self.limit}")
        pos += 4
        out = []
        for i in range(n):
            try:
                x, pos = _dec(self.kind, buf, pos)
            except BadRecord as e:
                raise BadRecord(f"[{i}]: {e}") from None
            out.append(x)
        return out, pos


class _Opt:
    """u8 0 (None) or 1 followed by the value."""

    def __init__(self, kind):
        self.kind = kind

    def enc(self, out: bytearray, v) -> None:
        if v is None:
            out.append(0)
        else:
            out.append(1)
            _enc(self.kind, out, v)

    def dec(self, buf, pos: int):
        _need(buf, pos, 1, "a presence flag")
        flag = buf[pos]
        if flag == 0:
            return None, pos + 1
        if flag != 1:
            raise BadRecord(f"presence flag {flag} is neither 0 nor 1")
        return _dec(self.kind, buf, pos + 1)


class _Rec:
    """A nested record of one of ``types``: its tag, then its body."""

    def __init__(self, *types):
        self.types = types

    def enc(self, out: bytearray, v) -> None:
        if type(v) not in self.types:
            raise BadRecord(f"{type(v).__name__} is not one of {_names(self.types)}")
        _enc_record(out, v)

    def dec(self, buf, pos: int):
        return _dec_record(buf, pos, self.types)


class _Numbers:
    """A dict over a fixed key list: u8 bitmask, then a u64 per key present."""

    def __init__(self, keys: tuple):
        self.keys = keys
        assert len(keys) <= 8

    def enc(self, out: bytearray, v) -> None:
        if not isinstance(v, dict):
            raise BadRecord(f"{type(v).__name__} is not a dict")
        unknown = set(v) - set(self.keys)
        if unknown:
            raise BadRecord(f"unknown keys {sorted(map(str, unknown))} (known: {', '.join(self.keys)})")
        mask = sum(1 << i for i, k in enumerate(self.keys) if k in v)
        out.append(mask)
        for k in self.keys:
            if k in v:
                why = U64.check(v[k])
                if why:
                    raise BadRecord(f"{k}: {why}")
                out += _U64.pack(v[k])

    def dec(self, buf, pos: int):
        _need(buf, pos, 1, "a key mask")
        mask = buf[pos]
        if mask >> len(self.keys):
            raise BadRecord(f"key mask 0x{mask:02x} sets bits beyond the {len(self.keys)} keys")
        pos += 1
        out = {}
        for i, k in enumerate(self.keys):
            if mask >> i & 1:
                _need(buf, pos, 8, k)
                out[k] = _U64.unpack_from(buf, pos)[0]
                pos += 8
        return out, pos


class _Shape(_List):
    """A tensor's dimensions: a list of i64, decoded as a tuple."""

    def dec(self, buf, pos: int):
        dims, pos = _List.dec(self, buf, pos)
        return tuple(dims), pos


_U64 = struct.Struct("<Q")


def _check_bools(buf, pos: int, st: struct.Struct, bools: list) -> None:
    if bools:
        raw = struct.unpack_from(st.format.replace("?", "B"), buf, pos)
        for i in bools:
            if raw[i] > 1:
                raise BadRecord(f"bool item {i} is {raw[i]}, not 0 or 1")


def _enc(kind, out: bytearray, v) -> None:
    if isinstance(kind, _Int):
        why = kind.check(v)
        if why:
            raise BadRecord(why)
        out += struct.pack("<" + kind.code, v)
    else:
        kind.enc(out, v)


def _dec(kind, buf, pos: int):
    if isinstance(kind, _Int):
        size = struct.calcsize(kind.code)
        _need(buf, pos, size, "an int")
        if kind.code == "?" and buf[pos] > 1:
            raise BadRecord(f"bool is {buf[pos]}, not 0 or 1")
        return struct.unpack_from("<" + kind.code, buf, pos)[0], pos + size
    return kind.dec(buf, pos)


# ---------------------------------------------------------------- the schemas

MAX_TEXT = 32 << 10  # an error text (the core clips its texts to 4096 characters)
MAX_NAME = 1024  # an operator's or a tensor's name
MAX_DTYPE = 32
MAX_RESPONSE = 512  # a client response: protocol.MAX_MSG
MAX_ITEMS = 1 << 16  # ids in a Forget, a connection's regions, operators of a library
MAX_INPUTS = 4096  # a module's inputs (the front's limit for INFER_LARGE)
MAX_RANK = 32
MAX_FILENAME = 4096
MAX_PROFILE = COST_PROFILE_LEN  # a cost profile's name
# The failure numbers a Done may carry (response fields of the client's answer).
NUMBERS = ("oom_requested", "oom_free", "oom_total", "error_line", "result_required", "cycles")

_LOC3 = _Tup(U64, U64, U64)  # (buf_id, offset, size); regions: (buf_id, dsp_addr, size)
_LOC4 = _Tup(U64, U64, U64, U64)  # (buf_id, offset, size, dsp_addr)
_OP = _Tup(U32, _str(MAX_NAME), U32)  # (cmd, name, latency_us)
_JOB = (("job", U64), ("new_bufs", _List(_Tup(U64, U64), MAX_JOB_FDS)), ("drop_bufs", BOOL))

# tag -> (record type, ((field, type), ...)): the only description of the format.
_TABLE = {
    1: (LoadModule, _JOB + (("handle", U64), ("buf", U64), ("size", U64), ("ddr_free", U64))),
    2: (UnloadModule, _JOB + (("handle", U64),)),
    3: (LoadWeights, _JOB + (("model_id", U64), ("buf", U64), ("size", U64))),
    4: (UnloadWeights, _JOB + (("model_id", U64),)),
    5: (InferSpec, (("cid", U64), ("handle", U64), ("model_id", U64),
                    ("inputs", _List(_Tup(U64, U64, _Shape(I64, MAX_RANK), _str(MAX_DTYPE)), MAX_INPUTS)),
                    ("result", _LOC4), ("kv", _Opt(_LOC4)), ("kv_resident", BOOL), ("repeat", U32),
                    ("printf", _Opt(_LOC3)), ("resp_type", U32), ("profile", BOOL))),
    6: (RpcSpec, (("cid", U64), ("cmd", U32), ("input", _LOC3), ("output", _LOC3),
                  ("regions", _List(_LOC3, MAX_ITEMS)), ("printf", _Opt(_LOC3)))),
    7: (Call, _JOB + (("plan", U64), ("seq", U32), ("spec", _Opt(_Rec(InferSpec, RpcSpec))),
                      ("new_conn", BOOL), ("queued_us", U64))),
    8: (LoadOps, _JOB + (("handle", U64), ("source", _bytes(MAX_JOB_MSG)), ("filename", _str(MAX_FILENAME)))),
    9: (UnloadOps, _JOB + (("handle", U64),)),
    10: (Forget, _JOB + (("plans", _List(U64, MAX_ITEMS)), ("conns", _List(U64, MAX_ITEMS)),
                         ("bufs", _List(U64, MAX_ITEMS)))),
    32: (Hello, (("core", U32), ("pid", U32), ("ops", _List(_OP, MAX_ITEMS)))),
    33: (TensorSig, (("name", _str(MAX_NAME)), ("shape", _Shape(I64, MAX_RANK)), ("dtype", _str(MAX_DTYPE)))),
    34: (ModuleSig, (("separate_weights", BOOL), ("inputs", _List(_Rec(TensorSig), MAX_INPUTS)))),
    35: (Loaded, (("text_size", U64), ("data_size", U64), ("workspace_bytes", U64),
                  ("io_meta", _Opt(_Tup(U32, U32, U64, U64, U32))), ("signature", _Opt(_Rec(ModuleSig))))),
    36: (WeightsLoaded, (("num_constants", U64), ("nbytes", U64))),
    37: (OpsLoaded, (("ops", _List(_OP, MAX_ITEMS)),)),
    38: (Done, (("job", U64), ("status", I32), ("error", _str(MAX_TEXT)), ("seq", U32),
                ("numbers", _Numbers(NUMBERS)), ("value", _Opt(_Rec(Loaded, WeightsLoaded, OpsLoaded))),
                ("response", _Opt(_bytes(MAX_RESPONSE))))),
    39: (Deliver, (("cid", U64), ("data", _bytes(MAX_RESPONSE)))),
    40: (Switched, (("count", U64),)),
    41: (Cost, (("job", U64), ("cid", U64), ("seq", U32), ("profile", _str(MAX_PROFILE)), ("counted", BOOL),
                ("counts", _Tup(*[U64] * len(COST_COUNTS))), ("dma_bytes", _Tup(U64, U64)),
                ("dma_transfers", _Tup(U64, U64)))),
}

# What each end accepts at the top level of a datagram.
FRONT_TO_CORE = (LoadModule, UnloadModule, LoadWeights, UnloadWeights, Call, LoadOps, UnloadOps, Forget)
CORE_TO_FRONT = (Hello, Done, Deliver, Switched, Cost)


class _Schema:
    """One record's compiled table: its fixed fields as one struct, the rest in order."""

    def __init__(self, tag: int, cls, table: tuple):
        names = [f.name for f in fields(cls)]
        assert names == [n for n, _ in table], f"{cls.__name__}: schema {table} does not match {names}"
        self.tag, self.cls, self.name = tag, cls, cls.__name__
        self.fixed = [(i, n, k) for i, (n, k) in enumerate(table) if isinstance(k, _Int)]
        self.var = [(i, n, k) for i, (n, k) in enumerate(table) if not isinstance(k, _Int)]
        self.names = names
        self.fixed_names = [n for _, n, _ in self.fixed]
        self.st = struct.Struct("<" + "".join(k.code for _, _, k in self.fixed))
        self.bools = [j for j, (_, _, k) in enumerate(self.fixed) if k.code == "?"]


_SCHEMAS = {cls: _Schema(tag, cls, table) for tag, (cls, table) in _TABLE.items()}
_BY_TAG = {s.tag: s for s in _SCHEMAS.values()}


def _names(types) -> str:
    return "/".join(t.__name__ for t in types)


def _enc_record(out: bytearray, rec) -> None:
    s = _SCHEMAS.get(type(rec))
    if s is None:
        raise BadRecord(f"{type(rec).__name__} is not a record")
    out.append(s.tag)
    try:
        out += s.st.pack(*[getattr(rec, n) for n in s.fixed_names])
    except struct.error:
        for _, n, k in s.fixed:
            why = k.check(getattr(rec, n))
            if why:
                raise BadRecord(f"{s.name}.{n}: {why}") from None
        raise
    for _, n, k in s.var:
        try:
            _enc(k, out, getattr(rec, n))
        except BadRecord as e:
            raise BadRecord(f"{s.name}.{n}: {e}") from None


def _dec_record(buf, pos: int, allowed):
    _need(buf, pos, 1, "a record tag")
    s = _BY_TAG.get(buf[pos])
    if s is None or s.cls not in allowed:
        what = f"unknown tag {buf[pos]}" if s is None else f"a {s.name}"
        raise BadRecord(f"{what} where only {_names(allowed)} may come")
    pos += 1
    vals = [None] * len(s.names)
    field_name = "(fixed fields)"
    try:
        _need(buf, pos, s.st.size, f"the fixed fields ({s.st.size} bytes)")
        for (i, _, _), v in zip(s.fixed, s.st.unpack_from(buf, pos)):
            vals[i] = v
        _check_bools(buf, pos, s.st, s.bools)
        pos += s.st.size
        for i, field_name, k in s.var:
            vals[i], pos = k.dec(buf, pos)
    except BadRecord as e:
        raise BadRecord(f"{s.name}.{field_name}: {e}") from None
    return s.cls(*vals), pos


def encode(rec) -> bytes:
    out = bytearray()
    _enc_record(out, rec)
    if len(out) > MAX_JOB_MSG:
        raise RecordTooLarge(f"{type(rec).__name__} of {len(out)} bytes exceeds the internal limit of "
                             f"{MAX_JOB_MSG} bytes")
    return bytes(out)


def decode(data, accept) -> object:
    """The record in ``data``, which must be one of the ``accept`` types
    (FRONT_TO_CORE or CORE_TO_FRONT) and fill the datagram exactly."""
    buf = memoryview(data).cast("B") if not isinstance(data, (bytes, bytearray)) else data
    rec, pos = _dec_record(buf, 0, accept)
    if pos != len(buf):
        raise BadRecord(f"{type(rec).__name__}: {len(buf) - pos} bytes after the record's {pos}")
    return rec


def endpoint(sock) -> Endpoint:
    return Endpoint(sock, MAX_JOB_MSG, MAX_JOB_FDS)


def send(ep: Endpoint, rec, fds=()) -> None:
    ep.send(encode(rec), fds)


def recv(ep: Endpoint, accept, timeout: float | None = None):
    """One record of the ``accept`` types and its fds; BadRecord (fds closed) if the datagram is not one."""
    data, fds, truncated = ep.recv(timeout, bufsize=MAX_JOB_MSG)
    try:
        if truncated:
            raise BadRecord(f"internal job message truncated (more than {MAX_JOB_MSG} bytes)")
        return decode(data, accept), fds
    except BadRecord:
        for fd in fds:
            os.close(fd)
        raise
