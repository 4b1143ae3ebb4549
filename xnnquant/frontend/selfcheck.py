"""The self-check of every export: the lowered graph against the module, before ``xq.export`` returns.

Two comparisons, on the example inputs; either raises ``SelfCheckError``:

1. **The exported program against the module's eager forward.**  The program the
   lowering read (torch.export's graph, decomposed and rewritten by the passes) is run
   in torch and its outputs compared with ``module(*example_inputs)``.  A quantized
   embedding table's lookups read its float table here (quantizing the table is a change of
   weights, judged as every quantized weight is: by the report's SQNR).  A module that
   computes differently under export (a branch on ``torch.compiler.is_exporting()``,
   randomness) or a pass that changed a value is caught here; when the program differs,
   torch.export's own program is run too, to say which of the two it was.
2. **The graph against the program, node by node.**  The reference interpreter runs the
   graph; then every ATen node that lowered to a graph value is computed by torch *on
   the interpreter's values of its inputs*, and must give the interpreter's value of its
   output.  Each node is judged alone, so quantization upstream cannot hide or fake a
   fault, and the first node that differs is named with its ATen op and module path.
   Where a lowering quantized (``QuantizedReference``), torch computes the node as the
   graph defines it: the filter replaced by the stored filter's values, the input
   quantized per token by ``xq.quantize_per_token`` (bit-exact with the interpreter's
   and XNNPACK's own conversion).  Where a clamp was fused into its producer's output
   bounds, the producer's value is recomputed without it, so the producer and the clamp
   are each judged on their own.  Finally the graph's outputs must be the values of the
   program's outputs, laid out as declared.

A mixed program is judged so delegate by delegate, then run on ExecuTorch's runtime against
that composite (``selfcheck_mixed.py``).

The bound is ``graph.divergence.TOLERANCE`` (1e-4) relative to the larger of the value's
largest magnitude and 1% of its inputs' largest magnitude: one node's float32 sums taken
in another order, or a subtraction's rounding of large inputs, stay far below it, while
a wrong lowering is off by about its value's size.

A static int8 export (``activations="qint8"``) is judged on its int8 graph the same way,
every value in real units (codes dequantized); an ATen node whose output is qint8 is
computed by torch on the dequantized int8 inputs it reads, with its stored filter and
bias, and must lie within half an output step (plus its kernel's fixed-point
slack) of the graph's value: ``static_int8/check.py`` says why that bound holds.
"""

from __future__ import annotations

import copy
import dataclasses
import math
import operator
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..arrays import contiguous
from ..constants import FLT_MIN
from ..errors import SelfCheckError, XnnquantError
from ..graph.divergence import TOLERANCE
from ..graph.interpreter import evaluate_node, interpret_values
from .caller import buffers_kept, copies
from .evaluation import torch_op
from .lowering import op_name
from .lowering.context import Activation, QuantizedReference, inverse
from .lowering.walk import Lowered
from .program import AtenProgram
from .static_int8.check import Int8Check, check_layers, int8_check
from .static_int8.rewrite import Int8Graph


@dataclass(frozen=True)
class SelfCheck:
    """What the self-check compared (``print`` it).  ``int8_nodes``: of ``nodes``, those with a
    qint8 output, judged within their bound (``worst_int8_steps``: the largest difference in
    output steps)."""

    nodes: int
    worst_node_error: float
    eager_error: float
    int8_nodes: int = 0
    worst_int8_steps: float = 0.0

    def __str__(self) -> str:
        int8 = (f"; {self.int8_nodes} of them int8, within {self.worst_int8_steps:.3g} output steps of torch on "
                "their dequantized inputs" if self.int8_nodes else "")
        return (f"self-check passed: {self.nodes} nodes of the graph agree with torch on their own inputs (worst "
                f"relative error {self.worst_node_error:.2g}{int8}), the program agrees with the module's eager "
                f"forward ({self.eager_error:.2g}); tolerance {TOLERANCE:g}")


