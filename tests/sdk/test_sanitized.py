"""The C code under AddressSanitizer and UndefinedBehaviorSanitizer: the
native-op, IVP and C API tests run again in a pytest subprocess whose C builds
are all sanitized (tests/sdk/sanitize_plugin.py: the DSP runtime shim, the op
libraries and the IVP harness over dspx/ivp.h, libdspx and its programs),
each into its own cache entry.  Zero reports: any report fails the test with
the sanitizer's text.

The native-op and IVP tests load sanitized libraries into the Python process,
so it runs with libasan preloaded and ``detect_leaks=0`` (the interpreter's
own allocations kept until exit would drown a leak report); tests that start
a device process are left out there.  The C API tests load nothing into
Python: their C programs (libdspx, the drivers) link the sanitizers
themselves, with leak detection on; their devices are the plain ones.
``handle_segv=0``: a test's deliberate crash stays the SIGSEGV it expects
(ASan would turn it into a report and exit 1); a stray access still faults
and fails its test."""
from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
HERE = Path(__file__).resolve().parent
CC = shutil.which("gcc") or shutil.which("cc")
#: the C API tests that exercise libdspx's C paths (errors of every call,
#: outputs, staging, KV, tasks in flight, threads, a Python client beside),
#: and all of test_c_client_edges.py (create_input at capacity, c7x::Module::Run
#: shapes at the fit, one past and huge); left out for
#: time: the build / header / wire-layout checks (no C runs), the examples,
#: the tests that compile the wide module (half a minute) or spend their
#: time waiting on the device (bad requests' time-outs, kills)
C_API = ("test_no_device or test_version_mismatch or test_timeouts or test_c_client_outputs_match "
         "or test_staging_is_taken or test_kv_region or test_several_tasks or test_threads_share "
         "or test_ucp_errors or test_c_and_python_clients or test_create_input or test_cxx_module_run_shape")
#: left out of the native-op tests for time: the loader's checks (Python
#: reading ELF files: no C of ours runs) and the 2^24-element softmax (its
#: page-end buffers are mmaps, which ASan does not see into; the IVP
#: page-end tests cover those loads)
NATIVE = ("not (forbidden_import or constructors_and_destructors or cpp_static_object or custom_dt_init "
          "or elf_identity or bad_registration or taken_cmd or documented_export or 2_pow_24)")


def _libasan() -> str | None:
    if CC is None:
        return None
    p = subprocess.run([CC, "-print-file-name=libasan.so"], capture_output=True, text=True)
    path = p.stdout.strip()
    return path if p.returncode == 0 and os.path.isabs(path) and os.path.exists(path) else None


needs_asan = pytest.mark.skipif(_libasan() is None, reason="needs gcc with libasan")
#: how a report starts (ASan, LSan, UBSan)
REPORT = re.compile(r"ERROR: (Address|Leak)Sanitizer|runtime error: |SUMMARY: UndefinedBehaviorSanitizer")


def run_sanitized(tests: list[str], preload: bool, leaks: bool, select: str | None = None) -> str:
    """pytest on ``tests`` with sanitized builds: its output; fails on a
    report.  --capture=sys: what the C code writes to fd 2 (the reports)
    reaches this process even from inside a test."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "src"), str(HERE), env.get("PYTHONPATH", "")])
    # handle_segv=0: the tests' deliberate crashes stay the SIGSEGV they expect
    env["ASAN_OPTIONS"] = f"halt_on_error=1:handle_segv=0:detect_leaks={int(leaks)}"
    env["UBSAN_OPTIONS"] = "halt_on_error=1:print_stacktrace=1"
    env.pop("LD_PRELOAD", None)
    if preload:
        env["LD_PRELOAD"] = _libasan()
    cmd = [sys.executable, "-m", "pytest", "-q", "--capture=sys", "-p", "no:cacheprovider", "-p", "sanitize_plugin",
           "-o", "addopts=", *(["-k", select] if select else []), *tests]
    p = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=1500)
    out = p.stdout + p.stderr
    m = REPORT.search(out)
    assert m is None, f"sanitizer report:\n{out[max(0, m.start() - 2000):m.start() + 8000]}"
    assert p.returncode == 0, out[-8000:]
    assert " passed" in p.stdout and " failed" not in p.stdout, p.stdout[-3000:]
    return p.stdout


@needs_asan
def test_native_ops_and_ivp_under_asan_and_ubsan():
    run_sanitized(["tests/sdk/test_sdk_ivp.py", "tests/sdk/test_native_ops.py"], preload=True, leaks=False,
                  select=NATIVE)


@needs_asan
def test_c_api_under_asan_and_ubsan():
    run_sanitized(["tests/sdk/test_c_api.py", "tests/sdk/test_c_client_edges.py"], preload=False, leaks=True, select=C_API)
