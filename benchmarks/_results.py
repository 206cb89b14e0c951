"""Where a benchmark writes its JSON result: benchmarks/results/<name>, one home
for the make-the-directory-and-dump lines (used by llm.py and llm_kernels.py);
and the compiled example modules the benchmarks share with the tests."""
from __future__ import annotations

import json
import os

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULTS = os.path.join(ROOT, "benchmarks", "results")


def write_json(name: str, data) -> str:
    """Write ``data`` to benchmarks/results/``name`` (indented JSON); returns the path."""
    os.makedirs(RESULTS, exist_ok=True)
    path = os.path.join(RESULTS, name)
    with open(path, "w") as f:
        json.dump(data, f, indent=2)
    return path


def example(name: str, kernels: bool = False):
    """A compiled example module from the tests' cache (compiled there if
    missing), and its ONNX file."""
    import sys

    sys.path.insert(0, os.path.join(ROOT, "tests"))
    from conftest import compiled_example  # (conftest sets the tests' $DSPX_CACHE)

    from dspx import cache
    from dspx.compiler import examples
    from dspx.host.verifier import DeviceVerifier

    onnx = examples.build_all(str(cache.area("onnx")))[name]
    with DeviceVerifier() as verifier:  # its device starts only if the module is not cached
        return compiled_example(name, onnx, verifier, kernels=kernels), onnx
