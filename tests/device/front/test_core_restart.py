"""What the front keeps so a core restart costs no one their state
(docs/reliability.md §5), driven through the handlers with no core: the
private copy of each module's and weights file's bytes, the reload under the
same handle, op libraries sent again, and the limits derived from the fd
limit."""
from __future__ import annotations

import os

import pytest

from dspx.abi import protocol as P
from dspx.abi.protocol import Status as S
from dspx.device import jobs
from dspx.device.front.actions import Forget, Notify
from dspx.device.front.handlers import Handlers
from dspx.device.front.state import MAX_BUFS_PER_CONN, MAX_CONNS, Limits, ModuleRec
from front_harness import SIG, responses, submitted

MiB = 1 << 20


def _staged(front, data: bytes):
    if front.conn.staging is None:
        front.attach(MiB, staging=True)
    front.conn.staging.region.mm[:len(data)] = data
    return front.conn.staging


def _loaded_module(front, data=b"\x7fELF module bytes"):
    _staged(front, data)
    job = submitted(front(P.DynLoad(seq=2, elf_size=len(data))))
    (r,) = responses(job.on_done(jobs.Done(job.rec.job, value=jobs.Loaded(100, 0, 0, None, SIG))))
    return front.st.modules[r.module_handle]


def test_a_loaded_module_keeps_a_private_copy_of_exactly_its_staged_bytes(front):
    rec = _loaded_module(front, b"0123456789abcdef")
    img = rec.image
    assert img is not None and img.region.size == 16 and img.region.kind == "kept"
    assert os.pread(img.fd, 64, 0) == b"0123456789abcdef" and front.st.kept_bytes == 16
    front.conn.staging.region.mm[:4] = b"XXXX"  # staging is reused: the copy is not
    assert os.pread(img.fd, 4, 0) == b"0123"
    # its own buffer id (cores map it by id), at no DSP address, not inherited by children
    assert type(img.buf_id) is int and img.region.buf_id == img.buf_id
    assert img.buf_id not in [b.buf_id for b in front.conn.bufs.values()] and img.region.addr == 0
    import fcntl
    assert fcntl.fcntl(img.fd, fcntl.F_GETFD) & fcntl.FD_CLOEXEC


def test_a_copy_of_one_byte_is_kept_and_one_past_the_source_is_not(front):
    st = _staged(front, b"Z")
    one = front.st.keep_image(st, 1)
    assert one is not None and os.pread(one.fd, 8, 0) == b"Z"
    os.close(one.fd)
    assert front.st.keep_image(st, MiB + 1) is None  # the source ends first: refused, not a loop
    assert front.st.kept_bytes == 1


def test_loaded_weights_keep_a_copy_too_and_unloading_gives_it_back(front):
    _staged(front, b"DSPXWGT1" + bytes(24))
    job = submitted(front(P.ModelLoad(weights_size=32)))
    (r,) = responses(job.on_done(jobs.Done(job.rec.job, value=jobs.WeightsLoaded(2, 4096))))
    rec = front.st.models[r.model_id]
    assert rec.image.region.size == 32 and os.pread(rec.image.fd, 8, 0) == b"DSPXWGT1"
    fd = rec.image.fd
    front(P.ModelUnload(model_id=r.model_id))
    assert rec.image is None and front.st.kept_bytes == 0
    with pytest.raises(OSError):
        os.fstat(fd)  # closed


def test_copies_past_the_budget_are_not_kept(front):
    st = _staged(front, bytes(64))
    front.st.keep_limit = 100
    first = front.st.keep_image(st, 64)
    assert first is not None and front.st.kept_bytes == 64
    assert front.st.keep_image(st, 37) is None and front.st.kept_bytes == 64
    exact = front.st.keep_image(st, 36)  # to the byte
    assert exact is not None and front.st.kept_bytes == 100
    for b in (first, exact):
        os.close(b.fd)


def test_dropping_a_module_closes_its_copy_once(front):
    rec = _loaded_module(front)
    fd, size = rec.image.fd, rec.image.region.size
    front.st.drop_module(rec)
    assert rec.image is None and front.st.kept_bytes == 0
    front.st.drop_image(rec)  # nothing left to drop
    assert front.st.kept_bytes == 0
    with pytest.raises(OSError):
        os.fstat(fd)
    assert size == len(b"\x7fELF module bytes")


def test_reload_loads_the_copy_again_under_the_same_handle_before_anything_else(front):
    rec = _loaded_module(front)
    rec.core = 0
    (sub,) = front.h.reload(rec)
    job = sub.job
    assert isinstance(job.rec, jobs.LoadModule) and job.rec.handle == rec.handle
    assert (job.rec.buf, job.rec.size) == (rec.image.buf_id, rec.image.region.size)
    assert job.rec.ddr_free >= 1 << 62  # already accounted for in the pool
    assert (job.core, job.conn, job.req, job.bufs) == (0, None, None, [rec.image])
    assert job.priority == Handlers.RELOAD_PRIORITY > 255
    assert rec.generation is None  # not usable until it is back
    front.h.cores.generation = lambda i: 7 if i == 0 else None
    actions = job.on_done(jobs.Done(job.rec.job))
    assert rec.generation == 7 and front.st.modules[rec.handle] is rec
    assert actions == [Forget(bufs=[rec.image.buf_id])]


