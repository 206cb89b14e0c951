"""Native op libraries: C/C++ operators built against the SDK (dspx/dsp.h).

A native library arrives as ELF bytes (``dspx load-ops LIB.so``; the op
registry tells it from Python source by the ELF magic).  Before any of its
code runs, ``check`` reads it with pyelftools and refuses:

* anything but ELFCLASS64 / little endian / EM_X86_64 / ET_DYN, or an
  executable (PT_INTERP) — ERR_LOAD;
* an undefined dynamic symbol outside the op export table
  (``native_exports.OP_EXPORTS``) — ERR_SYMBOL naming it;
* DT_NEEDED other than libc/libm/libgcc_s/libstdc++ — ERR_SYMBOL naming it;
* constructors and destructors of its own: ``.init_array`` / ``.fini_array``
  entries other than the compiler's ``frame_dummy`` /
  ``__do_global_dtors_aux``, ``.preinit_array``, ``.ctors``/``.dtors``, a
  DT_INIT/DT_FINI that is not the ``.init``/``.fini`` boilerplate — ERR_LOAD;
* no exported ``dspx_ops_init`` — ERR_SYMBOL.

Then ``dspx_ops_init`` runs once in a forked probe (a crash or hang there
is ERR_LOAD, and the core never sees it), then for real: the library is
mapped from a memfd and its ``hb_dsp_register_fn`` calls are collected.

Handlers run through the runtime shim (src/dspx/sdk/dsp/runtime.c, loaded
RTLD_GLOBAL so libraries resolve the SDK against it) by a ctypes call that
releases the GIL: two cores — or two threads — run native ops in parallel.

The timing model (issue 26): after ``configure_cost(params)`` — before the
first native op, since the process then loads the cost build of the shim —
a call of a counted library (built with ``cost=True``) runs between the
shim's ``dspx_cost_begin``/``dspx_cost_end``; its cycles are the modeled
cycles and its record (``COST-SPEC`` names) comes back beside the result.
A plain library still runs, uncounted, on the host's clock: its record says
``"counted": false``.
"""
from __future__ import annotations

import ctypes
import io
import os
import signal

import numpy as np
from elftools.elf.elffile import ELFFile

from ... import trace
from ...abi.protocol import Status
from . import probe
from .errors import OpLoadError, OpSymbolError, RuntimeBroken
from .exports import ALLOWED_NEEDED, linker_tags
from .native_exports import check_imports

ELF_MAGIC = b"\x7fELF"
INIT_SYMBOL = "dspx_ops_init"
ALLOWED_INIT = frozenset({"frame_dummy"})
ALLOWED_FINI = frozenset({"__do_global_dtors_aux"})
PROBE_TIMEOUT_S = 10
MAX_OPS = 256
TEXT_CAP = 256 << 10
DMA_TRACE_CAP = 4096  # transfers per channel the shim keeps for the trace (TRACE_CAP in runtime.c)
R_X86_64_RELATIVE = 8
COST_MARKER = "dspx_cost_build"  # defined by a cost build (dspx/dsp.h)
COST_COUNTERS = "dspx_cost_tls"  # what a cost build's intrinsics import from the cost shim


def is_native(source) -> bool:
    return isinstance(source, (bytes, bytearray, memoryview)) and bytes(source[:4]) == ELF_MAGIC


# ------------------------------------------------------------------ checks before anything is mapped

def _array_targets(elf: ELFFile, sec) -> list[int]:
    """The function addresses in an .init_array-like section: relocated
    (R_X86_64_RELATIVE addends) or, failing that, the stored values."""
    lo, size = sec["sh_addr"], sec["sh_size"]
    data = sec.data()
    targets = {off: int.from_bytes(data[off:off + 8], "little") for off in range(0, size - size % 8, 8)}
    for rel in elf.iter_sections():
        if rel["sh_type"] != "SHT_RELA":
            continue
        for r in rel.iter_relocations():
            off = r["r_offset"] - lo
            if 0 <= off < size and r["r_info_type"] == R_X86_64_RELATIVE:
                targets[off] = r["r_addend"]
    return list(targets.values())


def _functions(elf: ELFFile) -> dict[int, set[str]] | None:
    """Function names by address from .symtab (None when stripped)."""
    symtab = elf.get_section_by_name(".symtab")
    if symtab is None:
        return None
    names: dict[int, set[str]] = {}
    for s in symtab.iter_symbols():
        if s["st_info"]["type"] == "STT_FUNC" and s.name:
            names.setdefault(s["st_value"], set()).add(s.name)
    return names


