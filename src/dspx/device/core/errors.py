"""Device-side failures: each carries the wire status the service answers with."""
from __future__ import annotations

from dspx.memory import AddressError
from dspx.abi.protocol import Status


class CoreError(Exception):
    status: Status = Status.ERR_GENERIC


class LoadError(CoreError):
    """The staged bytes are not a module this device can load (ERR_LOAD)."""

    status = Status.ERR_LOAD


class NoMemError(CoreError):
    """The DDR pool cannot hold the module (ERR_NOMEM)."""

    status = Status.ERR_NOMEM

    def __init__(self, message: str, requested: int, free: int, total: int = 0):
        super().__init__(message)
        self.oom_requested, self.oom_free, self.oom_total = requested, free, total


class SymbolError(CoreError):
    """A symbol the module needs is not exported by the firmware, or the
    module lacks a symbol the loader needs (ERR_SYMBOL).  ``.symbol`` names it."""

    status = Status.ERR_SYMBOL

    def __init__(self, symbol: str, message: str | None = None):
        super().__init__(message or f"unresolved symbol {symbol!r}")
        self.symbol = symbol


class WeightsError(CoreError):
    """Weights that are truncated, corrupt, or not the ones the module was
    compiled with (ERR_WEIGHTS)."""

    status = Status.ERR_WEIGHTS


class TensorError(CoreError):
    """Inputs that do not match the module's signature (ERR_TENSOR)."""

    status = Status.ERR_TENSOR


class HandleError(CoreError):
    """A module or weights this core does not hold (ERR_HANDLE): it could not
    be loaded again after a restart."""

    status = Status.ERR_HANDLE


class CallError(CoreError):
    """The module's entry raised while running (ERR_CALL)."""

    status = Status.ERR_CALL


# ------------------------------------------------ DSP runtime (custom operators)

class RuntimeMisuse(CoreError, ValueError):
    """A runtime API called wrongly: bad bank/channel/size, double free, a
    wait with nothing in flight, an API used outside a task (ERR_INVALID)."""

    status = Status.ERR_INVALID


class MapError(CoreError, AddressError):
    """mem_map of a DSP range not wholly inside one of the task's buffers (ERR_ADDR)."""

    status = Status.ERR_ADDR

    def __init__(self, addr: int, nbytes: int, reason: str):
        super().__init__(f"mem_map(0x{addr:x}, {nbytes}): {reason}")
        self.addr, self.nbytes = addr, nbytes


class TileExhausted(CoreError, MemoryError):
    """An L2 bank has no hole large enough for a tile (ERR_NOMEM)."""

    status = Status.ERR_NOMEM

    def __init__(self, requested: int, bank: int, free: int, largest: int, total: int):
        super().__init__(f"L2 bank {bank}: cannot allocate a {requested}-byte tile "
                         f"(free {free} of {total} bytes, largest hole {largest})")
        self.requested, self.bank, self.free, self.largest, self.total = requested, bank, free, largest, total


class DmaError(RuntimeMisuse):
    """DMA misuse (bad channel, sizes beyond the arrays, a dead tile, a wait
    with nothing in flight) or a copy that failed in the engine (ERR_INVALID)."""


class DmaTimeout(CoreError, TimeoutError):
    """A DMA wait that did not complete within its timeout (ERR_TIMEOUT)."""

    status = Status.ERR_TIMEOUT


class RuntimeBroken(CoreError):
    """User code broke the core's own runtime (the shim's canaries, DMA
    threads or queues): its caller gets ERR_CALL naming what broke, and the
    core restarts before anyone else's job runs there."""

    status = Status.ERR_CALL


# ---------------------------------------------------- op registry / op libraries

class OpLoadError(LoadError):
    """An op library that cannot be loaded: not UTF-8, a syntax error, or an
    exception while its top level runs (ERR_LOAD).  ``line`` is 1-based, 0 = unknown."""

    def __init__(self, message: str, line: int = 0):
        super().__init__(message)
        self.line = line

    @property
    def error_line(self) -> int:  # the name the core copies into OpsLoadResp
        return self.line


class OpSymbolError(SymbolError):
    """An op library imports or names something outside its export table
    (ERR_SYMBOL); ``.symbol`` names it, ``line`` is where."""

    def __init__(self, symbol: str, message: str, line: int = 0):
        super().__init__(symbol, message)
        self.line = line

    @property
    def error_line(self) -> int:
        return self.line


class OpBusy(CoreError):
    """A command id that is already registered (ERR_BUSY)."""

    status = Status.ERR_BUSY

    def __init__(self, cmd: int, owner: int, name: str):
        lib = "a built-in operator" if owner == 0 else f"op library {owner}"
        super().__init__(f"command 0x{cmd:x} is already registered by {lib} ({name!r})")
        self.cmd, self.owner = cmd, owner


class NoSuchOp(CoreError, LookupError):
    """A task naming a command id no operator is registered under (ERR_OP)."""

    status = Status.ERR_OP

    def __init__(self, cmd: int):
        super().__init__(f"no operator registered for command 0x{cmd:x}")
        self.cmd = cmd


class UnknownLibrary(CoreError, LookupError):
    """An op library handle that is not loaded (ERR_HANDLE)."""

    status = Status.ERR_HANDLE

    def __init__(self, handle: int):
        super().__init__(f"no op library with handle {handle}")
        self.handle = handle
