"""dspx — offload compute from a Linux host to a DSP (simulated on x86).

    import dspx
    with dspx.Client() as dev:          # starts a private simulated device if none runs
        print(dev.ping())
    vm = dspx.VirtualMachine("build/resnet18")   # a module compiled by `dspx compile`
    out = vm["main"](x)
    sess = dspx.InferenceSession("model.onnx")   # onnxruntime's calls; compiled on first use
    y, = sess.run(None, {"x": x})
"""
from .errors import DeviceError, DspxError  # noqa: F401
from .abi.protocol import VERSION  # noqa: F401

__version__ = "0.1.0"


def __getattr__(name):
    # Lazy so `import dspx` stays light for the CLI and the device.
    if name == "Client":
        from .host.client import Client
        return Client
    if name == "VirtualMachine":
        from .host.vm import VirtualMachine
        return VirtualMachine
    if name in ("InferenceSession", "NodeArg"):
        from .host import onnxrt
        return getattr(onnxrt, name)
    if name == "tasks":
        from .host import tasks
        return tasks
    raise AttributeError(name)
