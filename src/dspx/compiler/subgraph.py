"""Hand a maximal run of supported operators to ONE firmware kernel call.

As TIDL and TVM's BYOC do with subgraphs: the longest prefix of the ONNX graph
made of SUBGRAPH_OPS (convolutions, pooling, elementwise, the classifier…),
fed only by the graph's inputs, becomes one ``dspx.kernels.onnx_subgraph``
call.  The call carries the subgraph as a serialized ONNX model (a uint8
constant, no weights in it) and its weights as tensor arguments (module
constants, or weights-file parameters with separate weights), so the device
runs it as one onnxruntime session with prepacked weights and one thread pool:
no per-operator session runs, pool wake-ups or NCHWc reorders between
operators.  What follows the first unsupported operator stays TVM code (and
op-by-op kernels) after the call.  See docs/kernels.md, "Subgraphs".

On by default: on a quiet machine it made ResNet-18, ResNet-50 and ShuffleNet
1.5x, 1.2x and 1.7x faster on the device than op by op (docs/performance.md).
``dspx compile --op-by-op``, ``compile_onnx(..., subgraph=False)`` or
``DSPX_SUBGRAPH=0`` turns it off.
"""
from __future__ import annotations

import collections
import logging
import os
from dataclasses import dataclass, field

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from dspx.abi.kernels import PREFIX, SUBGRAPH_OPS, SUBGRAPH_WEIGHTS_KEY
from dspx.compiler.weights import MIN_WEIGHT_ELEMENTS

log = logging.getLogger(__name__)

KERNEL = PREFIX + "onnx_subgraph"
#: operators that make a subgraph worth a call (one of them at least)
HEAVY_OPS = frozenset({"Conv", "Gemm", "MatMul"})


def enabled_by_default() -> bool:
    return os.environ.get("DSPX_SUBGRAPH", "1") != "0"


@dataclass
class Partition:
    model: onnx.ModelProto  # the original graph (names of the module's inputs and outputs)
    sub: onnx.ModelProto  # the offloaded graph: data inputs, then weights as its last inputs
    weights: list[tuple[str, np.ndarray]]
    data: list[str]  # the subgraph's data inputs (graph inputs of the model)
    outputs: list[str]  # the subgraph's outputs (read by the rest, or outputs of the model)
    rest: onnx.ModelProto | None  # what stays TVM code; None when the whole graph is offloaded
    types: dict[str, tuple[tuple[int, ...], str]] = field(default_factory=dict)
    ops: dict[str, int] = field(default_factory=dict)

    def summary(self) -> dict:
        """What metadata.json records (``subgraphs``) and ``dspx info`` shows."""
        return {"kernel": KERNEL, "nodes": sum(self.ops.values()), "ops": dict(sorted(self.ops.items())),
                "inputs": self.data, "outputs": self.outputs, "weights": len(self.weights),
                "weight_bytes": int(sum(w.nbytes for _, w in self.weights)),
                "rest_nodes": 0 if self.rest is None else len(self.rest.graph.node)}


def _types(model: onnx.ModelProto) -> dict[str, tuple[tuple[int, ...] | None, int]]:
    """name -> (static shape or None, ONNX element type) for every typed value."""
    try:
        inferred = onnx.shape_inference.infer_shapes(model)
    except Exception:  # noqa: BLE001 - no inference, no partition (the boundary needs shapes)
        return {}
    g = inferred.graph
    out = {}
    for vi in list(g.input) + list(g.value_info) + list(g.output):
        tt = vi.type.tensor_type
        dims = [d.dim_value if d.HasField("dim_value") else None for d in tt.shape.dim] \
            if tt.HasField("shape") else None
        shape = tuple(dims) if dims is not None and None not in dims else None
        out[vi.name] = (shape, tt.elem_type)
    for init in g.initializer:
        out[init.name] = (tuple(init.dims), init.data_type)
    return out


