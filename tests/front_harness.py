"""A front's request handlers driven directly, with no socket and no core
process: the ``front`` fixture (conftest.py) and the helpers that read the
actions a handler returns.  Dmabufs are real sealed memfds, so attach maps
real pages."""
from __future__ import annotations

import os

from dspx import memory
from dspx.abi import protocol as P
from dspx.device import jobs
from dspx.device.front.actions import Respond, Submit
from dspx.device.front.handlers import Handlers
from dspx.device.front.state import Conn, Cores, DeviceState, ModuleRec

MiB = 1 << 20


SIG = jobs.ModuleSig(False, [jobs.TensorSig("x", (2, 8), "float32")])


class Front:
    """A fresh front with one connection: calling it handles a request from that
    connection and returns the actions."""

    def __init__(self, cores: int = 2):
        self.st = DeviceState(carveout_size=64 * MiB, ddr_pool_size=8 * MiB)
        self.h = Handlers(self.st, Cores(cores, lambda i: 1))
        self.conn = Conn(self.st.new_id(), None, 0)
        self.st.conns[self.conn.cid] = self.conn
        self.bufs = []

    def __call__(self, req, fds=()):  # fds: the front's own (SCM_RIGHTS gives it a dup)
        return self.h.handle(self.conn, req, list(fds))

    def attach(self, size: int, staging: bool = False, kv: int = 0) -> int:
        b = memory.DmaBuf(size, "test")
        self.bufs.append(b)
        (resp,) = responses(self(P.BufAttach(size=size, flags=P.ATTACH_STAGING if staging else 0, kv_size=kv),
                                 [os.dup(b.fd)]))
        assert resp.status == 0, resp
        return resp.dsp_addr

    def module(self, signature=SIG) -> int:
        h = self.st.new_id()
        self.st.modules[h] = ModuleRec(h, self.conn.cid, 0, 1, "module", 0, signature)
        self.conn.modules.add(h)
        return h


def responses(actions):
    return [a.msg for a in actions if isinstance(a, Respond)]


def status(actions) -> int:
    (r,) = responses(actions)
    return r.status


def submitted(actions):
    (s,) = [a for a in actions if isinstance(a, Submit)]
    return s.job


def infer_req(base: int, handle: int, size: int, descs, flags: int = 0, out=None):
    out_addr, out_size = out or (base, size)
    return P.Infer(module_handle=handle, num_inputs=len(descs), flags=flags, input_dsp_addr=base,
                   input_size=size, result_dsp_addr=out_addr, result_size=out_size, descs=descs)


def tensor_desc(addr, shape=(2, 8), dtype="float32"):
    return P.TensorDesc.for_array(addr, shape, dtype)


def dmabuf_fd(front, size=4096) -> int:
    """A new dmabuf's fd for a BUF_ATTACH request (the front keeps the buffer open)."""
    b = memory.DmaBuf(size)
    front.bufs.append(b)
    return os.dup(b.fd)
