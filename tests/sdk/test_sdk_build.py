"""`dspx sdk --cflags` and `dspx build-ops`: the flags, C and C++ sources,
compiler errors passed through as they are."""
from __future__ import annotations

import subprocess
import sys

import pytest
from elftools.elf.elffile import ELFFile

from dspx import sdk

CLI = [sys.executable, "-m", "dspx.cli"]
OP_C = ("#include <dspx/dsp.h>\nstatic int f(void *i, void *o, void *t) { (void)i; (void)o; (void)t; return 0; }\n"
        "int dspx_ops_init(void) { return hb_dsp_register_fn(0x7001, f, 0); }\n")
OP_CC = ("#include <dspx/dsp.h>\ntemplate <int N> static int f(void *, void *, void *) { return N; }\n"
         'extern "C" int dspx_ops_init(void) { return hb_dsp_register_fn(0x7002, f<0>, 0); }\n')


def run(*args):
    return subprocess.run([*CLI, *args], capture_output=True, text=True, timeout=120)


def test_cflags_name_the_packaged_headers():
    p = run("sdk", "--cflags")
    assert p.returncode == 0
    assert p.stdout.strip() == f"-I{sdk.INCLUDE_DIR}" == sdk.cflags()
    assert (sdk.INCLUDE_DIR / "dspx" / "dsp.h").is_file() and (sdk.INCLUDE_DIR / "dspx" / "ivp.h").is_file()


@pytest.mark.parametrize("name, code", [("op.c", OP_C), ("op.cc", OP_CC)])
def test_build_ops_makes_a_shared_object_exporting_the_init(tmp_path, name, code):
    src = tmp_path / name
    src.write_text(code)
    out = tmp_path / "lib" / "op.so"
    p = run("build-ops", str(src), "-o", str(out))
    assert p.returncode == 0, p.stderr
    with open(out, "rb") as f:
        elf = ELFFile(f)
        assert (elf["e_type"], elf["e_machine"]) == ("ET_DYN", "EM_X86_64")
        names = {s.name for s in elf.get_section_by_name(".dynsym").iter_symbols()}
    assert "dspx_ops_init" in names


def test_compiler_errors_are_shown_as_they_are(tmp_path):
    src = tmp_path / "broken.c"
    src.write_text("#include <dspx/dsp.h>\nint dspx_ops_init(void) { return no_such_thing; }\n")
    p = run("build-ops", str(src), "-o", str(tmp_path / "x.so"))
    assert p.returncode == 1 and not (tmp_path / "x.so").exists()
    assert f"{src}:2:" in p.stderr and "error: 'no_such_thing' undeclared" in p.stderr.replace("‘", "'").replace("’", "'")
    with pytest.raises(sdk.BuildError, match="no_such_thing"):
        sdk.build_ops([src], tmp_path / "x.so", echo=False)


def test_sdk_headers_are_warning_free_in_c_and_cxx(tmp_path):
    for name, compiler in (("h.c", "cc"), ("h.cc", "c++")):
        src = tmp_path / name
        src.write_text("#include <dspx/dsp.h>\n")
        p = subprocess.run([compiler, "-fsyntax-only", "-Wall", "-Wextra", "-Werror", *sdk.SDK_FLAGS, sdk.cflags(),
                            str(src)], capture_output=True, text=True, timeout=120)
        assert p.returncode == 0, p.stderr
