"""A Llama GGUF (SmolLM2-135M by default) -> two dspx device modules.

``compile_llm(gguf, outdir)`` writes

- ``prefill.so``: ``ids (1,64) int64, positions (1,64) int64, bases (1,64)
  int64, k0, v0, …, k29, v29 (1,3,256,64) float32, <weights>`` -> ``logits
  (1,64,49152), k0', v0', …`` (a row's KV goes to cache position base +
  position: ``bases`` places it in a slot of the KV, 0 with one slot)
- ``decode.so`` (and ``decode_parallel.so``): the same with ``(1,1)``
  ids/positions/bases and ``(1,1,49152)`` logits
- ``decode_batch.so`` (and ``decode_batch_parallel.so``): ``(1,4)`` rows,
  one decode token of up to 4 slots, and every real row's logits
- ``weights.bin``: ONE weights file both modules take (MODEL_LOAD once; both
  signatures carry its digest)
- ``metadata.json``: both modules' io tables and ``io_reserve``, the KV
  layout, the model config and a pointer to the GGUF the tokenizer comes from.

Weights stay quantized exactly as stored in the GGUF: Q4_1 blocks (f16 d,
f16 m, 32 nibbles) for every linear layer and Q8_0 blocks (f16 d, 32 int8)
for the tied embedding / LM head.  They are only *repacked* (same bits): the
nibbles of a block go into a ``(K/32, 16, N)`` uint8 array and the scales into
``(K/32, N)`` float16 arrays, so that the GEMV kernels stream 64 output rows
at a time with contiguous vector loads.  q/k/v are concatenated into one
``(576 -> 960)`` weight and gate/up into one ``(576 -> 3072)`` weight.

Every operator is a hand-scheduled TIR kernel (fused dequantize-GEMV, RMSNorm,
RoPE + in-place KV append, causal GQA attention over the cache, SiLU-gate)
compiled into the module: no default-legalized TVM codegen on the hot path.
Accumulation is float32 with the exact dequantized weight values (d·q + m), so
the float32 numpy reference over ``gguf.quants.dequantize`` is the oracle.

KV in place: the KV append is ``call_tir_inplace`` on the KV inputs and the
entry returns those very tensors as its KV outputs.  Driven KV_RESIDENT with
the KV inputs at the offsets the device packs KV outputs to (tensor i at
``i × 196,608`` from the KV base), the device sees that each output already
is its destination and copies nothing.

The package, by what it does: ``sizing`` (the model's shape, context and KV
sizes), ``weights`` (repacking and writing), ``tir`` (one factory per
kernel), ``graph`` (the Relax entry) and ``build`` (``compile_llm`` and the
cached ``compiled_dir``).
"""
from __future__ import annotations

from .build import (LLM_TARGET, build_digest, compile_llm, compiled_dir, gguf_identity,  # noqa: F401
                    kv_resident_reserve)
from .graph import entry, zeros_of  # noqa: F401
from .sizing import (DECODE_ACTIVATIONS, KB, KV_DTYPES, KV_LAYOUTS, TN, Dims, LLMCompileError,  # noqa: F401
                     check_decode_activations, check_kv_layout,
                     dims_of, kv_region_bytes, kv_row, largest_context)
from .tir import PR, REG, decode_slice, vnni_lanes, kernels, prefill_tile, vector_lanes, vexp  # noqa: F401
from .weights import _q4_1, _q8_0, dequantized_weights, pack_weights, rope_tables  # noqa: F401
