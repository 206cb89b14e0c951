"""libdspx, the C/C++ host library, against real device processes: every C
call's errors (no device, version mismatch, ERR_ADDR, ERR_HANDLE, capacity
EFBIG / ERR_SIZE with result_required, timeouts), C and Python clients at
once and isolated, a C client killed mid-INFER, the seed's softmax host
program and the C++ ResNet-18 example (against numpy / onnxruntime), and
the generated wire header against offsets written out by hand from
docs/protocol.md.  C and C++ are compiled with the system compilers into
pytest's tmp_path; every subprocess runs under a timeout."""
from __future__ import annotations

import errno
import io
import json
import os
import signal
import socket
import subprocess
import threading
import time
from pathlib import Path

import numpy as np
import onnxruntime as ort
import pytest
from elftools.elf.elffile import ELFFile

from dspx import cache
from dspx.abi import protocol as P
from dspx.compiler.examples import random_inputs
from dspx.sdk import libdspx

from conftest import SMALL, Device

ROOT = Path(__file__).resolve().parents[2]
RUN_TIMEOUT = 120
TOL = 1e-4


# ---------------------------------------------------------------- helpers
class Result(dict):
    """``key value`` lines of a driver run (last value wins; ``all(key)`` lists them)."""

    def __init__(self, proc: subprocess.CompletedProcess):
        super().__init__()
        self.proc = proc
        self._all: dict[str, list[str]] = {}
        for line in proc.stdout.splitlines():
            k, _, v = line.partition(" ")
            self[k] = v
            self._all.setdefault(k, []).append(v)

    def all(self, key: str) -> list[str]:
        return self._all.get(key, [])

    def rc(self, key: str) -> int:
        return int(self[f"{key}_rc"])


def run(binary, *args, socket_path: str | None = None, timeout: float = RUN_TIMEOUT, env=None, cwd=None) -> Result:
    e = dict(os.environ)
    e.pop("DSPX_SOCKET", None)
    if socket_path is not None:
        e["DSPX_SOCKET"] = str(socket_path)
    e.update(env or {})
    proc = subprocess.run([str(binary), *map(str, args)], capture_output=True, text=True, timeout=timeout, env=e,
                          cwd=cwd)
    return Result(proc)


def compile_src(tmp: Path, name: str, text: str, **kw) -> Path:
    src = tmp / name
    src.write_text(text)
    return libdspx.compile_program([src], tmp / src.stem, **kw)


def _align(n: int, a: int) -> int:
    return (n + a - 1) // a * a


def softmax(x):
    e = np.exp(x - x.max())
    return e / e.sum()


def spec(path: Path, a: np.ndarray) -> str:
    """A driver tensor argument: CODE.BITS:SHAPE:PATH."""
    code, bits = P.DType.code_bits(a.dtype.name)
    a.tofile(path)
    return f"{code}.{bits}:{'x'.join(map(str, a.shape)) or '1'}:{path}"


def read_out(path: Path, text: str) -> np.ndarray:
    dt, _, shape = text.partition(" ")
    code, bits = map(int, dt.split("."))
    return np.fromfile(path, P.DType.name(code, bits)).reshape([int(s) for s in shape.split("x")] if shape else [])


def _ort(onnx_path, meta, inputs):
    so = ort.SessionOptions()
    so.intra_op_num_threads = 1
    sess = ort.InferenceSession(str(onnx_path), so, providers=["CPUExecutionProvider"])
    return sess.run(None, {t["name"]: a for t, a in zip(meta["inputs"], inputs)})


def _dynstr_rename(so: bytes, old: str, new: str) -> bytes:
    assert len(old) == len(new)
    sec = ELFFile(io.BytesIO(so)).get_section_by_name(".dynstr")
    a, b = sec["sh_offset"], sec["sh_offset"] + sec["sh_size"]
    key = b"\0" + old.encode() + b"\0"
    assert key in so[a:b], old
    return so[:a] + so[a:b].replace(key, b"\0" + new.encode() + b"\0") + so[b:]


# ---------------------------------------------------------------- fixtures
@pytest.fixture(scope="session")
def sdk() -> Path:
    return libdspx.build()


@pytest.fixture(scope="session")
def driver(sdk, tmp_path_factory) -> Path:
    return compile_src(tmp_path_factory.mktemp("driver"), "driver.c", DRIVER, extra=("-lm", "-pthread"))


@pytest.fixture(scope="module")
def dev2():
    """A small device with two DSP cores (the seed's flow names core 0)."""
    d = Device("--cores", "2", *SMALL)
    yield d
    d.stop()




WIDE_IN, WIDE_OUT = 384, 74240  # io_meta: 128 + 256 | 256 + 256 + 24576 + 49152


@pytest.fixture(scope="module")
def wide_bare(tmp_path_factory, compiled, device_verifier) -> Path:
    """The wide module with its io_meta symbol renamed away: no declaration."""
    from dspx.compiler import examples
    from dspx.compiler.onnx import compile_onnx

    d = tmp_path_factory.mktemp("wide")
    compile_onnx(examples.wide(d / "wide.onnx"), d / "out", kernels=False, progress=False, verifier=device_verifier)
    bare = d / "bare"
    bare.mkdir()
    so = _dynstr_rename((d / "out" / "model.so").read_bytes(), "_binary_tvm_dsp_io_meta_start",
                        "_binary_tvm_dsp_io_meta_stArt")
    (bare / "model.so").write_bytes(so)
    return bare / "model.so"


class FakeDevice:
    """A SEQPACKET peer that speaks just enough: PING with a chosen version,
    BUF_ATTACH / SET_PRINTF_BUF answered, and (``silent``) nothing else —
    for the version and timeout paths a real device never takes."""

    _n = 0

    def __init__(self, tmp: Path, version: int = P.VERSION, answer_ping: bool = True, rpc_status: int | None = None):
        self.rpc_status = rpc_status
        self.last_failed = 0
        FakeDevice._n += 1
        self.path = str(tmp / f"fake{FakeDevice._n}.sock")
        self.version, self.answer_ping = version, answer_ping
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self.sock.bind(self.path)
        self.sock.listen(8)
        self.sock.settimeout(0.2)
        self.stop_flag = False
        self.seen: list[str] = []
        self.threads = [threading.Thread(target=self._accept, daemon=True)]
        self.threads[0].start()

    def _accept(self):
        while not self.stop_flag:
            try:
                conn, _ = self.sock.accept()
            except (TimeoutError, socket.timeout):
                continue
            except OSError:
                return
            t = threading.Thread(target=self._serve, args=(conn,), daemon=True)
            t.start()
            self.threads.append(t)

    def _requests(self, conn):
        """(request, the fds it carried) until the peer closes or the device stops."""
        conn.settimeout(0.2)
        while not self.stop_flag:
            try:
                data, fds, _, _ = socket.recv_fds(conn, 1024, 4)
            except (TimeoutError, socket.timeout):
                continue
            except OSError:
                return
            if not data:
                for fd in fds:
                    os.close(fd)
                return
            msg = P.decode(data)
            self.seen.append(msg.NAME)
            yield msg, fds

    def _serve(self, conn):
        addr = 0xC000_0000
        with conn:
            for msg, fds in self._requests(conn):
                for fd in fds:
                    os.close(fd)
                if isinstance(msg, P.Ping) and self.answer_ping:
                    conn.send(P.PingResp(seq=msg.seq, version=self.version).encode())
                elif isinstance(msg, P.BufAttach) and self.answer_ping:
                    conn.send(P.BufAttachResp(seq=msg.seq, dsp_addr=addr, size=msg.size).encode())
                    addr += msg.size
                elif isinstance(msg, P.SetPrintfBuf) and self.answer_ping:
                    conn.send(P.SetPrintfBufResp(seq=msg.seq).encode())
                elif isinstance(msg, P.Rpc) and self.rpc_status is not None:
                    self.last_failed = msg.seq
                    conn.send(P.RpcResp(seq=msg.seq, status=self.rpc_status).encode())
                elif isinstance(msg, P.GetError) and self.rpc_status is not None:
                    conn.send(P.GetErrorResp(seq=msg.seq, error_seq=self.last_failed, error_status=self.rpc_status,
                                             payload=b"task timed out before a core could start it").encode())
                # everything else (RPC, ...) is never answered

    def close(self):
        self.stop_flag = True
        self.sock.close()
        for t in self.threads:
            t.join(2)


@pytest.fixture
def fake(tmp_path):
    made = []

    def make(**kw):
        f = FakeDevice(tmp_path, **kw)
        made.append(f)
        return f

    yield make
    for f in made:
        f.close()


# ================================================================ build, headers, wire layout
def test_build_is_cached_libc_only_and_has_a_pkgconfig(sdk, tmp_path):
    sdk = libdspx.build()
    assert libdspx.build() == sdk and (sdk / ".built").exists()  # idempotent
    assert sdk.is_relative_to(cache.area("sdk")) and not sdk.is_relative_to(ROOT / "src")  # never the package tree
    for f in ("libdspx.so", "libdspx++.so", "dspx.pc", "include/dspx_wire.h"):
        assert (sdk / f).is_file(), f
    needed = subprocess.run(["readelf", "-d", str(sdk / "libdspx.so")], capture_output=True, text=True,
                            timeout=30).stdout
    libs = {line.split("[")[1].rstrip("]") for line in needed.splitlines() if "(NEEDED)" in line}
    assert libs <= {"libc.so.6", "ld-linux-x86-64.so.2"}, libs  # the C library needs libc only
    assert f"-I{sdk}/include" in libdspx.cflags() and "-ldspx" in libdspx.libs() and f"-Wl,-rpath,{sdk}" in libdspx.libs()
    pc = subprocess.run(["pkg-config", "--cflags", "--libs", "dspx"], capture_output=True, text=True, timeout=30,
                        env={**os.environ, "PKG_CONFIG_PATH": str(sdk)})
    assert pc.returncode == 0, pc.stderr
    src = tmp_path / "v.c"
    src.write_text('#include "c7x_client.h"\n#include <stdio.h>\n'
                   'int main(void) { printf("%s\\n", c7x_status_name(DSPX_STATUS_ERR_SIZE)); return 0; }\n')
    cc = subprocess.run(["cc", "-std=c11", str(src), "-o", str(tmp_path / "v"), *pc.stdout.split()],
                        capture_output=True, text=True, timeout=60)
    assert cc.returncode == 0, cc.stderr
    out = subprocess.run([str(tmp_path / "v")], capture_output=True, text=True, timeout=30)
    assert out.stdout.strip() == "ERR_SIZE"
    # a C program does not pull in libstdc++
    needed = subprocess.run(["readelf", "-d", str(tmp_path / "v")], capture_output=True, text=True, timeout=30).stdout
    assert "libstdc++" not in needed and "libdspx.so" in needed


def test_dspx_sdk_cflags_libs_builds_the_examples(sdk, tmp_path):
    """What docs/c-api.md says: `c++ prog.cc $(dspx sdk --cflags --libs)`."""
    import sys

    flags = subprocess.run([str(Path(sys.executable).parent / "dspx"), "sdk", "--cflags", "--libs"],
                           capture_output=True, text=True, timeout=300)
    assert flags.returncode == 0, flags.stderr
    for src in (ROOT / "examples" / "cpp" / "resnet18.cc", ROOT / "examples" / "ucp_c" / "softmax_host.cc"):
        r = subprocess.run(["c++", "-std=c++17", "-Wno-sign-compare", "-Wno-unused-parameter", str(src),
                            *flags.stdout.split(), "-o", str(tmp_path / src.stem)],
                           capture_output=True, text=True, timeout=300)
        assert r.returncode == 0 and not r.stderr, r.stderr


