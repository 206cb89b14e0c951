"""``dspx`` — the command line.  Outputs for programs are JSON (``--json``);
outputs for people are short readable lines.

Every command is added to the ``dspx`` group (``main``) through
``DspxGroup``, which gives it the same behaviour: ``-v/--verbose`` and
``--log-level`` (one logging setup, ``dspx.log``), a documented ``--socket``,
and one error policy (``errors.py``): user mistakes as one ``error: …`` line
on stderr (with ``--json``: one JSON error object on stdout) and a non-zero
exit, Ctrl-C → exit 130.  The commands live one module per group:
``device`` (serve, stop, ping, status, devices), ``info``, ``run``, ``compile``,
``ops`` (load-ops, unload-ops, ops, build-ops, sdk), ``llm`` (compile-llm, generate,
chat, serve-llm), ``serve_models`` (serve-models) and ``farm`` (farm up, down, status, run).

Shell completion (click's): ``eval "$(_DSPX_COMPLETE=bash_source dspx)"``
(``zsh_source``, ``fish_source`` for those shells)."""
from __future__ import annotations

import functools

import click

from .. import log
from . import errors
from .common import SOCKET_HELP, add_private_option


class DspxGroup(click.Group):
    """The ``dspx`` group: shared options and one error policy for every command."""

    def add_command(self, cmd: click.Command, name: str | None = None) -> None:
        for p in cmd.params:
            if p.name == "socket" and isinstance(p, click.Option) and not p.help:
                p.help = SOCKET_HELP
        if not any(p.name == "log_level" for p in cmd.params):  # once, if a command is added twice
            cmd.params += [click.Option(["-v", "--verbose"], count=True, help="more log output (-vv: debug)"),
                           click.Option(["--log-level"], type=click.Choice(log.LEVELS, case_sensitive=False),
                                        help="log level (default: warning, or $DSPX_LOG_LEVEL)")]
            add_private_option(cmd)
            cmd.callback = _with_logging(cmd.callback)
        super().add_command(cmd, name)

    def invoke(self, ctx: click.Context):
        argv = [*getattr(ctx, "_protected_args", []), *ctx.args]
        return errors.handle(ctx, lambda: super(DspxGroup, self).invoke(ctx), "--json" in argv)


def _with_logging(callback):
    @functools.wraps(callback)
    def run(*args, verbose=0, log_level=None, **kw):
        log.setup(verbose, log_level)
        return callback(*args, **kw)
    return run


@click.group(cls=DspxGroup, context_settings={"help_option_names": ["-h", "--help"]}, epilog=(
        "Shell completion: eval \"$(_DSPX_COMPLETE=bash_source dspx)\" (zsh_source, fish_source for "
        "those shells)."))
@click.version_option(package_name="dspx")
def main():
    """dspx: offload compute from this host to a DSP (simulated on x86 when no board is present)."""


# (module, attribute, command name).  A module whose imports need an extra
# that is not installed gets stand-ins that name the extra.
COMMANDS = (
    ("dspx.cli.device", "serve", "serve"), ("dspx.cli.device", "stop", "stop"), ("dspx.cli.device", "ping", "ping"),
    ("dspx.cli.device", "status", "status"), ("dspx.cli.device", "devices", "devices"),
    ("dspx.cli.info", "info", "info"), ("dspx.cli.run", "run", "run"), ("dspx.cli.compile", "compile_cmd", "compile"),
    ("dspx.cli.ops", "load_ops", "load-ops"), ("dspx.cli.ops", "unload_ops", "unload-ops"),
    ("dspx.cli.ops", "ops", "ops"),
    ("dspx.cli.ops", "sdk", "sdk"), ("dspx.cli.ops", "build_ops", "build-ops"),
    ("dspx.cli.llm", "compile_llm", "compile-llm"), ("dspx.cli.llm", "generate", "generate"),
    ("dspx.cli.llm", "chat", "chat"), ("dspx.cli.llm", "serve_llm", "serve-llm"),
    ("dspx.cli.serve_models", "serve_models", "serve-models"),
    ("dspx.cli.farm", "farm", "farm"))


def _unavailable(name: str, error: ImportError) -> click.Command:
    """A stand-in for a command whose module needs an extra that is not
    installed: it is listed, and running it names the extra."""
    from ..errors import missing_extra

    missing = missing_extra(error, f"`dspx {name}`")

    @click.command(name, context_settings={"ignore_unknown_options": True, "allow_extra_args": True},
                   help=f"(not installed: {missing or error})", add_help_option=False)
    def stand_in():
        raise missing or error
    return stand_in


def _load_commands():
    for modname, attr, name in COMMANDS:
        try:
            mod = __import__(modname, fromlist=[attr])
        except ImportError as e:
            if e.name and e.name.startswith("dspx"):  # a module not (yet) in this tree
                continue
            main.add_command(_unavailable(name, e))
            continue
        cmd = getattr(mod, attr, None)
        if cmd is not None:
            main.add_command(cmd)


_load_commands()

__all__ = ["DspxGroup", "main"]
