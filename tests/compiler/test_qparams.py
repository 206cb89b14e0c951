"""quantize.qparams, the uint8 (scale, zero point) of a calibration range,
against figures worked out by hand from onnxruntime's asymmetric rule: the
range is first widened to contain 0, so that 0.0 is exactly a quantum."""
from __future__ import annotations

import pytest

from dspx.compiler.quantize import qparams


@pytest.mark.parametrize("lo, hi, scale, zero_point", [
    (0.5, 2.0, 2.0 / 255, 0),      # all positive: widened down to 0
    (-3.0, -1.0, 3.0 / 255, 255),  # all negative: widened up to 0
    (-1.0, 3.0, 4.0 / 255, 64),    # 0 inside: 1 / (4/255) = 63.75 rounds to 64
    (0.0, 0.0, 1.0, 0),            # an empty range: the identity
])
def test_the_calibration_range_is_widened_to_contain_zero(lo, hi, scale, zero_point):
    s, z = qparams(lo, hi)
    assert s == pytest.approx(scale, rel=1e-12) and z == zero_point
