"""Farms of several machines, on this one: a node killed mid-batch (Ray's
multi-node test cluster, in this process), and `dspx farm up --listen`,
`join` and `leave` as a user runs them (separate processes, two `ray start`
nodes on this machine's routable address, with Ray's token authentication).
Every batch must equal, bit for bit, the module run item by item on a local
device (test_farm_batch._local)."""
from __future__ import annotations

import contextlib
import ipaddress
import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile

import numpy as np
import psutil
import pytest

import dspx.farm  # before ray: it sets Ray's loopback switch, read when Ray is first imported
import ray
from conftest import Device
from dspx.farm import actors, broker, cluster
from ray.cluster_utils import Cluster
from test_farm_batch import SMALL, _inputs, _local

DSPX = [sys.executable, "-m", "dspx.cli"]


@pytest.fixture(scope="module")
def module(compiled):
    return compiled("multi_input")


def _same_as(results, reference) -> None:
    assert [r.index for r in results] == list(range(len(reference)))
    for r, ref in zip(results, reference):
        assert r.outputs.keys() == ref.keys()
        for name in ref:
            assert r.outputs[name].dtype == ref[name].dtype and np.array_equal(r.outputs[name], ref[name]), (r, name)


# ---------------------------------------------------------------- a node killed mid-batch

@contextlib.contextmanager
def _test_cluster(monkeypatch, devices_on_the_second: bool = True):
    """Ray's multi-node test cluster: a head and one more node, one small
    device pinned to the head, and one to the other node unless the test
    adds it later (``spawn_second``).  It works with the loopback switch on
    (this process's): the Cluster starts its nodes itself, not through `ray
    start --address` (which the switch refuses), and puts every node on
    127.0.0.1, where nodes and driver reach each other; objects cross."""
    work = tempfile.mkdtemp(prefix="dspx-nodes-", dir="/tmp")  # short: Ray's socket paths live under it
    # The Cluster writes its address to Ray's default temp dir, /tmp/ray, shared by every user here: not there.
    monkeypatch.setenv("RAY_TMPDIR", work)
    ray_dir = os.path.join(work, "ray")
    clu = Cluster()
    try:
        head = clu.add_node(num_cpus=1, resources={"dspx:sim": 1}, object_store_memory=100 << 20, temp_dir=ray_dir,
                            include_dashboard=False, dashboard_agent_listen_port=cluster._free_port())
        cluster.connect(clu.address)
        ray.get(broker.get().status.remote(), timeout=120)  # the lease broker, as `farm up` makes it
        other = clu.add_node(num_cpus=1, resources={"dspx:sim": 1}, object_store_memory=100 << 20, temp_dir=ray_dir)
        nodes = (head, other) if devices_on_the_second else (head,)
        actors.wait_ready([actors.spawn("sim", i, device_args=SMALL, node=n.node_id) for i, n in enumerate(nodes)],
                          timeout=300)
        yield clu, head, other
    finally:
        cluster.disconnect()  # first: the Cluster refuses to remove the node its driver is on
        clu.shutdown()
        shutil.rmtree(work, ignore_errors=True)


@pytest.fixture
def two_nodes(monkeypatch):
    with _test_cluster(monkeypatch) as nodes:
        yield nodes


def test_a_node_killed_mid_batch_costs_its_items_a_move_to_the_surviving_node(two_nodes, module, shared_device):
    clu, head, other = two_nodes
    # Both devices warm (the module loaded): the batch below then spreads over both from its start.
    assert {r.device for r in dspx.farm.map(module, _inputs(module, 4, seed=9))} == {"sim-0", "sim-1"}
    # The second node's raylet, and under it the actor's worker and its device, SIGKILLed at once, as a
    # machine that goes away (the worker answers calls itself: it must not outlive its raylet).
    raylet = psutil.Process(ray.get(actors.find_devices("sim")["sim-1"].info.remote(), timeout=30)["pid"]).parent()
    assert raylet.name() == "raylet"
    killed = []

    def kill_at_its_first_result(result):
        # By now sim-1 has its next calls (map sends them before it hands over a result): they are lost.
        if result.device == "sim-1" and not killed:
            for p in [raylet, *raylet.children(recursive=True)]:
                p.send_signal(signal.SIGKILL)
            killed.append(result.index)

    data = _inputs(module, 24, seed=3)
    results = dspx.farm.map(module, data, on_result=kill_at_its_first_result, timeout=120)
    assert killed
    _same_as(results, _local(module, data, shared_device.path))
    moved = [r for r in results if r.attempt > 1]
    assert moved, "no item shows the attempt it lost with the killed node"
    assert all(r.node == head.node_id and r.device == "sim-0" and r.attempt == 2 for r in moved), moved


