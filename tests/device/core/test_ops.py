"""Op registry, op libraries loaded at runtime, and the softmax operator
(built-in 0x1402 and the example library's 0x2402) — in-process."""
from __future__ import annotations

import linecache
import mmap
import struct
from pathlib import Path

import numpy as np
import pytest
import scipy.special

from dspx.memory import AddressSpace, Region
from dspx.abi import ops as ops_abi
from dspx.abi.protocol import Status
from dspx.device.core import builtin_ops, ops, runtime as rt
from dspx.device.core.errors import OpBusy, OpLoadError, OpSymbolError, UnknownLibrary, NoSuchOp

EXAMPLE = Path(__file__).resolve().parents[3] / "examples" / "softmax" / "softmax_ops.py"
PARAM_ADDR, DATA_ADDR, OUT_ADDR = 0xC000_0000, 0xC010_0000, 0xD000_0000


class Device:
    """A registry with the built-ins, one core, and a connection whose
    address space holds a parameter buffer, a data buffer and an output buffer."""

    def __init__(self, n: int):
        self.core = rt.CoreRuntime()
        self.reg = ops.OpRegistry()
        builtin_ops.register(self.reg)
        self.space = AddressSpace()
        self.maps = {}
        for addr, size in ((PARAM_ADDR, 4096), (DATA_ADDR, max(4, 4 * n)), (OUT_ADDR, max(4, 4 * n))):
            mm = mmap.mmap(-1, size)
            self.space.add(Region(len(self.maps) + 1, addr, size, mm))
            self.maps[addr] = mm
        self.param = np.frombuffer(self.maps[PARAM_ADDR], np.uint8)
        self.data = np.frombuffer(self.maps[DATA_ADDR], np.float32, count=n)
        self.out = np.frombuffer(self.maps[OUT_ADDR], np.uint8)

    def run(self, cmd, input=None, output=None):
        input = self.param[:24] if input is None else input
        return self.reg.run(cmd, input, self.out if output is None else output, rt.TaskContext(self.space, self.core))

    def softmax(self, cmd: int, tcm: int, n: int | None = None, addr: int = DATA_ADDR):
        n = self.data.size if n is None else n
        pack_param(self.maps[PARAM_ADDR], 4 * n, addr, tcm)
        self.out[:] = 0
        res = self.run(cmd)
        return res, self.out[:4 * n].view(np.float32).copy()

    def close(self):
        self.core.close()


@pytest.fixture
def dev():
    d = Device(1024)
    yield d
    d.close()


def ok(_i, _o, _tm):
    return 0


# ------------------------------------------------------------------ softmax

def pack_param(buf, data_size: int, addr: int, tcm: int) -> None:
    """hbDSPSoftmaxParam as the seed's C lays it out, offsets written by hand."""
    struct.pack_into("<i", buf, 0, data_size)
    struct.pack_into("<Q", buf, 8, addr)
    struct.pack_into("<B", buf, 16, tcm)


def test_param_struct_is_the_seeds_c_layout():
    raw = bytearray(b"\xee" * 24)  # padding bytes must not matter
    pack_param(raw, 400_000, 0xC000_1000, 1)
    assert builtin_ops.SOFTMAX_PARAM.size == 24
    assert builtin_ops.read_softmax_param(raw) == (400_000, 0xC000_1000, 1)
    assert ops_abi.softmax_param(400_000, 0xC000_1000, True)[:17] == bytes(raw[:4]) + bytes(4) + bytes(raw[8:17])


SIZES = [1, 7, 1000, 100_000, rt.TILE_ELEMS - 1, rt.TILE_ELEMS + 1, 3 * rt.TILE_ELEMS]


