"""A dynamic size computed from the program's inputs when it runs, not read from a tensor.

A portable node may need the size of a value that only an XNNPACK delegate computes, and
the delegate may run after it (wav2vec2's attention mask is built from the length of the
feature projection's output, ``arange(linear.size(1))``, and feeds the same delegate's
attention).  Every size is a function of the program's input sizes (and of the sizes read
from tensors' values, ``item``): torch.export traced it as a sympy expression over their
symbols.  ``computed`` writes the kernel calls that evaluate that expression::

    symbol s      aten::sym_size.int of the program input whose dim it is, or (dim - b) // a
                  of one that is a * s + b (a derived ``Dim``: ``10 * s``)
    symbol u      the node that reads it from a tensor (``item``)
    a + b, a * b  executorch_prim::add.Scalar, mul.Scalar
    a // b        executorch_prim::floordiv.Scalar   (FloorDiv)
    a % b         executorch_prim::mod.Scalar        (Mod, PythonMod: sizes are >= 0)
    max, min      executorch_prim::sym_max.Scalar, sym_min.Scalar

An expression with a rational coefficient (``(32*s - 32)/(16*s - 16)``) is first brought to
one without (``sympy.cancel``: 2); one that still has one, or another function, is refused.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from ..errors import UnsupportedConfigError
from ..pte.builder import MethodBuilder
from ..pte.portable import RuntimeInt
from .program import AtenProgram

Operand = Callable[[Any], Any]


def computed(expr: Any, program: AtenProgram, method: MethodBuilder, operand: Operand,
             done: dict[Any, Any]) -> RuntimeInt | int:
    """The value of size expression ``expr`` when the program runs (module docstring);
    ``operand(node)``: the value of a node of the program; ``done``: expression -> value,
    the ones already computed (filled)."""
    import sympy
    from torch.utils._sympy.functions import FloorDiv, Max, Min, Mod, PythonMod

    if expr in done:
        return done[expr]
    if expr.is_number:
        if not expr.is_integer:
            raise UnsupportedConfigError(f"a dynamic size has the non-integer term {expr}: expected integer sizes")
        return int(expr)
    value: RuntimeInt | int
    if isinstance(expr, sympy.Symbol):
        value = _symbol(expr, program, method, operand)
    elif isinstance(expr, (sympy.Add, sympy.Mul, Max, Min)) and all(a.is_integer or not a.is_number for a in expr.args):
        kernel = {sympy.Add: "add", sympy.Mul: "mul", Max: "sym_max", Min: "sym_min"}[type(expr)]
        parts = [computed(a, program, method, operand, done) for a in expr.args]
        value = parts[0]
        for part in parts[1:]:
            value = _call(kernel, value, part, method, _upper(expr, program))
    elif isinstance(expr, (FloorDiv, Mod, PythonMod)):
        a, b = (computed(a, program, method, operand, done) for a in expr.args)
        value = _call("floordiv" if isinstance(expr, FloorDiv) else "mod", a, b, method, _upper(expr, program))
    else:
        simpler = sympy.cancel(expr)
        if simpler == expr:
            raise UnsupportedConfigError(f"the dynamic size {expr} is not computed by ExecuTorch's size kernels "
                                         "(+, *, //, %, max, min of sizes)")
        value = computed(simpler, program, method, operand, done)
    done[expr] = value
    return value


def _call(kernel: str, a: RuntimeInt | int, b: RuntimeInt | int, method: MethodBuilder, bound: int) -> RuntimeInt:
    """``executorch_prim::{kernel}.Scalar(a, b)`` into a new ``Int`` (at most ``bound``)."""
    def index(v: RuntimeInt | int) -> int:
        return v.index if isinstance(v, RuntimeInt) else method.int_value(int(v))

    out = method.int_value(bound)  # written when the program runs
    method.kernel_call(f"executorch_prim::{kernel}", "Scalar", [index(a), index(b), out])
    return RuntimeInt(out, bound)


def _upper(expr: Any, program: AtenProgram) -> int:
    """The largest value of size expression ``expr`` in the ranges of its symbols."""
    from torch.utils._sympy.value_ranges import bound_sympy

    try:
        return int(bound_sympy(expr, program.ranges).upper)
    except (TypeError, ValueError, OverflowError):  # no bound: refused where the size itself is read
        raise UnsupportedConfigError(f"the dynamic size {expr} has no upper bound: give its torch.export.Dim a "
                                     "max") from None


def _symbol(symbol: Any, program: AtenProgram, method: MethodBuilder, operand: Operand) -> RuntimeInt | int:
    """Size symbol ``symbol``: a dim of a program input, or a size a node reads from a tensor."""
    import sympy

    placeholders = {n.name: n for n in program.graph.nodes if n.op == "placeholder"}
    for name in program.inputs:
        for d, dim in enumerate(getattr(placeholders[name].meta.get("val"), "shape", ())):
            if isinstance(dim, int):
                continue
            expr = sympy.expand(dim.node.expr)
            scale, offset = expr.coeff(symbol), expr - expr.coeff(symbol) * symbol
            if not (scale.is_Integer and scale > 0 and offset.is_Integer):
                continue  # the dim is not a * symbol + b (a derived Dim's is: 10 * s)
            bound = program.size(dim, f"dim {d} of input {name!r}").bound
            out = method.int_value(bound)  # written when the program runs
            method.kernel_call("aten::sym_size", "int", [operand(placeholders[name]), method.int_value(d), out])
            value: RuntimeInt | int = RuntimeInt(out, bound)
            upper = _upper(symbol, program)
            if offset != 0:
                value = _call("sub", value, int(offset), method, upper * int(scale))
            return value if scale == 1 else _call("floordiv", value, int(scale), method, upper)
    for node in program.graph.nodes:
        val = node.meta.get("val")
        if node.op == "call_function" and type(val).__name__ == "SymInt" and val.node.expr == symbol \
                and not _reads_a_size(node):
            value = operand(node)
            if isinstance(value, RuntimeInt):
                return value
    raise UnsupportedConfigError(f"the dynamic size {symbol} is neither a dim of an input nor read from a tensor "
                                 "before it is needed")


def _reads_a_size(node: Any) -> bool:
    import torch

    return node.target is torch.ops.aten.sym_size.int
