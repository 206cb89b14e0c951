"""The host side of one connection, without I/O (h11's habit).

``Session`` decides what the wire needs and keeps what came back: which seq
a request gets and which waiter a response belongs to, how a failure becomes
a typed exception, and (``IoCapacity``) the capacity rules of docs/protocol.md, "Capacity" with
where an inference's inputs go.  ``Client`` owns the socket and the dmabufs
and asks this module what to do, so every rule here is tested with no device.
"""
from __future__ import annotations

import itertools
import struct
from dataclasses import dataclass

import numpy as np

from ..abi import layout, protocol as P
from ..errors import CapacityError, CapacityLocked, CapacityWarning, DeviceError, device_error

_SEQ = struct.Struct("<I")  # the header's seq field, at offset 4

# Response fields a typed exception carries when the device set them.
NUMBERS = ("oom_requested", "oom_free", "oom_total", "result_required", "return_value", "cycles", "error_line")


class Session:
    """Seq allocation and matching for one connection, plus its io capacity."""

    def __init__(self):
        self._seqs = itertools.count(1)  # next() is atomic: senders on several threads share it
        self._outstanding: set[int] = set()
        self._stash: dict[int, P.Message] = {}
        self.io = IoCapacity()

    def start(self, msg: P.Message) -> bytes:
        """Give ``msg`` the next seq and return its bytes.  Its response is
        awaited from now on, so call this before the bytes go out."""
        msg.seq = next(self._seqs) & 0xFFFFFFFF
        data = msg.encode()
        self._outstanding.add(msg.seq)
        return data

    def start_bytes(self, request: bytearray) -> int:
        """``start`` for a request already encoded: write the next seq into it."""
        seq = next(self._seqs) & 0xFFFFFFFF
        _SEQ.pack_into(request, 4, seq)
        self._outstanding.add(seq)
        return seq

    def receive(self, data) -> None:
        """One datagram from the device.  A response to an outstanding
        request is kept for its waiter; anything else (a duplicate, a late
        answer to a seq already taken) is dropped, so nothing waits forever."""
        resp = P.decode(data)
        if resp.seq in self._outstanding and resp.seq not in self._stash:
            self._stash[resp.seq] = resp

    def take(self, seq: int) -> P.Message | None:
        """The response to ``seq`` if it has arrived; ``seq`` is then done."""
        resp = self._stash.pop(seq, None)
        if resp is not None:
            self._outstanding.discard(seq)
        return resp


def failure(resp: P.Message, request: str, error: P.GetErrorResp | None = None) -> DeviceError:
    """The typed exception for a failed response: its status, the numbers it
    carries, and the text of GET_ERROR when that text is about this seq."""
    numbers = {k: getattr(resp, k) for k in NUMBERS if getattr(resp, k, 0)}
    text = error.payload.decode(errors="replace") if error is not None and error.error_seq == resp.seq else ""
    return device_error(resp.status, text, request, **numbers)


@dataclass
class InferLayout:
    """What the client does for one inference: copy each ``(offset, array)``
    into input_buf, write ``table`` at input_buf's start, send ``message``."""

    copies: list
    table: bytes
    message: P.Infer | P.InferLarge


SIDES = ("input", "output")


