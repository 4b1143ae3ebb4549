"""One payload, every input size within its dims: the real runtime against the interpreter.

A payload's dims are upper bounds: XNNPACK computes every value's dims again from the
tensors it is given on each call (its reshape step), and ``run`` executes a program whose
input and output tensors are declared ``DYNAMIC_BOUND`` at the payload's dims.  Oracles:
the real XNNPACK inside executorch 1.4.1 (``run``, and the ExecuTorch runtime on a
``to_pte`` program directly), ExecuTorch's own ``.pte`` deserializer, and numpy
references written here.  The facts measured for them are in docs/exporting.md ("Dynamic shapes").
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from float_bounds import assert_within, bound_of_kind, gamma, half_ulp

from xnnquant.errors import UnsupportedConfigError, XnnquantError
from xnnquant.graph import Graph, interpret, load, run, to_pte
from xnnquant.graph.interpreter import HANDLERS, constant_values, evaluate_node

pytestmark = pytest.mark.xnnpack

N, D, H = 16, 32, 4  # bound of the sequence, model width, heads
SIZES = (1, 5, N)


def ints(rng: np.random.Generator, shape: tuple[int, ...], top: int) -> np.ndarray:
    return rng.integers(-top, top + 1, shape).astype(np.float32)


def attention_moves() -> tuple[Graph, np.ndarray, np.ndarray]:
    """x [1, S, D] -> (scores [1, H, S + 1, S + 1], tokens [1, S + 3, D]) through every node
    kind whose shape follows a dynamic dim: fully connected over the rows, reshape with
    an inferred dim, transposes, a batch matmul of two dynamic operands, a concatenation
    with a fixed token, a slice dropping it again, a constant pad and a broadcast add.
    Weights are small integers."""
    rng = np.random.default_rng(1)
    w, c = ints(rng, (D, D), 2), ints(rng, (D,), 3)
    g = Graph()
    x, token = g.input((1, N, D)), g.input((1, 1, D))
    seq = g.concatenate([token, x], axis=1)                               # [1, S + 1, D]
    heads = g.static_reshape(g.fully_connected(seq, g.constant(w)), (1, -1, H, D // H))
    q = g.static_transpose(heads, (0, 2, 1, 3))                           # [1, H, S + 1, d]
    k = g.static_transpose(heads, (0, 2, 3, 1))                           # [1, H, d, S + 1]
    g.output(g.batch_matrix_multiply(q, k))
    rows = g.static_slice(seq, (0, 1, 0), (1, N, D))                      # rows 1.. : x again
    g.output(g.add(g.static_constant_pad(rows, (0, 1, 0), (0, 2, 0), 0.5), g.constant(c)))
    return g, w, c


@pytest.mark.parametrize("size", SIZES)
def test_shape_moves_are_exact_at_every_size(size: int) -> None:
    """Small integers: every product and every partial sum (at most 32 * 4 * 2 = 256 per
    fully-connected output, 8 * 256^2 per score) is an integer below 2^24, so float32
    computes it exactly in any order and with or without FMA: runtime, interpreter and a
    numpy reference agree bit for bit, on any CPU."""
    g, w, c = attention_moves()
    rng = np.random.default_rng(size)
    x, token = ints(rng, (1, size, D), 4), ints(rng, (1, 1, D), 4)
    seq = np.concatenate([token, x], axis=1).astype(np.float64)
    heads = (seq @ w.T).reshape(1, size + 1, H, D // H)
    want = [heads.transpose(0, 2, 1, 3) @ heads.transpose(0, 2, 3, 1),
            np.pad(x, ((0, 0), (1, 2), (0, 0)), constant_values=0.5) + c]
    got = run(g, [x, token])
    assert [o.shape for o in got] == [(1, H, size + 1, size + 1), (1, size + 3, D)]
    for o, r, i in zip(got, want, interpret(g, [x, token])):
        np.testing.assert_array_equal(o, r)
        np.testing.assert_array_equal(i, r)


def encoder_layer() -> Graph:
    """A pre-norm attention block with the node kinds of XN01: layer norm from fully
    connected means (weight 1/D), per-head attention through reshapes that infer the
    sequence, softmax, the output projection and the residual."""
    rng = np.random.default_rng(2)

    def weight(*shape: int) -> int:
        return g.constant((rng.standard_normal(shape) / np.sqrt(shape[-1])).astype(np.float32))

    g = Graph()
    x = g.input((1, N, D))
    mean = g.constant(np.full((1, D), 1 / D, np.float32))
    centred = g.subtract(x, g.fully_connected(x, mean))
    std = g.square_root(g.add(g.fully_connected(g.square(centred), mean), g.constant(np.float32([1e-5]))))
    h = g.add(g.multiply(g.divide(centred, std), weight(D)), weight(D))

    def heads(perm: tuple[int, ...]) -> int:
        return g.static_transpose(g.static_reshape(g.fully_connected(h, weight(D, D), weight(D)), (1, -1, H, D // H)),
                                  perm)

    q, k, v = heads((0, 2, 1, 3)), heads((0, 2, 3, 1)), heads((0, 2, 1, 3))
    scores = g.multiply(g.batch_matrix_multiply(q, k), g.constant(np.float32([(D // H) ** -0.5])))
    attended = g.static_transpose(g.batch_matrix_multiply(g.softmax(scores), v), (0, 2, 1, 3))
    g.output(g.add(g.fully_connected(g.static_reshape(attended, (1, -1, D)), weight(D, D)), x))
    for node in g.nodes[:-1]:  # every value a node computes, so each node is checked alone
        g.output(node.outputs[0])
    return g


def node_bound(node, args: list[np.ndarray], ref: np.ndarray) -> np.ndarray:
    """What one node of the runtime may differ from the interpreter's float64 result
    (rounded once to float32, ``ref``) by, given the same inputs ``args``:

    * fully connected and batch matmul sum ``K`` products (and the bias) in any order:
      ``gamma(K + bias) * sum|terms|`` (Higham), ``sum|terms|`` being the same node on
      ``|args|``, plus the half ulp of ``ref``;
    * reshape and transpose move bits;
    * the other kinds meet XNNPACK's own per-kernel test tolerances (``bound_of_kind``).
    """
    if node.kind in ("XNNFullyConnected", "XNNBatchMatrixMultiply"):
        terms = args[0].shape[-1] + (len(node.inputs) > 2)
        size = HANDLERS[node.kind](node, [np.abs(a) for a in args])[0].astype(np.float64)
        return gamma(terms) * size + half_ulp(ref)
    if node.kind in ("XNNStaticReshape", "XNNStaticTranspose"):
        return np.zeros(ref.shape)
    return bound_of_kind(node.kind, ref)


@pytest.mark.parametrize("size", SIZES)
def test_encoder_layer_node_by_node_at_every_size(size: int) -> None:
    """Each node's runtime result against the interpreter's on the runtime's own inputs
    (every computed value is a graph output), within that node's float32 bound: errors
    do not compound, so the bound is the node's own whatever the size."""
    g = encoder_layer()
    x = np.random.default_rng(size).standard_normal((1, size, D)).astype(np.float32)
    got = dict(zip(g.outputs, run(g, [x])))
    values = {**constant_values(g), g.inputs[0]: x, **got}
    assert got[g.outputs[0]].shape == (1, size, D)
    for position, node in enumerate(g.nodes):
        args = [values[i] for i in node.inputs]
        ref = evaluate_node(g, node, args, position)[0]
        assert got[node.outputs[0]].shape == ref.shape
        assert_within(got[node.outputs[0]], ref, node_bound(node, args, ref), f"node {position} ({node.kind})")


