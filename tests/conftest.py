"""Shared fixtures: a running simulated device on a private socket."""
from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time

import pytest

from dspx.transport import is_listening

SMALL = ["--carveout-size", "64M", "--ddr-pool-size", "64M"]


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

CACHE = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), ".cache", "dspx")


def _compiler_digest() -> str:
    """Compiled modules are reused while the compiler sources and TVM are unchanged."""
    import hashlib
    from pathlib import Path

    import tvm

    import dspx.compiler

    h = hashlib.sha256(tvm.__version__.encode())
    compiler = Path(dspx.compiler.__file__).parent
    for f in [*sorted(compiler.glob("*.py")), *sorted((compiler.parent / "abi").glob("*.py"))]:
        h.update(f.read_bytes())
    return h.hexdigest()[:16]


@pytest.fixture(scope="session")
def example_onnx():
    """{name: path} of the example ONNX models (built once, cached in .cache/dspx)."""
    from dspx.compiler import examples

    return examples.build_all(os.path.join(CACHE, "onnx"))


@pytest.fixture(scope="session")
def compiled(example_onnx):
    """compiled(name, separate=False, kernels=False, op_by_op=False) -> directory
    of a compiled example module, cached in .cache/dspx across sessions
    (kernels=True hands the graph to one onnx_subgraph call unless op_by_op)."""
    import shutil
    from pathlib import Path

    from dspx.compiler.onnx import compile_onnx
    from dspx.compiler.verify import Verifier

    verifier = Verifier()  # one private device checks every example compiled here
    root = Path(CACHE, "modules", _compiler_digest())
    for stale in root.parent.glob("*"):  # builds by an older compiler
        if stale != root:
            shutil.rmtree(stale, ignore_errors=True)

    def get(name: str, separate: bool = False, kernels: bool = False, op_by_op: bool = False) -> Path:
        out = root / f"{name}{'-sep' if separate else ''}{'-k' if kernels else ''}{'-op' if op_by_op else ''}"
        if not (out / "metadata.json").exists():
            compile_onnx(example_onnx[name], out, separate_weights=separate, kernels=kernels, progress=False,
                         verifier=verifier, subgraph=False if op_by_op else None)
        return out

    yield get
    verifier.close()


# ---------------------------------------------------------------- shared devices and op libraries

@pytest.fixture(scope="module")
def spin_device():
    """A two-core device with the op library that holds a core (spin_ops.py)
    loaded, for one test module (tests must not depend on its history)."""
    import spin_ops

    d = spin_ops.device("--carveout-size", "128M", "--ddr-pool-size", "64M", "--cores", "2")
    yield d
    d.stop()
