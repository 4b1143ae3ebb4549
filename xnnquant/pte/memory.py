"""Memory planning of a method: a byte offset in arena 1 for every planned tensor.

The runtime allocates each arena of ``ExecutionPlan.non_const_buffer_sizes`` once per
loaded method; a planned tensor's data lives at its ``AllocationDetails`` offset in it.
Tensors whose lifetimes are disjoint may share bytes.  The algorithm is ExecuTorch 1.4.1's
default (``greedy`` of exir/memory_planning.py), on lifetimes counted in instructions::

    position 0        before the first instruction: every input is live from here
    position i + 1    instruction i: every tensor it names (directly or inside a
                      TensorList / OptionalTensorList argument) is live here
    position n + 1    after the last instruction: every output is live until here
    lifetime          [first position, last position], both ends included: a tensor an
                      instruction reads never shares bytes with one it writes

    size              nbytes (at the upper bound when DYNAMIC_BOUND) rounded up to 16
    order             largest first; equal sizes: the one appearing later first
                      (appearance: inputs, then the instructions' arguments, then outputs)
    placement         the first shared object none of whose tensors it overlaps in time
                      (at the object's offset 0); else the first object in which it fits
                      above every tensor it overlaps in time; else a new object of its size
    arena 1           the objects end to end, + 64 bytes when the method calls an XNNPACK
                      delegate; ``non_const_buffer_sizes = [0, arena 1]`` (entry 0:
                      constants, unused), [0, 0] when nothing is planned

A planned tensor no instruction, input or output names is live for the whole method, and
so is method state (``Tensor.state``): its values must survive from one call to the next.
Inputs and outputs are planned (the runtime copies inputs into their planned memory).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from ..constants import PTE_TENSOR_ALIGNMENT, PTE_XNNPACK_EXTRA_PLANNED_BYTES, XNNPACK_BACKEND_ID
from .values import OptionalTensorList, ShapeDynamism, Tensor, TensorList

if TYPE_CHECKING:
    from .builder import MethodBuilder

#: The arena every planned tensor lives in (0 is reserved for constants).
PLANNED_MEMORY_ID = 1


@dataclass(frozen=True)
class MemoryPlan:
    """``offsets``: value index -> byte offset in arena 1; ``arena_sizes``: the method's
    ``non_const_buffer_sizes``."""

    offsets: dict[int, int]
    arena_sizes: tuple[int, ...]


@dataclass
class _SharedObject:
    size: int
    placed: list[tuple[int, int, tuple[int, int]]] = field(default_factory=list)  # (offset, size, lifetime)
    offset: int = 0


def _overlap(a: tuple[int, int], b: tuple[int, int]) -> bool:
    return not (a[1] < b[0] or a[0] > b[1])


def _aligned(n: int) -> int:
    return -(-n // PTE_TENSOR_ALIGNMENT) * PTE_TENSOR_ALIGNMENT


def lifetimes(method: MethodBuilder) -> dict[int, tuple[int, int]]:
    """Lifetime of every planned tensor of ``method``, in order of appearance."""
    values = method.values
    planned = {i for i, v in enumerate(values) if isinstance(v, Tensor) and v.planned
               and v.dynamism != ShapeDynamism.DYNAMIC_UNBOUND}
    end = len(method.instructions) + 1
    spans: dict[int, list[int]] = {}

    def touch(index: int, position: int) -> None:
        if index in planned:
            span = spans.setdefault(index, [position, position])
            span[0], span[1] = min(span[0], position), max(span[1], position)

    for index in method.inputs:
        touch(index, 0)
    for position, instruction in enumerate(method.instructions, start=1):
        for arg in instruction.args:
            touch(arg, position)
            value = values[arg]
            if isinstance(value, (TensorList, OptionalTensorList)):
                for item in value.items:
                    if item >= 0:
                        touch(item, position)
    for index in method.outputs:
        touch(index, end)
    for index in sorted(planned - spans.keys()):
        spans[index] = [0, end]
    for index in planned:  # state outlives every call: it shares its bytes with nothing
        value = values[index]
        if isinstance(value, Tensor) and value.state:
            spans[index] = [0, end]
    return {index: (span[0], span[1]) for index, span in spans.items()}


def greedy(sizes: Sequence[int], spans: Sequence[tuple[int, int]]) -> tuple[list[int], int]:
    """Byte offsets of tensors of ``sizes`` bytes live over ``spans`` (both in order of
    appearance), and the bytes of the objects laid end to end (module docstring)."""
    aligned = [_aligned(n) for n in sizes]
    order = sorted(range(len(aligned)), key=lambda k: aligned[k])  # stable: equal sizes keep their order
    order.reverse()
    objects: list[_SharedObject] = []
    where: dict[int, tuple[_SharedObject, int]] = {}
    for k in order:
        size, span = aligned[k], spans[k]
        spot = next(((obj, 0) for obj in objects if not any(_overlap(span, p[2]) for p in obj.placed)), None)
        if spot is None:
            for obj in objects:
                top = max((off + sz for off, sz, other in obj.placed if _overlap(span, other)), default=0)
                if top > 0 and top + size <= obj.size:
                    spot = (obj, top)
                    break
        if spot is None:
            objects.append(_SharedObject(size))
            spot = (objects[-1], 0)
        spot[0].placed.append((spot[1], size, span))
        where[k] = spot
    total = 0
    for obj in objects:
        obj.offset, total = total, total + obj.size
    return [where[k][0].offset + where[k][1] for k in range(len(aligned))], total


def plan_memory(method: MethodBuilder) -> MemoryPlan:
    """Offsets of every planned tensor of ``method`` and its arena sizes (module docstring)."""
    live = lifetimes(method)
    if not live:
        return MemoryPlan({}, (0, 0))
    indices = list(live)
    sizes = []
    for index in indices:
        tensor = method.values[index]
        assert isinstance(tensor, Tensor)  # lifetimes() keeps only tensors
        sizes.append(tensor.nbytes)
    offsets, total = greedy(sizes, [live[i] for i in indices])
    if any(d.backend_id == XNNPACK_BACKEND_ID for d in method.delegates):
        total += PTE_XNNPACK_EXTRA_PLANNED_BYTES
    return MemoryPlan(dict(zip(indices, offsets)), (0, total))
