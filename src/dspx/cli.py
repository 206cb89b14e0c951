"""``dspx`` — the command line.  Outputs for programs are JSON (``--json``);
outputs for people are short readable lines.

Every command, wherever it is defined, is added to the ``dspx`` group through
``DspxGroup``, which gives it the same behaviour: ``-v/--verbose`` and
``--log-level`` (one logging setup, ``dspx.log``), a documented ``--socket``,
user mistakes as one ``error: …`` line on stderr (with ``--json``: one JSON
error object on stdout) and a non-zero exit, Ctrl-C → exit 130.

Shell completion (click's): ``eval "$(_DSPX_COMPLETE=bash_source dspx)"``
(``zsh_source``, ``fish_source`` for those shells)."""
from __future__ import annotations

import functools
import json
import logging
import os
import re
import statistics
import sys

import click

from . import fmt, log, memory
from .abi.protocol import DEFAULT_JOB_TIMEOUT_S

SOCKET_HELP = ("device socket (default: $DSPX_SOCKET, else the per-user socket when a device listens there, "
               "else a private simulated device started for this command)")
EXIT_ERROR, EXIT_USAGE, EXIT_INTERRUPTED = 1, 2, 130


def error_object(e: BaseException) -> dict:
    """The JSON error object for ``e``: status, error (name), message, code and the numbers."""
    from .errors import DeviceError, MissingExtra

    out = {"status": "error", "error": type(e).__name__, "message": str(e), "code": -(getattr(e, "errno", None) or 1)}
    if isinstance(e, DeviceError):
        out.update(code=e.status, error=e.status_name, message=e.detail or str(e), **e.numbers)
    elif isinstance(e, MissingExtra):
        out.update(extra=e.extra, module=e.module)
    elif isinstance(e, click.UsageError):
        out.update(code=-EXIT_USAGE, error="UsageError", message=e.format_message())
    return out


def _message(e: BaseException) -> str:
    from .errors import DspxError

    if isinstance(e, OSError) and not isinstance(e, DspxError) and e.strerror:
        where = f"{e.filename}: " if e.filename else ""
        return f"{where}{e.strerror}"
    text = str(e) if str(e) else type(e).__name__
    return text if isinstance(e, (DspxError, OSError, ValueError)) else f"{type(e).__name__}: {text}"


def _user_error(e: Exception, what: str) -> Exception:
    from .errors import EXTRA_OF, DeviceError, MissingExtra, missing_extra

    if isinstance(e, ImportError):
        return missing_extra(e, what) or e
    # A device without an optional dependency reports the import error in its text.
    m = re.search(r"No module named '([\w.]+)'", str(e)) if isinstance(e, DeviceError) else None
    if m and m.group(1).split(".")[0] in EXTRA_OF:
        return MissingExtra(m.group(1).split(".")[0], f"the device ({e.status_name} on {e.request or 'a request'})")
    return e


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
            cmd.callback = _with_logging(cmd.callback)
        super().add_command(cmd, name)

    def invoke(self, ctx: click.Context):
        argv = [*getattr(ctx, "_protected_args", []), *ctx.args]
        as_json = "--json" in argv
        try:
            return super().invoke(ctx)
        except (click.exceptions.Exit, click.Abort, BrokenPipeError):  # click ends a closed pipe quietly
            raise
        except click.UsageError as e:
            hint = f" (see '{e.ctx.command_path} --help')" if e.ctx else ""
            _report(e, as_json, f"{e.format_message()}{hint}")
            ctx.exit(EXIT_USAGE)
        except click.ClickException as e:
            _report(e, as_json, e.format_message())
            ctx.exit(e.exit_code)
        except KeyboardInterrupt:
            click.echo("interrupted", err=True)
            ctx.exit(EXIT_INTERRUPTED)
        except Exception as e:  # noqa: BLE001 — every failure ends as one line; -vv logs the traceback
            cmd = ctx.invoked_subcommand or "dspx"
            e = _user_error(e, f"`dspx {cmd}`")
            logging.getLogger("dspx").debug("traceback of the error below", exc_info=True)
            text = _message(e)
            first, _, rest = text.strip().partition("\n")  # one line; the rest (a device's traceback) at debug
            if rest:
                logging.getLogger("dspx").debug("the rest of the error:\n%s", rest)
            _report(e, as_json, first)
            ctx.exit(EXIT_ERROR)


