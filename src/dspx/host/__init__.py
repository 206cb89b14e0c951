"""Host side: what applications import."""
from .. import trace as _trace

_trace.host_from_env()  # DSPX_TRACE=out.json traces any host program (docs/profiling.md)
