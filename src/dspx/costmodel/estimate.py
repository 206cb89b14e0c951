"""Board-time estimates for compiled modules and the LLM on an MMA profile (c7x-j722s).

Not a measurement: a first-principles model of each firmware kernel call,
labelled as an estimate wherever it is shown (issue 26, item 4).

The model, per kernel call (a conv, dense/gemm, pool, each node of an
offloaded onnx_subgraph, the LLM's GEMV/GEMM, attention, norms):

    cycles = max(compute, memory) + kernel_call_overhead_cycles
    compute = MACs / rate        rate: mma_int8_macs_per_cycle for int8 layers
                                       (conv/gemm/matmul of an int8 module, the LLM's
                                       linear layers), vector_fp32_macs_per_cycle
                                       (or mma_fp32_macs_per_cycle) for the rest
    memory  = DDR bytes / ddr_bandwidth_bytes_per_cycle

DDR bytes (the L2 rule, see ``ddr_bytes``): each layer reads its weights and
input from DDR and writes its output there once (nothing is assumed to stay
in L2 between layers).  Weights and input are read once each when the smaller
of the two fits in half of L2; otherwise the smaller is re-read once per
half-L2 chunk of the larger.

MACs and operations: conv N·M·Ho·Wo·(C/group)·kh·kw; gemm/matmul output
elements × K; pools output elements × window; global pools input elements;
any other operator one vector op per element of its largest tensor.  Reshape,
Flatten, Squeeze, Unsqueeze, Identity, Dropout, Constant, Shape cost nothing.
A conv/gemm swallows the bias Add, residual Add and Relu that follow it, as
the firmware kernels do (dspx.compiler.kernel_rewrite).

Left out: caches below L2 and MSMC, DMA/compute overlap beyond the max(),
layers kept in L2 from one call to the next, TIDL's layer fusion beyond the
above, the MMA's efficiency on small or odd shapes (taken as 100 %).

This module imports only the standard library (onnx lazily, inside
``onnx_layers``) so it can sit at the base layer beside the profiles.
"""
from __future__ import annotations

import logging
import math
import os
from dataclasses import asdict, dataclass
from typing import Collection, Mapping

from .profile import ProfileError, load

log = logging.getLogger(__name__)

ENV = "DSPX_COST_MODEL"
MMA_INT8 = "mma-int8"
VECTOR_FP32 = "vector-fp32"
#: the profile parameters an estimate needs (COST-SPEC names); the fp32 rate may be either name
NEEDED = ("clock_hz", "mma_int8_macs_per_cycle", "vector_fp32_macs_per_cycle", "l2_bytes",
          "ddr_bandwidth_bytes_per_cycle", "kernel_call_overhead_cycles")
FP32_ALIASES = ("vector_fp32_macs_per_cycle", "mma_fp32_macs_per_cycle")
#: the LLM's weights as the dspx package stores them (dspx.compiler.llm.weights)
Q4_1_BYTES = 20 / 32  # per weight: f16 d, f16 m, 16 bytes of nibbles per 32-weight block
Q8_0_BYTES = 34 / 32  # per weight: f16 d, 32 int8 per block


class EstimateError(ValueError):
    """The profile lacks what an estimate needs, or the model cannot be sized."""


@dataclass(frozen=True)
class Layer:
    """One kind of kernel call: what it computes and moves, per call."""
    name: str
    kernel: str
    unit: str  # MMA_INT8 or VECTOR_FP32
    macs: float
    weight_bytes: float
    in_bytes: float  # activations read: inputs, residual, the KV cache
    out_bytes: float  # activations written
    calls: int = 1


# ---------------------------------------------------------------- parameters

def rates(params: Mapping[str, float]) -> dict[str, float]:
    """The values an estimate uses, by COST-SPEC name; EstimateError names what is missing."""
    got = {k: params[k] for k in NEEDED if k in params}
    fp32 = next((params[k] for k in FP32_ALIASES if params.get(k)), None)  # c7x-j722s: mma_fp32 is 0
    if fp32 is not None:
        got["vector_fp32_macs_per_cycle"] = fp32
    missing = [k for k in NEEDED if k not in got]
    if missing:
        raise EstimateError(f"the cost profile lacks {', '.join(missing)} (an MMA profile such as "
                            "c7x-j722s has them)")
    return {k: float(got[k]) for k in NEEDED}