def test_a_device_that_joins_mid_batch_takes_work_from_it(monkeypatch, tmp_path):
    from spin_ops import SOURCE, SPIN

    lib = tmp_path / "spin.py"
    lib.write_text(SOURCE)
    ms = np.full((80, 1), 100, "<i4").view(np.uint8)  # 80 cases of 100 ms: 8 s on one device
    cases = dspx.farm.ops.read_cases({"input": ms, "cmd": np.int64(SPIN), "output_bytes": np.int64(4)})
    with _test_cluster(monkeypatch, devices_on_the_second=False) as (clu, head, other):
        seen = []

        def on_result(r):
            seen.append(r.device)
            if len(seen) == 2:  # the batch runs on sim-0 alone: a device joins on the second node
                actors.spawn("sim", 1, device_args=SMALL, node=other.node_id)

        results = dspx.farm.ops.run_cases(lib, cases, chunk=1, on_result=on_result)
    assert all(r.output.tobytes() == b"RUN!" and r.error is None for r in results)
    assert seen[:2] == ["sim-0", "sim-0"] and "sim-1" in seen[2:], seen


# ---------------------------------------------------------------- farm up --listen, join, leave

def _routable_ip() -> str | None:
    for addrs in psutil.net_if_addrs().values():
        for a in addrs:
            if a.family == socket.AF_INET and not ipaddress.ip_address(a.address).is_loopback:
                return a.address
    return None


IP = _routable_ip()
needs_ip = pytest.mark.skipif(IP is None, reason="this machine has no routable IPv4 address for a farm to listen on")


def _session(sid: int) -> list[int]:
    rows = subprocess.run(["ps", "-eo", "pid=,sid=,stat="], capture_output=True, text=True, timeout=30).stdout
    return [int(pid) for pid, s, stat in (r.split() for r in rows.splitlines()) if int(s) == sid and stat[0] != "Z"]


class Machine:
    """`dspx` commands as a user on one machine of the farm runs them: its own
    per-user directory (where `farm up` or `join` records what it started),
    holding the farm's token (RAY_AUTH_TOKEN_PATH, RAY_AUTH_MODE=token)."""

    def __init__(self, root, name: str, token):
        self.env = {k: v for k, v in os.environ.items() if k != "DSPX_FARM"}
        self.env.update(XDG_RUNTIME_DIR=str(root / name), RAY_AUTH_TOKEN_PATH=str(token), RAY_AUTH_MODE="token")
        (root / name).mkdir()
        self.started: list[int] = []  # the sessions of what it started, killed at the end if `down` failed

    def dspx(self, *args, timeout=300):
        return subprocess.run([*DSPX, *args], capture_output=True, text=True, timeout=timeout, env=self.env)

    def json(self, *args) -> dict:
        out = self.dspx(*args, "--json")
        assert out.returncode == 0, out.stdout + out.stderr
        return json.loads(out.stdout)

    def stop(self) -> None:
        self.dspx("farm", "down", timeout=60)
        for sid in self.started:
            for pid in _session(sid):
                os.kill(pid, signal.SIGKILL)


@pytest.fixture(scope="module")
def farm_of_two(tmp_path_factory):
    """A farm on this machine's routable address with one device, and a
    second `ray start` node joined to it with one more (two machines' worth
    of commands, each with its own per-user directory)."""
    root = tmp_path_factory.mktemp("machines")
    token = root / "token"
    token.write_text(secrets.token_hex(32))
    token.chmod(0o600)
    head, node = Machine(root, "head", token), Machine(root, "node", token)
    try:
        up = head.json("farm", "up", "--listen", IP, "--devices", "1")
        head.started.append(up["pid"])
        assert up["address"].startswith(f"{IP}:") and up["auth"] == "token", up
        joined = node.json("farm", "join", up["address"], "--key", "sim", "--devices", "1")
        node.started.append(joined["pid"])
        yield head, node, up["address"], joined, root, token
    finally:
        node.stop()
        head.stop()
        assert not any(_session(sid) for m in (head, node) for sid in m.started)


