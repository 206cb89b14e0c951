"""One logging setup for the host CLI and the device processes it starts.

``setup(verbose, level)`` configures the ``dspx`` logger to write
``dspx: LEVEL: message`` lines to stderr and exports the level as
``$DSPX_LOG_LEVEL``, so a device started by this process (``dspx serve``, a
private device) logs at the same level; ``setup()`` with no arguments reads it
back there."""
from __future__ import annotations

import logging
import os
import sys

ENV = "DSPX_LOG_LEVEL"
LEVELS = ("debug", "info", "warning", "error")


def level_of(verbose: int = 0, level: str | None = None) -> int:
    if level:
        return getattr(logging, level.upper())
    if verbose:
        return logging.INFO if verbose == 1 else logging.DEBUG
    env = os.environ.get(ENV, "").upper()
    return getattr(logging, env) if env in {n.upper() for n in LEVELS} else logging.WARNING


class _StderrHandler(logging.StreamHandler):
    """Writes to whatever sys.stderr is at the time (a test runner may swap it)."""

    @property
    def stream(self):
        return sys.stderr

    @stream.setter
    def stream(self, _value):
        pass


class _Formatter(logging.Formatter):
    """``prefix: message`` for info, ``prefix: LEVEL: message`` for the rest."""

    def __init__(self, prefix: str):
        super().__init__()
        self.prefix = prefix

    def format(self, record) -> str:
        text = super().format(record)
        level = "" if record.levelno == logging.INFO else f"{record.levelname}: "
        return f"{self.prefix}: {level}{text}"


def setup(verbose: int = 0, level: str | None = None, prefix: str = "dspx") -> logging.Logger:
    lvl = level_of(verbose, level)
    log = logging.getLogger("dspx")
    log.setLevel(lvl)
    if not any(isinstance(h, _StderrHandler) for h in log.handlers):
        h = _StderrHandler()
        h.setFormatter(_Formatter(prefix))
        log.addHandler(h)
        log.propagate = False
    if verbose or level:  # passed on to the processes this one starts
        os.environ[ENV] = logging.getLevelName(lvl).lower()
    return log


def debug_enabled() -> bool:
    return logging.getLogger("dspx").isEnabledFor(logging.DEBUG)


def printer(name: str = "device", prefix: str = "dspx-device"):
    """For a process this one started (the device): ``setup()`` from
    ``$DSPX_LOG_LEVEL`` with its own prefix, and a ``log(*parts)`` callable —
    the shape the device's service takes — writing at info level."""
    logger = setup(prefix=prefix).getChild(name)
    if not os.environ.get(ENV):
        logging.getLogger("dspx").setLevel(logging.INFO)  # the device's default: its start-up lines show

    def log(*parts) -> None:
        logger.info(" ".join(map(str, parts)))
    return log
