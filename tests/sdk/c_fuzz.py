"""Atheris against the C client's decoder (fuzz_decoder.c, built with
-fsanitize=address,undefined): structure-aware INFER replies — mostly
well-framed, with every field near the edges of the client's buffers —
plus the bytes the device writes into output_buf (a descriptor table) and
the printf ring's header.  The run is a child process (the ASan runtime must
be preloaded before Python starts); ``run()`` starts it and returns its
figures.  Used by test_c_fuzz.py (a short run) and benchmarks/fuzz_c.py."""
from __future__ import annotations

import collections
import ctypes
import errno
import hashlib
import json
import os
import re
import struct
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
# fuzz_decoder.c's client
OB_ADDR, OB_SIZE = 0xC0200000, 8192
ST_ADDR, ST_SIZE, KV_SIZE = 0xC0000000, 8192, 4096
PR_ADDR, PR_SIZE = 0xC0100000, 1024
INFER_RESP, INFER_LARGE_RESP = 0x1021, 0x1023
RESP = struct.Struct("<IIIiiQIIQIIIIQ")  # header + INFER_RESP body, 68 bytes
DESC = struct.Struct("<QQiiii6q")
PRINTF_MAGIC = 0x544E5250
# what a reply may earn: success, a framing / size / descriptor refusal, or a device status's errno
ALLOWED = {0, -errno.EPROTO, -errno.EIO, -errno.EINVAL, -errno.ENOMEM, -errno.EBUSY, -errno.ETIME, -errno.EFAULT,
           -errno.ENOSPC, -errno.EOPNOTSUPP, -errno.ENOEXEC, -errno.ENOENT, -errno.EREMOTEIO, -errno.EBADF,
           -errno.EBADMSG, -errno.EDOM}
U64 = (1 << 64) - 1


def _edges(base: int, size: int) -> list[int]:
    return [base - 1, base, base + 1, base + size - 80, base + size - 1, base + size, base + size + 1]


ADDRS = (_edges(OB_ADDR, OB_SIZE) + _edges(ST_ADDR + ST_SIZE - KV_SIZE, KV_SIZE) + _edges(ST_ADDR, ST_SIZE)
         + [PR_ADDR, 0, U64, U64 - 7, 1 << 63])
SIZES = [0, 1, 2, 4, 8, 64, 80, 4096, KV_SIZE, OB_SIZE - 1, OB_SIZE, OB_SIZE + 1, 1 << 31, 1 << 32, 1 << 63, U64]
DTYPES = [(0, 8), (0, 16), (0, 32), (0, 64), (1, 8), (2, 16), (2, 32), (2, 64), (2, 8), (0, 12), (3, 32), (-1, 32)]


def _pick(fdp, values):
    return values[fdp.ConsumeIntInRange(0, len(values) - 1)]


def _number(fdp, values, bits: int = 64) -> int:
    """An edge value, an edge value nudged, or any value."""
    k = fdp.ConsumeIntInRange(0, 3)
    if k <= 1:
        return _pick(fdp, values) & ((1 << bits) - 1)
    if k == 2:
        return (_pick(fdp, values) + fdp.ConsumeIntInRange(-64, 64)) & ((1 << bits) - 1)
    return fdp.ConsumeIntInRange(0, (1 << bits) - 1)


def _desc(fdp) -> bytes:
    code, bits = _pick(fdp, DTYPES)
    ndim = fdp.ConsumeIntInRange(-1, 7)
    addr = _number(fdp, ADDRS)
    if fdp.ConsumeBool():  # a well-formed tensor: the shape says its size
        elems = fdp.ConsumeIntInRange(0, 2 * OB_SIZE)
        shape = [elems] + [1] * 5
        ndim = max(1, min(ndim, 6))
        size = elems * max(bits, 0) // 8
        if fdp.ConsumeBool():  # placed where it fits: output_buf or the KV region, else anywhere
            base, room = (OB_ADDR, OB_SIZE) if fdp.ConsumeBool() else (ST_ADDR + ST_SIZE - KV_SIZE, KV_SIZE)
            addr = base + fdp.ConsumeIntInRange(0, max(room - size, 0))
    else:
        shape = [_number(fdp, [0, 1, 2, 64, 1 << 58, 1 << 62, U64]) - (1 << 63) * fdp.ConsumeBool()
                 for _ in range(6)]
        shape = [((s + (1 << 63)) % (1 << 64)) - (1 << 63) for s in shape]
        size = _number(fdp, SIZES)
    return DESC.pack(addr, size, ndim, code, bits, fdp.ConsumeIntInRange(0, 1) * fdp.ConsumeIntInRange(0, 9), *shape)


