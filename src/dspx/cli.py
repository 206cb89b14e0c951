"""``dspx`` — the command line.  Outputs for programs are JSON (``--json``);
outputs for people are short readable lines."""
from __future__ import annotations

import json
import os
import statistics
import sys

import click

from . import memory


def _client(socket, **kw):
    from .host.client import Client
    return Client(socket, **kw)


def _fail(e: Exception, as_json: bool) -> None:
    from .errors import DeviceError

    if as_json:
        out = {"status": "error", "error": type(e).__name__, "message": str(e)}
        if isinstance(e, DeviceError):
            out.update(code=e.status, error=e.status_name, message=e.detail or str(e), **e.numbers)
        click.echo(json.dumps(out))
    else:
        click.echo(f"error: {e}", err=True)
    sys.exit(1)


socket_opt = click.option("--socket", default=None, envvar="DSPX_SOCKET",
                          help="device socket (default: a private simulated device when none is running)")


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="dspx")
def main():
    """dspx: offload compute from this host to a DSP (simulated on x86 when no board is present)."""


@main.command()
@click.option("--socket", default=None, help="socket path (default: $DSPX_SOCKET or the per-user path)")
@click.option("--carveout-size", default=str(memory.CARVEOUT_SIZE), show_default=True, help="shared window bytes (512M, …)")
@click.option("--ddr-pool-size", default=str(memory.DDR_POOL_SIZE), show_default=True)
@click.option("--cores", default=1, show_default=True, help="simulated DSP cores (processes)")
@click.option("--threads", default=0, help="threads per core (default: cpus / cores)")
def serve(socket, carveout_size, ddr_pool_size, cores, threads):
    """Run the simulated device service in the foreground (Ctrl-C stops it)."""
    args = [sys.executable, "-m", "dspx.device", "--carveout-size", carveout_size, "--ddr-pool-size",
            ddr_pool_size, "--cores", str(cores), "--threads", str(threads)]
    if socket:
        args += ["--socket", socket]
    # The device is its own program: replace this process rather than import it.
    os.execv(sys.executable, args)


@main.command()
@socket_opt
@click.option("--count", "-c", default=10, show_default=True)
@click.option("--json", "as_json", is_flag=True)
def ping(socket, count, as_json):
    """Round-trip PINGs: median and p99 in µs, device version."""
    try:
        with _client(socket, staging_size=0, printf_size=0) as c:
            c.ping()  # warm-up
            rtts = sorted(c.ping()["rtt_us"] for _ in range(count))
            info = c.ping()
    except Exception as e:
        _fail(e, as_json)
    p99 = rtts[min(len(rtts) - 1, int(round(0.99 * (len(rtts) - 1))))]
    out = {"status": "ok", "count": count, "median_us": round(statistics.median(rtts), 2), "p99_us": round(p99, 2),
           "min_us": round(rtts[0], 2), "version": info["version"], "uptime_ms": info["uptime_ms"]}
    if as_json:
        click.echo(json.dumps(out))
    else:
        click.echo(f"device {out['version']}: {count} pings, median {out['median_us']} µs, "
                   f"p99 {out['p99_us']} µs, min {out['min_us']} µs")


@main.command()
@socket_opt
@click.option("--json", "as_json", is_flag=True)
def status(socket, as_json):
    """Device status: version, uptime, jobs, memory pools."""
    try:
        with _client(socket, staging_size=0, printf_size=0) as c:
            st = c.status()
            st.update(c.pools())
    except Exception as e:
        _fail(e, as_json)
    st["status"] = "ok"
    if as_json:
        click.echo(json.dumps(st))
        return
    click.echo(f"device {st['version']}, up {st['uptime_ms'] / 1000:.1f} s, {st['cores']} core(s)")
    click.echo(f"jobs: {st['jobs_completed']} completed, {st['jobs_failed']} failed")
    click.echo(f"DDR pool: {st['ddr_used']:,} / {st['ddr_total']:,} bytes used (peak {st['ddr_peak']:,})")
    click.echo(f"carveout: {st['carveout_used']:,} / {st['carveout_total']:,} bytes attached")
    click.echo(f"connections: {st['connections']}, modules: {st['modules']}, ops: {st['op_count']}, "
               f"rss: {st['rss_bytes'] / 2**20:.1f} MiB")


def _load_extra_commands():
    # Commands that need heavy optional dependencies live in their own modules.
    for modname, attr in (("dspx.host.run_cmd", "run"), ("dspx.compiler.cli_compile", "compile"),
                          ("dspx.host.ops_cmd", "load_ops"), ("dspx.host.ops_cmd", "ops"),
                          ("dspx.host.llm_cmd", "generate"), ("dspx.host.llm_cmd", "chat"),
                          ("dspx.compiler.llm_cmd", "compile_llm")):
        try:
            mod = __import__(modname, fromlist=[attr])
        except ImportError as e:
            if e.name and e.name.startswith("dspx"):
                continue
            raise
        cmd = getattr(mod, attr, None)
        if cmd is not None:
            main.add_command(cmd)


_load_extra_commands()
main.add_command(__import__("dspx.sdk.cli", fromlist=["sdk"]).sdk)
main.add_command(__import__("dspx.sdk.cli", fromlist=["build_ops"]).build_ops)

if __name__ == "__main__":
    main()
