"""Modules torchao already quantized: their codes and scales exported as they are, bit for bit.

A user who ran torchao's ``quantize_`` on a module exports it with ``xq.export``: each
``nn.Linear`` whose weight is a torchao quantized tensor (the subclass ``quantize_`` leaves,
or the same behind torch's parametrizations after ``unwrap_tensor_subclass``) keeps its codes
and scales, stored as the XNNPACK scheme that holds them exactly; ``weights=`` applies to the
module's other (float) layers.  A dynamic-activation config's layer reads its input quantized
per token at run time (``qdint8``, XNNPACK's asymmetric per-token int8, which is torchao's
``int8_asym_per_token``); a weight-only config's reads it in float32 (XNNPACK's f32-qc8w and
f32-qc4w kernels)::

    torchao tensor (config)                                  stored as
    Int8Tensor, one scale per row or one per tensor:         qc8w
      int8 dynamic activations per row (Int8Dynamic-
      ActivationInt8WeightConfig), or none (Int8Weight-
      OnlyConfig)
    IntxUnpackedToInt8Tensor (Int8DynamicActivationIntx-
      WeightConfig, IntxWeightOnlyConfig):
        PerAxis(0), int1 .. int4                              qc4w (dynamic activations and an odd
                                                              in_features: qc8w, as XNNPACK's
                                                              qd8-qc4w kernels compute it wrongly)
        PerAxis(0), int5 .. int8                              qc8w
        PerGroup(G), int1 .. int4, dynamic activations,       qb4w:G
          scales exact in bf16, G a multiple of 32

Refused, naming the layer: weights with zero points (XNNPACK's int8 and int4 weights are
symmetric), blockwise int5 .. int8 (XNNPACK has no blockwise int8), blockwise weight-only
(XNNPACK's blockwise int4 takes int8 dynamic activations only), blockwise scales that bf16
does not hold exactly (XNNPACK stores them as bf16: quantize with
``weight_scale_dtype=torch.bfloat16``), group sizes XNNPACK does not take, static or
pre-scaled activations, other torchao tensors, and torchao weights outside an ``nn.Linear``.

For the export, each such linear is replaced in its parent by a plain ``nn.Linear`` whose
weight is the dequantized float32 tensor ``codes * scale`` carrying a ``Stored`` (attribute
``STORED``), which ``LoweringContext.weight`` stores instead of quantizing; the module's own
layers are put back afterwards (``dequantized_for_export``).  The self-check compares the
program with that float module.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, TypeVar

import numpy as np

from ..constants import XNN_MIN_BLOCKSIZE
from ..datatypes import Datatype
from ..errors import UnsupportedConfigError
from ..tensor import QuantizedTensor

#: Attribute of a stand-in float weight: the ``Stored`` torchao's codes and scales became.
STORED = "xnnquant_stored"

F = TypeVar("F", bound=Callable[..., Any])


@dataclass(frozen=True)
class Stored:
    """A torchao weight as it is exported: its codes and scales, and whether the layer reads
    its input quantized per token at run time (``dynamic``) or in float32."""

    quantized: QuantizedTensor
    dynamic: bool


def stored_of(weight: Any) -> Stored | None:
    """The torchao codes and scales a stand-in weight carries, or None."""
    return getattr(weight, STORED, None)


def is_torchao_tensor(tensor: Any) -> bool:
    """True for one of torchao's quantized tensor subclasses (read without importing torchao)."""
    return any(c.__name__ == "TorchAOBaseTensor" for c in type(tensor).__mro__)


@dataclass(frozen=True)
class Found:
    """A layer holding a torchao weight: its path, the module, and how it is stored (None with
    ``refusal`` saying why it cannot be)."""

    path: str
    module: Any
    stored: Stored | None
    refusal: str = ""


def torchao_layers(module: Any) -> list[Found]:
    """Every submodule of ``module`` (itself included) whose ``weight`` is a torchao tensor."""
    found = []
    for path, sub in module.named_modules():
        try:
            weight = getattr(sub, "weight", None)
        except Exception:  # a parametrization that cannot rebuild its tensor: not torchao's to read here
            continue
        if weight is None or not is_torchao_tensor(weight):
            continue
        if type(sub).__name__ not in ("Linear", "ParametrizedLinear") or weight.dim() != 2:
            found.append(Found(path, sub, None, f"a torchao weight ({type(weight).__name__}, shape "
                                                f"{tuple(weight.shape)}) outside an nn.Linear: xnnquant reads "
                                                "torchao's codes of linear layers only"))
            continue
        stored, refusal = _read(weight)
        found.append(Found(path, sub, stored, refusal))
    return found


