"""onnxruntime's IOBinding on ``dspx.InferenceSession``.

    io = sess.io_binding()
    io.bind_cpu_input("x", x)                      # an array (no copy when it is create_input's)
    y = np.empty((2, 24), np.float32)
    io.bind_output("relu", "cpu", 0, np.float32, y.shape, y.ctypes.data)   # written in place
    io.bind_output("softmax")                      # allocated by the session
    io.bind_ortvalue_output("tanh", ort_value)     # an onnxruntime.OrtValue on the CPU, written in place
    sess.run_with_iobinding(io)
    relu, softmax = io.copy_outputs_to_cpu()       # or io.get_outputs(): OrtValue-like

Names, shapes and element types are checked when they are bound (onnxruntime
checks at the run), each mistake one ``InputError`` naming the tensor.  The
device writes its outputs to its output buffer; a pre-allocated output is
filled from there once the run returns, and ``synchronize_*`` have nothing
to wait for.
"""
from __future__ import annotations

import ctypes

import numpy as np

from ..errors import InputError
from . import inputs as _inputs

# numpy dtype name -> ONNX TensorProto element type (what OrtValue.element_type() returns)
ONNX_ELEMENT_TYPE = {"float32": 1, "uint8": 2, "int8": 3, "uint16": 4, "int16": 5, "int32": 6, "int64": 7,
                     "bool": 9, "float16": 10, "float64": 11, "uint32": 12, "uint64": 13, "bfloat16": 16}


class OrtValue:
    """A bound output after a run, with the calls of ``onnxruntime.OrtValue`` that apply."""

    def __init__(self, array: np.ndarray, type_string: str):
        self._a, self._type = array, type_string

    def numpy(self) -> np.ndarray:
        return self._a

    def shape(self) -> list:
        return list(self._a.shape)

    def data_type(self) -> str:
        return self._type

    def element_type(self) -> int:
        return ONNX_ELEMENT_TYPE.get(self._a.dtype.name, 0)

    def device_name(self) -> str:
        return "cpu"

    def data_ptr(self) -> int:
        return self._a.ctypes.data

    def tensor_size_in_bytes(self) -> int:
        return self._a.nbytes

    def has_value(self) -> bool:
        return True

    def is_tensor(self) -> bool:
        return True


def _from_pointer(buffer_ptr: int, element_type, shape) -> np.ndarray:
    """The host memory at ``buffer_ptr`` as an array (onnxruntime's raw-pointer binding)."""
    dt, shape = np.dtype(element_type), tuple(int(d) for d in shape)
    nbytes = int(np.prod(shape, dtype=np.int64)) * dt.itemsize
    raw = (ctypes.c_uint8 * nbytes).from_address(int(buffer_ptr))
    return np.frombuffer(raw, np.uint8).view(dt).reshape(shape)


def _ortvalue_array(v, name: str) -> np.ndarray:
    """The memory of an OrtValue (onnxruntime's or ours) as an array, by its pointer."""
    from .onnxrt import ORT_TYPES

    _check_device(v.device_name(), name)
    dtype = {t: d for d, t in ORT_TYPES.items()}.get(v.data_type())
    if dtype is None:
        raise InputError(f"{name!r}: an OrtValue of {v.data_type()} is not a tensor dspx binds", name)
    return _from_pointer(v.data_ptr(), dtype, v.shape())


def _check_device(device_type: str, name: str) -> None:
    if str(device_type).lower() != "cpu":
        raise InputError(f"{name!r}: device_type {device_type!r}: dspx binds host memory ('cpu'); the device "
                         f"reads and writes its own buffers", name, "cpu", device_type)


