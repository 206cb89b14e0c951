"""The one error policy of every ``dspx`` command (applied by ``DspxGroup``):
a user mistake ends as one ``error: …`` line on stderr, or with ``--json`` one
JSON error object on stdout, and a non-zero exit; Ctrl-C exits 130."""
from __future__ import annotations

import json
import logging
import sys

import click

EXIT_ERROR, EXIT_USAGE, EXIT_INTERRUPTED = 1, 2, 130


def _compile_error(e: BaseException) -> bool:
    # Asked without importing the compiler (it needs the tvm extra): a raised
    # CompileError means its module is loaded.
    checks = sys.modules.get("dspx.compiler.checks")
    return checks is not None and isinstance(e, checks.CompileError)


def error_object(e: BaseException) -> dict:
    """The JSON error object for ``e``: status, error (name), message, code and the numbers."""
    from ..errors import DeviceError, MissingExtra

    out = {"status": "error", "error": type(e).__name__, "message": str(e), "code": -(getattr(e, "errno", None) or 1)}
    if isinstance(e, DeviceError):
        out.update(code=e.status, error=e.status_name, message=e.detail or str(e), **e.numbers)
    if isinstance(e, MissingExtra):  # a device's too (DeviceMissingExtra): the extra to install
        out.update(extra=e.extra, module=e.module)
    if isinstance(e, click.UsageError):
        out.update(code=-EXIT_USAGE, error="UsageError", message=e.format_message())
    elif _compile_error(e):
        out.update(operators=e.operators, node=e.node)
    return out


def message(e: BaseException) -> str:
    """The text after ``error: ``: a user error's own words, anything else named by its type."""
    from ..errors import DspxError

    if isinstance(e, OSError) and not isinstance(e, DspxError) and e.strerror:
        where = f"{e.filename}: " if e.filename else ""
        return f"{where}{e.strerror}"
    text = str(e) if str(e) else type(e).__name__
    user = isinstance(e, (DspxError, OSError, ValueError)) or _compile_error(e)
    return text if user else f"{type(e).__name__}: {text}"


def user_error(e: Exception, what: str) -> Exception:
    """``e``, or the MissingExtra it stands for (an import error, here or on the device)."""
    from ..errors import DeviceError, MissingExtra, device_missing_module, missing_extra

    if isinstance(e, MissingExtra):  # already names the extra (and, from a device, says so)
        return e
    if isinstance(e, ImportError):
        return missing_extra(e, what) or e
    # A device without an optional dependency says so in its text.
    module = device_missing_module(e.detail) if isinstance(e, DeviceError) else None
    if module:
        return MissingExtra(module, f"the device ({e.status_name} on {e.request or 'a request'})")
    return e


def report(e: BaseException, as_json: bool, text: str) -> None:
    """Tell the user: the JSON error object on stdout, or ``error: text`` on stderr."""
    if as_json:
        click.echo(json.dumps(error_object(e) | ({"message": text} if isinstance(e, click.UsageError) else {})))
    else:
        click.echo(f"error: {text}", err=True)


def handle(ctx: click.Context, run, as_json: bool):
    """``run()`` under the policy: every failure ends as one report and its exit code."""
    try:
        return run()
    except (click.exceptions.Exit, click.Abort, BrokenPipeError):  # click ends a closed pipe quietly
        raise
    except click.UsageError as e:
        hint = f" (see '{e.ctx.command_path} --help')" if e.ctx else ""
        report(e, as_json, f"{e.format_message()}{hint}")
        ctx.exit(EXIT_USAGE)
    except click.ClickException as e:
        report(e, as_json, e.format_message())
        ctx.exit(e.exit_code)
    except KeyboardInterrupt:
        click.echo("interrupted", err=True)
        ctx.exit(EXIT_INTERRUPTED)
    except Exception as e:  # noqa: BLE001 — every failure ends as one line; -vv logs the traceback
        cmd = ctx.invoked_subcommand or "dspx"
        e = user_error(e, f"`dspx {cmd}`")
        logging.getLogger("dspx").debug("traceback of the error below", exc_info=True)
        first, _, rest = message(e).strip().partition("\n")  # one line; the rest (a device's traceback) at debug
        if rest:
            logging.getLogger("dspx").debug("the rest of the error:\n%s", rest)
        report(e, as_json, first)
        ctx.exit(EXIT_ERROR)
