"""dspx.cpuinfo: the first processor of a /proc/cpuinfo written out by hand."""
from __future__ import annotations

from dspx import cpuinfo

TWO_PROCESSORS = """processor\t: 0
vendor_id\t: AuthenticAMD
model name\t: AMD EPYC 7B13
cpu MHz\t\t: 2450.000
flags\t\t: fpu sse2 avx avx2 fma bmi2

processor\t: 1
model name\t: Another Name
cpu MHz\t\t: 1200.000
flags\t\t: fpu avx512f
"""


def test_the_first_processor_is_read(tmp_path):
    p = tmp_path / "cpuinfo"
    p.write_text(TWO_PROCESSORS)
    assert cpuinfo.flags(str(p)) == {"fpu", "sse2", "avx", "avx2", "fma", "bmi2"}  # not processor 1's avx512f
    assert cpuinfo.model_name(str(p)) == "AMD EPYC 7B13"
    assert cpuinfo.mhz(str(p)) == 2450.0


def test_missing_fields_and_an_unreadable_file(tmp_path):
    p = tmp_path / "bare"
    p.write_text("processor\t: 0\n")
    assert cpuinfo.flags(str(p)) == frozenset()  # readable, no flags line: none known
    assert cpuinfo.model_name(str(p)) == "unknown" and cpuinfo.mhz(str(p)) is None
    missing = str(tmp_path / "absent")
    assert cpuinfo.flags(missing) is None  # unreadable: nothing to check against
    assert cpuinfo.model_name(missing) == "unknown" and cpuinfo.mhz(missing) is None


def test_this_machine_has_flags():
    assert "sse2" in cpuinfo.flags()  # every x86-64 CPU
