"""ExecuTorch 1.4.1's own serialization of a one-delegate program: the oracle of the writer.

``lowered_pte(payload, inputs, outputs)`` is the ``.pte`` ExecuTorch writes for an
``XnnpackBackend`` delegate running ``payload``: a stub module with those inputs and
outputs (its body makes zero tensors of the output shapes, laid out in their dim orders)
is exported with ``torch.export``; a ``LoweredBackendModule`` around it, with the payload
as its processed bytes and the named data in a ``NamedDataStore`` (16-aligned, keys
sorted), gives ``.buffer(extract_delegate_segments=True)``.  ``dynamic=True`` marks the
stub's input and output specs ``DYNAMIC_BOUND`` before ExecuTorch's memory planning.
This was xnnquant's own ``to_pte`` before the writer (``xnnquant.pte.writer``) replaced it.

Imports torch and executorch.exir: tests only.
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch
from executorch.exir._serialize._named_data_store import NamedDataStore
from executorch.exir.lowered_backend_module import LoweredBackendModule
from executorch.exir.passes.memory_planning_pass import MemoryPlanningPass
from executorch.exir.schema import TensorShapeDynamism
from executorch.exir.tensor import TensorSpec as ExirSpec

from xnnquant.graph.program import TensorSpec


@functools.lru_cache(maxsize=16)
def _stub(inputs: tuple[TensorSpec, ...], outputs: tuple[TensorSpec, ...]) -> Any:
    def zeros(spec: TensorSpec) -> torch.Tensor:
        order = spec.dim_order or tuple(range(len(spec.shape)))
        dtype = torch.from_numpy(np.zeros(0, spec.dtype)).dtype
        return torch.zeros(spec.shape, dtype=dtype).permute(order).contiguous().permute(
            [order.index(d) for d in range(len(order))])

    class Stub(torch.nn.Module):
        def forward(self, *args: Any) -> tuple[torch.Tensor, ...]:
            return tuple(zeros(spec) for spec in outputs)

    return torch.export.export(Stub(), tuple(zeros(spec) for spec in inputs), strict=False)


class _BoundedIO(MemoryPlanningPass):
    def run(self, graph_module: Any, graph_signature: Any = None) -> Any:
        for node in graph_module.graph.nodes:
            io = [node] if node.op == "placeholder" else list(node.args[0]) if node.op == "output" else []
            for spec in (n.meta.get("spec") for n in io):
                if isinstance(spec, ExirSpec):
                    spec.shape_dynamism = TensorShapeDynamism.DYNAMIC_BOUND
        return super().run(graph_module, graph_signature)


def lowered_pte(payload: bytes, inputs: Sequence[TensorSpec], outputs: Sequence[TensorSpec],
                named_data: Mapping[str, bytes] | None = None, dynamic: bool = False) -> bytes:
    store = None
    if named_data:
        data_store = NamedDataStore()
        for key in sorted(named_data):
            data_store.add_named_data(key, bytes(named_data[key]), alignment=16)
        store = data_store.get_named_data_store_output()
    lowered = LoweredBackendModule(_stub(tuple(inputs), tuple(outputs)), "XnnpackBackend", payload, [], store)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return bytes(lowered.buffer(extract_delegate_segments=True,
                                    memory_planning=_BoundedIO() if dynamic else None))


def planned_tensors(pte: bytes, method: int = 0) -> list[tuple[int, list[int]]]:
    """(scalar type, sizes) of every planned tensor of a program's method, read by ExecuTorch's
    own deserializer (sizes at their upper bounds: what the memory plan holds)."""
    from executorch.exir._serialize import _deserialize_pte_binary

    plan = _deserialize_pte_binary(pte).program.execution_plan[method]
    return [(int(v.val.scalar_type), list(v.val.sizes)) for v in plan.values
            if type(v.val).__name__ == "Tensor" and v.val.allocation_info is not None]
