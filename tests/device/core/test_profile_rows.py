"""The profile records when the printf ring is short of room
(inference.profile_text, docs/protocol.md "Profile records"): the rows with
the fewest cycles go first, the others stay in call order, and the header
says how many were dropped.  The expected text is written out by hand."""
from __future__ import annotations

from dspx.device.core.inference import profile_text

RUN = [("kernel", "dspx.kernels.conv2d", "1x3x8x8", 0, 9_000_000),  # a 9 ms conv
       ("vm", "vm.builtin.alloc_tensor", "", 5, 15),                # 10 ns
       ("kernel", "dspx.kernels.add", "1x4", 100, 120),             # 20 ns
       ("tvm", "fused_mean", "1x4", 200, 700)]                      # 500 ns
CONV = "#dspx-profile-row\tkernel\tdspx.kernels.conv2d\t1x3x8x8\t1\t9000000\n"
ALLOC = "#dspx-profile-row\tvm\tvm.builtin.alloc_tensor\t\t1\t10\n"
ADD = "#dspx-profile-row\tkernel\tdspx.kernels.add\t1x4\t1\t20\n"
MEAN = "#dspx-profile-row\ttvm\tfused_mean\t1x4\t1\t500\n"


def head(rows: int, dropped: int) -> str:
    return f"#dspx-profile\t1\truns=1\tentry_cycles=9000700\trows={rows}\tdropped={dropped}\n"


def test_all_rows_when_they_fit():
    want = head(4, 0) + CONV + ALLOC + ADD + MEAN
    assert profile_text([RUN], 9_000_700, len(want) + 4) == want


def test_the_smallest_rows_are_dropped_first_and_counted():
    want = head(2, 2) + CONV + MEAN  # 10 ns and 20 ns gone, the 9 ms conv kept
    assert profile_text([RUN], 9_000_700, len(want) + 4) == want
    assert profile_text([RUN], 9_000_700, len(want) + 3) == head(1, 3) + CONV
