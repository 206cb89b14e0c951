"""The front's request handlers (device/front/handlers.py), driven directly:
no socket, no core.  Every status they answer, from every place that answers
it (docs/reliability.md, "Rules and their tests").  A handler takes (conn,
request, fds) and returns actions; dmabufs are real sealed memfds so attach
maps real pages (tests/front_harness.py).  Each test is named after the rule
it checks; where a rule has an edge (a limit, a size), both sides of it are
tested, so a check that moves by one fails.
"""
from __future__ import annotations

import os
import struct

import pytest

from dspx import memory
from dspx.abi import layout, protocol as P
from dspx.abi.protocol import Status as S
from dspx.device import jobs
from dspx.device.front.actions import Forget, NoRoom, Notify, Respond, Submit
from dspx.device.front.handlers import Handlers
from dspx.device.front.state import MAX_BUFS_PER_CONN, MAX_INPUTS, MAX_OPLIB_SOURCE, Conn, Cores, ModelRec, ModuleRec, Reject
from front_harness import SIG, Front, dmabuf_fd, infer_req, responses, status, submitted, tensor_desc

MiB = 1 << 20


def _other_conn(front) -> Conn:
    c = Conn(front.st.new_id(), None, 0)
    front.st.conns[c.cid] = c
    return c


def _reject_of(fn, *a):
    with pytest.raises(Reject) as e:
        fn(*a)
    return e.value


# ---------------------------------------------------------------- BUF_ATTACH

def test_attach_with_two_fds_is_invalid(front):
    assert status(front(P.BufAttach(size=4096), [dmabuf_fd(front), dmabuf_fd(front)])) == S.ERR_INVALID


def test_attach_past_the_carveout_window_is_nomem_and_the_mapping_is_dropped(front):
    front.attach(60 * MiB)
    assert status(front(P.BufAttach(size=8 * MiB), [dmabuf_fd(front, 8 * MiB)])) == S.ERR_NOMEM
    assert front.st.window.used == 60 * MiB and len(front.conn.bufs) == 1
    (e,) = responses(front(P.GetError()))
    assert e.error_status == S.ERR_NOMEM


@pytest.mark.parametrize("kv,want", [(64, S.SUCCESS), (4096, S.SUCCESS), (0, S.SUCCESS), (32, S.ERR_INVALID),
                                     (4096 + 64, S.ERR_INVALID)])
def test_kv_size_is_a_multiple_of_64_at_most_the_staging_size(front, kv, want):
    assert status(front(P.BufAttach(size=4096, flags=P.ATTACH_STAGING, kv_size=kv), [dmabuf_fd(front)])) == want


def test_the_kv_region_is_the_last_kv_size_bytes_of_staging(front):
    base = front.attach(MiB, staging=True, kv=4096)
    buf, start, size = front.conn.kv_region()
    assert (start, size) == (base + MiB - 4096, 4096) and buf is front.conn.staging


def test_attach_flag_bits_past_bit_0_are_invalid(front):
    for bit in (1, 2, 31):
        assert status(front(P.BufAttach(size=4096, flags=1 << bit), [dmabuf_fd(front)])) == S.ERR_INVALID


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


# ---------------------------------------------------------------- BUF_DETACH

def test_detach_of_an_address_inside_a_buffer_is_err_addr(front):
    addr = front.attach(8192)
    assert status(front(P.BufDetach(dsp_addr=addr + 4096))) == S.ERR_ADDR
    assert addr in front.conn.bufs


def test_detach_of_another_connections_buffer_is_err_addr(front):
    addr = front.attach(4096)
    other = _other_conn(front)
    assert status(front.h.handle(other, P.BufDetach(dsp_addr=addr), [])) == S.ERR_ADDR
    assert addr in front.conn.bufs


def test_detach_of_the_printf_buffer_unbinds_printf(front):
    addr = front.attach(4096)
    front(P.SetPrintfBuf(printf_dsp_addr=addr, printf_size=4096))
    assert front.conn.printf == (addr, 4096)
    assert status(front(P.BufDetach(dsp_addr=addr))) == 0 and front.conn.printf is None


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

@pytest.mark.parametrize("size,want", [(layout.PRINTF_MIN_SIZE, S.SUCCESS), (layout.PRINTF_MIN_SIZE - 1, S.ERR_INVALID),
                                       (0, S.ERR_INVALID)])
def test_printf_buffer_holds_at_least_the_header_and_16_bytes(front, size, want):
    assert layout.PRINTF_MIN_SIZE == 32
    addr = front.attach(4096)
    assert status(front(P.SetPrintfBuf(printf_dsp_addr=addr, printf_size=size))) == want


def test_printf_buffer_in_another_connection_is_err_addr(front):
    addr = front.attach(4096)
    other = _other_conn(front)
    assert status(front.h.handle(other, P.SetPrintfBuf(printf_dsp_addr=addr, printf_size=64), [])) == S.ERR_ADDR


def test_printf_buffer_must_lie_in_one_buffer_up_to_its_last_byte(front):
    addr = front.attach(4096)
    assert status(front(P.SetPrintfBuf(printf_dsp_addr=addr + 4096 - 64, printf_size=64))) == S.SUCCESS
    assert status(front(P.SetPrintfBuf(printf_dsp_addr=addr + 4096 - 64, printf_size=65))) == S.ERR_ADDR


def test_printf_target_of_a_job_is_the_bound_ring(front):
    base, h = front.attach(4096), front.module()
    pb = front.attach(4096)
    front(P.SetPrintfBuf(printf_dsp_addr=pb + 1024, printf_size=2048))
    job = submitted(front(infer_req(base, h, 4096, [tensor_desc(base + 128)])))
    assert job.plan.spec.printf == (front.conn.bufs[pb].buf_id, 1024, 2048)
    assert front.conn.bufs[pb] in job.bufs  # held busy while the job runs


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


# ---------------------------------------------------------------- staging (DYN_LOAD / MODEL_LOAD)

def test_model_load_without_staging_is_invalid(front):
    assert status(front(P.ModelLoad(weights_size=100))) == S.ERR_INVALID


@pytest.mark.parametrize("size,want", [(0, S.ERR_SIZE), (MiB - 4096, None), (MiB - 4096 + 1, S.ERR_SIZE)])
def test_model_load_size_must_fit_staging_above_the_kv_region(front, size, want):
    front.attach(MiB, staging=True, kv=4096)
    actions = front(P.ModelLoad(weights_size=size))
    if want is None:
        assert isinstance(submitted(actions).rec, jobs.LoadWeights)
    else:
        assert status(actions) == want


def test_dyn_load_of_exactly_the_staging_room_is_a_job(front):
    front.attach(MiB, staging=True, kv=4096)
    assert submitted(front(P.DynLoad(elf_size=MiB - 4096))).rec.size == MiB - 4096


def test_staging_of_another_connection_does_not_count(front):
    front.attach(MiB, staging=True)
    other = _other_conn(front)
    assert status(front.h.handle(other, P.DynLoad(elf_size=100), [])) == S.ERR_INVALID


@pytest.mark.parametrize("flags", [2, 1 << 31])
def test_dyn_load_unknown_flag_bits_are_invalid(front, flags):
    front.attach(MiB, staging=True)
    assert status(front(P.DynLoad(elf_size=100, flags=flags))) == S.ERR_INVALID


def test_dyn_load_op_library_flag_loads_the_staged_source(front):
    st = front.attach(MiB, staging=True)
    front.conn.bufs[st].region.mm[:6] = b"x = 1\n"
    job = _per_core(front(P.DynLoad(elf_size=6, flags=P.DYN_LOAD_OP_LIBRARY)))[0]
    assert isinstance(job.rec, jobs.LoadOps) and job.rec.source == b"x = 1\n"


def test_dyn_load_needs_a_staging_buffer(front):
    assert status(front(P.DynLoad(elf_size=100))) == S.ERR_INVALID


@pytest.mark.parametrize("size", [0, MiB - 4096 + 1])
def test_dyn_load_size_must_fit_staging_above_kv(front, size):
    front.attach(MiB, staging=True, kv=4096)
    assert status(front(P.DynLoad(elf_size=size))) == S.ERR_SIZE


def test_dyn_load_is_a_job_for_core_0_and_its_answer_carries_io_meta(front):
    front.attach(MiB, staging=True)
    job = submitted(front(P.DynLoad(seq=5, elf_size=1000)))
    assert isinstance(job.rec, jobs.LoadModule) and job.core == 0 and job.rec.size == 1000
    done = jobs.Done(job.rec.job, value=jobs.Loaded(4096, 1024, 0, (1, 1, 256, 128, 1), SIG))
    (r,) = responses(job.on_done(done))
    assert (r.seq, r.status, r.io_input_bytes, r.io_output_bytes, r.io_num_inputs, r.io_flags) == (5, 0, 256, 128, 1, 1)
    assert front.st.ddr.used == 5120 and r.module_handle in front.conn.modules


def test_a_dyn_load_job_reads_the_staging_buffer_and_holds_it(front):
    stg = front.attach(4096, staging=True)
    sb = front.conn.bufs[stg]
    job = submitted(front(P.DynLoad(elf_size=100)))
    assert (job.rec.buf, job.rec.size, job.rec.ddr_free) == (sb.buf_id, 100, 8 * MiB)
    assert job.bufs == [sb]


def test_a_module_that_does_not_fit_the_ddr_pool_is_unloaded_and_refused_with_the_numbers(front):
    front.attach(MiB, staging=True)
    job = submitted(front(P.DynLoad(elf_size=1000)))
    with pytest.raises(NoRoom) as e:
        job.on_done(jobs.Done(job.rec.job, value=jobs.Loaded(16 * MiB, 0, 0, None, None)))
    assert e.value.status == S.ERR_NOMEM and e.value.numbers["oom_requested"] == 16 * MiB
    assert e.value.numbers["oom_total"] == 8 * MiB and isinstance(e.value.undo, Notify)
    assert front.st.ddr.used == 0


