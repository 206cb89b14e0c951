"""Structure-aware fuzzing of the device service (docs/testing.md).

``tests.fuzz.fuzzer`` is the library (used by the short pytest run in
``tests/fuzz/test_fuzz.py`` and by the long run ``benchmarks/fuzz.py``).
"""
from .fuzzer import Fuzzer, FuzzStats, check_response, compiled_example, device_footprint  # noqa: F401
