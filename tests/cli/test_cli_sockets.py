"""Socket paths: `dspx serve` keeps a user's file, a shared directory's socket
lives in its private dspx-<uid>, an unsafe directory is refused, and every
command a hint suggests is one that works (run here)."""
import os
import re
import signal
import socket
import stat
import subprocess
import sys
import time

import pytest

from dspx.transport import is_listening, socket_path

DSPX = [sys.executable, "-m", "dspx.cli"]


def env_of(tmp_path, **extra):
    """The tests' environment with no $DSPX_SOCKET and a private runtime directory."""
    rt = tmp_path / "rt"
    rt.mkdir(mode=0o700, exist_ok=True)
    env = {k: v for k, v in os.environ.items() if k != "DSPX_SOCKET"}
    return {**env, "XDG_RUNTIME_DIR": str(rt), **extra}


def dspx(*args, env, timeout=90):
    return subprocess.run([*DSPX, *map(str, args)], capture_output=True, text=True, timeout=timeout, env=env)


def one_error_line(r) -> str:
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 1 and len(lines) == 1 and lines[0].startswith("error: "), (r.returncode, r.stderr)
    return lines[0]


class Served:
    """`dspx serve --socket GIVEN` in the background; stopped (SIGTERM) at the end."""

    def __init__(self, given, env):
        self.given, self.path = str(given), socket_path(str(given))
        self.proc = subprocess.Popen([*DSPX, "serve", "--socket", self.given, "--carveout-size", "64M",
                                      "--ddr-pool-size", "64M"], env=env, stdout=subprocess.DEVNULL,
                                     stderr=subprocess.PIPE, text=True)
        deadline = time.monotonic() + 60
        while not is_listening(self.path):
            assert self.proc.poll() is None, self.proc.stderr.read()
            assert time.monotonic() < deadline, "dspx serve did not listen within 60 s"
            time.sleep(0.02)

    def stop(self):
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            self.proc.wait(20)
        return self.proc.returncode


@pytest.mark.parametrize("kind", ["file", "directory", "symlink"])
def test_serve_keeps_what_is_not_a_socket(tmp_path, kind):
    target = tmp_path / "notes.txt"
    target.write_bytes(b"my notes\n\x00\xff")
    given = {"file": target, "directory": tmp_path / "adir", "symlink": tmp_path / "link"}[kind]
    if kind == "directory":
        given.mkdir()
    elif kind == "symlink":
        given.symlink_to(target)
    r = dspx("serve", "--socket", given, env=env_of(tmp_path))
    line = one_error_line(r)
    assert str(given) in line and "not a socket" in line and "refusing" in line, line
    assert target.read_bytes() == b"my notes\n\x00\xff"
    assert os.path.lexists(given) and not stat.S_ISSOCK(os.lstat(given).st_mode)


def test_serve_replaces_a_stale_socket_and_stop_ends_it(tmp_path):
    env = env_of(tmp_path)
    path = tmp_path / "stale.sock"
    s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    s.bind(str(path))
    s.close()  # a socket file no device listens on: what a device that was killed leaves
    dev = Served(path, env)
    try:
        r = dspx("ping", "--socket", path, "-c", "2", env=env)
        assert r.returncode == 0 and "device 3.0.0" in r.stdout, r.stderr
        r = dspx("stop", "--socket", path, env=env)
        assert r.returncode == 0 and f"stopped the device on {path} (pid {dev.proc.pid})" in r.stdout, r.stdout
        assert dev.proc.wait(20) == 0 and not path.exists()
        r = dspx("stop", "--socket", path, env=env)
        assert r.returncode == 0 and r.stdout.strip() == f"no device is running on {path}; nothing to stop"
    finally:
        dev.stop()