def relative_error(got: np.ndarray, ref: np.ndarray, scale: float) -> float:
    """``max |got - ref| / scale``, positions equal in both (infinities, NaN) counting as exact."""
    got64, ref64 = np.asarray(got, np.float64), np.asarray(ref, np.float64)
    if got64.shape != ref64.shape:
        return math.inf
    same = (got64 == ref64) | (np.isnan(got64) & np.isnan(ref64))
    with np.errstate(invalid="ignore"):
        diff = np.where(same, 0.0, np.abs(got64 - ref64))
    worst = float(np.max(diff, initial=0.0))
    return math.inf if math.isnan(worst) else worst / max(scale, float(FLT_MIN))


def magnitude(x: Any) -> float:
    arr = np.asarray(x, np.float64)
    finite = arr[np.isfinite(arr)]
    return float(np.max(np.abs(finite), initial=0.0))


def leaves(value: Any) -> list[Any]:
    import torch

    leaves, _ = torch.utils._pytree.tree_flatten(value)
    return leaves


def evaluate(program: AtenProgram, inputs: tuple[Any, ...]) -> list[Any]:
    """The program's outputs computed by torch, node by node, on copies of ``inputs`` (its
    constants as they are; a quantized table's lookup in its float table:
    ``passes/embeddings.py``).  ``XnnquantError`` when a node cannot compute on them (an
    int64 input read by a float linear, a token id outside an embedding table), naming the
    node and the inputs it reads: export runs this before lowering, whatever ``check=``."""
    import torch

    from .passes.embeddings import QuantizedEmbedding

    env: dict[Any, Any] = {}
    given = iter(copies(inputs))
    with torch.no_grad():
        for node in program.graph.nodes:
            if node.op == "placeholder":
                env[node] = placeholder_value(program, node, given)
            elif node.op == "call_function":
                args = torch.fx.node.map_arg(node.args, env.__getitem__)
                kwargs = torch.fx.node.map_arg(node.kwargs, env.__getitem__)
                try:
                    if isinstance(node.target, QuantizedEmbedding):
                        env[node] = torch.nn.functional.embedding(args[0],
                                                                  program.constants[node.target.float_table])
                    else:
                        env[node] = torch_op(node.target)(*args, **kwargs)
                except Exception as exc:  # torch's kernels raise RuntimeError, IndexError, ValueError ...
                    raise _cannot_run(program, node, exc, inputs) from None
            elif node.op == "output":
                return leaves(torch.fx.node.map_arg(node.args[0], env.__getitem__))
    raise AssertionError("a graph without an output node")


def placeholder_value(program: AtenProgram, node: Any, inputs: Any) -> Any:
    """A placeholder's tensor: a constant's, a state's values when exported, else the next of ``inputs``."""
    if program.is_constant(node):
        return program.constants[node.name]
    if program.is_state(node):
        return program.state[node.name].clone()
    return next(inputs)


def _cannot_run(program: AtenProgram, node: Any, exc: Exception, inputs: tuple[Any, ...]) -> XnnquantError:
    """The error for a node torch cannot compute on the example inputs."""
    seen, todo, read = set(), [node], []
    while todo:
        n = todo.pop()
        if n in seen:
            continue
        seen.add(n)
        if n.op == "placeholder" and n.name in program.inputs:
            read.append(program.inputs.index(n.name))
        todo.extend(n.all_input_nodes)
    given = ", ".join(f"{program.input_names.get(program.inputs[k], program.inputs[k])!r} "
                      f"({str(inputs[k].dtype).removeprefix('torch.')} {tuple(inputs[k].shape)})" for k in sorted(read))
    first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
    where = (f"node {node.name} ({op_name(node.target)}, module {AtenProgram.module_path(node) or '<top level>'}) "
             f"raises {type(exc).__name__}: {first}")
    if not given:  # the inputs cannot be at fault
        return XnnquantError(f"the module's program cannot run: {where}; it reads no example input, only the "
                             "module's own tensors: expected a module whose forward runs in torch (it does not "
                             "with these parameters and buffers)")
    return XnnquantError(
        f"the module's program cannot run on its example inputs: {where}; it reads example input(s) {given}; "
        "expected inputs of the dtypes and values the module computes on (a float layer takes float32, token ids "
        "lie below the table's size)")


