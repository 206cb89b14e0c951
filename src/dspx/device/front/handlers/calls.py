"""INFER, INFER_LARGE and RPC: validated once, then planned.

The first request with given bytes is validated in full and becomes a
``Plan``; the same bytes again (only the seq differs) reuse it, until
anything the plan depends on changes (the connection's buffers, printf ring,
modules or models: ``invalidate``).
"""
from __future__ import annotations

import time

from .... import memory
from ....abi import protocol as P
from ....abi.protocol import Status as S
from ... import jobs
from ..actions import Forget, FrontJob, Submit
from ..state import MAX_INPUTS, MAX_PLANS_PER_CONN, Conn, Cores, DeviceState, Plan, Reject

# index of descs_addr (then descs_size) in InferLarge.FULL's unpacked fields: after the header's 4
_LARGE_DESCS = 4 + P.InferLarge.FIELDS.index("descs_addr")


class CallHandlers:
    """The calls and their plans (a part of ``Handlers``)."""
    st: DeviceState
    cores: Cores
    job_timeout_s: float

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

    @staticmethod
    def _printf_target(conn: Conn, used: list):
        if conn.printf is None:
            return None
        b, off = conn.resolve(conn.printf[0], conn.printf[1], "printf buffer")
        used.append(b)
        return (b.buf_id, off, conn.printf[1])

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
