"""A decoder's quantized program emulated in torch: the program's numbers, whole windows at once.

An exported program computes each linear layer as XNNPACK does (``frontend/lowering/linear.py``)
and looks tokens up in its quantized table (``frontend/passes/embeddings.py``).  ``emulated``
puts the same numbers into a ``transformers`` causal LM for the time of a ``with`` block, so
that a batch of windows runs in one eager forward instead of one program call a token::

    linear  y = A(x) @ dequantize(Q(W))^T + b
        Q:  the layer's ``WeightScheme``, quantized by the library's own quantizer
            (``WeightScheme.quantize``: the program's codes and scales, bit for bit)
        A:  "qd8"   per-token dynamic int8, as XNNPACK converts a linear's input
                    (``per_token_int8``: XNNPACK's zero point and ``1 / m`` scale, rounding
                    of the product first, saturation; ``xq.quantize_per_token``'s numbers)
            "fp32"  none (a weights-only kernel: fp32 activations)
            "q8_0"  llama.cpp's: symmetric int8 in blocks of 32 along the features,
                    scale ``max|block| / 127`` rounded to fp16 (for comparison only:
                    XNNPACK has no such conversion)
    table   lookup in ``dequantize(E(table))`` (``EmbeddingScheme``)

What differs from the program: the order of float sums (XNNPACK's integer dot products
and their tiles against torch's matmul), so logits agree to float rounding except where a
per-token code sits on a rounding tie (``tests/test_llm_bytes.py`` measures it against
the real runtime).  Attention, norms and the KV cache stay fp32 (a program's ``kv_cache="fp32"``).

``window_nll`` scores windows of token ids in one batch: the negative log-likelihood of
each predicted token, as ``evaluate.perplexity`` computes it from a program's logits.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..constants import FLT_MIN
from ..errors import XnnquantError

#: The activation quantizations ``emulated`` knows (module docstring).
ACTIVATIONS = ("qd8", "fp32", "q8_0")
#: llama.cpp's block of activations (``QK8_0``).
Q8_0_BLOCK = 32


def per_token_int8(x: Any) -> Any:
    """``x`` (float32 torch ``[..., K]``) through XNNPACK's per-token int8 and back: each row's
    codes, zero point and scale (``per_token_codes``), dequantized ``(q - zp) * scale`` in
    float32, ``x``'s shape."""
    q, zp, scale = per_token_codes(x)
    return (q - zp) * scale


def per_token_codes(x: Any) -> tuple[Any, Any, Any]:
    """XNNPACK's per-token int8 of ``x`` (float32 torch ``[..., K]``), as ``xq.quantize_per_token``
    computes it (``schemes/per_token.py``): (codes, zero points, scales), float32 torch
    ``[..., K]``, ``[..., 1]``, ``[..., 1]``."""
    import torch

    x = torch.where(x.abs() < FLT_MIN, torch.zeros((), dtype=x.dtype), x)  # denormals are zero
    lo = torch.clamp(x.amin(dim=-1, keepdim=True), max=0.0)
    hi = torch.clamp(x.amax(dim=-1, keepdim=True), min=0.0)
    span = hi - lo
    # float32 quotients correctly rounded (through float64), as numpy's and XNNPACK's divisions are
    mult = torch.where(span == 0, torch.ones((), dtype=x.dtype), (255.0 / span.double()).float())
    lo_m, hi_m = lo * mult, hi * mult
    zp = torch.where((-128.0 + lo_m) + (127.0 + hi_m) > 0, -128.0 - lo_m, 127.0 - hi_m)
    zp = torch.round(torch.clamp(zp, -128.0, 127.0))
    q = torch.clamp(torch.round(x * mult) + zp, -128.0, 127.0)
    return q, zp, (1.0 / mult.double()).float()


