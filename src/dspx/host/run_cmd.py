"""``dspx run``: open → load → infer → unload → close in one connection,
then one JSON line on stdout."""
from __future__ import annotations

import json
import sys

import click
import numpy as np


@click.command("run")
@click.argument("module", type=click.Path(exists=True))
@click.option("--input", "-i", "inputs", multiple=True, required=True, help="input .npy (or raw .bin), in order")
@click.option("--shape", multiple=True, help="shape for a raw .bin input, e.g. 1,3,224,224 (one per .bin)")
@click.option("--dtype", multiple=True, help="dtype for a raw .bin input (one per .bin)")
@click.option("--output", "-o", default=None, help="write outputs: .npz (all), .npy or .bin (the first)")
@click.option("--repeat", default=0, help="run the entry N times (per-run cycles go to printf)")
@click.option("--kv-resident", is_flag=True, help="KV_RESIDENT: outputs past the first stay in the KV region")
@click.option("--socket", default=None, envvar="DSPX_SOCKET")
def run(module, inputs, shape, dtype, output, repeat, kv_resident, socket):
    """Run a compiled MODULE (dir or .so) once on the device; print one JSON line."""
    from ..errors import DeviceError
    from .vm import VirtualMachine, load_input

    try:
        shapes = [tuple(int(s) for s in sh.split(",")) for sh in shape]
        arrays, raw = [], 0
        for path in inputs:
            if path.endswith(".npy"):
                arrays.append(load_input(path))
            else:
                arrays.append(load_input(path, shapes[raw] if raw < len(shapes) else None,
                                         dtype[raw] if raw < len(dtype) else None))
                raw += 1
        with VirtualMachine(module, socket=socket) as vm:
            outs = vm.run_nocopy(*arrays, repeat=repeat, kv_resident=kv_resident)
            outs = outs if isinstance(outs, list) else [outs]
            descs = []
            for i, o in enumerate(outs):
                code, bits = {"i": 0, "u": 1, "f": 2}[o.dtype.kind], o.dtype.itemsize * 8
                descs.append({"index": i, "ndim": o.ndim, "dtype_code": code, "dtype_bits": bits,
                              "data_size": int(o.nbytes), "shape": list(o.shape)})
            if output:
                if output.endswith(".npz"):
                    np.savez(output, *[np.array(o) for o in outs])
                elif output.endswith(".npy"):
                    np.save(output, np.array(outs[0]))
                else:
                    np.array(outs[0]).tofile(output)
            result = {"status": "ok", "cycles": vm.last_cycles, "num_outputs": len(outs), "outputs": descs}
    except DeviceError as e:
        click.echo(json.dumps({"status": "error", "code": e.status, "error": e.status_name,
                               "message": e.detail or str(e), **e.numbers}))
        sys.exit(1)
    except Exception as e:
        code = getattr(e, "errno", None)
        click.echo(json.dumps({"status": "error", "code": -(code or 1), "error": type(e).__name__,
                               "message": str(e)}))
        sys.exit(1)
    click.echo(json.dumps(result))
