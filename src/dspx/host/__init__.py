"""Host side: what applications import."""
from . import tracing as _tracing

_tracing.host_from_env()  # DSPX_TRACE=out.json traces any host program (docs/profiling.md)