def test_a_reload_that_fails_kills_the_handle(front):
    rec = _loaded_module(front)
    image_buf = rec.image.buf_id
    job = front.h.reload(rec)[0].job
    actions = job.on_done(jobs.Done(job.rec.job, S.ERR_LOAD, "no longer loads"))
    assert rec.handle not in front.st.modules and actions == [Forget(bufs=[image_buf])]


def test_a_reload_of_something_unloaded_meanwhile_is_undone_on_the_core(front):
    rec = _loaded_module(front)
    image_buf = rec.image.buf_id
    job = front.h.reload(rec)[0].job
    front.st.modules.pop(rec.handle)
    forget, undo = job.on_done(jobs.Done(job.rec.job))
    assert forget == Forget(bufs=[image_buf])
    assert isinstance(undo, Notify) and undo.core == rec.core and undo.rec.handle == rec.handle
    assert isinstance(undo.rec, jobs.UnloadModule)
    job2 = front.h.reload(_loaded_module(front))[0].job
    front.st.modules.clear()
    assert len(job2.on_done(jobs.Done(job2.rec.job, S.ERR_LOAD, "x"))) == 1  # failed: nothing to undo


def test_weights_reload_as_weights(front):
    _staged(front, b"W" * 40)
    job = submitted(front(P.ModelLoad(weights_size=40)))
    (r,) = responses(job.on_done(jobs.Done(job.rec.job, value=jobs.WeightsLoaded(2, 64))))
    rec = front.st.models[r.model_id]
    re = front.h.reload(rec)[0].job
    assert isinstance(re.rec, jobs.LoadWeights) and (re.rec.model_id, re.rec.size) == (r.model_id, 40)
    assert re.rec.buf == rec.image.buf_id and re.bufs == [rec.image]
    front.st.models.pop(r.model_id)
    forget, undo = re.on_done(jobs.Done(re.rec.job))
    assert isinstance(undo.rec, jobs.UnloadWeights) and undo.rec.model_id == r.model_id
    rec2 = front.st.models.setdefault(rec.model_id, rec)
    re2 = front.h.reload(rec2)[0].job
    re2.on_done(jobs.Done(re2.rec.job, S.ERR_WEIGHTS, "bad"))
    assert rec.model_id not in front.st.models


def test_a_restarted_core_gets_every_op_library_again_in_handle_order(front):
    st = front.st
    for h, src in ((12, b"b = 2\n"), (5, b"a = 1\n")):
        st.modules[h] = ModuleRec(h, 0, 0, 0, "oplib")
        st.op_sources[h] = (src, f"<lib{h}>")
    st.op_table[0x3001] = ("x", 0, 12)
    subs = front.h.replay_ops(1)
    assert [s.job.rec.handle for s in subs] == [5, 12]
    j5, j12 = (s.job for s in subs)
    assert (j5.rec.source, j5.rec.filename, j5.core, j5.conn, j5.bufs) == (b"a = 1\n", "<lib5>", 1, None, [])
    assert j5.priority == Handlers.RELOAD_PRIORITY + 1 and j5.run_limit_s == Handlers.OPS_LOAD_LIMIT_S
    assert j5.on_done(jobs.Done(j5.rec.job)) == []
    (n,) = j12.on_done(jobs.Done(j12.rec.job, S.ERR_LOAD, "fails now"))
    assert isinstance(n.rec, jobs.UnloadOps) and n.rec.handle == 12
    assert 12 not in st.modules and 0x3001 not in st.op_table and 5 in st.modules
    st.modules.pop(5)
    assert j5.on_done(jobs.Done(j5.rec.job, S.ERR_LOAD, "gone already")) == []


@pytest.mark.parametrize("nofile,window,conn_bytes,want", [
    (1024, 512 * MiB, None, (256, 64, MAX_BUFS_PER_CONN, 448, 384 * MiB)),
    (16, 64 * MiB, None, (8, 2, MAX_BUFS_PER_CONN, MAX_BUFS_PER_CONN, 48 * MiB)),
    (1031, 1001, None, (257, 64, MAX_BUFS_PER_CONN, 451, 750)),  # whole numbers, rounded down
    (1 << 20, 64 * MiB, 0, (MAX_CONNS, MAX_CONNS // 4, MAX_BUFS_PER_CONN, (1 << 19) - 64, 0)),
])
def test_limits_follow_the_fd_limit(nofile, window, conn_bytes, want):
    lim = Limits.for_device(nofile, window, conn_bytes)
    assert (lim.conns, lim.conns_per_peer, lim.bufs_per_conn, lim.bufs_total, lim.conn_bytes) == want
    assert lim.nofile == nofile
    assert all(type(v) is int for v in (lim.conns, lim.conns_per_peer, lim.bufs_total, lim.conn_bytes))
