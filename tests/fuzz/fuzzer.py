"""A structure-aware fuzzer for the device protocol.

It opens a real connection to a live device and sets it up so that deep
paths are reachable: a staging buffer with a KV region, a printf ring,
input_buf/output_buf, two loaded modules (``multi_input``: 7 inputs, so
INFER_LARGE with a descriptor table in input_buf; ``multi_output``: 7
outputs, so INFER with inline input descriptors and the output descriptor
table written to output_buf), a scratch buffer for RPC (softmax parameter
struct) and a few spare buffers that BUF_DETACH may take away.

Each step builds a *valid* message of one type for that state (INFER,
INFER_LARGE, RPC, SET_PRINTF_BUF, BUF_ATTACH with or without an fd,
BUF_DETACH, DYN_LOAD / MODEL_LOAD with garbage or damaged modules staged,
OPS_LOAD with garbage source, DYN_UNLOAD, MODEL_UNLOAD, OPS_LIST, GET_ERROR,
POOL_STATUS, PING, GET_STATUS) and then mutates it field by field: lengths,
counts, addresses at every buffer edge (base−1, base, end−1, end, end+1, of
this connection's buffers, of another connection's, of the KV region, of
the DDR pool 0x1_0200_0000 and L2 0x7E00_0000), sizes near 2^32 and 2^64,
ndim, dtype, shapes, flags, reserved fields, descriptor arrays (inline and in
the table), seq, the header's type/len/status, body truncation/extension —
or sends random bytes.  ``window`` requests may be in flight at once
(responses are matched to requests by type and seq; a request that may
change the fixtures, or whose build writes shared memory, goes alone).
Every request must get exactly one well-formed
response within the timeout: type ``0x1000 | type``, the same seq, ``len``
equal to the datagram size, a decodable body when it succeeded.  No answer
may be ERR_GENERIC (an internal failure), and a message with exactly one
mutation of a class whose answer the protocol fixes must get that status
(``expected_status``): framing damage ERR_INVALID, an unknown or response
type ERR_OP, a reserved field or unknown flag bit ERR_INVALID, an inline
descriptor count other than ``num_inputs`` ERR_INVALID, BUF_ATTACH without
exactly one fd ERR_INVALID, and every forged address (one outside all of
this connection's buffers: another connection's, the DDR pool, L2, wrapped
ranges) ERR_ADDR.  ``FuzzStats.unexpected`` counts the answers that differ.

The fuzzer never trusts its own state after a mutated request succeeded:
anything that may have removed one of its fixtures (a detach, an unload, a
new printf binding) makes it reopen its connection, which also exercises the
"a closed connection leaves nothing behind" path thousands of times.
"""
from __future__ import annotations

import array
import collections
import fcntl
import os
import random
import select
import socket
import struct
import time
from dataclasses import dataclass, field
from pathlib import Path

from dspx.abi import layout
from dspx import memory
from dspx.abi import protocol as P
from dspx.abi.protocol import MsgType as T, Status

HDR = struct.Struct("<IIIi")
U32 = 0xFFFFFFFF
U64 = (1 << 64) - 1
DDR_BASE = memory.DDR_POOL_BASE
L2_BASE = memory.L2_BASE

# Requests whose success changes the fuzzer's fixtures (it undoes or
# restores them at once), so they never share the window with others.
STATE_TYPES = frozenset((T.OPS_LOAD, T.DYN_LOAD, T.MODEL_LOAD, T.BUF_ATTACH, T.SET_PRINTF_BUF, T.BUF_DETACH,
                         T.DYN_UNLOAD, T.MODEL_UNLOAD))

# ------------------------------------------------------------------ checking


def expected_header(datagram: bytes) -> tuple[int, int]:
    """(response type, seq) the device must answer ``datagram`` with."""
    mtype = struct.unpack_from("<I", datagram)[0] if len(datagram) >= 4 else 0
    seq = struct.unpack_from("<I", datagram, 4)[0] if len(datagram) >= 8 else 0
    return (P.RESPONSE_BIT | mtype) & U32, seq


def check_response(datagram: bytes, resp: bytes) -> str | None:
    """Why ``resp`` is not a well-formed answer to ``datagram``, or None."""
    if len(resp) < P.HEADER_SIZE:
        return f"response of {len(resp)} bytes"
    if len(resp) > P.MAX_MSG:
        return f"response of {len(resp)} bytes > {P.MAX_MSG}"
    rtype, seq, ln, status = HDR.unpack_from(resp)
    want_type, want_seq = expected_header(datagram)
    if rtype != want_type:
        return f"response type 0x{rtype:x}, expected 0x{want_type:x}"
    if seq != want_seq:
        return f"response seq {seq}, expected {want_seq}"
    if ln != len(resp):
        return f"response len field {ln} != datagram size {len(resp)}"
    if status not in Status._value2member_map_:
        return f"unknown status {status}"
    cls = P.message_class(rtype)
    if status == Status.SUCCESS:
        if cls is None:
            return f"SUCCESS for a type with no response class 0x{rtype:x}"
        try:
            P.decode(resp)
        except P.ProtocolError as e:
            return f"undecodable successful response: {e}"
    elif cls is not None and len(resp) not in (P.HEADER_SIZE, cls.SIZE):
        return f"failure response of {len(resp)} bytes (typed body is {cls.SIZE})"
    return None


# ------------------------------------------------------------------ stats


