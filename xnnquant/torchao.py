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

Activation-aware methods (``"act_mse"``, ``"gptq"``) take per-layer calibration through the
config itself, ``calibration={layer name or module: Calibration or array}``, which
``calibrate(model, batches)`` collects with forward pre-hooks on the model's linears
(``mask=`` leaves padding rows out, as ``xq.export``'s ``calibration_mask=``)::

    calibration = calibrate(model, batches, mask=1)   # {"layer.0.attention.self.query": Calibration, ...}
    quantize_(model, XnnquantConfig("qb4w:32", method="gptq", calibration=calibration))

rather than torchao's observe-then-convert two-step (``quantize_`` once to insert observers,
run the model, ``quantize_`` again to convert): the statistics often come from elsewhere
than the torch model being converted (the numpy MiniLM, a sequential calibration that
re-runs each layer after quantizing the previous ones, stored ``Calibration`` objects), a
mapping takes all of them, the config stays a plain value that one ``quantize_`` call
applies, and the model carries no observer state between two calls.  Keys are layer names
as ``named_modules`` gives them (they survive ``copy.deepcopy`` of the model) or the module
objects themselves.

A layer the config does not fit (not a 2-D linear weight, ``K`` not divisible by the group
size, ``K`` not a multiple of 32 for int4, no calibration for an activation-aware method)
is refused with an ``XnnquantError`` naming it.
To skip such layers instead, pass the config's own filter:
``quantize_(model, config, filter_fn=config.fits)``.

torchao's handler signature gives the module but not its name; the name (for refusals and
for ``calibration`` keys) is read from the frame of torchao's ``quantize_`` walk that called
the handler (its ``cur_fqn`` / ``fqn`` local); when that frame is not there, refusals
describe the module by its shape and calibration must be keyed by module.

Importing this module imports torch and torchao (the ``torchao`` extra:
``pip install 'xnnquant[torchao]'``); ``import xnnquant`` does not.
"""

from __future__ import annotations

import sys
import warnings
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from types import FrameType
from typing import Any

import numpy as np

from . import arguments
from .constants import XNN_MIN_BLOCKSIZE
from .errors import XnnquantError, missing_extra
from .frontend.weights import Layer, LayerKind, SchemeKind, WeightScheme
from .schemes import quantize_blockwise
from .schemes.blockwise import valid_group_sizes
from .schemes.calibration import Calibration
from .schemes.checks import ACTIVATION_AWARE_METHODS, Method
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
METHODS = ("minmax", "mse", *ACTIVATION_AWARE_METHODS)


def parse_scheme(text: Any) -> WeightScheme:
    """``weights=`` as the export's ``WeightScheme``: a quantized one (``WEIGHT_SCHEMES``)."""
    scheme = WeightScheme.parse(text)
    if not scheme.is_quantized:
        raise XnnquantError(f"weights={text!r} quantizes nothing: expected one of {', '.join(WEIGHT_SCHEMES)} "
                            "(leave the layers out of quantize_ to keep them float)")
    return scheme


def executorch_refusal(scheme: WeightScheme, shape: tuple[int, ...]) -> str | None:
    """Why a linear weight of ``shape`` cannot take ``scheme`` through ExecuTorch's lowering
    (the export's refusals, and ExecuTorch 1.4.1 writing qc4w as qbint4 with one group per
    row, so that ``in_features`` must be a multiple of 32), or None when it can."""
    if len(shape) != 2:
        return f"expected a 2-D linear weight [out_features, in_features], got shape {list(shape)}"
    k = shape[1]
    if scheme.kind is SchemeKind.QC4W and k % XNN_MIN_BLOCKSIZE:
        fits = ", ".join(f"qb4w:{g}" for g in valid_group_sizes(k)) or "qc8w only"
        return (f"in_features={k} is not a multiple of {XNN_MIN_BLOCKSIZE} (ExecuTorch 1.4.1 writes qc4w as "
                f"qbint4 with one group per row; XNNPACK's int4 blocks are multiples of {XNN_MIN_BLOCKSIZE}; "
                f"fits: {fits})")
    return scheme.refusal(Layer(LayerKind.LINEAR, k))


