"""What the compiler checks and rewrites in the ONNX graph before TVM sees it,
and how a failure inside TVM's importer becomes one actionable line.

Every error here is a ``CompileError`` whose message names the operator and
node (``node 'x' (PRelu)``), what is unsupported and what to do about it.
"""
from __future__ import annotations

import contextlib
import io
import re

import onnx
from onnx import TensorProto, helper

TRAINING_DOMAIN = "ai.onnx.preview.training"
TRAINING_OPS = {"Gradient", "Momentum", "Adagrad", "Adam"}
STRING_OPS = {"StringNormalizer", "StringConcat", "StringSplit", "RegexFullMatch", "TfIdfVectorizer",
              "LabelEncoder", "CategoryMapper"}


class CompileError(Exception):
    """The model cannot be compiled; the message says why in one line
    (``.operators`` lists unsupported operator types, ``.node`` the node)."""

    def __init__(self, message: str, operators: list[str] | None = None, node: str | None = None):
        super().__init__(" ".join(str(message).split()))  # one line, always
        self.operators = operators or []
        self.node = node


def node_label(node) -> str:
    name = node.name or (node.output[0] if node.output else "?")
    return f"node {name!r} ({node.op_type})"


def _value_kind(tp: onnx.TypeProto) -> str:
    return tp.WhichOneof("value") or "tensor_type"


def _is_string(tp: onnx.TypeProto) -> bool:
    return _value_kind(tp) == "tensor_type" and tp.tensor_type.elem_type == TensorProto.STRING


def precheck(model: onnx.ModelProto) -> None:
    """Refuse what the device cannot run, naming the first offending node or tensor."""
    g = model.graph
    for kind, values in (("input", g.input), ("output", g.output)):
        for v in values:
            k = _value_kind(v.type)
            if k in ("sequence_type", "optional_type", "map_type"):
                what = k.split("_")[0]
                raise CompileError(f"graph {kind} {v.name!r} is a {what}, not a tensor: dspx modules take and "
                                   f"return tensors only; export the model with tensor {kind}s "
                                   f"(e.g. stack the sequence into one tensor)")
            if _is_string(v.type):
                raise CompileError(f"graph {kind} {v.name!r} is a string tensor: the device has no strings; "
                                   "tokenize or encode strings on the host and pass integer tensors")
    for init in g.initializer:
        if init.data_type == TensorProto.STRING:
            raise CompileError(f"initializer {init.name!r} is a string tensor: the device has no strings; "
                               "encode them on the host")
    for node in g.node:
        if node.domain == TRAINING_DOMAIN or node.op_type in TRAINING_OPS:
            raise CompileError(f"{node_label(node)} is a training operator: dspx compiles inference graphs; "
                               "export the model for inference (e.g. torch.onnx.export of model.eval(), "
                               "without training=TrainingMode.TRAINING)", [node.op_type], node.name)
        if node.op_type in STRING_OPS:
            raise CompileError(f"{node_label(node)} works on string tensors, which the device does not have; "
                               "do this step on the host", [node.op_type], node.name)
        for a in node.attribute:
            if a.type == onnx.AttributeProto.TENSOR and a.t.data_type == TensorProto.STRING:
                raise CompileError(f"{node_label(node)} makes a string tensor, which the device does not have; "
                                   "do this step on the host", [node.op_type], node.name)


def _parse_dims(text: str, what: str) -> list[int]:
    try:
        dims = [int(d) for d in text.split(",")]
    except ValueError:
        raise CompileError(f"{what}: {text!r} is not a comma-separated list of integers") from None
    if any(d < 0 for d in dims):
        raise CompileError(f"{what}: dimensions must be >= 0, got {text!r}")
    return dims


def parse_assignments(items, what: str, parse) -> dict:
    """``["NAME=VALUE", …]`` -> {NAME: parse(VALUE)} with one-line errors."""
    out = {}
    for item in items or ():
        name, sep, value = str(item).partition("=")
        if not sep or not name:
            raise CompileError(f"{what} {item!r}: expected NAME=VALUE")
        out[name.strip()] = parse(value.strip(), f"{what} {name.strip()}")
    return out


def parse_shapes(items) -> dict[str, list[int]]:
    return parse_assignments(items, "--shape", _parse_dims)


def parse_dims(items) -> dict[str, int]:
    def one(text, what):
        dims = _parse_dims(text, what)
        if len(dims) != 1:
            raise CompileError(f"{what}: one integer expected, got {text!r}")
        return dims[0]
    return parse_assignments(items, "--dim", one)