def _check_init(elf: ELFFile, filename: str, names: dict[int, set[str]] | None) -> None:
    for secname, allowed in ((".init_array", ALLOWED_INIT), (".fini_array", ALLOWED_FINI),
                             (".preinit_array", frozenset()), (".ctors", None), (".dtors", None)):
        sec = elf.get_section_by_name(secname)
        if sec is None or sec["sh_size"] == 0:
            continue
        if allowed is None:  # old-style lists: only the -1 ... 0 markers
            words = [int.from_bytes(sec.data()[i:i + 8], "little") for i in range(0, sec["sh_size"], 8)]
            if any(w not in (0, (1 << 64) - 1) for w in words):
                raise OpLoadError(f"{filename}: {secname} lists constructors; native op libraries may not "
                                  "run code when loaded (register from dspx_ops_init)")
            continue
        for target in _array_targets(elf, sec):
            if names is None:
                raise OpLoadError(f"{filename}: {secname} cannot be checked without a symbol table "
                                  "(do not strip op libraries)")
            got = names.get(target, set())
            if not got & allowed:
                what = ", ".join(sorted(got)) or f"0x{target:x}"
                raise OpLoadError(f"{filename}: {secname} runs {what} when the library is loaded or unloaded; "
                                  "native op libraries may not have constructors or destructors "
                                  "(register from dspx_ops_init)")
    dyn = elf.get_section_by_name(".dynamic")
    for tag in dyn.iter_tags() if dyn is not None else ():
        kind = tag.entry.d_tag
        if kind in ("DT_INIT", "DT_FINI"):
            sec = elf.get_section_by_name(".init" if kind == "DT_INIT" else ".fini")
            if sec is None or tag.entry.d_val != sec["sh_addr"]:
                raise OpLoadError(f"{filename}: {kind} points at 0x{tag.entry.d_val:x}, not the compiler's "
                                  f"{'.init' if kind == 'DT_INIT' else '.fini'} boilerplate")
        elif kind in ("DT_PREINIT_ARRAY",):
            raise OpLoadError(f"{filename}: {kind} is not allowed in an op library")


def check(data: bytes, filename: str = "<oplib>") -> dict[int, set[str]]:
    """Every check made before the library is mapped (see the module doc).
    Returns the library's function names by address (for naming its ops)."""
    buf = bytes(data)
    if len(buf) < 64 or buf[:4] != ELF_MAGIC:
        raise OpLoadError(f"{filename}: not an ELF file")
    if buf[4] != 2:
        raise OpLoadError(f"{filename}: ELF class {buf[4]}, native op libraries are ELFCLASS64")
    if buf[5] != 1:
        raise OpLoadError(f"{filename}: ELF data encoding {buf[5]} is not little endian")
    try:
        elf = ELFFile(io.BytesIO(buf))
        machine, etype = elf["e_machine"], elf["e_type"]
        interp = any(True for _ in elf.iter_segments("PT_INTERP"))
        dynsym = elf.get_section_by_name(".dynsym")
        undefined, defined = [], set()
        for sym in dynsym.iter_symbols() if dynsym is not None else ():
            if not sym.name:
                continue
            if sym["st_shndx"] == "SHN_UNDEF":
                undefined.append(sym.name)
            else:
                defined.add(sym.name)
        functions = _functions(elf)
        if machine == "EM_X86_64" and etype == "ET_DYN" and not interp:
            _check_init(elf, filename, functions)
    except (OpLoadError, OpSymbolError):
        raise
    except Exception as e:  # pyelftools reports corrupt input with assorted exception types
        raise OpLoadError(f"{filename}: malformed ELF: {type(e).__name__}: {e}") from None
    if machine != "EM_X86_64":
        raise OpLoadError(f"{filename}: ELF for machine {machine}, this device is EM_X86_64")
    if etype != "ET_DYN":
        raise OpLoadError(f"{filename}: ELF type {etype}, an op library is a shared object (ET_DYN)")
    if interp:
        raise OpLoadError(f"{filename}: an executable (it has PT_INTERP), not a shared library")
    if dynsym is None:
        raise OpLoadError(f"{filename}: no dynamic symbol table (.dynsym)")
    try:
        tags = linker_tags(elf, filename, OpLoadError)
    except OpLoadError:
        raise
    except Exception as e:
        raise OpLoadError(f"{filename}: malformed ELF: {type(e).__name__}: {e}") from None
    needed = [name for tag, name in tags if tag == "DT_NEEDED"]
    paths = [tag for tag, _ in tags if tag in ("DT_RPATH", "DT_RUNPATH")]
    if COST_COUNTERS in undefined and not cost_on():
        raise OpSymbolError(COST_COUNTERS, f"{filename}: is a cost build (--cost-model), and this device has no "
                                           "cost model: rebuild it without --cost-model")
    bad = check_imports(undefined)
    if bad is not None:
        raise OpSymbolError(bad, f"{filename}: imports {bad!r}, which is not in the op export table "
                                 "(docs/custom-ops.md)")
    for lib in needed:
        if lib not in ALLOWED_NEEDED:
            raise OpSymbolError(lib, f"{filename}: needs {lib!r}; op libraries may link only "
                                     f"{', '.join(sorted(ALLOWED_NEEDED))}")
    if paths:
        raise OpLoadError(f"{filename}: sets {paths[0][3:]}; libraries are looked up only where the device's are "
                          "(drop -rpath)")
    if INIT_SYMBOL not in defined:
        raise OpSymbolError(INIT_SYMBOL, f"{filename}: no exported {INIT_SYMBOL}() (declare it extern \"C\" "
                                         "and register the ops there)")
    return functions or {}