def requested(cost_model: str | None) -> str | None:
    """The cost model asked for: the argument, else ``$DSPX_COST_MODEL``, else None (off)."""
    return cost_model or os.environ.get(ENV) or None


def load_params(name_or_path: str) -> tuple[str, dict[str, float], dict[str, str]]:
    """(profile name, values, statuses) of the parameters an estimate needs,
    from dspx.costmodel.profile.load (a shipped name, a file, or JSON text)."""
    prof = load(name_or_path)
    have = [prof.params[k] for k in NEEDED + FP32_ALIASES[1:] if k in prof.params]
    return prof.name, {p.name: float(p.value) for p in have}, {p.name: p.status for p in have}


def when_requested(cost_model: str | None, make) -> dict | None:
    """``make(params, profile=, status=)`` under the profile asked for (see
    ``requested``), or None when no cost model is asked for.  A profile named
    by argument that cannot give an estimate raises EstimateError; one set only
    in ``$DSPX_COST_MODEL`` (which the device reads too, perhaps naming the
    j6-vision profile, which has no MMA) is logged and skipped."""
    name = requested(cost_model)
    if name is None:
        return None
    try:
        profile, params, status = load_params(name)
        return make(params, profile=profile, status=status)
    except (ProfileError, EstimateError) as e:
        if cost_model:  # a ProfileError names its profile or file already
            raise EstimateError(str(e) if isinstance(e, ProfileError) else f"cost model {name!r}: {e}") from None
        log.warning("no board-time estimate under %s=%s: %s", ENV, name, e)
        return None


# ---------------------------------------------------------------- the model

def ddr_bytes(weight_bytes: float, in_bytes: float, out_bytes: float, l2_bytes: float) -> float:
    """DDR traffic of one call under the L2 rule.  The output is written once.
    Of the two operands read (weights, input activations) the smaller stays in
    half of L2 while the larger streams through the other half, so each is read
    once; when the smaller does not fit in half of L2 either, it is re-read once
    per half-L2 chunk of the larger: ``larger + smaller × ceil(larger / (l2/2))``."""
    small, large = sorted((weight_bytes, in_bytes))
    half = l2_bytes / 2
    if small <= half:
        return out_bytes + weight_bytes + in_bytes
    return out_bytes + large + small * math.ceil(large / half)


def layer_row(layer: Layer, r: Mapping[str, float]) -> dict:
    """The estimate of one row (all its calls) under the rates ``r`` (see ``rates``)."""
    rate = r["mma_int8_macs_per_cycle"] if layer.unit == MMA_INT8 else r["vector_fp32_macs_per_cycle"]
    ddr = ddr_bytes(layer.weight_bytes, layer.in_bytes, layer.out_bytes, r["l2_bytes"])
    compute = layer.macs / rate
    memory = ddr / r["ddr_bandwidth_bytes_per_cycle"]
    overhead = r["kernel_call_overhead_cycles"]
    per_call = max(compute, memory) + overhead
    n = layer.calls
    return {**asdict(layer), "ddr_bytes": ddr * n, "compute_cycles": compute * n, "memory_cycles": memory * n,
            "overhead_cycles": overhead * n, "cycles": per_call * n,
            "bound": "compute" if compute >= memory else "memory"}


def estimate_layers(layers: list[Layer], params: Mapping[str, float], profile: str,
                    status: Mapping[str, str] | None = None) -> dict:
    """{profile, estimate: true, params, total_cycles, seconds, layers: rows} of a call sequence."""
    r = rates(params)
    rows = [layer_row(layer, r) for layer in layers]
    total = sum(row["cycles"] for row in rows)
    est = {"profile": profile, "estimate": True, "params": r, "total_cycles": total,
           "seconds": total / r["clock_hz"], "calls": sum(layer.calls for layer in layers), "layers": rows}
    if status:
        est["param_status"] = dict(status)
    return est


