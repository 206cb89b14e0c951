"""Isolation: a client that forges the DSP address of another client's
buffers, of another connection's staging or KV region, or of device-private
memory (DDR pool, L2) gets ERR_ADDR for every message that carries an
address — and the other client's memory is neither read nor written.
(The socket refuses other uids: tests/device/front/test_service.py::test_other_uid_is_refused.)"""
from __future__ import annotations

import textwrap

import numpy as np
import pytest

from dspx.abi import layout
from dspx import memory
from dspx.abi import protocol as P
from dspx.errors import BadAddress
from dspx.host.client import Client
from dspx.host.tasks import Tasks
from conftest import Device

PEEK = 0x3B01
OPS = textwrap.dedent("""
    import numpy as np
    from dspx.device.core import runtime as rt

    @rt.register_op(0x3B01)
    def peek(inp, out, tm):
        addr, n = np.frombuffer(inp, np.uint64, count=2)
        src = rt.mem_map(int(addr), int(n))
        out[:int(n)] = src
        src[:] = 0xEE  # would scribble on whatever it mapped
        return 0
""")
PATTERN = bytes(range(256)) * 16


@pytest.fixture(scope="module")
def world(compiled):
    dev = Device("--carveout-size", "64M", "--ddr-pool-size", "64M")
    so = (compiled("multi_output") / "model.so").read_bytes()
    so_large = (compiled("multi_input") / "model.so").read_bytes()
    owner = Client(dev.path, staging_size=1 << 20, kv_size=1 << 16, timeout=20)
    attacker = Client(dev.path, staging_size=1 << 20, kv_size=1 << 16, timeout=20)
    owner_mod = owner.load_module(so)
    secret = owner.alloc(len(PATTERN), "secret")
    secret.mm[:] = PATTERN
    owner.staging.mm[:4096] = PATTERN
    owner.kv_view(0, (4096,), np.uint8)[:] = np.frombuffer(PATTERN, np.uint8)
    mod = attacker.load_module(so)
    mod_large = attacker.load_module(so_large)
    tasks = Tasks(client=attacker)
    tasks.load_ops(OPS)
    kv_owner = owner.staging.dsp_addr + owner.staging.size - owner.kv_size
    targets = {
        "other's buffer": secret.dsp_addr,
        "other's buffer, middle": secret.dsp_addr + 1024,
        "other's buffer, last bytes": secret.dsp_addr + secret.size - 64,
        "other's staging": owner.staging.dsp_addr,
        "other's KV region": kv_owner,
        "other's input_buf": owner.input_buf.dsp_addr,
        "other's output_buf": owner.output_buf.dsp_addr,
        "other's printf ring": owner.printf_buf.dsp_addr,
        "DDR pool": memory.DDR_POOL_BASE,
        "DDR pool, inside": memory.DDR_POOL_BASE + (1 << 20),
        "L2 SRAM": memory.L2_BASE,
        "outside the window": memory.CARVEOUT_BASE + (64 << 20),
        "null": 0,
        "top of the 64-bit space": 2**64 - 64,
    }
    yield dict(dev=dev, owner=owner, attacker=attacker, mod=mod, mod_large=mod_large, tasks=tasks,
               secret=secret, targets=targets, owner_mod=owner_mod, kv_owner=kv_owner)
    attacker.close()
    owner.close()
    dev.stop()


def _infer(w, **kw):
    a = w["attacker"]
    ib, ob = a.input_buf, a.output_buf
    desc = P.TensorDesc.for_array(ib.dsp_addr + 256, (2, 32), "float32")
    fields = dict(module_handle=w["mod"].handle, num_inputs=1, input_dsp_addr=ib.dsp_addr, input_size=ib.size,
                  result_dsp_addr=ob.dsp_addr, result_size=ob.size, descs=[desc])
    fields.update(kw)
    return P.Infer(**fields)