# ------------------------------------------------------------------ the timing model

#: The profile parameters the C model reads: struct dspx_cost_params (dspx/cost.h), in its order.
COST_PARAMS = ("issue_load_store", "issue_alu", "issue_mul", "issue_special", "issue_move", "ddr_cached",
               "ddr_load_latency_cycles", "ddr_store_cycles", "tcm_load_latency_cycles", "idma_setup_cycles",
               "idma_bandwidth_bytes_per_cycle", "call_overhead_cycles")
#: struct dspx_cost_record's scalar fields, in its order (then dma_bytes[2], dma_transfers[2]).
COST_COUNTS = ("cycles", "overhead", "compute", "ddr_stall", "dma_wait", "ddr_loads", "ddr_stores", "tcm_loads",
               "tcm_stores", "ops_alu", "ops_mul", "ops_special", "ops_move")


class CostParams(ctypes.Structure):
    _fields_ = [(name, ctypes.c_double) for name in COST_PARAMS]


class CostRecord(ctypes.Structure):
    _fields_ = [(name, ctypes.c_uint64) for name in COST_COUNTS] + [
        ("dma_bytes", ctypes.c_uint64 * 2), ("dma_transfers", ctypes.c_uint64 * 2)]

    def as_dict(self) -> dict:
        out = {name: getattr(self, name) for name in COST_COUNTS}
        out["dma_bytes"], out["dma_transfers"] = list(self.dma_bytes), list(self.dma_transfers)
        return out


_cost: tuple[str, CostParams] | None = None  # (profile name, its parameters) while a cost model is on


def configure_cost(params: dict | None, profile: str = "custom") -> None:
    """Put this process's native ops under a cost model: ``params`` maps the
    COST_PARAMS names to numbers (or to profile entries ``{"value": ...}``);
    None switches counting off.  Before the first native op loads the shim
    (a process that loaded the plain shim cannot count: RuntimeError)."""
    global _cost
    if params is None:
        _cost = None
        return
    missing = [name for name in COST_PARAMS if name not in params]
    if missing:
        raise ValueError(f"cost model {profile!r}: no value for {', '.join(missing)}")
    values = CostParams(*(float(params[name]) for name in COST_PARAMS))
    if _shim is not None and not _shim_counts:
        raise RuntimeError("the plain runtime shim is already loaded: configure the cost model before the first "
                           "native op")
    previous, _cost = _cost, (profile, values)
    try:
        _configure(shim())  # the first call loads the cost shim
    except BaseException:
        _cost = previous
        raise


def cost_on() -> bool:
    """Whether a cost model is configured (then the cost shim is, or will be, loaded)."""
    return _cost is not None


def _configure(lib: ctypes.CDLL) -> None:
    profile, values = _cost
    if lib.dspx_cost_configure(ctypes.byref(values)) != 0:
        raise ValueError(f"cost model {profile!r}: the C model cannot use these values (issue rates and "
                         "bandwidths > 0, cycle counts whole and >= 0, ddr_cached 0 or 1)")


