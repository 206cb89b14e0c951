"""Who may unload an op library (docs/protocol.md, OPS_LOAD): a device-wide
one (what `dspx load-ops` loads) any connection of its uid, also once the
connection that loaded it has closed; a connection's own library only that
connection: another's DYN_UNLOAD is ERR_HANDLE naming the process that holds
it, and nothing changes."""
from __future__ import annotations

from dspx.abi import protocol as P
from dspx.abi.protocol import Status as S
from dspx.device import jobs
from dspx.device.front.actions import Notify
from dspx.device.front.state import Conn, ModuleRec
from front_harness import Front, responses


def _library(front: Front, cid: int, shared_uid: int | None = None) -> int:
    h = front.st.new_id()
    front.st.modules[h] = ModuleRec(h, cid, 0, 0, "oplib", shared_uid=shared_uid)
    front.st.op_table[0x3001] = ("spin", 0, h)
    front.st.op_sources[h] = (b"src", "<oplib>")
    return h


def test_a_device_wide_library_whose_connection_closed_is_unloaded_by_a_connection_of_its_uid():
    front = Front()
    gone = front.st.new_id()  # a connection that loaded it and has closed: no longer in st.conns
    h = _library(front, gone, shared_uid=front.conn.uid)
    actions = front(P.DynUnload(seq=5, module_handle=h))
    (r,) = responses(actions)
    assert (r.status, r.seq) == (0, 5)
    assert [a.rec for a in actions if isinstance(a, Notify)] == [jobs.UnloadOps(handle=h)]  # every core
    assert 0x3001 not in front.st.op_table and h not in front.st.modules and h not in front.st.op_sources


def test_a_library_of_an_open_connection_is_err_handle_naming_its_process():
    front = Front()
    owner = Conn(front.st.new_id(), None, 0, pid=4321)
    front.st.conns[owner.cid] = owner
    h = _library(front, owner.cid)
    actions = front(P.DynUnload(module_handle=h))
    (r,) = responses(actions)
    assert r.status == S.ERR_HANDLE and not any(isinstance(a, Notify) for a in actions)
    assert "process 4321" in front.conn.last_error[2] and "device-wide" in front.conn.last_error[2]
    assert front.st.op_table[0x3001] == ("spin", 0, h) and h in front.st.modules
