"""dspx/transport.py, the socket both sides speak over: a socket directory
open to others (or reached through a symlink someone else planted) is refused, so is a peer of another uid
(either side), the socket is the owner's only, and a full accept backlog is
waited for rather than taken for no device."""
from __future__ import annotations

import os
import socket
import subprocess
import sys
import tempfile
import time

import pytest

from dspx.errors import DspxError
from dspx.host.client import Client
from dspx.transport import UntrustedPath, check_peer_uid


def _serve(path: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "dspx.device", "--socket", path], capture_output=True, text=True,
                          timeout=60)


def test_a_symlinked_or_open_socket_directory_is_refused(tmp_path):
    target = tmp_path / "victim"
    target.mkdir(mode=0o755)
    (target / "dsp0.sock").write_text("someone's file")
    link = tmp_path / "dspx-0"
    link.symlink_to(target)  # ours, in a directory only we can write: followed, and the file there kept
    r = _serve(str(link / "dsp0.sock"))
    assert r.returncode == 2 and f"{target}/dsp0.sock exists and is a regular file, not a socket" in r.stderr, r.stderr
    assert os.stat(target).st_mode & 0o777 == 0o755  # not chmodded
    assert (target / "dsp0.sock").read_text() == "someone's file"  # not replaced
    open_dir = tmp_path / "open"
    open_dir.mkdir()
    os.chmod(open_dir, 0o777)
    r = _serve(str(open_dir / "dsp0.sock"))
    assert r.returncode == 2 and f"socket directory {open_dir} has mode 0777: others can write" in r.stderr, r.stderr
    assert not (open_dir / "dsp0.sock").exists()
    (open_dir / "sub").mkdir(mode=0o700)  # ours, but below a directory others could swap it out of
    r = _serve(str(open_dir / "sub" / "dsp0.sock"))
    assert r.returncode == 2 and f": directory {open_dir} has mode 0777" in r.stderr, r.stderr


@pytest.mark.skipif(os.getuid() != 0, reason="needs root to plant a symlink of another uid")
def test_a_symlink_another_user_planted_in_a_shared_directory_is_not_followed(tmp_path):
    shared = tmp_path / "shared"
    shared.mkdir()
    os.chmod(shared, 0o1777)  # like /tmp
    mine = tmp_path / "mine"
    mine.mkdir(mode=0o700)
    planted = shared / f"dspx-{os.getuid()}"  # where --socket shared/x.sock lives
    planted.symlink_to(mine)
    os.lchown(planted, 65534, 65534)
    r = _serve(str(shared / "x.sock"))
    assert r.returncode == 2 and f"{planted} is a symlink of uid 65534 in shared {shared}" in r.stderr, r.stderr
    assert not list(mine.iterdir())


def test_peer_uid_check_refuses_another_uid():
    check_peer_uid(os.getuid(), "/x")  # ours: accepted
    with pytest.raises(UntrustedPath, match="runs as uid 4242, not"):
        check_peer_uid(4242, "/x")


@pytest.mark.skipif(os.getuid() != 0, reason="needs root to run a listener as another uid")
def test_a_client_refuses_a_listener_of_another_uid():
    """A real listener run as uid 65534 (this test runs as root): the client
    refuses it after SO_PEERCRED, before sending anything."""
    import shutil
    top = tempfile.mkdtemp(prefix="dspx-uid-")
    os.chmod(top, 0o755)
    d = os.path.join(top, "other")
    os.mkdir(d, 0o700)
    os.chown(d, 65534, 65534)
    path = os.path.join(d, "dsp0.sock")
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        try:
            os.setuid(65534)
            s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
            s.bind(path)
            os.chmod(path, 0o777)
            s.listen(1)
            os.write(w, b"L")
            conn, _ = s.accept()
            conn.settimeout(5)
            try:
                got = conn.recv(64)
            except OSError:
                got = b""
            os.write(w, b"G" if got else b"N")
        finally:
            os._exit(0)
    os.close(w)
    assert os.read(r, 1) == b"L"
    with pytest.raises(DspxError, match="runs as uid 65534, not 0; refusing"):
        Client(path, staging_size=0, printf_size=0, timeout=5)
    assert os.read(r, 1) == b"N"  # it received nothing (no PING, no fds)
    os.waitpid(pid, 0)
    shutil.rmtree(top)


def test_a_full_accept_backlog_is_waited_for_not_taken_for_no_device(tmp_path):
    """While another client floods the device, a newcomer's connect waits
    (within its timeout) instead of reading EAGAIN as "nobody listens"."""
    from dspx.transport import TransportError, connect, is_listening
    path = str(tmp_path / "s")
    srv = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    srv.bind(path)
    srv.listen(0)
    filler = []
    while True:  # fill the backlog
        c = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        c.setblocking(False)
        try:
            c.connect(path)
        except BlockingIOError:
            c.close()
            break
        filler.append(c)
    assert is_listening(path)
    t0 = time.monotonic()
    with pytest.raises(TransportError, match="backlog stayed full"):
        connect(path, timeout=0.3)
    assert time.monotonic() - t0 >= 0.3
    srv.accept()[0].close()  # room again: the next connect gets in
    connect(path, timeout=5).close()
    for c in filler:
        c.close()
    srv.close()


def test_socket_permissions(device):
    assert os.stat(device.path).st_mode & 0o777 == 0o600
    assert os.stat(os.path.dirname(device.path)).st_mode & 0o077 == 0