@dataclass
class FuzzStats:
    sent: int = 0
    by_status: collections.Counter = field(default_factory=collections.Counter)
    by_type: collections.Counter = field(default_factory=collections.Counter)
    by_kind: collections.Counter = field(default_factory=collections.Counter)
    malformed: int = 0
    extra_responses: int = 0
    hangs: int = 0
    crashes: int = 0  # the device closed our connection or its front process died
    core_restarts: int = 0
    reconnects: int = 0
    fds_sent: int = 0
    problems: list = field(default_factory=list)
    internal_errors: list = field(default_factory=list)  # ERR_GENERIC answers: request + the device's text
    unexpected: int = 0  # answers other than the status a mutation class must get
    by_expectation: collections.Counter = field(default_factory=collections.Counter)  # class -> checked
    forged_addresses: int = 0  # single forged-address mutations sent (each must be ERR_ADDR)
    fixture_hits: int = 0  # detaches / unloads aimed at a fixture (see Fuzzer.fixture_every)
    fixture_redirected: int = 0  # ... pointed elsewhere to keep to fixture_every
    max_latency_s: float = 0.0
    slowest: str = ""
    elapsed_s: float = 0.0

    def problem(self, text: str) -> None:
        if len(self.problems) < 50:
            self.problems.append(text)

    def as_dict(self) -> dict:
        return {"sent": self.sent, "by_status": dict(self.by_status.most_common()),
                "by_type": dict(self.by_type.most_common()), "by_kind": dict(self.by_kind.most_common()),
                "malformed": self.malformed, "unexpected": self.unexpected,
                "by_expectation": dict(self.by_expectation.most_common()),
                "forged_addresses": self.forged_addresses, "fixture_hits": self.fixture_hits,
                "fixture_redirected": self.fixture_redirected, "extra_responses": self.extra_responses,
                "hangs": self.hangs,
                "crashes": self.crashes, "core_restarts": self.core_restarts, "reconnects": self.reconnects,
                "fds_sent": self.fds_sent, "max_latency_s": round(self.max_latency_s, 4), "slowest_request": self.slowest,
                "elapsed_s": round(self.elapsed_s, 2),
                "msgs_per_s": round(self.sent / self.elapsed_s, 1) if self.elapsed_s else 0,
                "problems": self.problems, "internal_errors": self.internal_errors}


# ------------------------------------------------------------------ helpers


def compiled_example(name: str) -> Path:
    """Directory of a compiled example module (the tests' cache in .cache/dspx)."""
    from conftest import compiled_example as compile_example  # (conftest sets the tests' $DSPX_CACHE)

    from dspx import cache
    from dspx.compiler import examples
    from dspx.host.verifier import DeviceVerifier

    with DeviceVerifier() as verifier:  # its device starts only if the module is not cached
        return compile_example(name, examples.build_all(str(cache.area("onnx")))[name], verifier)


def device_footprint(front_pid: int) -> dict:
    """Open fds and RSS of a device: its front process and its cores."""
    import psutil

    front = psutil.Process(front_pid)
    procs = [front] + [c for c in front.children() if c.is_running()]
    fds = rss = 0
    each = {}  # "front" / "core <pid>" -> {"fds", "rss"}
    for i, p in enumerate(procs):
        try:
            f, r = p.num_fds(), p.memory_info().rss
        except psutil.Error:
            continue
        fds += f
        rss += r
        each["front" if i == 0 else f"core {p.pid}"] = {"fds": f, "rss": r}
    return {"fds_front": front.num_fds(), "fds": fds, "rss": rss, "cores": [p.pid for p in procs[1:]],
            "procs": each}


def sealed_memfd(size: int, seal: bool = True) -> int:
    fd = os.memfd_create("fuzz", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    os.ftruncate(fd, size)
    if seal:
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, memory.REQUIRED_SEALS)
    return fd


def _fmt_fields(cls) -> list[tuple[str, str]]:
    """[(field name, struct char)] of a message class's fixed body."""
    chars = cls.BODY.format.lstrip("<")
    return list(zip(cls.FIELDS, chars))


def _sealed(fd: int) -> bool:
    return fcntl.fcntl(fd, fcntl.F_GET_SEALS) & memory.REQUIRED_SEALS == memory.REQUIRED_SEALS


_RANGES = {"I": (0, U32), "i": (-(1 << 31), (1 << 31) - 1), "Q": (0, U64), "q": (-(1 << 63), (1 << 63) - 1)}

GARBAGE_SOURCES = [
    b"", b"\x00" * 64, b"\xff\xfe\xfd", b"import os\n", b"def f(:\n", b"x = 1\n" * 100,
    b"from dspx.device.core import runtime as rt\nrt.register_op(0x1402, lambda i, o, t: 0)\n",
    b"__import__('os')._exit(1)\n", b"open('/etc/passwd')\n", b"raise SystemExit\n",
    b"import numpy\nnumpy.zeros(1 << 60)\n", b"\n" * 4096, "\u00e9\u4e2d".encode() * 100,
]


