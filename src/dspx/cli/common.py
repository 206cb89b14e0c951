"""What several ``dspx`` commands share: the ``--socket`` and ``--private``
options and the note about a private device."""
from __future__ import annotations

import functools
import ipaddress
import os

import click
from click.core import ParameterSource

SOCKET_HELP = ("device socket (default: $DSPX_SOCKET, else the per-user background device, started on first use "
               "and stopped after $DSPX_IDLE_EXIT seconds without a connection, 300; `dspx stop` ends it)")
PRIVATE_HELP = ("a private simulated device for this command, started for it and stopped after it "
                "(also $DSPX_PRIVATE=1)")
# Commands with a --socket that are no client of a device, so take no --private.
NOT_CLIENTS = ("serve", "stop")

socket_opt = click.option("--socket", default=None, envvar="DSPX_SOCKET", help=SOCKET_HELP)


def add_private_option(cmd: click.Command) -> None:
    """Give a device-client command ``--private``, and hand its callback
    ``socket=None`` unless --socket was on the command line (the launcher
    reads $DSPX_SOCKET itself, so its hints name what the user did)."""
    if cmd.name in NOT_CLIENTS or not any(p.name == "socket" for p in cmd.params) or \
            any(p.name == "private" for p in cmd.params):
        return
    cmd.params.append(click.Option(["--private"], is_flag=True, help=PRIVATE_HELP))
    callback = cmd.callback

    @functools.wraps(callback)
    def run(*args, private=False, **kw):
        from ..host.launcher import PRIVATE_ENV

        named = click.get_current_context().get_parameter_source("socket") == ParameterSource.COMMANDLINE
        if private and named:
            raise click.UsageError("--private and --socket exclude each other: a private device has a socket of "
                                   "its own")
        if private:  # for whatever client the command opens (and any device it starts)
            os.environ.pop("DSPX_SOCKET", None)
            os.environ[PRIVATE_ENV] = "1"
        if not named:
            kw["socket"] = None
        return callback(*args, **kw)

    cmd.callback = run


def private_note(client) -> str | None:
    """What to tell the user when the answer came from a private device."""
    if getattr(client, "device", None) is None:
        return None
    return ("this answer is from a private device started for this command and stopped after it (--private, "
            "$DSPX_PRIVATE, more cores, or a device setting such as $DSPX_COST_MODEL in the environment)")


def is_loopback(host: str) -> bool:
    """Whether a --host / --listen address is this machine's loopback (no
    import of Ray: a farm command must set Ray's auth mode before that)."""
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"
