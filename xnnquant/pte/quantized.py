"""ExecuTorch's quantized kernels that xnnquant's programs call: the quantized embedding lookups.

They are not ATen operators and not among the portable kernels: ExecuTorch ships them in
its quantized kernels library (``kernels/quantized``, the ``quantized_ops_lib`` target a
device runtime must link; the pip runtime registers them only once
``executorch.kernels.quantized`` is imported, 240 -> 259 registered operators).  A program
calling them is written like any portable call (``portable.portable_call`` with an
``OutKernel``, whose schema ``kernels/quantized/quantized.yaml`` of executorch 1.4.1
declares) and run after ``load_quantized_kernels()``.

What the 1.4.1 kernels compute, measured on the runtime (``tests/test_export_embeddings.py``)::

    out[..., j] = (code(w[id], j) - zp[id, j // g]) * scale[id, j // g]     float32 arithmetic
      g = D / scales.size(1) (2-D scales), D (1-D scales: one per row); no zero points: zp = 0

    embedding_byte   weight int8 or uint8 (V, D), the code is the byte
    embedding_4bit   weight uint8 (V, D / 2), two codes a byte, the FIRST in the HIGH nibble:
                     code(j) = (byte[j / 2] >> 4) - 8 for even j, (byte[j / 2] & 15) - 8 for odd j

* ``.dtype_out`` reads scales of float32, float16 or bfloat16 (upcast to float32); ``.out``
  reads them as the out tensor's dtype without a check (bf16 or fp16 scales under a float32
  out read garbage): the programs call ``.dtype_out``.  ``dtype``, when given, must be the out
  tensor's dtype (else the process aborts); zero points must be the out tensor's dtype.
  ``weight_quant_min`` / ``weight_quant_max`` are not used (only min <= max is checked).
* ids: ``embedding_byte`` takes int64 only (int32 aborts the process), ``embedding_4bit``
  int64 or int32.
* an id outside ``[0, V)``: ``embedding_byte`` aborts the whole process (SIGABRT, "Index out
  of bounds for weight"); ``embedding_4bit`` does not check it and reads outside the table
  (garbage, or SIGSEGV far out).  The portable ``aten::embedding.out`` returns an error
  (``InvalidArgument``, the method fails) instead; so ``embedding_call`` first looks the ids
  up in a ``(V, 1)`` bool table with it, the *guard*: an id out of range fails the method
  with an error before the quantized kernel reads it (V bytes of constant data).
* without the quantized kernels loaded the program loads, and running it fails with
  ``OperatorMissing`` (error 0x14).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

from ..errors import UnsupportedConfigError, missing_extra
from .builder import MethodBuilder

#: The namespace of the quantized kernels.
NAMESPACE = "quantized_decomposed"
#: The out-variant schemas of the kernels called (``kernels/quantized/quantized.yaml``, 1.4.1).
SCHEMAS = {
    "embedding_byte.dtype_out": "quantized_decomposed::embedding_byte.dtype_out(Tensor weight, Tensor weight_scales, "
                                "Tensor? weight_zero_points, int weight_quant_min, int weight_quant_max, "
                                "Tensor indices, *, ScalarType? dtype=None, Tensor(a!) out) -> Tensor(a!)",
    "embedding_4bit.dtype_out": "quantized_decomposed::embedding_4bit.dtype_out(Tensor weight, Tensor weight_scales, "
                                "Tensor? weight_zero_points, int weight_quant_min, int weight_quant_max, "
                                "Tensor indices, ScalarType? dtype=None, *, Tensor(a!) out) -> Tensor(a!)",
}
#: Kernels of ExecuTorch's ``dim_order_ops`` (``exir/passes/dim_order_ops_registry.py``, 1.4.1),
#: portable kernels outside ATen: a copy into another dim order.
DIM_ORDER_SCHEMAS = {
    "_clone_dim_order.out": "dim_order_ops::_clone_dim_order.out(Tensor self, *, bool non_blocking=False, "
                            "int[]? dim_order=None, Tensor(a!) out) -> Tensor(a!)",
}
#: The kernel of each code width (bits -> key of ``SCHEMAS``).
EMBEDDING_KERNELS = {8: "embedding_byte.dtype_out", 4: "embedding_4bit.dtype_out"}


@dataclass(frozen=True)
class OutKernel:
    """A kernel outside ATen, given by its out-variant schema (the text of ``SCHEMAS``);
    ``portable.portable_call`` calls it as it calls an ATen operator's out variant."""

    schema: str

    @functools.cached_property
    def _schema(self) -> Any:
        try:
            import torch
        except ImportError:
            raise missing_extra("torch", "torch", "emitting ExecuTorch's quantized kernels") from None
        return torch._C.parse_schema(self.schema)

    @property
    def _overloadname(self) -> str:
        return str(self._schema.overload_name)