def partition(model: onnx.ModelProto) -> Partition | None:
    """The offloadable prefix of ``model`` (already shape-fixed, BN folded), or
    None when there is none worth a call.  Float32 models only."""
    g = model.graph
    inits = {i.name: i for i in g.initializer}
    inputs = [i.name for i in g.input if i.name not in inits]
    types = _types(model)
    if not types:
        return None
    ready = set(inputs) | set(inits)
    taken, produced = [], set()
    for node in g.node:
        outs_f32 = all(types.get(o, (None, 0))[1] == TensorProto.FLOAT for o in node.output if o) \
            or node.op_type == "Constant"
        if (node.domain in ("", "ai.onnx") and node.op_type in SUBGRAPH_OPS and outs_f32
                and not any(a.type in (onnx.AttributeProto.GRAPH, onnx.AttributeProto.GRAPHS)
                            for a in node.attribute)
                and all(not i or i in ready or i in produced for i in node.input)):
            taken.append(node)
            produced.update(o for o in node.output if o)
    ops = collections.Counter(n.op_type for n in taken)
    if not any(ops[o] for o in HEAVY_OPS):
        return None
    taken_ids = {id(n) for n in taken}
    rest_nodes = [n for n in g.node if id(n) not in taken_ids]
    graph_outs = [o.name for o in g.output]
    read_by_rest = {i for n in rest_nodes for i in n.input}
    outputs = [o for n in taken for o in n.output if o in produced and (o in read_by_rest or o in graph_outs)]
    used = {i for n in taken for i in n.input if i}
    data = [i for i in inputs if i in used]
    boundary = data + outputs
    if not outputs or any(types.get(n, (None, 0))[0] is None or types[n][1] != TensorProto.FLOAT
                          for n in boundary):
        return None
    weights, small = [], []
    for name, init in inits.items():
        if name not in used:
            continue
        arr = numpy_helper.to_array(init)
        if arr.dtype == np.float32 and arr.size >= MIN_WEIGHT_ELEMENTS:
            weights.append((name, np.ascontiguousarray(arr)))
        else:
            small.append(init)

    def value(name):
        shape, elem = types[name]
        return helper.make_tensor_value_info(name, elem, list(shape))

    sg = helper.make_graph(taken, "dspx_subgraph", [value(n) for n in data] + [value(n) for n, _ in weights],
                           [value(n) for n in outputs], small)
    sub = helper.make_model(sg, opset_imports=[o for o in model.opset_import if o.domain in ("", "ai.onnx")])
    sub.ir_version = model.ir_version
    helper.set_model_props(sub, {SUBGRAPH_WEIGHTS_KEY: str(len(weights))})
    rest = None
    if rest_nodes:
        rest_inputs = [i for i in g.input if i.name not in inits] + [value(n) for n in outputs]
        rest_inits = [inits[n] for n in inits if n in read_by_rest]
        rg = helper.make_graph(rest_nodes, g.name or "rest", rest_inputs, list(g.output), rest_inits)
        rest = helper.make_model(rg, opset_imports=list(model.opset_import))
        rest.ir_version = model.ir_version
    shapes = {n: (types[n][0], "float32") for n in boundary}
    return Partition(model, sub, weights, data, outputs, rest, shapes, dict(ops))


def check_with_onnxruntime(part: Partition) -> str | None:
    """Build the subgraph's session here with its weights, as the device will:
    None if onnxruntime takes it, else why not (then the compiler keeps the
    op-by-op path)."""
    try:
        import onnxruntime as ort
    except ImportError:
        return "onnxruntime is not installed"
    m = onnx.ModelProto()
    m.CopyFrom(part.sub)
    names = {n for n, _ in part.weights}
    keep = [i for i in m.graph.input if i.name not in names]
    del m.graph.input[:]
    m.graph.input.extend(keep)
    m.graph.initializer.extend(numpy_helper.from_array(w, n) for n, w in part.weights)
    so = ort.SessionOptions()
    so.log_severity_level = 3
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL  # a check, not a plan
    try:
        ort.InferenceSession(m.SerializeToString(), so, providers=["CPUExecutionProvider"])
    except Exception as e:  # noqa: BLE001
        return str(e).splitlines()[0][:300]
    return None


