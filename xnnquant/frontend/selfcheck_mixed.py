"""The self-check of a mixed program (``selfcheck.py``'s comparisons, for XNNPACK delegates and
ExecuTorch's portable kernels in one program).

The program is computed as it runs (``composite``): its portable nodes by torch, its delegates by
the reference interpreter, each delegate's nodes judged on the way as a pure graph's are
(``selfcheck.compare_nodes``).  Then the program itself runs on ExecuTorch's runtime and each
output must be the composite's (``compare_program``): exactly for an integer output computed
from integers only, within ``TOLERANCE`` of its largest magnitude for a float program, within
``QUANTIZED_PROGRAM_TOLERANCE`` (RMS) when its delegates quantize activations.  A kernel
called with a wrong argument or a delegate wired wrongly is off by about its outputs' size.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from ..arrays import contiguous
from ..constants import FLT_MIN
from ..errors import SelfCheckError
from ..graph.divergence import TOLERANCE
from ..graph.interpreter import interpret_values
from .evaluation import torch_op
from .lowering.walk import Lowered
from .program import AtenProgram
from .selfcheck import compare_nodes, leaves, magnitude, placeholder_value, relative_error


def check_mixed(program: AtenProgram, delegates: Sequence[Lowered | None], inputs: tuple[Any, ...],
                exported: Any) -> tuple[int, float]:
    """Judge the mixed program ``exported`` (module docstring) on copies of the example ``inputs``;
    returns (nodes compared, worst relative error), or raises ``SelfCheckError``."""
    compared, worst, composite = _composite(program, delegates, inputs)
    exact = [not _reads_floats(program, node) for node in leaves(program.user_outputs())]
    _compare_program(exported, inputs, composite, exact)
    return compared, worst


def _reads_floats(program: AtenProgram, node: Any) -> bool:
    """True when a float value (an input, a constant or a node's) enters ``node``'s value."""
    import torch

    seen, todo = set(), [node]
    while todo:
        n = todo.pop()
        if not isinstance(n, torch.fx.Node) or n in seen:
            continue
        seen.add(n)
        val = program.constants.get(n.name) if program.is_constant(n) else n.meta.get("val")
        if val is None or getattr(val, "dtype", torch.float32).is_floating_point:
            return True  # a float, or a value of unknown type
        todo.extend(n.all_input_nodes)
    return False


#: How far a mixed program's outputs, run on ExecuTorch's runtime, may be from the composite
#: reference (the interpreter for its delegates, torch for its portable nodes).  A float program
#: differs by XNNPACK's rounding: a few ulps, judged as every node is (``TOLERANCE``, of the
#: largest magnitude).  A program whose delegates quantize activations at run time moves an int8
#: code wherever XNNPACK's float sums round a tie the other way, and the later layers carry it
#: on: all-MiniLM-L6-v2 whole at qb4w:32 ended 1.4e-2 (largest magnitude) from the interpreter
#: while every node agreed to 1e-6; such programs are judged by the RMS error relative to the
#: output's RMS, within ``QUANTIZED_PROGRAM_TOLERANCE``.  A quantized embedding table's lookups are computed
#: by torch from its stored values (``passes/embeddings.QuantizedEmbedding``), which the
#: kernel computes exactly (``(code - 0) * scale`` in float32): no quantization error enters
#: this comparison.  A kernel called with a wrong argument or
#: a delegate wired wrongly is off by about its outputs' size.
QUANTIZED_PROGRAM_TOLERANCE = 0.1


def _composite(program: AtenProgram, delegates: Sequence[Lowered | None],
               inputs: tuple[Any, ...]) -> tuple[int, float, list[Any]]:
    """A mixed program computed as it runs, the delegates by the interpreter and the portable
    nodes by torch, each delegate's nodes compared on the way (comparison 2); returns (nodes
    compared, worst relative error, the program's outputs)."""
    import torch

    from .passes.partition import PARTITION, PHASE, PORTABLE

    values: dict[Any, Any] = {}
    given = iter(inputs)
    for node in program.graph.nodes:
        if node.op == "placeholder":
            values[node] = placeholder_value(program, node, given)

    def operand(arg: Any) -> Any:
        if arg in values:
            return values[arg]
        val = arg.meta.get("val")
        if isinstance(val, torch.SymInt) and arg.op == "call_function":  # a size: computed from the values
            args = torch.fx.node.map_arg(arg.args, operand)
            values[arg] = int(torch_op(arg.target)(*args, **torch.fx.node.map_arg(arg.kwargs, operand)))
            return values[arg]
        return int(val.node.hint) if isinstance(val, torch.SymInt) else val

    calls = [n for n in program.graph.nodes if n.op == "call_function"]
    last = max([n.meta.get(PHASE, 0) for n in calls] + [len(delegates) - 1], default=0)
    compared, worst = 0, 0.0
    with torch.no_grad():
        for phase in range(last + 1):
            for node in calls:
                if node.meta.get(PARTITION) == PORTABLE and node.meta.get(PHASE, 0) == phase:
                    args = torch.fx.node.map_arg(node.args, operand)
                    kwargs = torch.fx.node.map_arg(node.kwargs, operand)
                    values[node] = torch_op(node.target)(*args, **kwargs)
            lowered = delegates[phase] if phase < len(delegates) else None
            if lowered is None:
                continue
            arrays = [contiguous(np.transpose(np.asarray(operand(n), np.dtype(spec.dtype)), spec.dim_order))
                      for n, spec in zip(lowered.input_nodes, lowered.inputs)]
            env = interpret_values(lowered.graph, arrays)
            members = {n for n in calls if n.meta.get(PARTITION) == phase}
            n_compared, n_worst, _, _ = compare_nodes(program, lowered, env, members)
            compared, worst = compared + n_compared, max(worst, n_worst)
            for node, vid, spec in zip(lowered.output_nodes, lowered.graph.outputs, lowered.outputs):
                values[node] = torch.from_numpy(contiguous(
                    np.transpose(np.asarray(env[vid]), np.argsort(spec.dim_order))))
    return compared, worst, [operand(item) for item in leaves(program.user_outputs())]


def _quantizes_activations(exported: Any) -> bool:
    """True when a delegate quantizes activations (per-token int8, or static int8)."""
    from ..datatypes import Datatype

    return any(v.datatype in (Datatype.qdint8, Datatype.qint8) for g in exported.delegates for v in g.values)


def _compare_program(exported: Any, inputs: tuple[Any, ...], composite: list[Any],
                     exact: Sequence[bool] = ()) -> None:
    """A mixed program's outputs on ExecuTorch's runtime against the composite reference;
    ``exact[i]``: output ``i`` is computed from integer values only (no rounding on either
    side can explain a difference)."""
    quantized = _quantizes_activations(exported)
    got = exported.run(*inputs)
    for i, (out, ref) in enumerate(zip(got, composite)):
        ref_arr = np.asarray(ref.detach().numpy() if hasattr(ref, "detach") else ref)
        if ref_arr.dtype.kind in "biu":
            differ = np.asarray(out) != ref_arr if np.shape(out) == ref_arr.shape else np.ones(ref_arr.shape, bool)
            if differ.any() and i < len(exact) and exact[i]:
                raise SelfCheckError(
                    f"self-check failed: output {i} ({ref_arr.dtype}) of the program on ExecuTorch's runtime differs "
                    f"from what its delegates (on the interpreter) and portable kernels (torch) compute in "
                    f"{int(differ.sum())} of {differ.size} elements. It is computed from integer values only, "
                    "exactly on both sides: the program is assembled wrongly; please report it. check=False skips "
                    "this check")
            if differ.any():
                raise SelfCheckError(
                    f"self-check failed: output {i} ({ref_arr.dtype}) of the program on ExecuTorch's runtime differs "
                    f"from what its delegates (on the interpreter) and portable kernels (torch) compute in "
                    f"{int(differ.sum())} of {differ.size} elements. An output of comparisons, argmax or rounding "
                    "of float values flips where those values lie within float rounding of the decision (XNNPACK "
                    "and the interpreter round differently); if they do not lie that close, the program is "
                    "assembled wrongly: please report it. check=False skips this check")
            continue
        out_arr, ref64 = np.asarray(out, np.float64), ref_arr.astype(np.float64)
        if quantized:
            error = float(np.sqrt(np.mean((out_arr - ref64) ** 2) / max(np.mean(ref64 ** 2), float(FLT_MIN))))
            bound, how = QUANTIZED_PROGRAM_TOLERANCE, "RMS, relative to the output's RMS"
        else:
            error = relative_error(out_arr, ref64, magnitude(ref_arr))
            bound, how = TOLERANCE, "relative to its largest magnitude"
        if not error <= bound:
            raise SelfCheckError(
                f"self-check failed: output {i} of the program on ExecuTorch's runtime differs from what its "
                f"delegates (on the interpreter) and portable kernels (torch) compute by {error:.3g} ({how}; "
                f"tolerance {bound:g}): the program is assembled wrongly; please report it")