def one_input(fdp) -> tuple:
    """(datagram, output_buf bytes, ring header, printf_read, max_outputs) from the fuzzer's bytes."""
    rtype = INFER_RESP if fdp.ConsumeIntInRange(0, 9) < 9 else _pick(fdp, [INFER_LARGE_RESP, 0x1001, 0x21, 0])
    status = 0 if fdp.ConsumeIntInRange(0, 4) < 4 else fdp.ConsumeIntInRange(-16, 2) if fdp.ConsumeBool() else \
        fdp.ConsumeIntInRange(-(1 << 31), (1 << 31) - 1)
    inline = fdp.ConsumeIntInRange(0, 6)
    nout = inline if fdp.ConsumeIntInRange(0, 2) < 2 else _number(fdp, [0, 1, 5, 6, 7, 8, 1 << 31, (1 << 32) - 1], 32)
    table = fdp.ConsumeIntInRange(0, 2) == 0
    descs_addr = _number(fdp, ADDRS) if table else 0
    descs_size = (_number(fdp, [80 * nout % (1 << 32), 0, 80, 79, 81, OB_SIZE, (1 << 32) - 1], 32)
                  if table else 0)
    printf_size = 0 if fdp.ConsumeBool() else _number(fdp, [1, PR_SIZE, 1 << 31], 32)
    body = RESP.pack(rtype, 7, 0, status, fdp.ConsumeIntInRange(-(1 << 31), (1 << 31) - 1), 0, nout, printf_size,
                     descs_addr, descs_size, 0, 0, 0, _number(fdp, SIZES))
    data = body + b"".join(_desc(fdp) for _ in range(inline))
    if fdp.ConsumeIntInRange(0, 7) == 7:  # truncated or extended
        data = (data + fdp.ConsumeBytes(fdp.ConsumeIntInRange(0, 600)))[:fdp.ConsumeIntInRange(0, 600)]
    length = len(data) if fdp.ConsumeIntInRange(0, 9) < 9 else _number(fdp, [0, 16, 68, 148, 512, 513], 32)
    data = data[:8] + struct.pack("<I", length) + data[12:] if len(data) >= 12 else data
    ob = b""
    if table and OB_ADDR <= descs_addr < OB_ADDR + OB_SIZE:  # the table where the reply says it is
        ob = bytes(descs_addr - OB_ADDR) + b"".join(_desc(fdp) for _ in range(fdp.ConsumeIntInRange(0, 8)))
    cap = _number(fdp, [17, 16, 0, PR_SIZE, PR_SIZE + 1, 1 << 31], 32)
    ring = struct.pack("<IIII", PRINTF_MAGIC if fdp.ConsumeIntInRange(0, 5) < 5 else fdp.ConsumeInt(4) & 0xFFFFFFFF,
                       _number(fdp, [0, 1, cap - 16, cap - 15, PR_SIZE], 32), cap, 0)
    printf_read = _number(fdp, [0, 1, cap - 16, PR_SIZE], 32)
    return bytes(data), ob, ring, printf_read, fdp.ConsumeIntInRange(0, 9)


