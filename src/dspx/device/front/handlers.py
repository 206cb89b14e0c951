"""Request handlers of the front: ``(conn, request, fds) -> actions``.

A handler validates a request against the front's state and returns what
should happen — ``Respond``, ``Submit`` a job to a core, ``Notify`` cores,
``Forget`` what cores hold — instead of calling into the loop, so every rule
can be tested with no socket (``tests/test_front_handlers.py``).  A refusal
is ``Reject(status, message, **numbers)``.

INFER and RPC are planned: the first request with given bytes is validated
in full and becomes a ``Plan``; the same bytes again (only the seq differs)
reuse it, until anything the plan depends on changes (the connection's
buffers, printf ring, modules or models: ``invalidate``).
"""
from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from typing import Callable

from ... import memory
from ...abi import layout, protocol as P
from ...abi.protocol import Status as S
from ...memory import Region
from .. import jobs
from .state import (MAX_INPUTS, MAX_OPLIB_SOURCE, MAX_PLANS_PER_CONN, Buffer, Conn,
                    DeviceState, ModelRec, ModuleRec, Plan, Reject)

INFERENCE_CORE = 0  # compiled modules and their weights live on core 0
# index of descs_addr (then descs_size) in InferLarge.FULL's unpacked fields: after the header's 4
_LARGE_DESCS = 4 + P.InferLarge.FIELDS.index("descs_addr")


# ---------------------------------------------------------------- actions

@dataclass
class Respond:
    msg: P.Message


@dataclass
class FrontJob:
    """A job waiting for or running on a core, and what to do when it ends."""
    rec: jobs.Job
    conn: Conn | None
    req: P.Message | None
    core: int = P.CORE_ANY
    bufs: list = field(default_factory=list)
    # (Done) -> actions; raising Reject answers the request with that failure
    on_done: Callable | None = None
    priority: int = 0
    deadline: float | None = None  # monotonic time the job must have ended by
    plan: Plan | None = None
    req_type: int = 0  # a Call's request type (its req is not decoded on replay)
    queued_at: float = 0.0
    run_limit_s: float = 0.0  # seconds it may run once started (its deadline is set then)


@dataclass
class Submit:
    job: FrontJob


@dataclass
class Notify:
    """Send a record that needs no answer to one core (index) or every core (None)."""
    core: int | None
    rec: jobs.Job
    generation: int | None = None  # only if that core is still this incarnation


@dataclass
class Forget:
    """Cores drop these plans, client sockets and buffer mappings, if they hold them."""
    plans: list = field(default_factory=list)
    conns: list = field(default_factory=list)
    bufs: list = field(default_factory=list)


class Cores:
    """What handlers may ask about the cores."""

    def __init__(self, count: int, generation: Callable[[int], int | None], rss: Callable[[], int] = lambda: 0):
        self.count = count
        self.generation = generation  # the incarnation of a ready core, None if it is not ready
        self.rss = rss  # resident bytes of the front and its cores


def failure(conn: Conn | None, req: P.Message, e: Reject) -> list:
    """The failure response to ``req``, recorded for GET_ERROR."""
    if conn is None:
        return []
    conn.last_error = (req.seq, int(e.status), str(e))
    return [Respond(P.failure(req, e.status, **e.numbers))]


