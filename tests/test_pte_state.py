"""Method state in ``.pte`` programs (``MethodBuilder.state``) against ExecuTorch 1.4.1.

Oracles: the real runtime (state kept from one call of a loaded method to the next, a
fresh ``load_method`` starting from the file's values again), and ExecuTorch's own
deserializer and serializer (our bytes read by it and written again are our bytes, the
state's initial values in its mutable data segment).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from executorch.exir._serialize import _deserialize_pte_binary, _PTEFile, _serialize_pte_binary
from executorch.runtime import Runtime

from xnnquant.errors import XnnquantError
from xnnquant.graph import Graph
from xnnquant.pte.builder import ProgramBuilder
from xnnquant.pte.memory import lifetimes, plan_memory
from xnnquant.pte.portable import portable_call

pytestmark = pytest.mark.xnnpack

START = np.array([1.0, 2.0, 3.0], np.float32)


def _accumulator(with_delegate: bool = False) -> ProgramBuilder:
    """``forward(x)``: ``s += x`` (in place, ``aten::add.out`` with ``out=s``), returns ``s * 1``
    (from an XNNPACK delegate when ``with_delegate``, else a clone); also a second state
    with the same initial values, and one with other values, that nothing reads."""
    p = ProgramBuilder()
    m = p.method("forward")
    x = m.input(m.tensor(np.float32, (3,)))
    s = m.state(START)
    m.state(START.copy())  # equal bytes: stored once
    m.state(np.zeros((2, 2), np.int64))
    portable_call(m, torch.ops.aten.add.Tensor, (s, x), out=s)
    if with_delegate:
        g = Graph()
        a = g.input((3,))
        g.output(g.multiply(a, g.constant(np.ones(3, np.float32))))
        y = m.tensor(np.float32, (3,))
        m.delegate_call(m.delegate("XnnpackBackend", g.to_bytes()), [s], [y])
    else:
        y = portable_call(m, torch.ops.aten.clone.default, (s,))
    m.output(y)
    return p


@pytest.mark.parametrize("with_delegate", [False, True])
def test_state_is_kept_between_calls_and_a_fresh_load_starts_from_the_file(with_delegate: bool) -> None:
    pte = _accumulator(with_delegate).to_bytes()
    program = Runtime.get().load_program(pte)
    method = program.load_method("forward")  # executorch.runtime keeps one Method per name
    x = torch.tensor([0.5, -1.0, 2.0])
    for k in (1, 2, 3):
        (out,) = method.execute([x])
        assert torch.equal(out, torch.from_numpy(START) + k * x)
    # a second Method of the same Program: loading it puts the file's values in its state
    # (the Python bindings give both Methods of one Program the same planned memory)
    fresh = program._program.load_method("forward")
    (again,) = fresh((x,))
    assert torch.equal(again, torch.from_numpy(START) + x)
    (other,) = Runtime.get().load_program(pte).load_method("forward").execute([x])
    assert torch.equal(other, torch.from_numpy(START) + x)


def test_executorch_reserializes_our_bytes_with_state() -> None:
    """ExecuTorch's deserializer reads the initial values from its mutable data segment
    (equal values stored once), and its serializer writes our bytes back."""
    p = _accumulator(with_delegate=True)
    ours = p.to_bytes()
    read = _deserialize_pte_binary(ours)
    assert [bytes(b.storage) for b in read.mutable_data] == [b"", START.tobytes(), bytes(32)]
    tensors = [v.val for v in read.program.execution_plan[0].values if hasattr(v.val, "data_buffer_idx")]
    states = [t for t in tensors if t.allocation_info is not None and t.data_buffer_idx > 0]
    assert [t.data_buffer_idx for t in states] == [1, 1, 2]
    read.program.named_data = None  # the deserializer leaves [] where a fresh program has none
    again = bytes(_serialize_pte_binary(_PTEFile(read.program, mutable_data=read.mutable_data,
                                                 named_data=read.named_data), extract_delegate_segments=True))
    assert again == ours


def test_state_shares_its_memory_with_nothing() -> None:
    p = _accumulator()
    m = p.methods[0]
    plan = plan_memory(m)
    live = lifetimes(m)
    states = [i for i, v in enumerate(m.values) if getattr(v, "state", 0)]
    assert len(states) == 3
    end = len(m.instructions) + 1
    for i in states:
        assert live[i] == (0, end)
        size = -(-m.values[i].nbytes // 16) * 16
        for j, offset in plan.offsets.items():
            if j != i:
                other = -(-m.values[j].nbytes // 16) * 16
                assert offset + other <= plan.offsets[i] or plan.offsets[i] + size <= offset


def test_state_refusals() -> None:
    m = ProgramBuilder().method("forward")
    with pytest.raises(XnnquantError, match="does not cast exactly to CHAR"):
        m.state(np.array([1.5], np.float32), dtype=np.int8)
    with pytest.raises(XnnquantError, match="dim_order must be a permutation"):
        m.state(np.zeros((2, 2), np.float32), dim_order=(0, 0))