def _load_cost_api(lib: ctypes.CDLL) -> None:
    lib.dspx_cost_configure.argtypes, lib.dspx_cost_configure.restype = [ctypes.POINTER(CostParams)], ctypes.c_int
    lib.dspx_cost_begin.argtypes, lib.dspx_cost_begin.restype = [], None
    lib.dspx_cost_end.argtypes, lib.dspx_cost_end.restype = [ctypes.POINTER(CostRecord)], None
    lib.dspx_cost_abi.argtypes, lib.dspx_cost_abi.restype = [], ctypes.c_uint32
    abi = lib.dspx_cost_abi()
    if (abi & 0xffff, abi >> 16) != (ctypes.sizeof(CostParams), ctypes.sizeof(CostRecord)):
        raise RuntimeError("dspx/cost.h and native.CostParams/CostRecord disagree on the structs' layout")


# ------------------------------------------------------------------ the runtime shim

_shim = None
_shim_counts = False  # the loaded shim is the cost build


def shim() -> ctypes.CDLL:
    """The runtime shim, built on first use and loaded RTLD_GLOBAL (its cost
    build when a cost model is configured)."""
    global _shim, _shim_counts
    if _shim is None:
        from ... import sdk
        lib = ctypes.CDLL(str(sdk.runtime_shim(cost=cost_on())), mode=ctypes.RTLD_GLOBAL)
        if cost_on():
            _load_cost_api(lib)
        P, I, U64, SZ = ctypes.c_void_p, ctypes.c_int, ctypes.c_uint64, ctypes.c_size_t
        lib.dspx_rt_new.argtypes, lib.dspx_rt_new.restype = [P, SZ], P
        lib.dspx_rt_free.argtypes, lib.dspx_rt_free.restype = [P], None
        lib.dspx_rt_set_regions.argtypes, lib.dspx_rt_set_regions.restype = [P, I, P], I
        lib.dspx_rt_run.argtypes = [P, P, P, SZ, P, SZ, ctypes.POINTER(I), ctypes.POINTER(U64)]
        lib.dspx_rt_run.restype = I
        lib.dspx_rt_take_text.argtypes = [P, ctypes.c_char_p, SZ, ctypes.POINTER(U64)]
        lib.dspx_rt_take_text.restype = SZ
        lib.dspx_rt_collect_begin.argtypes, lib.dspx_rt_collect_begin.restype = [], None
        lib.dspx_rt_collect_end.argtypes = [I, P, P, P, ctypes.c_char_p, I]
        lib.dspx_rt_collect_end.restype = I
        lib.dspx_rt_symbol_name.argtypes, lib.dspx_rt_symbol_name.restype = [P, ctypes.c_char_p, I], U64
        lib.dspx_rt_check.argtypes, lib.dspx_rt_check.restype = [P, I], I
        lib.dspx_rt_broken.argtypes, lib.dspx_rt_broken.restype = [P], ctypes.c_char_p
        lib.dspx_rt_take_dma.argtypes = [P, ctypes.c_int32, ctypes.POINTER(U64), SZ, ctypes.POINTER(ctypes.c_int64)]
        lib.dspx_rt_take_dma.restype = SZ
        _shim, _shim_counts = lib, cost_on()
        if _shim_counts:
            _configure(lib)
    return _shim


