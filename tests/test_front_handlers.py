"""The front's request handlers, driven directly: no socket, no core process.

Each test names the rule it checks.  A handler takes (conn, request, fds) and
returns actions; dmabufs are real sealed memfds so attach maps real pages.
"""
from __future__ import annotations

import os
import struct

import pytest

from dspx import memory
from dspx.abi import protocol as P
from dspx.abi.protocol import Status as S
from dspx.device import jobs
from dspx.device.front.actions import Forget, NoRoom, Notify, Respond, Submit
from dspx.device.front.handlers import Handlers
from dspx.device.front.state import MAX_BUFS_PER_CONN, Conn, Cores, DeviceState, ModuleRec

MiB = 1 << 20
SIG = jobs.ModuleSig(False, [jobs.TensorSig("x", (2, 8), "float32")])


class Front:
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


# ---------------------------------------------------------------- basics and errors

def test_ping_answers_version_with_the_same_seq(front):
    (r,) = responses(front(P.Ping(seq=77)))
    assert (r.seq, r.status, r.version) == (77, 0, 0x030000)


def test_a_refusal_is_remembered_for_get_error(front):
    front(P.BufDetach(seq=9, dsp_addr=0x1234))
    (e,) = responses(front(P.GetError(seq=10)))
    assert (e.error_seq, e.error_status) == (9, S.ERR_ADDR) and b"0x1234" in e.payload


# ---------------------------------------------------------------- BUF_ATTACH / DETACH

def test_attach_needs_exactly_one_fd(front):
    assert status(front(P.BufAttach(size=4096))) == S.ERR_INVALID


def test_attach_refuses_unknown_flags(front):
    b = memory.DmaBuf(4096)
    front.bufs.append(b)
    assert status(front(P.BufAttach(size=4096, flags=2), [os.dup(b.fd)])) == S.ERR_INVALID


def test_kv_size_only_with_a_staging_buffer(front):
    b = memory.DmaBuf(4096)
    front.bufs.append(b)
    assert status(front(P.BufAttach(size=4096, kv_size=64), [os.dup(b.fd)])) == S.ERR_INVALID


@pytest.mark.parametrize("kv", [65, 8192])
def test_kv_region_must_be_64_aligned_and_fit(front, kv):
    b = memory.DmaBuf(4096)
    front.bufs.append(b)
    assert status(front(P.BufAttach(size=4096, flags=P.ATTACH_STAGING, kv_size=kv), [os.dup(b.fd)])) == S.ERR_INVALID


def test_first_attach_lands_at_the_window_base_and_one_staging_only(front):
    assert front.attach(MiB, staging=True, kv=4096) == memory.CARVEOUT_BASE
    b = memory.DmaBuf(4096)
    front.bufs.append(b)
    assert status(front(P.BufAttach(size=4096, flags=P.ATTACH_STAGING), [os.dup(b.fd)])) == S.ERR_INVALID


def test_attach_past_the_per_connection_limit_is_nomem(front):
    for _ in range(MAX_BUFS_PER_CONN):
        front.attach(4096)
    b = memory.DmaBuf(4096)
    front.bufs.append(b)
    assert status(front(P.BufAttach(size=4096), [os.dup(b.fd)])) == S.ERR_NOMEM


def test_detach_of_an_unknown_address_is_err_addr(front):
    assert status(front(P.BufDetach(dsp_addr=memory.CARVEOUT_BASE))) == S.ERR_ADDR


def test_detach_of_a_buffer_a_job_uses_is_busy(front):
    addr = front.attach(4096)
    front.conn.bufs[addr].busy = 1
    assert status(front(P.BufDetach(dsp_addr=addr))) == S.ERR_BUSY
    assert addr in front.conn.bufs