def _report(e: BaseException, as_json: bool, text: str) -> None:
    if as_json:
        click.echo(json.dumps(error_object(e) | ({"message": text} if isinstance(e, click.UsageError) else {})))
    else:
        click.echo(f"error: {text}", err=True)


def _with_logging(callback):
    @functools.wraps(callback)
    def run(*args, verbose=0, log_level=None, **kw):
        log.setup(verbose, log_level)
        return callback(*args, **kw)
    return run


def _client(socket, **kw):
    from .host.client import Client
    return Client(socket, **kw)


def private_note(client) -> str | None:
    """What to tell the user when the answer came from a private device."""
    if getattr(client, "device", None) is None:
        return None
    return ("no device was running: this answer is from a private device started for this command "
            "and stopped after it (`dspx serve` runs one that stays)")


socket_opt = click.option("--socket", default=None, envvar="DSPX_SOCKET", help=SOCKET_HELP)


@click.group(cls=DspxGroup, context_settings={"help_option_names": ["-h", "--help"]}, epilog=(
        "Shell completion: eval \"$(_DSPX_COMPLETE=bash_source dspx)\" (zsh_source, fish_source for "
        "those shells)."))
@click.version_option(package_name="dspx")
def main():
    """dspx: offload compute from this host to a DSP (simulated on x86 when no board is present)."""


def _size_option(name, default, what):
    return click.option(name, default=fmt.size(default), show_default=True,
                        help=f"{what} (bytes, or with K/M/G: 64M, 1G)")


@main.command()
@click.option("--socket", default=None, help="socket to listen on (default: $DSPX_SOCKET or the per-user "
                                             "socket ${XDG_RUNTIME_DIR:-/tmp}/dspx-<uid>/dsp0.sock)")
@_size_option("--carveout-size", memory.CARVEOUT_SIZE, "shared window every client's buffers map into")
@_size_option("--ddr-pool-size", memory.DDR_POOL_SIZE, "device memory for modules, weights and task buffers")
@click.option("--cores", default=1, show_default=True, type=click.IntRange(min=1),
              help="simulated DSP cores (one process each)")
@click.option("--threads", default=0, type=click.IntRange(min=0), help="threads per core (default: cpus / cores)")
@click.option("--job-timeout", default=DEFAULT_JOB_TIMEOUT_S, show_default=True, type=click.FloatRange(min=0),
              help="seconds a task or inference may run before it is stopped (0: no limit; a task's own "
                   "timeout_ms wins; the default is far above any legitimate call, docs/reliability.md §5c)")
@click.option("--conn-memory", default=None,
              help="window bytes one connection may attach (64M, 1G; default: 3/4 of the window)")
def serve(socket, carveout_size, ddr_pool_size, cores, threads, job_timeout, conn_memory):
    """Run the simulated device service in the foreground (Ctrl-C stops it)."""
    from .errors import DspxError
    from .transport import default_socket_path, is_listening

    path = socket or os.environ.get("DSPX_SOCKET") or default_socket_path()
    if is_listening(path):
        raise DspxError(f"a device is already listening on {path} (stop it, or serve on another --socket)")
    sizes = [("--carveout-size", carveout_size), ("--ddr-pool-size", ddr_pool_size)]
    if conn_memory is not None:
        sizes.append(("--conn-memory", conn_memory))
    args = [sys.executable, "-m", "dspx.device", "--cores", str(cores), "--threads", str(threads), "--socket", path,
            "--job-timeout", str(job_timeout)]
    for opt, text in sizes:
        _parse_size(opt, text)
        args += [opt, text]
    # The device is its own program: replace this process rather than import it.
    # It reads its log level from $DSPX_LOG_LEVEL (set by the logging options).
    os.execv(sys.executable, args)


def _parse_size(opt: str, text: str) -> int:
    units = {"k": 1 << 10, "m": 1 << 20, "g": 1 << 30}
    t = text.strip().lower().removesuffix("ib").removesuffix("b")
    try:
        n = int(float(t[:-1]) * units[t[-1]]) if t and t[-1] in units else int(t, 0)
    except ValueError:
        n = -1
    if n <= 0:
        raise click.BadParameter(f"{text!r} is not a size (bytes, or with K/M/G: 64M, 1G)", param_hint=opt)
    return n


