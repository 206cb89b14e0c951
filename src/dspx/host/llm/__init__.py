"""Language-model generation on the device (``dspx generate``, ``dspx chat``,
``dspx serve-llm``), by what each part does:

- ``device``: ``DeviceLLM``, a compiled package loaded on a device — prefill,
  KV-resident decode and the bytes the host moved (``Traffic``);
- ``sampling``: the next token from a step's logits (``sample``,
  ``apply_repeat_penalty``);
- ``generator``: ``Generator``, prompts to streamed text with stop strings,
  limits and figures (``GenerationResult``);
- ``embed``: ``Embedder``, mean-pooled hidden states (serve-llm's /v1/embeddings);
- ``chat``: ``Chat``, a conversation with llama.cpp-style context shift, and
  ``demo_generate`` for ``make demo``.
"""
from .chat import Chat, Turn, demo_generate
from .device import ContextFullError, DeviceLLM, Traffic
from .embed import Embedder
from .generator import GenerationResult, Generator
from .sampling import apply_repeat_penalty, sample

__all__ = ["Chat", "ContextFullError", "DeviceLLM", "Embedder", "GenerationResult", "Generator", "demo_generate", "Traffic",
           "Turn", "apply_repeat_penalty", "sample"]