def _compare_with_eager(module: Any, traced: Any, inputs: tuple[Any, ...], program: AtenProgram,
                        mutated: Sequence[int] = (), computed: list[Any] | None = None) -> float:
    """Comparison 1 (module docstring); returns the worst relative error.  Every forward
    runs on copies of ``inputs`` and leaves the module's buffers as they were
    (``caller.py``); the new values of the inputs the forward writes into (``mutated``, by
    position) are the program's first outputs, and the values of the buffers it updates
    (``program.mutated``: state) after the module's forward are compared with the program's."""
    import torch

    def forward(run: Any) -> tuple[list[Any], list[Any]]:
        given = copies(inputs)
        with torch.no_grad(), buffers_kept(module):
            results = run(*given)
            after = [program.live[name].detach().clone() for name in program.mutated] if run is module else []
        return [given[k] for k in mutated] + [t for t in leaves(results) if isinstance(t, torch.Tensor)], after

    eager, after = forward(module)
    computed = evaluate(program, inputs) if computed is None else computed
    states, computed = computed[:len(program.mutated)], computed[len(program.mutated):]
    for name, value, live in zip(program.mutated, states, after):  # the buffers' values after the call, too
        error = relative_error(value.detach().numpy(), live.numpy(), magnitude(live.numpy()))
        if not error <= TOLERANCE:
            raise SelfCheckError(
                f"self-check failed: buffer {program.origins[name]!r}, which the module updates, holds other values "
                f"after the exported program's call than after the module's eager forward (by {error:.3g}, relative "
                f"to its largest magnitude; tolerance {TOLERANCE:g}): the program's state would not follow the "
                "module's")
    worst = 0.0
    for i, (want, got) in enumerate(zip(eager, computed)):
        error = relative_error(got.detach().numpy(), want.detach().numpy(), magnitude(want.detach().numpy()))
        worst = max(worst, error)
        if not error <= TOLERANCE:
            exported = forward(traced.module())[0][i]
            at_export = relative_error(exported.detach().numpy(), want.detach().numpy(), magnitude(want.numpy()))
            cause = (f"torch.export traced another computation than the module's eager forward (its program "
                     f"differs by {at_export:.3g} too): a branch on torch.compiler.is_exporting(), randomness or "
                     "state the trace does not see" if not at_export <= TOLERANCE else
                     "the rewrites before lowering (xnnquant/frontend/passes) changed it")
            what = f"input {mutated[i]} as the forward leaves it" if i < len(mutated) else f"output {i}"
            raise SelfCheckError(
                f"self-check failed: {what} of the exported program differs from the module's eager forward "
                f"by {error:.3g} (relative to its largest magnitude; tolerance {TOLERANCE:g}): {cause}; the program "
                "would not compute what the module computes")
    if len(eager) != len(computed):
        raise SelfCheckError(f"self-check failed: the module returns {len(eager)} tensors, its exported program "
                             f"{len(computed)}")
    return worst


def _logical(env: dict[int, np.ndarray], a: Activation) -> np.ndarray:
    """The interpreter's value of ``a`` in torch's dim order (at the sizes it ran at)."""
    value = np.asarray(env[a.id])
    if value.ndim != a.rank:  # a static value computed flat (the reshaping kinds)
        value = value.reshape(a.dims)
    return np.transpose(value, inverse(a.perm))


