"""`dspx farm up`, `status`, `down` as a user runs them: separate processes
that find the farm through the per-user record (here in a private
$XDG_RUNTIME_DIR), one small device."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

DSPX = [sys.executable, "-m", "dspx.cli"]


def _dspx(env, *args, timeout=300):
    return subprocess.run([*DSPX, *args], capture_output=True, text=True, timeout=timeout, env=env)


def _session(sid: int) -> list[int]:
    """The live processes of session ``sid``, as ps sees them."""
    rows = subprocess.run(["ps", "-eo", "pid=,sid=,stat="], capture_output=True, text=True, timeout=30).stdout
    return [int(pid) for pid, s, stat in (r.split() for r in rows.splitlines()) if int(s) == sid and stat[0] != "Z"]


def test_farm_up_status_down(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "DSPX_FARM"}
    env["XDG_RUNTIME_DIR"] = str(tmp_path)
    up = _dspx(env, "farm", "up", "--devices", "1", "--json")
    assert up.returncode == 0, up.stdout + up.stderr
    farm = json.loads(up.stdout)
    try:
        assert farm["address"].startswith("127.0.0.1:") and farm["devices"] == 1
        again = _dspx(env, "farm", "up", "--devices", "1")
        assert again.returncode == 1 and again.stderr.strip() == (
            f"error: a farm is already running at {farm['address']} (`dspx farm down` stops it)")
        st = _dspx(env, "farm", "status", "--json")
        assert st.returncode == 0, st.stderr
        assert json.loads(st.stdout)["keys"] == {"sim": {"devices": 1, "free": 1, "busy": 0, "other": 0, "held": 0,
                                                         "restarting": 0, "pending": 0, "user_cap": 1,
                                                         "waiting": []}}
        down = _dspx(env, "farm", "down")
        assert down.returncode == 0 and f"farm at {farm['address']} stopped" in down.stdout, down.stderr
    finally:
        for pid in _session(farm["pid"]):  # only if down failed: what this test started
            os.kill(pid, signal.SIGKILL)
    assert not _session(farm["pid"])
    gone = _dspx(env, "farm", "status")
    assert gone.returncode == 1 and gone.stderr.startswith("error: no farm is running")
