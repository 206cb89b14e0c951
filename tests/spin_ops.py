"""The op library that holds a core, for the fault, back-pressure and
user-code tests: SPIN runs for the milliseconds in its input's first int32
(an abort stops it), STUBBORN swallows every abort so only killing its core
stops it, FOREVER loops until aborted, NOP returns at once.  SPIN and
STUBBORN write b"RUN!" to their output first, so a caller sees them run."""
from __future__ import annotations

import textwrap

SPIN, STUBBORN, FOREVER, NOP = 0x3A01, 0x3A02, 0x3A03, 0x3A04

SOURCE = textwrap.dedent(f"""
    import numpy as np
    from dspx.device.core import runtime as rt

    @rt.register_op({SPIN:#x})
    def spin(inp, out, tm):
        out[:4] = np.frombuffer(b"RUN!", np.uint8)  # tells the caller it runs
        ms = int(np.frombuffer(inp, np.int32, count=1)[0])
        t0 = rt.cycles()
        while rt.cycles() - t0 < ms * 1_000_000:
            pass
        return 0

    @rt.register_op({STUBBORN:#x})
    def stubborn(inp, out, tm):  # swallows the abort: only killing its core stops it
        out[:4] = np.frombuffer(b"RUN!", np.uint8)
        while True:
            try:
                while True:
                    pass
            except BaseException:
                pass

    @rt.register_op({FOREVER:#x})
    def forever(inp, out, tm):
        while True:
            pass

    @rt.register_op({NOP:#x})
    def nop(inp, out, tm):
        return 0
""")


def device(*args: str):
    """A device started with ``args`` that has this library loaded."""
    from conftest import Device
    from dspx.host.tasks import Tasks

    d = Device(*args)
    with Tasks(socket=d.path) as u:
        u.load_ops(SOURCE, device_wide=True)  # for the whole device, after this session
    return d