@main.command()
@socket_opt
@click.option("--count", "-c", default=10, show_default=True, type=click.IntRange(min=1),
              help="pings to time (at least 1)")
@click.option("--json", "as_json", is_flag=True, help="one JSON object instead of a line of text")
def ping(socket, count, as_json):
    """Round-trip PINGs: median and p99 in µs, device version."""
    with _client(socket, staging_size=0, printf_size=0) as c:
        c.ping()  # warm-up
        rtts = sorted(c.ping()["rtt_us"] for _ in range(count))
        info = c.ping()
        note = private_note(c)
    p99 = rtts[min(len(rtts) - 1, int(round(0.99 * (len(rtts) - 1))))]
    out = {"status": "ok", "count": count, "median_us": round(statistics.median(rtts), 2), "p99_us": round(p99, 2),
           "min_us": round(rtts[0], 2), "version": info["version"], "uptime_ms": info["uptime_ms"],
           "private_device": note is not None}
    if as_json:
        click.echo(json.dumps(out))
        return
    click.echo(f"device {out['version']}: {count} pings, median {out['median_us']} µs, "
               f"p99 {out['p99_us']} µs, min {out['min_us']} µs")
    if note:
        click.echo(note, err=True)


@main.command()
@socket_opt
@click.option("--json", "as_json", is_flag=True, help="one JSON object instead of text")
def status(socket, as_json):
    """Device status: version, uptime, jobs, memory pools."""
    with _client(socket, staging_size=0, printf_size=0) as c:
        st = c.status()
        st.update(c.pools())
        note = private_note(c)
    st["status"] = "ok"
    st["private_device"] = note is not None
    if as_json:
        if note:
            st["note"] = note
        click.echo(json.dumps(st))
        return
    if note:
        click.echo(note)
    click.echo(f"device {st['version']}, up {st['uptime_ms'] / 1000:.1f} s, {st['cores']} core(s)")
    click.echo(f"jobs: {st['jobs_completed']} completed, {st['jobs_failed']} failed")
    click.echo(f"DDR pool: {fmt.size(st['ddr_used'])} / {fmt.size(st['ddr_total'])} used "
               f"(peak {fmt.size(st['ddr_peak'])})")
    click.echo(f"carveout: {fmt.size(st['carveout_used'])} / {fmt.size(st['carveout_total'])} attached")
    click.echo(f"connections: {st['connections']}, modules: {st['modules']}, ops: {st['op_count']}, "
               f"rss: {st['rss_bytes'] / 2**20:.1f} MiB")


# Commands that need heavy optional dependencies live in their own modules:
# (module, attribute, command name).
EXTRA_COMMANDS = (
    ("dspx.host.run_cmd", "run", "run"), ("dspx.compiler.cli_compile", "compile", "compile"),
    ("dspx.host.ops_cmd", "load_ops", "load-ops"), ("dspx.host.ops_cmd", "ops", "ops"),
    ("dspx.host.info_cmd", "info", "info"), ("dspx.host.info_cmd", "devices", "devices"),
    ("dspx.host.llm_cmd", "generate", "generate"), ("dspx.host.llm_cmd", "chat", "chat"),
    ("dspx.host.serve_llm", "command", "serve-llm"),
    ("dspx.compiler.llm_cmd", "compile_llm", "compile-llm"),
    ("dspx.sdk.cli", "sdk", "sdk"), ("dspx.sdk.cli", "build_ops", "build-ops"))


def _unavailable(name: str, error: ImportError) -> click.Command:
    """A stand-in for a command whose module needs an extra that is not
    installed: it is listed, and running it names the extra."""
    from .errors import missing_extra

    missing = missing_extra(error, f"`dspx {name}`")

    @click.command(name, context_settings={"ignore_unknown_options": True, "allow_extra_args": True},
                   help=f"(not installed: {missing or error})", add_help_option=False)
    def stand_in():
        raise missing or error
    return stand_in


def _load_extra_commands():
    for modname, attr, name in EXTRA_COMMANDS:
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


_load_extra_commands()

if __name__ == "__main__":
    main()
