"""Command-id → operator registry, and op libraries loaded at runtime.

An op library is Python source shipped to the running device (the UCP
``hb_dsp_register_fn`` flow without reflashing).  Before any of it runs,
``load_library`` parses it and checks every import against the export table:

* allowed imports: ``numpy`` and ``numpy.*``, ``math``, ``dspx.device.core.runtime``
  (also as ``from dspx.device.core import runtime``), and from the runtime only
  the names in ``runtime.__all__``; anything else is ``ERR_SYMBOL`` naming it;
* the names ``__import__``, ``__builtins__``, ``open``, ``exec``, ``eval`` and ``compile`` are
  refused (``ERR_SYMBOL``).  This is a guard against mistakes, not a sandbox:
  an op library runs with the device's privileges.

Then its top level runs and its ``register_op`` calls are collected; the
library is installed only if every command id is free (``ERR_BUSY``
otherwise, and nothing of it stays registered).

Bytes starting with the ELF magic are a native library (C/C++ against the
SDK): checked, probed and loaded by ``native``, then installed by the same
rules; its handlers run through the runtime shim.
"""
from __future__ import annotations

import ast
import linecache
import numbers
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

from ...abi.protocol import Status
from . import native, runtime
from .errors import NoSuchOp, OpBusy, OpLoadError, OpSymbolError, RuntimeBroken, UnknownLibrary

RUNTIME_MODULE = "dspx.device.core.runtime"
ALLOWED_MODULES = ("numpy", "math", RUNTIME_MODULE)
FORBIDDEN_NAMES = frozenset({"__import__", "__builtins__", "open", "exec", "eval", "compile"})
EXPORTS = frozenset(runtime.__all__)
BUILTIN_LIB = 0  # the lib handle of firmware (built-in) operators
INT32 = (-(1 << 31), (1 << 31) - 1)


@dataclass(frozen=True)
class Op:
    cmd: int
    handler: Callable
    latency_us: int
    name: str
    lib: int


class OpInfo(NamedTuple):
    cmd: int
    name: str
    latency_us: int
    lib: int


class OpResult(NamedTuple):
    """A finished task.  ``status`` is SUCCESS when the handler returned an
    int (its value is ``return_value``, 0 = success by convention); otherwise
    the most specific code: the ``.status`` of a typed runtime error the
    handler let escape (e.g. ERR_ADDR from mem_map), else ERR_CALL — and then
    ``return_value`` repeats the status and the printf text ends with why."""

    status: int
    return_value: int
    cycles: int
    printf: str
    cost: dict | None = None  # the timing model's record of the call (runtime.TaskContext.end_cost), or None


class _Library:
    def __init__(self, handle: int, code_name: str | None, cmds: list[int],
                 native_lib: native.NativeLibrary | None = None):
        self.handle, self.code_name, self.cmds, self.native = handle, code_name, cmds, native_lib


def _dotted(node: ast.AST) -> str | None:
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if isinstance(node, ast.Name):
        parts.append(node.id)
        return ".".join(reversed(parts))
    return None


def _module_allowed(name: str) -> bool:
    return name in ALLOWED_MODULES or name.startswith("numpy.")


def check_source(tree: ast.Module) -> None:
    """Refuse imports outside the export table and the forbidden names."""
    runtime_aliases: set[str] = set()  # names bound to the runtime module
    nodes = sorted((n for n in ast.walk(tree) if hasattr(n, "lineno")), key=lambda n: (n.lineno, n.col_offset))
    for node in nodes:
        line = node.lineno
        if isinstance(node, ast.Import):
            for a in node.names:
                if not _module_allowed(a.name):
                    raise OpSymbolError(a.name, f"line {line}: import of {a.name!r} is not allowed "
                                        f"(op libraries may import {', '.join(ALLOWED_MODULES)})", line)
                if a.name == RUNTIME_MODULE and a.asname:
                    runtime_aliases.add(a.asname)
        elif isinstance(node, ast.ImportFrom):
            mod = "." * node.level + (node.module or "")
            for a in node.names:
                full = mod + a.name if mod.endswith(".") else f"{mod}.{a.name}"
                if a.name == "*":
                    raise OpSymbolError(full, f"line {line}: {full!r} (from {mod} import *) is not allowed; "
                                        "import the names you use", line)
                if full == RUNTIME_MODULE:
                    runtime_aliases.add(a.asname or a.name)
                elif node.level or not _module_allowed(mod):
                    raise OpSymbolError(full, f"line {line}: import of {full!r} is not allowed "
                                        f"(op libraries may import {', '.join(ALLOWED_MODULES)})", line)
                elif mod == RUNTIME_MODULE and a.name not in EXPORTS:
                    raise OpSymbolError(full, f"line {line}: {full!r} is not in the runtime's export "
                                        "table (dspx.device.core.runtime.__all__)", line)
        elif isinstance(node, ast.Name) and node.id in FORBIDDEN_NAMES:
            raise OpSymbolError(node.id, f"line {line}: {node.id!r} is not available to op libraries", line)
    # runtime.X through an alias, or spelled out as dspx.device.core.runtime.X
    for node in nodes:
        if isinstance(node, ast.Attribute):
            dotted = _dotted(node.value)
            if dotted in runtime_aliases or dotted == RUNTIME_MODULE:
                if node.attr not in EXPORTS:
                    line = node.lineno
                    full = f"{RUNTIME_MODULE}.{node.attr}"
                    raise OpSymbolError(full, f"line {line}: {full!r} is not in the runtime's export "
                                        "table (dspx.device.core.runtime.__all__)", line)


