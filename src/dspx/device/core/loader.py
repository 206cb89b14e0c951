"""DLOAD: check a compiled module held in memory, then load and run it.

Order matters: everything about the ELF (identity, imports, entry, blobs) is
checked with pyelftools on the staged bytes *before* the dynamic linker maps
the module, because mapping runs its constructors.  Loading goes through an
anonymous memfd (closed at unload), so no file is left behind, and through
TVM FFI's direct loader, which (unlike ``tvm.runtime.load_module``) does not
pin the library: dropping the last reference unmaps it.
"""
from __future__ import annotations

import ctypes
import os
import re
import weakref
from dataclasses import dataclass

import numpy as np
import tvm
import tvm_ffi
from elftools.elf.constants import P_FLAGS
from elftools.elf.elffile import ELFFile
from tvm import relax

from dspx.abi import modformat as fmt
from dspx.device.core.errors import CallError, LoadError, NoMemError, SymbolError, TensorError, WeightsError
from dspx.device.core.exports import check_imports, check_libraries, linker_tags
from dspx.abi.protocol import IoMeta

# A TVM-exported library carries its module tree (the Relax VM executable and
# its constants) in this symbol; without it there is nothing to call.
ENTRY_SYMBOL = "__tvm_ffi__library_bin"
DEFAULT_ENTRY = "main"
MACHINE = "EM_X86_64"
TENSOR_ALIGN = 64  # TVM refuses DLPack tensors whose data is less aligned

_load_so = tvm.get_global_func("ffi.Module.load_from_file.so")
_libc = ctypes.CDLL(None)


@dataclass(frozen=True)
class ElfInfo:
    text_size: int
    data_size: int
    io_meta: IoMeta | None
    signature: fmt.Signature | None

    @property
    def workspace_bytes(self) -> int:
        return self.signature.workspace_bytes if self.signature else 0

    @property
    def ddr_bytes(self) -> int:
        """What the module takes from the DDR pool: its segments and workspace."""
        return self.text_size + self.data_size + self.workspace_bytes


def _symbol_bytes(elf: ELFFile, buf: memoryview, symbols: dict, name: str) -> memoryview | None:
    sym = symbols.get(name)
    if sym is None:
        return None
    shndx = sym["st_shndx"]
    if not isinstance(shndx, int) or shndx >= elf.num_sections():
        raise LoadError(f"symbol {name} is not in a section (st_shndx {shndx})")
    sec = elf.get_section(shndx)
    start = sec["sh_offset"] + sym["st_value"] - sec["sh_addr"]
    end = start + sym["st_size"]
    sec_end = min(len(buf), sec["sh_offset"] + sec["sh_size"])
    if sec["sh_type"] == "SHT_NOBITS" or start < sec["sh_offset"] or end > sec_end:
        raise LoadError(f"symbol {name} ({sym['st_size']} bytes) lies outside the file's section {sec.name}")
    return buf[start:end]


def _check_ident(buf: memoryview) -> None:
    if len(buf) < 64 or bytes(buf[:4]) != b"\x7fELF":
        raise LoadError(f"not an ELF file (starts with {bytes(buf[:4])!r}, {len(buf)} bytes)")
    if buf[4] != 2:
        raise LoadError(f"ELF class {buf[4]} ({'ELFCLASS32' if buf[4] == 1 else 'unknown'}), "
                        "this device loads ELFCLASS64")
    if buf[5] != 1:
        raise LoadError(f"ELF data encoding {buf[5]} is not little endian (ELFDATA2LSB)")


def _inspect(stream, buf: memoryview, kernel_names) -> ElfInfo:
    """Every check DLOAD makes before mapping anything.  ``stream`` reads the
    same bytes as ``buf`` (pyelftools needs a file; reading the memfd avoids
    copying a large module once more)."""
    try:
        elf = ELFFile(stream)
        machine, etype = elf["e_machine"], elf["e_type"]
        segments = [(seg["p_flags"], seg["p_memsz"]) for seg in elf.iter_segments("PT_LOAD")]
        dynsym = elf.get_section_by_name(".dynsym")
        symbols, undefined = {}, []
        for sym in dynsym.iter_symbols() if dynsym is not None else ():
            if sym.name and sym["st_shndx"] == "SHN_UNDEF":
                undefined.append(sym.name)
            elif sym.name:
                symbols[sym.name] = sym
    except Exception as e:  # pyelftools reports corrupt input with assorted exception types
        raise LoadError(f"malformed ELF: {type(e).__name__}: {e}") from None
    if machine != MACHINE:
        raise LoadError(f"ELF for machine {machine}, this device is {MACHINE}")
    if etype != "ET_DYN":
        raise LoadError(f"ELF type {etype}, a loadable module is a shared object (ET_DYN)")
    if dynsym is None:
        raise LoadError("ELF has no dynamic symbol table (.dynsym)")
    try:
        tags = linker_tags(elf, "module")
    except LoadError:
        raise
    except Exception as e:
        raise LoadError(f"malformed ELF: {type(e).__name__}: {e}") from None
    bad = check_imports(undefined)
    if bad is not None:
        raise SymbolError(bad, f"module imports {bad!r}, which the firmware does not export")
    check_libraries(tags, "module")
    if ENTRY_SYMBOL not in symbols:
        raise SymbolError(ENTRY_SYMBOL, f"no TVM module entry: symbol {ENTRY_SYMBOL!r} is missing "
                                        "(not a library exported by TVM)")
    try:
        blob = _symbol_bytes(elf, buf, symbols, fmt.IO_META_SYMBOL)
        if blob is not None and len(blob) != IoMeta.SIZE:
            raise ValueError(f"io_meta blob is {len(blob)} bytes, expected {IoMeta.SIZE}")
        io_meta = IoMeta.decode(blob) if blob is not None else None
        blob = _symbol_bytes(elf, buf, symbols, fmt.SIGNATURE_SYMBOL)
        signature = fmt.Signature.decode(blob) if blob is not None else None
    except ValueError as e:
        raise LoadError(str(e)) from None
    if signature is not None:
        for kernel in signature.kernel_imports:
            if kernel not in kernel_names:
                raise SymbolError(kernel, f"module calls kernel {kernel!r}, which the kernel library does not export")
    # text = executable segments; data = the rest (constants and writable data)
    text = sum(size for flags, size in segments if flags & P_FLAGS.PF_X)
    data = sum(size for flags, size in segments if not flags & P_FLAGS.PF_X)
    return ElfInfo(text, data, io_meta, signature)


