"""Shared fixtures: a running simulated device on a private socket."""
from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import sys
import tempfile
import time

import pytest

from dspx.transport import is_listening

SMALL = ["--carveout-size", "64M", "--ddr-pool-size", "64M"]

# Every host entry point and CLI the tests start without a socket gets a
# private device (launcher.resolve): none starts the per-user background
# device, or uses one a user left running.  Tests of the background device
# unset it, with a temporary XDG_RUNTIME_DIR (tests/cli/test_cli_warm.py).
os.environ["DSPX_PRIVATE"] = "1"


class Device:
    """A `python -m dspx.device` process on its own socket."""

    def __init__(self, *args, prefix=()):
        """``prefix``: a command the device runs under (e.g. setpriv)."""
        self.dir = tempfile.mkdtemp(prefix="dspx-test-")
        self.path = os.path.join(self.dir, "dsp0.sock")
        self.log = open(os.path.join(self.dir, "device.log"), "w+b")
        self.proc = subprocess.Popen([*prefix, sys.executable, "-m", "dspx.device", "--socket", self.path, *args],
                                     stdout=self.log, stderr=self.log)
        deadline = time.monotonic() + 60
        while not is_listening(self.path):
            assert self.proc.poll() is None, self.output()
            assert time.monotonic() < deadline, "device did not start"
            time.sleep(0.01)
        # The socket listens before the cores exist; the front logs this line once every
        # core said hello (tests that look at the core processes need them to be there).
        # A loaded machine can take long to start a core (it imports TVM): its own bound.
        if os.environ.get("DSPX_LOG_LEVEL", "info").lower() in ("info", "debug") and "--quiet" not in args:
            cores_deadline = time.monotonic() + 180
            while "listening on" not in self.output():
                assert self.proc.poll() is None, self.output()
                assert time.monotonic() < cores_deadline, f"the device's cores did not start:\n{self.output()}"
                time.sleep(0.01)

    def output(self) -> str:
        self.log.flush()
        self.log.seek(0)
        return self.log.read().decode(errors="replace")

    def core_pids(self) -> list[int]:
        """The device's core processes (the front's other child is the core spawner)."""
        import psutil
        return [p.pid for p in psutil.Process(self.proc.pid).children() if p.name() != "dspx-spawner"]

    def alive(self) -> bool:
        return self.proc.poll() is None

    def stop(self):
        if self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(10)
        self.log.close()
        shutil.rmtree(self.dir, ignore_errors=True)  # its socket and log: every CI run left ~140 behind in /tmp


@contextlib.contextmanager
def llm_on_own_device(model_dir):
    """A DeviceLLM of ``model_dir`` on a device of its own (default sizes), closed with it."""
    from dspx.host.client import Client
    from dspx.host.llm import DeviceLLM

    dev = Device()
    c = Client(dev.path, timeout=120)
    m = DeviceLLM(model_dir, client=c, progress=False)
    try:
        yield m
    finally:
        m.close()
        c.close()
        dev.stop()


@pytest.fixture
def device():
    """A fresh small device for one test."""
    d = Device(*SMALL)
    yield d
    d.stop()


@pytest.fixture(scope="module")
def shared_device():
    """One small device for a whole test module (tests must not depend on its history)."""
    d = Device(*SMALL)
    yield d
    d.stop()


@pytest.fixture(scope="session")
def default_device():
    """One device with the default sizes for the whole session, for tests that
    need the default staging / KV region (tests must not depend on its history)."""
    d = Device()
    yield d
    d.stop()


@pytest.fixture
def client_of():
    """Open clients on a device socket; all are closed at the end."""
    from dspx.host.client import Client

    opened = []

    def make(path, **kw):
        kw.setdefault("staging_size", 1 << 20)
        kw.setdefault("kv_size", 1 << 16)
        c = Client(path, timeout=60, **kw)  # a hang still fails; 20 s was too short for a load under load 19
        opened.append(c)
        return c

    yield make
    for c in opened:
        c.close()


@pytest.fixture
def front():
    """A front's handlers driven directly, with no sockets (front_harness.Front)."""
    from front_harness import Front

    f = Front()
    yield f
    for b in f.bufs:
        b.close()


# ---------------------------------------------------------------- compiled example modules

# The tests' compiled artefacts live in the checkout's ignored .cache/dspx
# unless $DSPX_CACHE names another cache (set here, so the devices and CLIs
# the tests start use it too).
os.environ.setdefault("DSPX_CACHE", os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                                 ".cache", "dspx"))
CACHE = os.environ["DSPX_CACHE"]


@pytest.fixture(scope="session")
def device_verifier():
    """One private device that verifies every module the tests compile (started on first use)."""
    from dspx.host.verifier import DeviceVerifier

    with DeviceVerifier() as v:
        yield v


@pytest.fixture(scope="session")
def example_onnx():
    """{name: path} of the example ONNX models (built once, cached in .cache/dspx)."""
    from dspx import cache
    from dspx.compiler import examples

    return examples.build_all(str(cache.area("onnx")))


def compiled_example(name: str, onnx_path, verifier, separate: bool = False, kernels: bool = False,
                     op_by_op: bool = False, cost_model: str | None = None):
    """The directory of example ``name`` compiled (once per compiler: cache area "modules");
    ``cost_model``: with the board-time estimate of that profile recorded."""
    from dspx import cache
    from dspx.compiler import compiler_digest
    from dspx.compiler.onnx import compile_onnx

    modules = cache.area("modules")
    root = modules / compiler_digest()
    cache.prune(modules, keep=lambda d: d == root)  # builds by an older compiler
    out = root / (f"{name}{'-sep' if separate else ''}{'-k' if kernels else ''}{'-op' if op_by_op else ''}"
                  f"{'-' + cost_model if cost_model else ''}")
    cache.publish(out, lambda tmp: compile_onnx(onnx_path, tmp, separate_weights=separate, kernels=kernels,
                                                progress=False, verifier=verifier,
                                                subgraph=False if op_by_op else None, cost_model=cost_model),
                  complete="metadata.json")
    return out


@pytest.fixture(scope="session")
def compiled(example_onnx, device_verifier):
    """compiled(name, separate=False, kernels=False, op_by_op=False, cost_model=None) -> directory
    of a compiled example module, cached in .cache/dspx across sessions
    (kernels=True hands the graph to one onnx_subgraph call unless op_by_op;
    cost_model: the estimate of that profile recorded in its metadata)."""
    def get(name: str, separate: bool = False, kernels: bool = False, op_by_op: bool = False,
            cost_model: str | None = None):
        return compiled_example(name, example_onnx[name], device_verifier, separate, kernels, op_by_op, cost_model)
    return get


# ---------------------------------------------------------------- shared devices and op libraries

@pytest.fixture(scope="module")
def spin_device():
    """A two-core device with the op library that holds a core (spin_ops.py)
    loaded, for one test module (tests must not depend on its history)."""
    import spin_ops

    d = spin_ops.device("--carveout-size", "128M", "--ddr-pool-size", "64M", "--cores", "2")
    yield d
    d.stop()