def apply_shapes(model: onnx.ModelProto, shapes: dict | None, dims: dict | None) -> list[str]:
    """Fix the graph inputs' dynamic dimensions from ``--shape``/``--dim`` (in
    place); returns the names of the inputs that changed.  Every graph input
    must end up static."""
    g = model.graph
    inits = {i.name for i in g.initializer}
    inputs = {i.name: i for i in g.input if i.name not in inits}
    shapes, dims = dict(shapes or {}), dict(dims or {})
    unknown = sorted(set(shapes) - set(inputs))
    if unknown:
        raise CompileError(f"--shape names {', '.join(unknown)}, not an input of the model "
                           f"(inputs: {', '.join(inputs) or 'none'})")
    symbols = {d.dim_param for i in inputs.values() for d in i.type.tensor_type.shape.dim if d.dim_param}
    unused = sorted(set(dims) - symbols)
    if unused:
        raise CompileError(f"--dim names {', '.join(unused)}, not a symbolic dimension of the inputs "
                           f"(symbols: {', '.join(sorted(symbols)) or 'none'})")
    changed = []
    for name, v in inputs.items():
        if _value_kind(v.type) != "tensor_type":
            continue
        shape = v.type.tensor_type.shape
        if name in shapes:
            new = shapes[name]
            old = shape.dim
            if len(old) and len(new) != len(old):
                raise CompileError(f"--shape {name}={','.join(map(str, new))} has {len(new)} dimensions, "
                                   f"the model's input has {len(old)}")
            for i, d in enumerate(old):
                if d.HasField("dim_value") and d.dim_value != new[i]:
                    raise CompileError(f"--shape {name}: dimension {i} is fixed at {d.dim_value} in the model, "
                                       f"not {new[i]}")
            del shape.dim[:]
            for n in new:
                shape.dim.add().dim_value = n
            changed.append(name)
            continue
        for d in shape.dim:
            if d.dim_param in dims:
                value = dims[d.dim_param]
                d.Clear()
                d.dim_value = value
                if name not in changed:
                    changed.append(name)
        if not v.type.tensor_type.HasField("shape"):
            raise CompileError(f"input {name!r} has no shape in the model; give it with --shape "
                               f"{name}=D0,D1,...")
        free = [d.dim_param or "?" for d in shape.dim if not d.HasField("dim_value")]
        if free:
            text = ",".join(str(d.dim_value) if d.HasField("dim_value") else (d.dim_param or "?")
                            for d in shape.dim)
            hint = " or ".join([f"--dim {s}=VALUE" for s in free if s != "?"][:2] + [f"--shape {name}=D0,..."])
            raise CompileError(f"input {name!r} has a dynamic shape [{text}]; dspx modules need static "
                               f"shapes: give it with {hint}")
    if changed:
        # Symbolic dims of intermediate values and outputs are stale now.
        for v in list(g.value_info):
            g.value_info.remove(v)
        for o in g.output:
            if _value_kind(o.type) == "tensor_type":
                o.type.tensor_type.ClearField("shape")
    return changed


def rewrite_prelu(model: onnx.ModelProto) -> int:
    """Make every PRelu compile; returns how many nodes were changed.

    - A 1-D slope of C values on an input whose channel axis (1) has C and
      whose last axis does not is a per-channel slope, as PyTorch's exporter
      writes it (strict ONNX broadcasting would refuse it, and onnxruntime
      does): it becomes a (C, 1, ..., 1) slope.
    - A slope broadcast over several axes (TVM's converter asserts on those)
      becomes Relu(x) - slope * Relu(-x), exact for every slope shape.
    """
    g = model.graph
    inits = {i.name: i for i in g.initializer}
    if not any(n.op_type == "PRelu" for n in g.node):
        return 0
    try:
        inferred = onnx.shape_inference.infer_shapes(model).graph
        known = {v.name: [d.dim_value if d.HasField("dim_value") else None for d in v.type.tensor_type.shape.dim]
                 for v in list(inferred.value_info) + list(inferred.input)}
    except Exception:  # noqa: BLE001 - shape inference is a help here, not a requirement
        known = {}
    nodes, n = [], 0
    for node in g.node:
        if node.op_type != "PRelu" or len(node.input) != 2:
            nodes.append(node)
            continue
        x, slope = node.input
        s = list(inits[slope].dims) if slope in inits else None
        xs = known.get(x)
        if s is not None and len(s) == 1 and s[0] > 1 and xs and len(xs) >= 3 and xs[1] == s[0] != xs[-1]:
            per = onnx.numpy_helper.to_array(inits[slope]).reshape([s[0]] + [1] * (len(xs) - 2))
            name = slope + "__per_channel"
            if name not in inits:
                inits[name] = onnx.numpy_helper.from_array(per, name)
                g.initializer.append(inits[name])
            nodes.append(helper.make_node("PRelu", [x, name], list(node.output), name=node.name))
            n += 1
            continue
        if s is not None and (len(s) <= 1 or sum(d != 1 for d in s) <= 1):
            nodes.append(node)  # scalar, 1-D or one channel axis: TVM's own prelu
            continue
        y = node.output[0]
        p = f"{node.name or y}/prelu"
        nodes += [helper.make_node("Relu", [x], [p + "_pos"], name=p + "_pos"),
                  helper.make_node("Neg", [x], [p + "_neg"], name=p + "_neg"),
                  helper.make_node("Relu", [p + "_neg"], [p + "_negrelu"], name=p + "_negrelu"),
                  helper.make_node("Mul", [slope, p + "_negrelu"], [p + "_scaled"], name=p + "_scaled"),
                  helper.make_node("Sub", [p + "_pos", p + "_scaled"], [y], name=p)]
        n += 1
    if n:
        del g.node[:]
        g.node.extend(nodes)
    return n


