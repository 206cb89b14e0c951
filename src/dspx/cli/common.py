"""What several ``dspx`` commands share: the ``--socket`` option and the note
about a private device."""
from __future__ import annotations

import click

SOCKET_HELP = ("device socket (default: $DSPX_SOCKET, else the per-user socket when a device listens there, "
               "else a private simulated device started for this command)")

socket_opt = click.option("--socket", default=None, envvar="DSPX_SOCKET", help=SOCKET_HELP)


def private_note(client) -> str | None:
    """What to tell the user when the answer came from a private device."""
    if getattr(client, "device", None) is None:
        return None
    return ("no device was running: this answer is from a private device started for this command "
            "and stopped after it (`dspx serve` runs one that stays)")