class Context:
    """One core's native runtime: its L2 (the runtime.CoreRuntime's buffer), tile
    manager and DMA threads."""

    def __init__(self, l2: np.ndarray):
        self._l2 = l2  # keeps the buffer alive as long as the shim uses it
        self.ptr = shim().dspx_rt_new(l2.ctypes.data, l2.nbytes)
        if not self.ptr:
            raise MemoryError("cannot create the native runtime context")
        self._text = ctypes.create_string_buffer(TEXT_CAP)
        self._rv, self._cycles, self._dropped = ctypes.c_int(), ctypes.c_uint64(), ctypes.c_uint64()
        self._record = CostRecord()

    def close(self) -> None:
        if self.ptr:
            shim().dspx_rt_free(self.ptr)
            self.ptr = None

    def run(self, fn: int, input: np.ndarray, output: np.ndarray, space,
            counted: bool = False) -> tuple[int, int, int, str, dict | None]:
        """(fault status, handler return, cycles, printf text, cost record) of
        one task.  The record is None without a cost model; ``counted`` (a
        cost build's handler) runs it on the modeled clock."""
        rt = shim()
        triples = []
        for r in getattr(space, "regions", {}).values():
            if r.mm is not None:
                triples += (r.addr, r.size, np.frombuffer(r.mm, np.uint8).__array_interface__["data"][0])
        table = (ctypes.c_uint64 * len(triples))(*triples)
        rt.dspx_rt_set_regions(self.ptr, len(triples) // 3, table)
        counted = counted and _shim_counts and _cost is not None
        if counted:
            rt.dspx_cost_begin()
        fault = rt.dspx_rt_run(self.ptr, fn, input.__array_interface__["data"][0], input.nbytes,
                               output.__array_interface__["data"][0], output.nbytes,
                               ctypes.byref(self._rv), ctypes.byref(self._cycles))
        cycles, record = self._cycles.value, None
        if _cost is not None:
            record = {"profile": _cost[0], "estimate": True, "counted": counted}
        if counted:
            rt.dspx_cost_end(ctypes.byref(self._record))
            record.update(self._record.as_dict())
            cycles = record["cycles"]
        if trace.on:
            self._trace_dma(rt)
        n = rt.dspx_rt_take_text(self.ptr, self._text, TEXT_CAP, ctypes.byref(self._dropped))
        text = self._text.raw[:n].decode("utf-8", "replace") if n else ""
        if self._dropped.value:
            text = f"[dspx] printf: {self._dropped.value} earlier bytes dropped\n" + text
        return fault, self._rv.value, cycles, text, record

    def _trace_dma(self, rt) -> None:
        """The task's transfers, which the shim's DMA threads stamp with
        CLOCK_MONOTONIC while DSPX_TRACE is set (the last DMA_TRACE_CAP per
        channel): each onto its channel's track of the timeline."""
        buf, tid = (ctypes.c_uint64 * (3 * DMA_TRACE_CAP))(), ctypes.c_int64()
        rec = trace.recorder()
        for ch in range(2):
            n = rt.dspx_rt_take_dma(self.ptr, ch, buf, DMA_TRACE_CAP, ctypes.byref(tid))
            if n:
                rec.name_thread(f"dma channel {ch} (native)", tid.value)
            for i in range(n):
                rec.complete("dma copy", buf[3 * i], buf[3 * i + 1], "dma", {"bytes": buf[3 * i + 2]}, tid.value)

    def broken(self, check: bool = False) -> str:
        """What the last task (or, with check, anything since) broke in the
        shim's own state: its canaries, DMA threads, queues ("" if intact)."""
        rt = shim()
        if check:
            rt.dspx_rt_check(self.ptr, 1)
        return rt.dspx_rt_broken(self.ptr).decode(errors="replace")


def context_of(core) -> Context:
    """The native context of a runtime.CoreRuntime, created on first use."""
    ctx = getattr(core, "native", None)
    if ctx is None:
        ctx = core.native = Context(core.l2)
    return ctx


def run(op: "NativeOp", input: np.ndarray, output: np.ndarray, task) -> tuple[int, int, int, str, dict | None]:
    """(status, return value, cycles, printf text, cost record).  A handler
    that returns non-zero after an SDK call failed ends with that call's
    status (ERR_ADDR for a bad hb_dsp_mem_map ...), and the return value
    repeats it.  With a cost model on, cycles are the modeled ones (for a
    counted library) and the record holds the call's breakdown and counts."""
    ctx = context_of(task.core)
    fault, rv, cycles, text, record = ctx.run(op.fn, input, output, task.space, op.lib.counted)
    broken = ctx.broken()
    if broken:
        raise RuntimeBroken(f"native op {op.name} broke the core's runtime: {broken}; the core restarts")
    if fault and rv != 0:
        return fault, fault, cycles, text, record
    return int(Status.SUCCESS), rv, cycles, text, record


# ------------------------------------------------------------------ loading

class NativeOp:
    """A registered native handler (what OpRegistry keeps as the handler)."""

    __slots__ = ("lib", "fn", "name")

    def __init__(self, lib: "NativeLibrary", fn: int, name: str):
        self.lib, self.fn, self.name = lib, fn, name

    def __call__(self, *args):  # a native op is run by OpRegistry.run, never called from Python
        raise TypeError(f"native op {self.name} runs through the runtime shim")


def _demangle(name: str) -> str:
    """The function name of an Itanium-mangled symbol (``_Z14hb_dsp_softmaxPvS_S_``)."""
    if name.startswith("_Z") and name[2:3].isdigit():
        digits = ""
        for ch in name[2:]:
            if not ch.isdigit():
                break
            digits += ch
        return name[2 + len(digits):2 + len(digits) + int(digits)]
    return name


def library_probe(path: str):
    """What the probe of an op library runs: dlopen it, then its init."""
    rt = shim()

    def init():
        probe._die_with_parent()
        lib = ctypes.CDLL(path)
        rt.dspx_rt_collect_begin()
        getattr(lib, INIT_SYMBOL)()
    return init


def _probe(fd: int, filename: str) -> None:
    """Run dspx_ops_init once in a throwaway child (the core's probe zygote
    forks it): a crash or hang there is ERR_LOAD and never reaches the core."""
    out = probe.run_library(fd, PROBE_TIMEOUT_S)
    if out.hung:
        raise OpLoadError(f"{filename}: {INIT_SYMBOL} did not return within {PROBE_TIMEOUT_S} s")
    if out.signal == signal.SIGSYS:
        raise OpLoadError(f"{filename}: loading it or its {INIT_SYMBOL} tried a system call the device does not "
                          "allow (exec, sockets, writing files, signalling others …: SIGSYS)")
    if out.signal:
        raise OpLoadError(f"{filename}: {INIT_SYMBOL} crashed ({out.signal_name})")
    if not out.returned:
        raise OpLoadError(f"{filename}: loading the library or its {INIT_SYMBOL} ended the process (exit status "
                          f"{out.exit_code})")


def _defines(dll: ctypes.CDLL, name: str) -> bool:
    try:
        getattr(dll, name)
    except AttributeError:
        return False
    return True


class NativeLibrary:
    """A checked, mapped native library and the ops its init registered:
    ``ops`` is a list of (cmd, NativeOp, latency_us)."""

    def __init__(self, data: bytes, filename: str = "<oplib>", *, probe: bool = True,
                 names: dict[int, str] | None = None):
        functions = check(data, filename)
        rt = shim()
        self.filename = filename
        self._fd = os.memfd_create("dspx-oplib", os.MFD_CLOEXEC)
        self._dll = None
        self.counted = False  # a cost build: its calls run on the modeled clock
        try:
            view = memoryview(bytes(data))
            while view:
                view = view[os.write(self._fd, view):]
            # The fd stays open while loaded: a reused fd number would make a
            # later dlopen of the same /proc path return this library.
            path = f"/proc/self/fd/{self._fd}"
            if probe:
                _probe(self._fd, filename)
            try:
                self._dll = ctypes.CDLL(path, mode=ctypes.RTLD_LOCAL)
            except OSError as e:
                raise OpLoadError(f"{filename}: dynamic loading failed: {e}") from None
            self.counted = _defines(self._dll, COST_MARKER)
            init = getattr(self._dll, INIT_SYMBOL)
            init.restype = ctypes.c_int
            rt.dspx_rt_collect_begin()
            rc = init()
            cmds, fns, lats = (ctypes.c_int * MAX_OPS)(), (ctypes.c_void_p * MAX_OPS)(), (ctypes.c_int * MAX_OPS)()
            err = ctypes.create_string_buffer(256)
            n = rt.dspx_rt_collect_end(MAX_OPS, cmds, fns, lats, err, len(err))
            if n < 0:
                raise OpLoadError(f"{filename}: {err.value.decode(errors='replace')}")
            if rc != 0:
                raise OpLoadError(f"{filename}: {INIT_SYMBOL}() returned {rc}")
            if n == 0:
                raise OpLoadError(f"{filename}: the library registers no operators (call hb_dsp_register_fn "
                                  f"from {INIT_SYMBOL})")
            if n > MAX_OPS:
                raise OpLoadError(f"{filename}: registers {n} operators, at most {MAX_OPS}")
            self.ops = []
            name = ctypes.create_string_buffer(256)
            for i in range(n):
                offset = rt.dspx_rt_symbol_name(fns[i], name, len(name))
                symbol = name.value.decode(errors="replace") or min(functions.get(offset, ()), default="")
                label = (names or {}).get(cmds[i]) or _demangle(symbol) or f"op_{cmds[i]:x}"
                self.ops.append((cmds[i], NativeOp(self, fns[i], label), lats[i]))
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        """Unmap the library (its ops must be unregistered first)."""
        if self._dll is not None:
            import _ctypes
            _ctypes.dlclose(self._dll._handle)
            self._dll = None
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
