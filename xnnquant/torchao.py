"""Our codes and scales in ExecuTorch's own flow: a torchao ``quantize_`` config.

::

    from torchao.quantization import quantize_
    from xnnquant.torchao import XnnquantConfig

    quantize_(model, XnnquantConfig(weights="qb4w:32", method="mse"))
    edge = to_edge_transform_and_lower(torch.export.export(model, example_inputs),
                                       partitioner=[XnnpackPartitioner()])
    pte = edge.to_executorch().buffer      # holds exactly our codes and bf16 scales

``XnnquantConfig`` is a torchao ``AOBaseConfig`` with a module handler registered through
``torchao.quantization.transform_module.register_quantize_module_handler``.  For each
linear ``quantize_`` selects, the handler quantizes the weight with xnnquant's own
vectorized schemes and replaces it with torchao's ``IntxUnpackedToInt8Tensor`` holding
those codes (int8 ``[N, K]``), scales (float32, ``[N, K // g]`` or ``[N, 1]``) and zero
points (int8 zeros): the tensor torchao's ``Int8DynamicActivationIntxWeightConfig`` makes,
so ExecuTorch's unchanged ``XnnpackPartitioner`` lowers it.  What ExecuTorch 1.4.1 then
writes (measured, and checked bit for bit by the tests):

==============  ======================  ==================================================
``weights``     xnnquant scheme         in the ``.pte``
==============  ======================  ==================================================
``"qb4w:G"``    ``quantize_blockwise``  qbint4, group G, bf16 scales = ours (they are
                (G = 32, 64, ...)       bf16-exact, so ExecuTorch's rounding keeps them)
``"qc4w"``      ``quantize_blockwise``  qbint4 with one group per row (group K): 1.4.1
                with group K            writes per-channel int4 that way, with bf16 scales
``"qc8w"``      ``quantize_per_channel``  qcint8, float32 scales = ours
                (bits 8)
==============  ======================  ==================================================

``activations="int8_dynamic"`` (the default) makes XNNPACK quantize each linear's input
per token at run time (qdint8), as torchao's 8da4w/8da8w configs do.  ``activations=None``
keeps weight-only tensors, which torch runs correctly, but which ExecuTorch 1.4.1's
``XnnpackPartitioner`` lowers wrongly (measured, and the same with torchao's own
``IntxWeightOnlyConfig``): the delegate gets an fp32 weight holding the integer codes, the
scales are passed to it as arguments that nothing uses, and the program's outputs come out
about ``1 / scale`` times too large (1500x for int8, 90x for int4 on a small linear).  The
config warns when it is made so.

A layer the config does not fit (not a 2-D linear weight, ``K`` not divisible by the group
size, ``K`` not a multiple of 32 for int4) is refused with an ``XnnquantError`` naming it.
To skip such layers instead, pass the config's own filter:
``quantize_(model, config, filter_fn=config.fits)``.

torchao's handler signature gives the module but not its name; the name in refusals is
read from the frame of torchao's ``quantize_`` walk that called the handler (its
``cur_fqn`` / ``fqn`` local), and falls back to the module's shape when that frame is not
there.

Importing this module imports torch and torchao (the ``torchao`` extra:
``pip install 'xnnquant[torchao]'``); ``import xnnquant`` does not.
"""

from __future__ import annotations

import sys
import warnings
from dataclasses import dataclass
from types import FrameType
from typing import Any

import numpy as np

from .constants import XNN_MIN_BLOCKSIZE
from .errors import XnnquantError, missing_extra
from .schemes import quantize_blockwise, quantize_per_channel
from .schemes.blockwise import valid_group_sizes
from .schemes.checks import Method
from .tensor import QuantizedTensor

try:
    import torch
    from torchao.core.config import AOBaseConfig
    from torchao.quantization.quantize_.workflows.intx.intx_unpacked_to_int8_tensor import (
        IntxUnpackedToInt8Tensor,
        IntxUnpackedToInt8TensorActivationQuantization,
    )
    from torchao.quantization.transform_module import register_quantize_module_handler
except ImportError:
    raise missing_extra("torchao", "torchao", "xnnquant.torchao (quantize_ configs for ExecuTorch)") from None

#: Weight schemes, by the name ``XnnquantConfig(weights=...)`` takes.
WEIGHT_SCHEMES = ("qb4w:<group size>", "qc4w", "qc8w")
#: Activation schemes, by name.
ACTIVATIONS = {"int8_dynamic": IntxUnpackedToInt8TensorActivationQuantization.INT8_ASYM_PER_TOKEN, None: None}
METHODS = ("minmax", "mse")


