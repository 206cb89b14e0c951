"""The printf ring and the io-buffer layout rules (docs/protocol.md, "printf
ring" and "Outputs"), checked against bytes and offsets written out by hand."""
from __future__ import annotations

import struct

import pytest

from dspx.abi import layout

HDR = struct.Struct("<IIII")


def ring(size: int, off: int = 8) -> bytearray:
    mm = bytearray(off + size + 100)  # room after the ring that must stay untouched
    layout.ring_init(mm, off, size)
    return mm


def test_ring_header_is_magic_index_size_reserved():
    mm = ring(48)
    assert bytes(mm[8:24]) == b"PRNT" + bytes(4) + struct.pack("<I", 48) + bytes(4)


def test_ring_write_appends_after_the_header_and_moves_the_index():
    mm = ring(48)  # 32 bytes of text
    layout.ring_write(mm, 8, 48, b"hello ")
    layout.ring_write(mm, 8, 48, b"world")
    assert bytes(mm[24:35]) == b"hello world" and HDR.unpack_from(mm, 8) == (layout.PRINTF_MAGIC, 11, 48, 0)
    assert bytes(mm[:8]) == bytes(8) and bytes(mm[56:]) == bytes(100)  # nothing outside the ring


def test_ring_write_wraps_round_robin():
    mm = ring(48)
    layout.ring_write(mm, 8, 48, b"a" * 30)
    layout.ring_write(mm, 8, 48, b"0123456789")  # 2 at the end, 8 from the start
    assert bytes(mm[24:56]) == b"23456789" + b"a" * 22 + b"01"
    assert HDR.unpack_from(mm, 8)[1] == 8


def test_ring_write_of_more_than_the_ring_keeps_the_newest_bytes():
    mm = ring(48)
    layout.ring_write(mm, 8, 48, bytes(range(40)))
    assert bytes(mm[24:56]) == bytes(range(8, 40)) and HDR.unpack_from(mm, 8)[1] == 0


@pytest.mark.parametrize("damage", [(0, 0x1234), (1, 40), (1, 32), (2, 64)])
def test_a_header_that_is_not_ours_restarts_the_ring_at_0(damage):
    mm = ring(48)
    layout.ring_write(mm, 8, 48, b"xyz")
    field, value = damage
    struct.pack_into("<I", mm, 8 + 4 * field, value)
    layout.ring_write(mm, 8, 48, b"new")
    assert bytes(mm[24:27]) == b"new" and HDR.unpack_from(mm, 8) == (layout.PRINTF_MAGIC, 3, 48, 0)


def test_ring_read_returns_what_was_written_since_an_index():
    mm = ring(48)
    layout.ring_write(mm, 8, 48, b"first ")
    assert layout.ring_read(mm, 8, 0) == (b"first ", 6)
    layout.ring_write(mm, 8, 48, b"second")
    assert layout.ring_read(mm, 8, 6) == (b"second", 12)
    assert layout.ring_read(mm, 8, 12) == (b"", 12)


def test_ring_read_across_the_wrap():
    mm = ring(48)
    layout.ring_write(mm, 8, 48, b"a" * 28)
    layout.ring_write(mm, 8, 48, b"0123456789")
    assert layout.ring_read(mm, 8, 28) == (b"0123456789", 6)


def test_ring_read_past_the_ring_starts_over():
    mm = ring(48)
    layout.ring_write(mm, 8, 48, b"abc")
    assert layout.ring_read(mm, 8, 32) == (b"abc", 3)


@pytest.mark.parametrize("damage", [(0, 0), (2, 16), (1, 32)])
def test_ring_read_of_a_damaged_header_reads_nothing(damage):
    mm = ring(48)
    layout.ring_write(mm, 8, 48, b"abc")
    field, value = damage
    struct.pack_into("<I", mm, 8 + 4 * field, value)
    assert layout.ring_read(mm, 8, 1) == (b"", 1)


def test_alignment_and_descriptor_region_by_hand():
    assert [layout.align(n) for n in (0, 1, 63, 64, 65, 128)] == [0, 64, 64, 64, 128, 128]
    assert layout.align(5, 4) == 8 and layout.align(8, 4) == 8
    assert [layout.desc_region(n) for n in (0, 1, 4, 5, 7)] == [0, 128, 320, 448, 576]


def test_pack_places_each_tensor_64_aligned_from_an_aligned_start():
    assert layout.pack([]) == ([], 0)
    assert layout.pack([1, 64, 65, 0, 10]) == ([0, 64, 128, 256, 256], 320)
    assert layout.pack([10], start=1) == ([64], 128)
    assert layout.pack([10], start=128) == ([128], 192)


def test_side_bytes_is_the_descriptor_region_then_each_tensor_rounded():
    # 2 tensors: 160 -> 192; 100 -> 128; 1 -> 64
    assert layout.side_bytes([100, 1]) == 192 + 128 + 64
    assert layout.side_bytes([]) == 0