def test_detach_frees_the_window_and_tells_the_cores(front):
    addr = front.attach(4096)
    buf_id = front.conn.bufs[addr].buf_id
    actions = front(P.BufDetach(dsp_addr=addr))
    assert status(actions) == 0 and front.st.window.used == 0
    assert any(isinstance(a, Forget) and a.bufs == [buf_id] for a in actions)


# ---------------------------------------------------------------- SET_PRINTF_BUF

def test_printf_reserved_must_be_zero(front):
    addr = front.attach(4096)
    assert status(front(P.SetPrintfBuf(printf_dsp_addr=addr, printf_size=4096, reserved=1))) == S.ERR_INVALID


def test_printf_buffer_needs_header_and_room(front):
    addr = front.attach(4096)
    assert status(front(P.SetPrintfBuf(printf_dsp_addr=addr, printf_size=31))) == S.ERR_INVALID


def test_printf_buffer_outside_the_connection_is_err_addr(front):
    addr = front.attach(4096)
    assert status(front(P.SetPrintfBuf(printf_dsp_addr=addr + 2048, printf_size=4096))) == S.ERR_ADDR


def test_printf_ring_header_is_initialised(front):
    addr = front.attach(4096)
    assert status(front(P.SetPrintfBuf(printf_dsp_addr=addr + 1024, printf_size=2048))) == 0
    mm = front.conn.bufs[addr].region.mm
    # magic "PRNT", write index 0, size, reserved — written out by hand
    assert bytes(mm[1024:1040]) == b"PRNT" + bytes(4) + struct.pack("<I", 2048) + bytes(4)


# ---------------------------------------------------------------- DYN_LOAD / MODEL_LOAD

def test_dyn_load_needs_a_staging_buffer(front):
    assert status(front(P.DynLoad(elf_size=100))) == S.ERR_INVALID


@pytest.mark.parametrize("size", [0, MiB - 4096 + 1])
def test_dyn_load_size_must_fit_staging_above_kv(front, size):
    front.attach(MiB, staging=True, kv=4096)
    assert status(front(P.DynLoad(elf_size=size))) == S.ERR_SIZE


@pytest.mark.parametrize("field", ["reserved0", "reserved1"])
def test_dyn_load_reserved_fields_must_be_zero(front, field):
    front.attach(MiB, staging=True)
    assert status(front(P.DynLoad(elf_size=100, **{field: 1}))) == S.ERR_INVALID


@pytest.mark.parametrize("field", ["flags", "reserved0", "reserved1"])
def test_model_load_flags_and_reserved_must_be_zero(front, field):
    front.attach(MiB, staging=True)
    assert status(front(P.ModelLoad(weights_size=100, **{field: 1}))) == S.ERR_INVALID


def test_dyn_load_is_a_job_for_core_0_and_its_answer_carries_io_meta(front):
    front.attach(MiB, staging=True)
    job = submitted(front(P.DynLoad(seq=5, elf_size=1000)))
    assert isinstance(job.rec, jobs.LoadModule) and job.core == 0 and job.rec.size == 1000
    done = jobs.Done(job.rec.job, value=jobs.Loaded(4096, 1024, 0, (1, 1, 256, 128, 1), SIG))
    (r,) = responses(job.on_done(done))
    assert (r.seq, r.status, r.io_input_bytes, r.io_output_bytes, r.io_num_inputs, r.io_flags) == (5, 0, 256, 128, 1, 1)
    assert front.st.ddr.used == 5120 and r.module_handle in front.conn.modules


def test_a_module_that_does_not_fit_the_ddr_pool_is_unloaded_and_refused_with_the_numbers(front):
    front.attach(MiB, staging=True)
    job = submitted(front(P.DynLoad(elf_size=1000)))
    with pytest.raises(NoRoom) as e:
        job.on_done(jobs.Done(job.rec.job, value=jobs.Loaded(16 * MiB, 0, 0, None, None)))
    assert e.value.status == S.ERR_NOMEM and e.value.numbers["oom_requested"] == 16 * MiB
    assert e.value.numbers["oom_total"] == 8 * MiB and isinstance(e.value.undo, Notify)
    assert front.st.ddr.used == 0