@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("cmd", [builtin_ops.SOFTMAX_CMD, 0x2402])
def test_softmax_direct_and_ping_pong_agree_with_scipy(n, cmd):
    d = Device(n)
    try:
        if cmd == 0x2402:
            d.reg.load_library(EXAMPLE.read_text(), EXAMPLE.name)
        d.data[:] = 1 + np.arange(n, dtype=np.float32) / np.float32(n)  # the seed's data
        d.data[::3] += np.random.default_rng(n).standard_normal(d.data[::3].size, dtype=np.float32)
        ref = scipy.special.softmax(d.data)
        r0, direct = d.softmax(cmd, 0)
        r1, tcm = d.softmax(cmd, 1)
        for r in (r0, r1):
            assert (r.status, r.return_value) == (0, 0), r.printf
            assert r.cycles > 0
        assert direct.dtype == tcm.dtype == np.float32
        assert np.max(np.abs(tcm - direct) / direct) <= 1e-6
        assert np.max(np.abs(direct - ref) / ref) <= 1e-6
        assert np.max(np.abs(tcm - ref) / ref) <= 1e-6
        assert not np.shares_memory(d.data, d.out)
        assert d.core.tm.live() == []
    finally:
        d.close()


def test_softmax_at_2_pow_24_plus_3():
    n = (1 << 24) + 3
    d = Device(n)
    try:
        d.data[:] = np.arange(n, dtype=np.float32)
        d.data /= np.float32(n)
        d.data += np.float32(1)
        r1, tcm = d.softmax(builtin_ops.SOFTMAX_CMD, 1)
        r0, direct = d.softmax(builtin_ops.SOFTMAX_CMD, 0)
        assert r0.status == r1.status == 0
        ref = scipy.special.softmax(d.data)
        assert np.max(np.abs(tcm - direct) / direct) <= 1e-6
        assert np.max(np.abs(tcm - ref) / ref) <= 1e-6
    finally:
        d.close()


def test_softmax_prints_its_cycles_like_the_seed(dev):
    dev.data[:] = 1
    r, out = dev.softmax(builtin_ops.SOFTMAX_CMD, 1)
    assert r.printf.startswith("find softmax ping-pong tcm is ") and r.printf.endswith(" cycles\n")
    assert 0 < int(r.printf.split()[-2]) <= r.cycles
    assert np.allclose(out, 1 / 1024, rtol=1e-6)
    r, _ = dev.softmax(builtin_ops.SOFTMAX_CMD, 0)
    assert r.printf.startswith("find softmax ddr tcm is ")


def test_softmax_writes_the_shared_output_buffer_zero_copy(dev):
    dev.data[:] = 0
    pack_param(dev.maps[PARAM_ADDR], 8, DATA_ADDR, 0)
    assert dev.run(builtin_ops.SOFTMAX_CMD).status == 0
    assert struct.unpack_from("<2f", dev.maps[OUT_ADDR], 0) == (0.5, 0.5)


def test_softmax_refuses_bad_parameters(dev):
    cmd = builtin_ops.SOFTMAX_CMD
    r = dev.run(cmd, input=dev.param[:23])
    assert (r.status, r.return_value) == (0, Status.ERR_SIZE) and "24" in r.printf
    struct.pack_into("<iQB", dev.maps[PARAM_ADDR], 0, 6, DATA_ADDR, 0)
    assert dev.run(cmd).return_value == Status.ERR_INVALID
    struct.pack_into("<iQB", dev.maps[PARAM_ADDR], 0, -4, DATA_ADDR, 0)
    assert dev.run(cmd).return_value == Status.ERR_INVALID
    struct.pack_into("<iQB", dev.maps[PARAM_ADDR], 0, 4096, DATA_ADDR, 1)
    assert dev.run(cmd, output=dev.out[:100]).return_value == Status.ERR_SIZE
    struct.pack_into("<iQB", dev.maps[PARAM_ADDR], 0, 0, DATA_ADDR, 1)
    assert dev.run(cmd).return_value == 0


def test_softmax_on_an_address_the_connection_does_not_own_is_err_addr(dev):
    for addr in (0x1000, DATA_ADDR + 4096 - 8, OUT_ADDR + 8192):
        r, _ = dev.softmax(builtin_ops.SOFTMAX_CMD, 1, n=16, addr=addr)
        assert r.status == r.return_value == Status.ERR_ADDR
        assert "MapError" in r.printf and f"0x{addr:x}" in r.printf
    r, _ = dev.softmax(builtin_ops.SOFTMAX_CMD, 1)
    assert r.status == 0