def _quantized_input(x: Any, reference: QuantizedReference) -> Any:
    """``x`` as the graph feeds it to a quantized node (``QuantizedReference``)."""
    import torch

    from ..schemes import quantize_per_token

    arr = np.ascontiguousarray(np.transpose(x.numpy(), reference.input_layout))
    if reference.input_scale is not None:
        arr = (arr * reference.input_scale).astype(np.float32)
    rows = quantize_per_token(arr, num_nonbatch_dims=reference.nonbatch_dims).dequantize()
    return torch.from_numpy(np.ascontiguousarray(np.transpose(rows, inverse(reference.input_layout))))


def _unfused(lowered: Lowered, env: dict[int, np.ndarray], int8: Int8Check | None = None) -> dict[int, np.ndarray]:
    """``env``, with each value whose producer took in fused clamps recomputed with the
    producer's bounds as they were before the first (``LoweringContext.fuse_clamp``)."""
    views = dict(env)
    producers = {vid: node for node in lowered.graph.nodes for vid in node.outputs}
    for vid, (bounds, _) in lowered.fused.items():
        node = copy.copy(producers[vid])
        node.output_min, node.output_max = bounds
        results = evaluate_node(lowered.graph, node, [env[i] for i in node.inputs])
        views[vid] = results[list(node.outputs).index(vid)]
        if int8 is not None:
            views[vid] = int8.real(vid, views[vid])
    return views


def _int8_read(check: Int8Check, value: Activation) -> Activation:
    """The qint8 value an int8 node reads for ``value``: its twin, or, for an fp32 value the
    lowering laid out anew for the node (an ``XNNStaticTranspose``: PoolFormer's
    ``avg_pool(x) - x`` reads ``x`` channels-last), the twin of that layout, read in it."""
    if value.id in check.int8_version:
        return Activation(check.int8_version[value.id], value.shape, value.perm, value.sym)
    for n in check.graph.nodes:
        if n.kind == "XNNStaticTranspose" and n.inputs[0] == value.id and n.outputs[0] in check.int8_version:
            perm = tuple(value.perm[p] for p in n.params["perm"])
            return Activation(check.int8_version[n.outputs[0]], value.shape, perm, value.sym)
    return value


def _operands(node: Any, lowered: Lowered, env: dict[int, np.ndarray], reference: QuantizedReference | None,
              int8: Int8Check | None = None, fp32_in: Int8Check | None = None) -> tuple[Any, Any, list[np.ndarray]]:
    """``node``'s arguments for torch: each activation as the interpreter computed it (the first
    one quantized as the graph does when the lowering quantized), each constant as it is (the
    quantized filter as its stored values); and the activations' values.

    ``int8`` (a node with a qint8 output): each activation is the qint8 value the int8 graph
    reads, dequantized, and the filter the stored one.  ``fp32_in`` (a node a static int8
    graph leaves in fp32): each activation is the value that node reads, the fp32 twin of a
    qint8 value where the graph has one (an fp32 producer's output: no round trip through
    int8), else the codes dequantized (its convert's output)."""
    import torch

    activations: list[np.ndarray] = []
    stored = int8.filters.get(node.name) if int8 is not None else None

    def operand(arg: Any) -> Any:
        value = lowered.values.get(arg, arg.meta.get("val"))  # a size is read as traced
        if isinstance(value, Activation):
            if int8 is not None:
                value = _int8_read(int8, value)
            elif fp32_in is not None:
                value = Activation(fp32_in.float_version.get(value.id, value.id), value.shape, value.perm, value.sym)
            x = torch.from_numpy(np.ascontiguousarray(_logical(env, value)))
            if reference is not None and not activations:
                x = _quantized_input(x, reference)
            activations.append(x.numpy())
            return x.float() if int8 is not None or fp32_in is not None else x
        if reference is not None and value is reference.weight:
            return torch.from_numpy(np.ascontiguousarray(reference.dequantized))
        if stored is not None and value is stored[0]:
            return torch.from_numpy(np.ascontiguousarray(stored[1], np.float32))
        if isinstance(value, torch.SymInt):  # a dynamic size: its value at the example inputs
            return int(value.node.hint)
        return value

    return torch.fx.node.map_arg(node.args, operand), torch.fx.node.map_arg(node.kwargs, operand), activations


