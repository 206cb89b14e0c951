"""Built-in operator command ids and their parameter structs, as the host
(``dspx.host.tasks``, the C ``hb_ucp`` flow) writes them and the device's
firmware operators read them.

``hbDSPSoftmaxParam`` is the seed's C struct as C lays it out (it is not
packed on either side of the seed): ``int32 data_size`` (bytes) at 0, padding,
``uint64 input`` (DSP address of the float32 data) at 8, ``uint8 run_tcm_opt``
at 16, tail padding to 24 bytes.  ``run_tcm_opt`` 0 computes over DDR
directly, 1 streams the data through the two L2 banks (ping-pong DMA).
"""
from __future__ import annotations

import struct

SOFTMAX_CMD = 0x1402
SOFTMAX_LATENCY_US = 0
#: hbDSPSoftmaxParam with C's natural alignment (x86-64 and the DSP agree)
SOFTMAX_PARAM = struct.Struct("<i4xQB7x")
assert SOFTMAX_PARAM.size == 24

# Fault injection (tests only, off by default): with DSPX_FAULT_INJECTION=1 in
# the device's environment, every core registers FAULT_CRASH_CMD
# ("fault.crash"), whose handler kills its core process, so tests can crash a
# core through the ordinary RPC path.
FAULT_INJECTION_ENV = "DSPX_FAULT_INJECTION"
FAULT_CRASH_CMD = 0xFA01


def softmax_param(data_size: int, input_addr: int, run_tcm_opt: bool) -> bytes:
    return SOFTMAX_PARAM.pack(data_size, input_addr, 1 if run_tcm_opt else 0)


def read_softmax_param(buf) -> tuple[int, int, int]:
    """(data_size, input, run_tcm_opt) from the first 24 bytes of ``buf``."""
    return SOFTMAX_PARAM.unpack_from(buf)