def test_an_isolated_run_at_a_smaller_size() -> None:
    """The worker process gets the output shapes of that size (its output slots)."""
    g, _, _ = attention_moves()
    x, token = ints(np.random.default_rng(3), (1, 3, D), 4), np.ones((1, 1, D), np.float32)
    for o, i in zip(run(g, [x, token], isolate=True), interpret(g, [x, token])):
        np.testing.assert_array_equal(o, i)  # exact: small integers, as above


def test_a_convolution_over_dynamic_height_and_width() -> None:
    """NHWC [1, H, W, 3] declared [1, 12, 12, 3]: a 3 x 3 convolution, stride 2, padding 1
    (output (H + 2 - 3) // 2 + 1), then a 2 x 2 max pooling, at each size.  Integers
    again (at most 3 * 3 * 3 * 4 * 2 = 216 per sum): exact."""
    rng = np.random.default_rng(4)
    g = Graph()
    x = g.input((1, 12, 12, 3))
    g.output(g.max_pooling_2d(g.conv2d(x, g.constant(ints(rng, (4, 3, 3, 3), 2)), stride=2, padding=1), kernel=2))
    for hw, out in (((5, 7), (1, 2)), ((12, 12), (3, 3))):
        image = ints(rng, (1, *hw, 3), 4)
        got, want = run(g, [image])[0], interpret(g, [image])[0]
        assert got.shape == (1, *out, 4)
        np.testing.assert_array_equal(got, want)