@pytest.mark.parametrize("lang", ["c", "c++"])
def test_every_header_compiles_from_c_and_cxx_pedantic(sdk, tmp_path, lang):
    headers = ["c7x_client.h", "hb_ucp.h", "hb_dsp.h", "dlpack/dlpack.h", "dspx_wire.h"]
    if lang == "c++":
        headers.append("c7x_runtime.h")
    body = "".join(f'#include "{h}"\n' for h in headers) + "int main(void) { return 0; }\n"
    src = tmp_path / ("h.c" if lang == "c" else "h.cc")
    src.write_text(body)
    std = ["-std=c11"] if lang == "c" else ["-std=c++17"]
    r = subprocess.run([("cc" if lang == "c" else "c++"), *std, "-Wall", "-Wextra", "-Wpedantic", "-Werror",
                        *libdspx.cflags().split(), "-c", str(src), "-o", str(tmp_path / "h.o")],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr


# Byte offsets written out by hand from docs/protocol.md (not from protocol.py):
# struct -> (size, [(field, offset, field size, signed)])
DOC_LAYOUT = {
    "header": (16, [("type", 0, 4, 0), ("seq", 4, 4, 0), ("len", 8, 4, 0), ("status", 12, 4, 1)]),
    "tensor_desc": (80, [("data_addr", 0, 8, 0), ("data_size", 8, 8, 0), ("ndim", 16, 4, 1),
                         ("dtype_code", 20, 4, 1), ("dtype_bits", 24, 4, 1), ("reserved", 28, 4, 1),
                         ("shape", 32, 48, 1)]),
    "io_meta": (40, [("magic", 0, 4, 0), ("version", 4, 4, 0), ("num_inputs", 8, 4, 0), ("num_outputs", 12, 4, 0),
                     ("input_bytes", 16, 8, 0), ("output_bytes", 24, 8, 0), ("flags", 32, 4, 0),
                     ("reserved", 36, 4, 0)]),
    "ping": (16, []),
    "ping_resp": (24, [("version", 16, 4, 0), ("uptime_ms", 20, 4, 0)]),
    "get_status_resp": (32, [("version", 16, 4, 0), ("uptime_ms", 20, 4, 0), ("jobs_completed", 24, 4, 0),
                             ("jobs_failed", 28, 4, 0)]),
    "dyn_load": (32, [("elf_size", 16, 4, 0), ("flags", 20, 4, 0)]),
    "dyn_load_resp": (68, [("module_handle", 16, 4, 0), ("text_size", 20, 4, 0), ("data_size", 24, 4, 0),
                           ("oom_requested", 28, 4, 0), ("oom_free", 32, 4, 0), ("oom_total", 36, 4, 0),
                           ("io_input_bytes", 40, 8, 0), ("io_output_bytes", 48, 8, 0), ("io_num_inputs", 56, 4, 0),
                           ("io_num_outputs", 60, 4, 0), ("io_flags", 64, 4, 0)]),
    "dyn_unload": (20, [("module_handle", 16, 4, 0)]),
    "dyn_unload_resp": (16, []),
    "model_load": (32, [("weights_size", 16, 4, 0), ("flags", 20, 4, 0)]),
    "model_load_resp": (36, [("model_id", 16, 4, 0), ("num_constants", 20, 4, 0), ("oom_requested", 24, 4, 0),
                             ("oom_free", 28, 4, 0), ("oom_total", 32, 4, 0)]),
    "model_unload": (20, [("model_id", 16, 4, 0)]),
    "infer": (64, [("module_handle", 16, 4, 0), ("model_id", 20, 4, 0), ("num_inputs", 24, 4, 0), ("flags", 28, 4, 0),
                   ("input_dsp_addr", 32, 8, 0), ("input_size", 40, 8, 0), ("result_dsp_addr", 48, 8, 0),
                   ("result_size", 56, 8, 0)]),
    "infer_large": (80, [("module_handle", 16, 4, 0), ("model_id", 20, 4, 0), ("num_inputs", 24, 4, 0),
                         ("flags", 28, 4, 0), ("descs_addr", 32, 8, 0), ("descs_size", 40, 4, 0),
                         ("reserved", 44, 4, 0), ("input_dsp_addr", 48, 8, 0), ("input_size", 56, 8, 0),
                         ("result_dsp_addr", 64, 8, 0), ("result_size", 72, 8, 0)]),
    "infer_resp": (68, [("return_value", 16, 4, 1), ("cycles", 20, 8, 0), ("num_outputs", 28, 4, 0),
                        ("printf_size", 32, 4, 0), ("descs_addr", 36, 8, 0), ("descs_size", 44, 4, 0),
                        ("oom_requested", 48, 4, 0), ("oom_free", 52, 4, 0), ("oom_total", 56, 4, 0),
                        ("result_required", 60, 8, 0)]),
    "infer_large_resp": (68, [("return_value", 16, 4, 1), ("cycles", 20, 8, 0), ("result_required", 60, 8, 0)]),
    "set_printf_buf": (32, [("printf_dsp_addr", 16, 8, 0), ("printf_size", 24, 4, 0), ("reserved", 28, 4, 0)]),
    "buf_attach": (32, [("size", 16, 8, 0), ("flags", 24, 4, 0), ("kv_size", 28, 4, 0)]),
    "buf_attach_resp": (32, [("dsp_addr", 16, 8, 0), ("size", 24, 8, 0)]),
    "buf_detach": (24, [("dsp_addr", 16, 8, 0)]),
    "rpc": (64, [("cmd", 16, 4, 0), ("core", 20, 4, 1), ("priority", 24, 4, 0), ("timeout_ms", 28, 4, 0),
                 ("input_dsp_addr", 32, 8, 0), ("input_size", 40, 8, 0), ("output_dsp_addr", 48, 8, 0),
                 ("output_size", 56, 8, 0)]),
    "rpc_resp": (40, [("return_value", 16, 4, 1), ("core", 20, 4, 0), ("cycles", 24, 8, 0), ("printf_size", 32, 4, 0),
                      ("queued_us", 36, 4, 0)]),
    "ops_load": (40, [("src_dsp_addr", 16, 8, 0), ("src_size", 24, 8, 0), ("flags", 32, 4, 0),
                      ("reserved", 36, 4, 0)]),
    "ops_load_resp": (28, [("lib_handle", 16, 4, 0), ("num_ops", 20, 4, 0), ("error_line", 24, 4, 1)]),
    "ops_list": (20, [("start", 16, 4, 0)]),
    "ops_list_resp": (24, [("total", 16, 4, 0), ("count", 20, 4, 0)]),
    "op_entry": (48, [("cmd", 0, 4, 0), ("latency_us", 4, 4, 0), ("lib_handle", 8, 4, 0), ("flags", 12, 4, 0),
                      ("name", 16, 32, 1)]),
    "get_error": (16, []),
    "get_error_resp": (24, [("error_seq", 16, 4, 0), ("error_status", 20, 4, 1)]),
    "pool_status_resp": (88, [("ddr_total", 16, 8, 0), ("ddr_used", 24, 8, 0), ("ddr_peak", 32, 8, 0),
                              ("carveout_total", 40, 8, 0), ("carveout_used", 48, 8, 0), ("l2_total", 56, 4, 0),
                              ("l2_used", 60, 4, 0), ("connections", 64, 4, 0), ("modules", 68, 4, 0),
                              ("cores", 72, 4, 0), ("op_count", 76, 4, 0), ("rss_bytes", 80, 8, 0)]),
}
DOC_CODES = {"PING": 0x0001, "GET_STATUS": 0x0003, "DYN_LOAD": 0x0010, "DYN_UNLOAD": 0x0012, "MODEL_LOAD": 0x0020,
             "MODEL_UNLOAD": 0x0022, "INFER": 0x0021, "INFER_LARGE": 0x0023, "SET_PRINTF_BUF": 0x0030,
             "BUF_ATTACH": 0x0040, "BUF_DETACH": 0x0041, "RPC": 0x0050, "OPS_LOAD": 0x0051, "OPS_LIST": 0x0052,
             "GET_ERROR": 0x0060, "POOL_STATUS": 0x0061}
DOC_STATUS = ["SUCCESS", "ERR_GENERIC", "ERR_INVALID", "ERR_NOMEM", "ERR_BUSY", "ERR_TIMEOUT", "ERR_ADDR", "ERR_SIZE",
              "ERR_OP", "ERR_LOAD", "ERR_SYMBOL", "ERR_CALL", "ERR_HANDLE", "ERR_WEIGHTS", "ERR_TENSOR"]


def test_generated_wire_header_matches_protocol_doc(sdk, tmp_path):
    lines = ['#include <stdio.h>', '#include "dspx_wire.h"', '#define SIGNED(T, f) _Generic((((T *)0)->f), int8_t: 1, int16_t: 1, int32_t: 1, int64_t: 1, char: 1, '
             'default: 0)',
             '#define F(T, f) printf(#T " " #f " %zu %zu %d\\n", offsetof(T, f), sizeof(((T *)0)->f), '
             '(int)SIGNED(T, f))', 'int main(void) {']
    for name, (size, fields) in DOC_LAYOUT.items():
        t = f"dspx_wire_{name}_t"
        lines.append(f'    printf("sizeof {t} %zu\\n", sizeof({t}));')
        for f, _, _, _ in fields:
            if f in ("shape", "name"):  # arrays: signedness of the element
                lines.append(f'    printf("{t} {f} %zu %zu %d\\n", offsetof({t}, {f}), sizeof((({t} *)0)->{f}), '
                             f'(int)SIGNED({t}, {f}[0]));')
            else:
                lines.append(f"    F({t}, {f});")
    for n, code in DOC_CODES.items():
        lines.append(f'    printf("code {n} %u %u\\n", DSPX_MSG_{n}, DSPX_MSG_{n}_RESP);')
    for i, n in enumerate(DOC_STATUS):
        lines.append(f'    printf("status {n} %d %s\\n", DSPX_STATUS_{n}, dspx_wire_status_name({-i}));')
    lines += ['    printf("version %u max %u inline %u %u\\n", DSPX_WIRE_VERSION, DSPX_WIRE_MAX_MSG, '
              'DSPX_WIRE_MAX_INLINE_INPUTS, DSPX_WIRE_MAX_INLINE_OUTPUTS);',
              '    printf("flags %u %u %u %u %u\\n", DSPX_WIRE_FLAG_KV_RESIDENT, DSPX_WIRE_REPEAT_MASK, '
              'DSPX_WIRE_INFER_FLAGS_RESERVED, DSPX_WIRE_ATTACH_STAGING, DSPX_WIRE_DYN_LOAD_OP_LIBRARY);',
              '    printf("printf %llu %llu\\n", DSPX_WIRE_PRINTF_MAGIC, DSPX_WIRE_PRINTF_HEADER);',
              '    return 0;', '}']
    exe = compile_src(tmp_path, "layout.c", "\n".join(lines) + "\n")
    out = subprocess.run([str(exe)], capture_output=True, text=True, timeout=30).stdout.splitlines()
    got = {}
    for line in out:
        parts = line.split()
        got[tuple(parts[:2])] = parts[2:]
    for name, (size, fields) in DOC_LAYOUT.items():
        t = f"dspx_wire_{name}_t"
        assert got[("sizeof", t)] == [str(size)], t
        for f, off, fsize, signed in fields:
            assert got[(t, f)] == [str(off), str(fsize), str(signed)], f"{t}.{f}"
    for n, code in DOC_CODES.items():
        assert got[("code", n)] == [str(code), str(code | 0x1000)], n
    for i, n in enumerate(DOC_STATUS):
        assert got[("status", n)] == [str(-i), n]
    assert got[("version", "196608")] == ["max", "512", "inline", "5", "5"]
    assert got[("flags", str(1 << 16))] == ["65535", str(0xFFFC0000), "1", "1"]  # bits 18–31 (16 KV_RESIDENT, 17 PROFILE)
    assert got[("printf", str(0x544E5250))] == ["16"]


# ================================================================ errors of every call
def test_no_device_is_said_clearly(driver, tmp_path):
    missing = tmp_path / "nobody" / "dsp0.sock"
    r = run(driver, "open", socket_path=missing)
    assert r.rc("open") == -errno.ECONNREFUSED
    assert f"no dspx device is listening on {missing}" in r["open_error"]
    assert "starts no device of its own" in r["open_error"] and "dspx serve" in r["open_error"]
    # the per-user default socket when DSPX_SOCKET is not set
    r = run(driver, "open", env={"XDG_RUNTIME_DIR": str(tmp_path)})
    assert r.rc("open") == -errno.ECONNREFUSED
    assert str(tmp_path / f"dspx-{os.getuid()}" / "dsp0.sock") in r["open_error"]
    # the Horizon API's implicit session says the same
    r = run(driver, "ucp_nodev", socket_path=missing)
    assert r.rc("malloc") == -errno.ECONNREFUSED and "dspx serve" in r["malloc_error"]
    assert r["desc"] == os.strerror(errno.ECONNREFUSED)


def test_no_device_hint_suggests_a_serve_that_is_accepted(driver, tmp_path):
    """The `dspx serve --socket` libdspx suggests is one serve accepts (the
    rules of transport.serve_refusal), as the CLI's hint; a socket named in a
    shared directory is looked for in its dspx-<uid>, where serve puts it."""
    import re

    from dspx.transport import serve_refusal

    rt, open_dir, shared = tmp_path / "rt", tmp_path / "open", tmp_path / "shared"
    rt.mkdir(mode=0o700)
    open_dir.mkdir()
    open_dir.chmod(0o777)
    shared.mkdir()
    shared.chmod(0o1777)
    notes = tmp_path / "notes.txt"
    notes.write_bytes(b"mine")
    cases = {tmp_path / "new" / "dsp0.sock": tmp_path / "new" / "dsp0.sock",
             open_dir / "x.sock": rt / f"dspx-{os.getuid()}" / "x.sock",
             notes: rt / f"dspx-{os.getuid()}" / "notes.txt",
             shared / "x.sock": shared / f"dspx-{os.getuid()}" / "x.sock"}
    for given, want in cases.items():
        r = run(driver, "open", socket_path=given, env={"XDG_RUNTIME_DIR": str(rt)})
        assert r.rc("open") == -errno.ECONNREFUSED
        suggested = re.search(r"`dspx serve --socket ([^`]+)`", r["open_error"]).group(1)
        assert suggested == str(want) and serve_refusal(suggested) is None, r["open_error"]
        assert "set DSPX_SOCKET" in r["open_error"]
    assert notes.read_bytes() == b"mine"
    r = run(driver, "open", socket_path=shared / "x.sock")
    assert f"listening on {shared / f'dspx-{os.getuid()}' / 'x.sock'}" in r["open_error"]


def test_version_mismatch_is_refused_at_open(driver, fake):
    f = fake(version=0x040102)
    r = run(driver, "open", socket_path=f.path)
    assert r.rc("open") == -errno.EPROTONOSUPPORT
    assert "protocol major version mismatch: host speaks 3.0.0, device speaks 4.1.2" in r["open_error"]
    assert f.seen == ["PING"]  # nothing attached before the check
    g = fake(version=0x030105)  # same major: accepted
    assert run(driver, "timeout", 10000, socket_path=g.path).rc("open") == 0
    assert g.seen == ["PING", "BUF_ATTACH", "SET_PRINTF_BUF"]  # then the printf ring


def test_timeouts_bound_every_wait(driver, fake, tmp_path):
    f = fake(answer_ping=False)
    r = run(driver, "timeout", 300, socket_path=f.path, timeout=30)
    assert r.rc("open") == -errno.ETIMEDOUT
    assert "no response to PING within 300 ms" in r["open_error"]
    # a task the device never answers: the wait times out, the task stays waitable, and is not released
    g = fake()
    r = run(driver, "ucp_timeout", 200, socket_path=g.path, timeout=30)
    assert r.rc("malloc") == 0 and r.rc("submit") == 0
    assert r.rc("wait") == -errno.ETIMEDOUT and "no response to RPC 0x1402 within 200 ms" in r["wait_error"]
    assert r.rc("wait2") == -errno.ETIMEDOUT
    assert r.rc("release") == -errno.EBUSY and "in flight" in r["release_error"]
    # the device's own ERR_TIMEOUT (a task no core started in time) is -ETIME, with the device's text
    h = fake(rpc_status=P.Status.ERR_TIMEOUT)
    r = run(driver, "ucp_timeout", 5000, socket_path=h.path, timeout=30)
    assert r.rc("wait") == -errno.ETIME and r.rc("wait2") == -errno.ETIME and r.rc("release") == 0
    assert r["wait_error"] == "ERR_TIMEOUT (-5) on RPC 0x1402: task timed out before a core could start it"


def test_handles_and_bad_requests(driver, shared_device, client_of, compiled):
    d = compiled("multi_output")
    py = client_of(shared_device.path)
    theirs = py.load_module((d / "model.so").read_bytes())
    r = run(driver, "handles", d / "model.so", theirs.handle, socket_path=shared_device.path)
    for key, rc, name in [("dyn_unload", -errno.EBADF, "ERR_HANDLE"), ("foreign_unload", -errno.EBADF, "ERR_HANDLE"),
                          ("model_unload", -errno.EBADF, "ERR_HANDLE"),
                          ("infer_bad_handle", -errno.EBADF, "ERR_HANDLE"),
                          ("infer_bad_model", -errno.EBADF, "ERR_HANDLE"),
                          ("infer_bad_flags", -errno.EINVAL, "ERR_INVALID"),
                          ("infer_bad_tensor", -errno.EDOM, "ERR_TENSOR"),
                          ("garbage_load", -errno.ENOEXEC, "ERR_LOAD"),
                          ("unload_again", -errno.EBADF, "ERR_HANDLE")]:
        assert r.rc(key) == rc, (key, r.get(f"{key}_error"))
        assert r[f"{key}_status_name"] == name and int(r[f"{key}_status"]) == P.Status[name]
        # the device's own text, fetched with GET_ERROR
        assert r[f"{key}_error"].startswith(f"{name} ({int(P.Status[name])}) on ") and ": " in r[f"{key}_error"]
    assert "9999" in r["dyn_unload_error"] and str(theirs.handle) in r["foreign_unload_error"]
    assert r.rc("load") == 0 and r.rc("unload") == 0 and r.rc("ping_after") == 0
    assert py.ping()["version"] == "3.0.0"
    py.unload_module(theirs.handle)  # still the Python client's: the C client could not unload it


def test_capacity_efbig_err_size_and_lock(driver, shared_device, wide_bare, tmp_path):
    r = run(driver, "capacity", wide_bare, WIDE_IN, socket_path=shared_device.path, cwd=tmp_path)
    assert r.rc("load") == 0 and r["io_input_bytes"] == r["io_output_bytes"] == "0"
    assert r.rc("infer_unreserved") == -errno.EFBIG and "reserve_io" in r["infer_unreserved_error"]
    assert r.rc("reserve_small") == 0 and int(r["input_capacity"]) >= WIDE_IN
    # input over capacity: EFBIG on the host, nothing sent to the device
    assert r.rc("infer_too_big") == -errno.EFBIG and "(EFBIG)" in r["infer_too_big_error"]
    assert r["jobs_sent_by_efbig"] == "0"
    assert r.rc("create_input_too_big") == -errno.EFBIG
    # output over capacity: the device's ERR_SIZE, result_required stopping at the first tensor that does not fit
    assert r.all("size_rc") == [str(-errno.ENOSPC)] * 2
    assert r.all("size_status_name") == ["ERR_SIZE", "ERR_SIZE"]
    required = [int(x) for x in r.all("required")]
    assert required == [_align(256 + 256 + 96 * 64 * 4, 64), WIDE_OUT] == [int(x) for x in
                                                                            r.all("size_result_required")]
    assert all(f"result_required={n}" in e for n, e in zip(required, r.all("size_error")))
    assert r.all("locked_after_size") == ["0", "0"]  # a failure does not lock: grow and retry
    assert r.all("reserve_retry_rc") == ["0", "0"] and r.all("ping_between_rc") == ["0", "0"]
    assert r.rc("infer_ok") == 0 and r["num_outputs"] == "3" and r["locked"] == "1"
    x = np.arange(64, dtype=np.float32).reshape(1, 64)
    for i, want in enumerate([x * 2, np.broadcast_to(x, (96, 64)), np.broadcast_to(x, (192, 64))]):
        np.testing.assert_array_equal(read_out(tmp_path / f"cap_out{i}.bin", r[f"out{i}"]), want)
    assert r.rc("reserve_locked") == -errno.EPERM and "locked" in r["reserve_locked_error"]
    assert r.rc("unload") == 0


@pytest.mark.parametrize("name,separate", [("multi_input", False), ("multi_output", False), ("multi_output", True)])
def test_c_client_outputs_match_onnxruntime(driver, shared_device, compiled, example_onnx, tmp_path, name, separate):
    """multi_input: 7 inputs travel as INFER_LARGE; multi_output: 7 output
    descriptors come back through output_buf; separate weights: MODEL_LOAD."""
    d = compiled(name, separate=separate)
    meta = json.loads((d / "metadata.json").read_text())
    x = random_inputs(meta)
    specs = [spec(tmp_path / f"in{i}.bin", a) for i, a in enumerate(x)]
    weights = d / meta["weights"]["file"] if separate else "-"
    r = run(driver, "infer", d / "model.so", weights, tmp_path / "out", *specs, socket_path=shared_device.path)
    assert r.rc("load") == 0 and r.rc("infer") == 0, r.proc.stdout + r.proc.stderr
    if separate:
        assert r.rc("weights") == 0 and r.rc("model_unload") == 0
    assert int(r["input_data_offset"]) == _align(80 * len(x), 64)
    ref = _ort(example_onnx[name], meta, x)
    assert int(r["num_outputs"]) == len(ref) == len(meta["outputs"])
    for i, (want, m) in enumerate(zip(ref, meta["outputs"])):
        got = read_out(tmp_path / f"out{i}.bin", r[f"out{i}"])
        assert got.shape == want.shape == tuple(m["shape"]) and got.dtype == want.dtype, m["name"]
        np.testing.assert_allclose(got, want, rtol=0, atol=TOL, err_msg=m["name"])
    assert r.rc("create_input") == 0 and r.rc("infer_zero_copy") == 0 and r["zero_copy_same"] == "1"
    assert int(r["cycles"]) > 0 and r.rc("unload") == 0


def test_a_bigger_load_grows_io_buffers_after_the_lock(driver, shared_device, compiled):
    """As the Python client: only reserve_io is refused once locked; a later
    load that declares more grows the buffers, and an earlier create_input
    tensor is still valid memory, copied into the new input_buf."""
    small, big = compiled("multi_output") / "model.so", compiled("resnet18", kernels=True) / "model.so"
    r = run(driver, "grow_after_lock", small, big, socket_path=shared_device.path)
    assert r.rc("load_a") == 0 and r.rc("create_input") == 0 and r.rc("infer_a") == 0 and r["locked"] == "1"
    assert r.rc("load_b") == 0
    assert int(r["input_after"]) >= int(r["big_in"]) > int(r["input_before"])
    assert int(r["output_after"]) >= int(r["big_out"])
    assert r["kept"] == "1" and r.rc("infer_a_again") == 0 and r["same"] == "1"
    assert r.rc("reserve_locked") == -errno.EPERM


def test_staging_is_taken_on_first_need_and_grows(driver, shared_device, compiled, client_of):
    small, big = compiled("multi_input") / "model.so", compiled("multi_output") / "model.so"
    assert small.stat().st_size < big.stat().st_size
    r = run(driver, "two_loads", small, big, socket_path=shared_device.path)
    assert r.rc("load_a") == 0 and r.rc("load_b") == 0 and r.rc("unload_a") == 0 and r.rc("unload_b") == 0
    u0, u1, u2 = map(int, r["used"].split())
    kv = 1 << 16
    # open attached only the printf ring; the first load a staging area sized to it (+ KV region) and io buffers
    assert u1 - u0 >= _align(small.stat().st_size, 4096) + kv
    assert u2 > u1 and int(r["modules"]) >= 2  # replaced by a bigger one; both modules loaded


def test_kv_region_inputs_and_kv_resident_outputs(driver, shared_device, compiled, example_onnx, tmp_path):
    d = compiled("multi_output")
    meta = json.loads((d / "metadata.json").read_text())
    x = random_inputs(meta, seed=7)
    r = run(driver, "kv", d / "model.so", spec(tmp_path / "x.bin", x[0]), tmp_path / "kv",
            socket_path=shared_device.path)
    assert r.rc("load") == 0 and r.rc("kv") == 0 and int(r["kv_size"]) == 1 << 16
    assert r.rc("infer_kv_input") == 0 and r.rc("infer_kv_resident") == 0, r.proc.stdout
    ref = _ort(example_onnx["multi_output"], meta, x)
    # KV_RESIDENT: only the first output reaches output_buf; the others are
    # packed 64-byte aligned from the KV region's base (docs/protocol.md)
    assert int(r["num_outputs"]) == 1
    np.testing.assert_allclose(read_out(tmp_path / "kv0.bin", r["out0"]), ref[0], rtol=0, atol=TOL)
    region = (tmp_path / "kvkv.bin").read_bytes()
    off = 0
    for want in ref[1:]:
        got = np.frombuffer(region, want.dtype, want.size, off).reshape(want.shape)
        np.testing.assert_allclose(got, want, rtol=0, atol=TOL)
        off = _align(off + want.nbytes, 64)


def test_cxx_module_errors_are_typed(sdk, shared_device, wide_bare, tmp_path):
    exe = compile_src(tmp_path, "cpp_errors.cc", CPP_ERRORS)
    r = run(exe, wide_bare, WIDE_IN, socket_path=shared_device.path)
    assert r.proc.returncode == 0, r.proc.stderr
    assert int(r["missing_code"]) == -errno.ENOENT and "no compiled module" in r["missing_what"]
    assert int(r["run_unloaded_code"]) == -errno.EINVAL
    assert r["unreserved_name"] == "EFBIG" and int(r["unreserved_code"]) == -errno.EFBIG
    assert r.all("size_name") == ["ERR_SIZE", "ERR_SIZE"] and r.all("size_status") == ["-7", "-7"]
    assert [int(x) for x in r.all("size_required")] == [_align(256 + 256 + 96 * 64 * 4, 64), WIDE_OUT]
    assert all(w.startswith("c7x::Module::Run: ERR_SIZE (-7) on INFER: ") for w in r.all("size_what"))
    assert r["unreserved_what"].startswith("c7x::Module::Run: EFBIG (-27): ")
    assert r["ok_outputs"] == "3"
    assert r["out0_shape"] == "1x64 first 0 last 126"
    assert r["out2_shape"] == "192x64 first 0 last 63"
    assert r["locked_name"] == "EPERM" and "locked" in r["locked_what"]
    assert int(r["strided_code"]) == -errno.EINVAL and "row-major" in r["strided_what"]
    assert r["nodev_name"] == "ECONNREFUSED" and "no dspx device is listening" in r["nodev_what"]


def test_load_out_of_ddr_pool_names_the_numbers(driver, compiled):
    d = compiled("resnet18", kernels=True)
    dev = Device("--carveout-size", "128M", "--ddr-pool-size", "16M")
    try:
        r = run(driver, "load", d / "model.so", socket_path=dev.path)
    finally:
        dev.stop()
    assert r.rc("load") == -errno.ENOMEM and r["load_status_name"] == "ERR_NOMEM"
    requested, free, total = map(int, r["load_oom"].split())
    assert total == 16 << 20 and requested > free and free <= total
    assert r.rc("missing_file") == -errno.ENOENT and "/nonexistent/model.so" in r["missing_file_error"]
    assert r.rc("ping_after") == 0


def test_c7x_compute_cli_runs_a_module_and_says_json(sdk, shared_device, compiled, example_onnx, tmp_path):
    """The TI-shaped CLI built on the libraries: load + infer + unload in one connection."""
    cli = libdspx.cli_path()
    d = compiled("multi_input")
    meta = json.loads((d / "metadata.json").read_text())
    x = random_inputs(meta, seed=5)
    args = []
    for i, a in enumerate(x):
        a.tofile(tmp_path / f"x{i}.bin")
        args += ["--input", tmp_path / f"x{i}.bin"]
    r = run(cli, "--socket", shared_device.path, "run", d, *args, "--output", tmp_path / "y")
    assert r.proc.returncode == 0, r.proc.stdout + r.proc.stderr
    res = json.loads(r.proc.stdout)
    ref = _ort(example_onnx["multi_input"], meta, x)
    assert [o["shape"] for o in res["outputs"]] == [list(a.shape) for a in ref] and res["cycles"] > 0
    for o, want in zip(res["outputs"], ref):
        np.testing.assert_allclose(np.fromfile(o["file"], o["dtype"]).reshape(want.shape), want, rtol=0, atol=TOL)
    st = json.loads(run(cli, "status", socket_path=shared_device.path).proc.stdout)
    assert st["version"] == "3.0.0" and st["cores"] >= 1
    ping = json.loads(run(cli, "ping", "--count", "20", socket_path=shared_device.path).proc.stdout)
    assert ping["count"] == 20 and ping["median_us"] > 0
    bad = run(cli, "run", d, "--input", tmp_path / "x0.bin", socket_path=shared_device.path)
    assert bad.proc.returncode == 1 and "takes 7 inputs, got 1" in json.loads(bad.proc.stdout)["error"]
    # c7x::Module with a separate weights file (MODEL_LOAD) and 7 outputs (descriptors through output_buf)
    d = compiled("multi_output", separate=True)
    meta = json.loads((d / "metadata.json").read_text())
    assert meta["weights"]["file"]
    x = random_inputs(meta, seed=6)
    x[0].tofile(tmp_path / "m.bin")
    r = run(cli, "run", d, "--input", tmp_path / "m.bin", "--output", tmp_path / "m", socket_path=shared_device.path)
    assert r.proc.returncode == 0, r.proc.stdout + r.proc.stderr
    res = json.loads(r.proc.stdout)
    ref = _ort(example_onnx["multi_output"], meta, x)
    assert [o["name"] for o in res["outputs"]] == [m["name"] for m in meta["outputs"]]
    for o, want in zip(res["outputs"], ref):
        np.testing.assert_allclose(np.fromfile(o["file"], o["dtype"]).reshape(want.shape), want, rtol=0, atol=TOL)
    nodev = run(cli, "ping", socket_path=tmp_path / "none.sock")
    assert nodev.proc.returncode == 1 and json.loads(nodev.proc.stdout)["code"] == -errno.ECONNREFUSED


# ================================================================ the UCP flow
def test_seed_softmax_host_program(tmp_path):
    """examples/ucp_c/softmax_host.cc — the seed's test_softmax_op unchanged —
    against `dspx serve --cores 2` on the per-user socket, found with no
    configuration (XDG_RUNTIME_DIR points into tmp_path for both)."""
    import sys

    from dspx.transport import is_listening

    src = ROOT / "examples" / "ucp_c" / "softmax_host.cc"
    # the seed's own code draws exactly these two warnings (no others)
    r = subprocess.run(["c++", "-std=c++17", "-Wall", "-Wextra", *libdspx.cflags().split(), "-fsyntax-only", str(src)],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0
    kinds = {line.rsplit("[", 1)[1].rstrip("]") for line in r.stderr.splitlines() if "warning:" in line}
    assert kinds == {"-Wsign-compare", "-Wunused-parameter"}, r.stderr
    exe = libdspx.compile_program([src], tmp_path / "softmax_host", extra=("-Wno-sign-compare", "-Wno-unused-parameter"))
    env = {**os.environ, "XDG_RUNTIME_DIR": str(tmp_path)}
    env.pop("DSPX_SOCKET", None)
    sock = tmp_path / f"dspx-{os.getuid()}" / "dsp0.sock"
    dspx_cli = Path(sys.executable).parent / "dspx"
    log = open(tmp_path / "serve.log", "w+b")
    serve = subprocess.Popen([str(dspx_cli), "serve", "--cores", "2", "--carveout-size", "64M", "--ddr-pool-size",
                              "64M"], env=env, stdout=log, stderr=log)
    try:
        deadline = time.monotonic() + 60
        while not is_listening(str(sock)):
            assert serve.poll() is None and time.monotonic() < deadline, (tmp_path / "serve.log").read_text()
            time.sleep(0.02)
        out = run(exe, env={"XDG_RUNTIME_DIR": str(tmp_path)})
    finally:
        serve.terminate()
        try:
            serve.wait(10)
        except subprocess.TimeoutExpired:
            serve.kill()
            serve.wait(10)
        log.close()
    assert out.proc.returncode == 0, out.proc.stdout + out.proc.stderr
    assert "[I] opt vs non-opt result is same" in out.proc.stdout.splitlines()
    assert "opt vs non-opt result is diff" not in out.proc.stdout + out.proc.stderr
    assert "softmax op finish" in out.proc.stdout
    # the DSP's printf (both implementations) reached the host's stderr
    assert "find softmax ddr tcm is" in out.proc.stderr and "find softmax ping-pong tcm is" in out.proc.stderr


@pytest.mark.parametrize("any_core", [0, 1])
def test_several_tasks_in_flight_on_chosen_cores(driver, dev2, tmp_path, any_core):
    n, size = 6, 5000
    r = run(driver, "ucp_tasks", n, size, tmp_path / "t", any_core, socket_path=dev2.path)
    assert r.proc.returncode == 0, r.proc.stderr
    assert r.all("submit_rc") == ["0"] * n
    assert r.rc("release_in_flight") == -errno.EBUSY
    for i in range(n):
        assert r[f"task{i}_rc"] == "0" and r[f"task{i}_rv"] == "0"
        core = int(r[f"task{i}_core"])
        assert core == (i % 2) if not any_core else core in (0, 1)
        x = ((np.arange(size) * 37 + i * 11) % 101).astype(np.float32) / np.float32(17.0) - np.float32(3.0)
        got = np.fromfile(tmp_path / f"t{i}.bin", np.float32)
        np.testing.assert_allclose(got, softmax(x.astype(np.float64)), rtol=1e-5, atol=1e-9)
    assert r.all("wait_again_rc") == ["0"] * n and r.all("release_rc") == ["0"] * n
    assert r.rc("resubmit_released") == -errno.EINVAL
    assert r.all("free_rc") == ["0"] * n and r.rc("free_twice") == -errno.EFAULT


def test_threads_share_the_session_with_tasks_in_flight(driver, dev2):
    r = run(driver, "ucp_threads", 4, 3, 4000, socket_path=dev2.path)
    assert r.proc.returncode == 0, r.proc.stderr
    assert r["bad"] == "0", r.get("last_error")
    assert float(r["worst_rel_err"]) < 1e-5


def test_ucp_errors_and_isolation_from_a_python_client(driver, dev2, client_of):
    from dspx.host.tasks import Tasks, softmax_param

    py = client_of(dev2.path)
    secret = py.alloc(4096, "py-secret")
    secret.mm[:8] = b"PYTHON!!"
    r = run(driver, "ucp_errors", hex(secret.dsp_addr), socket_path=dev2.path)
    assert r.rc("bad_priority") == -errno.EINVAL and "priority 300" in r["bad_priority_error"]
    assert r.rc("bad_backend") == -errno.EINVAL
    assert r.rc("missing_core_submit") == 0 and r.rc("missing_core_wait") == -errno.EINVAL
    assert "ERR_INVALID" in r["missing_core_wait_error"]
    assert r.rc("addr") == -errno.EFAULT and "ERR_ADDR" in r["addr_error"]
    # the C client names the Python client's buffer: refused, nothing read or written there
    assert r.rc("foreign") != 0 and r["foreign_error"], r["foreign_error"]
    assert "ERR_ADDR" in r["foreign_error"] or int(r["foreign_rv"]) != 0
    assert bytes(secret.mm[:8]) == b"PYTHON!!"
    assert r.rc("unknown_cmd") == -errno.EOPNOTSUPP and "ERR_OP" in r["unknown_cmd_error"]
    assert r.rc("rpc_not_ours") == -errno.EFAULT
    assert r.rc("flush_clean") == 0 and r.rc("flush_bad") == -errno.EINVAL and r.rc("malloc_zero") == -errno.EINVAL
    assert r.rc("after") == 0
    # and the Python client still works beside it
    with Tasks(py) as ucp:
        data, param, out = ucp.malloc(4 * 1000), ucp.malloc(24), ucp.malloc(4 * 1000)
        x = np.linspace(-2, 2, 1000, dtype=np.float32)
        data.view(np.float32)[:] = x
        softmax_param(param, data, 1000, tiled=True)
        ucp.run(0x1402, param, out, core=1)
        np.testing.assert_allclose(out.view(np.float32), softmax(x.astype(np.float64)), rtol=1e-5)


def test_c_and_python_clients_at_once(driver, dev2, client_of, tmp_path):
    """A C process and this Python process run softmax tasks on the same
    device at the same time; each gets its own right answers."""
    from dspx.host.tasks import Tasks, softmax_param

    e = {**os.environ, "DSPX_SOCKET": dev2.path}
    proc = subprocess.Popen([str(driver), "ucp_tasks", "8", "20000", str(tmp_path / "c"), "1"], env=e,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        py = client_of(dev2.path)
        with Tasks(py) as ucp:
            for k in range(6):
                n = 3000 + 100 * k
                data, param, out = ucp.malloc(4 * n), ucp.malloc(24), ucp.malloc(4 * n)
                x = np.cos(np.arange(n, dtype=np.float32) * (k + 1) / 7).astype(np.float32)
                data.view(np.float32)[:] = x
                softmax_param(param, data, n, tiled=bool(k & 1))
                ucp.run(0x1402, param, out, core=k % 2)
                np.testing.assert_allclose(out.view(np.float32), softmax(x.astype(np.float64)), rtol=1e-5)
        stdout, stderr = proc.communicate(timeout=RUN_TIMEOUT)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
    assert proc.returncode == 0, stderr
    res = Result(subprocess.CompletedProcess(proc.args, proc.returncode, stdout, stderr))
    for i in range(8):
        assert res[f"task{i}_rc"] == "0"
        x = ((np.arange(20000) * 37 + i * 11) % 101).astype(np.float32) / np.float32(17.0) - np.float32(3.0)
        np.testing.assert_allclose(np.fromfile(tmp_path / f"c{i}.bin", np.float32), softmax(x.astype(np.float64)),
                                   rtol=1e-5, atol=1e-9)


# ================================================================ a C client killed mid-INFER
def _settled(c, want: dict, timeout: float = 30.0) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        p = c.pools()
        if all(p[k] == v for k, v in want.items()) or time.monotonic() > deadline:
            return p
        time.sleep(0.05)


def test_c_client_killed_mid_infer_leaves_nothing(driver, compiled, tmp_path, client_of):
    dev = Device("--carveout-size", "256M", "--ddr-pool-size", "128M")
    try:
        py = client_of(dev.path, staging_size=0, printf_size=0)
        base = py.pools()
        d = compiled("resnet18", kernels=True)
        x = np.random.default_rng(1).standard_normal((1, 3, 224, 224)).astype(np.float32)
        e = {**os.environ, "DSPX_SOCKET": dev.path}
        proc = subprocess.Popen([str(driver), "hang", str(d / "model.so"), spec(tmp_path / "x.bin", x), "200"],
                                env=e, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        try:
            lines = []
            deadline = time.monotonic() + RUN_TIMEOUT
            while time.monotonic() < deadline:
                line = proc.stdout.readline()
                if not line:
                    break
                lines.append(line)
                if line.strip() == "READY":
                    break
            assert lines and lines[-1].strip() == "READY", "".join(lines) + proc.stderr.read()
            assert "load_rc 0\n" in lines and "warm_rc 0\n" in lines
            busy = py.pools()
            assert busy["connections"] == base["connections"] + 1 and busy["modules"] == base["modules"] + 1
            time.sleep(0.3)  # the 200-run INFER is on the core now
            assert proc.poll() is None
            proc.send_signal(signal.SIGKILL)
            proc.wait(10)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait(10)
        keys = ("connections", "modules", "carveout_used", "ddr_used")
        after = _settled(py, {k: base[k] for k in keys})
        assert {k: after[k] for k in keys} == {k: base[k] for k in keys}
        assert dev.alive() and py.ping()["version"] == "3.0.0"
    finally:
        dev.stop()


def test_device_killed_mid_infer_gives_a_clear_error(driver, compiled, tmp_path):
    dev = Device("--carveout-size", "256M", "--ddr-pool-size", "128M")
    d = compiled("resnet18", kernels=True)
    x = np.zeros((1, 3, 224, 224), np.float32)
    e = {**os.environ, "DSPX_SOCKET": dev.path}
    proc = subprocess.Popen([str(driver), "hang", str(d / "model.so"), spec(tmp_path / "x.bin", x), "200"],
                            env=e, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        line = ""
        deadline = time.monotonic() + RUN_TIMEOUT
        while line.strip() != "READY" and time.monotonic() < deadline:
            line = proc.stdout.readline()
            if not line:
                break
        assert line.strip() == "READY", proc.stderr.read()
        time.sleep(0.3)
        dev.proc.kill()  # the front dies; its cores follow
        out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
        dev.stop()
    res = Result(subprocess.CompletedProcess(proc.args, proc.returncode, out, err))
    assert res.rc("long_infer") == -errno.ECONNRESET
    assert "the device closed the connection" in res["long_infer_error"]


# ================================================================ C++: c7x::Module on ResNet-18
def test_cxx_resnet18_example_matches_onnxruntime(sdk, compiled, example_onnx, tmp_path):
    d = compiled("resnet18", kernels=True)
    meta = json.loads((d / "metadata.json").read_text())
    exe = libdspx.compile_program([ROOT / "examples" / "cpp" / "resnet18.cc"], tmp_path / "resnet18")
    x = random_inputs(meta, seed=3)[0]
    x.tofile(tmp_path / "x.bin")
    dev = Device("--carveout-size", "256M", "--ddr-pool-size", "128M")
    try:
        r = run(exe, d, tmp_path / "x.bin", tmp_path / "y.bin", socket_path=dev.path)
    finally:
        dev.stop()
    assert r.proc.returncode == 0, r.proc.stdout + r.proc.stderr
    ref = _ort(example_onnx["resnet18"], meta, [x])[0]
    y = np.fromfile(tmp_path / "y.bin", np.float32).reshape(ref.shape)
    np.testing.assert_allclose(y, ref, rtol=0, atol=TOL)
    assert "output logits shape [1, 1000]" in r.proc.stdout
    top = [int(t.split(" ")[0]) for t in r.proc.stdout.split("top-5: ")[1].strip().split(") ")]
    assert top == list(np.argsort(-ref[0])[:5])


# ================================================================ C sources of the test programs
DRIVER = r'''/* A test driver over the libdspx C API: one subcommand per scenario; prints
 * "key value" lines the pytest side parses. */
#define _GNU_SOURCE
#include <errno.h>
#include <math.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "c7x_client.h"
#include "hb_dsp.h"
#include "hb_ucp.h"

static long long now_ms(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (long long)ts.tv_sec * 1000 + ts.tv_nsec / 1000000;
}

static void report(const char *key, int rc, c7x_client_t *c) {
    printf("%s_rc %d\n", key, rc);
    if (c) {
        int32_t st = c7x_client_last_status(c);
        printf("%s_status %d\n", key, (int)st);
        printf("%s_status_name %s\n", key, st ? c7x_status_name(st) : "-");
        printf("%s_error %s\n", key, c7x_client_last_error(c));
        printf("%s_result_required %llu\n", key, (unsigned long long)c7x_client_result_required(c));
        uint32_t rq, fr, tot;
        c7x_client_last_oom(c, &rq, &fr, &tot);
        printf("%s_oom %u %u %u\n", key, rq, fr, tot);
    }
    fflush(stdout);
}

static c7x_client_t *open_or_die(int timeout_ms) {
    c7x_client_opts_t o = C7X_CLIENT_OPTS_INIT;
    o.timeout_ms = timeout_ms;
    o.kv_size = 1 << 16;
    c7x_client_t *c = NULL;
    int rc = c7x_client_open_ex(&c, &o);
    if (rc) {
        printf("open_rc %d\nopen_error %s\n", rc, c7x_client_open_error());
        exit(3);
    }
    return c;
}

/* "CODE.BITS:D0xD1x...:PATH" */
static int parse_tensor(const char *spec, c7x_tensor_desc_t *d) {
    memset(d, 0, sizeof *d);
    char buf[1024];
    snprintf(buf, sizeof buf, "%s", spec);
    char *a = strtok(buf, ":"), *b = strtok(NULL, ":"), *p = strtok(NULL, ":");
    if (!a || !b || !p) return -1;
    d->dtype_code = atoi(a);
    d->dtype_bits = atoi(strchr(a, '.') + 1);
    size_t n = 1;
    for (char *t = strtok(b, "x"); t; t = strtok(NULL, "x")) {
        d->shape[d->ndim++] = atoll(t);
        n *= (size_t)atoll(t);
    }
    d->data_size = n * (size_t)d->dtype_bits / 8;
    d->data = malloc(d->data_size ? d->data_size : 1);
    FILE *f = fopen(p, "rb");
    if (!f || fread(d->data, 1, d->data_size, f) != d->data_size) return -1;
    fclose(f);
    return 0;
}

static void write_outputs(const char *prefix, const c7x_tensor_desc_t *o, uint32_t n) {
    for (uint32_t i = 0; i < n; i++) {
        char path[512];
        snprintf(path, sizeof path, "%s%u.bin", prefix, i);
        FILE *f = fopen(path, "wb");
        fwrite(o[i].data, 1, o[i].data_size, f);
        fclose(f);
        printf("out%u %d.%d", i, o[i].dtype_code, o[i].dtype_bits);
        for (int k = 0; k < o[i].ndim; k++) printf("%s%lld", k ? "x" : " ", (long long)o[i].shape[k]);
        printf("\n");
    }
}

/* ---- TI-shaped client */

static int cmd_open(void) {
    c7x_client_t *c = NULL;
    long long t0 = now_ms();
    int rc = c7x_client_open(&c, NULL);
    printf("open_rc %d\nopen_ms %lld\nopen_error %s\n", rc, now_ms() - t0, c7x_client_open_error());
    if (!rc) {
        uint32_t v = 0, up = 0;
        rc = c7x_client_ping(c, &v, &up);
        printf("ping_rc %d\nversion 0x%06x\n", rc, v);
        c7x_status_t st;
        rc = c7x_client_status(c, &st);
        printf("status_rc %d\nstatus_version 0x%06x\n", rc, st.version);
        c7x_client_close(c);
    }
    return 0;
}

static int cmd_timeout(int ms) {
    c7x_client_opts_t o = C7X_CLIENT_OPTS_INIT;
    o.timeout_ms = ms;
    c7x_client_t *c = NULL;
    long long t0 = now_ms();
    int rc = c7x_client_open_ex(&c, &o);
    printf("open_rc %d\nopen_ms %lld\nopen_error %s\n", rc, now_ms() - t0, c7x_client_open_error());
    if (!rc) c7x_client_close(c);
    return 0;
}

static int cmd_handles(const char *so, unsigned foreign) {
    c7x_client_t *c = open_or_die(0);
    report("dyn_unload", c7x_client_dyn_unload(c, 9999), c);
    report("foreign_unload", c7x_client_dyn_unload(c, foreign), c);
    report("model_unload", c7x_client_model_unload(c, 4242), c);
    c7x_module_info_t mi;
    int rc = c7x_client_dyn_load_file(c, so, &mi);
    report("load", rc, c);
    float x[64] = {0};
    c7x_tensor_desc_t in = {x, sizeof x, 2, 2, 32, 0, {1, 64, 0, 0, 0, 0}};
    c7x_tensor_desc_t out[4];
    report("infer_bad_handle", c7x_client_infer(c, mi.handle + 1000, 0, &in, 1, out, 4, 0, NULL), c);
    report("infer_bad_model", c7x_client_infer(c, mi.handle, 77, &in, 1, out, 4, 0, NULL), c);
    report("infer_bad_flags", c7x_client_infer(c, mi.handle, 0, &in, 1, out, 4, 1u << 20, NULL), c);
    c7x_tensor_desc_t bad = in;
    bad.shape[1] = 65; /* data_size disagrees with the shape */
    report("infer_bad_tensor", c7x_client_infer(c, mi.handle, 0, &bad, 1, out, 4, 0, NULL), c);
    report("garbage_load", c7x_client_dyn_load(c, "not an elf at all", 17, NULL), c);
    report("unload", c7x_client_dyn_unload(c, mi.handle), c);
    report("unload_again", c7x_client_dyn_unload(c, mi.handle), c);
    uint32_t v;
    report("ping_after", c7x_client_ping(c, &v, NULL), c);
    c7x_client_close(c);
    return 0;
}

/* A module without io_meta (x (1,64) f32 -> several outputs). */
static int cmd_capacity(const char *so, int in_bytes) {
    c7x_client_t *c = open_or_die(0);
    c7x_module_info_t mi;
    report("load", c7x_client_dyn_load_file(c, so, &mi), c);
    printf("io_input_bytes %llu\nio_output_bytes %llu\n", (unsigned long long)mi.io_input_bytes,
           (unsigned long long)mi.io_output_bytes);
    float x[64];
    for (int i = 0; i < 64; i++) x[i] = (float)i;
    c7x_tensor_desc_t in = {x, sizeof x, 2, 2, 32, 0, {1, 64, 0, 0, 0, 0}};
    c7x_tensor_desc_t out[8];
    c7x_status_t s0, s1;
    c7x_client_status(c, &s0);
    report("infer_unreserved", c7x_client_infer(c, mi.handle, 0, &in, 1, out, 8, 0, NULL), c);
    report("reserve_small", c7x_client_reserve_io(c, (size_t)in_bytes, 1), c);
    printf("input_capacity %zu\noutput_capacity %zu\n", c7x_client_input_capacity(c), c7x_client_output_capacity(c));
    /* an input bigger than input_buf: EFBIG on the host, nothing sent */
    static float bigx[1 << 16];
    c7x_tensor_desc_t big = {bigx, sizeof bigx, 2, 2, 32, 0, {1, 1 << 16, 0, 0, 0, 0}};
    report("infer_too_big", c7x_client_infer(c, mi.handle, 0, &big, 1, out, 8, 0, NULL), c);
    c7x_client_status(c, &s1);
    printf("jobs_sent_by_efbig %u\n", (s1.jobs_completed + s1.jobs_failed) - (s0.jobs_completed + s0.jobs_failed));
    c7x_tensor_desc_t t;
    int64_t shape[2] = {1024, 1024};
    report("create_input_too_big", c7x_client_create_input(c, 2, shape, 2, 32, &t), c);
    c7x_infer_info_t info;
    int rc, tries = 0;
    while ((rc = c7x_client_infer(c, mi.handle, 0, &in, 1, out, 8, 0, &info)) == -ENOSPC && tries++ < 5) {
        report("size", rc, c);
        printf("locked_after_size %d\n", c7x_client_io_locked(c));
        printf("required %llu\n", (unsigned long long)info.result_required);
        uint32_t v;
        report("ping_between", c7x_client_ping(c, &v, NULL), c);
        report("reserve_retry", c7x_client_reserve_io(c, (size_t)in_bytes, (size_t)info.result_required), c);
    }
    report("infer_ok", rc, c);
    printf("num_outputs %u\nlocked %d\n", info.num_outputs, c7x_client_io_locked(c));
    write_outputs("cap_out", out, info.num_outputs);
    report("reserve_locked", c7x_client_reserve_io(c, 1 << 20, 1 << 20), c);
    report("unload", c7x_client_dyn_unload(c, mi.handle), c);
    c7x_client_close(c);
    return 0;
}

/* load DIR/model.so (+ weights), infer on the given tensors, write outputs */
static int cmd_infer(const char *so, const char *weights, int n, char **specs, const char *prefix) {
    c7x_client_t *c = open_or_die(0);
    c7x_module_info_t mi;
    report("load", c7x_client_dyn_load_file(c, so, &mi), c);
    uint32_t model = 0;
    if (strcmp(weights, "-") != 0) report("weights", c7x_client_model_load_file(c, weights, &model, NULL), c);
    printf("input_data_offset %zu\n", c7x_client_get_input_data_offset(c));
    c7x_tensor_desc_t *in = calloc((size_t)n, sizeof *in);
    for (int i = 0; i < n; i++)
        if (parse_tensor(specs[i], &in[i])) {
            printf("bad_spec %s\n", specs[i]);
            return 2;
        }
    c7x_tensor_desc_t out[16];
    c7x_infer_info_t info;
    int rc = c7x_client_infer(c, mi.handle, model, in, (uint32_t)n, out, 16, 0, &info);
    report("infer", rc, c);
    printf("num_outputs %u\ncycles %llu\n", info.num_outputs, (unsigned long long)info.cycles);
    if (!rc) write_outputs(prefix, out, info.num_outputs);
    /* zero copy: the same inputs from create_input, in place */
    c7x_tensor_desc_t *zin = calloc((size_t)n, sizeof *zin);
    int zc = 0;
    for (int i = 0; i < n && !zc; i++) {
        zc = c7x_client_create_input(c, in[i].ndim, in[i].shape, in[i].dtype_code, in[i].dtype_bits, &zin[i]);
        if (!zc) memcpy(zin[i].data, in[i].data, in[i].data_size);
    }
    report("create_input", zc, c);
    if (!zc) {
        void *first = malloc(out[0].data_size);
        memcpy(first, out[0].data, out[0].data_size);
        rc = c7x_client_infer(c, mi.handle, model, zin, (uint32_t)n, out, 16, 0, &info);
        report("infer_zero_copy", rc, c);
        printf("zero_copy_same %d\n", !rc && memcmp(first, out[0].data, out[0].data_size) == 0);
    }
    if (model) report("model_unload", c7x_client_model_unload(c, model), c);
    report("unload", c7x_client_dyn_unload(c, mi.handle), c);
    c7x_client_close(c);
    return 0;
}

static int cmd_load(const char *so) {
    c7x_client_t *c = open_or_die(0);
    c7x_module_info_t mi;
    report("load", c7x_client_dyn_load_file(c, so, &mi), c);
    report("missing_file", c7x_client_dyn_load_file(c, "/nonexistent/model.so", &mi), c);
    uint32_t v;
    report("ping_after", c7x_client_ping(c, &v, NULL), c);
    c7x_client_close(c);
    return 0;
}

/* a second, bigger load replaces the staging buffer sized to the first */
static int cmd_two_loads(const char *a, const char *b) {
    c7x_client_t *c = open_or_die(0);
    c7x_module_info_t ma, mb;
    c7x_pool_status_t p0, p1, p2;
    c7x_client_pool_status(c, &p0);
    report("load_a", c7x_client_dyn_load_file(c, a, &ma), c);
    c7x_client_pool_status(c, &p1);
    report("load_b", c7x_client_dyn_load_file(c, b, &mb), c);
    c7x_client_pool_status(c, &p2);
    printf("used %llu %llu %llu\nmodules %u\n", (unsigned long long)p0.carveout_used,
           (unsigned long long)p1.carveout_used, (unsigned long long)p2.carveout_used, p2.modules);
    report("unload_a", c7x_client_dyn_unload(c, ma.handle), c);
    report("unload_b", c7x_client_dyn_unload(c, mb.handle), c);
    c7x_client_close(c);
    return 0;
}

/* growth after the lock: a create_input tensor of module a (x (2,32) f32),
 * an inference (locks), then a bigger module b; a's tensor stays usable */
static int cmd_grow_after_lock(const char *a, const char *b) {
    c7x_client_t *c = open_or_die(0);
    c7x_module_info_t ma, mb;
    report("load_a", c7x_client_dyn_load_file(c, a, &ma), c);
    c7x_tensor_desc_t t, out[8], first[8];
    int64_t shape[2] = {2, 32};
    report("create_input", c7x_client_create_input(c, 2, shape, 2, 32, &t), c);
    for (int i = 0; i < 64; i++) ((float *)t.data)[i] = (float)i / 8.0f;
    c7x_infer_info_t info;
    report("infer_a", c7x_client_infer(c, ma.handle, 0, &t, 1, out, 8, 0, &info), c);
    static unsigned char saved[8][4096];
    uint32_t n = info.num_outputs;
    for (uint32_t i = 0; i < n && i < 8; i++) {
        first[i] = out[i];
        memcpy(saved[i], out[i].data, out[i].data_size < 4096 ? out[i].data_size : 4096);
    }
    printf("locked %d\ninput_before %zu\noutput_before %zu\n", c7x_client_io_locked(c),
           c7x_client_input_capacity(c), c7x_client_output_capacity(c));
    report("load_b", c7x_client_dyn_load_file(c, b, &mb), c);
    printf("input_after %zu\noutput_after %zu\nbig_in %llu\nbig_out %llu\n", c7x_client_input_capacity(c),
           c7x_client_output_capacity(c), (unsigned long long)mb.io_input_bytes,
           (unsigned long long)mb.io_output_bytes);
    printf("kept %d\n", ((float *)t.data)[63] == 63.0f / 8.0f);
    report("infer_a_again", c7x_client_infer(c, ma.handle, 0, &t, 1, out, 8, 0, &info), c);
    int same = info.num_outputs == n;
    for (uint32_t i = 0; same && i < n && i < 8; i++)
        same = out[i].data_size == first[i].data_size &&
               !memcmp(saved[i], out[i].data, out[i].data_size < 4096 ? out[i].data_size : 4096);
    printf("same %d\n", same);
    report("reserve_locked", c7x_client_reserve_io(c, 1 << 24, 1 << 24), c);
    c7x_client_close(c);
    return 0;
}

/* an input living in the KV region (passed in place), then KV_RESIDENT:
 * outputs past the first land in the KV region */
static int cmd_kv(const char *so, const char *spec, const char *prefix) {
    c7x_client_t *c = open_or_die(0);
    c7x_module_info_t mi;
    report("load", c7x_client_dyn_load_file(c, so, &mi), c);
    void *kv;
    size_t kv_size;
    report("kv", c7x_client_kv_region(c, &kv, &kv_size), c);
    printf("kv_size %zu\n", kv_size);
    c7x_tensor_desc_t in;
    if (parse_tensor(spec, &in)) return 2;
    uint8_t *slot = (uint8_t *)kv + kv_size / 2; /* KV_RESIDENT outputs pack from the region's base */
    memcpy(slot, in.data, in.data_size);
    in.data = slot;
    c7x_tensor_desc_t out[16];
    c7x_infer_info_t info;
    report("infer_kv_input", c7x_client_infer(c, mi.handle, 0, &in, 1, out, 16, 0, &info), c);
    report("infer_kv_resident", c7x_client_infer(c, mi.handle, 0, &in, 1, out, 16, C7X_INFER_FLAG_KV_RESIDENT, &info),
           c);
    printf("num_outputs %u\n", info.num_outputs);
    write_outputs(prefix, out, info.num_outputs);
    char path[512];
    snprintf(path, sizeof path, "%skv.bin", prefix);
    FILE *f = fopen(path, "wb");
    fwrite(kv, 1, kv_size / 2, f);
    fclose(f);
    c7x_client_close(c);
    return 0;
}

/* start a long inference and never return: the test kills us mid-INFER */
static int cmd_hang(const char *so, const char *spec, int repeat) {
    c7x_client_t *c = open_or_die(120000);
    c7x_module_info_t mi;
    int rc = c7x_client_dyn_load_file(c, so, &mi);
    report("load", rc, c);
    c7x_tensor_desc_t in;
    if (parse_tensor(spec, &in)) return 2;
    c7x_tensor_desc_t out[4];
    c7x_infer_info_t info;
    rc = c7x_client_infer(c, mi.handle, 0, &in, 1, out, 4, 0, &info); /* warm */
    report("warm", rc, c);
    printf("READY\n");
    fflush(stdout);
    rc = c7x_client_infer(c, mi.handle, 0, &in, 1, out, 4, C7X_INFER_REPEAT(repeat), &info);
    report("long_infer", rc, c);
    return 0;
}

static int cmd_ping_bench(int n) {
    c7x_client_opts_t o = C7X_CLIENT_OPTS_INIT;
    o.printf_size = 0;
    c7x_client_t *c = NULL;
    int rc = c7x_client_open_ex(&c, &o);
    if (rc) {
        printf("open_rc %d\n", rc);
        return 3;
    }
    uint32_t v;
    for (int i = 0; i < 200; i++) c7x_client_ping(c, &v, NULL);
    for (int i = 0; i < n; i++) {
        struct timespec a, b;
        clock_gettime(CLOCK_MONOTONIC, &a);
        rc = c7x_client_ping(c, &v, NULL);
        clock_gettime(CLOCK_MONOTONIC, &b);
        if (rc) return 4;
        printf("%lld\n", (long long)(b.tv_sec - a.tv_sec) * 1000000000LL + (b.tv_nsec - a.tv_nsec));
    }
    c7x_client_close(c);
    return 0;
}

/* ---- Horizon-shaped tasks */

static void hb_report(const char *key, int rc) {
    printf("%s_rc %d\n%s_error %s\n", key, rc, key, hbUCPGetLastErrorText());
    fflush(stdout);
}

typedef struct {
    int32_t data_size;
    uint64_t input;
    uint8_t run_tcm_opt;
} softmax_param_t;

static int cmd_ucp_nodev(void) {
    hbUCPSysMem m;
    long long t0 = now_ms();
    int rc = hbUCPMalloc(&m, 4096, 0);
    printf("malloc_ms %lld\n", now_ms() - t0);
    hb_report("malloc", rc);
    printf("desc %s\n", hbUCPGetErrorDesc(rc));
    return 0;
}

/* n tasks in flight: task i softmaxes i-th slice on core i%2 (or any), waited for in reverse */
static int cmd_ucp_tasks(int n, int size, const char *prefix, int any) {
    hbUCPSysMem data[16], param[16], out[16];
    hbUCPTaskHandle_t task[16] = {0};
    for (int i = 0; i < n; i++) {
        int32_t bytes = (int32_t)(size * sizeof(float32_t));
        hb_report("malloc", hbUCPMalloc(&data[i], (uint64_t)bytes, 0));
        hbDSPAddrMap(&data[i], &data[i]);
        hbUCPMalloc(&out[i], (uint64_t)bytes, 0);
        hbDSPAddrMap(&out[i], &out[i]);
        hbUCPMalloc(&param[i], sizeof(softmax_param_t), 0);
        hbDSPAddrMap(&param[i], &param[i]);
        float32_t *x = (float32_t *)data[i].virAddr;
        for (int k = 0; k < size; k++) x[k] = (float32_t)((k * 37 + i * 11) % 101) / 17.0f - 3.0f;
        softmax_param_t *p = (softmax_param_t *)param[i].virAddr;
        p->data_size = bytes;
        p->input = data[i].phyAddr;
        p->run_tcm_opt = (uint8_t)(i & 1);
        hb_report("rpc", hbDSPRpcV2(&task[i], &param[i], &out[i], 0x1402));
        hbUCPSchedParam sp;
        HB_UCP_INITIALIZE_SCHED_PARAM(&sp);
        sp.backend = any ? HB_UCP_DSP_CORE_ANY : (i % 2 ? HB_UCP_DSP_CORE_1 : HB_UCP_DSP_CORE_0);
        sp.priority = (int32_t)(i * 40 % 256);
        hb_report("submit", hbUCPSubmitTask(task[i], &sp));
    }
    hb_report("release_in_flight", hbUCPReleaseTask(task[0]));
    for (int i = n - 1; i >= 0; i--) {
        int rc = hbUCPWaitTaskDone(task[i], 30000);
        int32_t rv = -1, core = -1;
        uint64_t cycles = 0;
        hbUCPGetTaskResult(task[i], &rv, &cycles, &core);
        printf("task%d_rc %d\ntask%d_core %d\ntask%d_rv %d\n", i, rc, i, core, i, rv);
        char path[512];
        snprintf(path, sizeof path, "%s%d.bin", prefix, i);
        FILE *f = fopen(path, "wb");
        fwrite(out[i].virAddr, sizeof(float32_t), (size_t)size, f);
        fclose(f);
        hb_report("wait_again", hbUCPWaitTaskDone(task[i], 10));
        hb_report("release", hbUCPReleaseTask(task[i]));
    }
    hb_report("resubmit_released", hbUCPSubmitTask(task[0], NULL));
    for (int i = 0; i < n; i++) {
        hbDSPAddrUnmap(&data[i]);
        hb_report("free", hbUCPFree(&data[i]));
        hbUCPFree(&param[i]);
        hbUCPFree(&out[i]);
    }
    hb_report("free_twice", hbUCPFree(&data[0]));
    return 0;
}

/* threads, each with its own tasks in flight on the one session, checked
 * against a host softmax in double precision */
typedef struct {
    int id, tasks, size, bad;
    double worst;
} worker_t;

static void *worker(void *arg) {
    worker_t *w = (worker_t *)arg;
    hbUCPSysMem data[4], param[4], out[4];
    hbUCPTaskHandle_t task[4] = {0};
    int k = w->tasks > 4 ? 4 : w->tasks;
    for (int round = 0; round < 3; round++) {
        for (int i = 0; i < k; i++) {
            int32_t bytes = (int32_t)(w->size * sizeof(float32_t));
            if (hbUCPMalloc(&data[i], (uint64_t)bytes, 0) || hbUCPMalloc(&out[i], (uint64_t)bytes, 0) ||
                hbUCPMalloc(&param[i], sizeof(softmax_param_t), 0)) {
                w->bad++;
                return NULL;
            }
            hbDSPAddrMap(&data[i], &data[i]);
            hbDSPAddrMap(&out[i], &out[i]);
            hbDSPAddrMap(&param[i], &param[i]);
            float32_t *x = (float32_t *)data[i].virAddr;
            for (int j = 0; j < w->size; j++) x[j] = (float32_t)(((j + 1) * (w->id + 3) * (i + round + 1)) % 29) / 7.0f;
            softmax_param_t *p = (softmax_param_t *)param[i].virAddr;
            p->data_size = bytes;
            p->input = data[i].phyAddr;
            p->run_tcm_opt = (uint8_t)((i + round) & 1);
            hbUCPSchedParam sp;
            HB_UCP_INITIALIZE_SCHED_PARAM(&sp);
            sp.backend = (w->id + i) % 2 ? HB_UCP_DSP_CORE_1 : HB_UCP_DSP_CORE_0;
            sp.priority = (w->id * 31 + i) % 256;
            if (hbDSPRpcV2(&task[i], &param[i], &out[i], 0x1402) || hbUCPSubmitTask(task[i], &sp)) w->bad++;
        }
        for (int i = k - 1; i >= 0; i--) {
            if (hbUCPWaitTaskDone(task[i], 30000) || hbUCPReleaseTask(task[i])) w->bad++;
            const float32_t *x = (const float32_t *)data[i].virAddr, *y = (const float32_t *)out[i].virAddr;
            double mx = -1e300, sum = 0;
            for (int j = 0; j < w->size; j++) mx = x[j] > mx ? x[j] : mx;
            for (int j = 0; j < w->size; j++) sum += exp((double)x[j] - mx);
            for (int j = 0; j < w->size; j++) {
                double want = exp((double)x[j] - mx) / sum, err = fabs(y[j] - want) / want;
                if (err > w->worst) w->worst = err;
            }
            hbUCPFree(&data[i]);
            hbUCPFree(&out[i]);
            hbUCPFree(&param[i]);
        }
    }
    return NULL;
}

static int cmd_ucp_threads(int threads, int tasks, int size) {
    pthread_t th[16];
    worker_t w[16];
    memset(w, 0, sizeof w);
    for (int i = 0; i < threads; i++) {
        w[i].id = i;
        w[i].tasks = tasks;
        w[i].size = size;
        pthread_create(&th[i], NULL, worker, &w[i]);
    }
    int bad = 0;
    double worst = 0;
    for (int i = 0; i < threads; i++) {
        pthread_join(th[i], NULL);
        bad += w[i].bad;
        worst = w[i].worst > worst ? w[i].worst : worst;
    }
    printf("bad %d\nworst_rel_err %.3g\nlast_error %s\n", bad, worst, hbUCPGetLastErrorText());
    return 0;
}

/* errors: bad priority, bad core, memory size beyond the buffer (ERR_ADDR),
 * a parameter naming another connection's address, unknown command id */
static int cmd_ucp_errors(unsigned long long foreign) {
    hbUCPSysMem data, param, out;
    hbUCPMalloc(&data, 4096, 0);
    hbUCPMalloc(&param, 64, 0);
    hbUCPMalloc(&out, 4096, 0);
    hbDSPAddrMap(&data, &data);
    hbDSPAddrMap(&param, &param);
    hbDSPAddrMap(&out, &out);
    softmax_param_t *p = (softmax_param_t *)param.virAddr;
    p->data_size = 4096;
    p->input = data.phyAddr;
    p->run_tcm_opt = 0;
    hbUCPSchedParam sp;
    HB_UCP_INITIALIZE_SCHED_PARAM(&sp);
    hbUCPTaskHandle_t t = NULL;

    hbDSPRpcV2(&t, &param, &out, 0x1402);
    sp.priority = 300;
    hb_report("bad_priority", hbUCPSubmitTask(t, &sp));
    sp.priority = 0;
    sp.backend = HB_UCP_DSP_CORE_0 | HB_UCP_DSP_CORE_1;
    hb_report("bad_backend", hbUCPSubmitTask(t, &sp));
    sp.backend = HB_UCP_DSP_CORE_3; /* a core the device does not have */
    int rc = hbUCPSubmitTask(t, &sp);
    hb_report("missing_core_submit", rc);
    if (!rc) hb_report("missing_core_wait", hbUCPWaitTaskDone(t, 10000));
    hbUCPReleaseTask(t);
    sp.backend = HB_UCP_CORE_ANY;

    hbUCPSysMem lie = out;
    lie.memSize = 1 << 20; /* more than the buffer holds */
    hbDSPRpcV2(&t, &param, &lie, 0x1402);
    hbUCPSubmitTask(t, &sp);
    hb_report("addr", hbUCPWaitTaskDone(t, 10000));
    hbUCPReleaseTask(t);

    p->input = foreign; /* another connection's buffer */
    hbDSPRpcV2(&t, &param, &out, 0x1402);
    hbUCPSubmitTask(t, &sp);
    hb_report("foreign", hbUCPWaitTaskDone(t, 10000));
    int32_t rv = 0;
    hbUCPGetTaskResult(t, &rv, NULL, NULL);
    printf("foreign_rv %d\n", rv);
    hbUCPReleaseTask(t);

    p->input = data.phyAddr;
    hbDSPRpcV2(&t, &param, &out, 0x7777);
    hbUCPSubmitTask(t, &sp);
    hb_report("unknown_cmd", hbUCPWaitTaskDone(t, 10000));
    hbUCPReleaseTask(t);

    hbUCPSysMem notours = {0, &sp, 64};
    hb_report("rpc_not_ours", hbDSPRpcV2(&t, &notours, &out, 0x1402));
    hb_report("flush_clean", hbUCPMemFlush(&out, HB_SYS_MEM_CACHE_CLEAN));
    hb_report("flush_bad", hbUCPMemFlush(&out, 99));
    hb_report("malloc_zero", hbUCPMalloc(&notours, 0, 0));

    p->input = data.phyAddr; /* still serving */
    hbDSPRpcV2(&t, &param, &out, 0x1402);
    hbUCPSubmitTask(t, &sp);
    hb_report("after", hbUCPWaitTaskDone(t, 10000));
    hbUCPReleaseTask(t);
    return 0;
}

/* against a device that never answers RPC: the wait times out and can be retried */
static int cmd_ucp_timeout(int ms) {
    hbUCPSysMem a, b;
    hb_report("malloc", hbUCPMalloc(&a, 64, 0));
    hbUCPMalloc(&b, 64, 0);
    hbUCPTaskHandle_t t = NULL;
    hbDSPRpcV2(&t, &a, &b, 0x1402);
    hb_report("submit", hbUCPSubmitTask(t, NULL));
    long long t0 = now_ms();
    hb_report("wait", hbUCPWaitTaskDone(t, ms));
    printf("wait_ms %lld\n", now_ms() - t0);
    hb_report("wait2", hbUCPWaitTaskDone(t, ms));
    hb_report("release", hbUCPReleaseTask(t));
    return 0;
}

int main(int argc, char **argv) {
    setvbuf(stdout, NULL, _IOLBF, 0);
    if (argc < 2) return 64;
    const char *c = argv[1];
    if (!strcmp(c, "open")) return cmd_open();
    if (!strcmp(c, "timeout")) return cmd_timeout(atoi(argv[2]));
    if (!strcmp(c, "handles")) return cmd_handles(argv[2], (unsigned)atoi(argv[3]));
    if (!strcmp(c, "capacity")) return cmd_capacity(argv[2], atoi(argv[3]));
    if (!strcmp(c, "infer")) return cmd_infer(argv[2], argv[3], argc - 5, argv + 5, argv[4]);
    if (!strcmp(c, "load")) return cmd_load(argv[2]);
    if (!strcmp(c, "two_loads")) return cmd_two_loads(argv[2], argv[3]);
    if (!strcmp(c, "grow_after_lock")) return cmd_grow_after_lock(argv[2], argv[3]);
    if (!strcmp(c, "kv")) return cmd_kv(argv[2], argv[3], argv[4]);
    if (!strcmp(c, "hang")) return cmd_hang(argv[2], argv[3], atoi(argv[4]));
    if (!strcmp(c, "ping_bench")) return cmd_ping_bench(atoi(argv[2]));
    if (!strcmp(c, "ucp_nodev")) return cmd_ucp_nodev();
    if (!strcmp(c, "ucp_tasks")) return cmd_ucp_tasks(atoi(argv[2]), atoi(argv[3]), argv[4], atoi(argv[5]));
    if (!strcmp(c, "ucp_threads")) return cmd_ucp_threads(atoi(argv[2]), atoi(argv[3]), atoi(argv[4]));
    if (!strcmp(c, "ucp_errors")) return cmd_ucp_errors(strtoull(argv[2], NULL, 0));
    if (!strcmp(c, "ucp_timeout")) return cmd_ucp_timeout(atoi(argv[2]));
    return 64;
}
'''

CPP_ERRORS = r'''// c7x::Module errors: typed exceptions with the status name and its numbers.
#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

#include "c7x_runtime.h"

static void show(const char* key, const c7x::Error& e) {
  std::printf("%s_code %d\n%s_status %d\n%s_name %s\n%s_required %llu\n%s_what %s\n", key, e.code(), key, e.status(),
              key, e.status_name().c_str(), key, (unsigned long long)e.result_required(), key, e.what());
}

#define EXPECT_ERROR(key, stmt)            \
  try {                                    \
    stmt;                                  \
    std::printf("%s_code 0\n", key);       \
  } catch (const c7x::Error& e) {          \
    show(key, e);                          \
  }

int main(int argc, char** argv) {
  if (argc < 3) return 64;
  std::string so = argv[1];
  long in_bytes = std::atol(argv[2]);
  {
    c7x::Module m;
    EXPECT_ERROR("missing", m.Load("/nonexistent/model"));
    EXPECT_ERROR("run_unloaded", m.Run(std::vector<DLTensor>{}));
    m.Load(so);
    std::vector<float> x(64);
    for (int i = 0; i < 64; i++) x[i] = static_cast<float>(i);
    int64_t shape[2] = {1, 64};
    DLTensor t{x.data(), {kDLCPU, 0}, 2, {kDLFloat, 32, 1}, shape, nullptr, 0};
    EXPECT_ERROR("unreserved", m.Run({t}));
    m.ReserveIO(static_cast<size_t>(in_bytes), 1);
    uint64_t need = 0;
    for (int i = 0; i < 5; i++) {
      try {
        const auto& out = m.Run({t});
        std::printf("ok_outputs %zu\n", out.size());
        for (size_t k = 0; k < out.size(); k++) {
          const float* d = static_cast<const float*>(out[k].dl.data);
          std::printf("out%zu_shape %lldx%lld first %g last %g\n", k, (long long)out[k].dl.shape[0],
                      (long long)out[k].dl.shape[1], d[0], d[out[k].nbytes / 4 - 1]);
        }
        break;
      } catch (const c7x::Error& e) {
        show("size", e);
        need = e.result_required();
        m.ReserveIO(static_cast<size_t>(in_bytes), need);
      }
    }
    EXPECT_ERROR("locked", m.ReserveIO(1 << 20, 1 << 20));
    int64_t strides[2] = {1, 2};  // not row-major
    DLTensor s = t;
    s.strides = strides;
    EXPECT_ERROR("strided", m.Run({s}));
    m.Close();
  }
  {
    c7x::Module m(std::string("/nonexistent/dsp0.sock"));
    EXPECT_ERROR("nodev", m.Load(so));
  }
  return 0;
}
'''