# ---------------------------------------------------------------- reserved fields

@pytest.mark.parametrize("field,value", [("reserved0", 1), ("reserved1", 1 << 31), ("flags", 1)])
def test_model_load_reserved_and_flags_are_invalid_whatever_the_bit(front, field, value):
    front.attach(MiB, staging=True)
    assert status(front(P.ModelLoad(weights_size=100, **{field: value}))) == S.ERR_INVALID


@pytest.mark.parametrize("field,value", [("reserved0", 1 << 31), ("reserved1", 2)])
def test_dyn_load_reserved_fields_are_invalid_whatever_the_bit(front, field, value):
    front.attach(MiB, staging=True)
    assert status(front(P.DynLoad(elf_size=100, **{field: value}))) == S.ERR_INVALID


@pytest.mark.parametrize("field", ["flags", "reserved"])
def test_ops_load_unknown_flags_and_reserved_are_invalid(front, field):
    base = front.attach(4096)  # flags bit 0 is device-wide; bit 1 is not defined
    assert status(front(P.OpsLoad(src_dsp_addr=base, src_size=16, **{field: 2}))) == S.ERR_INVALID


@pytest.mark.parametrize("field", ["reserved0", "reserved1"])
def test_dyn_load_reserved_fields_must_be_zero(front, field):
    front.attach(MiB, staging=True)
    assert status(front(P.DynLoad(elf_size=100, **{field: 1}))) == S.ERR_INVALID


@pytest.mark.parametrize("field", ["flags", "reserved0", "reserved1"])
def test_model_load_flags_and_reserved_must_be_zero(front, field):
    front.attach(MiB, staging=True)
    assert status(front(P.ModelLoad(weights_size=100, **{field: 1}))) == S.ERR_INVALID


def test_ops_load_reserved_fields_say_so(front):
    base = front.attach(4096)
    assert status(front(P.OpsLoad(src_dsp_addr=base, src_size=10, flags=3))) == S.ERR_INVALID
    (e,) = responses(front(P.GetError()))
    assert e.payload == (b"unknown OPS_LOAD flags 0x3 or reserved 0 (only bit 0, device-wide, is defined; "
                         b"reserved must be zero)")


# ---------------------------------------------------------------- load results from the core

def _load_job(front):
    front.attach(MiB, staging=True)
    return submitted(front(P.DynLoad(seq=3, elf_size=1000)))


def test_a_load_refused_by_the_core_keeps_its_status_and_numbers(front):
    job = _load_job(front)
    done = jobs.Done(job.rec.job, S.ERR_NOMEM, "no room", numbers={"oom_requested": 9000, "oom_free": 100})
    e = _reject_of(job.on_done, done)
    # the pool's total is the front's to say
    assert (e.status, e.numbers["oom_requested"], e.numbers["oom_free"], e.numbers["oom_total"]) == \
        (S.ERR_NOMEM, 9000, 100, 8 * MiB)
    assert not front.conn.modules and front.st.ddr.used == 0


@pytest.mark.parametrize("st", [S.ERR_LOAD, S.ERR_SYMBOL])
def test_a_load_refused_by_the_core_with_no_numbers_answers_zeros(front, st):
    job = _load_job(front)
    e = _reject_of(job.on_done, jobs.Done(job.rec.job, st, "bad elf"))
    assert e.status == st and e.numbers == dict(oom_requested=0, oom_free=0, oom_total=0)


def test_a_load_whose_core_restarted_meanwhile_is_busy(front):
    job = _load_job(front)
    front.h.cores.generation = lambda i: None  # core 0 is restarting
    e = _reject_of(job.on_done, jobs.Done(job.rec.job, value=jobs.Loaded(100, 0, 0, None, None)))
    assert e.status == S.ERR_BUSY and "restarting" in str(e)


def test_a_module_that_exactly_fills_the_ddr_pool_loads(front):
    job = _load_job(front)
    (r,) = responses(job.on_done(jobs.Done(job.rec.job, value=jobs.Loaded(8 * MiB - 100, 60, 40, None, None))))
    assert r.status == 0 and front.st.ddr.used == 8 * MiB


def test_weights_larger_than_the_ddr_pool_are_nomem_with_the_numbers_and_undone_on_the_core(front):
    front.attach(MiB, staging=True)
    front.st.ddr.take(MiB)
    job = submitted(front(P.ModelLoad(weights_size=1000)))
    with pytest.raises(NoRoom) as e:
        job.on_done(jobs.Done(job.rec.job, value=jobs.WeightsLoaded(3, 7 * MiB + 1)))
    n = e.value.numbers
    assert e.value.status == S.ERR_NOMEM
    assert (n["oom_requested"], n["oom_free"], n["oom_total"]) == (7 * MiB + 1, 7 * MiB, 8 * MiB)
    assert isinstance(e.value.undo, Notify) and isinstance(e.value.undo.rec, jobs.UnloadWeights)
    assert e.value.undo.core == 0 and f"weights need {7 * MiB + 1} bytes of the DDR pool" in str(e.value)
    assert e.value.undo.rec.model_id == job.rec.model_id
    assert not front.conn.models and front.st.ddr.used == MiB


def test_weights_that_fit_become_a_model_of_the_connection(front):
    front.attach(MiB, staging=True)
    job = submitted(front(P.ModelLoad(seq=4, weights_size=1000)))
    (r,) = responses(job.on_done(jobs.Done(job.rec.job, value=jobs.WeightsLoaded(3, 8 * MiB))))
    assert (r.status, r.num_constants, r.seq) == (0, 3, 4) and r.model_id in front.conn.models


def test_weights_refused_by_the_core_keep_the_status(front):
    front.attach(MiB, staging=True)
    job = submitted(front(P.ModelLoad(weights_size=1000)))
    e = _reject_of(job.on_done, jobs.Done(job.rec.job, S.ERR_WEIGHTS, "truncated"))
    assert (e.status, str(e)) == (S.ERR_WEIGHTS, "truncated")


def _per_core(actions) -> list:
    """An op library loads on core 0 first: the one job submitted now."""
    subs = [a.job for a in actions if isinstance(a, Submit)]
    assert [j.core for j in subs] == [0] and all(j.conn is None for j in subs)
    return subs


def _rest(actions) -> list:
    """The jobs for the other cores, submitted once core 0 took the library."""
    subs = [a.job for a in actions if isinstance(a, Submit)]
    assert [j.core for j in subs] == list(range(1, 1 + len(subs))) and subs and all(j.conn is None for j in subs)
    return subs


def _load_everywhere(actions, ops) -> tuple[list, list]:
    """Every core takes the library with ``ops``: (the jobs in order, the last one's actions)."""
    (j0,) = _per_core(actions)
    done = lambda j: j.on_done(jobs.Done(j.rec.job, value=jobs.OpsLoaded(ops)))  # noqa: E731
    rest = _rest(done(j0))
    for j in rest:
        last = done(j)
    return [j0, *rest], last


def _answer(actions):
    (r,) = [a.msg for a in actions if type(a).__name__ == "RespondTo"]
    return r


def test_an_op_library_refused_by_a_core_answers_its_error_line(front):
    base = front.attach(4096)
    (j0,) = _per_core(front(P.OpsLoad(src_dsp_addr=base, src_size=16)))
    (j1,) = _rest(j0.on_done(jobs.Done(j0.rec.job, value=jobs.OpsLoaded([(0x3001, "spin", 5)]))))
    actions = j1.on_done(jobs.Done(j1.rec.job, S.ERR_LOAD, "syntax", numbers={"error_line": 3}))
    r = _answer(actions)
    assert (r.status, r.error_line) == (S.ERR_LOAD, 3)
    assert [a.core for a in actions if isinstance(a, Notify)] == [0]  # unloaded where it had loaded
    assert 0x3001 not in front.st.op_table


def test_an_op_library_is_installed_once_every_core_took_it(front):
    base = front.attach(4096)
    _, actions = _load_everywhere(front(P.OpsLoad(seq=8, src_dsp_addr=base, src_size=16)), [(0x3001, "spin", 5)])
    r = _answer(actions)
    assert (r.status, r.num_ops, r.seq) == (0, 1, 8)
    assert front.st.op_table[0x3001] == ("spin", 5, r.lib_handle)


@pytest.mark.parametrize("size,want", [(1, None), (MAX_OPLIB_SOURCE, None), (MAX_OPLIB_SOURCE + 1, S.ERR_SIZE)])
def test_op_library_source_is_1_byte_to_128_kib(front, size, want):
    base = front.attach(256 << 10)
    actions = front(P.OpsLoad(src_dsp_addr=base, src_size=size))
    if want is None:
        assert len(_per_core(actions)[0].rec.source) == size
    else:
        assert status(actions) == want


def test_op_library_source_outside_the_connection_is_err_addr(front):
    base = front.attach(4096)
    assert status(front(P.OpsLoad(src_dsp_addr=base + 4000, src_size=200))) == S.ERR_ADDR


def test_op_library_staged_over_128_kib_is_err_size(front):
    front.attach(MiB, staging=True)
    assert status(front(P.DynLoad(elf_size=MAX_OPLIB_SOURCE + 1, flags=P.DYN_LOAD_OP_LIBRARY))) == S.ERR_SIZE


# ---------------------------------------------------------------- handles

def test_unload_of_another_connections_module_is_err_handle(front):
    h = front.module()
    other = _other_conn(front)
    assert status(front.h.handle(other, P.DynUnload(module_handle=h), [])) == S.ERR_HANDLE
    assert h in front.st.modules