class Fuzzer:
    """Drive one fuzz connection against the device at ``path``.

    ``modules``: {"multi_input": dir, "multi_output": dir} compiled modules.
    ``foreign``: DSP addresses that belong to *another* connection (its
    buffers, staging, KV region) — every one must be ERR_ADDR here.
    """

    def __init__(self, path: str, modules: dict, seed: int = 0, timeout: float = 60.0,
                 foreign: list[tuple[int, int]] = (), front_pid: int | None = None, reset_every: int = 20000,
                 window: int = 1, weights: dict | None = None, fixture_every: int = 0):
        self.path = path
        self.rng = random.Random(seed)
        self.timeout = timeout
        self.foreign = list(foreign)
        self.front_pid = front_pid
        self.reset_every = reset_every
        self.crash_dir = os.environ.get("DSPX_FUZZ_CRASH_DIR")
        self.stats = FuzzStats()
        self.elfs = {k: (Path(v) / "model.so").read_bytes() for k, v in modules.items()}
        self.client = None
        self._seq = 1
        self._since_reset = 0
        self._oplibs: set[int] = set()
        self._core_pids: list[int] | None = None
        self.window = max(1, window)
        # A BUF_DETACH of a fixture buffer or a DYN_UNLOAD of a fixture module
        # makes the fuzzer reopen its connection or reload a module (~1 s on
        # a loaded machine): with fixture_every, at most one per that many
        # messages; the others are pointed at a spare buffer / handle 0.
        self.fixture_every = fixture_every
        self._last_fixture = -fixture_every
        self._inflight: list = []  # (expected (type, seq), datagram, expectation, label, time sent)
        self._want_error = None
        self._alone = False
        if weights:  # {kind: weight}: kinds not named keep their default weight
            counts = collections.Counter(self.KINDS)
            self._kinds, self._kind_weights = list(counts), [weights.get(k, counts[k]) for k in counts]
        else:
            self._kinds, self._kind_weights = list(self.KINDS), None
        self._open()

    # -------------------------------------------------------------- state
    def _open(self) -> None:
        import warnings

        from dspx.host.client import Client

        self.client = c = Client(self.path, timeout=self.timeout, staging_size=1 << 20, kv_size=64 << 10,
                                 printf_size=16 << 10)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            self.mi = c.load_module(self.elfs["multi_input"])
            self.mo = c.load_module(self.elfs["multi_output"])
        c.reserve_io(max(c.input_capacity, 4096), max(c.output_capacity, 8192), 7)
        self.scratch = c.alloc(64 << 10, "fuzz-scratch")
        self.spares = [c.alloc(4096, "fuzz-spare") for _ in range(2)]
        self.sock = c.ep.sock
        self.sock.settimeout(None)
        self._poll = select.poll()
        self._poll.register(self.sock, select.POLLIN | select.POLLHUP | select.POLLRDHUP)
        st = c.staging
        self.kv = (st.dsp_addr + st.size - c.kv_size, c.kv_size)
        self.bufs = [(b.dsp_addr, b.size) for b in c.bufs]
        self._seq = 1000
        self._since_reset = 0
        self._reset_due = False
        self._edges_cache = self._edges()
        # Fixed parts of valid requests.
        import numpy as np

        ib = c.input_buf
        self.mi_descs = []
        off = layout.align(80 * 7, 64)
        for shape, dt in [((1, 16), "float32"), ((1, 16), "float32"), ((4, 4), "float32"), ((2, 8), "float32"),
                          ((16,), "float32"), ((1, 16), "int64"), ((1,), "float16")]:
            d = P.TensorDesc.for_array(ib.dsp_addr + off, shape, dt)
            self.mi_descs.append(d)
            off = layout.align(off + d.data_size, 64)
        ib.mm[:80 * 7] = P.encode_descs(self.mi_descs)
        self.mo_desc = P.TensorDesc.for_array(ib.dsp_addr + 4096 - 256, (2, 32), "float32")
        # softmax parameter struct in scratch: 64 floats at scratch+1024, output at scratch+4096.
        sc = self.scratch
        np.frombuffer(sc.mm, np.float32, 64, 1024)[:] = np.linspace(-3, 3, 64, dtype=np.float32)
        struct.pack_into("<i4xQB", sc.mm, 0, 256, sc.dsp_addr + 1024, 0)  # hbDSPSoftmaxParam, C layout

    def _reset(self, why: str = "") -> None:
        self.stats.reconnects += 1
        self._inflight.clear()
        try:
            self.client.close()
        except Exception:
            pass
        self._open()

    def close(self) -> None:
        self._drain()
        for h in list(self._oplibs):
            self._unload_oplib(h)
        if self.client:
            self.client.close()
            self.client = None

    def _unload_oplib(self, handle: int) -> None:
        self._oplibs.discard(handle)
        try:
            self.client.request(P.DynUnload(module_handle=handle), timeout=self.timeout)
        except Exception:
            pass

    # -------------------------------------------------------------- values
    def _edges(self) -> list[int]:
        out = [0, 1, memory.CARVEOUT_BASE - 1, memory.CARVEOUT_BASE, memory.CARVEOUT_BASE + memory.CARVEOUT_SIZE,
               DDR_BASE, DDR_BASE + 4096, DDR_BASE + memory.DDR_POOL_SIZE - 1, L2_BASE, L2_BASE + 64,
               L2_BASE + memory.L2_SIZE - 1, U32, 1 << 32, (1 << 32) + 1, 1 << 63, U64, U64 - 15, U64 - 4095]
        for a, s in self.bufs + [self.kv] + self.foreign:  # noqa: B007
            out += [a - 1, a, a + 1, a + s // 2, a + s - 1, a + s, a + s + 1, a + s - 64]
        return out

    def _value(self, ch: str, orig: int, name: str) -> int:
        lo, hi = _RANGES[ch]
        r = self.rng.random()
        if ("addr" in name) and r < 0.6:
            v = self.rng.choice(self._edges_cache)
        elif ("size" in name or "num" in name) and r < 0.5:
            v = self.rng.choice([0, 1, 15, 16, 63, 64, 79, 80, 81, 4095, 4096, 4097, 1 << 20, (1 << 31) - 1,
                                 1 << 31, U32 - 1, U32, 1 << 32, (1 << 32) + 80, 1 << 63, U64, U64 - 79,
                                 orig - 1, orig + 1, orig * 2, U64 - orig]
                                + [s + d for _, s in self.bufs for d in (-1, 0, 1)])
        else:
            v = self.rng.choice([0, 1, 2, 5, 6, 7, 0x7F, 0x80, 0xFF, 0xFFFF, 0x10000, 0x1FFFF, (1 << 31) - 1,
                                 1 << 31, U32 - 1, U32, -1, -2, -(1 << 31), 1 << 32, 1 << 63, U64,
                                 orig - 1, orig + 1, orig ^ (1 << self.rng.randrange(64)),
                                 self.rng.randrange(1 << 64)])
        if ch in "IQ":
            v &= hi
        elif not lo <= v <= hi:
            v = (v & (2 * hi + 1)) - (2 * hi + 2 if v & (hi + 1) else 0)
        return v

    # -------------------------------------------------------------- templates
    def _valid(self, kind: str):
        """A valid request of ``kind``: (message, fds, staged bytes or None, desc table)."""
        c = self.client
        ib, ob = c.input_buf, c.output_buf
        rng = self.rng
        if kind == "INFER":
            return P.Infer(module_handle=self.mo.handle, num_inputs=1, input_dsp_addr=ib.dsp_addr,
                           input_size=ib.size, result_dsp_addr=ob.dsp_addr, result_size=ob.size,
                           flags=rng.choice([0, 0, 2, P.FLAG_KV_RESIDENT]), descs=[self.mo_desc]), ()
        if kind == "INFER_LARGE":
            return P.InferLarge(module_handle=self.mi.handle, num_inputs=7, descs_addr=ib.dsp_addr,
                                descs_size=560, input_dsp_addr=ib.dsp_addr, input_size=ib.size,
                                result_dsp_addr=ob.dsp_addr, result_size=ob.size), ()
        if kind == "RPC":
            sc = self.scratch
            return P.Rpc(cmd=0x1402, core=-1, priority=rng.randrange(256), timeout_ms=rng.choice([0, 5000]),
                         input_dsp_addr=sc.dsp_addr, input_size=13, output_dsp_addr=sc.dsp_addr + 4096,
                         output_size=256), ()
        if kind == "SET_PRINTF_BUF":
            pb = c.printf_buf
            return P.SetPrintfBuf(printf_dsp_addr=pb.dsp_addr, printf_size=pb.size), ()
        if kind == "BUF_ATTACH":
            size = rng.choice([4096, 8192, 100, 1 << 16])
            fds = [] if rng.random() < 0.2 else [sealed_memfd(size, seal=rng.random() < 0.9)]
            if fds and rng.random() < 0.1:
                fds.append(sealed_memfd(4096))
            return P.BufAttach(size=size, flags=0, kv_size=0), fds
        if kind == "BUF_DETACH":
            return P.BufDetach(dsp_addr=rng.choice(self.spares).dsp_addr), ()
        if kind == "DYN_LOAD":
            n = self._stage_garbage(elf=True)
            return P.DynLoad(elf_size=n), ()
        if kind == "MODEL_LOAD":
            n = self._stage_garbage(elf=False)
            return P.ModelLoad(weights_size=n), ()
        if kind == "OPS_LOAD":
            src = rng.choice(GARBAGE_SOURCES) or rng.randbytes(rng.randrange(1, 300))
            sc = self.scratch
            off = 32768
            sc.mm[off:off + len(src)] = src
            return P.OpsLoad(src_dsp_addr=sc.dsp_addr + off, src_size=len(src)), ()
        if kind == "DYN_UNLOAD":
            ours = rng.random() < 0.1
            return P.DynUnload(module_handle=rng.choice([self.mi.handle, self.mo.handle] if ours else
                                                        [0, U32, self.mi.handle + 1000, 1])), ()
        if kind == "MODEL_UNLOAD":
            return P.ModelUnload(model_id=rng.choice([0, 1, self.mi.handle, U32])), ()
        if kind == "OPS_LIST":
            return P.OpsList(start=rng.choice([0, 1, 9, 10, U32])), ()
        cls = {"PING": P.Ping, "GET_STATUS": P.GetStatus, "GET_ERROR": P.GetError, "POOL_STATUS": P.PoolStatus}[kind]
        return cls(), ()

    def _stage_garbage(self, elf: bool) -> int:
        """Put something broken into staging; return the size to claim."""
        st = self.client.staging
        room = st.size - self.client.kv_size
        rng = self.rng
        base = self.elfs[rng.choice(["multi_input", "multi_output"])]
        r = rng.random()
        if r < 0.3:
            data = base[:rng.randrange(1, len(base))]  # truncated
        elif r < 0.6:
            data = bytearray(base)
            # damage the ELF identity / header fields, or one random byte
            for _ in range(rng.randrange(1, 4)):
                i = rng.choice([4, 5, 6, 7, 16, 18, 20, 24, 32, 40, 52, 54, 56, 58, 60, 62,
                                rng.randrange(64)])
                data[i] = rng.randrange(256)
            data = bytes(data)
        elif r < 0.8:
            data = rng.randbytes(rng.randrange(1, 2048))
        elif r < 0.9:
            data = b"\x7fELF" + rng.randbytes(rng.randrange(0, 512))
        else:
            data = b"DSPXWGT1" + rng.randbytes(rng.randrange(0, 256))
        st.mm[:len(data)] = data
        if rng.random() < 0.1:
            return rng.choice([0, room, room + 1, U32])
        return len(data)

    KINDS = (["INFER"] * 8 + ["INFER_LARGE"] * 8 + ["RPC"] * 6 + ["SET_PRINTF_BUF"] * 4 + ["BUF_ATTACH"] * 3
             + ["BUF_DETACH"] * 3 + ["DYN_LOAD"] * 2 + ["MODEL_LOAD"] * 2 + ["OPS_LOAD"] * 2 + ["DYN_UNLOAD"] * 2
             + ["MODEL_UNLOAD"] * 2 + ["OPS_LIST"] * 2 + ["PING", "GET_STATUS", "GET_ERROR", "POOL_STATUS"])

    def _hits_fixture(self, msg) -> bool:
        if msg.TYPE == T.DYN_UNLOAD:
            return msg.module_handle in (self.mi.handle, self.mo.handle)
        spares = {b.dsp_addr for b in self.spares}
        return any(a == msg.dsp_addr and a not in spares for a, _ in self.bufs)

    def _forged(self, addr: int) -> bool:
        """``addr`` lies in none of this connection's buffers (nor its KV
        region), so no range starting there can be one of its own."""
        return not any(a <= addr < a + s for a, s in self.bufs + [self.kv])

    def _mutate_desc_bytes(self, raw: bytearray, start: int, count: int) -> tuple | None:
        """Damage one descriptor; returns (status, class) when the protocol
        fixes the answer to that damage alone."""
        i = self.rng.randrange(count)
        off = start + 80 * i
        before = bytes(raw[off:off + 80])
        rng = self.rng
        which = rng.randrange(7)
        self._desc_damage(raw, off, which)
        if bytes(raw[off:off + 80]) == before:
            return "noop"
        ndim = struct.unpack_from("<i", before, 16)[0]
        if which == 0 and self._forged(struct.unpack_from("<Q", raw, off)[0]):
            return Status.ERR_ADDR, "forged descriptor address"
        if which in (1, 3):  # the size or the dtype no longer agree with the shape or the signature
            return Status.ERR_TENSOR, "descriptor data_size/dtype"
        if which >= 5 and raw[off + 32:off + 32 + 8 * ndim] != before[32:32 + 8 * ndim]:
            return Status.ERR_TENSOR, "descriptor extent"
        return None

    def _desc_damage(self, raw: bytearray, off: int, which: int) -> None:
        rng = self.rng
        if which == 0:  # data_addr
            struct.pack_into("<Q", raw, off, self._value("Q", struct.unpack_from("<Q", raw, off)[0], "addr"))
        elif which == 1:  # data_size
            struct.pack_into("<Q", raw, off + 8, self._value("Q", struct.unpack_from("<Q", raw, off + 8)[0], "size"))
        elif which == 2:  # ndim
            struct.pack_into("<i", raw, off + 16, rng.choice([-1, 0, 1, 2, 5, 6, 7, 1 << 30, -(1 << 31)]))
        elif which == 3:  # dtype
            struct.pack_into("<ii", raw, off + 20, rng.choice([-1, 0, 1, 2, 3, 4, 255]),
                             rng.choice([0, 1, 7, 8, 16, 32, 64, 128, -8]))
        elif which == 4:  # reserved
            struct.pack_into("<i", raw, off + 28, rng.choice([1, -1]))
        else:  # one shape extent
            j = rng.randrange(6)
            struct.pack_into("<q", raw, off + 32 + 8 * j,
                             rng.choice([-1, 0, 1, 2, 16, 1 << 31, 1 << 32, (1 << 62), -(1 << 63), (1 << 63) - 1]))

    def _field_expectation(self, msg, name: str, old: int, new: int):
        """(status, class) a request that differs from a valid one only in
        field ``name`` must get, None when the protocol leaves it open, or
        "noop" when the value did not change."""
        if new == old:
            return "noop"
        t = msg.TYPE
        if name.startswith("reserved"):
            return Status.ERR_INVALID, "reserved field"
        if name == "flags":
            allowed = {T.DYN_LOAD: P.DYN_LOAD_OP_LIBRARY, T.BUF_ATTACH: P.ATTACH_STAGING,
                       T.OPS_LOAD: P.OPS_LOAD_DEVICE_WIDE,
                       T.INFER: ~P.INFER_FLAGS_RESERVED, T.INFER_LARGE: ~P.INFER_FLAGS_RESERVED}.get(t, 0)
            return (Status.ERR_INVALID, "unknown flag bits") if new & ~allowed else None
        if "addr" in name and t != T.DYN_UNLOAD and self._forged(new):
            return Status.ERR_ADDR, "forged address"
        if t == T.INFER and name == "num_inputs":
            return Status.ERR_INVALID, "inline descriptor count"
        if t == T.INFER_LARGE and name in ("num_inputs", "descs_size"):
            return Status.ERR_INVALID, "descriptor table size"
        if t in (T.INFER, T.INFER_LARGE) and name == "module_handle" and new not in (self.mi.handle, self.mo.handle):
            return Status.ERR_HANDLE, "unknown module handle"
        if t in (T.INFER, T.INFER_LARGE) and name == "model_id":
            return Status.ERR_HANDLE, "unknown model id"  # this connection never keeps a model
        if t == T.RPC and name == "priority" and new > 255:
            return Status.ERR_INVALID, "priority range"
        if t == T.RPC and name == "core" and new < P.CORE_ANY:
            return Status.ERR_INVALID, "core index"
        return None

    def build(self) -> tuple[bytes, list[int], str]:
        """One fuzz datagram (+ fds to send with it) and its kind label.
        ``self.expect`` is then the (status, class) the answer must carry, or None."""
        rng = self.rng
        r = rng.random()
        self._seq = (self._seq + 1) & U32
        self.expect = None
        if r < 0.04:  # random bytes
            n = rng.choice([0, 1, 3, 4, 7, 8, 15, 16, 17, rng.randrange(512), 512, 513, rng.randrange(513, 4096)])
            data = rng.randbytes(n)
            if n < P.HEADER_SIZE or n > P.MAX_MSG or HDR.unpack_from(data)[2] != n:
                self.expect = (Status.ERR_INVALID, "framing")
            return data, [], "random"
        if r < 0.07:  # a valid header with a random type / random body
            t = rng.choice([rng.randrange(1 << 32), rng.randrange(0x80), 0x1001, 0x1021, 0x7FFF, 0x10000 | 0x21])
            body = rng.randbytes(rng.randrange(0, 497))
            if t not in P.MsgType._value2member_map_:
                self.expect = (Status.ERR_OP, "not a request type")
            return HDR.pack(t, self._seq, 16 + len(body), 0) + body, [], "random_type"
        kind = rng.choices(self._kinds, self._kind_weights)[0] if self._kind_weights else rng.choice(self._kinds)
        damage_table = kind == "INFER_LARGE" and rng.random() < 0.4
        if kind in ("DYN_LOAD", "MODEL_LOAD", "OPS_LOAD") or damage_table:
            self._drain()  # its build writes staging / scratch / the descriptor table that requests in flight read
            self._alone = True
        msg, fds = self._valid(kind)
        msg.seq = self._seq
        label = kind
        n_mut = 0 if rng.random() < 0.12 else rng.choice([1, 1, 1, 2, 3])
        fields = _fmt_fields(type(msg))
        effects = []  # per mutation: (status, class), None (open) or "noop"
        for _ in range(n_mut if fields else 0):
            name, ch = rng.choice(fields)
            old = getattr(msg, name)
            setattr(msg, name, self._value(ch, old, name))
            effects.append(self._field_expectation(msg, name, old, getattr(msg, name)))
        if self.fixture_every and kind in ("BUF_DETACH", "DYN_UNLOAD") and self._hits_fixture(msg):
            if self.stats.sent - self._last_fixture >= self.fixture_every:
                self._last_fixture = self.stats.sent
                self.stats.fixture_hits += 1
            else:
                self.stats.fixture_redirected += 1
                if kind == "BUF_DETACH":
                    msg.dsp_addr = rng.choice(self.spares).dsp_addr
                else:
                    msg.module_handle = 0
        if kind in ("INFER", "INFER_LARGE") and not msg.flags & P.INFER_FLAGS_RESERVED \
                and msg.flags & P.REPEAT_MASK > 3 and rng.random() < 0.99:
            msg.flags &= ~P.REPEAT_MASK | 3  # a valid repeat of 65535 runs is slow, not interesting
        if damage_table:  # damage the descriptor table in input_buf
            ib = self.client.input_buf
            raw = bytearray(P.encode_descs(self.mi_descs))
            effects.append(self._mutate_desc_bytes(raw, 0, 7))
            ib.mm[:len(raw)] = raw
            n_mut += 1
        elif kind == "INFER_LARGE":
            self.client.input_buf.mm[:560] = P.encode_descs(self.mi_descs)
        data = bytearray(msg.encode())
        if kind == "INFER" and rng.random() < 0.4:
            if rng.random() < 0.5:
                effects.append(self._mutate_desc_bytes(data, 64, 1))
            else:  # more or fewer inline descriptors than num_inputs
                extra = rng.choice([0, 1, 4, 5])
                del data[64:]
                data += P.encode_descs([self.mo_desc] * extra)
                struct.pack_into("<I", data, 8, len(data))
                effects.append("noop" if extra == msg.num_inputs == 1 else (Status.ERR_INVALID, "inline descriptor count"))
            n_mut += 1
        real = [e for e in effects if e != "noop"]
        if len(real) == 1 and real[0] is not None:
            self.expect = real[0]
        elif kind == "BUF_ATTACH" and len(fds) != 1:  # checked before any field
            self.expect = (Status.ERR_INVALID, "BUF_ATTACH fd count")
        elif kind == "BUF_ATTACH" and not real and not _sealed(fds[0]):
            self.expect = (Status.ERR_INVALID, "BUF_ATTACH unsealed memfd")
        if rng.random() < 0.08:  # header / framing: decoding fails before any field is looked at
            h = rng.randrange(5)
            self.expect = None
            if h == 0:
                struct.pack_into("<I", data, 8, self._value("I", len(data), "len"))
                if struct.unpack_from("<I", data, 8)[0] != len(data):
                    self.expect = (Status.ERR_INVALID, "framing")
            elif h == 1:
                struct.pack_into("<i", data, 12, rng.choice([1, -1, -(1 << 31)]))
            elif h == 2:
                data = data[:rng.randrange(len(data))]
                self.expect = (Status.ERR_INVALID, "framing")
            elif h == 3:
                data += bytes(rng.randrange(1, 600))
                fixed = rng.random() < 0.5
                if fixed:
                    struct.pack_into("<I", data, 8, len(data) & U32)
                # (an INFER body grown by whole descriptors may frame correctly)
                if not (fixed and kind == "INFER" and (len(data) - P.Infer.SIZE) % 80 == 0):
                    self.expect = (Status.ERR_INVALID, "framing")
            else:
                t = rng.choice([0x1000 | msg.TYPE, msg.TYPE ^ 1, msg.TYPE | 0x100])
                struct.pack_into("<I", data, 0, t)
                if t not in P.MsgType._value2member_map_:
                    self.expect = (Status.ERR_OP, "not a request type")
            n_mut += 1
            label += ":hdr"
        if not fds and rng.random() < 0.02:  # an fd riding on a message that takes none
            fds = [sealed_memfd(4096)]
            if kind == "BUF_ATTACH" and self.expect == (Status.ERR_INVALID, "BUF_ATTACH fd count"):
                self.expect = None  # it now carries the one fd it takes: no longer a count error
        self.stats.by_kind[label + ("" if n_mut else ":valid")] += 1
        return bytes(data), fds, label

    # -------------------------------------------------------------- running
    # Up to ``window`` requests are in flight on the connection.  Responses
    # may come back out of order (a job's core answers it, the front answers
    # the rest), so each is matched to its request by (response type, seq).
    # A request that may change the fuzzer's fixtures when it succeeds, or
    # whose build wrote shared memory that in-flight requests read, goes
    # alone: the window is drained before it and after it.

    def _send(self, data: bytes, fds: list, label: str, alone: bool) -> None:
        st = self.stats
        key = expected_header(data)
        if alone or any(e[0] == key for e in self._inflight):
            self._drain()
        while len(self._inflight) >= self.window:
            self._recv_one()
        try:
            try:
                if fds:
                    socket.send_fds(self.sock, [data], fds)
                    st.fds_sent += len(fds)
                else:
                    self.sock.send(data)
            finally:
                for fd in fds:
                    os.close(fd)
        except (ConnectionError, OSError) as e:
            if isinstance(e, OSError) and e.errno == 90:  # EMSGSIZE: larger than the socket allows, not sent
                return
            self._lost(label, data, e)
            return
        st.sent += 1
        mtype = struct.unpack_from("<I", data)[0] if len(data) >= 4 else None
        st.by_type[P.MsgType(mtype).name if mtype in P.MsgType._value2member_map_ else "other"] += 1
        self._inflight.append((key, data, self.expect, label, time.monotonic()))
        if alone:
            self._drain()

    def _lost(self, label: str, data: bytes, e: Exception) -> None:
        self.stats.crashes += 1
        self.stats.problem(f"{label}: connection lost ({e!r}) after {data[:64].hex()}")
        self._inflight.clear()
        self._after_loss()

    def _recv_one(self) -> None:
        """Take one response and check it against the request it answers."""
        st = self.stats
        try:
            if not self._poll.poll(int(self.timeout * 1000)):
                key, data, _, label, _ = self._inflight[0]
                st.hangs += 1
                st.problem(f"{label}: no response within {self.timeout} s to {data[:96].hex()} "
                           f"({len(self._inflight)} in flight)")
                self._inflight.clear()
                self._reset("hang")
                return
            resp, anc, flags, _ = self.sock.recvmsg(4096, socket.CMSG_SPACE(16 * 4))
            if not resp:
                raise ConnectionResetError("device closed the connection")
        except (ConnectionError, OSError) as e:
            key, data, _, label, _ = self._inflight[0]
            self._lost(label, data, e)
            return
        for level, ctype, cdata in anc or ():
            if level == socket.SOL_SOCKET and ctype == socket.SCM_RIGHTS:
                a = array.array("i")
                a.frombytes(cdata[: len(cdata) - len(cdata) % 4])
                for fd in a:
                    os.close(fd)
                st.problem("device sent fds on a response")
        rkey = HDR.unpack_from(resp)[:2] if len(resp) >= 16 else None
        i = next((i for i, e in enumerate(self._inflight) if e[0] == rkey), 0 if len(self._inflight) == 1 else None)
        if i is None:  # answers nothing in flight (a second answer, or a garbled header)
            st.extra_responses += 1
            st.problem(f"response {resp[:32].hex()} matches none of {len(self._inflight)} requests in flight")
            return
        key, data, expect, label, t_sent = self._inflight[i]
        del self._inflight[i]
        dt = time.monotonic() - t_sent
        if dt > st.max_latency_s:
            st.max_latency_s = dt
            st.slowest = data[:96].hex()
        self._check(data, resp, expect, label)

    def _drain(self) -> None:
        """Take every response owed, then make sure nothing more comes."""
        while self._inflight:
            self._recv_one()
        if self._poll.poll(0):
            try:
                extra = self.sock.recv(4096, socket.MSG_DONTWAIT)
            except OSError:
                return
            if extra:
                self.stats.extra_responses += 1
                self.stats.problem(f"extra datagram {extra[:32].hex()} with nothing in flight")
        if self._want_error is not None:
            self._fetch_error(*self._want_error)
            self._want_error = None
        if self._reset_due:
            self._reset("periodic")

    def _check(self, data: bytes, resp: bytes, expect, label: str) -> None:
        st = self.stats
        why = check_response(data, resp)
        status = HDR.unpack_from(resp)[3] if len(resp) >= 16 else None
        st.by_status[Status.name_of(status) if status is not None else "none"] += 1
        if expect is not None and status is not None and not why:
            want, cls = expect
            st.by_expectation[cls] += 1
            if cls.startswith("forged"):
                st.forged_addresses += 1
            if status != want:
                st.unexpected += 1
                st.problem(f"{label}: {cls} must be {Status.name_of(want)}, got {Status.name_of(status)}; "
                           f"request {data[:96].hex()}")
        if why:
            st.malformed += 1
            st.problem(f"{label}: {why}; request {data[:96].hex()} response {resp[:64].hex()}")
        if status == Status.ERR_CALL and label.split(":")[0] not in ("RPC",) and len(st.internal_errors) < 20:
            # A job that is not user code failed as a call: its core crashed.  Keep the evidence.
            if self.crash_dir:
                n = len(st.internal_errors)
                with open(os.path.join(self.crash_dir, f"crash-{os.getpid()}-{n}.bin"), "wb") as f:
                    f.write(data)
                with open(os.path.join(self.crash_dir, f"crash-{os.getpid()}-{n}-staging.bin"), "wb") as f:
                    f.write(bytes(self.client.staging.mm[:1 << 20]))
        if status in (Status.ERR_GENERIC, Status.ERR_CALL) and len(st.internal_errors) < 20 \
                and self._want_error is None:
            # GET_ERROR once the window is empty: with requests in flight a
            # later failure may have replaced the text, which is then said.
            self._want_error = (label, data, bool(self._inflight))
        self._track(data, resp, status)

    def _fetch_error(self, label: str, data: bytes, pipelined: bool) -> None:
        note = " (others were in flight: the text may be a later request's)" if pipelined else ""
        try:
            self.sock.send(HDR.pack(T.GET_ERROR, 0, 16, 0))
            if not self._poll.poll(int(self.timeout * 1000)):
                raise TimeoutError("no GET_ERROR response")
            err = P.decode(self.sock.recv(4096))
            self.stats.internal_errors.append(f"{label}: {data[:96].hex()} -> "
                                              f"{err.payload.decode(errors='replace')}{note}")
        except Exception as e:  # noqa: BLE001
            self.stats.internal_errors.append(f"{label}: {data[:96].hex()} -> (GET_ERROR failed: {e!r})")

    def step(self) -> None:
        if self._reset_due:
            self._drain()
        self._alone = False
        data, fds, label = self.build()
        mtype = struct.unpack_from("<I", data)[0] if len(data) >= 4 else None
        self._send(data, fds, label, self._alone or self.window <= 1 or mtype in STATE_TYPES)

    def _track(self, data: bytes, resp: bytes, status: int | None) -> None:
        """Keep the fuzz state usable after a (possibly mutated) request
        succeeded: undo what it created, restore what it took away."""
        self._since_reset += 1
        if self._since_reset % 1000 == 0:
            self._check_cores()
        if self._since_reset >= self.reset_every:
            self._reset_due = True  # once the window is empty
            return
        if status != Status.SUCCESS:
            return
        c = self.client
        rtype = HDR.unpack_from(resp)[0] & ~P.RESPONSE_BIT
        if rtype in (T.OPS_LOAD, T.DYN_LOAD):
            r = P.decode(resp)
            h = r.lib_handle if rtype == T.OPS_LOAD else r.module_handle
            if rtype == T.OPS_LOAD or struct.unpack_from("<I", data, 20)[0] & P.DYN_LOAD_OP_LIBRARY:
                self._unload_oplib(h)  # maybe device-wide: never leave one behind
            else:
                c.request(P.DynUnload(module_handle=h))
        elif rtype == T.MODEL_LOAD:
            c.request(P.ModelUnload(model_id=P.decode(resp).model_id))
        elif rtype == T.BUF_ATTACH:
            c.request(P.BufDetach(dsp_addr=P.decode(resp).dsp_addr))
        elif rtype == T.SET_PRINTF_BUF:
            if data[16:28] != struct.pack("<QI", c.printf_buf.dsp_addr, c.printf_buf.size):
                c.request(P.SetPrintfBuf(printf_dsp_addr=c.printf_buf.dsp_addr, printf_size=c.printf_buf.size))
        elif rtype == T.BUF_DETACH:
            addr = struct.unpack_from("<Q", data, 16)[0]
            spare = next((b for b in self.spares if b.dsp_addr == addr), None)
            if spare is None:
                self._reset("a fixture buffer was detached")
                return
            c.bufs.remove(spare)
            spare.close()
            self.spares.remove(spare)
            self.spares.append(c.alloc(4096, "fuzz-spare"))
            self.bufs = [(b.dsp_addr, b.size) for b in c.bufs]
            self._edges_cache = self._edges()
        elif rtype == T.DYN_UNLOAD:
            h = struct.unpack_from("<I", data, 16)[0]
            import warnings
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                if h == self.mi.handle:
                    self.mi = c.load_module(self.elfs["multi_input"])
                elif h == self.mo.handle:
                    self.mo = c.load_module(self.elfs["multi_output"])

    def _check_cores(self) -> None:
        """Count core restarts: core pids that were not there before."""
        if self.front_pid is None:
            return
        pids = set(device_footprint(self.front_pid)["cores"])
        if self._core_pids is not None:
            self.stats.core_restarts += len(pids - self._core_pids)
        self._core_pids = pids

    def _after_loss(self) -> None:
        if self.front_pid is not None:
            try:
                os.kill(self.front_pid, 0)
            except ProcessLookupError:
                raise RuntimeError("the device process died") from None
        self._reset("connection lost")

    def run(self, count: int, progress=None, stop_at: float | None = None) -> FuzzStats:
        """Send ``count`` messages (or until time.monotonic() passes ``stop_at``)."""
        t0 = time.monotonic()
        self._check_cores()
        for i in range(count):
            self.step()
            if progress and i and i % progress[0] == 0:
                self.stats.elapsed_s = time.monotonic() - t0
                progress[1](self.stats)
            if stop_at is not None and i % 256 == 0 and time.monotonic() > stop_at:
                break
        self._drain()
        self.stats.elapsed_s = time.monotonic() - t0
        self._check_cores()
        return self.stats