def compare_nodes(program: AtenProgram, lowered: Lowered, env: dict[int, np.ndarray],
                   members: set[Any] | None = None, int8: Int8Check | None = None) -> tuple[int, float, int, float]:
    """Comparison 2 (module docstring) on the interpreter's values ``env`` (real values: a static
    int8 graph's codes dequantized), for the nodes of ``members`` (a delegate) or all; returns
    (nodes compared, worst relative error, nodes with a qint8 output, their worst difference in
    output steps)."""
    import torch

    views = _unfused(lowered, env, int8)
    clamps = {node: (vid, low, high) for vid, (_, fused) in lowered.fused.items() for node, low, high in fused}
    compared, worst, int8_nodes, worst_steps = 0, 0.0, 0, 0.0
    for node in program.graph.nodes:
        if node.op != "call_function" or node.target is operator.getitem or (members is not None
                                                                               and node not in members):
            continue
        result = lowered.values.get(node)
        outs = result if isinstance(result, tuple) else (result,)
        if not any(isinstance(o, Activation) for o in outs):
            continue
        first = next(o for o in outs if isinstance(o, Activation))
        quantized = int8 if int8 is not None and int8.is_int8(first.id) else None
        in_int8 = quantized is not None and node.name in quantized.int8_nodes
        args, kwargs, activations = _operands(node, lowered, views, lowered.references.get(node),
                                              quantized if in_int8 else None, None if in_int8 else int8)
        with torch.no_grad():
            want = torch_op(node.target)(*args, **kwargs)
        wants = want if isinstance(want, (tuple, list)) else (want,)
        inputs_scale = 0.01 * max((magnitude(a) for a in activations), default=0.0)
        for k, (out, ref) in enumerate(zip(outs, wants)):
            if not isinstance(out, Activation):
                continue
            ref_arr = ref.detach().numpy().astype(np.float64)
            fused = clamps.get(node)
            if fused is not None and fused[0] == out.id:  # the producer's bounds as this node left them
                views[out.id] = np.clip(views[out.id], fused[1], fused[2])
            got = _logical(views, out)
            compared += 1
            if quantized is not None:
                delta = quantized.bias_delta.get(node.name)
                if delta is not None:  # along the output channels: the graph value's last dim
                    ref_arr = ref_arr + delta.reshape([-1 if d == out.perm[-1] else 1 for d in range(out.rank)])
                # torch's op has no bounds of its own: a fused clamp is judged at its own ATen node
                bounds = lowered.fused[out.id][0] if out.id in lowered.fused else (None, None)
                expected = quantized.grid_clip(out.id, ref_arr, bounds)
                step = float(np.float32(_int8_scale(quantized, out.id)))
                bound = quantized.tolerance(out.id, magnitude(ref_arr), TOLERANCE)
                diff = float(np.max(np.abs(got - expected), initial=0.0)) if got.shape == expected.shape else math.inf
                int8_nodes += 1
                worst_steps = max(worst_steps, diff / step if math.isfinite(diff) else worst_steps)
                if not diff <= bound:
                    _fail(node, lowered, k, f"{diff / step:.3g} output steps (bound {bound / step:.3g} steps: half a "
                                            "step, the kernel's slack and torch's float error)")
                continue
            error = relative_error(got, ref_arr, max(magnitude(ref_arr), inputs_scale))
            worst = max(worst, error if math.isfinite(error) else worst)
            if not error <= TOLERANCE:
                _fail(node, lowered, k, f"{error:.3g} (relative; tolerance {TOLERANCE:g})")
    return compared, worst, int8_nodes, worst_steps


def _int8_scale(check: Int8Check, vid: int) -> float:
    from ..graph import int8

    return int8.quant(check.graph.value(vid))[0]