def test_unload_of_an_unknown_module_is_err_handle(front):
    assert status(front(P.DynUnload(module_handle=12345))) == S.ERR_HANDLE


def test_unload_of_another_connections_model_is_err_handle(front):
    mid = front.st.new_id()
    front.st.models[mid] = ModelRec(mid, front.conn.cid, 0, 1, 100, 1)
    other = _other_conn(front)
    assert status(front.h.handle(other, P.ModelUnload(model_id=mid), [])) == S.ERR_HANDLE
    assert mid in front.st.models


def test_unload_waits_for_the_core_unless_the_core_is_a_new_incarnation(front):
    h = front.module()  # generation 1, as Front's cores report
    job = submitted(front(P.DynUnload(seq=6, module_handle=h)))
    assert isinstance(job.rec, jobs.UnloadModule) and h not in front.st.modules
    h2 = front.module()
    front.st.modules[h2].generation = 0  # loaded on a core that has restarted since
    (r,) = responses(front(P.DynUnload(seq=7, module_handle=h2)))
    assert (r.status, r.seq) == (0, 7)


def test_an_op_library_handle_unloads_with_dyn_unload(front):
    h = front.st.new_id()
    front.st.modules[h] = ModuleRec(h, front.conn.cid, 0, 0, "oplib")
    front.st.op_table[0x3001] = ("spin", 0, h)
    (r,) = responses(front(P.DynUnload(module_handle=h)))
    assert r.status == 0 and 0x3001 not in front.st.op_table


def test_unload_of_another_connections_op_library_is_err_handle(front):
    """docs/protocol.md: another connection's library handle is ERR_HANDLE;
    the library and its ops stay, and nothing goes to the cores."""
    h = front.st.new_id()
    front.st.modules[h] = ModuleRec(h, _other_conn(front).cid, 0, 0, "oplib")
    front.st.op_table[0x3001] = ("spin", 0, h)
    front.st.op_sources[h] = (b"src", "<oplib>")
    actions = front(P.DynUnload(module_handle=h))
    (r,) = responses(actions)
    assert r.status == S.ERR_HANDLE and not any(isinstance(a, Notify) for a in actions)
    assert front.st.op_table[0x3001] == ("spin", 0, h) and h in front.st.modules and h in front.st.op_sources


def _loaded_lib(front, flags: int, close_before_the_last_core: bool = False) -> tuple[int, list]:
    """OPS_LOAD of a 1-op library (cmd 0x3001) taken by every core: (its handle, the last actions)."""
    base = front.attach(4096)
    (j0,) = _per_core(front(P.OpsLoad(src_dsp_addr=base, src_size=16, flags=flags)))
    ok = lambda j: j.on_done(jobs.Done(j.rec.job, value=jobs.OpsLoaded([(0x3001, "spin", 0)])))  # noqa: E731
    rest = _rest(ok(j0))
    for j in rest[:-1]:
        ok(j)
    front.conn.closed = close_before_the_last_core
    return j0.rec.handle, ok(rest[-1])


def test_an_op_library_is_its_connections_and_a_device_wide_one_its_uids(front):
    own, _ = _loaded_lib(front, 0)
    shared, _ = _loaded_lib(front, P.OPS_LOAD_DEVICE_WIDE)
    assert front.conn.oplibs == {own}  # released with the connection; the device-wide one is not
    assert (front.st.modules[own].shared_uid, front.st.modules[shared].shared_uid) == (None, front.conn.uid)
    other = _other_conn(front)  # the same uid
    assert front.h.may_unload(other, front.st.modules[shared]) and not front.h.may_unload(other, front.st.modules[own])
    stranger = Conn(front.st.new_id(), None, front.conn.uid + 1)
    assert not front.h.may_unload(stranger, front.st.modules[shared])
    front.h.unload_ops(front.st.modules[own])
    assert front.conn.oplibs == set() and own not in front.st.modules


def test_unload_of_another_connections_device_wide_op_library_succeeds(front):
    h = front.st.new_id()
    front.st.modules[h] = ModuleRec(h, _other_conn(front).cid, 0, 0, "oplib", shared_uid=front.conn.uid)
    front.st.op_table[0x3001] = ("spin", 0, h)
    actions = front(P.DynUnload(module_handle=h))
    (r,) = responses(actions)
    assert r.status == 0 and 0x3001 not in front.st.op_table and h not in front.st.modules
    assert any(isinstance(a, Notify) and a.rec.handle == h for a in actions)


@pytest.mark.parametrize("flags, kept", [(0, False), (P.OPS_LOAD_DEVICE_WIDE, True)])
def test_an_op_library_whose_connection_closed_during_the_load(front, flags, kept):
    """Its own library would have no one to unload it: undone on every core
    that took it; a device-wide one is installed all the same."""
    handle, actions = _loaded_lib(front, flags, close_before_the_last_core=True)
    assert (handle in front.st.modules, 0x3001 in front.st.op_table) == (kept, kept)
    undo = sorted(a.core for a in actions if isinstance(a, Notify) and isinstance(a.rec, jobs.UnloadOps))
    assert undo == ([] if kept else list(range(front.h.cores.count)))


def test_infer_with_another_connections_module_is_err_handle(front):
    base, h = front.attach(4096), front.module()
    other = _other_conn(front)
    front.st.modules[h].cid = other.cid
    assert status(front(infer_req(base, h, 4096, [tensor_desc(base + 128)]))) == S.ERR_HANDLE


def test_infer_with_an_op_library_handle_is_err_handle(front):
    base = front.attach(4096)
    h = front.st.new_id()
    front.st.modules[h] = ModuleRec(h, front.conn.cid, 0, 0, "oplib")
    assert status(front(infer_req(base, h, 4096, [tensor_desc(base + 128)]))) == S.ERR_HANDLE


@pytest.mark.parametrize("owner", ["unknown", "other"])
def test_infer_with_a_model_id_not_of_this_connection_is_err_handle(front, owner):
    base, h = front.attach(4096), front.module()
    mid = 4242
    if owner == "other":
        front.st.models[mid] = ModelRec(mid, _other_conn(front).cid, 0, 1, 100, 1)
    req = infer_req(base, h, 4096, [tensor_desc(base + 128)])
    req.model_id = mid
    assert status(front(req)) == S.ERR_HANDLE


def test_infer_with_its_own_model_id_is_a_job(front):
    base, h = front.attach(4096), front.module(jobs.ModuleSig(True, SIG.inputs))
    mid = front.st.new_id()
    front.st.models[mid] = ModelRec(mid, front.conn.cid, 0, 1, 100, 1)
    req = infer_req(base, h, 4096, [tensor_desc(base + 128)])
    req.model_id = mid
    assert submitted(front(req)).plan.spec.model_id == mid


def test_unload_of_an_unknown_model_is_err_handle(front):
    assert status(front(P.ModelUnload(model_id=42))) == S.ERR_HANDLE


# ---------------------------------------------------------------- INFER / INFER_LARGE framing

@pytest.mark.parametrize("inline", [0, 2])
def test_inline_descriptor_count_must_equal_num_inputs(front, inline):
    base, h = front.attach(4096), front.module()
    req = infer_req(base, h, 4096, [tensor_desc(base + 128)] * inline)
    req.num_inputs = 1
    assert status(front(req)) == S.ERR_INVALID


LOWEST_RESERVED = (P.INFER_FLAGS_RESERVED & -P.INFER_FLAGS_RESERVED).bit_length() - 1


@pytest.mark.parametrize("bit", [LOWEST_RESERVED, 24, 31])
def test_infer_large_reserved_flag_bits_are_invalid(front, bit):
    base, h = front.attach(4096), front.module()
    front.conn.bufs[base].region.mm[:80] = tensor_desc(base + 128).encode()
    req = P.InferLarge(module_handle=h, num_inputs=1, flags=1 << bit, descs_addr=base, descs_size=80,
                       input_dsp_addr=base, input_size=4096, result_dsp_addr=base, result_size=4096)
    assert status(front(req)) == S.ERR_INVALID


def test_infer_large_without_reserved_flags_is_a_job(front):
    base, h = front.attach(4096), front.module()
    front.conn.bufs[base].region.mm[:80] = tensor_desc(base + 128).encode()
    req = P.InferLarge(module_handle=h, num_inputs=1, flags=P.FLAG_KV_RESIDENT - 1, descs_addr=base, descs_size=80,
                       input_dsp_addr=base, input_size=4096, result_dsp_addr=base, result_size=4096)
    assert submitted(front(req)).plan.spec.repeat == 0xFFFF


def _large(front, n: int, buf_size: int):
    base, h = front.attach(buf_size), front.module(signature=None)
    descs = [tensor_desc(base + buf_size - 64, (16,), "float32")] * n
    front.conn.bufs[base].region.mm[:80 * n] = P.encode_descs(descs)
    return P.InferLarge(module_handle=h, num_inputs=n, descs_addr=base, descs_size=80 * n, input_dsp_addr=base,
                        input_size=buf_size, result_dsp_addr=base, result_size=buf_size)


def test_infer_large_takes_up_to_4096_inputs(front):
    assert MAX_INPUTS == 4096
    job = submitted(front(_large(front, 4096, 4096 * 80 + 4096)))
    assert len(job.plan.spec.inputs) == 4096


def test_infer_large_with_4097_inputs_is_invalid(front):
    assert status(front(_large(front, 4097, 4097 * 80 + 4096))) == S.ERR_INVALID