def test_reshape_stores_its_inferred_dim_as_zero() -> None:
    """The schema's new_shape is unsigned; XNNPACK infers a 0 (ExecuTorch 1.4.1's own
    serializer writes torch's -1 as 0 too).  The output value's dims resolve it at the
    input's dims."""
    g = Graph()
    y = g.static_reshape(g.input((1, N, D)), (1, -1, H, D // H))
    g.output(y)
    assert g.nodes[0].params["new_shape"] == (1, 0, H, D // H)
    assert g.value(y).dims == (1, N, H, D // H)
    assert load(g.to_bytes()).nodes[0].params["new_shape"] == (1, 0, H, D // H)
    x = np.arange(3 * D, dtype=np.float32).reshape(1, 3, D)
    np.testing.assert_array_equal(run(g, [x])[0], x.reshape(1, 3, H, D // H))


def test_reshape_to_fixed_dims_holds_only_at_its_size() -> None:
    """new_shape (1, 16, 4, 8) written out: at 5 rows the element count no longer agrees.
    XNNPACK refuses the call (xnn_status_invalid_parameter); run and interpret say why."""
    g = Graph()
    g.output(g.static_reshape(g.input((1, N, D)), (1, N, H, D // H)))
    x = np.zeros((1, 5, D), np.float32)
    message = r"XNNStaticReshape: element count changes: got input \(1, 5, 32\) \(160 elements\) and new_shape"
    with pytest.raises(XnnquantError, match=r"node 0 \(XNNStaticReshape\): " + message):
        run(g, [x])
    with pytest.raises(XnnquantError, match=message):
        interpret(g, [x])


def test_two_inferred_dims_are_refused() -> None:
    g = Graph()
    g.output(g.static_reshape(g.input((2, N, D)), (2, N, D)))
    g.nodes[0].params["new_shape"] = (0, 0, D)
    with pytest.raises(XnnquantError, match=r"^node 0 \(XNNStaticReshape\): new_shape \(0, 0, 32\) infers 2 dims "
                                            r"\(each 0\): XNNPACK 1adaa7c7 infers at most one, and refuses the graph "
                                            r"on every call \(xnn_status_invalid_parameter\)$"):
        g.to_bytes()


def test_a_fully_connected_input_must_keep_its_channels() -> None:
    """[1, 4, 16] fits [1, 16, 32] dim by dim, but K is 32: XNNPACK would compute
    numel / K = 2 rows of the 4 and leave the others unwritten (measured), so it is
    refused before the runtime sees it."""
    g = Graph()
    g.output(g.fully_connected(g.input((1, N, D)), g.constant(np.ones((8, D), np.float32))))
    x = np.ones((1, 4, 16), np.float32)
    with pytest.raises(XnnquantError, match=r"^node 0 \(XNNFullyConnected\): XNNFullyConnected: input channels do "
                                            r"not match the filter: got input \(1, 4, 16\)"):
        run(g, [x])
    with pytest.raises(XnnquantError, match=r"node 0 \(XNNFullyConnected\): inputs of shapes \[\(1, 4, 16\), "
                                            r"\(8, 32\)\] do not fit together"):
        interpret(g, [x])


@pytest.mark.parametrize("isolate", [False, True])
def test_inputs_above_their_dims_are_refused(isolate: bool) -> None:
    g, _, _ = attention_moves()
    token = np.ones((1, 1, D), np.float32)
    expected = (r"^inputs\[0\] does not match the payload's external input 0: got shape \(1, 17, 32\) float32, "
                r"expected \(1, 16, 32\) float32 \(or smaller dims, each at least 1: the program is planned at the "
                r"payload's dims\)$")
    with pytest.raises(XnnquantError, match=expected):
        run(g, [np.ones((1, N + 1, D), np.float32), token], isolate=isolate)
    # a zero-size dim aborts the 1.4.1 pybindings (SIGABRT) while they wrap the tensor
    with pytest.raises(XnnquantError, match=r"got shape \(1, 0, 32\) float32"):
        run(g, [np.ones((1, 0, D), np.float32), token], isolate=isolate)
    with pytest.raises(XnnquantError, match=r"got shape \(16, 32\) float32"):
        run(g, [np.ones((N, D), np.float32), token], isolate=isolate)


def test_the_interpreter_refuses_inputs_above_their_dims() -> None:
    g, _, _ = attention_moves()
    with pytest.raises(XnnquantError, match=r"^inputs\[0\] does not match external input value 0: got shape "
                                            r"\(1, 17, 32\) float32, expected \(1, 16, 32\) float32 \(or smaller "
                                            r"dims, each at least 1\)$"):
        interpret(g, [np.ones((1, N + 1, D), np.float32), np.ones((1, 1, D), np.float32)])


def _declared(pte: bytes) -> list[tuple[list[int], str]]:
    from executorch.exir._serialize._program import deserialize_pte_binary

    plan = deserialize_pte_binary(pte).program.execution_plan[0]
    return [(plan.values[i].val.sizes, plan.values[i].val.shape_dynamism.name) for i in (*plan.inputs, *plan.outputs)]


def _execute(pte: bytes, x: np.ndarray) -> list[np.ndarray]:
    import torch
    from executorch.runtime import Runtime

    program = Runtime.get().load_program(pte)
    return [o.numpy() for o in program.load_method("forward").execute([torch.from_numpy(x)])]


def test_the_program_declares_bounded_tensors(capfd: pytest.CaptureFixture[str]) -> None:
    """What the runtime needs to take other sizes, read by ExecuTorch's own deserializer
    and run by its runtime: STATIC tensors refuse any other shape; DYNAMIC_BOUND ones at
    the payload's dims take smaller ones and refuse an element count above the planned
    capacity (16 * 32 = 512 elements), with ExecuTorch's own words in its log."""
    g = Graph()
    g.output(g.static_reshape(g.input((1, N, D)), (1, -1, H, D // H)))
    static, bounded = to_pte(g), to_pte(g, dynamic=True)
    assert _declared(static) == [([1, N, D], "STATIC"), ([1, N, H, D // H], "STATIC")]
    assert _declared(bounded) == [([1, N, D], "DYNAMIC_BOUND"), ([1, N, H, D // H], "DYNAMIC_BOUND")]
    small = np.arange(5 * D, dtype=np.float32).reshape(1, 5, D)
    np.testing.assert_array_equal(_execute(bounded, small)[0], small.reshape(1, 5, H, D // H))
    capfd.readouterr()
    with pytest.raises(RuntimeError, match="set_inputs"):
        _execute(static, small)
    assert "Attempted to resize a static tensor" in capfd.readouterr().err
    with pytest.raises(RuntimeError, match="set_inputs"):
        _execute(bounded, np.zeros((1, N + 1, D), np.float32))
    assert "maximum capacity of 512 elements to 544 elements" in capfd.readouterr().err


def test_a_node_kind_without_a_shape_rule_is_refused() -> None:
    """The shape rules cover every node kind ``run`` may meet at other sizes; a kind
    without one is refused by name, never guessed."""
    from xnnquant.graph.model import Node
    from xnnquant.graph.shapes import node_output_dims

    assert node_output_dims(Node("XNNSoftmax", (0,), (1,)), [(1, H, 5, 5)]) == [(1, H, 5, 5)]
    with pytest.raises(UnsupportedConfigError, match=r"^XNNUnknown: no shape rule for this node kind$"):
        node_output_dims(Node("XNNUnknown", (0,), (1,)), [(1,)])


@pytest.fixture(scope="module")
def et_dynamic(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """``dynamic.pte``: ExecuTorch's own flow with ``Dim("seq", max=16)``
    (``tests/oracles/et_dynamic.py``, in a subprocess)."""
    out = tmp_path_factory.mktemp("et_dynamic")
    repo = Path(__file__).resolve().parents[1]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(repo), os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run([sys.executable, str(repo / "tests" / "oracles" / "et_dynamic.py"), str(out), str(N)],
                          capture_output=True, text=True, env=env, timeout=900)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return out / "dynamic.pte"


def test_executorch_own_dynamic_program_at_a_smaller_size(et_dynamic: Path) -> None:
    """ExecuTorch's payload holds the bound (16) and the view's -1 as 0; at S = 3 its
    delegate, fed what the method gave it, computes in the interpreter and run alone
    exactly what it computed inside ExecuTorch's program (data movement and a ReLU:
    exact on any CPU)."""
    import torch

    from xnnquant.pte import read_pte
    from xnnquant.pte.run import check_delegates

    program = read_pte(et_dynamic)
    (delegate,) = program.delegates
    reshape = next(n for n in delegate.graph.nodes if n.kind == "XNNStaticReshape")
    assert reshape.params["new_shape"] == (1, 0, H, D // H)
    assert delegate.graph.value(delegate.graph.inputs[0]).dims == (1, N, D)
    (check,) = check_delegates(program, "forward", [torch.randn(1, 3, D)])
    assert check.input_shapes == ((1, 3, D),) and check.output_shapes == ((1, H, 3, D // H),)
    assert check.errors == (0.0,) and check.alone_identical