def import_onnx(model: onnx.ModelProto, fn):
    """``fn(model)`` (TVM's importer) with errors made actionable: an exception
    in an operator converter becomes a CompileError naming the node; the
    importer's own prints (inputs dumped to stdout) are swallowed."""
    import gc

    from tvm.relax.frontend.onnx import onnx_frontend as fe

    by_op: dict[str, list] = {}
    for n in model.graph.node:
        by_op.setdefault(n.op_type, []).append(n)
    seen: dict[str, int] = {}
    current: dict = {}
    real = fe.ONNXGraphImporter._convert_operator

    def convert(self, op_name, inputs, attrs, opset):
        # the k-th conversion of an op type is its k-th node (nodes convert in graph order)
        k = seen[op_name] = seen.get(op_name, -1) + 1
        nodes = by_op.get(op_name, [])
        current["node"] = (nodes[k] if k < len(nodes) else None, op_name)
        return real(self, op_name, inputs, attrs, opset)

    fe.ONNXGraphImporter._convert_operator = convert
    err = None
    try:
        with contextlib.redirect_stdout(io.StringIO()):
            return fn(model)
    except CompileError:
        raise
    except Exception as e:  # noqa: BLE001 - the frontend raises assorted types
        err = _import_error(e, model, current)
        e.__traceback__ = None  # drop the importer's frames (its BlockBuilder warns when destroyed)
    finally:
        fe.ONNXGraphImporter._convert_operator = real
    gc.collect()
    raise err


def _import_error(e: Exception, model, current: dict) -> CompileError:
    node, op = current.get("node", (None, None))
    text = _first_line(e)
    if type(e).__name__ == "OpNotImplemented":
        m = re.search(r"not supported for frontend ONNX:\s*([^\n]+)", str(e))
        ops = sorted(o.strip() for o in m.group(1).split(",")) if m else []
        nodes = [n for n in model.graph.node if n.op_type in ops]
        where = f" (first: {node_label(nodes[0])})" if nodes else ""
        return CompileError(f"unsupported ONNX operator(s): {', '.join(ops) or text}{where}; "
                            "replace them in the model or run them on the host", ops)
    if op is None:
        return CompileError(f"TVM cannot import the model: {type(e).__name__}: {text}")
    label = node_label(node) if node is not None else f"a {op} node"
    return CompileError(f"{label}: TVM cannot convert it ({type(e).__name__}: {text}); "
                        f"{_advice(op, node, text)}", [op], node.name if node is not None else None)




def _first_line(e: Exception) -> str:
    text = str(e).strip()
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    # TVM errors put the message last, after a traceback of C++ frames
    for ln in reversed(lines):
        if not ln.startswith(("File ", "at ", "  ", "#")) and "Traceback" not in ln:
            return ln[:300]
    return (lines[-1] if lines else type(e).__name__)[:300]


def _advice(op: str, node, text: str) -> str:
    attrs = ({a.name: helper.get_attribute_value(a) for a in node.attribute} if node is not None else {})
    if op.startswith("Sequence") or op in ("SplitToSequence", "ConcatFromSequence"):
        return "sequences this pipeline cannot lower to tensors: export the model without sequence operators"
    if op in ("Expand", "Reshape", "Tile", "ConstantOfShape", "Range") or "shape" in text.lower():
        return ("its output shape depends on input values; fix them (fold the shape into a constant, "
                "or give static input shapes with --shape/--dim)")
    if "dynamic" in text.lower() or "symbolic" in text.lower():
        return "give static input shapes with --shape NAME=D0,D1,... or --dim NAME=V"
    if attrs:
        shown = ", ".join(f"{k}={v!r}"[:60] for k, v in list(attrs.items())[:4])
        return f"check its attributes ({shown}) or replace the operator in the model"
    return "replace the operator in the model or run it on the host"


