"""The core's sandbox (device/sandbox.py): what code running in a core
can reach.  A core holds the buffers of the connection it serves only; its
seccomp allow-list refuses new files, sockets and exec to whatever runs in
it, op library code past the import check included.  docs/containment.md
states the rules."""
from __future__ import annotations

import os
import re
import struct
import textwrap

import pytest

from dspx.device import sandbox
from dspx.errors import CallFailed, OpFailed
from dspx.host.tasks import Tasks
from conftest import Device

UNISTD = "/usr/include/x86_64-linux-gnu/asm/unistd_64.h"

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


@pytest.mark.skipif(not os.path.exists(UNISTD), reason="needs the kernel headers (linux-libc-dev) as the reference")
def test_the_filters_syscall_numbers_are_the_kernels():
    kernel = {m[1]: int(m[2]) for m in re.finditer(r"#define __NR_(\w+) (\d+)", open(UNISTD).read())}
    wrong = {n: (nr, kernel[n]) for n, nr in sandbox.NR.items() if n in kernel and kernel[n] != nr}
    assert not wrong
    named = set(sandbox.CORE_ALLOW) | set(sandbox.CORE_REFUSED) | set(sandbox.CORE_KILL)
    assert len(named) == len(sandbox.CORE_ALLOW) + len(sandbox.CORE_REFUSED) + len(sandbox.CORE_KILL)  # disjoint


# Trusted code that escaped the import check tries what the core's filter
# refuses: each op returns the errno it got (0: it worked).
ESCAPE = textwrap.dedent("""
    from numpy.f2py import os
    from dspx.device.core import runtime as rt
    import numpy as np

    sys = os.sys
    load = getattr(sys.modules["builtins"], "__imp" + "ort__")
    TRIES = {
        1: lambda d: os.close(os.open(d + "/new", os.O_WRONLY | os.O_CREAT, 0o600)),
        2: lambda d: os.close(os.open(d + "/existing", os.O_WRONLY)),
        3: lambda d: os.close(os.open(d + "/existing", os.O_RDWR)),
        4: lambda d: os.close(os.open(d, os.O_WRONLY | os.O_TMPFILE, 0o600)),
        5: lambda d: os.mkdir(d + "/dir"),
        6: lambda d: os.unlink(d + "/existing"),
        7: lambda d: os.rename(d + "/existing", d + "/moved"),
        8: lambda d: os.chmod(d + "/existing", 0o777),
        9: lambda d: load("socket").socket(),
        10: lambda d: os.close(os.open(d + "/existing", os.O_RDONLY)),  # outside the trees a core reads
        11: lambda d: os.close(os.memfd_create("x")),  # memfds stay allowed
        12: lambda d: os.close(os.open(os.__file__, os.O_RDONLY)),  # so does reading the interpreter's files
    }

    @rt.register_op(0x3F20)
    def attempt(inp, out, tm):
        which = int(np.frombuffer(inp, np.uint32, 1)[0])
        where = bytes(inp[4:]).split(b"\\0")[0].decode()
        try:
            TRIES[which](where)
        except OSError as e:
            return e.errno
        return 0

    @rt.register_op(0x3F21)
    def run_program(inp, out, tm):
        os.execv("/bin/true", ["true"])
""")
ATTEMPT_CMD, EXEC_CMD = 0x3F20, 0x3F21
REFUSED = {1: "create a file", 2: "open a file for writing", 3: "open a file read-write", 4: "O_TMPFILE",
           5: "mkdir", 6: "unlink", 7: "rename", 8: "chmod", 9: "a new socket"}


def test_op_library_code_in_a_core_creates_no_file_and_no_socket_and_exec_ends_its_core(dev, tmp_path):
    (tmp_path / "existing").write_text("kept")
    with Tasks(socket=dev.path) as u:
        h, _ = u.load_ops(ESCAPE)
        try:
            inp, out = u.malloc(4096), u.malloc(64)

            def attempt(which: int) -> int:
                inp.buf.mm[:4096] = b"\0" * 4096
                inp.buf.mm[:4] = struct.pack("<I", which)
                path = str(tmp_path).encode()
                inp.buf.mm[4:4 + len(path)] = path
                try:
                    return u.run(ATTEMPT_CMD, inp, out, core=0).return_value
                except OpFailed as e:  # the errno the attempt got is the handler's return
                    return e.return_value

            got = {w: attempt(w) for w in REFUSED}
            assert got == {w: 1 for w in REFUSED}, {REFUSED[w]: e for w, e in got.items()}  # EPERM each
            # Landlock (where the kernel has it) confines reads to the interpreter's and libraries' trees
            assert attempt(10) == (13 if sandbox.landlock_abi() else 0)  # EACCES
            assert attempt(11) == 0 and attempt(12) == 0
            assert sorted(p.name for p in tmp_path.iterdir()) == ["existing"]
            assert (tmp_path / "existing").read_text() == "kept"

            with pytest.raises(CallFailed, match="core 0 crashed"):
                u.run(EXEC_CMD, inp, out, core=0)
            assert re.search(r"core 0 died \(exit -31\)", dev.output()), dev.output()[-2000:]  # SIGSYS
            assert u.client.ping()["version"] == "3.0.0"
            assert attempt(12) == 0  # the restarted core serves again, the library loaded on it again
        finally:
            u.unload_ops(h)


def test_the_core_refuses_sockets_to_op_library_code(dev):
    """Past the import check (op libraries are trusted code), the core's own
    filter still refuses new sockets: EPERM in the handler.  (Exec ends the
    core, new files are refused: the test above.)"""
    src = textwrap.dedent("""
        from numpy.f2py import os  # an escape from the import check
        from dspx.device.core import runtime as rt

        @rt.register_op(0x3F02)
        def try_socket(inp, out, tm):
            import numpy.f2py
            sock = numpy.f2py.os.sys.modules["socket"]
            try:
                sock.socket(sock.AF_INET, sock.SOCK_STREAM)
            except OSError as e:
                return e.errno
            return 0
    """)
    with Tasks(socket=dev.path) as u:
        h, _ = u.load_ops(src)
        try:
            with pytest.raises(OpFailed) as e:
                u.run(0x3F02, u.malloc(4), u.malloc(4))
            assert e.value.return_value == 1  # EPERM
        finally:
            u.unload_ops(h)
