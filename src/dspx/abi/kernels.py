"""The firmware kernel ABI: what a compiled module may call by name.

A module calls a kernel through ``R.call_dps_packed("dspx.kernels.<name>", …)``
with the arguments in the order declared here: tensor inputs, then
attributes, then the output tensor(s).  The compiler emits these calls
(``dspx.compiler.kernel_rewrite``), the device implements and registers them
(``dspx.device.core.kernels``); both import this table, neither redefines it.
"""
from __future__ import annotations

from typing import NamedTuple

PREFIX = "dspx.kernels."

# Attribute encodings.
LAYOUT_NCHW = 0
LAYOUT_NHWC = 1
# Flags or-ed into a layout code: this tensor stays in the kernel backend's
# private blocked layout (onnxruntime's NCHWc) between two kernels, so no
# reorder pass runs over the activations between them.  Same shape as NCHW,
# channels a multiple of BLOCK_MULTIPLE.
IN_BLOCKED = 4
OUT_BLOCKED = 8
RES_BLOCKED = 16
BLOCK_MULTIPLE = 16
ACT_NONE = 0
ACT_RELU = 1
ROPE_HALF = 0  # rotate-half (HF Llama / NeoX)
ROPE_INTERLEAVED = 1  # pairs (2i, 2i+1) (GPT-J / GGUF "normal")


class KernelABI(NamedTuple):
    inputs: tuple[str, ...]
    attrs: tuple[str, ...]
    outputs: tuple[str, ...]

    @property
    def args(self) -> tuple[str, ...]:
        return self.inputs + self.attrs + self.outputs

    def position(self, arg: str) -> int:
        return self.args.index(arg)


def _abi(inputs: str, attrs: str, outputs: str = "out") -> KernelABI:
    return KernelABI(tuple(inputs.split()), tuple(attrs.split()), tuple(outputs.split()))


#: short name -> argument lists, in call order
KERNELS: dict[str, KernelABI] = {
    "conv2d": _abi("data weight bias", "strides padding dilation groups layout act"),
    "conv2d_add": _abi("data weight bias residual", "strides padding dilation groups layout act"),
    "max_pool2d": _abi("data", "pool strides padding dilation ceil_mode layout"),
    "avg_pool2d": _abi("data", "pool strides padding dilation ceil_mode count_include_pad layout"),
    "global_avg_pool2d": _abi("data", "layout"),
    "dense": _abi("data weight bias", "trans_b act"),
    # the same with an int8 weight and its per-output-channel scales (O,) / (N,):
    # weight = q * wscale (dspx compile --weights int8)
    "conv2d_qw": _abi("data weight bias wscale", "strides padding dilation groups layout act"),
    "conv2d_add_qw": _abi("data weight bias residual wscale", "strides padding dilation groups layout act"),
    "dense_qw": _abi("data weight bias wscale", "trans_b act"),
    "matmul": _abi("a b", "trans_b"),
    "gemv_q8": _abi("data qweight scales", "block"),
    "gemv_q4": _abi("data qweight scales", "block"),
    "gemv_q4_1": _abi("data qweight scales mins", "block"),
    "softmax": _abi("data", "axis"),
    "rmsnorm": _abi("data weight", "eps"),
    "layernorm": _abi("data gamma beta", "eps"),
    "silu_mul": _abi("gate up", ""),
    "rope": _abi("data positions", "theta mode"),
    "attention_decode": _abi("q k_cache v_cache", "length scale"),
    "kv_update": _abi("cache new", "pos"),
    # int8 activations x int8 weights (dspx compile --quantize int8, docs/quantize.md): the input
    # is quantized with its calibrated (in_scale, in_zero) to uint8, a conv's result requantized
    # with (out_scale, out_zero); float32 in and out; weight = q * wscale per output channel
    "conv2d_q8": _abi("data weight bias wscale",
                      "strides padding dilation groups layout act in_scale in_zero out_scale out_zero"),
    "conv2d_add_q8": _abi("data weight bias residual wscale",
                          "strides padding dilation groups layout act in_scale in_zero out_scale out_zero"),
    "dense_q8": _abi("data weight bias wscale", "trans_b act in_scale in_zero"),
    # a whole run of operators in one call (dspx.compiler.subgraph): ``graph`` is a uint8
    # tensor holding a serialized ONNX model; ``inputs...`` are its graph inputs in order
    # (data first, then the SUBGRAPH_WEIGHTS_KEY last ones: weights), ``outputs...`` its
    # graph outputs in order; no attributes, the counts are the graph's own
    "onnx_subgraph": _abi("graph inputs...", "", "outputs..."),
}

#: the operators an onnx_subgraph graph may hold (default ONNX domain, float32 activations):
#: what both the compiler's partition and the device's check accept
SUBGRAPH_OPS = frozenset({
    "Conv", "Relu", "Add", "Sub", "Mul", "Div", "MaxPool", "AveragePool", "GlobalAveragePool",
    "GlobalMaxPool", "Flatten", "Gemm", "MatMul", "Reshape", "Transpose", "Concat", "Split", "Clip",
    "Sigmoid", "HardSigmoid", "HardSwish", "LeakyRelu", "PRelu", "Tanh", "Softmax",
    "BatchNormalization", "Identity", "Constant", "Squeeze", "Unsqueeze", "Pad", "LRN"})
#: metadata_props key of an onnx_subgraph graph: how many of its last inputs are weights
#: (constant per module; the device bakes them into its session once, prepacked)
SUBGRAPH_WEIGHTS_KEY = "dspx.num_weights"

#: which argument positions of a kernel may take a blocked tensor, and the flag that says so
BLOCKED_ARGS: dict[str, dict[int, int]] = {
    "conv2d": {0: IN_BLOCKED}, "conv2d_add": {0: IN_BLOCKED, 3: RES_BLOCKED},
    "conv2d_qw": {0: IN_BLOCKED}, "conv2d_add_qw": {0: IN_BLOCKED, 3: RES_BLOCKED},
    "max_pool2d": {0: IN_BLOCKED}, "global_avg_pool2d": {0: IN_BLOCKED}}


def full_name(short: str) -> str:
    if short not in KERNELS:
        raise KeyError(f"{short!r} is not a firmware kernel")
    return PREFIX + short


def names() -> frozenset[str]:
    """Every full kernel name of the export table."""
    return frozenset(PREFIX + n for n in KERNELS)
