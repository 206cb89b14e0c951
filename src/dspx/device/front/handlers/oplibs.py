"""OPS_LOAD, OPS_LIST: custom operator libraries, loaded on every core."""
from __future__ import annotations

from ....abi import protocol as P
from ....abi.protocol import Status as S
from ... import jobs
from ..actions import FrontJob, Notify, Respond, RespondTo, Submit
from ..state import MAX_OPLIB_SOURCE, Cores, DeviceState, ModuleRec, Reject


class OpLibHandlers:
    """Op libraries (a part of ``Handlers``: ``RELOAD_PRIORITY`` is the modules')."""
    st: DeviceState
    cores: Cores
    job_timeout_s: float

    def h_ops_load(self, conn, req, fds):
        if req.flags & ~P.OPS_LOAD_DEVICE_WIDE or req.reserved:
            raise Reject(S.ERR_INVALID, f"unknown OPS_LOAD flags 0x{req.flags:x} or reserved {req.reserved} "
                                        "(only bit 0, device-wide, is defined; reserved must be zero)")
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

    # Ownership: a library is its connection's — only that one unloads it, and
    # it goes when that one closes (also when it closed during the load) —
    # unless OPS_LOAD asked for a device-wide one: that stays until any
    # connection of the same uid unloads it or the device stops.
    def _load_ops(self, conn, req, source: bytes, filename: str) -> list:
        device_wide = isinstance(req, P.OpsLoad) and bool(req.flags & P.OPS_LOAD_DEVICE_WIDE)
        if len(source) > MAX_OPLIB_SOURCE:
            raise Reject(S.ERR_SIZE, f"op library of {len(source)} bytes (1..{MAX_OPLIB_SOURCE})")
        handle = self.st.new_id()
        results: dict[int, jobs.Done] = {}
        limit = min(self.OPS_LOAD_LIMIT_S, self.job_timeout_s or self.OPS_LOAD_LIMIT_S)

        def finished() -> list:
            undo = [Notify(j, jobs.UnloadOps(handle=handle)) for j, d in results.items() if d.status == S.SUCCESS]
            if conn.closed and not device_wide:
                return undo  # its owner is gone: nobody could unload it
            bad = [(i, r) for i, r in sorted(results.items()) if r.status != S.SUCCESS]
            if bad:
                i, r = bad[0]
                e = Reject(r.status, f"core {i}: {r.error}", error_line=r.numbers.get("error_line", 0))
                conn.last_error = (req.seq, int(e.status), str(e))
                return undo + [RespondTo(conn, P.failure(req, e.status, **e.numbers))]
            ops = results[0].value.ops
            self.st.op_sources[handle] = (source, filename)
            self.st.modules[handle] = ModuleRec(handle, conn.cid, 0, 0, "oplib",
                                                shared_uid=conn.uid if device_wide else None)
            if not device_wide:
                conn.oplibs.add(handle)
            for cmd, name, lat in ops:
                self.st.op_table[cmd] = (name, lat, handle)
            resp = (P.DynLoadResp(seq=req.seq, module_handle=handle) if isinstance(req, P.DynLoad)
                    else P.OpsLoadResp(seq=req.seq, lib_handle=handle, num_ops=len(ops)))
            return [RespondTo(conn, resp)]

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

    @staticmethod
    def may_unload(conn, rec: ModuleRec) -> bool:
        """Whether ``conn`` may unload op library ``rec``: its owner's, or any of the uid of a device-wide one."""
        return rec.cid == conn.cid or (rec.shared_uid is not None and rec.shared_uid == conn.uid)

    def unload_ops(self, rec: ModuleRec) -> list:
        owner = self.st.conns.get(rec.cid)
        if owner is not None:
            owner.oplibs.discard(rec.handle)
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
