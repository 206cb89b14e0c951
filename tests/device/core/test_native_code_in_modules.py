"""Reliability II (issue 15), the cores: a dead core costs no one else their
state, and native code in a module cannot act before the device checked it
(a constructor that ends the process, a DT_NEEDED library or RUNPATH of its
own).  docs/reliability.md states the rules."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import textwrap

import numpy as np
import psutil
import pytest

from dspx.errors import CallFailed, DeviceError
from dspx.host.client import Client
from dspx.host.tasks import Tasks
from dspx.host.vm import VirtualMachine
from conftest import Device

FAULT_CRASH = 0xFA01  # dspx.abi.ops.FAULT_CRASH_CMD, written out


@pytest.fixture(scope="module")
def crashable():
    env = dict(os.environ, DSPX_FAULT_INJECTION="1")
    old = os.environ.copy()
    os.environ.update(env)
    try:
        d = Device("--carveout-size", "128M", "--ddr-pool-size", "64M", "--cores", "2")
    finally:
        os.environ.clear()
        os.environ.update(old)
    yield d
    d.stop()


def test_a_bystanders_module_and_weights_survive_another_client_crashing_the_core(crashable, compiled):
    mdir = compiled("multi_input", separate=True)
    meta = json.loads((mdir / "metadata.json").read_text())
    rng = np.random.default_rng(3)
    xs = [rng.standard_normal(t["shape"]).astype(t["dtype"]) for t in meta["inputs"]]
    vm = VirtualMachine(mdir, socket=crashable.path)  # a default client: staging on first need
    try:
        assert vm.model_id  # separate weights: MODEL_LOAD'ed too
        out = vm["main"](*xs)
        ref = [np.array(r) for r in (out if isinstance(out, list) else [out])]
        cores = {p.pid for p in psutil.Process(crashable.proc.pid).children()}
        with Tasks(socket=crashable.path) as crasher:
            t = crasher.submit(crasher.rpc(FAULT_CRASH, crasher.malloc(4), crasher.malloc(4)), core=0)
            with pytest.raises(CallFailed, match="core 0 crashed"):
                crasher.wait(t, 20_000)
        got = vm["main"](*xs)  # the first call after the restart: no error, same answer
        got = got if isinstance(got, list) else [got]
        for a, b in zip(got, ref):
            np.testing.assert_array_equal(a, b)
        assert len({p.pid for p in psutil.Process(crashable.proc.pid).children()} - cores) == 1
        assert "core 0 died" in crashable.output()
    finally:
        vm.close()


# ---------------------------------------------------------------- native code that acts when loaded

CC = shutil.which("cc") or shutil.which("gcc")
needs_cc = pytest.mark.skipif(CC is None, reason="needs a C compiler")

# A file in a fake module: just enough for the loader's checks (the TVM
# library symbol), so the only thing that can refuse it is what it does.
FAKE_MODULE = 'char __tvm_ffi__library_bin[16] = "dspx-fake";\n'


def build(tmp_path, name: str, src: str, *flags: str) -> bytes:
    c = tmp_path / f"{name}.c"
    c.write_text(textwrap.dedent(src))
    out = tmp_path / f"lib{name}.so"
    subprocess.run([CC, "-shared", "-fPIC", "-O1", "-o", str(out), str(c), *flags], check=True,
                   capture_output=True)
    return out.read_bytes()


@pytest.fixture(scope="module")
def dev():
    d = Device("--carveout-size", "64M", "--ddr-pool-size", "64M")
    yield d
    d.stop()


@needs_cc
def test_a_module_whose_constructor_exits_zero_is_refused_and_the_core_lives(dev, tmp_path):
    """exit_group(0) from a constructor, with no import to see: the forked
    probe ends 'successfully' without the load having returned; the core
    never maps the module."""
    elf = build(tmp_path, "bye", FAKE_MODULE + """
        __attribute__((constructor)) static void bye(void) {
            __asm__ volatile("mov $231, %%eax\\n xor %%edi, %%edi\\n syscall" ::: "rax", "rdi", "memory");
        }
    """)
    cores = {p.pid for p in psutil.Process(dev.proc.pid).children()}
    with Client(dev.path, staging_size=1 << 20, timeout=60) as c:
        with pytest.raises(DeviceError) as e:
            c.load_module(elf)
        assert e.value.status_name == "ERR_LOAD" and "ended the loading process" in str(e.value), e.value
        assert c.ping()["version"] == "3.0.0"
    assert {p.pid for p in psutil.Process(dev.proc.pid).children()} == cores


@needs_cc
@pytest.mark.parametrize("how", ["needed", "runpath"])
def test_a_module_that_brings_its_own_library_is_refused_before_anything_runs(dev, tmp_path, how):
    """A DT_NEEDED library outside the allowed system ones, or an allowed name
    looked up through the module's own RUNPATH, is refused from the ELF bytes:
    the library's constructor (which would write a file) never runs, not even
    in the probe."""
    marker = tmp_path / "ran"
    libname = "evil" if how == "needed" else "m"
    build(tmp_path, libname, f"""
        #include <stdio.h>
        __attribute__((constructor)) static void run(void) {{
            FILE *f = fopen("{marker}", "w"); if (f) {{ fputs("ran", f); fclose(f); }}
        }}
        double dspx_evil(double x) {{ return x; }}
    """)
    if how == "runpath":
        os.rename(tmp_path / "libm.so", tmp_path / "libm.so.6")
    if how == "needed":  # linked by its absolute path: DT_NEEDED names it, no search path needed
        elf = build(tmp_path, "mod", FAKE_MODULE, "-Wl,--no-as-needed", str(tmp_path / "libevil.so"))
    else:
        elf = build(tmp_path, "mod", FAKE_MODULE, "-Wl,--no-as-needed", f"-L{tmp_path}", "-lm",
                    f"-Wl,-rpath,{tmp_path}", "-Wl,--enable-new-dtags")
    with Client(dev.path, staging_size=1 << 20, timeout=60) as c:
        with pytest.raises(DeviceError) as e:
            c.load_module(elf)
        if how == "needed":
            assert e.value.status_name == "ERR_SYMBOL" and "libevil.so" in str(e.value), e.value
        else:
            assert e.value.status_name == "ERR_LOAD" and "RUNPATH" in str(e.value), e.value
    assert not marker.exists()


@needs_cc
@pytest.mark.parametrize("act", ["write_file", "exec", "kill_parent"])
def test_a_module_constructor_with_no_imports_never_gets_to_act(dev, tmp_path, act):
    """Raw system calls from a constructor (no import for the checks to see):
    the forked probe loads it under a seccomp filter, the call ends the probe
    (SIGSYS), the load is refused and the core never runs it."""
    marker = tmp_path / "ran"
    calls = {
        # openat(AT_FDCWD, marker, O_WRONLY|O_CREAT, 0644)
        "write_file": f'sc4(257, -100, (long)"{marker}", 0101, 0644);',
        # execve("/bin/touch", {"touch", marker, 0}, 0)
        "exec": f'static const char *argv[] = {{"touch", "{marker}", 0}}; sc4(59, (long)"/bin/touch", (long)argv, 0, 0);',
        # kill(getppid(), SIGKILL): the core
        "kill_parent": "sc4(62, sc4(110, 0, 0, 0, 0), 9, 0, 0);",
    }
    elf = build(tmp_path, act, FAKE_MODULE + """
        static long sc4(long n, long a, long b, long c, long d) {
            long r;
            register long r10 __asm__("r10") = d;
            __asm__ volatile("syscall" : "=a"(r) : "a"(n), "D"(a), "S"(b), "d"(c), "r"(r10) : "rcx", "r11", "memory");
            return r;
        }
        __attribute__((constructor)) static void act(void) { %s }
    """ % calls[act])
    cores = {p.pid for p in psutil.Process(dev.proc.pid).children()}
    with Client(dev.path, staging_size=1 << 20, timeout=60) as c:
        with pytest.raises(DeviceError) as e:
            c.load_module(elf)
        assert e.value.status_name == "ERR_LOAD" and "SIGSYS" in str(e.value), e.value
        assert c.ping()["version"] == "3.0.0"
    assert not marker.exists()
    assert {p.pid for p in psutil.Process(dev.proc.pid).children()} == cores


def test_the_core_refuses_sockets_to_op_library_code(dev):
    """Past the import check (op libraries are trusted code), the core's own
    filter still refuses new sockets: EPERM in the handler.  (Exec ends the
    core, new files are refused: tests/test_reliability2_sandbox.py.)"""
    src = textwrap.dedent("""
        from numpy.f2py import os  # an escape from the import check
        from dspx.device.core import runtime as rt

        @rt.register_op(0x3F02)
        def try_socket(inp, out, tm):
            import numpy.f2py
            sock = numpy.f2py.os.sys.modules["socket"]
            try:
                sock.socket(sock.AF_INET, sock.SOCK_STREAM)
            except OSError as e:
                return e.errno
            return 0
    """)
    with Tasks(socket=dev.path) as u:
        h, _ = u.load_ops(src)
        try:
            assert u.run(0x3F02, u.malloc(4), u.malloc(4)).return_value == 1  # EPERM
        finally:
            u.unload_ops(h)
