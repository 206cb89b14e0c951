"""The seed's C softmax listing (examples/softmax_c, unmodified) run in a
child process, counted under a cost model or plain: shared by cost_sweep.py
and cost_model.py.

The cost shim replaces the plain one for a whole process (it is loaded
RTLD_GLOBAL and op libraries bind to it), so, as tests/sdk/test_cost_c.py
does, each kind runs in a child of its own: an op registry, a core's runtime
and an address space, no device and no RPC.  The child is a small server
(one JSON request a line on stdin, one JSON answer a line on stdout), so a
parent can drive two children in alternation and time them interleaved.

The tile size is the user's: the listing takes TILE_SIZE from its header
softmax.h, so ``build`` puts the sources, unmodified, beside a copy of that
header with only its TILE_SIZE line changed.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "softmax_c"
SOURCES = ("softmax_ivp.cc", "register.cc")
SOFTMAX_C_CMD = 0x3402  # examples/softmax_c/softmax.h
ARGS_ADDR, DATA_ADDR, OUT_ADDR = 0xC000_0000, 0xC010_0000, 0xD000_0000
TILE_LINE = re.compile(r"^#define TILE_SIZE .*$", re.M)


def build(out_dir: Path, *, cost: bool, tile_bytes: int | None = None) -> Path:
    """The listing built as an op library (``cost``: a counted build) with
    TILE_SIZE = ``tile_bytes`` (None: the shipped header); returns its path."""
    from dspx import sdk

    tag = f"{'cost' if cost else 'plain'}-{tile_bytes or 'shipped'}"
    src = Path(out_dir) / f"src-{tag}"
    src.mkdir(parents=True, exist_ok=True)
    for name in SOURCES:
        shutil.copyfile(EXAMPLE / name, src / name)
    header = (EXAMPLE / "softmax.h").read_text()
    if tile_bytes is not None:
        header = TILE_LINE.sub(f"#define TILE_SIZE ({tile_bytes})", header)
    (src / "softmax.h").write_text(header)
    return sdk.build_ops([src / name for name in SOURCES], Path(out_dir) / f"softmax-{tag}.so", echo=False, cost=cost)


class Child:
    """A child process running the listing's builds ``libs`` ({key: path})
    under the cost model ``profile`` (a profile name; None: plain, no model)."""

    def __init__(self, libs: dict[str, Path], profile: str | None):
        env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")]))
        arg = json.dumps({"libs": {k: str(p) for k, p in libs.items()}, "profile": profile})
        self.log = tempfile.TemporaryFile("w+")  # the listing's DSP_LOG lines and any error, shown on failure
        self.proc = subprocess.Popen([sys.executable, __file__, arg], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=self.log, text=True, env=env)

    def run(self, lib: str, n: int, tcm: int, check: bool = False) -> dict:
        """One call of the listing over ``n`` floats (``tcm``: 0 direct, 1
        ping-pong): {"status", "cycles", "cost", "host_ns", "printf"}, and
        "err" (max error relative to the largest output) when ``check``."""
        self.proc.stdin.write(json.dumps({"lib": lib, "n": n, "tcm": tcm, "check": check}) + "\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        if not line:
            self.log.seek(0)
            raise RuntimeError(f"the softmax child exited ({self.proc.wait()}):\n{self.log.read()[-3000:]}")
        return json.loads(line)

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.stdin.close()
            self.proc.wait(60)
        self.log.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


# ------------------------------------------------------------------ the child's side

class _Data:
    """The task's buffers for ``n`` floats: parameter struct, input, output."""

    def __init__(self, n: int):
        import mmap

        import numpy as np

        from dspx.memory import AddressSpace, Region

        self.n, self.space, self.bufs = n, AddressSpace(), {}
        for i, (addr, size) in enumerate(((ARGS_ADDR, 4096), (DATA_ADDR, 4 * n + 4096), (OUT_ADDR, 4 * n + 4096))):
            self.bufs[addr] = mmap.mmap(-1, size)
            self.space.add(Region(i + 1, addr, size, self.bufs[addr]))
        self.x = np.random.default_rng(n).standard_normal(n).astype(np.float32)
        np.frombuffer(self.bufs[DATA_ADDR], np.float32, n)[:] = self.x
        self.args = np.frombuffer(self.bufs[ARGS_ADDR], np.uint8, 24)
        self.out = np.frombuffer(self.bufs[OUT_ADDR], np.uint8)

    def error(self) -> float:
        import numpy as np

        ref = np.exp(self.x.astype(np.float64) - self.x.max())
        ref /= ref.sum()
        return float(np.max(np.abs(np.frombuffer(self.bufs[OUT_ADDR], np.float32, self.n) - ref) / ref.max()))


def _serve(libs: dict[str, str], profile: str | None) -> None:
    import struct
    import time

    from dspx.device.core import native, ops, runtime as rt

    if profile is not None:  # before any native op loads the shim: this process loads the cost build
        from dspx import costmodel
        prof = costmodel.load(profile)
        native.configure_cost(prof.values(), prof.name)
    regs = {}
    for key, path in libs.items():
        regs[key] = ops.OpRegistry()
        regs[key].load_library(Path(path).read_bytes(), Path(path).name)
    answers = os.fdopen(os.dup(1), "w")  # the answers' own channel: what the ops print (also in "printf") is dropped
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, 1)
    os.close(devnull)
    core, data = rt.CoreRuntime(), {}
    for line in sys.stdin:
        req = json.loads(line)
        d = data.get(req["n"]) or data.setdefault(req["n"], _Data(req["n"]))
        struct.pack_into("<i4xQB", d.bufs[ARGS_ADDR], 0, 4 * d.n, DATA_ADDR, req["tcm"])  # hbDSPSoftmaxParam
        task = rt.TaskContext(d.space, core)
        t0 = time.perf_counter_ns()
        r = regs[req["lib"]].run(SOFTMAX_C_CMD, d.args, d.out, task)
        host_ns = time.perf_counter_ns() - t0
        answer = {"status": r.status, "cycles": r.cycles, "cost": task.cost_record, "host_ns": host_ns,
                  "printf": r.printf}
        if req["check"]:
            answer["err"] = d.error()
        answers.write(json.dumps(answer) + "\n")
        answers.flush()
    core.close()


if __name__ == "__main__":
    arg = json.loads(sys.argv[1])
    _serve(arg["libs"], arg["profile"])