def fold_batchnorm(model: onnx.ModelProto) -> int:
    """Conv -> BatchNormalization (inference form, constant parameters, the conv
    output read by nothing else) becomes one Conv with scaled weights and a new
    bias, as inference exporters and onnxruntime do; returns how many.

    Why here: TVM decomposes a BatchNormalization into elementwise arithmetic
    on the activations, which then stands between the convolution and its
    residual add and ReLU, so the kernel rewrite cannot fuse them, and runs as
    generated code (half of a ResNet-50 call before this).  Folded in float64,
    rounded once to float32."""
    import numpy as np
    from onnx import numpy_helper

    g = model.graph
    inits = {i.name: i for i in g.initializer}
    readers: dict[str, int] = {}
    for node in g.node:
        for i in node.input:
            readers[i] = readers.get(i, 0) + 1
    for o in g.output:
        readers[o.name] = readers.get(o.name, 0) + 1
    producer = {o: node for node in g.node for o in node.output}
    drop, n = set(), 0
    for bn in g.node:
        if bn.op_type != "BatchNormalization" or len(bn.output) != 1 or len(bn.input) != 5:
            continue
        conv = producer.get(bn.input[0])
        if (conv is None or conv.op_type != "Conv" or readers.get(bn.input[0]) != 1
                or not all(i in inits for i in bn.input[1:]) or conv.input[1] not in inits
                or (len(conv.input) > 2 and conv.input[2] and conv.input[2] not in inits)):
            continue
        attrs = {a.name: helper.get_attribute_value(a) for a in bn.attribute}
        if attrs.get("training_mode", 0) or attrs.get("spatial", 1) != 1:
            continue
        eps = float(attrs.get("epsilon", 1e-5))
        gamma, beta, mean, var = (numpy_helper.to_array(inits[i]).astype(np.float64) for i in bn.input[1:])
        w = numpy_helper.to_array(inits[conv.input[1]])
        if w.dtype != np.float32 or gamma.shape != (w.shape[0],):
            continue
        b = (numpy_helper.to_array(inits[conv.input[2]]).astype(np.float64)
             if len(conv.input) > 2 and conv.input[2] else np.zeros(w.shape[0]))
        scale = gamma / np.sqrt(var + eps)
        wf = (w.astype(np.float64) * scale.reshape(-1, *[1] * (w.ndim - 1))).astype(np.float32)
        bf = ((b - mean) * scale + beta).astype(np.float32)
        base = conv.name or conv.output[0]
        wn, bname = f"{base}__bn_w", f"{base}__bn_b"
        g.initializer.extend([numpy_helper.from_array(wf, wn), numpy_helper.from_array(bf, bname)])
        x = conv.input[0]
        del conv.input[:]
        conv.input.extend([x, wn, bname])
        conv.output[0] = bn.output[0]
        drop.add(id(bn))
        n += 1
    if n:
        kept = [node for node in g.node if id(node) not in drop]
        del g.node[:]
        g.node.extend(kept)
        # the replaced filters and BN parameters are unused now
        used = {i for node in g.node for i in node.input}
        unused = [i for i in g.initializer if i.name not in used]
        for i in unused:
            g.initializer.remove(i)
        names = {i.name for i in unused}
        for v in [v for v in g.input if v.name in names]:
            g.input.remove(v)
    return n


def sum_to_add(model: onnx.ModelProto) -> int:
    """Sum(a, b, ...) -> Add(Add(a, b), ...): TVM imports Sum as stack + reduce
    (a copy of every input, and a residual add the kernel rewrite cannot fuse
    into the convolution before it); pairwise Add is the same arithmetic
    (ONNX Sum broadcasts like Add).  Returns how many nodes were changed."""
    g = model.graph
    nodes, n = [], 0
    for node in g.node:
        if node.op_type != "Sum" or len(node.input) < 2:
            nodes.append(node)
            continue
        acc = node.input[0]
        for k, x in enumerate(node.input[1:], 1):
            out = node.output[0] if k == len(node.input) - 1 else f"{node.output[0]}__sum{k}"
            nodes.append(helper.make_node("Add", [acc, x], [out], name=f"{node.name or node.output[0]}__add{k}"))
            acc = out
        n += 1
    if n:
        del g.node[:]
        g.node.extend(nodes)
    return n
