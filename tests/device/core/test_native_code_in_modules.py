"""Native code in a module cannot act before the device checked it (a
constructor that ends the process, a DT_NEEDED library or RUNPATH of its
own), against a real device.  docs/reliability.md states the rules."""
from __future__ import annotations

import os
import shutil
import subprocess
import textwrap

import psutil
import pytest

from dspx.errors import DeviceError
from dspx.host.client import Client
from conftest import Device


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