def test_infer_large_descriptor_table_outside_the_connection_is_err_addr(front):
    base, h = front.attach(4096), front.module()
    req = P.InferLarge(module_handle=h, num_inputs=1, descs_addr=base + 4096 - 40, descs_size=80,
                       input_dsp_addr=base, input_size=4096, result_dsp_addr=base, result_size=4096)
    assert status(front(req)) == S.ERR_ADDR
    assert Handlers.plan_key(front.conn, P.MsgType.INFER_LARGE, req.encode()) is None  # not plannable


@pytest.mark.parametrize("change", [dict(reserved=1), dict(num_inputs=4097, descs_size=4097 * 80),
                                    dict(descs_size=79)])
def test_infer_large_framing_rules(front, change):
    base, h = front.attach(4096), front.module()
    req = P.InferLarge(module_handle=h, num_inputs=1, descs_addr=base, descs_size=80, input_dsp_addr=base,
                       input_size=4096, result_dsp_addr=base, result_size=4096)
    for k, v in change.items():
        setattr(req, k, v)
    assert status(front(req)) == S.ERR_INVALID


def test_infer_large_keys_include_the_descriptor_table(front):
    base, h = front.attach(4096), front.module()
    mm = front.conn.bufs[base].region.mm
    mm[:80] = tensor_desc(base + 128).encode()
    req = P.InferLarge(module_handle=h, num_inputs=1, descs_addr=base, descs_size=80, input_dsp_addr=base,
                       input_size=4096, result_dsp_addr=base, result_size=4096)
    k1 = Handlers.plan_key(front.conn, P.MsgType.INFER_LARGE, req.encode())
    mm[:80] = tensor_desc(base + 192).encode()
    k2 = Handlers.plan_key(front.conn, P.MsgType.INFER_LARGE, req.encode())
    assert k1 != k2
    job = submitted(front.h.handle(front.conn, req, [], k2))
    assert job.plan.spec.inputs[0][1] == 192  # the table as read for the key, not re-read later


# ---------------------------------------------------------------- INFER addresses and descriptors

def test_infer_result_range_not_owned_is_err_addr(front):
    base, h = front.attach(4096), front.module()
    assert status(front(infer_req(base, h, 4096, [tensor_desc(base + 128)], out=(base + 2048, 4096)))) == S.ERR_ADDR


def test_infer_input_range_that_wraps_64_bits_is_err_addr(front):
    base, h = front.attach(4096), front.module()
    req = infer_req(base, h, 4096, [tensor_desc(base + 128)])
    req.input_size = (1 << 64) - 1
    assert status(front(req)) == S.ERR_ADDR


def test_infer_input_may_end_on_the_input_ranges_last_byte(front):
    base, h = front.attach(4096), front.module()
    assert submitted(front(infer_req(base, h, 1024, [tensor_desc(base + 1024 - 64)])))
    assert status(front(infer_req(base, h, 1024, [tensor_desc(base + 1024 - 63)]))) == S.ERR_ADDR


def test_infer_input_in_the_kv_region_is_accepted(front):
    st = front.attach(MiB, staging=True, kv=4096)
    base, h = front.attach(4096), front.module()
    kv_addr = st + MiB - 4096
    job = submitted(front(infer_req(base, h, 4096, [tensor_desc(kv_addr + 64)])))
    assert job.plan.spec.inputs[0][:2] == (front.conn.bufs[st].buf_id, MiB - 4096 + 64)
    assert job.plan.spec.kv == (front.conn.bufs[st].buf_id, MiB - 4096, 4096, kv_addr)


def test_infer_input_in_staging_below_the_kv_region_is_err_addr(front):
    st = front.attach(MiB, staging=True, kv=4096)
    base, h = front.attach(4096), front.module()
    assert status(front(infer_req(base, h, 4096, [tensor_desc(st + MiB - 4096 - 32)]))) == S.ERR_ADDR


def test_infer_input_in_another_connections_kv_region_is_err_addr(front):
    other = _other_conn(front)
    b = memory.DmaBuf(MiB)
    front.bufs.append(b)
    (r,) = responses(front.h.handle(other, P.BufAttach(size=MiB, flags=P.ATTACH_STAGING, kv_size=4096),
                                    [os.dup(b.fd)]))
    kv = r.dsp_addr + MiB - 4096
    base, h = front.attach(4096), front.module()
    assert status(front(infer_req(base, h, 4096, [tensor_desc(kv)]))) == S.ERR_ADDR


def test_kv_resident_with_a_kv_region_is_a_job_that_says_so(front):
    front.attach(MiB, staging=True, kv=4096)
    base, h = front.attach(4096), front.module()
    spec = submitted(front(infer_req(base, h, 4096, [tensor_desc(base + 128)], flags=P.FLAG_KV_RESIDENT))).plan.spec
    assert spec.kv_resident and spec.kv is not None


@pytest.mark.parametrize("why,desc", [
    ("ndim", P.TensorDesc(0, 64, 7, 2, 32, (1,) * 6)),
    ("ndim", P.TensorDesc(0, 64, -1, 2, 32, ())),
    ("dtype", P.TensorDesc(0, 64, 1, 2, 8, (64,))),
    ("dtype", P.TensorDesc(0, 64, 1, 3, 32, (16,))),
    ("negative", P.TensorDesc(0, 64, 2, 2, 32, (-4, -4))),
    ("data_size", P.TensorDesc(0, 60, 2, 2, 32, (2, 8))),
    ("reserved", P.TensorDesc(0, 64, 1, 2, 32, (16,), reserved=1)),
])
def test_a_malformed_descriptor_is_err_tensor_naming_what(front, why, desc):
    base, h = front.attach(4096), front.module(signature=None)
    d = P.TensorDesc(base + 128, desc.data_size, desc.ndim, desc.dtype_code, desc.dtype_bits, desc.shape,
                     desc.reserved)
    assert status(front(infer_req(base, h, 4096, [d]))) == S.ERR_TENSOR
    (e,) = responses(front(P.GetError()))
    assert why.encode() in e.payload


def test_input_count_against_the_signature_is_err_tensor(front):
    base, h = front.attach(4096), front.module()
    assert status(front(infer_req(base, h, 4096, [tensor_desc(base + 128), tensor_desc(base + 256)]))) == S.ERR_TENSOR


def test_a_module_without_a_signature_takes_any_well_formed_inputs(front):
    base, h = front.attach(4096), front.module(signature=None)
    job = submitted(front(infer_req(base, h, 4096, [tensor_desc(base + 128, (3,), "int8"), tensor_desc(base + 192)])))
    assert [i[2:] for i in job.plan.spec.inputs] == [((3,), "int8"), ((2, 8), "float32")]


def test_infer_of_an_unknown_module_is_err_handle(front):
    base = front.attach(4096)
    assert status(front(infer_req(base, 99, 4096, [tensor_desc(base + 128)]))) == S.ERR_HANDLE


def test_infer_reserved_flag_bits_are_refused(front):
    base, h = front.attach(4096), front.module()
    assert status(front(infer_req(base, h, 4096, [tensor_desc(base + 128)], flags=1 << 31))) == S.ERR_INVALID


def test_infer_descriptor_count_must_match_num_inputs(front):
    base, h = front.attach(4096), front.module()
    req = infer_req(base, h, 4096, [tensor_desc(base + 128)])
    req.num_inputs = 2
    assert status(front(req)) == S.ERR_INVALID


def test_infer_input_outside_the_input_range_is_err_addr(front):
    base, h = front.attach(4096), front.module()
    assert status(front(infer_req(base, h, 1024, [tensor_desc(base + 1024)]))) == S.ERR_ADDR


def test_infer_input_range_not_owned_is_err_addr(front):
    base, h = front.attach(4096), front.module()
    assert status(front(infer_req(base + 8192, h, 1024, [tensor_desc(base + 8192)]))) == S.ERR_ADDR


def test_infer_kv_resident_needs_a_kv_region(front):
    base, h = front.attach(4096), front.module()
    assert status(front(infer_req(base, h, 4096, [tensor_desc(base + 128)], flags=P.FLAG_KV_RESIDENT))) == S.ERR_INVALID


@pytest.mark.parametrize("shape,dtype", [((2, 4), "float32"), ((2, 8), "int32")])
def test_infer_against_the_signature_is_err_tensor(front, shape, dtype):
    base, h = front.attach(4096), front.module()
    assert status(front(infer_req(base, h, 4096, [tensor_desc(base + 128, shape, dtype)]))) == S.ERR_TENSOR


def test_infer_of_a_separate_weights_module_without_a_model_is_err_weights(front):
    base, h = front.attach(4096), front.module(jobs.ModuleSig(True, SIG.inputs))
    assert status(front(infer_req(base, h, 4096, [tensor_desc(base + 128)]))) == S.ERR_WEIGHTS


# ---------------------------------------------------------------- RPC

def _rpc(front, **kw):
    front.st.op_table[0x1402] = ("softmax", 0, 0)
    base = front.attach(4096)
    fields = dict(cmd=0x1402, input_dsp_addr=base, input_size=16, output_dsp_addr=base + 64, output_size=16)
    fields.update({k: (v(base) if callable(v) else v) for k, v in kw.items()})
    return front(P.Rpc(**fields))


@pytest.mark.parametrize("priority", [0, 255])
def test_rpc_priority_0_to_255_is_accepted(front, priority):
    assert submitted(_rpc(front, priority=priority)).priority == priority


@pytest.mark.parametrize("priority", [256, 1 << 31, (1 << 32) - 1])
def test_rpc_priority_past_255_is_invalid(front, priority):
    assert status(_rpc(front, priority=priority)) == S.ERR_INVALID


@pytest.mark.parametrize("core,want", [(-1, None), (0, None), (1, None), (2, S.ERR_INVALID), (-2, S.ERR_INVALID)])
def test_rpc_core_is_any_or_an_existing_index(front, core, want):
    actions = _rpc(front, core=core)
    if want is None:
        assert submitted(actions).core == core
    else:
        assert status(actions) == want