class IoCapacity:
    """input_buf / output_buf capacity (docs/protocol.md, "Capacity") and where tensors sit in input_buf.

    Sizes grow from a module's declaration (DYN_LOAD) whether or not capacity
    is locked; ``reserve`` only until the first successful use locks it.
    Buffers are replaced by bigger ones, never shrunk.
    """

    def __init__(self):
        self.size = {"input": 0, "output": 0}      # bytes of the current buffer (0: none yet)
        self.dsp_addr = {"input": 0, "output": 0}
        self.kv_addr = 0                           # DSP address of the KV region, when there is one
        self.locked = False
        # Tensors in input_buf start past the largest descriptor region declared.
        self.tensors_from = 0
        self._created: tuple[int, int] | None = None  # (first, end) of create_input arrays in this input_buf

    @property
    def input(self) -> int:
        return self.size["input"]

    @property
    def output(self) -> int:
        return self.size["output"]

    def declare(self, input_bytes: int, output_bytes: int, num_inputs: int = 0) -> list[tuple[str, int]]:
        """A DYN_LOAD's io declaration: the sides whose buffer must be
        replaced by a bigger one, and the size each needs."""
        self.tensors_from = max(self.tensors_from, layout.desc_region(num_inputs))
        return [(side, want) for side, want in zip(SIDES, (input_bytes, output_bytes)) if want > self.size[side]]

    def reserve(self, input_bytes: int, output_bytes: int, num_inputs: int = 0) -> list[tuple[str, int]]:
        """reserve_io: like a declaration, but refused once capacity is locked."""
        if self.locked:
            raise CapacityLocked(f"reserve_io({input_bytes}, {output_bytes}) refused: capacity was locked at "
                                 f"input {self.input} / output {self.output} bytes by its first successful use")
        return self.declare(input_bytes, output_bytes, num_inputs)

    def state(self) -> tuple:
        """Everything an inference's layout depends on, to key cached layouts by."""
        return (self.size["input"], self.dsp_addr["input"], self.size["output"], self.dsp_addr["output"],
                self.kv_addr, self.tensors_from, self._created)

    def replaced(self, side: str, size: int, dsp_addr: int) -> None:
        """The client attached a new buffer for ``side``.  Arrays create_input
        handed out live in the old one, so they are copied from now on."""
        self.size[side], self.dsp_addr[side] = size, dsp_addr
        if side == "input":
            self._created = None

    def unmet(self, shortfalls: list[tuple[str, int, str]]) -> CapacityWarning:
        """The warning for a declaration that could not be met: ``(side,
        declared, why)`` for each side whose buffer could not be replaced."""
        parts = [f"{side} declared {want} bytes, allocated {self.size[side]} ({why})" for side, want, why in shortfalls]
        return CapacityWarning("io declaration could not be met: " + "; ".join(parts) +
                               " — call reserve_io() with the real figures before the first inference")

    def create_input(self, nbytes: int) -> int:
        """Offset in input_buf of a new zero-copy input; locks capacity."""
        first, end = self._created or (None, self.tensors_from)
        off = layout.align(max(end, self.tensors_from))
        if not self.input or off + nbytes > self.input:
            raise CapacityError(off + nbytes, self.input, "create_input")
        self._created = (off if first is None else first, off + nbytes)
        self.locked = True
        return off

    def plan_infer(self, handle: int, inputs, in_place, model_id: int = 0, repeat: int = 0,
                   kv_resident: bool = False, kv_inputs=(), profile: bool = False) -> InferLayout:
        """Lay out one inference.  ``inputs`` are arrays, ``in_place`` their
        offsets in input_buf (None: not there, copy it); ``kv_inputs`` are
        ``(index, kv_offset, shape, dtype)`` for inputs in the KV region.
        Raises CapacityError (EFBIG) before anything is staged."""
        if not self.input or not self.output:
            raise CapacityError(sum(a.nbytes for a in inputs), self.input, "inference")
        kv = {i: (off, shape, dt) for i, off, shape, dt in kv_inputs}
        n = len(inputs) + len(kv)
        large = n > P.MAX_INLINE_INPUTS
        table = layout.DESC_SIZE * n if large else 0  # INFER_LARGE: descriptors at input_buf's start
        first, end = self._created or (None, 0)
        if first is not None and first < table:
            raise CapacityError(table, first, "descriptor region")
        pos = max(layout.desc_region(n), end)
        base = self.dsp_addr["input"]
        copies, descs = [], []
        arrays = iter(zip(inputs, in_place))
        for i in range(n):
            if i in kv:
                off, shape, dt = kv[i]
                descs.append(P.TensorDesc.for_array(self.kv_addr + off, shape, np.dtype(dt).name))
                continue
            a, off = next(arrays)
            if off is None:
                off = layout.align(pos)
                pos = off + a.nbytes
                copies.append((off, a))
            descs.append(P.TensorDesc.for_array(base + off, a.shape, a.dtype.name))
        if pos > self.input:
            raise CapacityError(pos, self.input)
        fields = dict(module_handle=handle, model_id=model_id, num_inputs=n,
                      flags=(repeat & P.REPEAT_MASK) | (P.FLAG_KV_RESIDENT if kv_resident else 0)
                      | (P.FLAG_PROFILE if profile else 0),
                      input_dsp_addr=base, input_size=self.input,
                      result_dsp_addr=self.dsp_addr["output"], result_size=self.output)
        if not large:
            return InferLayout(copies, b"", P.Infer(**fields, descs=descs))
        return InferLayout(copies, P.encode_descs(descs), P.InferLarge(**fields, descs_addr=base, descs_size=table))

    def completed(self, resp) -> None:
        """A successful inference response: outputs handed back lock capacity."""
        if resp.num_outputs:
            self.locked = True