def forged_requests(w, addr):
    """Every message that carries a DSP address, with ``addr`` in it."""
    a, t = w["attacker"], w["tasks"]
    ib = a.input_buf
    desc = P.TensorDesc.for_array(addr, (2, 32), "float32")
    yield "INFER input range", _infer(w, input_dsp_addr=addr, input_size=1024,
                                      descs=[P.TensorDesc.for_array(addr, (2, 32), "float32")])
    yield "INFER result range", _infer(w, result_dsp_addr=addr, result_size=4096)
    yield "INFER descriptor data", _infer(w, descs=[desc])
    a.input_buf.mm[:560] = bytes(560)
    yield "INFER_LARGE descs_addr", P.InferLarge(module_handle=w["mod_large"].handle, num_inputs=7,
                                                 descs_addr=addr, descs_size=560, input_dsp_addr=ib.dsp_addr,
                                                 input_size=ib.size, result_dsp_addr=a.output_buf.dsp_addr,
                                                 result_size=a.output_buf.size)
    yield "SET_PRINTF_BUF", P.SetPrintfBuf(printf_dsp_addr=addr, printf_size=4096)
    yield "BUF_DETACH", P.BufDetach(dsp_addr=addr)
    mine = t.malloc(64)
    yield "RPC input", P.Rpc(cmd=0x1402, input_dsp_addr=addr, input_size=13, output_dsp_addr=mine.phy,
                             output_size=64)
    yield "RPC output", P.Rpc(cmd=0x1402, input_dsp_addr=mine.phy, input_size=13, output_dsp_addr=addr,
                              output_size=64)
    yield "OPS_LOAD src", P.OpsLoad(src_dsp_addr=addr, src_size=64)


def test_every_address_carrying_message_refuses_forged_addresses(world):
    w = world
    refused = []
    for name, addr in w["targets"].items():
        for what, req in forged_requests(w, addr):
            with pytest.raises(BadAddress) as e:
                w["attacker"].request(req)
            assert e.value.status == P.Status.ERR_ADDR, (name, what)
            refused.append((name, what))
    assert len(refused) == len(w["targets"]) * 9


def test_mem_map_inside_an_op_refuses_forged_addresses(world):
    w, t = world, world["tasks"]
    inp, out = t.malloc(16), t.malloc(4096)
    for name, addr in w["targets"].items():
        inp.view(np.uint64)[:] = [addr, 64]
        with pytest.raises(BadAddress, match="ERR_ADDR"):
            t.run(PEEK, inp, out)
        assert not out.vir.any(), name  # nothing was copied out
    # Positive control: its own buffer maps fine.
    own = t.malloc(64)
    own.vir[:] = 7
    inp.view(np.uint64)[:] = [own.phy, 64]
    t.run(PEEK, inp, out)
    assert (out.vir[:64] == 7).all()


def test_overflowing_ranges_are_refused(world):
    """Ranges that start inside the attacker's own buffer but wrap 2^64 or run past its end."""
    a = world["attacker"]
    b = a.alloc(4096)
    for addr, size in [(b.dsp_addr, 2**64 - 1), (b.dsp_addr + 4095, 2), (b.dsp_addr, 4097),
                       (b.dsp_addr + 16, 2**64 - 16), (2**64 - 1, 2)]:
        with pytest.raises(BadAddress):
            a.request(P.SetPrintfBuf(printf_dsp_addr=addr, printf_size=max(size & 0xFFFFFFFF, 64)))
        with pytest.raises(BadAddress):
            a.request(P.Rpc(cmd=0x1402, input_dsp_addr=addr, input_size=size, output_dsp_addr=b.dsp_addr,
                            output_size=64))
        with pytest.raises(BadAddress):
            a.request(_infer(world, input_dsp_addr=addr, input_size=size))


def test_the_owner_is_untouched_and_own_kv_region_is_allowed(world):
    w = world
    owner, a = w["owner"], w["attacker"]
    test_every_address_carrying_message_refuses_forged_addresses(w)
    assert bytes(w["secret"].mm[:]) == PATTERN
    assert bytes(owner.staging.mm[:4096]) == PATTERN
    assert owner.kv_view(0, (4096,), np.uint8).tobytes() == PATTERN
    hdr = np.frombuffer(owner.printf_buf.mm, np.uint32, 4)
    assert hdr[0] == layout.PRINTF_MAGIC
    x = np.ones((2, 32), np.float32)
    assert len(owner.infer(w["owner_mod"].handle, [x]).descs) == 7
    # The attacker's *own* KV region is a legal input.
    a.kv_view(0, (2, 32), np.float32)[:] = 1
    kv = a.staging.dsp_addr + a.staging.size - a.kv_size
    r = a.request(_infer(w, descs=[P.TensorDesc.for_array(kv, (2, 32), "float32")]))
    assert r.status == 0 and r.num_outputs == 7
    # ... but the owner's KV region is not, even with KV_RESIDENT.
    with pytest.raises(BadAddress):
        a.request(_infer(w, flags=P.FLAG_KV_RESIDENT,
                         descs=[P.TensorDesc.for_array(w["kv_owner"], (2, 32), "float32")]))