@pytest.mark.parametrize("field", ["input", "output"])
def test_rpc_range_outside_the_connection_is_err_addr(front, field):
    assert status(_rpc(front, **{f"{field}_dsp_addr": lambda b: b + 4090})) == S.ERR_ADDR


def test_rpc_without_a_timeout_has_no_deadline_unless_the_device_sets_one(front):
    assert submitted(_rpc(front)).deadline is None
    f2 = Front()
    f2.h.job_timeout_s = 5.0
    try:
        assert submitted(_rpc(f2)).deadline is not None
    finally:
        for b in f2.bufs:
            b.close()


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


def test_op_library_flag_bits_past_bit_0_are_invalid(front):
    base = front.attach(4096)
    assert status(front(P.OpsLoad(src_dsp_addr=base, src_size=16, flags=0xFFFFFFFE))) == S.ERR_INVALID


# ---------------------------------------------------------------- GET_ERROR / POOL_STATUS

def test_get_error_reports_the_last_failure_only(front):
    front(P.BufDetach(seq=1, dsp_addr=0x10))
    front(P.DynUnload(seq=2, module_handle=77))
    (e,) = responses(front(P.GetError(seq=3)))
    assert (e.error_seq, e.error_status) == (2, S.ERR_HANDLE) and b"77" in e.payload


def test_get_error_text_is_cut_to_fit_a_datagram(front):
    front.h.handle(front.conn, P.Ping(seq=1), [])
    front.conn.last_error = (1, S.ERR_LOAD, "x" * 2000)
    (e,) = responses(front(P.GetError(seq=2)))
    assert len(e.payload) == P.GetErrorResp.MAX_TEXT and len(e.encode()) == P.MAX_MSG


def test_pool_status_counts_modules_not_op_libraries(front):
    front.module()
    front.module()
    h = front.st.new_id()
    front.st.modules[h] = ModuleRec(h, front.conn.cid, 0, 0, "oplib")
    front.st.op_table[1] = ("a", 0, h)
    front.attach(8192)
    (r,) = responses(front(P.PoolStatus()))
    assert (r.modules, r.op_count, r.connections, r.cores, r.carveout_used) == (2, 1, 1, 2, 8192)
    assert (r.ddr_total, r.carveout_total, r.l2_total) == (8 * MiB, 64 * MiB, memory.L2_SIZE)


def test_a_handler_bug_is_not_a_refusal_it_propagates_to_the_loop(front):
    """The loop turns an unexpected exception into ERR_GENERIC (test_service);
    handle() answers only Reject, so a bug is never mistaken for a status."""
    front.h._table[P.MsgType.PING] = lambda *a: 1 / 0
    with pytest.raises(ZeroDivisionError):
        front(P.Ping())


def test_failure_with_no_connection_answers_nothing():
    from dspx.device.front.actions import failure
    assert failure(None, P.Ping(), Reject(S.ERR_INVALID, "x")) == []


def test_cores_default_rss_is_zero():
    assert Cores(1, lambda i: 1).rss() == 0


def test_submit_and_respond_are_distinct_actions(front):
    front.attach(MiB, staging=True)
    actions = front(P.DynLoad(elf_size=10))
    assert [type(a) for a in actions] == [Submit]
    assert [type(a) for a in front(P.Ping())] == [Respond]


def test_ping_answers_version_with_the_same_seq(front):
    (r,) = responses(front(P.Ping(seq=77)))
    assert (r.seq, r.status, r.version) == (77, 0, 0x030000)


def test_a_refusal_is_remembered_for_get_error(front):
    front(P.BufDetach(seq=9, dsp_addr=0x1234))
    (e,) = responses(front(P.GetError(seq=10)))
    assert (e.error_seq, e.error_status) == (9, S.ERR_ADDR) and b"0x1234" in e.payload


# ---------------------------------------------------------------- answers that carry state

def test_ping_and_status_carry_the_version_and_the_uptime_in_ms(front):
    import time

    front.st.started = time.monotonic() - 5.0
    (r,) = responses(front(P.Ping(seq=3)))
    assert r.version == P.VERSION and 5000 <= r.uptime_ms < 5000 + 60_000
    front.st.jobs_completed, front.st.jobs_failed = (1 << 32) + 7, 3
    (s,) = responses(front(P.GetStatus(seq=4)))
    assert (s.seq, s.version, s.jobs_completed, s.jobs_failed) == (4, P.VERSION, 7, 3)
    assert 5000 <= s.uptime_ms < 5000 + 60_000


def test_uptime_wraps_at_32_bits():
    import time

    from dspx.device.front.state import DeviceState

    st = DeviceState()
    st.started = time.monotonic() - ((1 << 32) + 10_000) / 1000  # 2^32 ms and 10 s ago
    assert 10_000 <= st.uptime_ms() < 10_000 + 60_000


def test_pool_status_reports_every_figure_by_name(front):
    front.h.cores.rss = lambda: 123_456_789
    front.st.ddr.take(3 * MiB)
    front.st.ddr.give(MiB)
    front.attach(8192)
    (r,) = responses(front(P.PoolStatus(seq=9)))
    assert (r.seq, r.ddr_total, r.ddr_used, r.ddr_peak) == (9, 8 * MiB, 2 * MiB, 3 * MiB)
    assert (r.carveout_total, r.carveout_used, r.l2_total, r.l2_used) == (64 * MiB, 8192, memory.L2_SIZE, 0)
    assert (r.connections, r.modules, r.cores, r.op_count, r.rss_bytes) == (1, 0, 2, 0, 123_456_789)


def test_ops_list_is_sorted_by_command_and_paged(front):
    for cmd in range(0x2000 + 12, 0x2000, -1):  # 12 ops, registered in reverse
        front.st.op_table[cmd] = (f"op{cmd:x}", cmd & 0xFF, 7)
    (r,) = responses(front(P.OpsList(seq=2, start=0)))
    assert (r.seq, r.total, r.count) == (2, 12, P.OpsListResp.MAX_ENTRIES)
    assert r.entries()[0] == (0x2001, 1, 7, 0, "op2001")
    (r2,) = responses(front(P.OpsList(start=10)))
    assert [e[0] for e in r2.entries()] == [0x200B, 0x200C] and r2.total == 12
    (r3,) = responses(front(P.OpsList(start=12)))
    assert (r3.count, r3.payload) == (0, b"")


def test_a_new_device_reports_no_jobs_yet(front):
    (s,) = responses(front(P.GetStatus(seq=9)))
    assert (s.status, s.jobs_completed, s.jobs_failed) == (0, 0, 0)


# ---------------------------------------------------------------- unloads and accounting

def _model(front, nbytes: int, generation: int = 1) -> int:
    mid = front.st.new_id()
    front.st.models[mid] = ModelRec(mid, front.conn.cid, 0, generation, nbytes, 2)
    front.conn.models.add(mid)
    front.st.ddr.take(nbytes)
    return mid


def test_model_unload_waits_for_its_core_then_answers_the_connection(front):
    from dspx.device.front.actions import RespondTo

    mid = _model(front, 4096)
    actions = front(P.ModelUnload(seq=12, model_id=mid))
    job = submitted(actions)
    assert isinstance(job.rec, jobs.UnloadWeights) and job.rec.model_id == mid
    assert (job.core, job.conn, job.req.seq, job.bufs) == (0, None, 12, [])
    (to,) = job.on_done(jobs.Done(job.rec.job))
    assert isinstance(to, RespondTo) and to.conn is front.conn
    assert isinstance(to.msg, P.ModelUnloadResp) and to.msg.seq == 12
    assert mid not in front.st.models and mid not in front.conn.models and front.st.ddr.used == 0


def test_model_unload_of_a_core_that_restarted_answers_at_once(front):
    mid = _model(front, 4096, generation=0)
    (r,) = responses(front(P.ModelUnload(seq=5, model_id=mid)))
    assert (r.seq, r.status) == (5, 0) and not [a for a in front(P.Ping()) if isinstance(a, Submit)]


def test_module_unload_waits_for_the_core_that_holds_it(front):
    h = front.module()
    front.st.modules[h].core = 1
    job = submitted(front(P.DynUnload(seq=3, module_handle=h)))
    assert (job.core, job.rec.handle, job.req.seq) == (1, h, 3)
    (to,) = job.on_done(jobs.Done(job.rec.job))
    assert to.conn is front.conn and to.msg.seq == 3


def test_generation_is_asked_of_the_cores_own_index(front):
    front.h.cores.generation = lambda i: {0: 1, 1: 5}.get(i)
    h = front.module()
    front.st.modules[h].core, front.st.modules[h].generation = 1, 5
    assert isinstance(submitted(front(P.DynUnload(module_handle=h))).rec, jobs.UnloadModule)


def test_the_ddr_pool_comes_back_per_module_and_resets_when_nothing_is_loaded(front):
    st = front.st
    a, b = front.module(), front.module()
    for h, n in ((a, 1000), (b, 3000)):
        st.modules[h].ddr_bytes = n
        st.ddr.take(n)
    st.ddr.take(500)  # drift the pool's figure: only a reset clears it
    st.drop_module(st.modules[a])
    assert st.ddr.used == 3500 and a not in front.conn.modules and b in front.conn.modules
    mid = _model(front, 100)
    st.drop_module(st.modules[b])
    assert st.ddr.used == 600  # a model is still loaded: no reset
    st.drop_model(st.models[mid])
    assert st.ddr.used == 0 and mid not in front.conn.models