def q8_0(x: Any) -> Any:
    """``x`` (float32 torch ``[..., K]``, K a multiple of 32) through llama.cpp's ``Q8_0``
    activation blocks and back: ``d = fp16(max|block| / 127)``, ``q = round(x / d)``."""
    import torch

    k = x.shape[-1]
    if k % Q8_0_BLOCK:
        raise XnnquantError(f"q8_0 activations need features in blocks of {Q8_0_BLOCK}: got {k}")
    blocks = x.reshape(*x.shape[:-1], k // Q8_0_BLOCK, Q8_0_BLOCK)
    d = (blocks.abs().amax(dim=-1, keepdim=True) / 127.0).to(torch.float16).to(torch.float32)
    inv = torch.where(d == 0, torch.zeros((), dtype=d.dtype), 1.0 / d)
    q = torch.clamp(torch.round(blocks * inv), -127.0, 127.0)
    return (q * d).reshape(x.shape)


def activation_function(kind: str) -> Callable[[Any], Any] | None:
    """The conversion of a linear's input for ``kind`` (``ACTIVATIONS``); None for fp32."""
    if kind == "qd8":
        return per_token_int8
    if kind == "q8_0":
        return q8_0
    if kind == "fp32":
        return None
    raise XnnquantError(f"unknown activations {kind!r}: expected one of {', '.join(ACTIVATIONS)}")


@dataclass(frozen=True)
class LinearSetting:
    """How one linear layer is emulated: its stored weight (float32 ``[N, K]``) and the
    conversion of its input (``ACTIVATIONS``)."""

    weight: Any  # torch float32 [N, K]
    activations: str = "qd8"


def linear_modules(model: Any) -> dict[str, Any]:
    """Every ``nn.Linear`` of ``model`` by its module name, the LM head included."""
    import torch

    return {name: m for name, m in model.named_modules() if isinstance(m, torch.nn.Linear)}


def head_name(model: Any) -> str:
    """The module name of ``model``'s LM head (its output embeddings)."""
    head = model.get_output_embeddings()
    for name, m in model.named_modules():
        if m is head:
            return name
    raise XnnquantError(f"{type(model).__name__} has no language-model head among its modules")


def is_tied(model: Any) -> bool:
    """True when the LM head's weight is the token table (one tensor)."""
    head, table = model.get_output_embeddings(), model.get_input_embeddings()
    return head is not None and table is not None and head.weight is table.weight


@contextlib.contextmanager
def emulated(model: Any, linears: Mapping[str, LinearSetting], table: Any = None) -> Iterator[Any]:
    """``model`` computing as a program would (module docstring) inside the block.

    ``linears``: module name -> ``LinearSetting`` (layers not named stay float, fp32
    activations); ``table``: the token table's stored values, float32 ``[V, D]`` (None: kept).
    A head tied to the table is untied for the block when either changes.  Weights,
    forwards and ties are put back on exit.
    """
    import torch

    modules = linear_modules(model)
    unknown = sorted(set(linears) - set(modules))
    if unknown:
        raise XnnquantError(f"no linear layer {unknown[0]!r} in {type(model).__name__}: expected one of its "
                            f"nn.Linear module names (e.g. {next(iter(modules), '')!r})")
    embeddings = model.get_input_embeddings()
    saved = [(m, m.weight, m.__dict__.get("forward")) for m in (*modules.values(), embeddings)]
    try:
        if table is not None:
            embeddings.weight = torch.nn.Parameter(torch.as_tensor(table, dtype=torch.float32), requires_grad=False)
        for name, setting in linears.items():
            m = modules[name]
            m.weight = torch.nn.Parameter(torch.as_tensor(setting.weight, dtype=torch.float32), requires_grad=False)
            convert = activation_function(setting.activations)
            if convert is not None:
                m.forward = _converting(m, convert)
        yield model
    finally:
        for m, weight, forward in saved:
            m.weight = weight
            if forward is None:
                m.__dict__.pop("forward", None)
            else:
                m.forward = forward


def _converting(module: Any, convert: Callable[[Any], Any]) -> Callable[[Any], Any]:
    import torch

    def forward(x: Any) -> Any:
        return torch.nn.functional.linear(convert(x), module.weight, module.bias)

    return forward


def window_nll(model: Any, windows: Any, batch: int = 8) -> np.ndarray:
    """The negative log-likelihood of every predicted token of ``windows`` (int64 ``[B, W]``,
    each window from position 0, no BOS): float64 ``[B, W - 1]`` (``logsumexp(logits_i) -
    logits_i[t_{i+1}]`` in float64, ``evaluate.perplexity``'s), ``batch`` windows a forward."""
    import torch

    ids = torch.as_tensor(np.asarray(windows), dtype=torch.int64)
    if ids.dim() != 2 or ids.shape[1] < 2:
        raise XnnquantError(f"windows must be token ids [B, W] with W >= 2: got shape {tuple(ids.shape)}")
    out = []
    with torch.no_grad():
        for start in range(0, ids.shape[0], batch):
            chunk = ids[start:start + batch]
            logits = model(input_ids=chunk, use_cache=False).logits[:, :-1].double()
            nll = torch.logsumexp(logits, dim=-1) - logits.gather(-1, chunk[:, 1:, None]).squeeze(-1)
            out.append(nll.numpy())
    return np.concatenate(out)