@dataclass(frozen=True)
class WeightScheme:
    """A parsed ``weights=`` string: bits, and the group size (None: one group per row)."""

    bits: int
    group_size: int | None

    @classmethod
    def parse(cls, text: Any) -> WeightScheme:
        if isinstance(text, str):
            if text == "qc8w":
                return cls(8, None)
            if text == "qc4w":
                return cls(4, None)
            head, _, tail = text.partition(":")
            if head == "qb4w" and tail.isdigit() and int(tail) > 0 and int(tail) % XNN_MIN_BLOCKSIZE == 0:
                return cls(4, int(tail))
        raise XnnquantError(
            f"unknown weights scheme: got {text!r}, expected one of {', '.join(WEIGHT_SCHEMES)} "
            f"(group size a positive multiple of {XNN_MIN_BLOCKSIZE}, e.g. 'qb4w:32')"
        )

    def __str__(self) -> str:
        if self.bits == 8:
            return "qc8w"
        return "qc4w" if self.group_size is None else f"qb4w:{self.group_size}"

    def refusal(self, shape: tuple[int, ...]) -> str | None:
        """Why a weight of ``shape`` cannot take this scheme, or None when it can."""
        if len(shape) != 2:
            return f"expected a 2-D linear weight [out_features, in_features], got shape {list(shape)}"
        k = shape[1]
        if self.bits == 8:
            return None
        fits = ", ".join(f"qb4w:{g}" for g in valid_group_sizes(k)) or "qc8w only"
        if self.group_size is None:
            if k % XNN_MIN_BLOCKSIZE:
                return (f"in_features={k} is not a multiple of {XNN_MIN_BLOCKSIZE} (ExecuTorch 1.4.1 writes qc4w as "
                        f"qbint4 with one group per row; XNNPACK's int4 blocks are multiples of {XNN_MIN_BLOCKSIZE}; "
                        f"fits: {fits})")
        elif k % self.group_size:
            return (f"in_features={k} is not divisible by the group size {self.group_size} (XNNPACK's int4 "
                    f"blocks are multiples of {XNN_MIN_BLOCKSIZE}; fits: {fits})")
        return None

    def quantize(self, w: Any, method: Method) -> QuantizedTensor:
        """Codes and scales of ``w`` ``[N, K]``: qcint8, or qbint4 (group K for ``qc4w``)."""
        if self.bits == 8:
            return quantize_per_channel(w, bits=8, axis=0, method=method)
        return quantize_blockwise(w, group_size=self.group_size or int(w.shape[1]), method=method)


@dataclass(frozen=True)
class XnnquantConfig(AOBaseConfig):
    """torchao ``quantize_`` config: linear weights quantized by xnnquant, for ExecuTorch.

    ``weights``: ``"qb4w:32"`` (any multiple of 32 dividing ``in_features``), ``"qc4w"`` or
    ``"qc8w"``.  ``method``: ``"mse"`` (scale search, the default) or ``"minmax"``.
    ``activations``: ``"int8_dynamic"`` or None (weight-only; see the module docstring).
    Bad values raise ``XnnquantError`` at construction.
    """

    weights: str = "qb4w:32"
    method: Method = "mse"
    activations: str | None = "int8_dynamic"

    def __post_init__(self) -> None:
        WeightScheme.parse(self.weights)
        if self.method not in METHODS:
            raise XnnquantError(f"unknown method: got {self.method!r}, expected one of {', '.join(METHODS)}")
        if self.activations not in ACTIVATIONS:
            raise XnnquantError(f"unknown activations: got {self.activations!r}, expected 'int8_dynamic' or None")
        if self.activations is None:
            warnings.warn(
                "activations=None: ExecuTorch 1.4.1's XnnpackPartitioner drops the scales of weight-only int-x "
                "linears (the .pte computes with the integer codes; measured 1500x too large for int8); use "
                "activations='int8_dynamic' for ExecuTorch", UserWarning, stacklevel=3)

    @property
    def scheme(self) -> WeightScheme:
        return WeightScheme.parse(self.weights)

    def fits(self, module: Any, fqn: str = "") -> bool:
        """A ``quantize_`` filter: True for linears this config can quantize, False otherwise."""
        return isinstance(module, torch.nn.Linear) and self.scheme.refusal(tuple(module.weight.shape)) is None

    def quantize_weight(self, weight: Any) -> IntxUnpackedToInt8Tensor:
        """torchao's tensor holding our codes and scales for ``weight`` ``[N, K]`` (no checks
        beyond the scheme's own)."""
        scheme = self.scheme
        qt = scheme.quantize(weight.detach(), self.method)
        codes = torch.from_numpy(np.ascontiguousarray(qt.codes))
        scale = torch.from_numpy(np.ascontiguousarray(qt.scale.reshape(qt.codes.shape[0], -1)))
        group = qt.codes.shape[1] // scale.shape[1]
        return IntxUnpackedToInt8Tensor(
            qdata=codes,
            scale=scale,
            zero_point=torch.zeros(scale.shape, dtype=torch.int8),
            target_dtype=torch.int8 if scheme.bits == 8 else torch.int4,
            block_size=(1, group),
            dtype=weight.dtype,
            activation_quantization=ACTIVATIONS[self.activations],
        )


def _layer_name(module: Any) -> str:
    """The module's name in the model being quantized, read from torchao's walk (see the
    module docstring), or a description of the module."""
    frame: FrameType | None = sys._getframe(2)
    for _ in range(8):
        if frame is None:
            break
        if frame.f_globals.get("__name__", "").startswith("torchao."):
            local = frame.f_locals
            if isinstance(local.get("cur_fqn"), str):
                return repr(local["cur_fqn"].rstrip(".") or "<model>")
            if isinstance(local.get("fqn"), str):
                return repr(local["fqn"] or "<model>")
        frame = frame.f_back
    return f"{type(module).__name__} with weight {list(getattr(module, 'weight', torch.empty(0)).shape)}"


@register_quantize_module_handler(XnnquantConfig)
def _quantize_module(module: Any, config: XnnquantConfig, *, parameter_name: str = "weight") -> Any:
    """torchao's handler: swap ``module.<parameter_name>`` for our quantized tensor."""
    weight = getattr(module, parameter_name, None)
    if not isinstance(weight, torch.Tensor):
        raise XnnquantError(f"layer {_layer_name(module)} has no tensor {parameter_name!r} to quantize")
    why = config.scheme.refusal(tuple(weight.shape))
    if why is not None:
        raise XnnquantError(
            f"layer {_layer_name(module)} does not fit weights={config.weights!r}: {why}; "
            "to skip such layers pass filter_fn=config.fits to quantize_"
        )
    new = config.quantize_weight(weight)
    setattr(module, parameter_name, torch.nn.Parameter(new, requires_grad=False))
    return module
