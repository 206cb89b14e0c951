"""The dspx module format, shared by the compiler (which writes it) and the
device loader (which reads it): what a compiled module carries besides its
code.

A module is one ELF shared object exported by TVM, plus:

- ``_binary_tvm_dsp_io_meta_start`` (with ``_end`` and ``_size``, objcopy
  style): the 40-byte ``IoMeta`` blob (docs/compiler.md).
- ``_binary_dspx_signature_start`` (with ``_end`` and ``_size``): UTF-8 JSON
  describing the entry, its tensors, the kernels it imports, its workspace and
  its weights (``Signature``).
- optionally ``weights.bin`` beside it (separate weights, sent with MODEL_LOAD)
  and always ``metadata.json`` for the host.

Formats only, no I/O beyond parsing bytes.  See docs/compiler.md.
"""
from __future__ import annotations

import hashlib
import json
import struct
from dataclasses import asdict, dataclass, field

import numpy as np

from dspx.abi.layout import ALIGN, align, side_bytes
from dspx.abi.protocol import MAX_NDIM, DType, IoMeta

IO_META_NAME = "tvm_dsp_io_meta"
SIGNATURE_NAME = "dspx_signature"
IO_META_SYMBOL = f"_binary_{IO_META_NAME}_start"
SIGNATURE_SYMBOL = f"_binary_{SIGNATURE_NAME}_start"
SIGNATURE_FORMAT = "dspx-signature/1"
WEIGHTS_FILE = "weights.bin"
METADATA_FILE = "metadata.json"
MODULE_FILE = "model.so"


# ---------------------------------------------------------------- tensors

@dataclass(frozen=True)
class TensorSpec:
    name: str
    shape: tuple[int, ...]
    dtype: str

    def __post_init__(self):
        DType.code_bits(self.dtype)  # raises ValueError for a dtype the protocol cannot carry
        if len(self.shape) > MAX_NDIM:
            raise ValueError(f"tensor {self.name!r} has {len(self.shape)} dims; descriptors carry at most {MAX_NDIM}")

    @property
    def nbytes(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64)) * DType.code_bits(self.dtype)[1] // 8

    def to_json(self) -> dict:
        return {"name": self.name, "shape": list(self.shape), "dtype": self.dtype}

    @classmethod
    def from_json(cls, d: dict) -> "TensorSpec":
        return cls(str(d["name"]), tuple(int(s) for s in d["shape"]), str(d["dtype"]))


def make_io_meta(inputs: list[TensorSpec], outputs: list[TensorSpec]) -> IoMeta:
    """Static shapes only, so the sizes are exact (flags bit 0)."""
    return IoMeta(len(inputs), len(outputs), side_bytes(t.nbytes for t in inputs),
                  side_bytes(t.nbytes for t in outputs), IoMeta.FLAG_EXACT)


# ---------------------------------------------------------------- signature

@dataclass
class Signature:
    """What the loader checks and the executor needs before running the entry.

    ``weights`` is "embedded" (constants inside the module) or "separate"
    (the entry takes the inputs, then ``num_weights`` weight tensors from a
    weights file whose payload digest is ``weights_digest``)."""

    entry: str
    inputs: list[TensorSpec]
    outputs: list[TensorSpec]
    kernel_imports: list[str] = field(default_factory=list)
    workspace_bytes: int = 0
    weights: str = "embedded"
    num_weights: int = 0
    weights_digest: str | None = None
    #: the LLVM CPU the code was generated for and the /proc/cpuinfo flags it
    #: needs (the loader refuses the module on a CPU without them)
    target_cpu: str | None = None
    cpu_features: list[str] = field(default_factory=list)

    def to_json(self) -> dict:
        d = asdict(self)
        d["format"] = SIGNATURE_FORMAT
        d["inputs"] = [t.to_json() for t in self.inputs]
        d["outputs"] = [t.to_json() for t in self.outputs]
        return d

    def encode(self) -> bytes:
        return json.dumps(self.to_json(), sort_keys=True, separators=(",", ":")).encode()

    @classmethod
    def decode(cls, blob: bytes) -> "Signature":
        try:
            d = json.loads(bytes(blob).decode())
            if d.get("format") != SIGNATURE_FORMAT:
                raise ValueError(f"format {d.get('format')!r}, expected {SIGNATURE_FORMAT!r}")
            if d["weights"] not in ("embedded", "separate"):
                raise ValueError(f"weights mode {d['weights']!r}")
            return cls(entry=str(d["entry"]),
                       inputs=[TensorSpec.from_json(t) for t in d["inputs"]],
                       outputs=[TensorSpec.from_json(t) for t in d["outputs"]],
                       kernel_imports=[str(k) for k in d["kernel_imports"]],
                       workspace_bytes=int(d["workspace_bytes"]),
                       weights=d["weights"],
                       num_weights=int(d["num_weights"]),
                       weights_digest=d["weights_digest"],
                       target_cpu=d.get("target_cpu"),  # absent in modules of older compilers
                       cpu_features=[str(f) for f in d.get("cpu_features", [])])
        except KeyError as e:
            raise ValueError(f"bad {SIGNATURE_NAME} blob: missing field {e}") from None
        except (UnicodeDecodeError, TypeError, ValueError) as e:  # JSONDecodeError is a ValueError
            raise ValueError(f"bad {SIGNATURE_NAME} blob: {e}") from None


