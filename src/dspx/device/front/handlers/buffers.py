"""BUF_ATTACH, BUF_DETACH and SET_PRINTF_BUF: a connection's buffers in the window."""
from __future__ import annotations

import os

from .... import memory
from ....abi import layout, protocol as P
from ....abi.protocol import Status as S
from ....memory import Region
from ..actions import Forget, Respond
from ..state import Buffer, Conn, DeviceState, Reject


class BufferHandlers:
    """The buffers (a part of ``Handlers``: ``invalidate`` is the calls')."""
    st: DeviceState

    def h_buf_attach(self, conn, req, fds):
        if len(fds) != 1:
            raise Reject(S.ERR_INVALID, f"BUF_ATTACH needs exactly one fd, got {len(fds)}")
        if req.flags & ~P.ATTACH_STAGING:
            raise Reject(S.ERR_INVALID, f"unknown attach flags 0x{req.flags:x}")
        lim = self.st.limits
        if len(conn.bufs) >= lim.bufs_per_conn:
            raise Reject(S.ERR_NOMEM, f"connection has {len(conn.bufs)} buffers attached (limit "
                                      f"{lim.bufs_per_conn} per connection)")
        if self.st.nbufs >= lim.bufs_total:
            raise Reject(S.ERR_NOMEM, f"device has {self.st.nbufs} buffers attached (limit {lim.bufs_total} for "
                                      f"all connections, from the fd limit {lim.nofile})")
        staging = bool(req.flags & P.ATTACH_STAGING)
        if staging and conn.staging is not None:
            raise Reject(S.ERR_INVALID, "this connection already has a staging buffer")
        if req.kv_size and not staging:
            raise Reject(S.ERR_INVALID, "kv_size must be zero unless attaching a staging buffer")
        kv = req.kv_size
        if kv % 64 or kv > req.size:
            raise Reject(S.ERR_INVALID, f"KV region of {kv} bytes does not fit a {req.size}-byte staging buffer")
        if lim.conn_bytes and conn.attached + req.size > lim.conn_bytes:
            raise Reject(S.ERR_NOMEM, f"connection quota: {req.size} bytes requested, {conn.attached} of "
                                      f"{lim.conn_bytes} attached by this connection already "
                                      f"(free {lim.conn_bytes - conn.attached}; window total {self.st.window.size})")
        peer = self.st.peer_use(conn.pid)[0]
        if lim.peer_bytes and peer + req.size > lim.peer_bytes and self.st.contended(conn.pid):
            raise Reject(S.ERR_NOMEM, f"process quota: {req.size} bytes requested, {peer} of {lim.peer_bytes} "
                                      f"attached by process {conn.pid}'s connections already, with other "
                                      f"processes connected (free {lim.peer_bytes - peer}; window total "
                                      f"{self.st.window.size})")
        fd = fds[0]
        try:
            view = memory.open_attached(fd, req.size)
        except (ValueError, OSError) as e:
            raise Reject(S.ERR_INVALID, f"cannot attach: {e}") from None
        try:
            addr = self.st.window.alloc(req.size)
        except memory.WindowFull as e:
            raise Reject(S.ERR_NOMEM, str(e)) from None
        fds.remove(fd)  # ours now
        region = Region(self.st.new_id(), addr, req.size, view)
        conn.space.add(region)
        conn.bufs[addr] = Buffer(region.buf_id, fd, region, staging, kv)
        conn.attached += req.size
        self.st.nbufs += 1
        return self.invalidate(conn) + [Respond(P.BufAttachResp(seq=req.seq, dsp_addr=addr, size=req.size))]

    def h_buf_detach(self, conn, req, fds):
        b = conn.bufs.get(req.dsp_addr)
        if b is None:
            raise Reject(S.ERR_ADDR, f"0x{req.dsp_addr:x} is not the address of a buffer of this connection")
        if b.busy:
            raise Reject(S.ERR_BUSY, f"buffer 0x{req.dsp_addr:x} is in use by {b.busy} job(s)")
        return self.detach(conn, req.dsp_addr) + [Respond(P.BufDetachResp(seq=req.seq))]

    def detach(self, conn: Conn, addr: int) -> list:
        actions = self.invalidate(conn)
        b = conn.bufs.pop(addr)
        conn.space.remove(addr)
        if conn.printf and b.region.addr <= conn.printf[0] < b.region.end():
            conn.printf = None
        os.close(b.fd)
        conn.attached -= b.region.size
        self.st.nbufs -= 1
        self.st.window.free(addr)
        return actions + [Forget(bufs=[b.buf_id])]

    def h_set_printf_buf(self, conn, req, fds):
        if req.reserved:
            raise Reject(S.ERR_INVALID, "reserved must be zero")
        if req.printf_size < layout.PRINTF_MIN_SIZE:
            raise Reject(S.ERR_INVALID, f"printf buffer of {req.printf_size} bytes is too small "
                                        f"(at least {layout.PRINTF_MIN_SIZE})")
        b, off = conn.resolve(req.printf_dsp_addr, req.printf_size, "printf buffer")
        conn.printf = (req.printf_dsp_addr, req.printf_size)
        header = bytearray(layout.PRINTF_HEADER)
        layout.ring_init(header, 0, req.printf_size)
        b.region.mm.write(off, bytes(header))
        return self.invalidate(conn) + [Respond(P.SetPrintfBufResp(seq=req.seq))]