# ------------------------------------------------------------------ registry

def test_ops_lists_builtins(dev):
    assert dev.reg.ops() == [ops.OpInfo(0x1402, "softmax", 0, ops.BUILTIN_LIB)]
    assert 0x1402 in dev.reg and 0x2402 not in dev.reg


def test_register_duplicate_is_busy(dev):
    with pytest.raises(OpBusy) as ei:
        dev.reg.register(0x1402, ok)
    assert ei.value.status == Status.ERR_BUSY and "0x1402" in str(ei.value) and "built-in" in str(ei.value)


def test_unknown_cmd_is_err_op(dev):
    with pytest.raises(NoSuchOp) as ei:
        dev.run(0xDEAD)
    assert ei.value.status == Status.ERR_OP and "0xdead" in str(ei.value)


LIB = """
import numpy as np
import math
from dspx.device.core.runtime import register_op, printf, Status

@register_op(0x3001, latency_us=250)
def fill(input, output, tm):
    output[:] = int(input[0])
    printf("filled %d bytes\\n", output.nbytes)
    return 0

def broken(input, output, tm):
    x = 1
    raise ValueError("bad things at " + str(x))

register_op(0x3002, broken, name="broken")

@register_op(0x3003)
def returns(input, output, tm):
    kind = int(input[0])
    return [0, None, 2 ** 40, np.int32(5), 3.0, True][kind]

@register_op(0x3004)
def leaks(input, output, tm):
    from dspx.device.core.runtime import dma
    tile = tm.alloc(4096, 0)
    dma.copy(0, np.zeros(4096, np.uint8), tile, 4096)
    return 0
"""


def test_load_run_list_unload(dev):
    h = dev.reg.load_library(LIB, "lib.py")
    assert h >= 1 and dev.reg.libraries() == [h]
    assert ops.OpInfo(0x3001, "fill", 250, h) in dev.reg.ops()
    assert ops.OpInfo(0x3002, "broken", 0, h) in dev.reg.ops()
    dev.param[0] = 42
    r = dev.run(0x3001)
    assert r == (0, 0, r.cycles, f"filled {dev.out.nbytes} bytes\n", None)  # no cost model: no record
    assert (dev.out == 42).all()
    dev.reg.unload_library(h)
    assert dev.reg.ops() == [ops.OpInfo(0x1402, "softmax", 0, 0)]
    with pytest.raises(NoSuchOp):
        dev.run(0x3001)
    with pytest.raises(UnknownLibrary) as ei:
        dev.reg.unload_library(h)
    assert ei.value.status == Status.ERR_HANDLE
    assert dev.reg.load_library(LIB, "lib.py") != h  # handles are not reused


def test_handler_exception_is_err_call_with_traceback_and_registry_keeps_working(dev):
    dev.reg.load_library(LIB, "lib.py")
    r = dev.run(0x3002)
    assert r.status == r.return_value == Status.ERR_CALL
    assert "Traceback" in r.printf and "ValueError: bad things at 1" in r.printf
    assert 'File "<oplib 1: lib.py>", line 14, in broken' in r.printf
    assert 'raise ValueError("bad things at " + str(x))' in r.printf  # source lines via linecache
    assert "ops.py" not in r.printf  # the registry's own frame is left out
    assert dev.run(0x3001).status == 0
    res, _ = dev.softmax(0x1402, 1)
    assert res.status == 0


@pytest.mark.parametrize("kind,status,rv,msg", [
    (0, 0, 0, ""),
    (1, Status.ERR_CALL, Status.ERR_CALL, "returned None, not an int"),
    (2, Status.ERR_CALL, Status.ERR_CALL, "does not fit int32"),
    (3, 0, 5, ""),
    (4, Status.ERR_CALL, Status.ERR_CALL, "returned 3.0"),
    (5, Status.ERR_CALL, Status.ERR_CALL, "returned True"),
])
def test_return_values(dev, kind, status, rv, msg):
    dev.reg.load_library(LIB, "lib.py")
    dev.param[0] = kind
    r = dev.run(0x3003)
    assert (r.status, r.return_value) == (status, rv) and msg in r.printf