@dataclass(frozen=True)
class ModelWeights:
    """A parsed weights file, copied into device-owned tensors (the staging
    bytes it came from may be reused as soon as MODEL_LOAD returns)."""

    digest: str
    names: list[str]
    tensors: list
    nbytes: int

    @property
    def num_constants(self) -> int:
        return len(self.tensors)


def parse_weights(data) -> ModelWeights:
    try:
        w = fmt.read_weights(data)
    except fmt.WeightsError as e:
        raise WeightsError(str(e)) from None
    return ModelWeights(w.digest, [t.name for t in w.tensors],
                        [tvm.runtime.tensor(t.array) for t in w.tensors], w.nbytes)


def as_tensor(arr: np.ndarray):
    """(tensor, zero_copy): a TVM tensor over ``arr``: a zero-copy DLPack view when the array is
    C-contiguous, 64-byte aligned and writable (always so in input_buf, whose
    layout aligns every tensor); otherwise one aligned copy, since TVM rejects
    less aligned data and numpy cannot export read-only arrays."""
    if arr.flags.c_contiguous and arr.flags.writeable:
        try:
            return tvm.runtime.from_dlpack(arr), True  # the common case, checked by TVM itself
        except Exception:  # noqa: BLE001 - misaligned: fall through to the copy
            pass
    aligned = np.empty(arr.nbytes + TENSOR_ALIGN, dtype=np.uint8)
    skip = -aligned.ctypes.data % TENSOR_ALIGN
    copy = aligned[skip:skip + arr.nbytes].view(arr.dtype).reshape(arr.shape)
    copy[...] = arr
    return tvm.runtime.from_dlpack(copy), False


