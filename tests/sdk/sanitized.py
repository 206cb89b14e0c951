"""libdspx's C client built with -fsanitize=address,undefined into one
program or shared object: the library's sources are #included by the test's
own C file (hostile_driver.c, fuzz_decoder.c), so a test reaches the
connection's internals (the stash of kept responses) without an API for
them.  Used by test_c_hostile.py, test_c_fuzz.py and benchmarks/fuzz_c.py."""
from __future__ import annotations

import os
import subprocess
from pathlib import Path

from dspx.sdk import gen_wire, libdspx

HERE = Path(__file__).resolve().parent
SAN = ["-fsanitize=address,undefined", "-fno-sanitize-recover=all", "-fno-omit-frame-pointer", "-g", "-O1"]
# every report is fatal and says so on stderr; leaks too, in a program (not under Python)
ENV = {"ASAN_OPTIONS": "abort_on_error=0:exitcode=97:detect_leaks=1",
       "UBSAN_OPTIONS": "halt_on_error=1:print_stacktrace=1:exitcode=98"}
REPORTS = ("ERROR: AddressSanitizer", "ERROR: LeakSanitizer", "runtime error:")


def build(src: Path, out: Path, shared: bool = False, extra=()) -> Path:
    """Compile ``src`` (which #includes dspx_conn.c and c7x_client.c) sanitized into ``out``
    (``extra``: more compiler flags, e.g. --coverage)."""
    inc = out.parent / "wire"
    gen_wire.write(inc / "dspx_wire.h")
    cmd = [os.environ.get("CC", "cc"), "-std=c11", *SAN, *extra, "-Wall", "-Wextra", "-Werror", "-D_GNU_SOURCE", "-pthread",
           f"-I{inc}", f"-I{libdspx.INCLUDE}", f"-I{libdspx.HOST}", str(src), "-o", str(out)]
    if shared:
        cmd[1:1] = ["-shared", "-fPIC"]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=libdspx.BUILD_TIMEOUT)
    if r.returncode:
        raise libdspx.BuildError(f"{' '.join(cmd)}\n{r.stdout}{r.stderr}")
    return out


def libasan() -> str:
    """The compiler's ASan runtime, to LD_PRELOAD into a Python process that loads a sanitized .so."""
    cc = os.environ.get("CC", "cc")
    return subprocess.run([cc, "-print-file-name=libasan.so"], capture_output=True, text=True,
                          check=True).stdout.strip()


def reports(stderr: str) -> list[str]:
    """The sanitizer reports in a run's stderr."""
    return [line for line in stderr.splitlines() if any(r in line for r in REPORTS)]