def _read(weight: Any) -> tuple[Stored | None, str]:
    """``_stored_as``, checked against torchao's own ``dequantize()`` of the weight: codes and
    scales read in another layout than torchao's (a block size this reading does not know)
    would give other values, and are refused rather than exported."""
    import torch

    stored, why = _stored_as(weight)
    if stored is None:
        return stored, why
    try:
        theirs = weight.dequantize().detach().to(torch.float32).cpu().numpy()
    except Exception as exc:  # a torchao tensor that cannot dequantize itself: nothing to compare with
        return None, f"torchao's dequantize() of it fails ({type(exc).__name__}: {exc})"
    ours = stored.quantized.dequantize()
    # torchao may multiply in its scales' dtype (bf16: a product rounded to 8 bits, 2^-9 off at
    # most); a misread layout puts other scales on whole groups
    if ours.shape != theirs.shape or not np.allclose(ours, theirs, rtol=2.0**-8, atol=0):
        return None, ("its codes and scales, as read here, do not give torchao's own dequantized weight (a layout "
                      "this reader does not know, such as another block size); please report it")
    return stored, ""


def _stored_as(weight: Any) -> tuple[Stored | None, str]:
    """(how ``weight``'s codes and scales are stored, '') or (None, why not)."""
    import torch

    kind = type(weight).__name__
    if kind == "Int8Tensor":
        kwargs = getattr(weight, "act_quant_kwargs", None)
        if getattr(weight, "act_quant_scale", None) is not None or getattr(weight, "act_pre_scale", None) is not None:
            return None, ("its activations are quantized with static scales or pre-scaled (act_quant_scale, "
                          "act_pre_scale): XNNPACK quantizes them per token at run time, unscaled")
        granularity = type(getattr(kwargs, "granularity", None)).__name__
        if kwargs is not None and (granularity not in ("PerRow", "PerToken") or getattr(kwargs, "reduce_range", False)):
            return None, (f"its activations are quantized {granularity}"
                          f"{' with reduce_range' if getattr(kwargs, 'reduce_range', False) else ''}: XNNPACK "
                          "quantizes them per token (PerRow) over the full int8 range")
        codes, scale, zero_point, bits = weight.qdata, weight.scale, getattr(weight, "zero_point", None), 8
        dynamic = kwargs is not None
    elif kind == "IntxUnpackedToInt8Tensor":
        dynamic = getattr(weight, "activation_quantization", None) is not None
        target = getattr(weight, "target_dtype", torch.int8)
        bits = int(str(target).removeprefix("torch.int")) if str(target).startswith("torch.int") else 0
        codes, scale, zero_point = weight.qdata, weight.scale, weight.zero_point
        if not 1 <= bits <= 8:
            return None, f"its codes are {target}: expected torch.int1 .. torch.int8"
    else:
        return None, f"torchao's {kind} has no XNNPACK scheme here (expected Int8Tensor or IntxUnpackedToInt8Tensor)"
    codes = codes.detach().cpu().numpy()
    n, k = codes.shape
    scales = scale.detach().to(torch.float32).cpu().numpy().reshape(n, -1) if scale.numel() != 1 else \
        np.full((n, 1), float(scale), np.float32)
    if zero_point is not None and bool(zero_point.ne(0).any()):
        return None, ("its weights have zero points (an asymmetric mapping): XNNPACK's int8 and int4 weights are "
                      "symmetric; quantize with weight_mapping_type=MappingType.SYMMETRIC")
    low, high = -(1 << (bits - 1)), (1 << (bits - 1)) - 1
    if codes.min(initial=0) < low or codes.max(initial=0) > high:
        return None, f"its codes leave the int{bits} range [{low}, {high}]"
    groups = scales.shape[1]
    if groups == 1:  # one scale per row
        if bits <= 4 and (k % 2 == 0 or not dynamic):
            return Stored(QuantizedTensor(Datatype.qcint4, codes, scales[:, 0], channel_dim=0), dynamic), ""
        return Stored(QuantizedTensor(Datatype.qcint8, codes, scales[:, 0], channel_dim=0), dynamic), ""
    group = k // groups
    if not dynamic:
        return None, (f"a weight-only config in groups of {group} (activations kept in float): XNNPACK's blockwise "
                      "int4 weights take int8 dynamic activations only; quantize with "
                      "Int8DynamicActivationIntxWeightConfig, or PerAxis(0)")
    if bits > 4:
        return None, (f"int{bits} codes in groups of {group}: XNNPACK has no blockwise int8 weights "
                      "(expected PerAxis(0), or int4 codes)")
    if group % XNN_MIN_BLOCKSIZE:
        return None, (f"groups of {group}: XNNPACK's blockwise int4 takes groups that are multiples of "
                      f"{XNN_MIN_BLOCKSIZE}")
    rounded = scales.astype(np.float32).view(np.uint32) & np.uint32(0xFFFF0000)
    if not np.array_equal(rounded, scales.astype(np.float32).view(np.uint32)):
        return None, ("its group scales are float32 that bf16 does not hold exactly, and XNNPACK stores blockwise "
                      "scales as bf16: quantize with weight_scale_dtype=torch.bfloat16 to export them bit for bit")
    return Stored(QuantizedTensor(Datatype.qbint4, codes, scales, group_size=group), dynamic), ""