class MappedModule:
    """A module mapped into the device, ready to run its entry."""

    def __init__(self, info: ElfInfo, lib, vm, fd: int):
        self.text_size = info.text_size
        self.data_size = info.data_size
        self.workspace_bytes = info.workspace_bytes
        self.io_meta = info.io_meta
        self.signature = info.signature
        self.entry = info.signature.entry if info.signature else DEFAULT_ENTRY
        self._close_fd = weakref.finalize(self, os.close, fd)  # also if dropped without unload()
        self._lib = lib
        self._vm = vm
        self._func = vm[self.entry]
        self._weights: ModelWeights | None = None
        self._last_outputs = None

    @property
    def separate_weights(self) -> bool:
        return self.signature is not None and self.signature.weights == "separate"

    def check_weights(self, weights: ModelWeights) -> None:
        sig = self.signature
        if not self.separate_weights:
            raise WeightsError("module carries its own weights; it takes no weights file")
        if weights.num_constants != sig.num_weights:
            raise WeightsError(f"weights file has {weights.num_constants} tensors, the module expects {sig.num_weights}")
        if sig.weights_digest is not None and weights.digest != sig.weights_digest:
            raise WeightsError(f"weights digest {weights.digest} is not the module's {sig.weights_digest}: "
                               "these weights belong to another model")

    def set_weights(self, weights_bytes) -> int:
        """Parse, check and keep weights as this module's own; returns the
        number of constants."""
        weights = parse_weights(weights_bytes)
        self.check_weights(weights)
        self._weights = weights
        return weights.num_constants

    def prepare(self, inputs: list[np.ndarray], weights: ModelWeights | None = None) -> tuple[list, bool]:
        """Check the inputs and weights against the signature once; return
        the entry's arguments and whether they may be reused for later calls
        on the same memory (every input was wrapped zero-copy)."""
        if self._vm is None:
            raise CallError("module is unloaded")
        if self.signature is not None:
            specs = self.signature.inputs
            if len(inputs) != len(specs):
                raise TensorError(f"{self.entry} takes {len(specs)} inputs, got {len(inputs)}")
            for i, (arr, spec) in enumerate(zip(inputs, specs)):
                if arr.shape != tuple(spec.shape) or arr.dtype != np.dtype(spec.dtype):
                    raise TensorError(f"input {i} ({spec.name}): got {list(arr.shape)} {arr.dtype.name}, "
                                      f"expected {list(spec.shape)} {spec.dtype}")
        if weights is not None:
            self.check_weights(weights)
        elif self.separate_weights:
            weights = self._weights
            if weights is None:
                raise WeightsError("module has separate weights and none are loaded (MODEL_LOAD first)")
        args, reusable = [], True
        for a in inputs:
            t, zero_copy = as_tensor(a)
            args.append(t)
            reusable &= zero_copy
        return args + (list(weights.tensors) if weights is not None else []), reusable

    def call(self, args: list) -> list[np.ndarray]:
        """Run the entry on prepared arguments; outputs are numpy views of the
        TVM outputs, valid until the next call or unload."""
        if self._vm is None:
            raise CallError("module is unloaded")
        self._last_outputs = None
        try:
            out = self._func(*args)
        except Exception as e:  # the TVM runtime reports every failure as an FFI error
            raise CallError(f"{self.entry} failed: {e}") from None
        outs = list(out) if isinstance(out, (list, tuple, tvm_ffi.Array)) else [out]
        self._last_outputs = outs
        return [np.from_dlpack(o) for o in outs]

    def run(self, inputs: list[np.ndarray], weights: ModelWeights | None = None) -> list[np.ndarray]:
        return self.call(self.prepare(inputs, weights)[0])

    def unload(self) -> None:
        """docs/compiler.md order: last outputs, the model slot (weights), the
        constants (held by the VM executable), then the code segments."""
        self._last_outputs = None
        self._weights = None
        self.timed = None  # a profiling VM (core/inference.py) holds the library too: it goes first
        self._func = None
        self._vm = None
        self._lib = None
        self._close_fd()
        # Hand the freed heap back to the OS so the device's footprint after
        # unload is what it was before the load (glibc keeps it otherwise).
        _libc.malloc_trim(0)


def load_module(elf, kernel_names: set[str] = frozenset(), *, ddr_free: int | None = None,
                ddr_total: int | None = None) -> MappedModule:
    """Check ``elf`` (bytes held in staging), then map it and create its VM.

    ``kernel_names``: the kernel library's exports (firmware kernels a module
    may call by name).  ``ddr_free``: DDR pool bytes available; a module whose
    segments plus workspace do not fit is refused before it is mapped."""
    buf = memoryview(elf).cast("B")
    _check_ident(buf)
    # The memfd stays open while the module is loaded: the dynamic linker
    # treats a second dlopen of the same path name as the library already
    # loaded, and a closed fd's number (hence "/proc/self/fd/N") is reused.
    fd = os.memfd_create("dspx-module", os.MFD_CLOEXEC)
    try:
        view = buf
        while view:
            view = view[os.write(fd, view):]
        with open(fd, "rb", closefd=False) as stream:
            info = _inspect(stream, buf, kernel_names)
        from dspx.device.core.cpu import check_module  # code for a CPU this one lacks: ERR_LOAD, not SIGILL
        check_module(info.signature)
        if ddr_free is not None and info.ddr_bytes > ddr_free:
            raise NoMemError(f"module needs {info.ddr_bytes} bytes of the DDR pool "
                             f"({info.text_size} text + {info.data_size} data + {info.workspace_bytes} workspace), "
                             f"{ddr_free} free", info.ddr_bytes, ddr_free, ddr_total or 0)
        try:
            lib = _load_so(f"/proc/self/fd/{fd}", "so")
        except Exception as e:
            raise LoadError(f"dynamic loading failed: {e}") from None
        entry = info.signature.entry if info.signature else DEFAULT_ENTRY
        try:
            vm = relax.VirtualMachine(lib, tvm.cpu())
        except Exception as e:
            # A packed function the module resolves by name at VM creation.
            m = re.search(r"Cannot find ffi::Function (\S+)", str(e))
            if m:
                raise SymbolError(m.group(1), f"module calls {m.group(1)!r}, which the device does not export") from None
            raise LoadError(f"cannot create the module's VM: {e}") from None
        try:
            vm.module["get_function_arity"](entry)
        except Exception:
            raise SymbolError(entry, f"module has no entry function {entry!r}") from None
        return MappedModule(info, lib, vm, fd)
    except BaseException:
        os.close(fd)
        raise


def describe(mod: MappedModule) -> dict:
    """The DYN_LOAD result the core hands to the front (JSON-able)."""
    io = mod.io_meta
    return {"text_size": mod.text_size, "data_size": mod.data_size, "workspace_bytes": mod.workspace_bytes,
            "entry": mod.entry,
            "io_meta": None if io is None else {"num_inputs": io.num_inputs, "num_outputs": io.num_outputs,
                                                "input_bytes": io.input_bytes, "output_bytes": io.output_bytes,
                                                "flags": io.flags},
            "signature": None if mod.signature is None else mod.signature.to_json()}
