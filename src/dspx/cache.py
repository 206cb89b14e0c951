"""The one cache of compiled artefacts: where it lives, how a key is made, and
how a build is published.

Every compiled thing dspx keeps (ONNX sessions, LLM packages, SDK builds, the
tests' example modules) lives under ``root()``:

- ``$DSPX_CACHE`` when set;
- else ``$XDG_CACHE_HOME/dspx``;
- else ``~/.cache/dspx``.

A build is keyed by a ``digest`` of what it depends on, and appears in one
step (``publish``): a reader sees all of a build or none of it, and two
processes building the same key at once both end with one complete copy.
"""
from __future__ import annotations

import hashlib
import os
import secrets
import shutil
from collections.abc import Callable, Iterable
from pathlib import Path


def root() -> Path:
    """``$DSPX_CACHE``, else ``$XDG_CACHE_HOME/dspx``, else ``~/.cache/dspx``."""
    if os.environ.get("DSPX_CACHE"):
        return Path(os.environ["DSPX_CACHE"])
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "dspx"


def area(name: str) -> Path:
    """One kind of artefact's folder under the root ("sessions", "llm", "sdk", ...)."""
    return root() / name


def digest(files: Iterable[Path] = (), *parts: str | bytes, length: int = 16) -> str:
    """Hex digest of the files' bytes (in the order given) and the extra parts."""
    h = hashlib.sha256()
    for f in files:
        h.update(Path(f).read_bytes())
    for p in parts:
        h.update(p.encode() if isinstance(p, str) else p)
    return h.hexdigest()[:length]


def publish(out: Path, build: Callable[[Path], object], *, complete: str) -> bool:
    """Make ``out`` by calling ``build(tmp)`` on a fresh sibling directory and
    renaming it into place; ``out/complete`` is the file whose presence says a
    build is whole.  Returns False when a whole build was already there (or
    another process published one first, which is then kept)."""
    out = Path(out)
    if (out / complete).exists():
        return False
    out.parent.mkdir(parents=True, exist_ok=True)
    # os.mkdir honours the umask (mkdtemp would make it 0700): a shared
    # $DSPX_CACHE stays readable by the users it is shared with.
    tmp = out.parent / f".{out.name}-{os.getpid()}-{secrets.token_hex(4)}"
    os.mkdir(tmp)
    try:
        build(tmp)
        if out.exists() and not (out / complete).exists():
            shutil.rmtree(out, ignore_errors=True)  # a half-written build from before atomic publish
        try:
            os.rename(tmp, out)
        except OSError:
            if not (out / complete).exists():
                raise
            return False
        return True
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def prune(parent: Path, keep: Callable[[Path], bool]) -> None:
    """Delete the entries of a cache folder that ``keep`` refuses (builds by
    an older compiler).  Only for folders under ``root()``, which dspx owns."""
    parent = Path(parent)
    if not parent.is_dir():
        return
    for entry in parent.iterdir():
        if entry.is_dir() and not entry.name.startswith(".") and not keep(entry):
            shutil.rmtree(entry, ignore_errors=True)
