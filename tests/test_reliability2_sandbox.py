"""Reliability II (issue 15, 7b/7c): what code running in a core can reach.

A core holds the buffers of the connection it serves only; its seccomp
allow-list refuses new files, sockets and exec to whatever runs in it.
docs/reliability.md §5b states the rules."""
from __future__ import annotations

import struct
import textwrap

import pytest

from dspx.host.tasks import Tasks
from conftest import Device

MARKER = b"connection-B-own"  # 16 bytes at the start of B's buffer

# An op library that escaped the import check (trusted code, docs/custom-ops.md)
# looking for another connection's buffer from inside the core.
SPY = textwrap.dedent("""
    from numpy.f2py import os
    from dspx.device.core import runtime as rt
    import numpy as np

    sys = os.sys
    read_text = getattr(sys.modules["builtins"], "op" + "en")  # past the name check
    load = getattr(sys.modules["builtins"], "__imp" + "ort__")

    @rt.register_op(0x3F10)
    def spy(inp, out, tm):
        ino = int(np.frombuffer(inp, np.uint64, 1)[0])
        marker = bytes(inp[8:24])
        maps = sum(1 for line in read_text("/proc/self/maps") if line.split()[4:5] == [str(ino)])
        fds = 0
        for n in os.listdir("/proc/self/fd"):
            try:
                fds += os.stat(f"/proc/self/fd/{n}").st_ino == ino
            except OSError:
                pass
        gc, mmap = load("gc"), load("mmap")
        seen = 0
        for o in gc.get_objects():
            for r in gc.get_referents(o):
                if isinstance(r, mmap.mmap) and not r.closed and len(r) >= 16 and r[:16] == marker:
                    seen += 1
        np.frombuffer(out, np.uint32, 3)[:] = (maps, fds, seen)
        return 0

    @rt.register_op(0x3F11)
    def touch(inp, out, tm):
        out[:4] = inp[:4]
        return 0
""")
SPY_CMD, TOUCH_CMD = 0x3F10, 0x3F11


@pytest.fixture(scope="module")
def dev():
    d = Device("--carveout-size", "64M", "--ddr-pool-size", "64M", "--cores", "1")
    yield d
    d.stop()


def spy(t: Tasks, ino: int) -> tuple[int, int, int]:
    inp, out = t.malloc(64), t.malloc(64)
    inp.buf.mm[:24] = struct.pack("<Q", ino) + MARKER
    t.run(SPY_CMD, inp, out, core=0)
    return struct.unpack_from("<3I", out.buf.mm)


def test_a_core_serving_connection_a_holds_no_mapping_or_fd_of_connection_bs_buffer(dev):
    import os
    with Tasks(socket=dev.path) as a, Tasks(socket=dev.path) as b:
        h, _ = a.load_ops(SPY)
        try:
            secret, out = b.malloc(4096), b.malloc(64)
            secret.buf.mm[:16] = MARKER
            ino = os.fstat(secret.buf.fd).st_ino
            b.run(TOUCH_CMD, secret, out, core=0)  # core 0 maps B's buffer
            assert bytes(out.buf.mm[:4]) == MARKER[:4]
            maps, fds, seen = spy(b, ino)  # the spy finds it while serving B: it can see
            assert maps >= 1 and fds >= 1 and seen >= 1, (maps, fds, seen)
            assert spy(a, ino) == (0, 0, 0), "serving A, the core still maps or holds B's buffer"
            secret.buf.mm[:4] = b"again"[:4]
            b.run(TOUCH_CMD, secret, out, core=0)  # B is served again: mapped afresh
            assert bytes(out.buf.mm[:4]) == b"agai"
        finally:
            a.unload_ops(h)
