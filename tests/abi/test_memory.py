"""dspx/memory.py, the shared memory both sides map: a dmabuf is a sealed
memfd whose pages host and device share (sync counted per buffer), and
attach takes only a memfd sealed against shrinking and growing, of at least
the size asked (open_attached, driven here through the front's BUF_ATTACH
handler with no socket: tests/front_harness.py)."""
from __future__ import annotations

import fcntl
import os
import struct

import pytest

from dspx.abi import layout, protocol as P
from dspx.abi.protocol import Status as S
from front_harness import dmabuf_fd, status


def test_attach_of_an_unsealed_memfd_is_invalid_and_closes_nothing_of_ours(front):
    fd = os.memfd_create("unsealed", os.MFD_ALLOW_SEALING)
    os.ftruncate(fd, 4096)
    fds = [fd]
    assert status(front.h.handle(front.conn, P.BufAttach(size=4096), fds)) == S.ERR_INVALID
    assert fds == [fd] and not front.conn.bufs  # still the caller's to close
    os.close(fd)


def test_attach_of_a_memfd_sealed_only_against_shrink_is_invalid(front):
    fd = os.memfd_create("half", os.MFD_ALLOW_SEALING)
    os.ftruncate(fd, 4096)
    fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK)
    assert status(front(P.BufAttach(size=4096), [fd])) == S.ERR_INVALID


@pytest.mark.parametrize("size,want", [(4096, S.SUCCESS), (4097, S.ERR_INVALID), (0, S.ERR_INVALID)])
def test_attach_size_must_be_within_the_memfd(front, size, want):
    assert status(front(P.BufAttach(size=size), [dmabuf_fd(front, 4096)])) == want


def test_shared_pages_and_sync_counters(shared_device, client_of):
    """Both sides map the same pages: the device writes the printf header
    into the host's buffer when it is bound."""
    from dspx import memory
    c = client_of(shared_device.path)
    hdr = struct.unpack_from("<IIII", c.printf_buf.mm, 0)
    assert hdr == (layout.PRINTF_MAGIC, 0, c.printf_buf.size, 0)
    assert memory.CARVEOUT_BASE <= c.staging.dsp_addr < memory.CARVEOUT_BASE + memory.CARVEOUT_SIZE
    buf = c.alloc(4096)
    buf.begin_cpu_access(memory.SYNC_WRITE)
    buf.end_cpu_access(memory.SYNC_WRITE)
    assert buf.synced == {"read": 0, "write": 4096} and buf.sync_calls == 1
    with pytest.raises(RuntimeError):
        buf.end_cpu_access(memory.SYNC_READ)
