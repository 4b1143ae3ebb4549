"""Decoder-only causal LMs with a KV cache, as ExecuTorch's LLM runners run them.

``export_llm`` (``export.py``) turns a ``transformers`` causal LM, or ExecuTorch's llama
``Transformer``, into one ``.pte``: ``forward(tokens, input_pos) -> logits`` over a KV cache
kept as method state, plus the metadata methods ``TextLLMRunner`` and ``llama_main`` read.
``decoder.py`` is the module exported: each model family's computation around one cache
layout and ExecuTorch's attention kernel.  ``generate.py`` runs such a program: prefill,
then one decode call per token, greedy or sampled, until an end-of-sequence token.

Importing this package does not import torch or transformers: ``export_llm`` does.
"""

from .export import LLMInfo, export_llm
from .generate import LLM, Generation, generate

__all__ = ["LLM", "Generation", "LLMInfo", "export_llm", "generate"]