def test_unload_of_an_unknown_model_is_err_handle(front):
    assert status(front(P.ModelUnload(model_id=42))) == S.ERR_HANDLE


# ---------------------------------------------------------------- INFER

def _desc(addr, shape=(2, 8), dtype="float32"):
    return P.TensorDesc.for_array(addr, shape, dtype)


def test_infer_of_an_unknown_module_is_err_handle(front):
    base = front.attach(4096)
    assert status(front(infer_req(base, 99, 4096, [_desc(base + 128)]))) == S.ERR_HANDLE


def test_infer_reserved_flag_bits_are_refused(front):
    base, h = front.attach(4096), front.module()
    assert status(front(infer_req(base, h, 4096, [_desc(base + 128)], flags=1 << 31))) == S.ERR_INVALID


def test_infer_descriptor_count_must_match_num_inputs(front):
    base, h = front.attach(4096), front.module()
    req = infer_req(base, h, 4096, [_desc(base + 128)])
    req.num_inputs = 2
    assert status(front(req)) == S.ERR_INVALID


def test_infer_input_outside_the_input_range_is_err_addr(front):
    base, h = front.attach(4096), front.module()
    assert status(front(infer_req(base, h, 1024, [_desc(base + 1024)]))) == S.ERR_ADDR


def test_infer_input_range_not_owned_is_err_addr(front):
    base, h = front.attach(4096), front.module()
    assert status(front(infer_req(base + 8192, h, 1024, [_desc(base + 8192)]))) == S.ERR_ADDR


def test_infer_kv_resident_needs_a_kv_region(front):
    base, h = front.attach(4096), front.module()
    assert status(front(infer_req(base, h, 4096, [_desc(base + 128)], flags=P.FLAG_KV_RESIDENT))) == S.ERR_INVALID


@pytest.mark.parametrize("shape,dtype", [((2, 4), "float32"), ((2, 8), "int32")])
def test_infer_against_the_signature_is_err_tensor(front, shape, dtype):
    base, h = front.attach(4096), front.module()
    assert status(front(infer_req(base, h, 4096, [_desc(base + 128, shape, dtype)]))) == S.ERR_TENSOR


def test_infer_of_a_separate_weights_module_without_a_model_is_err_weights(front):
    base, h = front.attach(4096), front.module(jobs.ModuleSig(True, SIG.inputs))
    assert status(front(infer_req(base, h, 4096, [_desc(base + 128)]))) == S.ERR_WEIGHTS


def test_infer_is_planned_once_and_replayed_until_the_buffers_change(front):
    base, h = front.attach(4096), front.module()
    req = infer_req(base, h, 4096, [_desc(base + 128)])
    data = req.encode()
    key = Handlers.plan_key(front.conn, P.MsgType.INFER, data)
    job = submitted(front.h.handle(front.conn, req, [], key))
    spec = job.plan.spec
    assert isinstance(job.rec, jobs.Call) and job.rec.seq == req.seq
    buf_id = front.conn.bufs[base].buf_id
    assert spec.inputs == [(buf_id, 128, (2, 8), "float32")] and spec.result == (buf_id, 0, 4096, base)
    # same bytes, another seq: the same plan
    again = P.decode(data)
    again.seq = 1234
    assert Handlers.plan_key(front.conn, P.MsgType.INFER, again.encode()) == key
    assert submitted(front.h.replay(front.conn, front.conn.plans[key], 1234)).plan is job.plan
    # attaching a buffer drops every plan of the connection, and the cores are told
    b = memory.DmaBuf(4096)
    front.bufs.append(b)
    actions = front(P.BufAttach(size=4096), [os.dup(b.fd)])
    assert not front.conn.plans and any(isinstance(a, Forget) and a.plans == [job.plan.plan_id] for a in actions)