def executorch_quantize(scheme: WeightScheme, w: Any, method: Method,
                        calibration: Calibration | Any = None) -> QuantizedTensor:
    """Codes and scales of ``w`` ``[N, K]`` as ExecuTorch stores ``scheme``: qcint8, or qbint4
    (qc4w: one group of K per row)."""
    if scheme.kind is SchemeKind.QC4W:
        return quantize_blockwise(w, group_size=int(w.shape[1]), method=method, calibration=calibration)
    q = scheme.quantize(w, method, calibration)
    assert isinstance(q, QuantizedTensor)
    return q


@dataclass(frozen=True)
class XnnquantConfig(AOBaseConfig):
    """torchao ``quantize_`` config: linear weights quantized by xnnquant, for ExecuTorch.

    ``weights``: ``"qb4w:32"`` (any multiple of 32 dividing ``in_features``), ``"qc4w"`` or
    ``"qc8w"``.  ``method``: ``"mse"`` (scale search, the default), ``"minmax"``, or the
    activation-aware ``"act_mse"`` / ``"gptq"`` with ``calibration``: layer name (or
    module) -> ``Calibration`` or float array ``(tokens, in_features)``, see ``calibrate``.
    ``activations``: ``"int8_dynamic"`` or None (weight-only; see the module docstring).
    Bad values raise ``XnnquantError`` at construction.
    """

    weights: str = "qb4w:32"
    method: Method = "mse"
    activations: str | None = "int8_dynamic"
    calibration: Mapping[Any, Any] | None = field(default=None, repr=False, compare=False)

    def __post_init__(self) -> None:
        parse_scheme(self.weights)
        for name, spellings in (("method", METHODS), ("activations", ACTIVATIONS)):  # case and spaces ignored
            text = arguments.spelling(getattr(self, name))
            if text is not None and text in spellings:
                object.__setattr__(self, name, text)
        if not isinstance(self.method, str) or self.method not in METHODS:
            raise XnnquantError(f"unknown method: got {arguments.shown(self.method)}, expected one of "
                                f"{', '.join(METHODS)}")
        if not (self.activations is None or (isinstance(self.activations, str) and self.activations in ACTIVATIONS)):
            raise XnnquantError(f"unknown activations: got {arguments.shown(self.activations)}, expected "
                                "'int8_dynamic' or None")
        if self.calibration is not None and not isinstance(self.calibration, Mapping):
            raise XnnquantError(f"calibration must map layer names (or modules) to calibrations: got "
                                f"{arguments.shown(self.calibration)}, expected {{layer name: Calibration or "
                                "(tokens, in_features) array} (see calibrate)")
        aware = self.method in ACTIVATION_AWARE_METHODS
        if aware and not self.calibration:
            raise XnnquantError(f"method {self.method!r} needs calibration: got none, expected calibration="
                                "{layer name: Calibration or (tokens, in_features) array} (see calibrate)")
        if not aware and self.calibration is not None:
            raise XnnquantError(f"method {self.method!r} does not use calibration: got a calibration mapping, "
                                f"expected one of the activation-aware methods {', '.join(ACTIVATION_AWARE_METHODS)}")
        if self.activations is None:
            warnings.warn(
                "activations=None: ExecuTorch 1.4.1's XnnpackPartitioner drops the scales of weight-only int-x "
                "linears (the .pte computes with the integer codes; measured 1500x too large for int8); use "
                "activations='int8_dynamic' for ExecuTorch", UserWarning, stacklevel=3)

    @property
    def scheme(self) -> WeightScheme:
        return parse_scheme(self.weights)

    def fits(self, module: Any, fqn: str = "") -> bool:
        """A ``quantize_`` filter: True for linears this config can quantize, False otherwise."""
        return (isinstance(module, torch.nn.Linear)
                and executorch_refusal(self.scheme, tuple(module.weight.shape)) is None)

    def calibration_for(self, module: Any, name: str | None) -> Any:
        """This layer's calibration (keyed by module, else by name), or None."""
        if not self.calibration:
            return None
        for key, value in self.calibration.items():
            if key is module:
                return value
        return self.calibration.get(name) if name is not None else None

    def quantize_weight(self, weight: Any, calibration: Any = None) -> IntxUnpackedToInt8Tensor:
        """torchao's tensor holding our codes and scales for ``weight`` ``[N, K]`` (no checks
        beyond the scheme's own)."""
        scheme = self.scheme
        qt = executorch_quantize(scheme, weight.detach(), self.method, calibration)
        codes = torch.from_numpy(np.ascontiguousarray(qt.codes))
        scale = torch.from_numpy(np.ascontiguousarray(qt.scale.reshape(qt.codes.shape[0], -1)))
        group = qt.codes.shape[1] // scale.shape[1]
        return IntxUnpackedToInt8Tensor(
            qdata=codes,
            scale=scale,
            zero_point=torch.zeros(scale.shape, dtype=torch.int8),
            target_dtype=torch.int8 if scheme.kind is SchemeKind.QC8W else torch.int4,
            block_size=(1, group),
            dtype=weight.dtype,
            activation_quantization=ACTIVATIONS[self.activations],
        )


