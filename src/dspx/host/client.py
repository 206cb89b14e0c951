"""The host client: one connection to a device, its dmabufs and its session.

``Client`` opens the channel (starting a private simulated device when none
is running, refusing a listener of another uid), checks the protocol
version, attaches the printf ring — and the staging buffer with its KV region
when first needed, sized to the need (or at open when a size is given) — and
then offers the calls of the protocol with typed errors.  Every
wait has a timeout; a device that dies raises ``DeviceLost``.  The rules
(seqs, error mapping, io capacity and layout) live in ``session``; this
module does the I/O they call for.
"""
from __future__ import annotations

import os
import socket as _socket
import sys
import threading
import time
import warnings
from dataclasses import dataclass

import numpy as np

from .. import memory, trace
from ..abi import layout, protocol as P
from ..errors import (BadReply, CapacityError, ClosedError, DeviceError, DeviceLost, DeviceTimeout, DspxError,
                      VersionMismatch)
from ..memory import DmaBuf
from ..abi.protocol import Status
from ..transport import PeerClosed, Timeout, TransportError, UntrustedPath, connect
from . import launcher, tracing
from .session import Session, failure

DEFAULT_TIMEOUT = 60.0


@dataclass
class LoadedModule:
    handle: int
    text_size: int
    data_size: int
    io_input_bytes: int
    io_output_bytes: int
    io_num_inputs: int
    io_num_outputs: int
    io_flags: int


@dataclass
class InferResult:
    cycles: int
    descs: list
    printf: str
    return_value: int = 0


def _output_descs(r, ob: DmaBuf) -> list:
    """The output descriptors of a successful INFER reply: inline, or the
    table it names in output_buf — only one wholly inside output_buf with
    room for num_outputs of them (a forged address would read elsewhere)."""
    n = r.num_outputs
    if not r.descs_size:
        if len(r.descs) < n:
            raise BadReply(f"{r.NAME} holds {len(r.descs)} descriptors for {n} outputs", num_outputs=n,
                           inline=len(r.descs))
        return r.descs
    need = n * P.TensorDesc.SIZE
    if r.descs_size < need or not ob.contains(r.descs_addr, r.descs_size):
        raise BadReply(f"{r.NAME}: output descriptor table 0x{r.descs_addr:x}+{r.descs_size} ({n} outputs need "
                       f"{need} bytes) is not inside output_buf 0x{ob.dsp_addr:x}+{ob.size}",
                       descs_addr=r.descs_addr, descs_size=r.descs_size, num_outputs=n,
                       output_addr=ob.dsp_addr, output_size=ob.size)
    return P.decode_descs(ob.mm, n, r.descs_addr - ob.dsp_addr)


def _clock_hz(profile: str) -> float:
    """The modeled clock of cost profile ``profile`` (its ``clock_hz``); 1 GHz
    when the host cannot load it (then a modeled cycle is drawn as 1 ns)."""
    try:
        from ..costmodel import profile as costmodel_profile
        p = costmodel_profile.load(profile).param("clock_hz")
        return float(getattr(p, "value", p))
    except Exception:  # no such profile here, or no cost model package: draw at the nominal clock
        return 1e9