def test_infer_large_keys_include_the_descriptor_table(front):
    base, h = front.attach(4096), front.module()
    mm = front.conn.bufs[base].region.mm
    mm[:80] = _desc(base + 128).encode()
    req = P.InferLarge(module_handle=h, num_inputs=1, descs_addr=base, descs_size=80, input_dsp_addr=base,
                       input_size=4096, result_dsp_addr=base, result_size=4096)
    k1 = Handlers.plan_key(front.conn, P.MsgType.INFER_LARGE, req.encode())
    mm[:80] = _desc(base + 192).encode()
    k2 = Handlers.plan_key(front.conn, P.MsgType.INFER_LARGE, req.encode())
    assert k1 != k2
    job = submitted(front.h.handle(front.conn, req, [], k2))
    assert job.plan.spec.inputs[0][1] == 192  # the table as read for the key, not re-read later


@pytest.mark.parametrize("change", [dict(reserved=1), dict(num_inputs=4097, descs_size=4097 * 80),
                                    dict(descs_size=79)])
def test_infer_large_framing_rules(front, change):
    base, h = front.attach(4096), front.module()
    req = P.InferLarge(module_handle=h, num_inputs=1, descs_addr=base, descs_size=80, input_dsp_addr=base,
                       input_size=4096, result_dsp_addr=base, result_size=4096)
    for k, v in change.items():
        setattr(req, k, v)
    assert status(front(req)) == S.ERR_INVALID


# ---------------------------------------------------------------- RPC and op libraries

def test_rpc_for_an_unregistered_command_is_err_op(front):
    base = front.attach(4096)
    assert status(front(P.Rpc(cmd=0x7777, input_dsp_addr=base, input_size=16, output_dsp_addr=base,
                              output_size=16))) == S.ERR_OP


@pytest.mark.parametrize("core,priority", [(2, 0), (-2, 0), (0, 256)])
def test_rpc_core_and_priority_ranges(front, core, priority):
    front.st.op_table[0x1402] = ("softmax", 0, 0)
    base = front.attach(4096)
    assert status(front(P.Rpc(cmd=0x1402, core=core, priority=priority, input_dsp_addr=base, input_size=16,
                              output_dsp_addr=base, output_size=16))) == S.ERR_INVALID


def test_rpc_job_carries_priority_core_and_the_whole_address_space(front):
    front.st.op_table[0x1402] = ("softmax", 0, 0)
    a, b = front.attach(4096), front.attach(8192)
    job = submitted(front(P.Rpc(cmd=0x1402, core=1, priority=7, timeout_ms=500, input_dsp_addr=a,
                                input_size=24, output_dsp_addr=b + 16, output_size=64)))
    spec = job.plan.spec
    assert (job.core, job.priority) == (1, 7) and job.deadline is not None
    assert spec.output == (front.conn.bufs[b].buf_id, 16, 64)
    assert sorted(r[1] for r in spec.regions) == [a, b]


@pytest.mark.parametrize("size,want", [(0, S.ERR_SIZE), ((128 << 10) + 1, S.ERR_SIZE)])
def test_op_library_size_limits(front, size, want):
    base = front.attach(256 << 10)
    assert status(front(P.OpsLoad(src_dsp_addr=base, src_size=size))) == want


def test_op_library_flags_must_be_zero(front):
    base = front.attach(4096)
    assert status(front(P.OpsLoad(src_dsp_addr=base, src_size=16, flags=1))) == S.ERR_INVALID


def test_a_new_device_reports_no_jobs_yet(front):
    (s,) = responses(front(P.GetStatus(seq=9)))
    assert (s.status, s.jobs_completed, s.jobs_failed) == (0, 0, 0)