def reprice(est: dict, params: Mapping[str, float], profile: str, status: Mapping[str, str] | None = None) -> dict:
    """The same kernel calls (an estimate's rows) under other parameters."""
    fields = Layer.__dataclass_fields__
    layers = [Layer(**{k: row[k] for k in fields}) for row in est["layers"]]
    out = {k: v for k, v in est.items() if k != "param_status"}
    return dict(out, **estimate_layers(layers, params, profile, status))


def module_estimate(meta: Mapping, cost_model: str | None = None) -> dict | None:
    """What ``dspx run DIR --cost-model NAME`` / ``dspx info`` / ``dspx generate``
    show: the estimate a module's (or an LLM package's) metadata records,
    recomputed under NAME's parameters when given (the rows keep MACs and
    bytes, so no model is needed); for an LLM package without one, computed
    from its dims.  None when there is nothing to show: a module compiled
    without a cost model (compile it with one)."""
    est = meta.get("cost_estimate")
    if cost_model is None:
        return est
    profile, params, status = load_params(cost_model)
    if est is None and "model" in meta and "n_layers" in meta["model"]:
        return estimate_llm(meta["model"], params, profile=profile, status=status)
    if est is None:
        return None
    if "prefill" in est:
        return estimate_llm(est["model"], params, profile=profile, position=est["decode"]["position"],
                            status=status)
    return reprice(est, params, profile, status)


# ---------------------------------------------------------------- compiled ONNX modules

VIEWS = frozenset({"Reshape", "Flatten", "Squeeze", "Unsqueeze", "Identity", "Dropout", "Constant", "Shape"})
_KERNEL = {"MaxPool": "max_pool2d", "AveragePool": "avg_pool2d", "GlobalAveragePool": "global_avg_pool2d",
           "Softmax": "softmax", "LayerNormalization": "layernorm"}
QUANTIZED = frozenset({"Conv", "Gemm", "MatMul"})
WEIGHT_BYTES = {"float32": 4, "float16": 2, "int8": 1}


def _types(model) -> dict[str, tuple[tuple[int, ...] | None, int]]:
    """name -> (static shape or None, bytes per element) for every typed value."""
    import onnx
    from onnx import helper

    try:
        g = onnx.shape_inference.infer_shapes(model).graph
    except Exception as e:  # noqa: BLE001
        raise EstimateError(f"onnx shape inference failed: {e}") from None
    out = {}
    for vi in list(g.input) + list(g.value_info) + list(g.output):
        tt = vi.type.tensor_type
        dims = tuple(d.dim_value if d.HasField("dim_value") else 0 for d in tt.shape.dim)
        shape = dims if tt.HasField("shape") and all(dims) else None
        out[vi.name] = (shape, helper.tensor_dtype_to_np_dtype(tt.elem_type).itemsize)
    for init in g.initializer:
        out[init.name] = (tuple(init.dims), helper.tensor_dtype_to_np_dtype(init.data_type).itemsize)
    return out


class _Graph:
    """The nodes, static shapes, weights and consumers of a model."""

    def __init__(self, model):
        g = model.graph
        self.nodes = list(g.node)
        self.types = _types(model)
        self.weights = {i.name for i in g.initializer} | {o for n in g.node if n.op_type == "Constant"
                                                          for o in n.output}
        self.consumers: dict[str, list] = {}
        for n in self.nodes:
            for i in n.input:
                self.consumers.setdefault(i, []).append(n)
        self.graph_outputs = {o.name for o in g.output}

    def shape(self, name: str) -> tuple[int, ...]:
        shape = self.types.get(name, (None, 0))[0]
        if shape is None:
            raise EstimateError(f"tensor {name!r} has no static shape; give the inputs static shapes")
        return shape

    def elems(self, name: str) -> int:
        return math.prod(self.shape(name))

    def only_consumer(self, name: str, ops: tuple[str, ...]):
        users = self.consumers.get(name, [])
        if len(users) == 1 and users[0].op_type in ops and name not in self.graph_outputs:
            return users[0]
        return None


def _attr(node, name: str, default):
    a = next((a for a in node.attribute if a.name == name), None)
    if a is None:
        return default
    return list(a.ints) if a.type == a.INTS else a.i


