"""The subgraph kernel, onnx_subgraph: a run of operators the compiler
offloaded (dspx.compiler.subgraph) in one onnxruntime session per graph, its
weights baked in and prepacked, data and outputs bound in place.
"""

from __future__ import annotations

import os
from typing import Callable

import numpy as np

from ....abi.kernels import SUBGRAPH_OPS, SUBGRAPH_WEIGHTS_KEY
from .backends import bound_run, ort_session_options
from .caches import cached, fingerprint
from .registry import KernelError, add, addr, as_numpy, site_cached

# DSPX_SUBGRAPH_SPIN=0 turns the subgraph session's spinning off (default on,
# as onnxruntime's own whole-graph session: one pool, woken once per call).
_SUBGRAPH_SPIN = os.environ.get("DSPX_SUBGRAPH_SPIN", "1") != "0"
# DSPX_SUBGRAPH_BLOCK_BASE=N: onnxruntime's session.dynamic_block_base (work
# split in shrinking blocks, so a descheduled thread's share is taken over);
# a candidate for shared cores, off by default (not measured quietly)
_SUBGRAPH_BLOCK_BASE = os.environ.get("DSPX_SUBGRAPH_BLOCK_BASE", "")


class Subgraph:
    """One onnxruntime session over a module's offloaded ONNX subgraph
    (dspx.compiler.subgraph): the weights baked in as initializers once (so
    onnxruntime prepacks them), data and outputs bound in place."""

    def __init__(self, graph: np.ndarray, inputs: list[np.ndarray], n_out: int):
        import onnx
        import onnxruntime as ort
        from onnx import numpy_helper

        try:
            m = onnx.ModelProto.FromString(graph.tobytes())
        except Exception as e:  # noqa: BLE001 - protobuf's DecodeError and friends
            raise KernelError(f"onnx_subgraph: graph is not a serialized ONNX model ({e})") from None
        g = m.graph
        _check_subgraph(m)
        meta = {p.key: p.value for p in m.metadata_props}
        n_w = meta.get(SUBGRAPH_WEIGHTS_KEY, "0")
        if not n_w.isdigit() or int(n_w) > len(g.input):
            raise KernelError(f"onnx_subgraph: {SUBGRAPH_WEIGHTS_KEY}={n_w!r} is not a count of the graph's "
                              f"{len(g.input)} inputs")
        n_w = int(n_w)
        if len(inputs) != len(g.input) or n_out != len(g.output):
            raise KernelError(f"onnx_subgraph: the graph has {len(g.input)} inputs and {len(g.output)} outputs, "
                              f"the call passes {len(inputs)} inputs and {n_out} outputs")
        for vi, a in zip(g.input, inputs):
            _check_value(vi, a, "input")
        weights = list(zip(g.input[len(g.input) - n_w:], inputs[len(inputs) - n_w:]))
        for vi, w in weights:
            g.initializer.append(numpy_helper.from_array(w, vi.name))
        data = list(g.input[:len(g.input) - n_w])
        del g.input[:]
        g.input.extend(data)
        self.names = [vi.name for vi in data]
        self.outs = [vi.name for vi in g.output]
        self.out_types = list(g.output)
        so = ort_session_options(spin=_SUBGRAPH_SPIN)
        if _SUBGRAPH_BLOCK_BASE.isdigit():
            so.add_session_config_entry("session.dynamic_block_base", _SUBGRAPH_BLOCK_BASE)
        try:
            self.sess = ort.InferenceSession(m.SerializeToString(), so, providers=["CPUExecutionProvider"])
        except Exception as e:  # noqa: BLE001 - onnxruntime refuses the graph
            raise KernelError(f"onnx_subgraph: onnxruntime cannot build the graph: {str(e).splitlines()[0][:300]}") \
                from None

    def bind(self, data: list[np.ndarray], outs: list[np.ndarray]) -> Callable[[], None]:
        for vi, o in zip(self.out_types, outs):
            _check_value(vi, o, "output")
        io = self.sess.io_binding()
        for name, a in zip(self.names, data):
            io.bind_input(name, "cpu", 0, np.float32, list(a.shape), addr(a))
        for name, o in zip(self.outs, outs):
            io.bind_output(name, "cpu", 0, np.float32, list(o.shape), addr(o))
        return bound_run(self.sess, io)


