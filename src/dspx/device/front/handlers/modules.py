"""DYN_LOAD, DYN_UNLOAD, MODEL_LOAD and MODEL_UNLOAD, and the reloads after a
core restart: compiled modules and their weights, kept on core 0."""
from __future__ import annotations

from ....abi import protocol as P
from ....abi.protocol import Status as S
from ... import jobs
from ..actions import Forget, FrontJob, NoRoom, Notify, Respond, RespondTo, Submit
from ..state import Buffer, Conn, Cores, DeviceState, ModelRec, ModuleRec, Reject

INFERENCE_CORE = 0  # compiled modules and their weights live on core 0


class ModuleHandlers:
    """Modules and weights (a part of ``Handlers``: ``invalidate`` is the
    calls', ``_load_ops`` and ``unload_ops`` the op libraries')."""
    st: DeviceState
    cores: Cores

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
                raise NoRoom(Notify(core, jobs.UnloadModule(handle=handle)), e) from None
            if not ddr.take(need):
                raise NoRoom(Notify(core, jobs.UnloadModule(handle=handle)),
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
        # an op library's owner unloads it (any connection of the uid, for a
        # device-wide one); another connection's is ERR_HANDLE, naming the holder
        if rec is not None and rec.kind == "oplib":
            if self.may_unload(conn, rec):
                return self.unload_ops(rec) + [Respond(P.DynUnloadResp(seq=req.seq))]
            owner = self.st.conns.get(rec.cid)
            if owner is not None:
                raise Reject(S.ERR_HANDLE, f"op library {rec.handle} belongs to a connection of process {owner.pid}: "
                                           f"only that connection unloads it (or load it device-wide)")
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
        return [Submit(FrontJob(core_rec, None, req, rec.core, [], lambda res: [RespondTo(conn, resp)]))]

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
                raise NoRoom(Notify(core, jobs.UnloadWeights(model_id=model_id)), e) from None
            if not ddr.take(v.nbytes):
                raise NoRoom(Notify(core, jobs.UnloadWeights(model_id=model_id)),
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
