"""``dspx serve``, ``stop``, ``ping``, ``status`` and ``devices``: a device
service and what runs there."""
from __future__ import annotations

import glob
import json
import os
import statistics
import sys

import click

from .. import fmt, memory
from ..abi.protocol import DEFAULT_JOB_TIMEOUT_S
from ..errors import DspxError
from .common import private_note, socket_opt


def _client(socket, **kw):
    from ..host.client import Client
    return Client(socket, **kw)


def _size_option(name, default, what):
    return click.option(name, default=fmt.size(default), show_default=True,
                        help=f"{what} (bytes, or with K/M/G: 64M, 1G)")


@click.command()
@click.option("--socket", default=None, help="socket to listen on (default: $DSPX_SOCKET or the per-user "
                                             "socket ${XDG_RUNTIME_DIR:-/tmp}/dspx-<uid>/dsp0.sock)")
@_size_option("--carveout-size", memory.CARVEOUT_SIZE, "shared window every client's buffers map into")
@_size_option("--ddr-pool-size", memory.DDR_POOL_SIZE, "device memory for modules, weights and task buffers")
@click.option("--cores", default=1, show_default=True, type=click.IntRange(min=1),
              help="simulated DSP cores (one process each)")
@click.option("--threads", default=0, type=click.IntRange(min=0), help="threads per core (default: cpus / cores)")
@click.option("--job-timeout", default=DEFAULT_JOB_TIMEOUT_S, show_default=True, type=click.FloatRange(min=0),
              help="seconds a task or inference may run before it is stopped (0: no limit; a task's own "
                   "timeout_ms wins; the default is far above any legitimate call, docs/reliability.md §6)")
@click.option("--conn-memory", default=None,
              help="window bytes one connection may attach (64M, 1G; default: 3/4 of the window)")
@click.option("--cost-model", "cost_model", default=None, metavar="NAME|FILE",
              help="estimate the board's cycles with this timing-model profile (j6-vision, c7x-j722s or a file; "
                   "also $DSPX_COST_MODEL; docs/cost-model.md)")
@click.option("--idle-exit", default=0.0, show_default=True, type=click.FloatRange(min=0), metavar="SECONDS",
              help="stop after this long with no connection (0: never; the background device commands start "
                   "uses $DSPX_IDLE_EXIT, default 300)")
def serve(socket, carveout_size, ddr_pool_size, cores, threads, job_timeout, conn_memory, cost_model, idle_exit):
    """Run the simulated device service in the foreground (Ctrl-C stops it).
    A socket in a shared directory such as /tmp lives in its private
    subdirectory dspx-<uid>; an existing file is replaced only if it is a
    socket no device listens on."""
    from ..transport import default_socket_path, is_listening, serve_refusal, socket_path

    path = socket_path(socket or default_socket_path())
    if is_listening(path):
        raise DspxError(f"a device is already listening on {path} (`dspx stop{_socket_arg(socket)}` ends it, "
                        f"or serve on another --socket)")
    refusal = serve_refusal(path)
    if refusal is not None:
        raise DspxError(f"{refusal}: refusing to serve there (choose another --socket)")
    sizes = [("--carveout-size", carveout_size), ("--ddr-pool-size", ddr_pool_size)]
    if conn_memory is not None:
        sizes.append(("--conn-memory", conn_memory))
    args = [sys.executable, "-m", "dspx.device", "--cores", str(cores), "--threads", str(threads), "--socket", path,
            "--job-timeout", str(job_timeout), "--idle-exit", str(idle_exit)]
    for opt, text in sizes:
        _parse_size(opt, text)
        args += [opt, text]
    if cost_model is not None:
        from .. import costmodel

        costmodel.load(cost_model)  # a bad name or file is refused here, in the user's words
        os.environ[costmodel.ENV] = cost_model
    # The device is its own program: replace this process rather than import it.
    # It reads its log level from $DSPX_LOG_LEVEL (set by the logging options).
    os.execv(sys.executable, args)