def test_by_default_one_connection_may_attach_the_whole_window_and_no_more(front):
    b = memory.DmaBuf(64 * MiB + 4096, "test")
    front.bufs.append(b)
    from dspx.device.front.state import Reject

    fds = [os.dup(b.fd)]
    with pytest.raises(Reject) as e:  # handle() answers it with its status and keeps the text for GET_ERROR
        front.h.h_buf_attach(front.conn, P.BufAttach(size=b.size), fds)
    os.close(fds[0])
    assert (e.value.status, str(e.value)) == (
        S.ERR_NOMEM, f"connection quota: {64 * MiB + 4096} bytes requested, 0 of {64 * MiB} attached by this "
                     f"connection already (free {64 * MiB}; window total {64 * MiB})")


def _two_buffers_staging_and_printf(front):
    """An input buffer, a result buffer, staging with a 4 KiB KV region, a printf ring in the result buffer."""
    inb, outb = front.attach(4096), front.attach(8192)
    stg = front.attach(64 * 1024, staging=True, kv=4096)
    assert status(front(P.SetPrintfBuf(printf_dsp_addr=outb + 4096, printf_size=256))) == S.SUCCESS
    bufs = front.conn.bufs
    return inb, outb, stg, bufs[inb], bufs[outb], bufs[stg]


def test_an_infer_becomes_a_plan_of_exactly_its_buffers_and_fields(front):
    inb, outb, stg, ib, ob, sb = _two_buffers_staging_and_printf(front)
    kv_addr = stg + 60 * 1024
    sig = jobs.ModuleSig(False, [jobs.TensorSig("a", (2, 8), "float32"), jobs.TensorSig("b", (4,), "int32")])
    h = front.module(sig)
    req = P.Infer(seq=77, module_handle=h, num_inputs=2, flags=3 | P.FLAG_PROFILE | P.FLAG_KV_RESIDENT,
                  input_dsp_addr=inb, input_size=4096, result_dsp_addr=outb, result_size=4096,
                  descs=[_desc(inb + 128), _desc(kv_addr + 64, (4,), "int32")])
    job = submitted(front(req))  # no plan key: planned, not kept
    plan, spec = job.plan, job.plan.spec
    assert job.conn is front.conn and job.rec.seq == 77 and job.rec.plan == plan.plan_id and not front.conn.plans
    assert (spec.cid, spec.handle, spec.model_id) == (front.conn.cid, h, 0)
    assert spec.inputs == [(ib.buf_id, 128, (2, 8), "float32"), (sb.buf_id, 60 * 1024 + 64, (4,), "int32")]
    assert spec.result == (ob.buf_id, 0, 4096, outb) and spec.kv == (sb.buf_id, 60 * 1024, 4096, kv_addr)
    assert (spec.kv_resident, spec.repeat, spec.profile, spec.resp_type) == (True, 3, True, P.MsgType.INFER | 0x1000)
    assert spec.printf == (ob.buf_id, 4096, 256)
    assert plan.core == 0 and [id(b) for b in plan.used] == [id(ib), id(ob), id(sb)]  # each once, busy while it runs


def test_an_infer_without_profile_or_repeat_bits_plans_neither(front):
    base, h = front.attach(4096), front.module()
    spec = submitted(front(infer_req(base, h, 4096, [_desc(base + 128)], flags=0))).plan.spec
    assert (spec.repeat, spec.profile, spec.kv, spec.printf) == (0, False, None, None)


