"""``dspx serve-models``: compiled modules over HTTP in the KServe v2 inference
protocol (Triton's HTTP API; dspx.host.serve_models, docs/serve-models.md).

Start-up checks every path and binds the port before anything touches the
device; "serving" is printed once every model is loaded."""
from __future__ import annotations

import click

from ..host import serve_models as server
from .common import socket_opt


@click.command("serve-models")
@click.argument("models", nargs=-1, required=True, metavar="[NAME=]PATH...")
@click.option("--host", default="127.0.0.1", show_default=True,
              help="address to bind (localhost only by default)")
@click.option("--port", default=8000, show_default=True, type=click.IntRange(0, 65535),
              help="HTTP port (Triton's default; 0 = any free port, printed when serving)")
@click.option("--max-body", default=server.MAX_BODY, show_default=True, type=click.IntRange(min=1),
              help="largest request body in bytes (after decompression); a larger one gets 413")
@socket_opt
def serve_models(models, host, port, max_body, socket):
    """Serve compiled modules (directories from `dspx compile`, their model.so, or a directory of
    them) over HTTP in the KServe v2 protocol: /v2/health/ready, /v2/models/NAME,
    /v2/models/NAME/infer (JSON and binary tensors).  A model is named after its directory
    (a .so: its file stem), or NAME=PATH."""
    from ..errors import DspxError

    for mod in ("fastapi", "uvicorn"):
        try:
            __import__(mod)
        except ImportError:
            raise DspxError(f"dspx serve-models needs the 'serve' extra ({mod} is not installed): "
                            f"pip install 'dspx[serve,tvm]'") from None
    sources = server.find_models(models)  # every path checked before the port is bound
    sock = server.listen(host, port)      # a port in use fails before the device is touched

    def ready(bound_host, bound_port):
        where = f"[{bound_host}]" if ":" in bound_host else bound_host
        names = ", ".join(s.name for s in sources)
        click.echo(f"serving {len(sources)} model(s) ({names}) on http://{where}:{bound_port}/v2 "
                   f"(KServe v2 / Triton HTTP); Ctrl-C stops", err=True)

    server.serve_models(sources, sock, socket=socket, max_body=max_body, on_ready=ready)