def _macs(g: _Graph, node) -> float:
    op, ins, out = node.op_type, [i for i in node.input if i], node.output[0]
    if op == "Conv":
        w = g.shape(ins[1])  # (M, C/group, kh, kw)
        return g.elems(out) * math.prod(w[1:])
    if op == "Gemm":
        a = g.shape(ins[0])
        return g.elems(out) * (a[0] if _attr(node, "transA", 0) else a[-1])
    if op == "MatMul":
        return g.elems(out) * g.shape(ins[0])[-1]
    if op in ("MaxPool", "AveragePool"):
        return g.elems(out) * math.prod(_attr(node, "kernel_shape", [1]))
    if op in ("GlobalAveragePool", "GlobalMaxPool"):
        return g.elems(ins[0])
    return max([g.elems(out)] + [g.elems(i) for i in ins if i not in g.weights])


def _fuse(g: _Graph, node, ready: set[str]) -> tuple[list, str | None]:
    """The Add (bias or residual) and Relu nodes a conv/gemm call swallows, and
    the residual input (None without one).  A residual must be ``ready`` (made
    by an earlier call or a graph input): of a block's two convs meeting in one
    Add, the later one takes it, as in kernel_rewrite."""
    swallowed, residual, last = [], None, node.output[0]
    for _ in range(2):
        add = g.only_consumer(last, ("Add",))
        if add is None:
            break
        other = add.input[1] if add.input[0] == last else add.input[0]
        if other not in g.weights:
            if residual is not None or node.op_type != "Conv" or other not in ready:
                break
            residual = other
        swallowed.append(add)
        last = add.output[0]
    relu = g.only_consumer(last, ("Relu",))
    if relu is not None:
        swallowed.append(relu)
    return swallowed, residual


def onnx_layers(model, *, quantize: str | None = None, weights: str = "float32", kernels: bool = True,
                offloaded: Collection[str] = ()) -> list[Layer]:
    """The kernel calls of a compiled ONNX model (its nodes after the compiler's
    rewrites: BatchNorm folded, Sum as Add), in graph order.

    quantize "int8": Conv/Gemm/MatMul with a constant weight run on the MMA with
    1-byte weights, and every activation is 1 byte (an int8 deployment keeps
    them so); weights: the stored precision of weight tensors; offloaded: first
    outputs of the nodes in the onnx_subgraph call (their rows say so)."""
    g = _Graph(model)
    act = 1 if quantize else 4
    offloaded = set(offloaded)
    done: set[int] = set()
    ready = {i.name for i in model.graph.input} | g.weights
    layers = []
    for node in g.nodes:
        if id(node) in done:
            continue
        ready.update(node.output)
        if node.op_type in VIEWS:
            continue
        swallowed, residual = _fuse(g, node, ready) if node.op_type in ("Conv", "Gemm", "MatMul") else ([], None)
        done.update(id(n) for n in swallowed)
        ready.update(o for n in swallowed for o in n.output)
        out = (swallowed[-1] if swallowed else node).output[0]
        ins = [i for i in node.input if i]
        w = [i for i in ins if i in g.weights] + [i for n in swallowed for i in n.input if i in g.weights]
        a = [i for i in ins if i not in g.weights] + ([residual] if residual else [])
        int8 = bool(quantize) and node.op_type in QUANTIZED and len(ins) > 1 and ins[1] in g.weights
        wb = 1 if int8 else WEIGHT_BYTES[weights]  # the main weight; biases and the rest stay float32
        weight_bytes = sum(g.elems(i) * (wb if j == 0 else 4) for j, i in enumerate(w))
        kernel = _kernel_name(node, residual, int8, kernels, node.output[0] in offloaded,
                              len(ins) > 1 and ins[1] in g.weights)
        layers.append(Layer(node.name or node.output[0], kernel,
                            MMA_INT8 if int8 else VECTOR_FP32, float(_macs(g, node)), float(weight_bytes),
                            float(sum(g.elems(i) for i in a) * act), float(g.elems(out) * act)))
    return layers


def _kernel_name(node, residual, int8: bool, kernels: bool, offloaded: bool, const_weight: bool) -> str:
    op = node.op_type
    if offloaded:
        return "onnx_subgraph:" + op
    if not kernels:
        return "tvm:" + op
    if op == "Conv":
        name = "conv2d_add" if residual else "conv2d"
    elif op in ("Gemm", "MatMul"):
        name = "dense" if op == "Gemm" or const_weight else "matmul"
    else:
        return _KERNEL.get(op, "tvm:" + op)
    return name + "_q8" if int8 else name