class Client:
    """A session with the device.  Use as a context manager."""

    def __init__(self, socket: str | None = None, *, timeout: float = DEFAULT_TIMEOUT,
                 staging_size: int | None = None, kv_size: int | None = None,
                 printf_size: int = memory.PRINTF_SIZE, cores: int = 1, device_args=(), private: bool | None = None):
        """``staging_size`` / ``kv_size``: None (the default) allocates the
        staging buffer and its KV region on first need, sized to that need
        (up to STAGING_SIZE / KV_SIZE), so a client that only pings or runs
        tasks takes none of the shared window; a number reserves exactly that
        at open (the staging buffer then lands first, at the window base);
        0 means none at all.  Which device: launcher.resolve (docs/device.md)."""
        self.timeout = timeout
        self.session = Session()
        self._infer_layouts: dict = {}  # layouts of recent inferences (see _layout)
        self._lock = threading.RLock()
        self._sent_at: dict[int, int] = {}  # seq -> when it was sent, while tracing
        self._awaited: tracing.Awaited | None = None  # while tracing: the device spans to wait for at the end
        self.device: launcher.PrivateDevice | None = None
        path, self.device = launcher.resolve(socket, private=private, cores=cores, extra_args=device_args)
        self.socket_path = path
        try:
            self.ep = connect(path, timeout=min(timeout, 10.0))
        except UntrustedPath as e:  # another user's listener: not a device to talk to
            self._stop_device()
            raise DspxError(str(e)) from None
        except TransportError as e:
            self._stop_device()
            raise DeviceLost(str(e)) from None
        self.bufs: list[DmaBuf] = []
        self.staging: DmaBuf | None = None
        lazy = staging_size is None
        # Limits of what staging / KV may grow to; kv_size is the KV region this
        # client offers (allocated on first use when lazy).
        self.staging_limit = memory.STAGING_SIZE if lazy else staging_size
        self.kv_size = (memory.KV_SIZE if kv_size is None else kv_size) if self.staging_limit else 0
        self._kv_attached = 0
        self.printf_buf: DmaBuf | None = None
        self._printf_read = 0
        self.input_buf: DmaBuf | None = None
        self.output_buf: DmaBuf | None = None
        self._closed = False
        try:
            pong = self.request(P.Ping())
            if (pong.version >> 16) != (P.VERSION >> 16):
                raise VersionMismatch(P.VERSION, pong.version)
            self.device_version = pong.version
            if not lazy and staging_size:
                self._attach_staging(staging_size, self.kv_size)
            if printf_size:
                self.printf_buf = self.attach(DmaBuf(printf_size, "dspx-printf"))
                self.request(P.SetPrintfBuf(printf_dsp_addr=self.printf_buf.dsp_addr, printf_size=printf_size))
        except BaseException:
            self.close()
            raise

    def _attach_staging(self, room: int, kv: int) -> None:
        """Attach a staging buffer with ``room`` bytes for staged data and a
        ``kv``-byte KV region at its end, replacing the current one (its KV
        contents are carried over)."""
        old, old_kv = self.staging, self._kv_attached
        new = DmaBuf(room + kv, "dspx-staging")
        if old is not None:
            if old_kv:
                n = min(old_kv, kv)
                new.mm[new.size - kv:new.size - kv + n] = old.mm[old.size - old_kv:old.size - old_kv + n]
            self.request(P.BufDetach(dsp_addr=old.dsp_addr))
            self.bufs.remove(old)
        try:
            self.staging = self.attach(new, staging=True, kv_size=kv)
        except BaseException:
            new.close()
            self.staging = None
            if old is not None:  # put the old one back
                try:
                    self.staging = self.attach(old, staging=True, kv_size=old_kv)
                except DspxError:
                    old.close()
                    self._kv_attached = 0
                    self.session.io.kv_addr = 0
            raise
        if old is not None:
            old.close()
        self._kv_attached = kv
        self.session.io.kv_addr = new.dsp_addr + new.size - kv if kv else 0

    def _need_staging(self, room: int = 0, kv: bool = False) -> None:
        """Grow (or first attach) staging to hold ``room`` staged bytes, and the KV region if ``kv``."""
        if not self.staging_limit:
            raise DspxError("this client was opened without a staging buffer (staging_size=0)")
        have_room = self.staging.size - self._kv_attached if self.staging is not None else 0
        want_kv = self.kv_size if kv or self._kv_attached else 0
        if room <= have_room and want_kv <= self._kv_attached:
            return
        # Sized to the need, in whole MiB so that a few loads do not each re-attach.
        want_room = max(have_room, min(self.staging_limit, memory.page_align(max(room, 1), 1 << 20)))
        self._attach_staging(want_room, want_kv)

    # ---------------------------------------------------------------- plumbing
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def send(self, msg: P.Message, fds=()) -> int:
        """Send a request; return its seq (for ``wait``)."""
        if self._closed:
            raise ClosedError("this Client is closed")
        return self._send_bytes(self.session.start(msg), msg.seq, msg.NAME, fds)

    def _send_bytes(self, data, seq: int, name: str, fds=()) -> int:
        t0 = trace.clock() if trace.on else 0
        try:
            deadline = time.monotonic() + self.timeout
            while True:
                try:
                    if fds:
                        _socket.send_fds(self.ep.sock, [data], list(fds), _socket.MSG_DONTWAIT)
                    else:
                        self.ep.sock.send(data, _socket.MSG_DONTWAIT)
                    return seq
                except BlockingIOError:
                    # The device stops reading a connection that leaves its
                    # responses unread (flow control): take them now, keep them
                    # for their waiters, and try again — never block for ever.
                    self._drain_for_send(deadline, name)
                except (BrokenPipeError, ConnectionResetError) as e:
                    raise DeviceLost(f"device closed the connection: {e.strerror}") from None
        finally:
            if t0:
                trace.complete("send", t0, "host")
                self._awaited = tracing.sent(self._sent_at, self._awaited, seq, t0)

    def _drain_for_send(self, deadline: float, request: str) -> None:
        import select

        left = deadline - time.monotonic()
        if left <= 0 or not self._lock.acquire(timeout=left):
            raise DeviceTimeout(f"could not send {request} within {self.timeout:.3g} s: the device does not "
                                f"take requests")
        try:
            p = select.poll()
            p.register(self.ep.sock, select.POLLIN | select.POLLOUT)
            for _, ev in p.poll(max(1, int((deadline - time.monotonic()) * 1000))):
                if ev & (select.POLLIN | select.POLLHUP):
                    try:
                        self._receive(0)
                    except Timeout:
                        return
        finally:
            self._lock.release()

    def _receive(self, timeout: float) -> None:
        """Hand one datagram to the session (raises transport.Timeout)."""
        try:
            data, fds, _ = self.ep.recv(timeout=timeout)
        except PeerClosed:
            raise DeviceLost(self._lost_message()) from None
        for fd in fds:  # no response carries a dmabuf
            os.close(fd)
        self.session.receive(data)

    def wait(self, seq: int, timeout: float | None = None, request: str = "") -> P.Message:
        """The response to ``seq``; responses to other requests that arrive
        meanwhile are kept for their own waiters."""
        t0 = trace.clock() if trace.on else 0
        try:
            timeout = self.timeout if timeout is None else timeout
            deadline = time.monotonic() + timeout
            while True:
                left = deadline - time.monotonic()
                if not self._lock.acquire(timeout=max(0.0, left)):
                    raise DeviceTimeout(f"no response to {request or 'request'} within {timeout:.3g} s")
                try:
                    resp = self.session.take(seq)
                    if resp is not None:
                        if t0:
                            tracing.answered(self._awaited, self._sent_at, resp)
                        return resp
                    try:
                        self._receive(max(0.0, deadline - time.monotonic()))
                    except Timeout:
                        raise DeviceTimeout(f"no response to {request or 'request'} within {timeout:.3g} s") from None
                finally:
                    self._lock.release()
        finally:
            if t0:
                trace.complete("wait", t0, "host", {"seq": seq})

    def _lost_message(self) -> str:
        msg = "the device closed the connection (it exited or was killed)"
        if self.device is not None:
            tail = self.device.log_tail(800).strip()
            if tail:
                msg += f"; device log:\n{tail}"
        return msg

    def check(self, resp: P.Message, request: str) -> P.Message:
        """``resp`` if it succeeded, else raise its typed error with GET_ERROR's text."""
        if resp.status == Status.SUCCESS:
            return resp
        error = None
        if not isinstance(resp, P.GetErrorResp):
            try:
                error = self.wait(self.send(P.GetError()), 5.0, "GET_ERROR")
            except (DeviceTimeout, DeviceLost):
                pass
        raise failure(resp, request, error)

    def request(self, msg: P.Message, fds=(), timeout: float | None = None) -> P.Message:
        t0 = trace.clock() if trace.on else 0
        try:
            resp = self.wait(self.send(msg, fds), timeout, msg.NAME)
            return resp if resp.status == 0 else self.check(resp, msg.NAME)
        finally:
            if t0:
                trace.complete(f"request {msg.NAME}", t0, "host", top=True)

    # ---------------------------------------------------------------- basics
    def ping(self) -> dict:
        t0 = time.perf_counter_ns()
        r = self.request(P.Ping())
        return {"version": P.version_str(r.version), "uptime_ms": r.uptime_ms,
                "rtt_us": (time.perf_counter_ns() - t0) / 1000}

    def status(self) -> dict:
        r = self.request(P.GetStatus())
        return {"version": P.version_str(r.version), "uptime_ms": r.uptime_ms,
                "jobs_completed": r.jobs_completed, "jobs_failed": r.jobs_failed}

    def pools(self) -> dict:
        r = self.request(P.PoolStatus())
        return {f: getattr(r, f) for f in r.FIELDS}

    def last_cost(self) -> dict:
        """The timing model's record of this connection's last counted call
        (GET_COST): an estimate (``"estimate": True``) under ``"profile"``,
        for the call ``"seq"`` ran on ``"core"``, with its modeled
        ``cycles`` = overhead + compute + ddr_stall + dma_wait, the counts,
        and ``dma_bytes``/``dma_transfers`` per iDMA channel.  Raises
        ``UnknownOp`` (ERR_OP) when the device has no cost model or counted
        no call of this connection.  While tracing, the record is drawn as
        the modeled DSP timeline (host/tracing.py ``modeled_call``)."""
        rec = self.request(P.GetCost()).record()
        if trace.on:
            from .tracing import modeled_call
            t0 = self._sent_at.get(rec["seq"])
            hz = _clock_hz(rec["profile"])
            modeled_call(rec, t0 if t0 is not None else trace.clock() - round(rec["cycles"] * 1e9 / hz), hz)
        return rec

    # ---------------------------------------------------------------- buffers
    def attach(self, buf: DmaBuf, staging: bool = False, kv_size: int = 0) -> DmaBuf:
        r = self.request(P.BufAttach(size=buf.size, flags=P.ATTACH_STAGING if staging else 0,
                                     kv_size=kv_size), fds=[buf.fd])
        buf.dsp_addr = r.dsp_addr
        self.bufs.append(buf)
        return buf

    def alloc(self, nbytes: int, name: str = "dspx-buf") -> DmaBuf:
        """A new dmabuf, attached: mapped here and visible to the device."""
        buf = DmaBuf(nbytes, name)
        try:
            return self.attach(buf)
        except BaseException:
            buf.close()
            raise

    def detach(self, buf: DmaBuf) -> None:
        if buf in self.bufs:
            try:
                self.request(P.BufDetach(dsp_addr=buf.dsp_addr))
            finally:
                self.bufs.remove(buf)
                buf.dsp_addr = None
        buf.close()

    free = detach

    def read_printf(self) -> str:
        """Text the device printed since the last call."""
        if self._closed:
            raise ClosedError("this Client is closed")
        if self.printf_buf is None:
            return ""
        data, self._printf_read = layout.ring_read(self.printf_buf.mm, 0, self._printf_read)
        return data.decode("utf-8", errors="replace")

    def show_printf(self, nbytes: int, stream=None) -> str:
        text = self.read_printf() if nbytes else ""
        if text:
            (stream or sys.stderr).write(text)
        return text

    # ---------------------------------------------------------------- modules
    def _stage(self, data, what: str) -> int:
        if self._closed:
            raise ClosedError("this Client is closed")
        n = len(data)
        if self.staging_limit and n > self.staging_limit:
            raise CapacityError(n, self.staging_limit, what, "staging")
        self._need_staging(n)
        room = self.staging.size - self._kv_attached
        if n > room:
            raise CapacityError(n, room, what, "staging")
        self.staging.begin_cpu_access(memory.SYNC_WRITE)
        self.staging.mm[:n] = data
        self.staging.end_cpu_access(memory.SYNC_WRITE)
        return n

    def load_module(self, elf: bytes) -> LoadedModule:
        t0 = trace.clock() if trace.on else 0
        try:
            n = self._stage(elf, "module")
            r = self.request(P.DynLoad(elf_size=n))
            short = []
            for side, want in self.session.io.declare(r.io_input_bytes, r.io_output_bytes, r.io_num_inputs):
                try:
                    self._grow(side, want)
                except (DeviceLost, DeviceTimeout):
                    raise
                except (DeviceError, OSError, ValueError, OverflowError) as e:  # advisory: keep what could be had
                    short.append((side, want, getattr(e, "status_name", None) or str(e)))
            if short:
                warnings.warn(self.session.io.unmet(short), stacklevel=2)
            return LoadedModule(r.module_handle, r.text_size, r.data_size, r.io_input_bytes, r.io_output_bytes,
                                r.io_num_inputs, r.io_num_outputs, r.io_flags)
        finally:
            if t0:
                trace.complete("load module", t0, "host", top=True)

    def unload_module(self, handle: int) -> None:
        self.request(P.DynUnload(module_handle=handle))

    def load_weights(self, data: bytes) -> tuple[int, int]:
        t0 = trace.clock() if trace.on else 0
        try:
            n = self._stage(data, "weights")
            r = self.request(P.ModelLoad(weights_size=n))
            return r.model_id, r.num_constants
        finally:
            if t0:
                trace.complete("load weights", t0, "host", top=True)

    def unload_weights(self, model_id: int) -> None:
        self.request(P.ModelUnload(model_id=model_id))

    # ---------------------------------------------------------------- io capacity (docs/protocol.md, "Capacity")
    @property
    def io_locked(self) -> bool:
        return self.session.io.locked

    @property
    def input_capacity(self) -> int:
        return self.session.io.input

    @property
    def output_capacity(self) -> int:
        return self.session.io.output

    def _grow(self, side: str, want: int) -> None:
        """Replace ``side``'s buffer by a bigger one.  The old one leaves the
        device; its pages stay mapped while create_input arrays use them."""
        new = self.alloc(want, f"dspx-{side}")
        old = getattr(self, f"{side}_buf")
        setattr(self, f"{side}_buf", new)
        self.session.io.replaced(side, new.size, new.dsp_addr)
        if old is not None:
            self.detach(old)

    def reserve_io(self, input_bytes: int, output_bytes: int, num_inputs: int = 0) -> None:
        for side, want in self.session.io.reserve(input_bytes, output_bytes, num_inputs):
            self._grow(side, want)

    def create_input(self, shape, dtype):
        """An array living in input_buf: passing it to infer skips the copy."""
        if self._closed:
            raise ClosedError("this Client is closed")
        dt = np.dtype(dtype)
        off = self.session.io.create_input(int(np.prod(shape, dtype=np.int64)) * dt.itemsize)
        return self.input_buf.array(off, shape, dt)

    def in_input_buf(self, arr) -> int | None:
        """Offset of ``arr``'s data in input_buf, when it lives there."""
        b = self.input_buf
        if b is None or not arr.flags.c_contiguous:
            return None
        off = arr.__array_interface__["data"][0] - b.host_addr
        return off if 0 <= off and off + arr.nbytes <= b.size else None

    # ---------------------------------------------------------------- inference
    def infer(self, handle: int, inputs, model_id: int = 0, repeat: int = 0, kv_resident: bool = False,
              kv_inputs=(), timeout: float | None = None, profile: bool = False) -> InferResult:
        """Run the module on ``inputs`` (numpy arrays).  Arrays already in
        input_buf are passed in place; others are copied once.  ``kv_inputs``
        are ``(index, kv_offset, shape, dtype)`` for inputs that live in the
        KV region.  Returns descriptors of outputs in output_buf.  ``profile``:
        FLAG_PROFILE; the printf text (with the profile records) is returned,
        not shown (VirtualMachine.profile reads it)."""
        t0 = trace.clock() if trace.on else 0
        try:
            if self._closed:
                raise ClosedError("this Client is closed")
            if kv_inputs or kv_resident:
                self._need_staging(kv=True)
            dsts, table, request, name = self._layout(handle, inputs, model_id, repeat, kv_resident, kv_inputs,
                                                      profile)
            ib = self.input_buf
            ib.begin_cpu_access(memory.SYNC_WRITE)
            for dst, i in dsts:
                np.copyto(dst, inputs[i])
            if table:
                ib.mm[:len(table)] = table
            ib.end_cpu_access(memory.SYNC_WRITE)
            if trace.on:
                with trace.span("encode", "host"):
                    seq = self.session.start_bytes(request)
            else:
                seq = self.session.start_bytes(request)
            resp = self.wait(self._send_bytes(request, seq, name), timeout, name)
            r = resp if resp.status == 0 else self.check(resp, name)
            ob = self.output_buf
            ob.begin_cpu_access(memory.SYNC_READ)
            try:
                out_descs = _output_descs(r, ob)
            finally:
                ob.end_cpu_access(memory.SYNC_READ)
            self.session.io.completed(r)
            text = (self.read_printf() if r.printf_size else "") if profile else self.show_printf(r.printf_size)
            return InferResult(r.cycles, out_descs, text)
        finally:
            if t0:
                trace.complete("infer", t0, "host", {"module": handle, "kv_resident": bool(kv_resident),
                                                      "input_bytes": sum(getattr(x, "nbytes", 0) for x in inputs)},
                               top=True)

    def _layout(self, handle, inputs, model_id, repeat, kv_resident, kv_inputs, profile) -> tuple:
        """(copies as (input_buf view, input index), descriptor table, encoded
        request, its name) for one inference.  A call shaped like an earlier
        one (same module, same io buffers, same input placement) reuses its
        layout and encoded request."""
        io = self.session.io
        offsets = [self.in_input_buf(a) for a in inputs]
        key = (handle, model_id, repeat, kv_resident, profile, tuple(kv_inputs), io.state(),
               tuple(zip(offsets, [a.shape for a in inputs], [a.dtype for a in inputs])))
        cached = self._infer_layouts.get(key)
        if cached is None:
            args = (handle, inputs, offsets, model_id, repeat, kv_resident, kv_inputs, profile)
            if trace.on:
                with trace.span("encode (layout)", "host"):
                    lay = io.plan_infer(*args)
            else:
                lay = io.plan_infer(*args)
            ib = self.input_buf
            copied = [i for i, off in enumerate(offsets) if off is None]
            cached = ([(ib.array(off, a.shape, a.dtype), i) for (off, a), i in zip(lay.copies, copied)],
                      lay.table, bytearray(lay.message.encode()), lay.message.NAME)
            if len(self._infer_layouts) >= 16:
                self._infer_layouts.clear()
            self._infer_layouts[key] = cached
        return cached

    def output_view(self, desc: P.TensorDesc):
        """A numpy view of one output in output_buf (valid until the next inference)."""
        if self._closed:
            raise ClosedError("this Client is closed")
        ob = self.output_buf
        if not ob.contains(desc.data_addr, desc.data_size):
            raise DspxError(f"output descriptor 0x{desc.data_addr:x}+{desc.data_size} is outside output_buf")
        return ob.array(desc.data_addr - ob.dsp_addr, desc.shape, desc.dtype)

    def kv_view(self, offset: int, shape, dtype):
        """A numpy view into this connection's KV region."""
        if not self.kv_size:
            raise DspxError("this client has no KV region")
        self._need_staging(kv=True)
        return self.staging.array(self.staging.size - self._kv_attached + offset, shape, dtype)

    # ---------------------------------------------------------------- close
    def _stop_device(self) -> None:
        if self.device is not None:
            tracing.before_device_stops()
            self.device.stop()
            self.device = None

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        # Closing the channel makes the device free everything this
        # connection attached; our own mappings go with the DmaBufs.
        ep = getattr(self, "ep", None)
        if ep is not None:
            ep.close()
        for b in getattr(self, "bufs", []):
            b.close()
        self.bufs = []
        self._stop_device()
