"""``dspx farm serve-llm``: ``dspx serve-llm`` on the farm's devices through
Ray Serve, one device per replica (docs/farm.md, "LLM serving";
``dspx.farm.serve``).  Ray is imported only when the command runs."""
from __future__ import annotations

import click

from ..host import serve_llm as server
from .llm import DECODE_ACTIVATIONS_OPTION, _check_package_options, _context, check_serving


@click.command("serve-llm")
@click.option("--replicas", "-n", default=2, show_default=True, type=click.IntRange(min=1),
              help="replicas of the server, each on a device of its own leased from the farm")
@click.option("--key", default="sim", show_default=True, help="lease devices under dspx:KEY")
@click.option("--host", default="127.0.0.1", show_default=True,
              help="address Ray Serve's HTTP proxy binds (localhost only by default; use --api-key before "
                   "opening it wider)")
@click.option("--port", default=8080, show_default=True, type=click.IntRange(1, 65535))
@click.option("--api-key", default=None, envvar="DSPX_API_KEY",
              help="require 'Authorization: Bearer KEY' (default: $DSPX_API_KEY, else none)")
@click.option("--model", "model_dir", default=None, type=click.Path(file_okay=False, exists=True),
              help="directory from `dspx compile-llm` (default: compile the GGUF once into the cache "
                   "($DSPX_CACHE/llm))")
@click.option("--gguf", default=None, type=click.Path(dir_okay=False, exists=True))
@click.option("--context", default=None, type=click.IntRange(min=1),
              help="context to compile for when --model is not given (default: the most that fits: 256 float32, "
                   "512 float16, 1024 int8)")
@click.option("--kv-dtype", default="float32", show_default=True, type=click.Choice(["float32", "float16", "int8"]))
@DECODE_ACTIVATIONS_OPTION
@click.option("--max-queue", default=4, show_default=True, type=click.IntRange(min=0),
              help="requests that may wait per replica; when every replica is full, more get 503")
@click.option("--parallel", default=1, show_default=True, type=click.IntRange(min=1),
              help="KV slots per replica: requests each answers at once")
@click.option("--max-body", default=server.Limits.max_body, show_default=True, type=click.IntRange(min=1),
              help="largest request body in bytes; a larger one gets 413")
@click.option("--lease-timeout", default=60.0, show_default=True, type=click.FloatRange(min=0),
              help="seconds each replica waits for a free device")
@click.option("--start-timeout", default=600.0, show_default=True, type=click.FloatRange(min=0, min_open=True),
              help="seconds for every replica to lease its device and load the model")
@click.option("--farm", "address", default=None, metavar="ADDRESS",
              help="farm address host:port (default: $DSPX_FARM, else the farm `dspx farm up` started)")
def serve_llm(replicas, key, host, port, api_key, model_dir, gguf, context, kv_dtype, decode_activations, max_queue,
              parallel, max_body, lease_timeout, start_timeout, address):
    """`dspx serve-llm` on the farm: N replicas behind Ray Serve, one device
    each.  A conversation stays on one replica (its KV prefix is reused);
    when every replica is full a request gets 503 at once.  Ctrl-C stops it
    and gives the devices back."""
    import os
    import signal
    import threading
    from pathlib import Path

    check_serving("farm serve-llm", ("fastapi", "sse_starlette", "prometheus_client"), "dspx[serve,llm,farm]",
                  host, api_key, "the farm's devices")
    _check_package_options(model_dir, context, kv_dtype, decode_activations)
    server.bind(host, port).close()  # a port in use (or a bad --host) is one error now, not a proxy that dies

    import dspx.farm as f  # before ray: it sets Ray's loopback switch
    from dspx.farm import serve as farm_serve

    f.cluster.connect(f.find(address))
    try:
        devices = f.actors.find_devices(key)
        if len(devices) < replicas:
            raise f.FarmError(f"--replicas {replicas} needs as many devices under dspx:{key}; the farm has "
                              f"{len(devices)} ({', '.join(devices) or 'none'})")
        if model_dir is None:
            from ..compiler.llm import compiled_dir

            # compiled here, once: every replica on this machine reads the same package
            model_dir = compiled_dir(gguf, progress=True, context=_context(context, kv_dtype), kv_dtype=kv_dtype,
                                     decode_activations=decode_activations)
        # $DSPX_LLM_DECODE as serve-llm reads it, here: the replicas run in the farm's environment, not this one
        settings = farm_serve.Settings(str(Path(model_dir).resolve()), replicas, key, parallel, max_queue, api_key,
                                       server.Limits(max_body=max_body), lease_timeout,
                                       decode_threads=os.environ.get("DSPX_LLM_DECODE") or None)
        click.echo(f"starting {replicas} replica(s) on dspx:{key} devices (each leases one and loads the model) …",
                   err=True)
        try:
            url = farm_serve.start(settings, host, port, timeout=start_timeout)
            stopping = threading.Event()
            for sig in (signal.SIGINT, signal.SIGTERM):  # either one: stop cleanly, the devices go back
                signal.signal(sig, lambda *_: stopping.set())
            where = ", ".join(f"{r['replica']}: {r['device']}" for r in farm_serve.replicas_info())
            click.echo(f"serving the device LLM on {url}/v1 with {replicas} replica(s) ({where}; OpenAI API, "
                       f"llama-server's /health /metrics /tokenize /detokenize /props /slots"
                       f"{', API key required' if api_key else ''}); Ctrl-C stops", err=True)
            while not stopping.wait(1.0):
                pass
        finally:
            click.echo("stopping: the replicas give their devices back …", err=True)
            farm_serve.stop()
    finally:
        f.cluster.disconnect()