def test_a_socket_in_a_shared_directory_lives_in_its_private_subdirectory(tmp_path):
    assert socket_path("/tmp/x.sock") == f"/tmp/dspx-{os.getuid()}/x.sock"  # /tmp is sticky and world-writable
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o1777)  # like /tmp
    env = env_of(tmp_path)
    given = shared / "x.sock"
    dev = Served(given, env)
    try:
        private = shared / f"dspx-{os.getuid()}"
        assert dev.path == str(private / "x.sock")
        st = os.lstat(private)
        assert stat.S_ISDIR(st.st_mode) and st.st_mode & 0o777 == 0o700 and st.st_uid == os.getuid()
        r = dspx("ping", "--socket", given, "-c", "2", env=env)  # the same name finds it
        assert r.returncode == 0 and "device 3.0.0" in r.stdout, r.stderr
    finally:
        assert dev.stop() == 0
    assert not os.path.exists(dev.path)


def test_symlinks_are_followed_to_a_directory_that_is_safe(tmp_path):
    from dspx.transport import UntrustedPath, serve_refusal, socket_dir

    safe, open_dir = tmp_path / "safe", tmp_path / "open"
    safe.mkdir(mode=0o700)
    open_dir.mkdir()
    open_dir.chmod(0o777)
    (tmp_path / "to-safe").symlink_to(safe)
    (tmp_path / "to-open").symlink_to(open_dir)
    (safe / "up").symlink_to("../open")
    assert socket_dir(str(tmp_path / "to-safe" / "x.sock"), create=False) == str(safe)
    assert serve_refusal(str(tmp_path / "to-safe" / "x.sock")) is None
    with pytest.raises(UntrustedPath, match=f"socket directory {open_dir} has mode 0777"):
        socket_dir(str(tmp_path / "to-open" / "x.sock"))
    with pytest.raises(UntrustedPath, match=f"socket directory {open_dir} has mode 0777"):
        socket_dir(str(safe / "up" / "x.sock"))  # a relative symlink through ".."
    assert not list(open_dir.iterdir())  # nothing was made there


def test_hints_suggest_commands_that_work(tmp_path):
    """`dspx ping` on a missing device: the serve command it suggests is run
    and serves, then the ping it implies answers; --socket is never answered
    with "unset DSPX_SOCKET"."""
    env = env_of(tmp_path)
    open_dir = tmp_path / "open"
    open_dir.mkdir()
    open_dir.chmod(0o777)  # others may write here: no socket of ours
    given = open_dir / "x.sock"
    refused = one_error_line(dspx("serve", "--socket", given, env=env))
    assert f"socket directory {open_dir} has mode 0777" in refused and "choose another --socket" in refused
    hint = one_error_line(dspx("ping", "--socket", given, env=env))
    assert "unset DSPX_SOCKET" not in hint and "leave out --socket" in hint, hint
    suggested = re.search(r"`dspx serve --socket ([^`]+)`", hint).group(1)
    assert suggested == os.path.join(env["XDG_RUNTIME_DIR"], f"dspx-{os.getuid()}", "x.sock"), hint
    dev = Served(suggested, env)
    try:
        r = dspx("ping", "--socket", suggested, "-c", "2", env=env)
        assert r.returncode == 0 and "device 3.0.0" in r.stdout, r.stderr
    finally:
        assert dev.stop() == 0
    # named in $DSPX_SOCKET: that is what the hint says to change; a usable path is suggested as given
    fine = tmp_path / "mine" / "dsp0.sock"
    hint = one_error_line(dspx("ping", env={**env, "DSPX_SOCKET": str(fine)}))
    assert f"no device is listening on {fine}" in hint and "unset DSPX_SOCKET" in hint
    assert "leave out --socket" not in hint and f"`dspx serve --socket {fine}`" in hint, hint
    dev = Served(fine, env)
    try:
        r = dspx("ping", "-c", "2", env={**env, "DSPX_SOCKET": str(fine)})
        assert r.returncode == 0 and "device 3.0.0" in r.stdout, r.stderr
    finally:
        assert dev.stop() == 0


def test_private_and_socket_exclude_each_other(tmp_path):
    r = dspx("ping", "--private", "--socket", tmp_path / "x.sock", env=env_of(tmp_path))
    assert r.returncode == 2 and "--private and --socket exclude each other" in r.stderr