def _static(activations: Any) -> bool:
    """True when ``activations=`` asks for static int8, in any spelling ``xq.export`` takes (an
    unknown one is left to its own error)."""
    from ..errors import XnnquantError
    from .options import ActivationKind, parse_activations

    try:
        return parse_activations(activations)[0] is ActivationKind.QINT8
    except XnnquantError:
        return False


def refusal(found: list[Found], kwargs: dict[str, Any]) -> str | None:
    """Why the export cannot keep torchao's codes (every layer listed), or None."""
    lines = [f"layer {f.path or '<top level>'!r}: {f.refusal}" for f in found if f.stored is None]
    if _static(kwargs.get("activations", "dynamic")):
        lines.append("activations=" f"{kwargs['activations']!r} rewrites the program into static int8, which would "
                     "quantize torchao's layers again; expected activations='dynamic'")
    if kwargs.get("state_dict") is not None:
        lines.append("state_dict= (a streaming export) reads float weights from a file; torchao's codes are in the "
                     "module: export it without state_dict=")
    if not lines:
        return None
    body = "\n".join(f"  - {line}" for line in lines)
    return f"the module holds weights torchao quantized, and their codes and scales cannot be exported:\n{body}"


@contextlib.contextmanager
def _swapped(module: Any, found: list[Found]) -> Iterator[Any]:
    """``module`` with each found linear replaced by its stand-in (module docstring), then put
    back; yields the module to export (the stand-in itself when ``module`` is the linear)."""
    import torch

    swaps = []
    root = module
    try:
        for f in found:
            stand_in = _stand_in(f, torch)
            if not f.path:
                root = stand_in
                continue
            parent_path, _, name = f.path.rpartition(".")
            parent = module.get_submodule(parent_path)
            swaps.append((parent, name, parent._modules[name]))
            parent._modules[name] = stand_in
        yield root
    finally:
        for parent, name, original in reversed(swaps):
            parent._modules[name] = original


def _stand_in(found: Found, torch: Any) -> Any:
    """A plain ``nn.Linear`` with the dequantized weight (carrying its ``Stored``) and the layer's bias."""
    assert found.stored is not None
    n, k = found.stored.quantized.shape
    bias = found.module.bias
    linear = torch.nn.Linear(k, n, bias=bias is not None, device="meta")
    weight = torch.nn.Parameter(torch.from_numpy(found.stored.quantized.dequantize()), requires_grad=False)
    setattr(weight, STORED, found.stored)
    linear.weight = weight
    if bias is not None:
        linear.bias = torch.nn.Parameter(bias.detach().to(torch.float32), requires_grad=False)
    return linear.train(found.module.training)


def dequantized_for_export(fn: F) -> F:
    """``fn(module, ...)`` (``xq.export``, ``xq.check``) given ``module`` with its torchao linears
    standing in as float ones carrying their codes (module docstring); refused with
    ``UnsupportedConfigError`` when a layer's codes cannot be kept."""

    @functools.wraps(fn)
    def wrapper(module: Any, *args: Any, **kwargs: Any) -> Any:
        found = torchao_layers(module) if callable(getattr(module, "named_modules", None)) else []
        if not found:
            return fn(module, *args, **kwargs)
        why = refusal(found, kwargs)
        if why is not None:
            raise UnsupportedConfigError(why)
        with _swapped(module, found) as stand_in:
            return fn(stand_in, *args, **kwargs)

    return wrapper  # type: ignore[return-value]
