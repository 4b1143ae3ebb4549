"""Mixed programs: ATen operators as ExecuTorch portable-kernel calls beside XNNPACK delegates.

Oracles: the real ExecuTorch 1.4.1 runtime runs each hand-built program, and torch (eager)
computes what it must return; every value is an integer or a sum of few small integers,
so float results are exact and compared exactly.  The runtime's own operator registry
is the list the emitter checks against.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from xnnquant.errors import UnsupportedConfigError, XnnquantError
from xnnquant.graph import Graph
from xnnquant.pte.builder import ProgramBuilder
from xnnquant.pte.portable import kernel_name, out_variant, portable_call, registered_operators
from xnnquant.pte.values import ShapeDynamism

pytestmark = pytest.mark.xnnpack
aten = torch.ops.aten


def _run(program: ProgramBuilder, inputs: list[torch.Tensor], method: str = "forward") -> list[torch.Tensor]:
    from executorch.runtime import Runtime

    loaded = Runtime.get().load_program(program.to_bytes())  # kept alive while its method runs
    return list(loaded.load_method(method).execute(inputs))


def _fully_connected_payload(shape: tuple[int, ...], weight: np.ndarray, bias: np.ndarray) -> bytes:
    g = Graph()
    x = g.input(shape)
    g.output(g.fully_connected(x, g.constant(weight), g.constant(bias)))
    return g.to_bytes()


def test_registered_operators_are_the_runtimes() -> None:
    from executorch.extension.pybindings import portable_lib

    # the quantized kernels library adds its quantized_decomposed:: kernels once a program needing
    # them was run in this process, and ExecuTorch's LLM kernels (llama::, with preprocess::
    # and llama::fallback) once an LLM test of this worker loaded them (pte/quantized.py):
    # the portable ones are the rest
    added = ("quantized_decomposed::", "llama::", "preprocess::")
    names = frozenset(n for n in portable_lib._get_operator_names() if not n.startswith(added))
    assert registered_operators() == names
    assert len(registered_operators()) == 240


@pytest.mark.parametrize(("op", "kernel"), [
    (aten.embedding.default, "aten::embedding.out"),
    (aten.add.Tensor, "aten::add.out"),
    (aten.add.Scalar, "aten::add.Scalar_out"),
    (aten.lt.Scalar, "aten::lt.Scalar_out"),
    (aten.where.self, "aten::where.self_out"),
    (aten.cumsum.default, "aten::cumsum.out"),
    (aten.arange.start_step, "aten::arange.start_out"),
    (aten.max.dim, "aten::max.dim_max"),
    (aten.view.default, "aten::view_copy.out"),  # views: their _copy operator
    (aten.slice.Tensor, "aten::slice_copy.Tensor_out"),
    (aten.split.Tensor, "aten::split_copy.Tensor_out"),
    (aten.permute.default, "aten::permute_copy.out"),
    (aten.mul.out, "aten::mul.out"),  # already an out variant
])
def test_out_variants(op: object, kernel: str) -> None:
    assert kernel_name(out_variant(op)) == kernel


def test_operators_without_a_kernel_are_refused_by_name() -> None:
    cases = [
        (aten.arange.start, "aten::arange.start has no out variant in torch's schemas: ExecuTorch's portable "
                            "kernels have no kernel for it"),
        (aten.reshape.default, "aten::reshape is a view with no _copy operator: ExecuTorch's portable kernels have "
                               "no kernel for it"),
        (aten.add_.Tensor, "aten::add_.Tensor mutates its inputs (inplace): expected a functional or out-variant "
                           "operator"),
        (aten.linalg_svd.default, "aten::linalg_svd: its out variant aten::linalg_svd.U has no kernel in the "
                                  "ExecuTorch 1.4.1 runtime (none of its 240 registered operators)"),
    ]
    for op, message in cases:
        with pytest.raises(UnsupportedConfigError) as info:
            out_variant(op)
        assert str(info.value) == message
    m = ProgramBuilder().method()
    x = m.tensor(np.float32, (3,))
    with pytest.raises(XnnquantError, match=r"^aten::add.Tensor: unexpected or repeated argument 'beta' \(its "
                                            r"arguments: self, other, alpha\)$"):
        portable_call(m, aten.add.Tensor, (x, x), {"beta": 2})
    with pytest.raises(XnnquantError, match=r"^aten::add.Tensor: a tensor argument must be the index of a Tensor "
                                            r"value: got 7$"):
        portable_call(m, aten.add.Tensor, (x, 7))


def test_embedding_feeds_an_xnnpack_delegate() -> None:
    """int64 ids -> aten::embedding (portable) -> fully connected (XNNPACK) -> output."""
    table = (np.arange(10 * 8) % 7 - 3).astype(np.float32).reshape(10, 8)
    weight = (np.arange(4 * 8) % 5 - 2).astype(np.float32).reshape(4, 8)
    bias = np.array([1, -2, 0, 3], np.float32)
    p = ProgramBuilder()
    m = p.method()
    ids = m.input(m.tensor(np.int64, (2, 5)))
    embedded = portable_call(m, aten.embedding.default, (m.tensor(np.float32, (10, 8), data=table), ids))
    y = m.output(m.tensor(np.float32, (2, 5, 4)))
    m.delegate_call(m.delegate("XnnpackBackend", _fully_connected_payload((2, 5, 8), weight, bias)), [embedded], [y])
    tokens = torch.tensor([[1, 9, 0, 3, 3], [7, 2, 8, 4, 5]])
    (got,) = _run(p, [tokens])
    want = torch.nn.functional.linear(torch.nn.functional.embedding(tokens, torch.from_numpy(table)),
                                      torch.from_numpy(weight), torch.from_numpy(bias))
    assert torch.equal(got, want)
    (call, delegate_call) = m.instructions
    assert m.operators == [("aten::embedding", "out")]
    # embedding.out(weight, indices, padding_idx=-1, scale_grad_by_freq=False, sparse=False, *, out) -> out
    assert [type(m.values[a]).__name__ for a in call.args] == ["Tensor", "Tensor", "Int", "Bool", "Bool", "Tensor",
                                                                "Tensor"]
    assert call.args[-1] == call.args[-2] == embedded and delegate_call.args == (embedded, y)


def test_a_chain_of_portable_operators_matches_torch() -> None:
    """arange -> lt -> where -> cumsum -> add with alpha, on the runtime and in torch."""
    p = ProgramBuilder()
    m = p.method()
    x, y = m.input(m.tensor(np.float32, (6,))), m.input(m.tensor(np.float32, (6,)))
    r = portable_call(m, aten.arange.start_step, (0, 6, 1), {"dtype": torch.int64})
    below = portable_call(m, aten.lt.Scalar, (r, 3))
    picked = portable_call(m, aten.where.self, (below, x, y))
    summed = portable_call(m, aten.cumsum.default, (picked, 0))
    m.output(portable_call(m, aten.add.Tensor, (summed, x), {"alpha": 2}))
    m.output(below)
    xs, ys = torch.tensor([1.0, -2, 3, 4, 5, -6]), torch.tensor([10.0, 20, 30, -40, 50, 60])
    got = _run(p, [xs, ys])
    keep = torch.arange(0, 6, 1, dtype=torch.int64) < 3
    want = torch.add(torch.cumsum(torch.where(keep, xs, ys), 0), xs, alpha=2)
    assert torch.equal(got[0], want) and torch.equal(got[1], keep)
    names = [m.operators[c.op_index] for c in m.instructions]
    assert names == [("aten::arange", "start_out"), ("aten::lt", "Scalar_out"), ("aten::where", "self_out"),
                     ("aten::cumsum", "out"), ("aten::add", "out")]
    # cumsum.out(self, dim, *, dtype=None, out) -> out: the absent dtype is a Null
    cumsum = m.instructions[3]
    assert [type(m.values[a]).__name__ for a in cumsum.args] == ["Tensor", "Int", "Null", "Tensor", "Tensor"]


def test_operators_with_several_outputs() -> None:
    """max.dim (two out tensors, returned as a TensorList) and split (a list out)."""
    p = ProgramBuilder()
    m = p.method()
    x = m.input(m.tensor(np.float32, (3, 4)))
    values, indices = portable_call(m, aten.max.dim, (x, 1))
    parts = portable_call(m, aten.split.Tensor, (x, 2, 1))
    for out in (values, indices, *parts):
        m.output(out)
    xs = torch.tensor([[1.0, 5, 2, 0], [7, -1, 7, 3], [0, 0, 9, 9]])
    got = _run(p, [xs])
    want_values, want_indices = torch.max(xs, 1)
    assert torch.equal(got[0], want_values) and torch.equal(got[1], want_indices)
    assert all(torch.equal(a, b) for a, b in zip(got[2:], torch.split(xs, 2, 1)))
    max_call, split_call = m.instructions
    returned = m.values[max_call.args[-1]]
    assert type(returned).__name__ == "TensorList" and returned.items == (values, indices)
    assert split_call.args[-1] == split_call.args[-2]  # the out list, then the same list returned


def test_a_bounded_program_runs_at_two_sizes() -> None:
    """DYNAMIC_BOUND input (1, 8, 4): portable ops and an XNNPACK delegate at 8 and 3 tokens."""
    weight = (np.arange(2 * 4) % 3 - 1).astype(np.float32).reshape(2, 4)
    bias = np.array([0.5, -1], np.float32)
    p = ProgramBuilder()
    m = p.method()
    x = m.input(m.tensor(np.float32, (1, 8, 4), dynamic=True))
    scaled = portable_call(m, aten.add.Tensor, (x, x), {"alpha": 3})
    running = portable_call(m, aten.cumsum.default, (scaled, 1))
    assert m.values[running].dynamism == ShapeDynamism.DYNAMIC_BOUND
    y = m.output(m.tensor(np.float32, (1, 8, 2), dynamic=True))
    m.delegate_call(m.delegate("XnnpackBackend", _fully_connected_payload((1, 8, 4), weight, bias)), [running], [y])
    for tokens in (8, 3):
        xs = (torch.arange(tokens * 4, dtype=torch.float32).reshape(1, tokens, 4) % 5) - 2
        (got,) = _run(p, [xs])
        want = torch.nn.functional.linear(torch.cumsum(xs + 3 * xs, 1), torch.from_numpy(weight),
                                          torch.from_numpy(bias))
        assert got.shape == (1, tokens, 2) and torch.equal(got, want)


class _Module(torch.nn.Module):
    def forward(self, ids: torch.Tensor, x: torch.Tensor, y: torch.Tensor, table: torch.Tensor) -> tuple:
        e = torch.nn.functional.embedding(ids, table)
        picked = torch.where(torch.lt(x, 3), x, y)
        v, i = torch.max(e, 1)
        return (torch.add(torch.cumsum(picked, 0), x, alpha=2), v, i, torch.split_with_sizes(x, [2, 4], 0),
                torch.permute(e, (2, 0, 1)), x.view(2, 3))


def _describe(values: list, index: int) -> object:
    """A value as (kind, content), tensors as (scalar type, sizes), lists resolved."""
    v = values[index]
    kind = type(v).__name__
    if kind == "Tensor":
        return kind, int(v.scalar_type), list(v.sizes)
    if kind == "IntList":
        return kind, [_describe(values, i) for i in v.items]
    if kind == "TensorList":
        return kind, [_describe(values, i) for i in v.items]
    fields = [f for f in ("value", "int_val", "bool_val", "double_val", "items") if hasattr(v, f)]
    return kind, getattr(v, fields[0]) if fields else None


def test_kernel_calls_are_what_executorchs_emitter_writes() -> None:
    """The same operators through ExecuTorch's own flow (torch.export, to_edge,
    to_executorch): the same kernels, argument for argument."""
    from executorch.exir import to_edge
    from executorch.exir._serialize import _deserialize_pte_binary

    example = (torch.tensor([[1, 2]]), torch.arange(6.0), torch.arange(6.0), torch.ones(10, 4))
    pte = to_edge(torch.export.export(_Module(), example)).to_executorch().buffer
    plan = _deserialize_pte_binary(pte).program.execution_plan[0]
    theirs = [(plan.operators[c.instr_args.op_index].name, plan.operators[c.instr_args.op_index].overload,
               [_describe([e.val for e in plan.values], a) for a in c.instr_args.args]) for c in plan.chains[0].instructions]

    m = ProgramBuilder().method()
    ids, x, y = m.tensor(np.int64, (1, 2)), m.tensor(np.float32, (6,)), m.tensor(np.float32, (6,))
    table = m.tensor(np.float32, (10, 4))
    e = portable_call(m, aten.embedding.default, (table, ids))
    below = portable_call(m, aten.lt.Scalar, (x, 3))
    picked = portable_call(m, aten.where.self, (below, x, y))
    summed = portable_call(m, aten.cumsum.default, (picked, 0))
    portable_call(m, aten.max.dim, (e, 1))
    portable_call(m, aten.add.Tensor, (summed, x), {"alpha": 2})
    portable_call(m, aten.split_with_sizes.default, (x, [2, 4], 0))
    portable_call(m, aten.permute.default, (e, [2, 0, 1]))
    portable_call(m, aten.view.default, (x, [2, 3]))
    ours = [(*m.operators[c.op_index], [_describe(m.values, a) for a in c.args]) for c in m.instructions]
    assert sorted(ours, key=repr) == sorted(theirs, key=repr)  # ExecuTorch orders independent calls its own way
