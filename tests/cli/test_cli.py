"""The `dspx` command line: serve, ping, status (JSON for programs)."""
import json
import os
import signal
import subprocess
import sys
import time

from dspx.transport import is_listening

DSPX = [sys.executable, "-m", "dspx.cli"]


def run(*args, env=None, timeout=60):
    return subprocess.run([*DSPX, *args], capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, **(env or {})})


def test_ping_json_on_a_private_device(tmp_path):
    env = {"XDG_RUNTIME_DIR": str(tmp_path)}
    env_no_socket = {k: v for k, v in os.environ.items() if k != "DSPX_SOCKET"}
    r = subprocess.run([*DSPX, "ping", "--count", "50", "--json"], capture_output=True, text=True, timeout=60,
                       env={**env_no_socket, **env})
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert out["status"] == "ok" and out["version"] == "3.0.0" and out["count"] == 50
    assert 0 < out["min_us"] <= out["median_us"] <= out["p99_us"]


def test_serve_then_ping_and_status_then_sigint(tmp_path):
    sock = str(tmp_path / "dev.sock")
    proc = subprocess.Popen([*DSPX, "serve", "--socket", sock, "--carveout-size", "64M", "--cores", "2"],
                            stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 30
        while not is_listening(sock):
            assert proc.poll() is None and time.monotonic() < deadline
            time.sleep(0.02)
        r = run("status", "--json", env={"DSPX_SOCKET": sock})
        st = json.loads(r.stdout)
        assert st["status"] == "ok" and st["cores"] == 2 and st["carveout_total"] == 64 << 20
        assert st["connections"] == 1 and st["jobs_completed"] == 0
        r = run("ping", "--socket", sock, "-c", "5")
        assert r.returncode == 0 and "device 3.0.0: 5 pings" in r.stdout
        r = run("status", "--socket", sock)
        assert "DDR pool" in r.stdout and "2 core(s)" in r.stdout
    finally:
        proc.send_signal(signal.SIGINT)
        assert proc.wait(15) == 130  # Ctrl-C, as the README says (SIGTERM: 0)
    assert not os.path.exists(sock)


def test_errors_are_json_for_programs(tmp_path):
    r = run("ping", "--json", env={"DSPX_SOCKET": str(tmp_path / "nothing.sock")})
    assert r.returncode == 1
    out = json.loads(r.stdout)
    assert out["status"] == "error" and "no device is listening" in out["message"]


def test_status_and_ops_say_when_the_answer_came_from_a_private_device(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "DSPX_SOCKET"}
    env["XDG_RUNTIME_DIR"] = str(tmp_path)  # nothing listens at the default path there
    for cmd in ("status", "ops"):
        r = subprocess.run([*DSPX, cmd], capture_output=True, text=True, timeout=60, env=env)
        assert r.returncode == 0 and "private device started for this command" in r.stdout.splitlines()[0], r.stdout
        r = subprocess.run([*DSPX, cmd, "--json"], capture_output=True, text=True, timeout=60, env=env)
        out = json.loads(r.stdout)
        assert out["private_device"] is True and "private device" in out["note"]
    sock = str(tmp_path / "dev.sock")
    proc = subprocess.Popen([*DSPX, "serve", "--socket", sock, "--carveout-size", "64M"], stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 30
        while not is_listening(sock):
            assert proc.poll() is None and time.monotonic() < deadline
            time.sleep(0.02)
        for cmd in ("status", "ops"):
            r = subprocess.run([*DSPX, cmd, "--socket", sock], capture_output=True, text=True, timeout=60, env=env)
            assert r.returncode == 0 and "private" not in r.stdout
            assert json.loads(subprocess.run([*DSPX, cmd, "--json", "--socket", sock], capture_output=True,
                                             text=True, timeout=60, env=env).stdout)["private_device"] is False
    finally:
        proc.send_signal(signal.SIGINT)
        proc.wait(15)
