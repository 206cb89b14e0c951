"""The internal channel between the device front and its cores.

Both ends are this package's own code, so jobs are pickled dicts over a
SEQPACKET socketpair; dmabuf fds ride along (SCM_RIGHTS) the first time a
core needs a buffer.  Nothing outside ``dspx.device`` sees this channel.
"""
from __future__ import annotations

import pickle

from ..transport import Endpoint

MAX_JOB_MSG = 1 << 20
MAX_JOB_FDS = 250  # SCM_MAX_FD: every buffer a connection has, on its first job


def endpoint(sock) -> Endpoint:
    return Endpoint(sock, MAX_JOB_MSG, MAX_JOB_FDS)


def send(ep: Endpoint, obj: dict, fds=()) -> None:
    ep.send(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL), fds)


def recv(ep: Endpoint, timeout: float | None = None) -> tuple[dict, list[int]]:
    data, fds, truncated = ep.recv(timeout, bufsize=MAX_JOB_MSG)
    if truncated:
        raise ValueError("internal job message truncated")
    return pickle.loads(data), fds
