"""The records the device front and its cores exchange, and their channel.

Both ends are this package's own code: records are small typed dataclasses,
pickled over a SEQPACKET socketpair.  dmabuf fds ride along (SCM_RIGHTS) the
first time a core needs a buffer (``new_bufs``), and so does a client's own
socket the first time a core answers that client directly (``new_conn``).

The hot calls (INFER, RPC) are *planned*: the front validates a request once
and sends its resolved form (``InferSpec`` / ``RpcSpec``) with the first job
under a plan id; a request whose bytes repeat is a job naming the plan only.
The core then answers the client itself on the client's socket, after
telling the front (``Done``) so the front's state is current before the
client can send anything that depends on it.
"""
from __future__ import annotations

import os
import pickle
import struct
from dataclasses import dataclass, field

from ..transport import Endpoint

MAX_JOB_MSG = 1 << 20
MAX_JOB_FDS = 250  # SCM_MAX_FD: every buffer a connection has, on its first job

# (buf_id, offset) pairs locate bytes in a mapped buffer on the core.


# ---------------------------------------------------------------- front -> core

@dataclass(slots=True)
class Job:
    job: int = 0  # 0: nothing to answer
    new_bufs: list = field(default_factory=list)  # [(buf_id, size)], fds in the same order
    # First unmap every buffer and drop every plan: this job is another
    # connection's (or the device's), and a core holds one owner's buffers only.
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
class Loaded:
    text_size: int
    data_size: int
    workspace_bytes: int
    io_meta: tuple | None  # (num_inputs, num_outputs, input_bytes, output_bytes, flags)
    signature: dict | None


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
    the client itself; ``numbers`` are response fields for a failure."""
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


def endpoint(sock) -> Endpoint:
    return Endpoint(sock, MAX_JOB_MSG, MAX_JOB_FDS)


class RecordTooLarge(ValueError):
    """A record that does not fit one internal message (MAX_JOB_MSG)."""


def encode(rec) -> bytes:
    data = pickle.dumps(rec, protocol=pickle.HIGHEST_PROTOCOL)
    if len(data) > MAX_JOB_MSG:
        raise RecordTooLarge(f"{type(rec).__name__} of {len(data)} bytes exceeds the internal limit of "
                             f"{MAX_JOB_MSG} bytes")
    return data


def send(ep: Endpoint, rec, fds=()) -> None:
    ep.send(encode(rec), fds)


def recv(ep: Endpoint, timeout: float | None = None):
    data, fds, truncated = ep.recv(timeout, bufsize=MAX_JOB_MSG)
    if truncated:
        for fd in fds:
            os.close(fd)
        raise ValueError("internal job message truncated")
    return pickle.loads(data), fds
