"""``VirtualMachine``: a compiled module on the device, called like TVM's
``relax.VirtualMachine`` — swap the class, keep the calls.

    vm = VirtualMachine("build/resnet18")      # dir with model.so + metadata.json
    y = vm["main"](x)                          # numpy / DLPack in, copies out
    x_dev = vm.create_input((1, 3, 224, 224), "float32")   # lives in input_buf
    views = vm.run_nocopy(x_dev)               # views of output_buf, valid until the next call
"""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from ..errors import DspxError
from .client import Client


def _as_numpy(x) -> np.ndarray:
    if isinstance(x, np.ndarray):
        return x
    if hasattr(x, "__dlpack__"):
        return np.from_dlpack(x)
    if hasattr(x, "numpy"):  # tvm.runtime.Tensor and friends
        return x.numpy()
    return np.asarray(x)


def find_module(path) -> tuple[Path, dict]:
    """(model.so path, metadata dict) from a module directory or .so file."""
    p = Path(path)
    so = p / "model.so" if p.is_dir() else p
    if not so.is_file():
        raise DspxError(f"no compiled module at {so} (build one with `dspx compile MODEL.onnx -o DIR`)")
    meta_path = so.parent / "metadata.json"
    meta = json.loads(meta_path.read_text()) if meta_path.is_file() else {}
    return so, meta


class VirtualMachine:
    def __init__(self, module, client: Client | None = None, *, socket: str | None = None, **client_opts):
        so, self.metadata = find_module(module)
        self._own_client = client is None
        self.client = client or Client(socket, **client_opts)
        self.model_id = 0
        self.handle = None
        self.last_cycles = 0
        self.last_printf = ""
        try:
            self.module = self.client.load_module(so.read_bytes())
            self.handle = self.module.handle
            # metadata.json names a separate weights file as weights.file (docs/compiler.md)
            w = self.metadata.get("weights")
            wfile = (w.get("file") if isinstance(w, dict) else None) or self.metadata.get("weights_file")
            if wfile:
                self.model_id, _ = self.client.load_weights((so.parent / wfile).read_bytes())
        except BaseException:
            self.close()
            raise
        self.entry = self.metadata.get("entry", "main")

    # ------------------------------------------------------------------ calls
    def __getitem__(self, name: str):
        if name != self.entry:
            raise KeyError(f"module has no function {name!r} (entry: {self.entry!r})")
        return self._call_copy

    def _run(self, inputs, repeat: int = 0, kv_resident: bool = False, kv_inputs=()):
        arrays = [_as_numpy(x) for x in inputs]
        res = self.client.infer(self.handle, arrays, model_id=self.model_id, repeat=repeat,
                                kv_resident=kv_resident, kv_inputs=kv_inputs)
        self.last_cycles = res.cycles
        self.last_printf = res.printf
        return [self.client.output_view(d) for d in res.descs]

    def _call_copy(self, *inputs):
        outs = [np.array(v, copy=True) for v in self._run(inputs)]
        return outs[0] if len(outs) == 1 else outs

    def run_nocopy(self, *inputs, **kw):
        """Outputs as views of output_buf: valid until the next call."""
        outs = self._run(inputs, **kw)
        return outs[0] if len(outs) == 1 else outs

    def create_input(self, shape, dtype="float32") -> np.ndarray:
        return self.client.create_input(shape, dtype)

    def reserve_io(self, input_bytes: int, output_bytes: int) -> None:
        self.client.reserve_io(input_bytes, output_bytes, self.module.io_num_inputs)

    # ------------------------------------------------------------------ lifetime
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def close(self) -> None:
        c = getattr(self, "client", None)
        if c is None:
            return
        try:
            if not c._closed:
                if self.model_id:
                    c.unload_weights(self.model_id)
                if self.handle is not None:
                    c.unload_module(self.handle)
        finally:
            self.model_id, self.handle = 0, None
            if self._own_client:
                c.close()
            self.client = None

    def __del__(self):
        if getattr(self, "_own_client", False) and getattr(self, "client", None) is not None:
            try:
                self.client.close()
            except Exception:
                pass


def load_input(path: str, shape=None, dtype=None) -> np.ndarray:
    """An input from .npy, or raw .bin with an explicit shape and dtype."""
    if path.endswith(".npy"):
        return np.load(path)
    if shape is None or dtype is None:
        raise DspxError(f"{path}: raw input needs --shape and --dtype")
    return np.fromfile(path, dtype=dtype).reshape(shape)


__all__ = ["VirtualMachine", "find_module", "load_input"]