def test_an_op_library_does_not_keep_the_pool_from_resetting(front):
    st = front.st
    h = front.st.new_id()
    st.modules[h] = ModuleRec(h, front.conn.cid, 0, 0, "oplib")
    m = front.module()
    st.modules[m].ddr_bytes = 10
    st.ddr.take(20)
    st.drop_module(st.modules[m])
    assert st.ddr.used == 0


def test_a_closing_connections_module_and_model_are_dropped_on_their_core_incarnation(front):
    h = front.module()
    front.st.modules[h].core, front.st.modules[h].generation = 1, 4
    (n,) = front.h.unload_module(front.st.modules[h])
    assert (n.core, n.generation, n.rec.handle) == (1, 4, h) and h not in front.st.modules
    mid = _model(front, 64, generation=3)
    (n,) = front.h.unload_model(front.st.models[mid])
    assert (n.core, n.generation, n.rec.model_id) == (0, 3, mid) and mid not in front.st.models


def test_unloading_an_op_library_removes_only_its_own_ops_on_every_core(front):
    st = front.st
    for lib in (101, 102):
        st.modules[lib] = ModuleRec(lib, front.conn.cid, 0, 0, "oplib")
        st.op_sources[lib] = (b"src", "<oplib>")
    st.op_table.update({1: ("a", 0, 101), 2: ("b", 0, 102), 3: ("c", 0, 101)})
    (n,) = front.h.unload_ops(st.modules[101])
    assert (n.core, n.rec.handle) == (None, 101) and isinstance(n.rec, jobs.UnloadOps)
    assert st.op_table == {2: ("b", 0, 102)} and 101 not in st.op_sources and 102 in st.op_sources
    assert 101 not in st.modules and 102 in st.modules


def test_dyn_unload_of_an_op_library_answers_the_request(front):
    st = front.st
    st.modules[77] = ModuleRec(77, front.conn.cid, 0, 0, "oplib")
    actions = front(P.DynUnload(seq=21, module_handle=77))
    (r,) = responses(actions)
    assert (r.seq, r.status) == (21, 0)
    assert any(isinstance(a, Notify) and a.rec.handle == 77 for a in actions)


def test_a_loaded_op_library_keeps_its_source_for_cores_that_restart(front):
    base = front.attach(4096)
    front.conn.bufs[base].region.mm[:16] = b"# op library 16\n"
    per_core, actions = _load_everywhere(front(P.OpsLoad(src_dsp_addr=base, src_size=16)), [])
    handle = per_core[0].rec.handle
    assert handle > 0 and all((j.rec.handle, j.rec.filename, j.rec.source) == (handle, "<oplib>", b"# op library 16\n")
                              for j in per_core)
    r = _answer(actions)
    assert r.lib_handle == handle
    assert front.st.op_sources[handle] == (b"# op library 16\n", "<oplib>")
    assert (front.st.modules[handle].kind, front.st.modules[handle].handle) == ("oplib", handle)


def test_an_op_library_refused_without_a_line_answers_line_0(front):
    base = front.attach(4096)
    per_core = _per_core(front(P.OpsLoad(src_dsp_addr=base, src_size=16)))
    for j in per_core:
        actions = j.on_done(jobs.Done(j.rec.job, S.ERR_LOAD, "does not compile"))
    r = _answer(actions)
    assert (r.status, r.error_line) == (S.ERR_LOAD, 0)
    (e,) = responses(front(P.GetError()))
    assert b"does not compile" in e.payload


def test_detach_accounts_the_connections_bytes_and_the_devices_buffers(front):
    a = front.attach(8192)
    b = front.attach(4096)
    assert front.conn.attached == 12288 and front.st.nbufs == 2
    front(P.BufDetach(dsp_addr=a))
    assert front.conn.attached == 4096 and front.st.nbufs == 1
    front(P.BufDetach(dsp_addr=b))
    assert front.conn.attached == 0 and front.st.nbufs == 0


def test_detach_unbinds_printf_only_if_the_ring_was_in_that_buffer(front):
    a = front.attach(4096)
    b = front.attach(4096)
    assert b == a + 4096  # adjacent: b starts where a ends
    front(P.SetPrintfBuf(printf_dsp_addr=b, printf_size=64))
    front(P.BufDetach(dsp_addr=a))
    assert front.conn.printf == (b, 64)


# ---------------------------------------------------------------- plans

def test_a_connection_keeps_16_plans_and_forgets_the_oldest(front):
    from dspx.device.front.state import MAX_PLANS_PER_CONN

    base, h = front.attach(8192), front.module(signature=None)
    ids = []
    for i in range(MAX_PLANS_PER_CONN):
        req = infer_req(base, h, 8192, [tensor_desc(base + 128 + 64 * i)])
        key = Handlers.plan_key(front.conn, P.MsgType.INFER, req.encode())
        actions = front.h.handle(front.conn, req, [], key)
        assert not [a for a in actions if not isinstance(a, Submit)]
        ids.append(submitted(actions).plan.plan_id)
    req = infer_req(base, h, 8192, [tensor_desc(base + 4096)])
    key = Handlers.plan_key(front.conn, P.MsgType.INFER, req.encode())
    actions = front.h.handle(front.conn, req, [], key)
    (forget,) = [a for a in actions if not isinstance(a, Submit)]
    assert forget.plans == [ids[0]] and len(front.conn.plans) == MAX_PLANS_PER_CONN


def test_an_rpc_plan_replays_only_while_its_command_is_registered(front):
    actions = _rpc(front)
    job = submitted(actions)
    plan = job.plan
    again = submitted(front.h.replay(front.conn, plan, 55))
    assert again.rec.seq == 55 and again.plan is plan and again.req_type == P.MsgType.RPC
    del front.st.op_table[0x1402]
    assert front.h.replay(front.conn, plan, 56) is None


def test_an_infer_plan_replays_whatever_the_op_table(front):
    base, h = front.attach(4096), front.module()
    plan = submitted(front(infer_req(base, h, 4096, [tensor_desc(base + 128)]))).plan
    job = submitted(front.h.replay(front.conn, plan, 9))
    assert job.req_type == P.MsgType.INFER and job.rec.plan == plan.plan_id


def test_no_room_keeps_the_status_message_and_numbers():
    n = Notify(0, jobs.UnloadModule(handle=1))
    e = NoRoom(n, Reject(S.ERR_NOMEM, "full", oom_requested=5, oom_free=1))
    assert (e.status, str(e), e.numbers, e.undo) == (S.ERR_NOMEM, "full", {"oom_requested": 5, "oom_free": 1}, n)


def test_infer_is_planned_once_and_replayed_until_the_buffers_change(front):
    base, h = front.attach(4096), front.module()
    req = infer_req(base, h, 4096, [tensor_desc(base + 128)])
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
                  descs=[tensor_desc(inb + 128), tensor_desc(kv_addr + 64, (4,), "int32")])
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
    spec = submitted(front(infer_req(base, h, 4096, [tensor_desc(base + 128)], flags=0))).plan.spec
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
    inf = submitted(front(infer_req(base, front.module(), 4096, [tensor_desc(base + 128)])))
    assert type(rpc.plan.plan_id) is int and type(inf.plan.plan_id) is int and rpc.plan.plan_id != inf.plan.plan_id
    assert not front.conn.plans


# ---------------------------------------------------------------- refusal texts and plan keys

def _staged_front(front):
    front.attach(MiB, staging=True)
    return front


REFUSALS = [  # (request builder, status, words the GET_ERROR text must hold)
    (lambda f, b: P.SetPrintfBuf(printf_dsp_addr=b, printf_size=64, reserved=1), S.ERR_INVALID, "reserved must be zero"),
    (lambda f, b: P.SetPrintfBuf(printf_dsp_addr=b, printf_size=31), S.ERR_INVALID, "31 bytes is too small (at least 32)"),
    (lambda f, b: P.SetPrintfBuf(printf_dsp_addr=b + 4000, printf_size=200), S.ERR_ADDR, "printf buffer 0x"),
    (lambda f, b: P.ModelUnload(model_id=4242), S.ERR_HANDLE, "unknown model id 4242"),
    (lambda f, b: P.DynUnload(module_handle=4343), S.ERR_HANDLE, "unknown module handle 4343"),
    (lambda f, b: P.BufDetach(dsp_addr=b + 8), S.ERR_ADDR, "is not the address of a buffer of this connection"),
    (lambda f, b: P.InferLarge(num_inputs=1, descs_addr=b + 4090, descs_size=80), S.ERR_ADDR, "descriptor table 0x"),
    (lambda f, b: P.OpsLoad(src_dsp_addr=b, src_size=0), S.ERR_SIZE, "op library of 0 bytes (1..131072)"),
    (lambda f, b: P.OpsLoad(src_dsp_addr=b + 4000, src_size=200), S.ERR_ADDR, "op library source 0x"),
    (lambda f, b: P.Rpc(cmd=0x7777, input_dsp_addr=b, input_size=4, output_dsp_addr=b, output_size=4), S.ERR_OP,
     "no operator registered for command 0x7777"),
    (lambda f, b: P.DynLoad(elf_size=100), S.ERR_INVALID, "DYN_LOAD: this connection has no staging buffer attached"),
    (lambda f, b: P.ModelLoad(weights_size=1, flags=1), S.ERR_INVALID, "flags and reserved fields must be zero"),
    (lambda f, b: P.ModelLoad(weights_size=100), S.ERR_INVALID, "MODEL_LOAD: this connection has no staging buffer"),
    (lambda f, b: P.InferLarge(module_handle=f.module(), num_inputs=1, descs_addr=b, descs_size=80, reserved=1),
     S.ERR_INVALID, "reserved must be zero"),
    (lambda f, b: P.InferLarge(module_handle=f.module(), num_inputs=4097, descs_size=4097 * 80), S.ERR_INVALID,
     "num_inputs 4097 is beyond any module (limit 4096)"),
    (lambda f, b: P.InferLarge(module_handle=f.module(), num_inputs=2, descs_size=80), S.ERR_INVALID,
     "descs_size 80 != num_inputs 2 x 80"),
    (lambda f, b: P.Infer(module_handle=f.module(), num_inputs=2, input_dsp_addr=b, input_size=4096,
                          result_dsp_addr=b, result_size=4096, descs=[tensor_desc(b + 128)]), S.ERR_INVALID,
     "num_inputs 2 but 1 descriptors inline"),
    (lambda f, b: infer_req(b, f.module(), 4096, [tensor_desc(b + 128)], flags=1 << 31), S.ERR_INVALID,
     "INFER flags 0x80000000 set reserved bits 18-31"),
    (lambda f, b: P.Infer(module_handle=f.module(), model_id=99, num_inputs=1, input_dsp_addr=b, input_size=4096,
                          result_dsp_addr=b, result_size=4096, descs=[tensor_desc(b + 128)]), S.ERR_HANDLE,
     "unknown model id 99"),
    (lambda f, b: infer_req(b, f.module(jobs.ModuleSig(True, SIG.inputs)), 4096, [tensor_desc(b + 128)]), S.ERR_WEIGHTS,
     "module was compiled with separate weights: load them with MODEL_LOAD and pass the model id"),
    (lambda f, b: infer_req(b + 8192, f.module(), 64, [tensor_desc(b + 8192)]), S.ERR_ADDR, "input range 0x"),
    (lambda f, b: infer_req(b, f.module(), 4096, [tensor_desc(b + 128)], out=(b + 8192, 64)), S.ERR_ADDR,
     "result range 0x"),
    (lambda f, b: infer_req(b, f.module(), 4096, [tensor_desc(b + 128)], flags=P.FLAG_KV_RESIDENT), S.ERR_INVALID,
     "KV_RESIDENT needs a staging buffer with a KV region"),
]
EXACT = {"reserved must be zero", "flags and reserved fields must be zero",
         "module was compiled with separate weights: load them with MODEL_LOAD and pass the model id",
         "KV_RESIDENT needs a staging buffer with a KV region"}  # fixed texts: all of it


