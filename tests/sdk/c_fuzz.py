"""Atheris against the C client's decoder (fuzz_decoder.c, built with
-fsanitize=address,undefined).  Each of libFuzzer's inputs becomes, in C, a
structure-aware INFER reply — mostly well-framed, every field near the edges
of the client's buffers — plus the descriptor table the device wrote into
output_buf and the printf ring's header; the decoder's outcomes are counted
in C.  The run is a child process (the ASan runtime must be preloaded
before Python starts); ``run()`` starts it and returns its figures.  Used
by test_c_fuzz.py (a short run) and benchmarks/fuzz_c.py."""
from __future__ import annotations

import ctypes
import errno
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
# what a reply may earn: success, a framing / size / descriptor refusal (EPROTO), or a device status's errno
ALLOWED = {0, -errno.EPROTO, -errno.EIO, -errno.EINVAL, -errno.ENOMEM, -errno.EBUSY, -errno.ETIME, -errno.EFAULT,
           -errno.ENOSPC, -errno.EOPNOTSUPP, -errno.ENOEXEC, -errno.ENOENT, -errno.EREMOTEIO, -errno.EBADF,
           -errno.EBADMSG, -errno.EDOM}


class Decoder:
    """fuzz_decoder.so through ctypes."""

    def __init__(self, so: str):
        lib = ctypes.CDLL(so)
        self.one = lib.dspx_fuzz_bytes
        self.one.argtypes = [ctypes.c_char_p, ctypes.c_size_t]
        self._outcome = lib.dspx_fuzz_outcome
        self._outcome.restype = ctypes.c_uint64
        self._outcome.argtypes = [ctypes.c_size_t, ctypes.POINTER(ctypes.c_int), ctypes.POINTER(ctypes.c_uint32),
                                  ctypes.POINTER(ctypes.c_char_p)]

    def outcomes(self) -> dict[str, int]:
        """"rc outputs-handed-back error-text" -> count, most frequent first."""
        rc, got, text, out = ctypes.c_int(), ctypes.c_uint32(), ctypes.c_char_p(), {}
        for i in range(1024):
            n = self._outcome(i, ctypes.byref(rc), ctypes.byref(got), ctypes.byref(text))
            if n:
                out[f"{rc.value} {got.value} {text.value.decode(errors='replace')}".rstrip()] = n
        return dict(sorted(out.items(), key=lambda kv: -kv[1]))


def child(so: str, runs: int, seed: int, out: str) -> None:
    """The fuzzing process (ASan preloaded): writes its figures to ``out`` every
    250,000 inputs and after the last."""
    import atheris

    dec = Decoder(so)
    one = dec.one
    state = {"done": 0, "bad": []}
    t0 = time.monotonic()

    def write() -> None:
        Path(out).write_text(json.dumps({"inputs": state["done"], "seconds": round(time.monotonic() - t0, 1),
                                         "outcomes": dec.outcomes(), "unexpected": state["bad"]}))

    def test_one(raw: bytes) -> None:
        rc = one(raw, len(raw))
        if rc not in ALLOWED and len(state["bad"]) < 20:
            state["bad"].append(rc)
        state["done"] += 1
        if state["done"] == runs or state["done"] % 250_000 == 0:
            write()

    atheris.Setup([sys.argv[0], f"-runs={runs}", f"-seed={seed}", "-max_len=1024", "-print_final_stats=1",
                   "-rss_limit_mb=4096", f"-artifact_prefix={Path(out).parent}/"], test_one)
    atheris.Fuzz()


#: the decoder's functions (dspx_conn.c, c7x_client.c, dspx_shape.h) whose line coverage a --coverage run reports
DECODER = ("dspx_check_frame", "dspx_check_size", "dspx_check", "dspx_printf_collect", "decode_outputs", "from_wire",
           "dspx_shape_bytes")


def line_coverage(workdir: Path) -> dict[str, dict]:
    """gcov's lines executed of each DECODER function after a --coverage run in ``workdir``."""
    p = subprocess.run(["gcov", "-f", "-n", "fuzz_decoder.so-fuzz_decoder.gcno"], cwd=workdir, capture_output=True,
                       text=True, timeout=120)
    found = re.findall(r"^Function '(\w+)'\nLines executed:([\d.]+)% of (\d+)", p.stdout, re.M)
    return {name: {"percent": float(pct), "lines": int(n)} for name, pct, n in found if name in DECODER}


def run(runs: int, seed: int, workdir: Path, python: str = sys.executable, nice: int = 0,
        coverage: bool = False) -> dict:
    """Build the harness, fuzz ``runs`` inputs in a child process, return its figures
    (``coverage``: built with --coverage, and gcov's line coverage of the decoder)."""
    sys.path.insert(0, str(HERE))
    import sanitized

    Path(workdir).mkdir(parents=True, exist_ok=True)
    so = sanitized.build(HERE / "fuzz_decoder.c", Path(workdir) / "fuzz_decoder.so", shared=True,
                         extra=("--coverage",) if coverage else ())
    out = Path(workdir) / f"fuzz-{seed}.json"
    out.unlink(missing_ok=True)
    env = dict(os.environ, LD_PRELOAD=sanitized.libasan(), PYTHONPATH=os.pathsep.join(sys.path),
               ASAN_OPTIONS="detect_leaks=0:abort_on_error=0:exitcode=97", UBSAN_OPTIONS=sanitized.ENV["UBSAN_OPTIONS"])
    code = (f"import sys; sys.path.insert(0, {str(HERE)!r}); import c_fuzz; "
            f"c_fuzz.child({str(so)!r}, {runs}, {seed}, {str(out)!r})")
    cmd = (["nice", "-n", str(nice)] if nice else []) + [python, "-c", code]
    p = subprocess.run(cmd, env=env, capture_output=True, text=True)
    res = json.loads(out.read_text()) if out.exists() else {"inputs": 0, "outcomes": {}, "unexpected": []}
    res["returncode"] = p.returncode
    res["reports"] = sanitized.reports(p.stderr)
    res["libfuzzer"] = {k: int(v) for k, v in re.findall(r"^stat::(\w+):\s*(\d+)", p.stderr, re.M)}
    res["stderr_tail"] = p.stderr[-3000:]
    if coverage:
        res["line_coverage"] = line_coverage(Path(workdir))
    return res
