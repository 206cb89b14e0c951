"""`make demo` is the README's first command: run examples/demo.py as a user
would and check what it prints against its own references."""
from __future__ import annotations

import os
import re
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_make_demo_runs_every_step_and_its_answers_are_right():
    r = subprocess.run([sys.executable, os.path.join(ROOT, "examples", "demo.py")], cwd=ROOT, capture_output=True,
                       text=True, timeout=900)
    out = r.stdout + r.stderr
    assert r.returncode == 0 and "Traceback" not in out, out
    for title in ("device: start, ping, status", "run ResNet-18 on the device", "custom operator: softmax",
                  "SmolLM2-135M on the device"):
        assert f"== {title}" in out, out
    err = float(re.search(r"max \|device - onnxruntime\| = (\S+)", out).group(1))
    assert err <= 1e-4, out  # ResNet-18 against onnxruntime on the same input
    assert re.search(r"ping-pong [\d,]+ cycles: same", out), out  # the two softmax paths agree
    # the same two calls estimated on a device with the timing model: the parts add up, ping-pong is faster
    est = {m[1]: [int(v.replace(",", "")) for v in m.groups()[1:]] for m in re.finditer(
        r"estimate \(j6-vision\): (direct|ping-pong) +([\d,]+) cycles = compute ([\d,]+) \+ DDR stall ([\d,]+) "
        r"\+ DMA wait ([\d,]+) \+ overhead ([\d,]+)", out)}
    assert set(est) == {"direct", "ping-pong"}, out
    assert all(cycles == sum(parts) for cycles, *parts in est.values()), est
    assert est["ping-pong"][0] < est["direct"][0], est
    assert "Paris" in out.split("Q: What is the capital of France?", 1)[1], out
