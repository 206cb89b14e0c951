"""dspx — offload compute from a Linux host to a DSP (simulated on x86).

    import dspx
    with dspx.Client() as dev:          # the per-user background device, started on first use
        print(dev.ping())
    vm = dspx.VirtualMachine("build/resnet18")   # a module compiled by `dspx compile`
    out = vm["main"](x)
    sess = dspx.InferenceSession("model.onnx")   # onnxruntime's calls; compiled on first use
    y, = sess.run(None, {"x": x})
    with dspx.Tasks() as ucp: ...               # the UCP flow: custom operators
"""
from .errors import (DeviceError, DspxError, InputError, MissingExtra, OpFailed)  # noqa: F401
from .abi.protocol import VERSION  # noqa: F401

__version__ = "0.1.0"

# The public names loaded on first use, so `import dspx` stays light for the
# CLI and the device: name -> (module, attribute; None: the module itself).
_LAZY = {
    "Client": ("host.client", "Client"),
    "VirtualMachine": ("host.vm", "VirtualMachine"),
    "BenchmarkResult": ("host.vm", "BenchmarkResult"),
    "InferenceSession": ("host.onnxrt", "InferenceSession"),
    "SessionOptions": ("host.onnxrt", "SessionOptions"),
    "NodeArg": ("host.onnxrt", "NodeArg"),
    "IOBinding": ("host.iobinding", "IOBinding"),
    "Tasks": ("host.tasks", "Tasks"),
    "ProfileReport": ("host.profile", "ProfileReport"),
    "tasks": ("host.tasks", None),
    "errors": ("errors", None),
}

__all__ = ["Client", "VirtualMachine", "BenchmarkResult", "InferenceSession", "SessionOptions", "NodeArg",
           "IOBinding", "Tasks", "ProfileReport", "tasks", "errors", "DspxError", "DeviceError", "InputError",
           "MissingExtra", "OpFailed", "VERSION", "__version__"]


def __getattr__(name):
    where = _LAZY.get(name)
    if where is None:
        raise AttributeError(f"module 'dspx' has no attribute {name!r}")
    import importlib

    module = importlib.import_module(f".{where[0]}", __name__)
    return module if where[1] is None else getattr(module, where[1])


def __dir__():
    return sorted(set(globals()) | set(__all__))