def _run(machine, module, data, path, *args) -> tuple[dict, dict]:
    """`dspx farm run` of ``data``: its --json summary and the outputs it wrote."""
    np.savez(path / "data.npz", **data)
    out = path / "out.npz"
    summary = machine.json("farm", "run", str(module), "--inputs", str(path / "data.npz"), "-o", str(out), *args)
    with np.load(out) as written:
        return summary, {name: written[name] for name in written.files}


def _stacked(reference: list[dict]) -> dict:
    return {name: np.stack([ref[name] for ref in reference]) for name in reference[0]}


@needs_ip
def test_a_joined_node_takes_work_and_status_shows_both_nodes(farm_of_two, module, shared_device, tmp_path):
    head, node, address, joined, _, _ = farm_of_two
    st = head.json("farm", "status")
    assert st["keys"]["sim"]["devices"] == 2 and st["keys"]["sim"]["free"] == 2, st
    where = {d["device"]: d["node"] for d in st["devices"]}
    assert where["sim-1"] == joined["node"] and where["sim-0"] != joined["node"], where
    # The joined machine's own record finds the farm too (its drivers attach to its node).
    assert {d["device"] for d in node.json("farm", "status")["devices"]} == {"sim-0", "sim-1"}

    data = _inputs(module, 24, seed=4)
    summary, written = _run(head, module, data, tmp_path)
    assert {r["node"] for r in summary["results"]} == {where["sim-0"], where["sim-1"]}, "both nodes take work"
    assert all(r["attempt"] == 1 for r in summary["results"])
    reference = _stacked(_local(module, data, shared_device.path))
    assert written.keys() == reference.keys()
    assert all(np.array_equal(written[k], reference[k]) for k in reference)


@needs_ip
def test_a_board_given_by_socket_takes_work_and_leave_stops_its_node_not_the_board(farm_of_two, module,
                                                                                     shared_device, tmp_path):
    head, _, address, _, root, token = farm_of_two
    board = Device(*SMALL)  # a device this node did not start: the board's stand-in
    machine = Machine(root, "board", token)
    try:
        joined = machine.json("farm", "join", address, "--key", "board", "--socket", board.path)
        machine.started.append(joined["pid"])
        st = head.json("farm", "status")
        info = {d["device"]: d for d in st["devices"]}["board-0"]
        assert info["node"] == joined["node"] and info["device_pid"] == board.proc.pid, info  # ours, connected to

        data = _inputs(module, 12, seed=5)
        summary, written = _run(head, module, data, tmp_path, "--key", "board")
        assert {(r["device"], r["node"]) for r in summary["results"]} == {("board-0", joined["node"])}
        reference = _stacked(_local(module, data, shared_device.path))
        assert all(np.array_equal(written[k], reference[k]) for k in reference)

        left = machine.json("farm", "leave")
        assert left["left"] and left["node"] == joined["node"]
        assert not _session(joined["pid"]), "leave left the node's processes running"
        assert board.alive(), "leave stopped the board: it is not the farm's to stop"
        assert "board" not in head.json("farm", "status")["keys"]
    finally:
        machine.stop()
        board.stop()


def test_a_join_where_no_farm_answers_is_one_error_line(tmp_path):
    with socket.socket() as s:  # a port nothing listens on, on an address of this machine
        s.bind((IP or "127.0.0.1", 0))
        address = f"{s.getsockname()[0]}:{s.getsockname()[1]}"
    env = {**os.environ, "XDG_RUNTIME_DIR": str(tmp_path)}
    out = subprocess.run([*DSPX, "farm", "join", address, "--devices", "1"], capture_output=True, text=True,
                         timeout=120, env=env)
    assert out.returncode == 1 and out.stdout == ""
    assert out.stderr.strip() == (f"error: no farm answers at {address} (is it up, started with `dspx farm up "
                                  f"--listen HOST`, and is its port open to this machine?)")
    assert not list(tmp_path.iterdir()), "a refused join recorded something"