def _layer_fqn() -> str | None:
    """The name of the module being quantized, read from torchao's ``quantize_`` walk (see
    the module docstring), or None."""
    frame: FrameType | None = sys._getframe(2)
    for _ in range(8):
        if frame is None:
            break
        if frame.f_globals.get("__name__", "").startswith("torchao."):
            local = frame.f_locals
            if isinstance(local.get("cur_fqn"), str):
                return str(local["cur_fqn"]).rstrip(".")
            if isinstance(local.get("fqn"), str):
                return str(local["fqn"])
        frame = frame.f_back
    return None


def _describe(module: Any, fqn: str | None) -> str:
    if fqn is not None:
        return repr(fqn or "<model>")
    return f"{type(module).__name__} with weight {list(getattr(module, 'weight', torch.empty(0)).shape)}"


@register_quantize_module_handler(XnnquantConfig)
def _quantize_module(module: Any, config: XnnquantConfig, *, parameter_name: str = "weight") -> Any:
    """torchao's handler: swap ``module.<parameter_name>`` for our quantized tensor."""
    fqn = _layer_fqn()
    weight = getattr(module, parameter_name, None)
    if not isinstance(weight, torch.Tensor):
        raise XnnquantError(f"layer {_describe(module, fqn)} has no tensor {parameter_name!r} to quantize")
    if type(weight) not in (torch.Tensor, torch.nn.Parameter) or not weight.dtype.is_floating_point:
        raise XnnquantError(f"layer {_describe(module, fqn)} is quantized already: its {parameter_name} is a "
                            f"{type(weight).__name__} of {weight.dtype}, expected a float tensor (apply quantize_ to "
                            "the float model, once)")
    why = executorch_refusal(config.scheme, tuple(weight.shape))
    if why is not None:
        raise XnnquantError(
            f"layer {_describe(module, fqn)} does not fit weights={config.weights!r}: {why}; "
            "to skip such layers pass filter_fn=config.fits to quantize_"
        )
    calibration = config.calibration_for(module, fqn)
    if config.method in ACTIVATION_AWARE_METHODS and calibration is None:
        named = ", ".join(repr(k) if isinstance(k, str) else type(k).__name__ for k in config.calibration or {})
        raise XnnquantError(
            f"layer {_describe(module, fqn)}: method {config.method!r} needs its calibration, and the mapping "
            f"has none for it (keys: {named}); key it by the name named_modules gives, or by the module"
        )
    new = config.quantize_weight(weight, calibration)
    setattr(module, parameter_name, torch.nn.Parameter(new, requires_grad=False))
    return module


def _chosen(filter_fn: Any, module: Any, name: str) -> bool:
    """``filter_fn(module, name)``, which must give True or False."""
    try:
        chosen = filter_fn(module, name)
    except Exception as exc:  # the caller's function: say where its error came from
        raise XnnquantError(f"filter_fn(module, {name!r}) failed: {type(exc).__name__}: {exc}") from None
    return arguments.flag(chosen, f"filter_fn(module, {name!r})")