class IOBinding:
    """Inputs and outputs bound to a session before ``run_with_iobinding``."""

    def __init__(self, session):
        self._session = session
        self._inputs: dict[str, object] = {}
        self._outputs: dict[str, np.ndarray | None] = {}  # name -> pre-allocated array, or None
        self._results: list[OrtValue] = []

    def _spec(self, side: str, name: str) -> _inputs.TensorSpec:
        specs = {t.name: t for t in self._session._specs(side)}
        if name not in specs:
            raise InputError(f"no {side[:-1]} named {name!r} ({side}: {', '.join(specs)})", name, list(specs), name)
        return specs[name]

    # ------------------------------------------------------------------ inputs
    def bind_cpu_input(self, name: str, arr_on_cpu) -> None:
        self._spec("inputs", name)
        self._inputs[name] = arr_on_cpu  # checked against the model's input at the run, as every feed

    def bind_input(self, name: str, device_type, device_id, element_type, shape, buffer_ptr) -> None:
        """Host memory at ``buffer_ptr`` (``element_type`` = a numpy dtype, as onnxruntime takes)."""
        self._spec("inputs", name)
        _check_device(device_type, name)
        self._inputs[name] = _from_pointer(buffer_ptr, element_type, shape)

    def bind_ortvalue_input(self, name: str, ortvalue) -> None:
        """An ``onnxruntime.OrtValue`` on the CPU (or one of ours), read where it lies."""
        self._spec("inputs", name)
        self._inputs[name] = _ortvalue_array(ortvalue, name)

    def clear_binding_inputs(self) -> None:
        self._inputs.clear()

    def synchronize_inputs(self) -> None:
        """Nothing to wait for: inputs are read when the run starts."""

    # ------------------------------------------------------------------ outputs
    def bind_output(self, name: str, device_type: str = "cpu", device_id: int = 0, element_type=None, shape=None,
                    buffer_ptr: int | None = None) -> None:
        """An output the run produces; with ``buffer_ptr`` (and its element
        type and shape) written into that memory, else allocated."""
        spec = self._spec("outputs", name)
        _check_device(device_type, name)
        if buffer_ptr is None:
            self._outputs[name] = None
            return
        if element_type is None or shape is None:
            raise InputError(f"output {name!r}: a buffer_ptr needs its element_type and shape", name, str(spec))
        got = f"{np.dtype(element_type).name}[{', '.join(str(int(d)) for d in shape)}]"
        if got != str(spec):
            raise InputError(f"output {name!r} is {spec}; the bound buffer is {got}", name, str(spec), got)
        self._outputs[name] = _from_pointer(buffer_ptr, element_type, shape)

    def bind_ortvalue_output(self, name: str, ortvalue) -> None:
        """A pre-allocated output: an ``onnxruntime.OrtValue`` on the CPU, written in place."""
        a = _ortvalue_array(ortvalue, name)
        self.bind_output(name, "cpu", 0, a.dtype, a.shape, a.ctypes.data)

    def clear_binding_outputs(self) -> None:
        self._outputs.clear()
        self._results = []

    def synchronize_outputs(self) -> None:
        """Nothing to wait for: outputs are on the host when the run returns."""

    def get_outputs(self) -> list[OrtValue]:
        """The bound outputs of the last run, in the order they were bound."""
        return list(self._results)

    def copy_outputs_to_cpu(self) -> list[np.ndarray]:
        return [np.array(v.numpy(), copy=True) for v in self._results]

    # ------------------------------------------------------------------ the run (InferenceSession.run_with_iobinding)
    def _run(self, run) -> None:
        """``run(names, feed)`` gives the named outputs; bound buffers are filled from them."""
        if not self._outputs:
            raise InputError("run_with_iobinding: no output is bound (bind_output(name) at least one)")
        names = list(self._outputs)
        outs = run(names, dict(self._inputs))
        types = {t.name: t.type for t in self._session.get_outputs()}
        results = []
        for name, out in zip(names, outs):
            target = self._outputs[name]
            if target is not None:
                np.copyto(target, out)
                out = target
            results.append(OrtValue(out, types[name]))
        self._results = results


__all__ = ["IOBinding", "OrtValue"]