# ---------------------------------------------------------------- weights file

class WeightsError(ValueError):
    """A weights file that is truncated, corrupt or not the one expected."""


WEIGHTS_MAGIC = b"DSPXWTS\0"
WEIGHTS_VERSION = 1
# magic, version, count, header_bytes (= payload offset), payload_bytes, sha256(payload)
_WHEADER = struct.Struct("<8sIIQQ32s")  # 64 bytes
# offset (from payload start), nbytes, name_len, dtype_code, dtype_bits, ndim, reserved; then shape i64 x ndim, name
_WENTRY = struct.Struct("<QQHBBBx")


@dataclass(frozen=True)
class WeightTensor:
    name: str
    array: np.ndarray  # read-only view into the file's bytes


@dataclass(frozen=True)
class Weights:
    tensors: list[WeightTensor]
    digest: str  # "sha256:<hex>" of the payload

    @property
    def nbytes(self) -> int:
        return sum(t.array.nbytes for t in self.tensors)


def encode_weights(named: list[tuple[str, np.ndarray]]) -> bytes:
    """Header (64 B) + entry table, padded to 64; then each tensor 64-aligned."""
    table, offset, arrays = [], 0, []
    for name, arr in named:
        arr = np.ascontiguousarray(arr)
        code, bits = DType.code_bits(arr.dtype.name)
        nm = name.encode()
        table.append(_WENTRY.pack(offset, arr.nbytes, len(nm), code, bits, arr.ndim)
                     + struct.pack(f"<{arr.ndim}q", *arr.shape) + nm)
        arrays.append((offset, arr))
        offset = align(offset + arr.nbytes, ALIGN)
    header_bytes = align(_WHEADER.size + sum(len(t) for t in table), ALIGN)
    payload = bytearray(offset)
    for off, arr in arrays:
        payload[off:off + arr.nbytes] = arr.tobytes()
    digest = hashlib.sha256(payload).digest()
    head = _WHEADER.pack(WEIGHTS_MAGIC, WEIGHTS_VERSION, len(named), header_bytes, len(payload), digest)
    head += b"".join(table)
    return head + bytes(header_bytes - len(head)) + payload


def read_weights(buf) -> Weights:
    """Parse a weights file held in memory; arrays are zero-copy views of ``buf``."""
    mv = memoryview(buf).cast("B")
    if len(mv) < _WHEADER.size:
        raise WeightsError(f"weights file is {len(mv)} bytes, shorter than its {_WHEADER.size}-byte header")
    magic, version, count, header_bytes, payload_bytes, digest = _WHEADER.unpack_from(mv)
    if magic != WEIGHTS_MAGIC:
        raise WeightsError(f"not a dspx weights file (magic {bytes(magic)!r}, expected {WEIGHTS_MAGIC!r})")
    if version != WEIGHTS_VERSION:
        raise WeightsError(f"weights file version {version}, this device reads {WEIGHTS_VERSION}")
    if header_bytes % ALIGN or header_bytes < _WHEADER.size:
        raise WeightsError(f"weights header size {header_bytes} is not a multiple of {ALIGN}")
    if len(mv) != header_bytes + payload_bytes:
        raise WeightsError(f"weights file is {len(mv)} bytes, header says {header_bytes + payload_bytes} "
                           f"({header_bytes} header + {payload_bytes} payload): truncated or padded")
    payload = mv[header_bytes:]
    if hashlib.sha256(payload).digest() != digest:
        raise WeightsError("weights payload does not match its sha256 digest: corrupt")
    tensors, pos = [], _WHEADER.size
    for i in range(count):
        if pos + _WENTRY.size > header_bytes:
            raise WeightsError(f"weights entry {i} runs past the {header_bytes}-byte header")
        offset, nbytes, name_len, code, bits, ndim = _WENTRY.unpack_from(mv, pos)
        pos += _WENTRY.size
        end = pos + 8 * ndim + name_len
        if ndim > MAX_NDIM or end > header_bytes:
            raise WeightsError(f"weights entry {i} is malformed (ndim {ndim}, name of {name_len} bytes)")
        shape = struct.unpack_from(f"<{ndim}q", mv, pos)
        try:
            name = bytes(mv[pos + 8 * ndim:end]).decode()
        except UnicodeDecodeError:
            raise WeightsError(f"weights entry {i} has a name that is not UTF-8") from None
        pos = end
        dtype = DType.name(code, bits)
        if dtype is None:
            raise WeightsError(f"weights tensor {name!r}: unknown dtype (code {code}, bits {bits})")
        if min(shape, default=0) < 0 or int(np.prod(shape, dtype=np.int64)) * bits // 8 != nbytes:
            raise WeightsError(f"weights tensor {name!r}: {nbytes} bytes do not match shape {list(shape)} {dtype}")
        if offset % ALIGN or offset + nbytes > payload_bytes:
            raise WeightsError(f"weights tensor {name!r}: bytes [{offset}, {offset + nbytes}) lie outside "
                               f"the {payload_bytes}-byte payload or are not {ALIGN}-aligned")
        arr = np.frombuffer(payload[offset:offset + nbytes], dtype=dtype).reshape(shape)
        tensors.append(WeightTensor(name, arr))
    return Weights(tensors, "sha256:" + digest.hex())