def build_module(part: Partition, separate_weights: bool, import_rest):
    """The relax module of the partitioned model: ``main`` calls the subgraph
    kernel on its inputs, then runs the rest (``import_rest(onnx_model)`` ->
    relax IRModule, imported as compile_onnx imports a whole model) on its
    results.  With separate weights, the subgraph's weights are ``main``
    parameters listed in its "params" attribute (then detach_params puts them in
    the weights file beside the rest's)."""
    import tvm
    from tvm import relax

    g = part.model.graph
    inits = {i.name for i in g.initializer}
    in_names = [i.name for i in g.input if i.name not in inits]
    sinfo = {n: relax.TensorType(list(s), d) for n, (s, d) in part.types.items()}
    if part.rest is not None:
        rmod = import_rest(part.rest)
        rfunc = rmod["main"]
        n_rest_in = len(part.rest.graph.input)
        params = list(rfunc.params)
        in_vars, out_vars, rest_weights = params[:len(in_names)], params[len(in_names):n_rest_in], \
            params[n_rest_in:]
        body_blocks, body_out = list(rfunc.body.blocks), rfunc.body.body
        rest_params = list(rfunc.attrs["params"]) if rfunc.attrs is not None and "params" in rfunc.attrs else []
        others = [(gv, f) for gv, f in rmod.functions.items() if gv.name_hint != "main"]
        ret_ty = rfunc.ret_ty
    else:
        shape_of = {i.name: i for i in g.input}
        in_vars = [relax.Var(_var_name(n), _input_sinfo(shape_of[n])) for n in in_names]
        out_vars = [relax.Var(_var_name(n), sinfo[n]) for n in part.outputs]
        rest_weights, rest_params, body_blocks, others = [], [], [], []
        by_name = dict(zip(part.outputs, out_vars))
        outs = [by_name[o.name] for o in g.output]
        body_out = outs[0] if len(outs) == 1 else relax.Tuple(outs)
        tys = [sinfo[o.name] for o in g.output]
        ret_ty = tys[0] if len(tys) == 1 else relax.TupleType(tys)
    by_input = dict(zip(in_names, in_vars))
    graph = relax.const(np.frombuffer(part.sub.SerializeToString(), dtype=np.uint8))
    if separate_weights:
        sub_weights = [relax.Var(_var_name(n), relax.TensorType(list(w.shape), "float32"))
                       for n, w in part.weights]
    else:
        sub_weights = [relax.const(w) for _, w in part.weights]
    args = [graph] + [by_input[n] for n in part.data] + sub_weights
    out_sinfo = [sinfo[n] for n in part.outputs]
    call = relax.call_dps_packed(KERNEL, args, out_ty=out_sinfo if len(out_sinfo) > 1 else out_sinfo[0])
    bindings = []
    if len(out_vars) == 1:
        bindings.append(relax.VarBinding(out_vars[0], call))
    else:
        tup = relax.Var("subgraph", relax.TupleType(out_sinfo))
        bindings.append(relax.VarBinding(tup, call))
        bindings += [relax.VarBinding(v, relax.TupleGetItem(tup, i)) for i, v in enumerate(out_vars)]
    body = relax.SeqExpr([relax.BindingBlock(bindings)] + body_blocks, body_out)
    func = relax.Function(in_vars + rest_weights + (sub_weights if separate_weights else []), body, ret_ty)
    func = func.with_attr("global_symbol", "main").with_attr("num_input", len(in_names))
    if separate_weights:
        tensors = rest_params + [tvm.runtime.tensor(w) for _, w in part.weights]
        func = func.with_attr("params", tensors)
    mod = tvm.IRModule({"main": func})
    for gv, f in others:  # helper functions of the rest's import, if any
        mod[gv] = f
    return relax.transform.Normalize()(mod)


def _var_name(name: str) -> str:
    return "".join(c if c.isalnum() else "_" for c in name) or "x"


def _input_sinfo(vi):
    from tvm import relax

    tt = vi.type.tensor_type
    return relax.TensorType([d.dim_value for d in tt.shape.dim],
                                  helper.tensor_dtype_to_np_dtype(tt.elem_type).name)