def test_an_rpc_becomes_a_plan_over_all_the_connections_buffers_and_is_kept_under_its_key(front):
    inb, outb, stg, ib, ob, sb = _two_buffers_staging_and_printf(front)
    front.st.op_table[0x1402] = ("softmax", 0, 0)
    req = P.Rpc(seq=5, cmd=0x1402, core=1, priority=9, timeout_ms=250, input_dsp_addr=inb + 64, input_size=32,
                output_dsp_addr=outb + 128, output_size=16)
    key = Handlers.plan_key(front.conn, P.MsgType.RPC, req.encode())
    job = submitted(front.h.handle(front.conn, req, [], key))
    plan, spec = job.plan, job.plan.spec
    assert job.conn is front.conn and job.rec.seq == 5 and front.conn.plans == {key: plan}
    assert (job.core, job.priority, plan.core, plan.priority, plan.timeout_ms) == (1, 9, 1, 9, 250)
    assert (spec.cid, spec.cmd) == (front.conn.cid, 0x1402)
    assert spec.input == (ib.buf_id, 64, 32) and spec.output == (ob.buf_id, 128, 16)
    assert spec.regions == [(ib.buf_id, inb, 4096), (ob.buf_id, outb, 8192), (sb.buf_id, stg, 64 * 1024)]
    assert spec.printf == (ob.buf_id, 4096, 256) and [id(b) for b in plan.used] == [id(ib), id(ob), id(sb)]
    assert submitted(front.h.replay(front.conn, plan, 6)).plan is plan


@pytest.mark.parametrize("fields,want,text", [
    (dict(core=2), S.ERR_INVALID, "core 2 does not exist (device has 2)"),
    (dict(priority=256), S.ERR_INVALID, "priority 256 outside 0..255"),
    (dict(input_dsp_addr=4090, input_size=16), S.ERR_ADDR,
     "task input 0x{:x}+16 is not inside a buffer of this connection"),
    (dict(output_dsp_addr=4095, output_size=2), S.ERR_ADDR,
     "task output 0x{:x}+2 is not inside a buffer of this connection"),
], ids=["core", "priority", "input", "output"])
def test_rpc_refusals_say_what(front, fields, want, text):
    front.st.op_table[0x1402] = ("softmax", 0, 0)
    base = front.attach(4096)
    req = dict(cmd=0x1402, input_dsp_addr=base, input_size=16, output_dsp_addr=base + 64, output_size=16)
    req.update({k: base + v if k.endswith("dsp_addr") else v for k, v in fields.items()})
    assert status(front(P.Rpc(**req))) == want
    (e,) = responses(front(P.GetError()))
    addr = req.get("input_dsp_addr") if "input_dsp_addr" in fields else req["output_dsp_addr"]
    assert (e.error_status, e.payload.decode()) == (want, text.format(addr))


def _infer_error_text(front, sig, descs_of) -> tuple[int, str]:
    base, h = front.attach(4096), front.module(sig)
    st = status(front(infer_req(base, h, 4096, descs_of(base))))
    (e,) = responses(front(P.GetError()))
    assert e.error_status == st
    return st, e.payload.decode()


@pytest.mark.parametrize("sig,descs_of,want,text", [
    (SIG, lambda b: [_desc(b + 128), _desc(b + 256)], S.ERR_TENSOR, "module takes 1 inputs, 2 given"),
    (SIG, lambda b: [_desc(b + 128, (2, 8), "int32")], S.ERR_TENSOR,
     "input 0 (x): module expects float32[2, 8], got int32[2, 8]"),
    (jobs.ModuleSig(False, [jobs.TensorSig("", (2, 8), "float32")]), lambda b: [_desc(b + 128, (8, 2))], S.ERR_TENSOR,
     "input 0 (0): module expects float32[2, 8], got float32[8, 2]"),  # an input with no name: its index
    (SIG, lambda b: [_desc(b + 4096)], S.ERR_ADDR, "input 0 data 0x{:x}+64 is outside the input range and the KV region"),
], ids=["count", "dtype", "unnamed", "outside"])
def test_infer_input_refusals_say_which_input_and_why(front, sig, descs_of, want, text):
    st, got = _infer_error_text(front, sig, descs_of)
    base = min(front.conn.bufs)
    assert (st, got) == (want, text.format(base + 4096))


def _attach_refusal(front, size, fd, **limits) -> tuple[int, str]:
    import dataclasses

    front.st.limits = dataclasses.replace(front.st.limits, **limits)
    st = status(front(P.BufAttach(size=size), [fd]))
    (e,) = responses(front(P.GetError()))
    assert e.error_status == st
    return st, e.payload.decode()


