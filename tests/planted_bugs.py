"""Plant each of issue 18's eight bugs, one at a time, in a scratch copy of
the repo and run the tests that should catch it; prints one line per bug.

    .venv/bin/python tests/planted_bugs.py [N ...]     # all, or bugs N ...

Not part of `make test` (it runs device tests eight times over); the last
result is in docs/reliability.md, "Rules and their tests"."""
import os, subprocess, sys, tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
PY = sys.executable

BUGS = [
 ("overflow-unsafe end in the address range check", "src/dspx/memory.py",
  "    return (0 <= addr < U64 and 0 <= size < U64 and addr + size < U64\n            and base <= addr and addr + size <= limit)",
  "    return base <= addr and (addr + size) & U64 <= limit  # planted: the end wraps",
  ["tests/device/front/test_handlers.py", "tests/abi/test_memory.py"]),
 ("capacity locked before the request instead of after success", "src/dspx/host/session.py",
  '        if not large:\n            return InferLayout(copies, b""',
  '        self.locked = True  # planted\n        if not large:\n            return InferLayout(copies, b""',
  ["tests/host/test_session.py"]),
 ("KV-resident outputs written at the wrong offset", "src/dspx/device/core/inference.py",
  "dst = view(self.kv_mm, kv_off + kpos, arr.shape, arr.dtype)",
  "dst = view(self.kv_mm, kv_off + kpos + 64, arr.shape, arr.dtype)",
  ["tests/device/core/test_inference.py::test_kv_resident_outputs_are_packed_from_the_kv_regions_base"]),
 ("INFER_LARGE skips the reserved-flags check", "src/dspx/device/front/handlers/calls.py",
  "        if req.flags & P.INFER_FLAGS_RESERVED:",
  "        if req.TYPE == P.MsgType.INFER and req.flags & P.INFER_FLAGS_RESERVED:",
  ["tests/device/front/test_handlers.py", "tests/abi/test_memory.py"]),
 ("tile manager's fit check ignores alignment padding", "src/dspx/device/core/runtime.py",
  "            if start + nbytes <= off + size:",
  "            if off + nbytes <= off + size:",
  ["tests/device/core/test_tiles_and_dma.py", "tests/device/core/test_runtime.py"]),
 ("BUF_DETACH of a buffer a running job uses: ERR_BUSY guard removed", "src/dspx/device/front/handlers/buffers.py",
  "        if b.busy:\n",
  "        if False:  # planted\n",
  ["tests/device/front/test_handlers.py", "tests/abi/test_memory.py",
   "tests/device/front/test_service.py::test_detach_of_a_buffer_a_running_job_uses_is_busy"]),
 ("the RPC message's fields permuted on the wire", "src/dspx/abi/protocol.py",
  '"cmd core priority timeout_ms input_dsp_addr input_size output_dsp_addr output_size"',
  '"cmd core priority timeout_ms output_dsp_addr output_size input_dsp_addr input_size"',
  ["tests/abi/test_protocol.py"]),
 ("the loader's forked probe turned off", "src/dspx/device/core/worker.py",
  'if os.environ.get(LOAD_PROBE_ENV, "1") != "0":',
  'if os.environ.get(LOAD_PROBE_ENV, "0") != "0":  # planted',
  ["tests/device/core/test_loader.py::test_a_module_that_crashes_the_loader_costs_the_probe_child_not_the_core"]),
]
def scratch() -> str:
    """A copy of the working tree (without .venv, .git and the LLM cache)."""
    root = tempfile.mkdtemp(prefix="dspx-planted-")
    subprocess.run(f"tar --exclude=./.venv --exclude=./.git --exclude=./mutants --exclude=./.cache/dspx/llm -cf - . "
                   f"| tar -xf - -C {root}", shell=True, cwd=REPO, check=True)
    return root


ROOT = scratch()
print(f"scratch copy: {ROOT}")
only = [int(a) for a in sys.argv[1:]]
env = dict(os.environ, PYTHONPATH=os.path.join(ROOT, "src"))
for i, (name, path, old, new, tests) in enumerate(BUGS, 1):
    if only and i not in only:
        continue
    p = os.path.join(ROOT, path)
    orig = open(p).read()
    assert orig.count(old) == 1, (name, "pattern not found once")
    open(p, "w").write(orig.replace(old, new))
    try:
        r = subprocess.run(["nice", PY, "-m", "pytest", "-q", "-p", "no:cacheprovider", *tests],
                           cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    finally:
        open(p, "w").write(orig)
    failed = [l.split(" - ")[0].replace("FAILED ", "") for l in r.stdout.splitlines() if l.startswith(("FAILED", "ERROR"))]
    summary = r.stdout.strip().splitlines()[-1] if r.stdout.strip() else r.stderr[-300:]
    print(f"{i}. {name}: {'CAUGHT' if r.returncode else 'NOT CAUGHT'} ({summary})")
    for f in failed[:6]:
        print(f"     {f}")
    sys.stdout.flush()

import shutil  # noqa: E402
shutil.rmtree(ROOT, ignore_errors=True)
