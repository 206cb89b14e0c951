"""The verifier the compiler checks a module with: a device.

``compile_onnx(..., verifier=DeviceVerifier())`` runs the compiled module
where it will run, through the real loader, kernels and weights path, on a
device the verifier starts (a private one, ~0.25 s) on first use and reuses
for every module it checks; ``DeviceVerifier(socket)`` uses a running one.
"""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from .launcher import PrivateDevice
from .vm import VirtualMachine


class DeviceVerifier:
    """Runs compiled modules on a device it owns (started on first use);
    a ``dspx.compiler.verify.ModuleRunner``."""

    def __init__(self, socket: str | None = None):
        self.socket = socket
        self._dev = None

    def _path(self) -> str:
        if self.socket is None:
            self._dev = PrivateDevice()
            self.socket = self._dev.path
        return self.socket

    def __call__(self, outdir, samples: list[list[np.ndarray]]) -> list[list[np.ndarray]]:
        """The outputs of each sample (a list of inputs), all through one load of the module."""
        outdir = Path(outdir)
        meta = json.loads((outdir / "metadata.json").read_text())
        need = (outdir / meta["module"]).stat().st_size
        wfile = (meta.get("weights") or {}).get("file")
        if wfile:
            need = max(need, (outdir / wfile).stat().st_size)
        vm = VirtualMachine(outdir, socket=self._path(), staging_size=max(need + (1 << 20), 16 << 20), kv_size=0)
        try:
            outs = []
            for inputs in samples:
                out = vm["main"](*inputs)
                outs.append([np.array(o) for o in (out if isinstance(out, (list, tuple)) else [out])])
            return outs
        finally:
            vm.close()

    def run(self, outdir, inputs: list[np.ndarray]) -> list[np.ndarray]:
        """The outputs of one call."""
        return self(outdir, [inputs])[0]

    def close(self) -> None:
        if self._dev is not None:
            self._dev.stop()
            self._dev = None
            self.socket = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