def test_attach_refusals_say_what(front):
    front.attach(4096)
    b = memory.DmaBuf(64 * MiB, "test")
    front.bufs.append(b)
    assert _attach_refusal(front, 4096, os.dup(b.fd), bufs_per_conn=1) == (
        S.ERR_NOMEM, "connection has 1 buffers attached (limit 1 per connection)")
    assert _attach_refusal(front, 64 * MiB, os.dup(b.fd), bufs_per_conn=128) == (  # 4096 attached already
        S.ERR_NOMEM, f"connection quota: {64 * MiB} bytes requested, 4096 of {64 * MiB} attached by this "
                     f"connection already (free {64 * MiB - 4096}; window total {64 * MiB})")
    assert _attach_refusal(front, 64 * MiB, os.dup(b.fd), conn_bytes=0) == (  # no quota: the window is full
        S.ERR_NOMEM, f"carveout window has no room for {64 * MiB} bytes (free {64 * MiB - 4096}, largest hole "
                     f"{64 * MiB - 4096}, total {64 * MiB})")
    assert _attach_refusal(front, 4096, os.open("/dev/null", os.O_RDWR)) == (
        S.ERR_INVALID, "cannot attach: attached fd is not a memory file")


def test_each_buffer_has_its_own_id_which_detach_forgets(front):
    a, b = front.attach(4096), front.attach(4096)
    ids = [front.conn.bufs[a].buf_id, front.conn.bufs[b].buf_id]
    assert all(type(i) is int for i in ids) and ids[0] != ids[1] and front.conn.bufs[a].region.buf_id == ids[0]
    forget = [x for x in front(P.BufDetach(dsp_addr=b)) if isinstance(x, Forget)]
    assert [f.bufs for f in forget] == [[ids[1]]]


def test_plans_have_ids_and_an_rpc_without_a_key_is_not_kept(front):
    base = front.attach(4096)
    front.st.op_table[0x1402] = ("softmax", 0, 0)
    rpc = submitted(front(P.Rpc(cmd=0x1402, input_dsp_addr=base, input_size=16, output_dsp_addr=base + 64,
                                output_size=16)))
    inf = submitted(front(infer_req(base, front.module(), 4096, [_desc(base + 128)])))
    assert type(rpc.plan.plan_id) is int and type(inf.plan.plan_id) is int and rpc.plan.plan_id != inf.plan.plan_id
    assert not front.conn.plans


def test_a_dyn_load_job_reads_the_staging_buffer_and_holds_it(front):
    stg = front.attach(4096, staging=True)
    sb = front.conn.bufs[stg]
    job = submitted(front(P.DynLoad(elf_size=100)))
    assert (job.rec.buf, job.rec.size, job.rec.ddr_free) == (sb.buf_id, 100, 8 * MiB)
    assert job.bufs == [sb]


def test_ops_load_reserved_fields_say_so(front):
    base = front.attach(4096)
    assert status(front(P.OpsLoad(src_dsp_addr=base, src_size=10, flags=1))) == S.ERR_INVALID
    (e,) = responses(front(P.GetError()))
    assert e.payload == b"flags and reserved must be zero"


def test_the_devices_job_timeout_gives_an_rpc_without_one_a_deadline():
    f = Front()
    f.h = Handlers(f.st, Cores(2, lambda i: 1), job_timeout_s=2.5)
    base = f.attach(4096)
    f.st.op_table[0x1402] = ("softmax", 0, 0)
    job = submitted(f(P.Rpc(cmd=0x1402, input_dsp_addr=base, input_size=16, output_dsp_addr=base + 64,
                            output_size=16)))
    assert f.h.job_timeout_s == 2.5 and job.deadline is not None
    for b in f.bufs:
        b.close()