def calibrate(model: Any, batches: Iterable[Any], *, runtime_quantized: bool = True,
              filter_fn: Any = None, mask: Any = None) -> dict[str, Calibration]:
    """The inputs every ``torch.nn.Linear`` of ``model`` sees on ``batches``, one
    ``Calibration`` per layer name (``named_modules``), for ``XnnquantConfig(calibration=)``.

    ``batches``: each a tensor or a tuple of positional arguments of ``model``.
    ``runtime_quantized`` (default True): accumulate each row as XNNPACK's dynamic int8
    path sees it (``Calibration(runtime_quantized=True)``), right for
    ``activations="int8_dynamic"``.  ``filter_fn(module, name)``: which linears (default:
    all).  ``mask``: which rows count (padding tokens should not): one mask per batch,
    bool or 0/1 numbers, shaped as every linear's input rows (``x.shape[:-1]``, e.g.
    ``(batch, tokens)``), or the index of the batch's input that is the mask (as
    ``xq.export``'s ``calibration_mask=``).  Without it every row counts.  A mask of the
    wrong shape, and inputs that are not finite, raise ``XnnquantError`` naming the batch
    and the layer.
    """
    from .frontend.batches import parse_masks

    if not isinstance(model, torch.nn.Module):
        raise XnnquantError(f"model must be a torch.nn.Module: got {arguments.shown(model)}")
    if isinstance(batches, (str, bytes, torch.Tensor, np.ndarray, Mapping)) or not isinstance(batches, Iterable):
        raise XnnquantError(f"batches must be an iterable of batches (each a tensor or a tuple of the model's "
                            f"positional inputs): got {arguments.shown(batches)}")
    runtime_quantized = arguments.flag(runtime_quantized, "runtime_quantized")
    if filter_fn is not None and not callable(filter_fn):
        raise XnnquantError(f"filter_fn must be a callable (module, name) -> bool, or None: got "
                            f"{arguments.shown(filter_fn)}")
    inputs = [batch if isinstance(batch, tuple) else (batch,) for batch in batches]
    for i, batch in enumerate(inputs):
        if not all(isinstance(x, torch.Tensor) for x in batch):
            raise XnnquantError(f"calibration batch {i} must be a tensor or a tuple of tensors: got "
                                f"{', '.join(arguments.shown(x) for x in batch) or 'an empty tuple'}")
    masks = parse_masks(mask, inputs) if mask is not None else None
    calibrations: dict[str, Calibration] = {}
    current = [0]
    hooks = []

    def accumulate(name: str, calibration: Calibration) -> Any:
        def hook(_module: Any, args: tuple[Any, ...]) -> None:  # returns None: a value would replace the input
            b = current[0]
            x = args[0].detach()
            rows_mask = None if masks is None else masks[b]
            if rows_mask is not None and tuple(rows_mask.shape) != tuple(x.shape[:-1]):
                raise XnnquantError(
                    f"mask of batch {b} has shape {tuple(rows_mask.shape)}, but layer {name!r} reads rows of shape "
                    f"{tuple(x.shape[:-1])} (its input's shape but the last dim): expected one bool per row")
            try:
                calibration.add(x, mask=rows_mask)
            except XnnquantError as exc:
                raise XnnquantError(f"calibration batch {b}: the input of layer {name!r} is not usable: {exc}") \
                    from None
        return hook

    for name, module in model.named_modules():
        if isinstance(module, torch.nn.Linear) and (filter_fn is None or _chosen(filter_fn, module, name)):
            calibration = Calibration(module.in_features, runtime_quantized=runtime_quantized)
            calibrations[name] = calibration
            hooks.append(module.register_forward_pre_hook(accumulate(name, calibration)))
    try:
        with torch.no_grad():
            for b, batch in enumerate(inputs):
                current[0] = b
                try:
                    model(*batch)
                except XnnquantError:  # a linear's input that a Calibration refuses, named by the hook
                    raise
                except Exception as exc:  # the model's own error on a batch that does not fit it
                    raise XnnquantError(f"calibration batch {b} ({', '.join(arguments.shown(x) for x in batch)}) "
                                        f"does not run through the model: {type(exc).__name__}: {exc}") from None
    finally:
        for hook in hooks:
            hook.remove()
    return calibrations