class Decoder:
    """fuzz_decoder.so through ctypes."""

    def __init__(self, so: str):
        lib = ctypes.CDLL(so)
        self._fn = lib.dspx_fuzz_decode
        self._fn.argtypes = [ctypes.c_char_p, ctypes.c_size_t, ctypes.c_char_p, ctypes.c_size_t, ctypes.c_char_p,
                             ctypes.c_uint32, ctypes.c_uint32, ctypes.POINTER(ctypes.c_uint32)]
        self._err = lib.dspx_fuzz_error
        self._err.restype = ctypes.c_char_p
        self._got = ctypes.c_uint32()

    def __call__(self, data, ob, ring, printf_read, max_outputs) -> tuple[int, int, str]:
        rc = self._fn(data, len(data), ob, len(ob), ring, printf_read, max_outputs, ctypes.byref(self._got))
        return rc, self._got.value, self._err().decode(errors="replace")


def outcome(rc: int, decoded: int, error: str) -> str:
    """A decoder outcome: the return code, the error's words (numbers dropped), the outputs handed back."""
    words = re.sub(r"0x[0-9a-f]+|-?\d+", "#", error.split(" on INFER")[0])
    return f"{rc} {decoded} {words}"


def child(so: str, runs: int, seed: int, out: str) -> None:
    """The fuzzing process (ASan preloaded): writes its counts to ``out`` after the last input."""
    import atheris

    dec = Decoder(so)
    seen: collections.Counter = collections.Counter()
    bad: list[str] = []
    t0 = time.monotonic()

    def test_one(raw: bytes) -> None:
        # With no coverage feedback libFuzzer keeps no corpus and its inputs stay
        # short; stretch each one deterministically (a crash file still replays).
        fdp = atheris.FuzzedDataProvider(raw + hashlib.shake_128(raw).digest(768))
        rc, decoded, error = dec(*one_input(fdp))
        key = outcome(rc, decoded, error)
        seen[key] += 1
        if rc not in ALLOWED and len(bad) < 20:
            bad.append(key)
        done = sum(seen.values())
        if done == runs or done % 250_000 == 0:  # a long run's progress survives an interrupted one
            Path(out).write_text(json.dumps({"inputs": done, "seconds": round(time.monotonic() - t0, 1),
                                             "outcomes": dict(seen.most_common()), "unexpected": bad}))

    atheris.Setup([sys.argv[0], f"-runs={runs}", f"-seed={seed}", "-max_len=2048", "-len_control=0", "-print_final_stats=1",
                   "-rss_limit_mb=4096"], test_one)
    atheris.Fuzz()


def run(runs: int, seed: int, workdir: Path, python: str = sys.executable, nice: int = 0) -> dict:
    """Build the harness, fuzz ``runs`` inputs in a child process, return its figures."""
    sys.path.insert(0, str(HERE))
    import sanitized

    so = sanitized.build(HERE / "fuzz_decoder.c", Path(workdir) / "fuzz_decoder.so", shared=True)
    out = Path(workdir) / f"fuzz-{seed}.json"
    out.unlink(missing_ok=True)
    env = dict(os.environ, LD_PRELOAD=sanitized.libasan(), PYTHONPATH=os.pathsep.join(sys.path),
               ASAN_OPTIONS="detect_leaks=0:abort_on_error=0:exitcode=97", UBSAN_OPTIONS=sanitized.ENV["UBSAN_OPTIONS"])
    code = f"import sys; sys.path.insert(0, {str(HERE)!r}); import c_fuzz; c_fuzz.child({str(so)!r}, {runs}, {seed}, {str(out)!r})"
    cmd = ([("nice"), "-n", str(nice)] if nice else []) + [python, "-c", code]
    p = subprocess.run(cmd, env=env, capture_output=True, text=True)
    res = json.loads(out.read_text()) if out.exists() else {"inputs": 0, "outcomes": {}, "unexpected": []}
    res["returncode"] = p.returncode
    res["reports"] = sanitized.reports(p.stderr)
    stats = dict(re.findall(r"^stat::(\w+):\s*(\d+)", p.stderr, re.M))
    res["libfuzzer"] = {k: int(v) for k, v in stats.items()}
    cov = re.findall(r"cov: (\d+) ft: (\d+)", p.stderr)
    res["cov"], res["ft"] = (int(cov[-1][0]), int(cov[-1][1])) if cov else (None, None)
    res["stderr_tail"] = p.stderr[-3000:]
    return res
