"""``dspx.farm``: simulated devices (later, boards) as Ray actors, for batch
runs spread over many devices (docs/farm.md).

    import dspx.farm
    results = dspx.farm.map("build/model", {"x": xs})     # xs: (N, *input_shape)
    results[0].outputs["relu"], results[0].device, results[0].attempt

A farm is a Ray cluster whose nodes offer ``dspx:<key>`` resources, one unit
per device; each device is a Ray actor holding one unit, owning a simulated
device process and a client (``actors.py``).  ``cluster.py`` starts and
finds a local farm on loopback; ``batch.py`` maps a module over inputs;
``leases.py`` holds one device for interactive use, granted by the farm's
``broker.py``.

This package imports Ray: it is the ``farm`` extra (``pip install
'dspx[farm]'``).  The single-machine path (``dspx.Client``,
``VirtualMachine``) never imports it.
"""
from __future__ import annotations

import os

# Ray reads these when it is first imported, so they are set before that.
# RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 is Ray's single-node switch (its default
# on macOS and Windows): the node's address is the loopback one, so every Ray
# server of a local farm binds 127.0.0.1 instead of the machine's routable
# address (docs/farm.md, "What crosses the network").  A user who set either
# keeps their value.
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")

from .batch import Result, map  # noqa: E402
from . import ops  # noqa: E402,F401  (dspx.farm.ops: op cases)
from .cluster import DEFAULT_KEY, Farm, FarmError, LocalFarm, connect, find  # noqa: E402
from .leases import Lease, LeaseTimeout, QueueTimeout, RunTimeout, acquire, lease, status  # noqa: E402

__all__ = ["DEFAULT_KEY", "Farm", "FarmError", "Lease", "LeaseTimeout", "LocalFarm", "QueueTimeout", "Result",
           "RunTimeout", "acquire", "connect", "find", "lease", "map", "status"]