@pytest.mark.parametrize("build,want,words", REFUSALS, ids=[w for *_, w in REFUSALS])
def test_every_refusal_says_what_and_why(front, build, want, words):
    base = front.attach(4096)
    assert status(front(build(front, base))) == want
    (e,) = responses(front(P.GetError()))
    text = e.payload.decode()
    assert e.error_status == want and (text == words if words in EXACT else words in text), text


def test_an_op_library_too_big_from_staging_names_its_size(front):
    _staged_front(front)
    front(P.DynLoad(elf_size=MAX_OPLIB_SOURCE + 1, flags=P.DYN_LOAD_OP_LIBRARY))
    (e,) = responses(front(P.GetError()))
    assert f"op library of {MAX_OPLIB_SOURCE + 1} bytes" in e.payload.decode()


def test_plan_keys_differ_with_any_field_but_the_seq(front):
    base, h = front.attach(4096), front.module()
    front.conn.bufs[base].region.mm[:80] = tensor_desc(base + 128).encode()
    large = P.InferLarge(module_handle=h, num_inputs=1, descs_addr=base, descs_size=80, input_dsp_addr=base,
                         input_size=4096, result_dsp_addr=base, result_size=4096)
    other = P.InferLarge(**{**{k: getattr(large, k) for k in large.FIELDS}, "module_handle": h + 1})
    k1 = Handlers.plan_key(front.conn, P.MsgType.INFER_LARGE, large.encode())
    assert k1 != Handlers.plan_key(front.conn, P.MsgType.INFER_LARGE, other.encode())
    large.seq = 99
    assert Handlers.plan_key(front.conn, P.MsgType.INFER_LARGE, large.encode()) == k1
    # a datagram of the wrong size for INFER_LARGE is keyed as it is (the full check refuses it)
    short = large.encode()[:64]
    assert Handlers.plan_key(front.conn, P.MsgType.INFER_LARGE, short) == short[:4] + short[8:]


def test_a_replayed_call_belongs_to_its_connection(front):
    job = submitted(_rpc(front))
    again = submitted(front.h.replay(front.conn, job.plan, 3))
    assert again.conn is front.conn and again.bufs == job.plan.used


def test_dropping_a_module_or_model_twice_is_harmless(front):
    h = front.module()
    rec = front.st.modules[h]
    front.st.drop_module(rec)
    front.st.drop_module(rec)
    mid = _model(front, 10)
    mrec = front.st.models[mid]
    front.st.drop_model(mrec)
    front.st.drop_model(mrec)
    assert h not in front.st.modules and mid not in front.st.models
    lib = front.st.new_id()
    front.st.modules[lib] = ModuleRec(lib, 0, 0, 0, "oplib")
    front.h.unload_ops(front.st.modules[lib])
    assert front.h.unload_ops(ModuleRec(lib, 0, 0, 0, "oplib"))[0].rec.handle == lib


def test_an_op_library_from_staging_answers_with_a_dyn_load_response(front):
    st = _staged_front(front).conn.staging
    st.region.mm[:6] = b"x = 1\n"
    per_core, actions = _load_everywhere(front(P.DynLoad(seq=31, elf_size=6, flags=P.DYN_LOAD_OP_LIBRARY)),
                                         [(0x3005, "x", 0)])
    assert all(j.bufs == [] and j.run_limit_s == Handlers.OPS_LOAD_LIMIT_S for j in per_core)
    (to,) = [a for a in actions if type(a).__name__ == "RespondTo"]
    r = to.msg
    assert to.conn is front.conn and isinstance(r, P.DynLoadResp)
    assert (r.seq, r.status, r.module_handle) == (31, 0, per_core[0].rec.handle)
    assert front.st.op_table[0x3005][2] == r.module_handle


def test_an_op_library_one_core_refused_is_unloaded_by_handle_where_it_loaded(front):
    base = front.attach(4096)
    (j0,) = _per_core(front(P.OpsLoad(seq=4, src_dsp_addr=base, src_size=16)))
    (j1,) = _rest(j0.on_done(jobs.Done(j0.rec.job, value=jobs.OpsLoaded([]))))
    actions = j1.on_done(jobs.Done(j1.rec.job, S.ERR_LOAD, "bad"))
    (undo,) = [a for a in actions if isinstance(a, Notify)]
    assert isinstance(undo.rec, jobs.UnloadOps) and undo.rec.handle == j0.rec.handle
    (to,) = [a for a in actions if type(a).__name__ == "RespondTo"]
    assert to.conn is front.conn and (to.msg.seq, to.msg.status) == (4, S.ERR_LOAD)


def test_a_loaded_module_records_the_incarnation_of_its_core(front):
    front.h.cores.generation = lambda i: 3 if i == 0 else None
    front.attach(MiB, staging=True)
    job = submitted(front(P.DynLoad(elf_size=100)))
    (r,) = responses(job.on_done(jobs.Done(job.rec.job, value=jobs.Loaded(10, 0, 0, None, None))))
    assert front.st.modules[r.module_handle].generation == 3


def test_detach_answers_with_the_requests_seq(front):
    addr = front.attach(4096)
    (r,) = responses(front(P.BufDetach(seq=44, dsp_addr=addr)))
    assert (r.seq, r.status) == (44, 0)


def test_busy_detach_says_how_many_jobs_use_the_buffer(front):
    addr = front.attach(4096)
    front.conn.bufs[addr].busy = 2
    front(P.BufDetach(dsp_addr=addr))
    (e,) = responses(front(P.GetError()))
    assert e.payload.decode() == f"buffer 0x{addr:x} is in use by 2 job(s)"


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
    (SIG, lambda b: [tensor_desc(b + 128), tensor_desc(b + 256)], S.ERR_TENSOR, "module takes 1 inputs, 2 given"),
    (SIG, lambda b: [tensor_desc(b + 128, (2, 8), "int32")], S.ERR_TENSOR,
     "input 0 (x): module expects float32[2, 8], got int32[2, 8]"),
    (jobs.ModuleSig(False, [jobs.TensorSig("", (2, 8), "float32")]), lambda b: [tensor_desc(b + 128, (8, 2))], S.ERR_TENSOR,
     "input 0 (0): module expects float32[2, 8], got float32[8, 2]"),  # an input with no name: its index
    (SIG, lambda b: [tensor_desc(b + 4096)], S.ERR_ADDR, "input 0 data 0x{:x}+64 is outside the input range and the KV region"),
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


# ---------------------------------------------------------------- DYN_LOAD in full

def test_a_loaded_module_answers_every_figure_and_is_recorded_as_this_connections(front):
    front.attach(MiB, staging=True)
    job = submitted(front(P.DynLoad(seq=17, elf_size=1000)))
    assert (job.core, job.conn, job.req.seq) == (0, front.conn, 17) and job.rec.ddr_free == 8 * MiB
    loaded = jobs.Loaded(4096, 1024, 512, (3, 5, 11_111, 22_222, 1), SIG)
    (r,) = responses(job.on_done(jobs.Done(job.rec.job, value=loaded)))
    assert (r.seq, r.status, r.module_handle) == (17, 0, job.rec.handle)
    assert (r.text_size, r.data_size) == (4096, 1024)
    assert (r.io_num_inputs, r.io_num_outputs, r.io_input_bytes, r.io_output_bytes, r.io_flags) == (3, 5, 11_111, 22_222, 1)
    rec = front.st.modules[r.module_handle]
    assert (rec.cid, rec.core, rec.kind, rec.ddr_bytes, rec.signature) == (front.conn.cid, 0, "module", 5632, SIG)
    assert responses(front(P.PoolStatus()))[0].modules == 1