class Handlers:
    def __init__(self, state: DeviceState, cores: Cores, job_timeout_s: float = 0.0):
        self.st = state
        self.cores = cores
        self.job_timeout_s = job_timeout_s
        self._table = {t.value: getattr(self, "h_" + t.name.lower()) for t in P.MsgType}

    def handle(self, conn: Conn, req: P.Message, fds: list, key: bytes | None = None) -> list:
        """``key``: the request's plan key (INFER, INFER_LARGE, RPC), to keep
        the plan this request becomes under."""
        try:
            if key is not None:
                return self._table[req.TYPE](conn, req, fds, key=key)
            return self._table[req.TYPE](conn, req, fds)
        except Reject as e:
            return failure(conn, req, e)

    # ------------------------------------------------------------ plans
    @staticmethod
    def plan_key(conn: Conn, msg_type: int, data) -> bytes | None:
        """A request's bytes without its seq — and for INFER_LARGE the
        descriptor table it names, read now: equal keys, equal validation.
        None: not plannable as it stands (the full check will say why)."""
        key = bytes(data[:4]) + bytes(data[8:])
        if msg_type == P.MsgType.INFER_LARGE and len(data) == P.InferLarge.SIZE:
            m = P.InferLarge.FULL.unpack_from(data)
            addr, size = m[_LARGE_DESCS], m[_LARGE_DESCS + 1]
            try:
                b, off = conn.resolve(addr, size, "descriptor table")
            except Reject:
                return None
            key += bytes(b.region.mm[off:off + size])
        return key

    def invalidate(self, conn: Conn) -> list:
        """Drop the connection's plans: something they were validated against changed."""
        if not conn.plans:
            return []
        ids = [p.plan_id for p in conn.plans.values()]
        conn.plans.clear()
        return [Forget(plans=ids)]

    def replay(self, conn: Conn, plan: Plan, seq: int) -> list | None:
        """A request whose bytes match ``plan``: everything was checked already
        (None: the op table changed since; decode and check it afresh)."""
        spec = plan.spec
        if isinstance(spec, jobs.RpcSpec) and spec.cmd not in self.st.op_table:
            return None
        return [Submit(self._call_job(conn, plan, seq))]

    def _remember(self, conn: Conn, key: bytes, plan: Plan) -> list:
        actions = []
        if len(conn.plans) >= MAX_PLANS_PER_CONN:
            old = conn.plans.pop(next(iter(conn.plans)))
            actions.append(Forget(plans=[old.plan_id]))
        conn.plans[key] = plan
        return actions

    def _call_job(self, conn: Conn, plan: Plan, seq: int) -> FrontJob:
        timeout = plan.timeout_ms / 1000 if plan.timeout_ms else self.job_timeout_s
        req_type = P.MsgType.RPC if isinstance(plan.spec, jobs.RpcSpec) else plan.spec.resp_type & ~P.RESPONSE_BIT
        job = FrontJob(jobs.Call(plan=plan.plan_id, seq=seq), conn, None, plan.core, plan.used,
                       on_done=self._call_done(conn), priority=plan.priority, plan=plan, req_type=req_type)
        if timeout:
            job.deadline = time.monotonic() + timeout
        return job

    def _call_done(self, conn: Conn):
        def done(res: jobs.Done) -> list:
            # The core answered the client itself; keep the error for GET_ERROR.
            if res.status != S.SUCCESS:
                conn.last_error = (res.seq, int(res.status), res.error)
            return []
        return done

    # ------------------------------------------------------------ basics
    def h_ping(self, conn, req, fds):
        return [Respond(P.PingResp(seq=req.seq, version=P.VERSION, uptime_ms=self.st.uptime_ms()))]

    def h_get_status(self, conn, req, fds):
        st = self.st
        return [Respond(P.StatusResp(seq=req.seq, version=P.VERSION, uptime_ms=st.uptime_ms(),
                                     jobs_completed=st.jobs_completed & 0xFFFFFFFF,
                                     jobs_failed=st.jobs_failed & 0xFFFFFFFF))]

    def h_pool_status(self, conn, req, fds):
        st = self.st
        return [Respond(P.PoolStatusResp(
            seq=req.seq, ddr_total=st.ddr.size, ddr_used=st.ddr.used, ddr_peak=st.ddr.peak,
            carveout_total=st.window.size, carveout_used=st.window.used, l2_total=memory.L2_SIZE, l2_used=0,
            connections=len(st.conns), modules=sum(1 for m in st.modules.values() if m.kind == "module"),
            cores=self.cores.count, op_count=len(st.op_table), rss_bytes=self.cores.rss()))]

    def h_get_error(self, conn, req, fds):
        seq, status, text = conn.last_error
        return [Respond(P.GetErrorResp(seq=req.seq, error_seq=seq, error_status=status,
                                       payload=text.encode(errors="replace")[:P.GetErrorResp.MAX_TEXT]))]

    # ------------------------------------------------------------ buffers
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

    @staticmethod
    def _printf_target(conn: Conn, used: list):
        if conn.printf is None:
            return None
        b, off = conn.resolve(conn.printf[0], conn.printf[1], "printf buffer")
        used.append(b)
        return (b.buf_id, off, conn.printf[1])

    # ------------------------------------------------------------ modules and weights
    @staticmethod
    def _staged(conn: Conn, size: int, what: str) -> Buffer:
        st = conn.staging
        if st is None:
            raise Reject(S.ERR_INVALID, f"{what}: this connection has no staging buffer attached")
        room = st.region.size - st.kv_size
        if size == 0 or size > room:
            raise Reject(S.ERR_SIZE, f"{what}: {size} bytes staged but the staging area holds {room}")
        return st

    def _generation(self, core: int) -> int:
        gen = self.cores.generation(core)
        if gen is None:
            raise Reject(S.ERR_BUSY, f"core {core} is restarting; try again")
        return gen

    def h_dyn_load(self, conn, req, fds):
        if req.reserved0 or req.reserved1:
            raise Reject(S.ERR_INVALID, "reserved fields must be zero")
        if req.flags & ~P.DYN_LOAD_OP_LIBRARY:
            raise Reject(S.ERR_INVALID, f"unknown DYN_LOAD flags 0x{req.flags:x}")
        st = self._staged(conn, req.elf_size, "DYN_LOAD")
        if req.flags & P.DYN_LOAD_OP_LIBRARY:
            return self._load_ops(conn, req, bytes(st.region.mm[:req.elf_size]), "<staging>")
        handle, core, ddr = self.st.new_id(), INFERENCE_CORE, self.st.ddr

        def done(res: jobs.Done) -> list:
            if res.status != S.SUCCESS:
                n = res.numbers
                # the core knows requested/free; the pool's total is the front's
                total = n.get("oom_total") or (ddr.size if res.status == S.ERR_NOMEM else 0)
                raise Reject(res.status, res.error, oom_requested=n.get("oom_requested", 0),
                             oom_free=n.get("oom_free", 0), oom_total=total)
            v: jobs.Loaded = res.value
            need = v.text_size + v.data_size + v.workspace_bytes
            try:
                self.st.check_peer_ddr(conn, need, "module")
            except Reject as e:
                raise _NoRoom(Notify(core, jobs.UnloadModule(handle=handle)), e) from None
            if not ddr.take(need):
                raise _NoRoom(Notify(core, jobs.UnloadModule(handle=handle)),
                              Reject(S.ERR_NOMEM, f"module needs {need} bytes of the DDR pool; {ddr.free} of "
                                                  f"{ddr.size} free", oom_requested=need, oom_free=ddr.free,
                                     oom_total=ddr.size))
            self.st.modules[handle] = ModuleRec(handle, conn.cid, core, self._generation(core), "module", need,
                                                v.signature, self.st.keep_image(st, req.elf_size))
            conn.modules.add(handle)
            ni, no, ib, ob, fl = v.io_meta or (0, 0, 0, 0, 0)
            return self.invalidate(conn) + [Respond(P.DynLoadResp(
                seq=req.seq, module_handle=handle, text_size=v.text_size, data_size=v.data_size,
                io_input_bytes=ib, io_output_bytes=ob, io_num_inputs=ni, io_num_outputs=no, io_flags=fl))]

        rec = jobs.LoadModule(handle=handle, buf=st.buf_id, size=req.elf_size, ddr_free=ddr.free)
        return [Submit(FrontJob(rec, conn, req, core, [st], done))]

    def h_dyn_unload(self, conn, req, fds):
        rec = self.st.modules.get(req.module_handle)
        if rec is not None and rec.kind == "oplib":
            return self.unload_ops(rec) + [Respond(P.DynUnloadResp(seq=req.seq))]
        rec = self.st.module(conn, req.module_handle)
        self.st.drop_module(rec)  # the handle is dead from now on
        return self.invalidate(conn) + self._answer_after_core(
            conn, req, rec, jobs.UnloadModule(handle=rec.handle), P.DynUnloadResp(seq=req.seq))

    def _answer_after_core(self, conn, req, rec, core_rec: jobs.Job, resp: P.Message) -> list:
        """Answer an unload only once the core has freed what it held, so a
        POOL_STATUS that follows sees the memory back (queued behind the
        jobs already running there)."""
        if self.cores.generation(rec.core) != rec.generation:
            return [Respond(resp)]  # the core that held it is gone, and its memory with it
        # Not tied to the connection: if it closes first, the unload still runs.
        return [Submit(FrontJob(core_rec, None, req, rec.core, [], lambda res: [_To(conn, resp)]))]

    def unload_module(self, rec: ModuleRec) -> list:
        """Free a module of a connection that is going away."""
        self.st.drop_module(rec)
        return [Notify(rec.core, jobs.UnloadModule(handle=rec.handle), rec.generation)]

    def h_model_load(self, conn, req, fds):
        if req.reserved0 or req.reserved1 or req.flags:
            raise Reject(S.ERR_INVALID, "flags and reserved fields must be zero")
        st = self._staged(conn, req.weights_size, "MODEL_LOAD")
        model_id, core, ddr = self.st.new_id(), INFERENCE_CORE, self.st.ddr

        def done(res: jobs.Done) -> list:
            if res.status != S.SUCCESS:
                raise Reject(res.status, res.error)
            v: jobs.WeightsLoaded = res.value
            try:
                self.st.check_peer_ddr(conn, v.nbytes, "weights")
            except Reject as e:
                raise _NoRoom(Notify(core, jobs.UnloadWeights(model_id=model_id)), e) from None
            if not ddr.take(v.nbytes):
                raise _NoRoom(Notify(core, jobs.UnloadWeights(model_id=model_id)),
                              Reject(S.ERR_NOMEM, f"weights need {v.nbytes} bytes of the DDR pool; {ddr.free} "
                                                  f"of {ddr.size} free", oom_requested=v.nbytes, oom_free=ddr.free,
                                     oom_total=ddr.size))
            self.st.models[model_id] = ModelRec(model_id, conn.cid, core, self._generation(core), v.nbytes,
                                                v.num_constants, self.st.keep_image(st, req.weights_size))
            conn.models.add(model_id)
            return self.invalidate(conn) + [Respond(P.ModelLoadResp(seq=req.seq, model_id=model_id,
                                                                    num_constants=v.num_constants))]

        rec = jobs.LoadWeights(model_id=model_id, buf=st.buf_id, size=req.weights_size)
        return [Submit(FrontJob(rec, conn, req, core, [st], done))]

    def h_model_unload(self, conn, req, fds):
        rec = self.st.models.get(req.model_id)
        if rec is None or rec.cid != conn.cid:
            raise Reject(S.ERR_HANDLE, f"unknown model id {req.model_id}")
        self.st.drop_model(rec)
        return self.invalidate(conn) + self._answer_after_core(
            conn, req, rec, jobs.UnloadWeights(model_id=rec.model_id), P.ModelUnloadResp(seq=req.seq))

    # ------------------------------------------------------------ after a core restart
    RELOAD_PRIORITY = 1 << 10  # before any request (priorities are 0..255)

    def reload(self, rec) -> list:
        """Load a module or weights again on its restarted core, from the
        front's copy, under the same handle: its owner never sees the restart.
        Jobs for that core queued meanwhile run after it."""
        image = rec.image
        is_module = isinstance(rec, ModuleRec)
        rec.generation = None  # not on a core until the reload ends
        job = (jobs.LoadModule(handle=rec.handle, buf=image.buf_id, size=image.region.size, ddr_free=1 << 62)
               if is_module else jobs.LoadWeights(model_id=rec.model_id, buf=image.buf_id, size=image.region.size))

        def done(res: jobs.Done) -> list:
            table = self.st.modules if is_module else self.st.models
            key = rec.handle if is_module else rec.model_id
            forget = [Forget(bufs=[image.buf_id])]
            if table.get(key) is not rec:  # unloaded (or its connection closed) meanwhile
                undo = jobs.UnloadModule(handle=key) if is_module else jobs.UnloadWeights(model_id=key)
                return forget + ([Notify(rec.core, undo)] if res.status == S.SUCCESS else [])
            if res.status != S.SUCCESS:  # it cannot come back: from now on its handle says so
                (self.st.drop_module if is_module else self.st.drop_model)(rec)
                return forget
            rec.generation = self.cores.generation(rec.core)
            return forget

        return [Submit(FrontJob(job, None, None, rec.core, [image], done, priority=self.RELOAD_PRIORITY))]

    def unload_model(self, rec: ModelRec) -> list:
        self.st.drop_model(rec)
        return [Notify(rec.core, jobs.UnloadWeights(model_id=rec.model_id), rec.generation)]

    # ------------------------------------------------------------ inference
    def h_infer(self, conn, req, fds, key: bytes | None = None):
        if len(req.descs) != req.num_inputs:
            raise Reject(S.ERR_INVALID, f"num_inputs {req.num_inputs} but {len(req.descs)} descriptors inline")
        return self._infer(conn, req, req.descs, key)

    def h_infer_large(self, conn, req, fds, key: bytes | None = None):
        if req.reserved:
            raise Reject(S.ERR_INVALID, "reserved must be zero")
        if req.num_inputs > MAX_INPUTS:
            raise Reject(S.ERR_INVALID, f"num_inputs {req.num_inputs} is beyond any module (limit {MAX_INPUTS})")
        if req.descs_size != req.num_inputs * P.TensorDesc.SIZE:
            raise Reject(S.ERR_INVALID, f"descs_size {req.descs_size} != num_inputs {req.num_inputs} x "
                                        f"{P.TensorDesc.SIZE}")
        b, off = conn.resolve(req.descs_addr, req.descs_size, "descriptor table")
        # The table lives in shared memory the host may rewrite: the plan key
        # holds the copy that was read, and only that copy is checked and used.
        table = key[len(key) - req.descs_size:] if key is not None else b.region.mm[off:off + req.descs_size]
        return self._infer(conn, req, P.decode_descs(table, req.num_inputs), key)

    def _infer(self, conn: Conn, req, descs, key: bytes | None) -> list:
        rec = self.st.module(conn, req.module_handle)
        if req.flags & P.INFER_FLAGS_RESERVED:
            raise Reject(S.ERR_INVALID, f"INFER flags 0x{req.flags:08x} set reserved bits 18-31")
        kv_resident = bool(req.flags & P.FLAG_KV_RESIDENT)
        if req.model_id:
            m = self.st.models.get(req.model_id)
            if m is None or m.cid != conn.cid:
                raise Reject(S.ERR_HANDLE, f"unknown model id {req.model_id}")
        elif rec.signature is not None and rec.signature.separate_weights:
            raise Reject(S.ERR_WEIGHTS, "module was compiled with separate weights: load them with "
                                        "MODEL_LOAD and pass the model id")
        in_buf, in_off = conn.resolve(req.input_dsp_addr, req.input_size, "input range")
        res_buf, res_off = conn.resolve(req.result_dsp_addr, req.result_size, "result range")
        used = [in_buf, res_buf]
        kv = conn.kv_region()
        if kv_resident and kv is None:
            raise Reject(S.ERR_INVALID, "KV_RESIDENT needs a staging buffer with a KV region")
        sig_inputs = rec.signature.inputs if rec.signature is not None else None
        if sig_inputs is not None and len(sig_inputs) != len(descs):
            raise Reject(S.ERR_TENSOR, f"module takes {len(sig_inputs)} inputs, {len(descs)} given")
        inputs = []
        in_end = req.input_dsp_addr + req.input_size
        for i, d in enumerate(descs):
            why = d.check()
            if why:
                raise Reject(S.ERR_TENSOR, f"input {i}: {why}")
            if memory.in_range(d.data_addr, d.data_size, req.input_dsp_addr, in_end):
                b, off = in_buf, in_off + (d.data_addr - req.input_dsp_addr)
            elif kv is not None and memory.in_range(d.data_addr, d.data_size, kv[1], kv[1] + kv[2]):
                b, off = kv[0], d.data_addr - kv[0].region.addr
            else:
                raise Reject(S.ERR_ADDR, f"input {i} data 0x{d.data_addr:x}+{d.data_size} is outside the input "
                                         f"range and the KV region")
            if sig_inputs is not None:
                want = sig_inputs[i]
                if list(want.shape) != list(d.shape) or want.dtype != d.dtype:
                    raise Reject(S.ERR_TENSOR, f"input {i} ({want.name or i}): module expects "
                                               f"{want.dtype}{list(want.shape)}, got {d.dtype}{list(d.shape)}")
            used.append(b)
            inputs.append((b.buf_id, off, tuple(d.shape), d.dtype))
        printf = self._printf_target(conn, used)
        if kv:
            used.append(kv[0])
        spec = jobs.InferSpec(
            conn.cid, rec.handle, req.model_id, inputs, (res_buf.buf_id, res_off, req.result_size, req.result_dsp_addr),
            (kv[0].buf_id, kv[1] - kv[0].region.addr, kv[2], kv[1]) if kv else None, kv_resident,
            req.flags & P.REPEAT_MASK, printf, P.RESPONSE_BIT | req.TYPE, bool(req.flags & P.FLAG_PROFILE))
        plan = Plan(self.st.new_id(), rec.core, spec, list({id(b): b for b in used}.values()))
        actions = self._remember(conn, key, plan) if key is not None else []
        return actions + [Submit(self._call_job(conn, plan, req.seq))]

    # ------------------------------------------------------------ custom ops
    def h_ops_load(self, conn, req, fds):
        if req.flags or req.reserved:
            raise Reject(S.ERR_INVALID, "flags and reserved must be zero")
        if req.src_size == 0 or req.src_size > MAX_OPLIB_SOURCE:
            raise Reject(S.ERR_SIZE, f"op library of {req.src_size} bytes (1..{MAX_OPLIB_SOURCE})")
        b, off = conn.resolve(req.src_dsp_addr, req.src_size, "op library source")
        return self._load_ops(conn, req, bytes(b.region.mm[off:off + req.src_size]), "<oplib>")

    # An op library is loaded on core 0 first, then on every other core at
    # once (any core may run any command id), and installed only if every
    # core took it: one that fails anywhere — an exception, a crash or exit of
    # its core, a hang past OPS_LOAD_LIMIT_S (or --job-timeout, if shorter) —
    # is unloaded from the cores that did take it and refused, naming the
    # core.  Core 0 first: a library whose top level loops holds one core for
    # the limit, not all of them.
    OPS_LOAD_LIMIT_S = 20.0

    def _load_ops(self, conn, req, source: bytes, filename: str) -> list:
        if len(source) > MAX_OPLIB_SOURCE:
            raise Reject(S.ERR_SIZE, f"op library of {len(source)} bytes (1..{MAX_OPLIB_SOURCE})")
        handle = self.st.new_id()
        results: dict[int, jobs.Done] = {}
        limit = min(self.OPS_LOAD_LIMIT_S, self.job_timeout_s or self.OPS_LOAD_LIMIT_S)

        def finished() -> list:
            bad = [(i, r) for i, r in sorted(results.items()) if r.status != S.SUCCESS]
            if bad:
                i, r = bad[0]
                e = Reject(r.status, f"core {i}: {r.error}", error_line=r.numbers.get("error_line", 0))
                conn.last_error = (req.seq, int(e.status), str(e))
                undo = [Notify(j, jobs.UnloadOps(handle=handle)) for j, d in results.items()
                        if d.status == S.SUCCESS]
                return undo + [_To(conn, P.failure(req, e.status, **e.numbers))]
            ops = results[0].value.ops
            self.st.op_sources[handle] = (source, filename)
            self.st.modules[handle] = ModuleRec(handle, conn.cid, 0, 0, "oplib")
            for cmd, name, lat in ops:
                self.st.op_table[cmd] = (name, lat, handle)
            resp = (P.DynLoadResp(seq=req.seq, module_handle=handle) if isinstance(req, P.DynLoad)
                    else P.OpsLoadResp(seq=req.seq, lib_handle=handle, num_ops=len(ops)))
            return [_To(conn, resp)]

        def load(core: int) -> Submit:
            # The device's own job (no connection): a client that closes
            # meanwhile does not leave a library on some cores only.
            return Submit(FrontJob(jobs.LoadOps(handle=handle, source=source, filename=filename), None, None, core,
                                   [], on(core), run_limit_s=limit))

        def on(core: int):
            def done(res: jobs.Done) -> list:
                results[core] = res
                if core == 0 and res.status == S.SUCCESS and self.cores.count > 1:
                    return [load(i) for i in range(1, self.cores.count)]
                return finished() if core == 0 or len(results) == self.cores.count else []
            return done

        return [load(0)]

    def replay_ops(self, core: int) -> list:
        """A restarted core gets every op library again, before anything else
        runs there; one that fails there now is unloaded everywhere (no
        restart loop)."""
        out = []
        for handle, (src, fname) in sorted(self.st.op_sources.items()):
            def done(res: jobs.Done, handle=handle) -> list:
                rec = self.st.modules.get(handle)
                if res.status == S.SUCCESS or rec is None:
                    return []
                return self.unload_ops(rec)
            out.append(Submit(FrontJob(jobs.LoadOps(handle=handle, source=src, filename=fname), None, None, core,
                                       [], done, priority=self.RELOAD_PRIORITY + 1,
                                       run_limit_s=self.OPS_LOAD_LIMIT_S)))
        return out

    def unload_ops(self, rec: ModuleRec) -> list:
        for cmd in [c for c, v in self.st.op_table.items() if v[2] == rec.handle]:
            del self.st.op_table[cmd]
        self.st.op_sources.pop(rec.handle, None)
        self.st.modules.pop(rec.handle, None)
        return [Notify(None, jobs.UnloadOps(handle=rec.handle))]

    def h_ops_list(self, conn, req, fds):
        entries = sorted((cmd, lat, lib, 0, name) for cmd, (name, lat, lib) in self.st.op_table.items())
        page = entries[req.start:req.start + P.OpsListResp.MAX_ENTRIES]
        return [Respond(P.OpsListResp(seq=req.seq, total=len(entries), count=len(page),
                                      payload=P.OpsListResp.pack_entries(page)))]

    def h_rpc(self, conn, req, fds, key: bytes | None = None):
        if req.cmd not in self.st.op_table:
            raise Reject(S.ERR_OP, f"no operator registered for command 0x{req.cmd:x}")
        if not (req.core == P.CORE_ANY or 0 <= req.core < self.cores.count):
            raise Reject(S.ERR_INVALID, f"core {req.core} does not exist (device has {self.cores.count})")
        if req.priority > 255:
            raise Reject(S.ERR_INVALID, f"priority {req.priority} outside 0..255")
        in_buf, in_off = conn.resolve(req.input_dsp_addr, req.input_size, "task input")
        out_buf, out_off = conn.resolve(req.output_dsp_addr, req.output_size, "task output")
        # The handler may map any other buffer of this connection (mem_map):
        # the core gets the whole address space, once per plan.
        used = list(conn.bufs.values())
        regions = [(b.buf_id, b.region.addr, b.region.size) for b in used]
        spec = jobs.RpcSpec(conn.cid, req.cmd, (in_buf.buf_id, in_off, req.input_size),
                            (out_buf.buf_id, out_off, req.output_size), regions, self._printf_target(conn, []))
        plan = Plan(self.st.new_id(), req.core, spec, used, req.priority, req.timeout_ms)
        actions = self._remember(conn, key, plan) if key is not None else []
        return actions + [Submit(self._call_job(conn, plan, req.seq))]


@dataclass
class _To:
    """Respond to a connection other than the one whose job ended (an unload
    answered after its core freed the module)."""
    conn: Conn
    msg: P.Message


class _NoRoom(Reject):
    """A load that succeeded on the core but does not fit the pool: undo it there, then refuse."""

    def __init__(self, undo: Notify, reject: Reject):
        super().__init__(reject.status, str(reject), **reject.numbers)
        self.undo = undo