def test_leftover_tiles_and_copies_are_cleaned_up_after_a_task(dev):
    dev.reg.load_library(LIB, "lib.py")
    r = dev.run(0x3004)
    assert r.status == 0
    assert "1 DMA copies not waited" in r.printf and "1 L2 tiles allocated" in r.printf
    assert dev.core.tm.live() == [] and dev.core.dma.in_flight(0) == 0


def test_example_library_loads_and_names_its_op(dev):
    h = dev.reg.load_library(EXAMPLE.read_bytes(), EXAMPLE.name)
    assert ops.OpInfo(0x2402, "softmax_lib", 0, h) in dev.reg.ops()


# ------------------------------------------------------------------ refusals

@pytest.mark.parametrize("src,symbol,line", [
    ("import os\n", "os", 1),
    ("import numpy\nimport subprocess as sp\n", "subprocess", 2),
    ("from os import path\n", "os.path", 1),
    ("import numpy.linalg\nfrom dspx.device.core import ops\n", "dspx.device.core.ops", 2),
    ("import dspx\n", "dspx", 1),
    ("from . import runtime\n", ".runtime", 1),
    ("from dspx.device.core.runtime import CoreRuntime\n", "dspx.device.core.runtime.CoreRuntime", 1),
    ("from dspx.device.core import runtime as rt\n\nx = rt.activate\n", "dspx.device.core.runtime.activate", 3),
    ("import dspx.device.core.runtime\ndspx.device.core.runtime.TaskContext\n", "dspx.device.core.runtime.TaskContext", 2),
    ("from numpy import *\n", "numpy.*", 1),
    ("x = 1\nm = __import__('os')\n", "__import__", 2),
    ("f = open('/etc/passwd')\n", "open", 1),
    ("def f():\n    return eval('1')\n", "eval", 2),
    ("exec('import os')\n", "exec", 1),
    ("g = __builtins__\n", "__builtins__", 1),
    ("def f():\n    import os\nimport subprocess\n", "os", 2),  # the first in source order
])
def test_refused_imports_and_names_are_err_symbol(dev, src, symbol, line):
    with pytest.raises(OpSymbolError) as ei:
        dev.reg.load_library(src + "\n" + LIB, "bad.py")
    e = ei.value
    assert e.status == Status.ERR_SYMBOL and e.symbol == symbol and e.line == e.error_line == line
    assert repr(symbol) in str(e) and f"line {line}" in str(e)
    assert 0x3001 not in dev.reg  # nothing ran, nothing registered


def test_allowed_imports(dev):
    src = ("import math\nimport numpy as np\nimport numpy.linalg\nfrom numpy import float32\n"
           "import dspx.device.core.runtime\nfrom dspx.device.core import runtime as rt\n"
           "from dspx.device.core.runtime import register_op, vecmax\n"
           "rt.register_op(0x3100, lambda i, o, tm: 0)\n"
           "dspx.device.core.runtime.register_op(0x3101, lambda i, o, tm: 0)\n")
    dev.reg.load_library(src, "ok.py")
    assert 0x3100 in dev.reg and 0x3101 in dev.reg


def test_syntax_error_is_err_load_with_line(dev):
    with pytest.raises(OpLoadError) as ei:
        dev.reg.load_library("import numpy\n\ndef f(:\n    pass\n", "syn.py")
    e = ei.value
    assert e.status == Status.ERR_LOAD and e.line == 3 and "syn.py, line 3" in str(e)