def _fail(node: Any, lowered: Lowered, k: int, how: str) -> None:
    emitted = sorted({n.kind for n in lowered.graph.nodes if n.debug_handle and
                      lowered.sources[n.debug_handle - 1][1] == node.name})
    raise SelfCheckError(
        f"self-check failed at {op_name(node.target)} (node {node.name}, module "
        f"{AtenProgram.module_path(node) or '<top level>'}): output {k} of the lowered graph "
        f"({', '.join(emitted) or 'no node of its own'}) differs from torch on the same inputs by {how}: the "
        "lowering of this node is wrong; please report it (check=False skips this check)")


def _compare_outputs(program: AtenProgram, lowered: Lowered, env: dict[int, np.ndarray]) -> None:
    """The graph's outputs are the values of the program's outputs, laid out as declared."""
    output = next(n for n in program.graph.nodes if n.op == "output")
    items = leaves(output.args[0])
    for i, (item, spec, vid) in enumerate(zip(items, lowered.outputs, lowered.graph.outputs)):
        value = lowered.values.get(item)
        if not isinstance(value, Activation):
            continue
        got = np.transpose(np.asarray(env[vid]), inverse(spec.dim_order))
        if not np.array_equal(got, _logical(env, value), equal_nan=True):
            raise SelfCheckError(f"self-check failed: graph output {i} is not the value of the program's output {i} "
                                 f"laid out as declared {spec.dim_order}")


def self_check(module: Any, example_inputs: Any, traced: Any, program: AtenProgram,
               delegates: Sequence[Lowered | None], mixed: Any = None, int8: Int8Graph | None = None,
               mutated: Sequence[int] = (), computed: list[Any] | None = None) -> SelfCheck:
    """Run the comparisons (module docstring); returns what was compared, or raises ``SelfCheckError``.

    ``delegates``: the one lowered graph of a pure program, or a mixed program's delegates
    by phase, whose ``Exported`` is ``mixed``.  ``int8``: the static int8 rewrite of a pure
    program's graph, which is then the graph judged.  ``mutated``: the inputs (by position)
    the forward writes into, whose new values lead the program's outputs (``caller.py``).
    ``computed``: the program's outputs on the example inputs when export already has them
    (``evaluate``).
    """
    inputs = copies(example_inputs)  # the caller's tensors are never handed to anything that runs
    eager_error = _compare_with_eager(module, traced, inputs, program, mutated, computed)
    if mixed is None:
        (lowered,) = delegates
        assert lowered is not None
        check = None
        if int8 is not None:
            check_layers(int8, lowered.sources)
            check = int8_check(int8, lowered.sources, lowered.filters)
            lowered = int8_view(lowered, int8)
        arrays = [contiguous(np.transpose(x.detach().numpy(), spec.dim_order))
                  for x, spec in zip(inputs, lowered.inputs)]
        env = interpret_values(lowered.graph, arrays)
        if check is not None:
            env = {vid: check.real(vid, x) for vid, x in env.items()}
        compared, worst, int8_nodes, steps = compare_nodes(program, lowered, env, None, check)
        _compare_outputs(program, lowered, env)
        return SelfCheck(compared, worst, eager_error, int8_nodes, steps)
    from .selfcheck_mixed import check_mixed

    compared, worst = check_mixed(program, delegates, inputs, mixed)
    return SelfCheck(compared, worst, eager_error)


def int8_view(lowered: Lowered, int8: Int8Graph) -> Lowered:
    """``lowered`` with the int8 graph in place of the float one: each ATen node's activations
    and fused clamps moved to the values standing for them there (``Int8Graph.primary``)."""
    def moved(value: Any) -> Any:
        if isinstance(value, Activation):
            return Activation(int8.primary(value.id), value.shape, value.perm, value.sym)
        if isinstance(value, tuple):
            return tuple(moved(v) for v in value)
        return value

    return dataclasses.replace(lowered, graph=int8.graph, values={k: moved(v) for k, v in lowered.values.items()},
                               fused={int8.primary(vid): f for vid, f in lowered.fused.items()}, references={})