MAX_TEXT = 4096  # characters of an exception's text kept in a status message


def clip(text: str, limit: int = MAX_TEXT) -> str:
    """An exception's text, bounded: a 2 MB message must not become a 2 MB reply."""
    if len(text) <= limit:
        return text
    half = limit // 2
    return f"{text[:half]} … [{len(text) - 2 * half} characters left out] … {text[-half:]}"


def check_op_name(cmd: int, name, filename: str) -> None:
    """An op's name travels in every OPS_LIST: it must be text that encodes."""
    if not isinstance(name, str) or not name:
        raise OpLoadError(f"{filename}: op 0x{cmd:x} has name {type(name).__name__} {clip(repr(name), 80)}; "
                          "an op name is a non-empty str")
    try:
        name.encode("utf-8")
    except UnicodeEncodeError as e:
        raise OpLoadError(f"{filename}: op 0x{cmd:x} name {name!r} cannot be encoded as UTF-8 ({e.reason} at "
                          f"{e.start})") from None


def _line_in(tb, filename: str) -> int:
    line = 0
    for frame, lineno in traceback.walk_tb(tb):
        if frame.f_code.co_filename == filename:
            line = lineno
    return line


class OpRegistry:
    """One core's operators.  Firmware operators go in with ``register``
    before the service starts; op libraries with ``load_library``."""

    def __init__(self):
        self._ops: dict[int, Op] = {}
        self._libs: dict[int, _Library] = {}
        self._next_handle = BUILTIN_LIB + 1
        self._firmware: list[native.NativeLibrary] = []

    def register(self, cmd: int, handler: Callable, latency_us: int = 0, name: str | None = None,
                 lib: int = BUILTIN_LIB) -> None:
        if cmd in self._ops:
            old = self._ops[cmd]
            raise OpBusy(cmd, old.lib, old.name)
        self._ops[cmd] = Op(cmd, handler, latency_us, name or getattr(handler, "__name__", f"op_{cmd:x}"), lib)

    def __contains__(self, cmd: int) -> bool:
        return cmd in self._ops

    def ops(self) -> list[OpInfo]:
        return [OpInfo(o.cmd, o.name, o.latency_us, o.lib) for o in sorted(self._ops.values(), key=lambda o: o.cmd)]

    # ---------------------------------------------------------------- libraries
    def load_library(self, source: str | bytes, filename: str = "<oplib>", handle: int | None = None) -> int:
        """Check, run and install an op library; returns its handle.  ``handle``
        lets a device give every core's registry the same number."""
        if native.is_native(source):
            return self._load_native(bytes(source), filename, handle)
        if isinstance(source, bytes):
            try:
                source = source.decode("utf-8")
            except UnicodeDecodeError as e:
                raise OpLoadError(f"{filename}: op library is not UTF-8 text (byte {e.start})") from None
        try:
            tree = ast.parse(source, filename)
        except SyntaxError as e:
            line = e.lineno or 0
            raise OpLoadError(f"{filename}, line {line}: {e.msg}", line) from None
        except ValueError as e:  # e.g. NUL bytes in the source
            raise OpLoadError(f"{filename}: {e}") from None
        check_source(tree)

        if handle is None:
            handle = self._next_handle
        elif handle in self._libs or handle == BUILTIN_LIB:
            raise OpLoadError(f"op library handle {handle} is already in use")
        # A name of its own, so tracebacks show this library's lines even when
        # several were loaded from the same file name.
        code_name = f"<oplib {handle}: {filename}>"
        namespace = {"__name__": f"dspx_oplib_{handle}", "__file__": filename}
        linecache.cache[code_name] = (len(source), None, source.splitlines(True), code_name)
        try:
            ops = self._run_top_level(tree, filename, code_name, namespace)
            for cmd, _, _, name in ops:
                check_op_name(cmd, name, filename)
            for i, (cmd, _, _, name) in enumerate(ops):
                if cmd in self._ops:
                    raise OpBusy(cmd, self._ops[cmd].lib, self._ops[cmd].name)
                if any(cmd == other for other, *_ in ops[:i]):
                    raise OpBusy(cmd, handle, name)
        except BaseException:
            linecache.cache.pop(code_name, None)
            raise
        for cmd, fn, latency, name in ops:
            self._ops[cmd] = Op(cmd, fn, latency, name, handle)
        self._libs[handle] = _Library(handle, code_name, [cmd for cmd, *_ in ops])
        self._next_handle = max(self._next_handle, handle + 1)
        return handle

    def _install_native(self, lib: native.NativeLibrary, handle: int) -> list[int]:
        """Register a native library's ops, all or none (ERR_BUSY)."""
        seen: set[int] = set()
        for cmd, op, _ in lib.ops:
            if cmd in self._ops:
                raise OpBusy(cmd, self._ops[cmd].lib, self._ops[cmd].name)
            if cmd in seen:
                raise OpBusy(cmd, handle, op.name)
            seen.add(cmd)
        for cmd, op, latency in lib.ops:
            self._ops[cmd] = Op(cmd, op, latency, op.name, handle)
        return [cmd for cmd, *_ in lib.ops]

    def _load_native(self, data: bytes, filename: str, handle: int | None) -> int:
        if handle is None:
            handle = self._next_handle
        elif handle in self._libs or handle == BUILTIN_LIB:
            raise OpLoadError(f"op library handle {handle} is already in use")
        lib = native.NativeLibrary(data, filename)
        try:
            cmds = self._install_native(lib, handle)
        except BaseException:
            lib.close()
            raise
        self._libs[handle] = _Library(handle, None, cmds, lib)
        self._next_handle = max(self._next_handle, handle + 1)
        return handle

    def register_native(self, data: bytes, filename: str, names: dict[int, str] | None = None) -> None:
        """Firmware operators from a native library (lib handle 0, never
        unloaded; trusted, so no probe)."""
        lib = native.NativeLibrary(data, filename, probe=False, names=names)
        try:
            self._install_native(lib, BUILTIN_LIB)
        except BaseException:
            lib.close()
            raise
        self._firmware.append(lib)

    @staticmethod
    def _run_top_level(tree: ast.Module, filename: str, code_name: str, namespace: dict) -> list:
        try:
            with runtime.collecting() as collected:
                exec(compile(tree, code_name, "exec"), namespace)
        except SystemExit:
            raise  # the worker names it: user code tried to end the core
        except BaseException as e:  # KeyboardInterrupt too: a status, not the end of the core
            line = _line_in(e.__traceback__, code_name)
            where = f", line {line}" if line else ""
            raise OpLoadError(f"{filename}{where}: {type(e).__name__}: {clip(str(e))}", line) from None
        if not collected.ops:
            raise OpLoadError(f"{filename}: the library registers no operators (call register_op)")
        return collected.ops

    def unload_library(self, handle: int) -> None:
        lib = self._libs.pop(handle, None)
        if lib is None:
            raise UnknownLibrary(handle)
        for cmd in lib.cmds:
            del self._ops[cmd]
        if lib.native is not None:
            lib.native.close()
        else:
            linecache.cache.pop(lib.code_name, None)

    def libraries(self) -> list[int]:
        return sorted(self._libs)

    # ---------------------------------------------------------------- tasks
    def run(self, cmd: int, input: np.ndarray, output: np.ndarray, task: runtime.TaskContext) -> OpResult:
        """Run the operator for ``cmd`` on the task's input/output arrays.
        NoSuchOp (ERR_OP) if nothing is registered; everything that goes
        wrong inside the handler comes back in the result, and the core is
        settled (DMA drained, leftover tiles freed) either way."""
        op = self._ops.get(cmd)
        if op is None:
            raise NoSuchOp(cmd)
        if isinstance(op.handler, native.NativeOp):
            status, rv, elapsed, text, task.cost_record = native.run(op.handler, input, output, task)
            task.write(text)
            return OpResult(status, rv, elapsed, task.printf_text(), task.cost_record)
        status = Status.SUCCESS
        with runtime.activate(task):
            start = runtime.cycles()
            try:
                rv = op.handler(input, output, task.core.tm)
            except BaseException as e:  # KeyboardInterrupt, SystemExit …: a status for this caller only
                rv = None
                status = e.status if isinstance(getattr(e, "status", None), Status) else Status.ERR_CALL
                tb = clip("".join(traceback.format_exception(type(e), e, e.__traceback__.tb_next)), 4 * MAX_TEXT)
                task.write(f"[dspx] op 0x{cmd:x} ({op.name}) raised:\n{tb}")
            record = task.end_cost()  # under a cost model the call's modeled cycles, overhead included
            elapsed = record["cycles"] if record is not None else (runtime.cycles() - start) & ((1 << 64) - 1)
        for note in task.core.settle():
            task.write(note + "\n")
        broken = task.core.dma.broken()
        if broken:
            raise RuntimeBroken(f"op 0x{cmd:x} ({op.name}) broke the core's runtime: {broken}; the core restarts")
        if status == Status.SUCCESS:
            if isinstance(rv, bool) or not isinstance(rv, numbers.Integral):
                status = Status.ERR_CALL
                task.write(f"[dspx] op 0x{cmd:x} ({op.name}) returned {clip(repr(rv), 200)}, not an int status\n")
            elif not INT32[0] <= int(rv) <= INT32[1]:
                status = Status.ERR_CALL
                task.write(f"[dspx] op 0x{cmd:x} ({op.name}) returned {int(rv)}, which does not fit int32\n")
        return_value = int(rv) if status == Status.SUCCESS else int(status)
        return OpResult(int(status), return_value, elapsed, task.printf_text(), record)
