"""Where a benchmark writes its JSON result: benchmarks/results/<name>, one home
for the make-the-directory-and-dump lines (used by llm.py and llm_kernels.py)."""
from __future__ import annotations

import json
import os

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")


def write_json(name: str, data) -> str:
    """Write ``data`` to benchmarks/results/``name`` (indented JSON); returns the path."""
    os.makedirs(RESULTS, exist_ok=True)
    path = os.path.join(RESULTS, name)
    with open(path, "w") as f:
        json.dump(data, f, indent=2)
    return path