def _check_subgraph(m) -> None:
    """Refuse what the firmware does not run: other operator domains, operators
    outside SUBGRAPH_OPS, nested graphs, external data (a path on the device)."""
    from onnx import AttributeProto, TensorProto

    for op in m.opset_import:
        if op.domain not in ("", "ai.onnx"):
            raise KernelError(f"onnx_subgraph: operator domain {op.domain!r} is not the firmware's "
                              "(default ONNX domain only)")
    if len(m.functions):
        raise KernelError("onnx_subgraph: the graph defines model-local functions; the firmware runs "
                          "plain operators only")
    g = m.graph
    tensors = list(g.initializer)
    for node in g.node:
        if node.domain not in ("", "ai.onnx") or node.op_type not in SUBGRAPH_OPS:
            raise KernelError(f"onnx_subgraph: node {node.name or node.op_type!r} is {node.domain or 'ai.onnx'}."
                              f"{node.op_type}, not an operator the firmware runs in a subgraph")
        for a in node.attribute:
            if a.type in (AttributeProto.GRAPH, AttributeProto.GRAPHS):
                raise KernelError(f"onnx_subgraph: node {node.name!r} holds a nested graph")
            if a.type == AttributeProto.TENSOR:
                tensors.append(a.t)
    for t in tensors:
        if t.data_location == TensorProto.EXTERNAL or len(t.external_data):
            raise KernelError(f"onnx_subgraph: tensor {t.name!r} refers to external data; weights travel as "
                              "kernel inputs")


def _check_value(vi, a: np.ndarray, kind: str) -> None:
    from onnx import TensorProto

    tt = vi.type.tensor_type
    dims = [d.dim_value if d.HasField("dim_value") else None for d in tt.shape.dim]
    if tt.elem_type != TensorProto.FLOAT or a.dtype != np.float32:
        raise KernelError(f"onnx_subgraph: {kind} {vi.name!r} must be float32 in the graph and the call "
                          f"(got {TensorProto.DataType.Name(tt.elem_type)} and {a.dtype})")
    if dims != list(a.shape):
        raise KernelError(f"onnx_subgraph: {kind} {vi.name!r} is {dims} in the graph, the call passes "
                          f"{list(a.shape)}")
    if not a.flags.c_contiguous:
        raise KernelError(f"onnx_subgraph: {kind} {vi.name!r} must be contiguous")


def onnx_subgraph(*args) -> Callable[[], None]:
    """A run of operators in one call: ``graph`` (uint8, a serialized ONNX
    model of SUBGRAPH_OPS), its inputs in order (data, then weights) and its
    outputs.  One onnxruntime session per graph with the weights prepacked and
    one pool: no per-operator calls, wake-ups or NCHWc reorders between them.
    A call site replays its bound run (see registry.sites)."""
    graph, inputs, outs, n_w = _subgraph_args(args)
    # one session per graph and weights (not per data: every address set of a call site shares it)
    wkey = tuple((addr(a), a.shape, fingerprint(a)) for a in inputs[len(inputs) - n_w:])
    sub = cached(graph, ("subgraph", wkey, len(outs)), lambda: Subgraph(graph, inputs, len(outs)))
    run = sub.bind(inputs[:len(sub.names)], outs)
    run()
    return run


def _subgraph_args(args: tuple) -> tuple[np.ndarray, list[np.ndarray], list[np.ndarray], int]:
    """(graph, inputs, outputs, weights among the inputs) of an onnx_subgraph call."""
    if not args:
        raise KernelError("onnx_subgraph: no graph passed")
    arrays = [as_numpy(a) for a in args]
    graph = arrays[0]
    if graph.dtype != np.uint8 or graph.ndim != 1:
        raise KernelError(f"onnx_subgraph: graph must be a 1-D uint8 tensor, got {graph.dtype} {graph.shape}")
    tensors = arrays[1:]
    n_in, n_w = _subgraph_counts(graph)
    if n_in > len(tensors):
        raise KernelError(f"onnx_subgraph: the graph has {n_in} inputs, the call passes {len(tensors)} tensors")
    return graph, tensors[:n_in], tensors[n_in:], n_w


def _subgraph_weight(args: tuple):
    """The first weight of an onnx_subgraph call (what its session baked in), or None."""
    _, inputs, _, n_w = _subgraph_args(args)
    return inputs[len(inputs) - n_w] if n_w else None


def _subgraph_counts(graph: np.ndarray) -> tuple[int, int]:
    """(inputs, of which weights) the graph declares (parsed once per graph
    constant; a count that does not fit is refused by Subgraph)."""
    def count():
        import onnx

        try:
            m = onnx.ModelProto.FromString(graph.tobytes())
        except Exception as e:  # noqa: BLE001
            raise KernelError(f"onnx_subgraph: graph is not a serialized ONNX model ({e})") from None
        n_w = {p.key: p.value for p in m.metadata_props}.get(SUBGRAPH_WEIGHTS_KEY, "0")
        n_in = len(m.graph.input)
        return n_in, int(n_w) if n_w.isdigit() and int(n_w) <= n_in else 0
    return cached(graph, ("subgraph-counts",), count)


# entered by hand: its arguments are variadic (the graph's own inputs and outputs)
add("onnx_subgraph", site_cached("onnx_subgraph", onnx_subgraph, _subgraph_weight), "onnxruntime",
    onnx_subgraph.__doc__)