def test_a_module_without_io_meta_answers_zeros(front):
    front.attach(MiB, staging=True)
    job = submitted(front(P.DynLoad(elf_size=1000)))
    (r,) = responses(job.on_done(jobs.Done(job.rec.job, value=jobs.Loaded(10, 20, 0, None, None))))
    assert (r.io_num_inputs, r.io_num_outputs, r.io_input_bytes, r.io_output_bytes, r.io_flags) == (0, 0, 0, 0, 0)


def test_a_load_refused_by_the_core_keeps_its_text_and_its_own_total(front):
    front.attach(MiB, staging=True)
    job = submitted(front(P.DynLoad(elf_size=1000)))
    e = _reject_of(job.on_done, jobs.Done(job.rec.job, S.ERR_NOMEM, "segments too big",
                                          numbers={"oom_requested": 9, "oom_free": 8, "oom_total": 777}))
    assert (str(e), e.numbers["oom_total"]) == ("segments too big", 777)


def test_a_module_past_the_pool_is_undone_on_its_core_with_the_figures_in_the_text(front):
    front.attach(MiB, staging=True)
    front.st.ddr.take(MiB)
    job = submitted(front(P.DynLoad(elf_size=1000)))
    with pytest.raises(NoRoom) as e:
        job.on_done(jobs.Done(job.rec.job, value=jobs.Loaded(8 * MiB, 0, 0, None, None)))
    assert (e.value.undo.core, e.value.undo.rec.handle) == (0, job.rec.handle)
    assert isinstance(e.value.undo.rec, jobs.UnloadModule)
    assert e.value.numbers == dict(oom_requested=8 * MiB, oom_free=7 * MiB, oom_total=8 * MiB)
    assert str(e.value) == f"module needs {8 * MiB} bytes of the DDR pool; {7 * MiB} of {8 * MiB} free"


def test_dyn_load_refusal_texts(front):
    front.attach(MiB, staging=True)
    for req, text in ((P.DynLoad(elf_size=1, reserved0=1), "reserved fields must be zero"),
                      (P.DynLoad(elf_size=1, flags=2), "unknown DYN_LOAD flags 0x2")):
        front(req)
        (e,) = responses(front(P.GetError()))
        assert e.payload.decode() == text


def test_an_op_library_from_staging_is_named_staging(front):
    front.attach(MiB, staging=True)
    (j0,) = _per_core(front(P.DynLoad(elf_size=6, flags=P.DYN_LOAD_OP_LIBRARY)))
    assert j0.rec.filename == "<staging>"


def test_set_printf_buf_answers_with_the_requests_seq(front):
    addr = front.attach(4096)
    (r,) = responses(front(P.SetPrintfBuf(seq=61, printf_dsp_addr=addr, printf_size=64)))
    assert (r.seq, r.status) == (61, 0)


def test_a_refusal_answers_its_numbers_in_the_response(front):
    from dspx.device.front.actions import failure

    (r,) = responses(failure(front.conn, P.DynLoad(seq=3), Reject(S.ERR_NOMEM, "x", oom_requested=5, oom_free=4)))
    assert (r.seq, r.status, r.oom_requested, r.oom_free) == (3, S.ERR_NOMEM, 5, 4)


def test_get_error_answers_its_own_seq_and_survives_unencodable_text(front):
    front.conn.last_error = (1, S.ERR_LOAD, "bad \ud800 text")
    (e,) = responses(front(P.GetError(seq=8)))
    assert (e.seq, e.error_seq, e.payload) == (8, 1, b"bad ? text")


def test_staged_size_refusal_text(front):
    front.attach(MiB, staging=True, kv=4096)
    front(P.DynLoad(elf_size=0))
    (e,) = responses(front(P.GetError()))
    assert e.payload.decode() == f"DYN_LOAD: 0 bytes staged but the staging area holds {MiB - 4096}"


def test_loaded_weights_are_recorded_on_core_0_at_its_incarnation(front):
    front.attach(MiB, staging=True)
    job = submitted(front(P.ModelLoad(weights_size=100)))
    (r,) = responses(job.on_done(jobs.Done(job.rec.job, value=jobs.WeightsLoaded(2, 64))))
    rec = front.st.models[r.model_id]
    assert (rec.cid, rec.core, rec.generation, rec.ddr_bytes, rec.num_constants) == (front.conn.cid, 0, 1, 64, 2)


# ---------------------------------------------------------------- calls: deadlines, plans, errors

def test_a_call_with_a_time_limit_gets_its_deadline_in_seconds(front):
    import time

    t0 = time.monotonic()
    job = submitted(_rpc(front, timeout_ms=1500))
    assert t0 + 1.5 <= job.deadline <= time.monotonic() + 1.5


def test_a_failed_call_is_kept_for_get_error_and_a_success_is_not(front):
    job = submitted(_rpc(front, timeout_ms=0))
    assert job.on_done(jobs.Done(job.rec.job, S.SUCCESS, seq=5)) == [] and front.conn.last_error == (0, 0, "")
    job.on_done(jobs.Done(job.rec.job, S.ERR_CALL, "handler raised", seq=6))
    assert front.conn.last_error == (6, S.ERR_CALL, "handler raised")


def test_infer_large_uses_the_table_read_for_its_key_not_what_is_in_memory_now(front):
    base, h = front.attach(4096), front.module()
    mm = front.conn.bufs[base].region.mm
    mm[:80] = tensor_desc(base + 128).encode()
    req = P.InferLarge(module_handle=h, num_inputs=1, descs_addr=base, descs_size=80, input_dsp_addr=base,
                       input_size=4096, result_dsp_addr=base, result_size=4096)
    key = Handlers.plan_key(front.conn, P.MsgType.INFER_LARGE, req.encode())
    mm[:80] = tensor_desc(base + 256).encode()  # the host rewrites the table after sending
    job = submitted(front.h.handle(front.conn, req, [], key))
    assert job.plan.spec.inputs[0][1] == 128 and front.conn.plans[key] is job.plan


def test_a_staging_buffer_without_kv_has_no_kv_region(front):
    front.attach(MiB, staging=True, kv=0)
    assert front.conn.kv_region() is None
    base, h = front.attach(4096), front.module()
    assert status(front(infer_req(base, h, 4096, [tensor_desc(base + 128)], flags=P.FLAG_KV_RESIDENT))) == S.ERR_INVALID


def test_model_load_is_a_job_for_core_0_reading_the_staged_bytes(front):
    front.h.cores.generation = lambda i: 1 if i == 0 else None
    front.attach(MiB, staging=True)
    st = front.conn.staging
    job = submitted(front(P.ModelLoad(seq=3, weights_size=100)))
    assert (job.rec.buf, job.rec.size, job.core, job.conn, job.req.seq, job.bufs) == (st.buf_id, 100, 0, front.conn,
                                                                                     3, [st])
    (r,) = responses(job.on_done(jobs.Done(job.rec.job, value=jobs.WeightsLoaded(1, 8))))
    assert front.st.models[r.model_id].generation == 1


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


# ---------------------------------------------------------------- BUF_ATTACH in full

def _attach_text(front, req, fds):
    st = status(front(req, fds))
    (e,) = responses(front(P.GetError()))
    return st, e.payload.decode()


def test_buf_attach_refusal_texts(front):
    assert _attach_text(front, P.BufAttach(size=4096), []) == (S.ERR_INVALID, "BUF_ATTACH needs exactly one fd, got 0")
    assert _attach_text(front, P.BufAttach(size=4096, flags=6), [dmabuf_fd(front)]) == \
        (S.ERR_INVALID, "unknown attach flags 0x6")
    assert _attach_text(front, P.BufAttach(size=4096, kv_size=64), [dmabuf_fd(front)]) == \
        (S.ERR_INVALID, "kv_size must be zero unless attaching a staging buffer")
    assert _attach_text(front, P.BufAttach(size=4096, flags=1, kv_size=8192), [dmabuf_fd(front)]) == \
        (S.ERR_INVALID, "KV region of 8192 bytes does not fit a 4096-byte staging buffer")
    front.attach(4096, staging=True)
    assert _attach_text(front, P.BufAttach(size=4096, flags=1), [dmabuf_fd(front)]) == \
        (S.ERR_INVALID, "this connection already has a staging buffer")


def test_buf_attach_answers_its_seq_address_and_size(front):
    (r,) = responses(front(P.BufAttach(seq=12, size=5000), [dmabuf_fd(front, 8192)]))
    assert (r.seq, r.status, r.dsp_addr, r.size) == (12, 0, memory.CARVEOUT_BASE, 5000)


def test_the_devices_buffer_limit_counts_every_connection(front):
    front.st.limits.bufs_total = 2
    front.attach(4096)
    other = _other_conn(front)
    b = memory.DmaBuf(4096)
    front.bufs.append(b)
    assert status(front.h.handle(other, P.BufAttach(size=4096), [os.dup(b.fd)])) == 0
    st, text = _attach_text(front, P.BufAttach(size=4096), [dmabuf_fd(front)])
    assert st == S.ERR_NOMEM and text.startswith("device has 2 buffers attached (limit 2 for all connections")


def test_a_connection_may_attach_up_to_its_byte_quota(front):
    front.st.limits.conn_bytes = 3 * 4096
    front.attach(8192)
    front.attach(4096)  # exactly the quota
    st, text = _attach_text(front, P.BufAttach(size=4096), [dmabuf_fd(front)])
    assert st == S.ERR_NOMEM and text.startswith("connection quota: 4096 bytes requested, 12288 of 12288")