@functools.cache
def kernel(key: str) -> OutKernel:
    """The ``OutKernel`` of ``SCHEMAS[key]`` (or ``DIM_ORDER_SCHEMAS[key]``)."""
    return OutKernel(SCHEMAS.get(key) or DIM_ORDER_SCHEMAS[key])


def embedding_call(method: MethodBuilder, bits: int, weight: int, scales: int, indices: int, out: int, *,
                   quant_min: int, quant_max: int, guard: int) -> int:
    """Append a quantized embedding lookup to ``method``: the guard's lookup (module
    docstring), then ``quantized_decomposed::embedding_{byte,4bit}.dtype_out``.

    Value indices: ``weight`` int8 ``(V, D)`` (8 bits) or uint8 ``(V, D / 2)`` (4 bits, high
    nibble first); ``scales`` ``(V,)`` (one per row) or ``(V, D / g)``, float32 or bfloat16;
    ``indices`` int64, any shape; ``out`` float32 ``indices.shape + (D,)``; ``guard`` bool
    ``(V, 1)``.  ``quant_min`` / ``quant_max``: the codes' range (carried, not read).
    Returns ``out``.
    """
    import torch

    from .portable import portable_call

    portable_call(method, torch.ops.aten.embedding.default, (guard, indices))
    if bits not in EMBEDDING_KERNELS:
        raise UnsupportedConfigError(f"ExecuTorch's quantized embedding kernels take 8 or 4 bits here: got {bits}")
    result = portable_call(method, kernel(EMBEDDING_KERNELS[bits]), (weight, scales, None, quant_min, quant_max,
                                                                     indices), {"dtype": torch.float32}, out=out)
    assert isinstance(result, int)
    return result


#: ExecuTorch's LLM kernels (``extension/llm/custom_ops``: the ``custom_ops`` library a device
#: runtime links, as ``llama_main`` does), out variants of the ``llama::`` operators that
#: ``executorch.extension.llm.custom_ops`` gives torch.  The pip runtime registers them once
#: that module is imported (240 -> 248 registered operators), ``TextLLMRunner`` included (it
#: shares the pip runtime's registry).
LLAMA_NAMESPACE = "llama"
LLAMA_KERNELS = frozenset({
    "llama::custom_sdpa.out", "llama::sdpa_with_kv_cache.out", "llama::update_cache.out",
    "llama::update_cache_with_indices.out", "llama::custom_quantized_sdpa.out", "llama::fast_hadamard_transform.out",
})


def calls_llama_kernels(operators: Any) -> bool:
    """True when a program's operators include one of ExecuTorch's LLM kernels."""
    return any(str(name).startswith(f"{LLAMA_NAMESPACE}::") for name in operators)


@functools.cache
def load_llama_kernels() -> None:
    """Register ExecuTorch's LLM kernels with the runtime of this process (once), and their
    operators with torch; ``UnsupportedConfigError`` when the runtime still lacks them."""
    try:
        import executorch.extension.llm.custom_ops.custom_ops  # noqa: F401  (loads libcustom_ops_aot_lib)
        from executorch.extension.pybindings import portable_lib
    except ImportError:
        raise missing_extra("xnnpack", "executorch", "running ExecuTorch's LLM kernels") from None
    missing = sorted(LLAMA_KERNELS - set(portable_lib._get_operator_names()))
    if missing:
        raise UnsupportedConfigError(f"the ExecuTorch runtime has no kernel for {', '.join(missing)} after importing "
                                     "executorch.extension.llm.custom_ops: expected executorch 1.4.1's LLM kernels")


def load_kernels(operators: Any) -> None:
    """Register the kernel libraries a program's operators need (quantized, LLM)."""
    if calls_quantized_kernels(operators):
        load_quantized_kernels()
    if calls_llama_kernels(operators):
        load_llama_kernels()


def calls_quantized_kernels(operators: Any) -> bool:
    """True when a program's operators (``PteProgram.operators``) include a quantized kernel."""
    return any(str(name).startswith(f"{NAMESPACE}::") for name in operators)


@functools.cache
def load_quantized_kernels() -> None:
    """Register ExecuTorch's quantized kernels with the runtime of this process (once), as a
    program calling them needs; ``UnsupportedConfigError`` when the runtime still lacks them."""
    try:
        import executorch.kernels.quantized  # noqa: F401  (loads libquantized_ops_aot_lib)
        from executorch.extension.pybindings import portable_lib
    except ImportError:
        raise missing_extra("xnnpack", "executorch", "running ExecuTorch's quantized kernels") from None
    registered = set(portable_lib._get_operator_names())
    missing = [f"{NAMESPACE}::{key}" for key in SCHEMAS if f"{NAMESPACE}::{key}" not in registered]
    if missing:
        raise UnsupportedConfigError(f"the ExecuTorch runtime has no kernel for {', '.join(missing)} after importing "
                                     "executorch.kernels.quantized: expected executorch 1.4.1's quantized kernels")