def estimate_onnx(model, params: Mapping[str, float], *, profile: str, quantize: str | None = None,
                  weights: str = "float32", kernels: bool = True, offloaded: Collection[str] = (),
                  status: Mapping[str, str] | None = None) -> dict:
    """The static estimate ``dspx compile`` records in metadata.json ("cost_estimate").
    ``model``: an onnx.ModelProto or a path to one."""
    if not hasattr(model, "graph"):
        import onnx

        model = onnx.load(str(model))
    est = estimate_layers(onnx_layers(model, quantize=quantize, weights=weights, kernels=kernels,
                                      offloaded=offloaded), params, profile, status)
    est["precision"] = quantize or "float32"
    return est


# ---------------------------------------------------------------- the LLM

def _dim(dims, key: str):
    return dims[key] if isinstance(dims, Mapping) else getattr(dims, key)


def llm_layers(dims, tokens: int, position: int, *, linear_bytes: float = Q4_1_BYTES,
               head_bytes: float = Q8_0_BYTES) -> list[Layer]:
    """The kernel calls of one LLM call on ``tokens`` tokens whose first sits at
    ``position`` (decode: tokens=1; prefill: tokens=chunk).  ``dims``: a
    dspx.compiler.llm.sizing.Dims or its dict (the LLM metadata's "model").

    Per layer: attn_norm, qkv, attention (RoPE, KV append, causal attention over
    the cache, float32 on the vector unit), o_proj, ffn_norm, gate_up, down
    (SiLU-gate and residual adds fused); then the final norm and the LM head.
    Linear layers run on the MMA (activations quantized to 8 bits, as llama.cpp's
    Q8 activations) from their stored Q4_1 / Q8_0 bytes; the embedding lookup
    (``tokens`` rows) is left out."""
    L, dim, heads, n_kv, hd, ffn, vocab = (int(_dim(dims, k)) for k in
                                           ("n_layers", "dim", "n_heads", "n_kv", "head_dim", "ffn", "vocab"))
    qkv = (heads + 2 * n_kv) * hd
    kv_elem = {"float32": 4, "float16": 2, "int8": 1}[_dim(dims, "kv_dtype")]
    M, f = tokens, 4  # float32 activations between calls

    def linear(name, k, n, wb=linear_bytes, calls=L):
        return Layer(name, "gemv" if M == 1 else "gemm", MMA_INT8, float(M * k * n), k * n * wb,
                     float(M * k * f), float(M * n * f), calls)

    def norm(name, calls=L):
        return Layer(name, "rmsnorm", VECTOR_FP32, float(M * dim), float(dim * f), float(M * dim * f),
                     float(M * dim * f), calls)

    cached = position + M  # positions the attention reads after the append
    scores = M * position + M * (M + 1) // 2  # sum over the tokens of the positions each attends to
    kv_read = 2 * n_kv * cached * hd * kv_elem
    attention = Layer("attention", "attention", VECTOR_FP32, float(2 * heads * hd * scores), 0.0,
                      float(kv_read + M * qkv * f), float(M * dim * f + 2 * M * n_kv * hd * kv_elem), L)
    return [norm("attn_norm"), linear("qkv", dim, qkv), attention, linear("o_proj", dim, dim),
            norm("ffn_norm"), linear("gate_up", dim, 2 * ffn), linear("down", ffn, dim),
            norm("final_norm", 1), linear("lm_head", dim, vocab, head_bytes, 1)]


