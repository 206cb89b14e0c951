"""The per-user background device: the first command that needs a device
starts it, later ones (and two at once) use that same process, `dspx stop`
ends it, it exits on its own when idle, and --private still gives a private
one.  Every test runs in a temporary XDG_RUNTIME_DIR without DSPX_PRIVATE, and
stops what it started."""
import json
import os
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from dspx.transport import connect, is_listening, peer_cred

DSPX = [sys.executable, "-m", "dspx.cli"]


@pytest.fixture
def warm_env(tmp_path):
    """(environment, default socket); the device there stopped at the end whatever happened."""
    rt = tmp_path / "rt"
    rt.mkdir(mode=0o700)
    env = {k: v for k, v in os.environ.items() if k not in ("DSPX_SOCKET", "DSPX_PRIVATE", "DSPX_IDLE_EXIT")}
    env["XDG_RUNTIME_DIR"] = str(rt)
    sock = str(rt / f"dspx-{os.getuid()}" / "dsp0.sock")
    yield env, sock
    pid = listener_pid(sock)
    subprocess.run([*DSPX, "stop"], env=env, capture_output=True, timeout=60)
    if pid is not None and alive(pid):
        os.kill(pid, 9)


def dspx(*args, env, timeout=120):
    return subprocess.run([*DSPX, *map(str, args)], capture_output=True, text=True, timeout=timeout, env=env)


def listener_pid(sock: str) -> int | None:
    """The pid of the process listening on ``sock`` (SO_PEERCRED), None if none."""
    if not is_listening(sock):
        return None
    ep = connect(sock)
    try:
        return peer_cred(ep.sock)[0]
    finally:
        ep.close()


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def test_first_command_starts_the_background_device_and_the_next_reuse_it(warm_env):
    env, sock = warm_env
    with ThreadPoolExecutor(2) as pool:  # two commands racing to start it: one device
        results = list(pool.map(lambda _: dspx("ping", "-c", "2", "--json", env=env), range(2)))
    for r in results:
        assert r.returncode == 0, r.stderr
        assert json.loads(r.stdout)["private_device"] is False
    pid = listener_pid(sock)
    assert pid is not None and alive(pid)
    assert device_fronts(sock) == [pid]  # one device: no second one started by the other command
    assert os.getsid(pid) == pid  # detached: a session of its own
    log = os.path.join(os.path.dirname(sock), "dsp0.log")
    assert f"listening on {sock}" in open(log).read()
    r = dspx("status", "--json", env=env)
    assert r.returncode == 0 and json.loads(r.stdout)["private_device"] is False, r.stderr
    assert listener_pid(sock) == pid  # the same process answered
    r = dspx("ping", "--private", "-c", "2", "--json", env=env)  # a device of its own, the background one untouched
    assert r.returncode == 0 and json.loads(r.stdout)["private_device"] is True, r.stderr
    assert listener_pid(sock) == pid
    r = dspx("stop", env=env)
    assert r.returncode == 0 and r.stdout.strip() == f"stopped the device on {sock} (pid {pid})", r.stdout
    deadline = time.monotonic() + 30
    while alive(pid):
        assert time.monotonic() < deadline, "the device outlived `dspx stop`"
        time.sleep(0.05)
    assert not os.path.exists(sock)
    r = dspx("stop", env=env)
    assert r.returncode == 0 and r.stdout.strip() == f"no device is running on {sock}; nothing to stop"


def device_fronts(sock: str) -> list[int]:
    """Device processes for ``sock`` whose parent is none (its spawner and cores are forked from it)."""
    found = {}
    for p in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{p}/cmdline", "rb") as f:
                cmd = f.read().split(b"\0")
            with open(f"/proc/{p}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        if cmd[1:5] == [b"-m", b"dspx.device", b"--socket", sock.encode()]:
            found[int(p)] = ppid
    return sorted(p for p, ppid in found.items() if ppid not in found)


def test_the_background_device_exits_when_idle(warm_env):
    env, sock = warm_env
    env = {**env, "DSPX_IDLE_EXIT": "1"}
    r = dspx("ping", "-c", "1", env=env)
    assert r.returncode == 0, r.stderr
    pid = listener_pid(sock)  # a connection too: the idle second starts after it
    assert pid is not None
    deadline = time.monotonic() + 60
    while alive(pid):
        assert time.monotonic() < deadline, "the idle background device did not exit"
        time.sleep(0.1)
    assert not os.path.exists(sock)
    assert "no connection for 1 s; stopping (idle exit)" in open(os.path.join(os.path.dirname(sock), "dsp0.log")).read()


def test_a_bad_idle_exit_is_one_line(warm_env):
    env, sock = warm_env
    r = dspx("ping", env={**env, "DSPX_IDLE_EXIT": "soon"})
    assert r.returncode == 1 and r.stderr.strip() == ("error: DSPX_IDLE_EXIT='soon' is not a number of seconds "
                                                      "(0: the background device never stops on its own)")
    assert not os.path.exists(sock)


def test_the_python_api_uses_the_background_device_too(warm_env, monkeypatch):
    import dspx as api

    env, sock = warm_env
    r = dspx("ping", "-c", "1", env=env)
    assert r.returncode == 0, r.stderr
    pid = listener_pid(sock)
    for k in ("DSPX_SOCKET", "DSPX_PRIVATE"):
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setenv("XDG_RUNTIME_DIR", env["XDG_RUNTIME_DIR"])
    with api.Client(staging_size=0, printf_size=0) as c:
        assert c.device is None and c.socket_path == sock
        assert peer_cred(c.ep.sock)[0] == pid
    with api.Client(staging_size=0, printf_size=0, private=True) as c:
        assert c.device is not None and c.socket_path != sock
