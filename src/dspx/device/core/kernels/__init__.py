"""The firmware kernel library (the MMALIB analogue).

Compiled modules do not carry their heavy operators: they call these kernels
by name (``R.call_dps_packed("dspx.kernels.conv2d", ...)``), and the name is
resolved against the firmware when the module's VM is created. A module
whose import is not in :func:`names` must be refused at DYN_LOAD with
ERR_SYMBOL naming it.

Calling convention (destination passing, checked against TVM 0.27): every
kernel is called ``fn(*inputs, *attrs, *outputs)``. Inputs and outputs are
TVM tensors (we take zero-copy numpy / torch views through DLPack and write
the outputs in place); attributes are ``R.prim_value`` ints/floats or
``R.shape`` tuples, passed as extra arguments. The spec of every kernel is in
:data:`KERNELS` and docs/kernels.md. All backends release the interpreter
lock while computing.

The package, from the bottom up:

- ``caches``: prepacked weights and every other per-module table, dropped
  together by :func:`clear_caches`;
- ``registry``: the table of kernels checked against ``dspx.abi.kernels``,
  the ``@kernel`` decorator and the call-site replay;
- ``backends``: the backend choice, the thread budget, onnxruntime sessions
  and the settings (:data:`backends.state`, changed only by the
  ``configure*`` functions);
- one module per kernel family, each registering its kernels when imported:
  ``conv``, ``pool``, ``gemm`` (dense, matmul), ``norm`` (softmax,
  layernorm), ``subgraph``, ``llm`` and ``q8`` (``--quantize int8``).
"""

from __future__ import annotations

# The ABI's argument codes, for callers that build kernel arguments.
from ....abi.kernels import (ACT_NONE, ACT_RELU, IN_BLOCKED, LAYOUT_NCHW, LAYOUT_NHWC,  # noqa: F401
                             OUT_BLOCKED, PREFIX, RES_BLOCKED)
from . import backends, caches, registry  # noqa: F401
from .backends import (BACKENDS, backend, configure, configure_backend, configure_threads,  # noqa: F401
                       optimize_model, ort_session_options, warmup)
from .caches import cache_size, clear_caches  # noqa: F401
from .registry import KERNELS, KernelError, KernelSpec, names, register_all  # noqa: F401

# The families: importing one enters its kernels in KERNELS.
from . import conv, gemm, llm, norm, pool, q8, subgraph  # noqa: F401,E402
from .conv import conv2d, conv2d_add, conv2d_add_qw, conv2d_qw  # noqa: F401,E402
from .gemm import dense, dense_qw, matmul  # noqa: F401,E402
from .llm import (attention_decode, configure_gemv, gemv_q4, gemv_q4_1, gemv_q8,  # noqa: F401,E402
                  kv_update, rmsnorm, rope, silu_mul)
from .norm import layernorm, softmax  # noqa: F401,E402
from .pool import avg_pool2d, global_avg_pool2d, max_pool2d  # noqa: F401,E402
from .q8 import conv2d_add_q8, conv2d_q8, dense_q8  # noqa: F401,E402
from .subgraph import onnx_subgraph  # noqa: F401,E402