def estimate_llm(dims, params: Mapping[str, float], *, profile: str, position: int | None = None,
                 status: Mapping[str, str] | None = None) -> dict:
    """Prefill and decode estimates of the LLM (``dspx generate``, the LLM metadata).

    prefill: one chunk (``dims.chunk`` tokens) from position 0, tok/s = chunk /
    its seconds (bound by MACs on the MMA); decode: one token at ``position``
    (default: one chunk into the context), tok/s = 1 / its seconds (bound by the
    weight bytes per token over DDR bandwidth)."""
    chunk = int(_dim(dims, "chunk"))
    position = chunk if position is None else int(position)
    prefill = estimate_layers(llm_layers(dims, chunk, 0), params, profile, status)
    prefill.update(tokens=chunk, position=0, tok_per_s=chunk / prefill["seconds"])
    decode = estimate_layers(llm_layers(dims, 1, position), params, profile, status)
    decode.update(tokens=1, position=position, tok_per_s=1 / decode["seconds"],
                  weight_bytes_per_token=sum(row["weight_bytes"] * row["calls"] for row in decode["layers"]))
    keys = ("n_layers", "dim", "n_heads", "n_kv", "head_dim", "ffn", "vocab", "chunk", "kv_dtype")
    return {"profile": profile, "estimate": True, "params": decode["params"],
            "model": {k: _dim(dims, k) for k in keys}, "prefill": prefill, "decode": decode,
            **({"param_status": dict(status)} if status else {})}


# ---------------------------------------------------------------- showing it

_PARAM_LABEL = {"clock_hz": ("clock", "Hz"), "mma_int8_macs_per_cycle": ("MMA int8", "MAC/cycle"),
                "vector_fp32_macs_per_cycle": ("vector fp32", "MAC/cycle"), "l2_bytes": ("L2", "bytes"),
                "ddr_bandwidth_bytes_per_cycle": ("DDR", "B/cycle"),
                "kernel_call_overhead_cycles": ("per call", "cycles")}


def _n(v: float) -> str:
    return f"{v:,.0f}" if abs(v) >= 10 or v == int(v) else f"{v:.3g}"


def assumed_line(est: dict) -> str:
    """"assumed: …" — every parameter the estimate used, with its status when known."""
    status = est.get("param_status", {})
    parts = [f"{label} {_n(est['params'][k])} {unit}" + (f" ({status[k]})" if k in status else "")
             for k, (label, unit) in _PARAM_LABEL.items()]
    return "  assumed: " + ", ".join(parts)


def _table(est: dict) -> list[str]:
    head = f"  {'layer':<24} {'kernel':<22} {'unit':<11} {'calls':>5} {'MACs':>15} {'DDR bytes':>13} " \
           f"{'compute':>12} {'memory':>12} {'overhead':>10} {'est. cycles':>13}  bound"
    lines = [head]
    for r in est["layers"]:
        lines.append(f"  {r['name'][:24]:<24} {r['kernel'][:22]:<22} {r['unit']:<11} {r['calls']:>5} "
                     f"{_n(r['macs']):>15} {_n(r['ddr_bytes']):>13} {_n(r['compute_cycles']):>12} "
                     f"{_n(r['memory_cycles']):>12} {_n(r['overhead_cycles']):>10} {_n(r['cycles']):>13}  "
                     f"{r['bound']}")
    return lines


def _total(est: dict, what: str) -> str:
    return (f"  {what} (estimate): {_n(est['total_cycles'])} cycles = {est['seconds'] * 1e3:.3f} ms "
            f"at {est['params']['clock_hz'] / 1e9:.3g} GHz, {est['calls']} kernel calls")


def format_estimate(est: dict) -> str:
    """A readable table of a module estimate (``estimate_onnx``) or an LLM
    estimate (``estimate_llm``): every figure is labelled an estimate, with
    the profile's name and the parameters assumed."""
    title = (f"ESTIMATE on {est['profile']} (a first-principles model of the board, not a measurement; "
             "max(compute, memory) + per-call overhead per kernel call)")
    lines = [title, assumed_line(est)]
    if "prefill" in est:
        p, d = est["prefill"], est["decode"]
        lines += [f"  estimated prefill: {p['tok_per_s']:,.1f} tok/s ({p['tokens']} tokens per call)",
                  f"  estimated decode:  {d['tok_per_s']:,.1f} tok/s (at position {d['position']}; "
                  f"{_n(d['weight_bytes_per_token'])} weight bytes per token)", "  decode, one token:"]
        lines += _table(d) + [_total(d, "decode token"), "  prefill, one chunk:"] + _table(p)
        lines.append(_total(p, "prefill chunk"))
    else:
        lines += _table(est) + [_total(est, f"estimated board latency ({est.get('precision', 'float32')})")]
    return "\n".join(lines)