def _socket_arg(socket: str | None) -> str:
    return f" --socket {socket}" if socket else ""


@click.command()
@click.option("--socket", default=None, help="the device's socket (default: $DSPX_SOCKET, else the per-user "
                                             "socket, where commands start the background device)")
@click.option("--json", "as_json", is_flag=True, help="one JSON object instead of a line of text")
def stop(socket, as_json):
    """Stop the device on the default socket (or --socket): the background
    device commands start, or a `dspx serve`.  Nothing running is not an error."""
    from ..host import launcher
    from ..transport import default_socket_path, socket_path

    path = socket_path(socket or default_socket_path())
    pid = launcher.stop(path)
    if as_json:
        click.echo(json.dumps({"status": "ok", "socket": path, "stopped": pid is not None, "pid": pid}))
    elif pid is None:
        click.echo(f"no device is running on {path}; nothing to stop")
    else:
        click.echo(f"stopped the device on {path} (pid {pid})")


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


@click.command()
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


@click.command()
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


# ---------------------------------------------------------------- devices

def candidate_sockets() -> list[tuple[str, str]]:
    """(path, how it was found): $DSPX_SOCKET, the per-user default, and any
    other socket in the per-user directory."""
    found, seen = [], set()

    def add(path, why):
        if path and path not in seen:
            seen.add(path)
            found.append((path, why))

    from ..transport import socket_path, user_socket_path

    env = os.environ.get("DSPX_SOCKET")
    add(env and socket_path(env), "$DSPX_SOCKET")
    default = user_socket_path()
    add(default, "default")
    for p in sorted(glob.glob(os.path.join(os.path.dirname(default), "*.sock"))):
        add(p, "per-user directory")
    return found


def probe(path: str, why: str) -> dict:
    from ..transport import is_listening

    d = {"socket": path, "found_by": why}
    if not os.path.exists(path):
        return {**d, "state": "absent"}
    if not is_listening(path):
        return {**d, "state": "stale", "note": "a socket file no device listens on (left by a device that died)"}
    from ..host.client import Client
    try:
        with Client(path, staging_size=0, printf_size=0, timeout=5) as c:
            st, pools = c.status(), c.pools()
    except DspxError as e:
        return {**d, "state": "unreachable", "error": str(e)}
    return {**d, "state": "running", "version": st["version"], "uptime_ms": st["uptime_ms"],
            "cores": pools.get("cores"), "connections": pools.get("connections", 1) - 1,
            "carveout_total": pools.get("carveout_total"), "carveout_used": pools.get("carveout_used"),
            "ddr_total": pools.get("ddr_total"), "ddr_used": pools.get("ddr_used")}


@click.command("devices")
@click.option("--json", "as_json", is_flag=True, help="one JSON object instead of text")
def devices(as_json):
    """List the devices this user can reach: $DSPX_SOCKET, the per-user
    default socket and any other socket beside it (stale socket files are
    named as such), each with its version, cores, uptime and memory."""
    found = [d for d in (probe(p, why) for p, why in candidate_sockets())
             if d["state"] != "absent" or d["found_by"] == "$DSPX_SOCKET"]
    if as_json:
        click.echo(json.dumps({"status": "ok", "devices": found}))
        return
    if not found:
        click.echo("no device is running (the first command that needs one starts the background device; "
                   "`dspx serve` runs one in the foreground)")
    for d in found:
        if d["state"] == "running":
            click.echo(f"{d['socket']}  device {d['version']}, {d['cores']} core(s), up "
                       f"{d['uptime_ms'] / 1000:.1f} s, carveout {fmt.size(d['carveout_used'])} / "
                       f"{fmt.size(d['carveout_total'])}, DDR {fmt.size(d['ddr_used'])} / "
                       f"{fmt.size(d['ddr_total'])}, {d['connections']} other connection(s)  [{d['found_by']}]")
        else:
            click.echo(f"{d['socket']}  {d['state']}: {d.get('note') or d.get('error') or 'no such file'}  "
                       f"[{d['found_by']}]")
