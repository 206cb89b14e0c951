"""The Relax entry: ``main`` is one forward pass over M tokens, every
operator a call of a TIR kernel (``tir``), the KV append in place on the
KV inputs, which the entry returns as its KV outputs.  Each row carries its
position and its slot's base (the first cache position of the slot it
belongs to: 0 with one slot), so one call can serve rows of several slots."""
from __future__ import annotations

import numpy as np

from .sizing import Dims
from .tir import kernels


def entry(d: Dims, M: int, weights: list[tuple[str, np.ndarray]], parallel_gemv: bool, batch: bool = False,
          tile: tuple[int, int] | None = None, *, lanes: int, vnni: int = 0):
    """IRModule whose ``main`` is one forward pass over M tokens (``batch``:
    M decode rows, each a GEMV of its own, every real row's logits), its
    prefill GEMMs on register micro-tiles of ``tile`` (rows, outputs), its
    decode GEMVs sliced for vectors of ``lanes`` float32 (``vnni``: their int8 block sums on vpdpbusd of that many lanes)."""
    from tvm import relax

    def ty(shape, dtype):
        return relax.TensorType(shape, dtype)

    ks = kernels(d, M, parallel_gemv, batch, tile, lanes=lanes, vnni=vnni)
    bb = relax.BlockBuilder()
    gv = {name: bb.add_func(f, name) for name, f in ks.items()}
    ids = relax.Var("ids", ty((1, M), "int64"))
    pos = relax.Var("positions", ty((1, M), "int64"))
    bases = relax.Var("bases", ty((1, M), "int64"))
    kv = []
    for i in range(d.n_layers):
        kv += [relax.Var(f"k{i}", ty(d.kv_shape, d.kv_dtype)), relax.Var(f"v{i}", ty(d.kv_shape, d.kv_dtype))]
    wv = {n: relax.Var(n.replace(".", "_"), ty(a.shape, str(a.dtype))) for n, a in weights}
    params = [ids, pos, bases] + kv + list(wv.values())
    xd = ty((M, d.dim), "float32")
    P = [pos] if M > 1 else []  # prefill GEMMs skip the padding rows
    with bb.function("main", params):
        with bb.dataflow():
            x = bb.emit(relax.call_tir(gv["embed"], [ids, wv["token_embd.q"], wv["token_embd.d"]], xd))
            new_kv = []
            for i in range(d.n_layers):
                b = f"blk.{i}."
                h = bb.emit(relax.call_tir(gv["rmsnorm"], [x, wv[b + "attn_norm"]], xd))
                qkv = bb.emit(relax.call_tir(gv["gemv_qkv"], [h, *P, wv[b + "qkv.q"], wv[b + "qkv.d"], wv[b + "qkv.m"],
                                                                zeros_of(bb, relax, M, d.qkv, "zq")],
                                             ty((M, d.qkv), "float32")))
                kvo = bb.emit(relax.call_tir_inplace(
                    gv["kv_write"], [qkv, pos, bases, wv["rope.cos"], wv["rope.sin"], kv[2 * i], kv[2 * i + 1]],
                    [5, 6], [ty(d.kv_shape, d.kv_dtype), ty(d.kv_shape, d.kv_dtype)]))
                kc = bb.emit(relax.TupleGetItem(kvo, 0))
                vc = bb.emit(relax.TupleGetItem(kvo, 1))
                new_kv += [kc, vc]
                att = bb.emit(relax.call_tir(gv["attention"], [qkv, pos, bases, wv["rope.cos"], wv["rope.sin"], kc, vc],
                                             xd))
                x = bb.emit(relax.call_tir(gv["gemv_o"], [att, *P, wv[b + "o.q"], wv[b + "o.d"], wv[b + "o.m"], x], xd))
                h = bb.emit(relax.call_tir(gv["rmsnorm"], [x, wv[b + "ffn_norm"]], xd))
                gu = bb.emit(relax.call_tir(gv["gemv_gate_up"], [h, *P, wv[b + "gate_up.q"], wv[b + "gate_up.d"],
                                                                    wv[b + "gate_up.m"],
                                                                    zeros_of(bb, relax, M, 2 * d.ffn, "zf")],
                                            ty((M, 2 * d.ffn), "float32")))
                a = bb.emit(relax.call_tir(gv["silu_mul"], [gu], ty((M, d.ffn), "float32")))
                x = bb.emit(relax.call_tir(gv["gemv_down"], [a, *P, wv[b + "down.q"], wv[b + "down.d"], wv[b + "down.m"], x],
                                           xd))
            h = bb.emit(relax.call_tir(gv["rmsnorm"], [x, wv["output_norm"]], xd))
            hq, hd = ("output.q", "output.d") if "output.q" in wv else ("token_embd.q", "token_embd.d")
            logits = bb.emit(relax.call_tir(gv["lm_head"], [h, *P, wv[hq], wv[hd]], ty((1, M, d.vocab), "float32")))
            out = bb.emit_output(relax.Tuple([logits] + new_kv))
        bb.emit_func_output(out)
    return bb.get()


def zeros_of(bb, relax, M, N, name):
    """A zero residual for the GEMVs without one (a module constant, 4·M·N bytes)."""
    return relax.const(np.zeros((M, N), np.float32))
