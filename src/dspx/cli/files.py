"""What kind of file a user gave a command, told on the host before anything
is sent: by content (the ELF magic, an ONNX protobuf that parses) and by
extension.  Each ``refuse_*`` raises one ``DspxError`` line saying what to
do instead."""
from __future__ import annotations

from pathlib import Path

from ..errors import DspxError
from ..sdk import CXX_SUFFIXES

C_SUFFIXES = (".c",)
HEADER_SUFFIXES = (".h", ".hh", ".hpp", ".hxx")


def head(path, n: int = 4096) -> bytes:
    with open(path, "rb") as f:
        return f.read(n)


def is_elf(path) -> bool:
    return head(path, 4) == b"\x7fELF"


def is_onnx(path) -> bool:
    """An ONNX model: the .onnx extension, or a protobuf ModelProto with a
    graph (what an ONNX file starts with: field 1, ir_version, a varint)."""
    p = Path(path)
    if not p.is_file():
        return False
    if p.suffix.lower() == ".onnx":
        return True
    if head(p, 1) != b"\x08":
        return False
    try:
        import onnx
    except ImportError:  # a base install: the extension is all there is to go by
        return False
    m = onnx.ModelProto()
    try:
        m.ParseFromString(p.read_bytes())
    except Exception:  # noqa: BLE001 — any parse failure: not a model
        return False
    return m.ir_version > 0 and m.HasField("graph")


def is_c_source(path) -> bool:
    """C or C++ source (or a header): by extension, or a first line a C file starts with."""
    p = Path(path)
    if p.suffix in C_SUFFIXES + CXX_SUFFIXES + HEADER_SUFFIXES:
        return True
    first = head(p, 512).lstrip().split(b"\n", 1)[0]
    return first.startswith((b"#include", b"#pragma", b"/*", b"//")) and not p.suffix == ".py"


def _compile_hint(path) -> str:
    return f"compile it first with `dspx compile {path} -o DIR`"


def refuse_onnx(path, then: str) -> None:
    """An ONNX model where a compiled module belongs: say how to get one."""
    if is_onnx(path):
        raise DspxError(f"{path} is an ONNX model: {_compile_hint(path)}, then {then}")


def check_op_library(path) -> bytes:
    """The bytes of an op library for ``load-ops`` (an ELF from ``dspx
    build-ops``, or Python source), or one line saying what ``path`` is instead."""
    data = Path(path).read_bytes()
    if data[:4] == b"\x7fELF":
        return data
    refuse_onnx(path, "run it with `dspx run DIR -i ...` (load-ops takes op libraries)")
    if is_c_source(path):
        out = Path(path).with_suffix(".so").name
        raise DspxError(f"{path} is C/C++ source: build it first with `dspx build-ops {path} -o {out}`, "
                        f"then `dspx load-ops {out}`")
    try:
        data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise DspxError(f"{path} is neither an ELF library nor Python source (not UTF-8 text at byte "
                        f"{e.start}): load-ops takes a .py op library or a LIB.so from `dspx build-ops`") from None
    return data


def check_op_sources(paths) -> None:
    """``build-ops`` compiles C and C++ only: anything else, one line saying what to do with it."""
    for p in paths:
        suffix = Path(p).suffix
        if suffix in C_SUFFIXES + CXX_SUFFIXES:
            continue
        if is_onnx(p):
            raise DspxError(f"{p} is an ONNX model, not operator source: {_compile_hint(p)}")
        if suffix == ".py":
            raise DspxError(f"{p} is a Python op library: it needs no build, load it with `dspx load-ops {p}`")
        if is_elf(p):
            raise DspxError(f"{p} is already a compiled ELF file: load an op library with `dspx load-ops {p}`")
        if suffix in HEADER_SUFFIXES:
            raise DspxError(f"{p} is a header: give the .c/.cc sources that include it")
        raise DspxError(f"{p} is not C or C++ source: build-ops compiles .c (C) and "
                        f"{', '.join(CXX_SUFFIXES)} (C++) files")
