"""Where tensors sit in shared buffers, and the printf ring: the layouts the
host, the device and the compiler all compute.

io buffers (docs/compiler.md and docs/protocol.md).  Each side (input_buf, output_buf) starts with a
descriptor region of 80 bytes per tensor, rounded up to 64; then every
tensor, each starting 64-byte aligned.  The KV region (KV_RESIDENT) packs its
tensors the same way from its base, with no descriptor region.

printf ring.  A 16-byte header ``magic u32, write index u32, size u32,
reserved u32`` then ``size - 16`` bytes of text written round-robin; the
write index is the next byte to write, relative to the text start.
"""
from __future__ import annotations

import struct
from collections.abc import Iterable

ALIGN = 64
DESC_SIZE = 80  # protocol.TensorDesc.SIZE

PRINTF_MAGIC = 0x544E5250  # b"PRNT"
PRINTF_HEADER = 16
PRINTF_MIN_SIZE = PRINTF_HEADER + 16
_RING = struct.Struct("<IIII")


def align(n: int, a: int = ALIGN) -> int:
    return (n + a - 1) // a * a


def desc_region(count: int) -> int:
    """Bytes of the descriptor region for ``count`` tensors."""
    return align(DESC_SIZE * count)


def pack(nbytes: Iterable[int], start: int = 0) -> tuple[list[int], int]:
    """Offsets of tensors of these sizes packed 64-aligned from ``start``,
    and the end of the last one (aligned)."""
    offsets, pos = [], align(start)
    for n in nbytes:
        offsets.append(pos)
        pos = align(pos + n)
    return offsets, pos


def side_bytes(nbytes: Iterable[int]) -> int:
    """io_meta's figure for one side: descriptor region + each tensor rounded to 64."""
    nbytes = list(nbytes)
    return pack(nbytes, desc_region(len(nbytes)))[1]


# ---------------------------------------------------------------- printf ring

def ring_init(mm, off: int, size: int) -> None:
    _RING.pack_into(mm, off, PRINTF_MAGIC, 0, size, 0)


def ring_write(mm, off: int, size: int, data: bytes) -> None:
    """Append ``data`` (the newest ``size - 16`` bytes of it) to the ring at
    ``mm[off:off+size]``.  A header that is not ours (the host re-initialised
    or scribbled on it) restarts the ring at 0."""
    cap = size - PRINTF_HEADER
    magic, widx, rsize, _ = _RING.unpack_from(mm, off)
    if magic != PRINTF_MAGIC or rsize != size or widx >= cap:
        widx = 0
    base = off + PRINTF_HEADER
    chunk = data[-cap:]
    first = min(len(chunk), cap - widx)
    mm[base + widx: base + widx + first] = chunk[:first]
    rest = len(chunk) - first
    if rest:
        mm[base: base + rest] = chunk[first:]
    _RING.pack_into(mm, off, PRINTF_MAGIC, (widx + len(chunk)) % cap, size, 0)


def ring_read(mm, off: int, since: int) -> tuple[bytes, int]:
    """Bytes written since write index ``since``, and the new index."""
    magic, widx, size, _ = _RING.unpack_from(mm, off)
    if magic != PRINTF_MAGIC or size <= PRINTF_HEADER or widx >= size - PRINTF_HEADER:
        return b"", since
    base, cap = off + PRINTF_HEADER, size - PRINTF_HEADER
    since = since if since < cap else 0
    if widx >= since:
        return bytes(mm[base + since: base + widx]), widx
    return bytes(mm[base + since: base + cap]) + bytes(mm[base: base + widx]), widx
