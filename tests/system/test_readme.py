"""The README's (and docs/coming-from.md's) Python examples, run as a user runs them: every ```python
block, in order, as one script, in a directory holding what the README says
it holds (model.onnx and build/model from `dspx compile`).  One device
serves them all through $DSPX_SOCKET (as `dspx serve` would), so the module
loader starts once, not once per private device."""
from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

from conftest import Device

README = Path(__file__).resolve().parents[2] / "README.md"
COMING_FROM = README.parent / "docs" / "coming-from.md"  # its examples assume the same files


def python_blocks(text: str) -> list[str]:
    return re.findall(r"^```python\n(.*?)^```", text, re.M | re.S)


def test_readme_has_python_examples():
    blocks = python_blocks(README.read_text())
    assert blocks and all("import" in b for b in blocks[:1])


def test_readme_python_examples_run(tmp_path, compiled, example_onnx):
    shutil.copy(example_onnx["multi_output"], tmp_path / "model.onnx")
    shutil.copytree(compiled("multi_output"), tmp_path / "build" / "model")
    # InferenceSession's first use compiles (test_onnxrt covers that); here its
    # cache holds the same model compiled, under the key it will look for
    # (computed in the script's own process: the compiler's sources are in the key).
    cache = tmp_path / "cache"
    seed = ("import shutil\nfrom dspx import cache\nfrom dspx.host.onnxrt import AREA, cache_key\n"
            "shutil.copytree('build/model', cache.area(AREA) / cache_key('model.onnx'))\n")
    script = tmp_path / "readme_examples.py"
    script.write_text("\n\n".join([seed, *python_blocks(README.read_text()), *python_blocks(COMING_FROM.read_text())]))
    dev = Device("--ddr-pool-size", "96M", "--cores", "2")  # the default carveout: Client()'s default staging
    try:
        env = {**os.environ, "DSPX_SOCKET": dev.path, "DSPX_CACHE": str(cache)}
        r = subprocess.run([sys.executable, str(script)], cwd=tmp_path, env=env, capture_output=True, text=True,
                           timeout=300)
    finally:
        dev.stop()
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-4000:]
    assert "Execution time summary" in r.stdout and "('x', [2, 32], 'tensor(float)')" in r.stdout
    assert "compiling" not in r.stderr  # the seeded cache was used