def test_errors_while_the_top_level_runs_are_err_load_with_line(dev):
    with pytest.raises(OpLoadError) as ei:
        dev.reg.load_library("import numpy\nx = 1 / 0\n", "div.py")
    assert ei.value.line == 2 and "ZeroDivisionError" in str(ei.value)
    with pytest.raises(OpLoadError) as ei:
        dev.reg.load_library("import numpy.not_a_module\n", "nm.py")
    assert ei.value.line == 1 and "not_a_module" in str(ei.value)
    with pytest.raises(OpLoadError) as ei:
        dev.reg.load_library("from dspx.device.core.runtime import register_op\nregister_op(1 << 32, abs)\n", "r.py")
    assert ei.value.line == 2 and "32 bits" in str(ei.value)


def test_library_without_ops_or_not_utf8_is_err_load(dev):
    with pytest.raises(OpLoadError, match="registers no operators"):
        dev.reg.load_library("import numpy\n", "empty.py")
    with pytest.raises(OpLoadError, match="UTF-8"):
        dev.reg.load_library(b"\xff\xfe", "bin.py")
    with pytest.raises(OpLoadError):
        dev.reg.load_library("x = 1\0", "nul.py")


def test_duplicate_cmd_refuses_the_whole_library(dev):
    src = ("from dspx.device.core.runtime import register_op\n"
           "register_op(0x3200, lambda i, o, tm: 0)\n"
           "register_op(0x1402, lambda i, o, tm: 0)\n")
    before = dev.reg.ops()
    with pytest.raises(OpBusy) as ei:
        dev.reg.load_library(src, "dup.py")
    assert ei.value.status == Status.ERR_BUSY and ei.value.cmd == 0x1402 and ei.value.owner == 0
    assert dev.reg.ops() == before and dev.reg.libraries() == []  # atomic: 0x3200 is not there
    h = dev.reg.load_library(LIB, "lib.py")
    with pytest.raises(OpBusy, match=f"op library {h}"):
        dev.reg.load_library(LIB.replace("0x3002", "0x3999"), "lib2.py")
    assert 0x3999 not in dev.reg
    same = "from dspx.device.core.runtime import register_op\nregister_op(7, abs)\nregister_op(7, abs)\n"
    with pytest.raises(OpBusy):
        dev.reg.load_library(same, "same.py")
    assert 7 not in dev.reg
    dev.reg.unload_library(h)
    dev.reg.load_library(LIB.replace("0x3002", "0x3999"), "lib2.py")  # free again after unload
    assert 0x3999 in dev.reg


def test_device_chosen_handles(dev):
    assert dev.reg.load_library(LIB, "lib.py", handle=17) == 17
    with pytest.raises(OpLoadError, match="in use"):
        dev.reg.load_library(LIB.replace("0x300", "0x400"), "x.py", handle=17)


def test_tracebacks_show_each_librarys_own_source(dev):
    a = ("from dspx.device.core.runtime import register_op\n"
         "def f(i, o, tm):\n    raise KeyError('from library a')\nregister_op(0x3300, f)\n")
    b = ("from dspx.device.core.runtime import register_op\n"
         "def g(i, o, tm):\n    raise KeyError('library b line')\nregister_op(0x3301, g)\n")
    ha = dev.reg.load_library(a, "same.py")
    hb = dev.reg.load_library(b, "same.py")
    assert "raise KeyError('from library a')" in dev.run(0x3300).printf
    assert "raise KeyError('library b line')" in dev.run(0x3301).printf
    dev.reg.unload_library(ha)
    dev.reg.unload_library(hb)
    assert not [k for k in linecache.cache if "same.py" in k]


@pytest.mark.parametrize("special", [np.nan, np.inf])
def test_softmax_paths_agree_on_nan_and_inf(dev, special):
    dev.data[:] = np.linspace(-5, 5, dev.data.size, dtype=np.float32)
    dev.data[700] = special
    with np.errstate(invalid="ignore"):
        _, direct = dev.softmax(builtin_ops.SOFTMAX_CMD, 0)
        _, tcm = dev.softmax(builtin_ops.SOFTMAX_CMD, 1)
        ref = scipy.special.softmax(dev.data)
    assert np.array_equal(direct, tcm, equal_nan=True)
    assert np.array_equal(direct, ref.astype(np.float32), equal_nan=True)
