"""``python -m dspx.device``: run the device service (what ``dspx serve`` runs)."""
from __future__ import annotations

import argparse
import signal
import sys

from .. import costmodel, memory, trace
from ..abi.protocol import DEFAULT_JOB_TIMEOUT_S
from ..transport import TransportError, default_socket_path
from .front.loop import Service


def parse_size(text: str) -> int:
    units = {"k": 1 << 10, "m": 1 << 20, "g": 1 << 30}
    t = text.strip().lower().removesuffix("ib").removesuffix("b")
    if t and t[-1] in units:
        return int(float(t[:-1]) * units[t[-1]])
    return int(t, 0)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="dspx-device", description="simulated DSP device service")
    ap.add_argument("--socket", default=None, help="socket path (default: $DSPX_SOCKET or the per-user path)")
    ap.add_argument("--carveout-size", type=parse_size, default=memory.CARVEOUT_SIZE)
    ap.add_argument("--ddr-pool-size", type=parse_size, default=memory.DDR_POOL_SIZE)
    ap.add_argument("--cores", type=int, default=1)
    ap.add_argument("--threads", type=int, default=0, help="threads per core (default: cpus / cores)")
    ap.add_argument("--parent-pid", type=int, default=None, help="exit when this parent process is gone")
    ap.add_argument("--job-timeout", type=float, default=DEFAULT_JOB_TIMEOUT_S,
                    help=f"seconds a task or inference may run before it is stopped (default "
                         f"{DEFAULT_JOB_TIMEOUT_S:.0f}; 0: no limit; a request's own timeout_ms wins)")
    ap.add_argument("--conn-memory", type=parse_size, default=None,
                    help="window bytes one connection may attach (default: 3/4 of the carveout window)")
    ap.add_argument("--idle-exit", type=float, default=0.0, metavar="SECONDS",
                    help="stop after this long with no connection (default 0: never)")
    ap.add_argument("--quiet", action="store_true")
    a = ap.parse_args(argv)
    trace.start_from_env("device front", 1, "front loop")  # DSPX_TRACE: the front's timeline (docs/profiling.md)
    if a.cores < 1:
        ap.error("--cores must be at least 1")
    try:
        # $DSPX_COST_MODEL checked once here; a user's file is passed to the cores as its JSON text
        costmodel.resolve_env()
    except costmodel.ProfileError as e:
        print(f"dspx-device: {e}", file=sys.stderr, flush=True)
        return 2
    from ..log import printer  # the host's logging setup; the level from $DSPX_LOG_LEVEL (dspx -v / --log-level)
    log = (lambda *m: None) if a.quiet else printer()
    try:
        svc = Service(a.socket or default_socket_path(), a.carveout_size, a.ddr_pool_size, a.cores, a.threads,
                      a.parent_pid, log, a.job_timeout, a.conn_memory, a.idle_exit)
        svc.serve_forever()
    except TransportError as e:  # e.g. an untrusted socket directory
        print(f"dspx-device: {e}", file=sys.stderr, flush=True)
        return 2
    return 128 + signal.SIGINT if svc.stopped_by == signal.SIGINT else 0  # Ctrl-C: 130, as a shell reports it


if __name__ == "__main__":
    sys.exit(main())
