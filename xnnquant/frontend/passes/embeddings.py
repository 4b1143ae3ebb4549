"""Quantized embedding tables (``embeddings="int8"`` or ``"int4:G"``).

Each lookup of a constant float32 table becomes a lookup of the table quantized as the
``EmbeddingScheme`` says (``weights.py``), run by ExecuTorch's quantized embedding kernel::

    aten.embedding(table, ids)          ->   QuantizedEmbedding(ids)
      table: constant float32 (V, D)          quantized_decomposed::embedding_{byte,4bit}.dtype_out
      ids:   int64 / int32, any shape         on the table's codes and scales (pte/quantized.py)
                                              -> float32 ids.shape + (D,)

int32 ids are converted to int64 first (``aten._to_copy``; the byte kernel takes int64 only).
The node's target, a ``QuantizedEmbedding``, holds the quantized table (one per table, shared
by its lookups), its report row, and computes the lookup in torch from the stored values
(``(codes - 0) * scale`` in float32, what the kernel computes: the self-check's composite
reference); ``float_table`` names the float table, which the self-check's comparison with the
module's eager forward looks the ids up in instead (the quantization is a change of the
weights, as a quantized linear's, not of the computation).

Guard: the pass runs only with ``embeddings=`` given, which ``strict=True`` refuses (the
kernel runs outside XNNPACK).  A table it cannot store so (an odd embedding dim for int4, a
group size not dividing it) is a refusal naming the table (``options.problems``), raised
with the others; a table computed by the program stays a float32 lookup.  A lookup whose
result torch.export's constant folding computed (positions of a static length) is no lookup
any more and keeps its float32 rows.
"""

from __future__ import annotations

import functools
import math
from typing import Any

import numpy as np
import torch

from ...tensor import QuantizedTensor
from ..program import AtenProgram
from ..report import ReportRow
from ..streaming import by_rows, is_meta
from ..weight_sqnr import weight_sqnr
from ..weights import EmbeddingScheme
from . import rewrite

aten = torch.ops.aten
EMBEDDING = aten.embedding.default


class QuantizedEmbedding:
    """A lookup in a quantized table: the target of the nodes this pass makes (module docstring).

    ``scheme``: the ``EmbeddingScheme``; ``float_table``: the placeholder name of the float
    table; ``shape``: (V, D); ``quantized``: the table's ``QuantizedTensor`` (None in a dry
    run, ``xq.check``); ``row``: its report row.  Compared by identity (an FX target).
    """

    def __init__(self, scheme: EmbeddingScheme, float_table: str, shape: tuple[int, int],
                 quantized: QuantizedTensor | None, row: ReportRow) -> None:
        self.scheme, self.float_table, self.shape, self.quantized, self.row = scheme, float_table, shape, quantized, row
        self.__name__ = f"quantized_decomposed.embedding_{'byte' if scheme.bits == 8 else '4bit'}"

    def __repr__(self) -> str:
        return f"{self.__name__}[{self.scheme}, {self.shape[0]}x{self.shape[1]}]"

    @property
    def why(self) -> str:
        """Where it runs, for the delegation report."""
        return (f"embeddings={str(self.scheme)!r}: ExecuTorch's quantized embedding kernel "
                "(quantized_ops_lib)")

    @functools.cached_property
    def dequantized(self) -> torch.Tensor:
        """The stored table's values: float32 (V, D)."""
        if self.quantized is None:
            raise AssertionError("a dry run's table holds no values")
        return torch.from_numpy(np.ascontiguousarray(self.quantized.dequantize(), np.float32))

    def __call__(self, ids: torch.Tensor) -> torch.Tensor:
        """The lookup computed from the stored values: float32 ``ids.shape + (D,)``."""
        return torch.nn.functional.embedding(ids, self.dequantized)

    def weight(self) -> np.ndarray:
        """The codes as the kernel reads them: int8 (V, D), or uint8 (V, D / 2) high nibble first."""
        from ...packing import pack_int4_high_first

        assert self.quantized is not None
        codes = np.ascontiguousarray(self.quantized.codes, np.int8)
        return codes if self.scheme.bits == 8 else pack_int4_high_first(codes)

    def scales(self) -> np.ndarray:
        """The scales as the kernel reads them: float32 (V,), or bfloat16 (V, D / G) (exact: the
        scheme's scales are bf16 values)."""
        import ml_dtypes

        assert self.quantized is not None
        scale = np.asarray(self.quantized.scale, np.float32)
        if self.scheme.bits == 8:
            return np.ascontiguousarray(scale.reshape(self.shape[0]))
        return np.ascontiguousarray(scale.astype(ml_dtypes.bfloat16))


def _dtype(node: Any) -> Any:
    return getattr(node.meta.get("val"), "dtype", None)


def _path(origin: str | None, node: Any) -> str:
    """The report's name of a table: the tensor's own name, unless the lookup ran in a module
    that name is not under (a table tied to an output layer, which torch.export may name
    ``lm_head.weight``): then the module that looked it up (``embed_tokens``)."""
    module = AtenProgram.module_path(node)
    if origin is None or (module and not origin.startswith(module + ".")):
        return module
    return origin[: -len(".weight")] if origin.endswith(".weight") else origin


def _table(program: AtenProgram, node: Any, scheme: EmbeddingScheme, options: Any) -> QuantizedEmbedding | str:
    """The ``QuantizedEmbedding`` of ``node``'s table, or why it cannot be made."""
    table = node.args[0]
    origin = program.origins.get(table.name)
    shape = tuple(int(d) for d in table.meta["val"].shape)
    path = _path(origin, node)
    where = (f"embedding table {origin or table.name!r} ({'x'.join(map(str, shape))}; node {node.name}, module "
             f"{AtenProgram.module_path(node) or '<top level>'})")
    why = scheme.refusal(shape)
    if why is not None:
        return f"{where} cannot take embeddings={str(scheme)!r}: {why}"
    rows, dim = shape
    nbytes = scheme.stored_nbytes((rows, dim))
    if getattr(options, "dry_run", False):
        return QuantizedEmbedding(scheme, table.name, (rows, dim), None,
                                  ReportRow(path, (rows, dim), str(scheme), nbytes, math.nan))
    method = getattr(options, "method", "mse")
    file, name = program.weight_file, program.stored.get(table.name, "")
    if is_meta(program.constants[table.name]) and file is not None and name in file.file.tensors:
        # a streaming export's table, read and quantized by pieces of rows (a 128k-token table is 1 GB of floats)
        file.check(name, shape, f"the table of {where}")
        quantized, sqnr = by_rows(lambda lo, hi: file.rows(name, lo, hi), shape, lambda t: scheme.quantize(t, method))
    else:
        values = program.array(table.name, f"the table of {where}")
        quantized = scheme.quantize(values, method)
        sqnr = weight_sqnr(values, quantized)
    row = ReportRow(path, (rows, dim), str(scheme), nbytes, sqnr)
    return QuantizedEmbedding(scheme, table.name, (rows, dim), quantized, row)


def _int64(program: AtenProgram, ids: Any, before: Any) -> Any:
    """``ids`` as int64 (a conversion node before ``before`` when they are not)."""
    if _dtype(ids) == torch.int64:
        return ids
    with program.graph.inserting_before(before):
        node = program.graph.call_function(aten._to_copy.default, (ids,), {"dtype": torch.int64})
    node.meta = {**before.meta, "val": torch.empty_like(ids.meta["val"], dtype=torch.int64)}
    return node


@rewrite("embeddings")
def quantize_tables(program: AtenProgram, options: Any) -> None:
    scheme: EmbeddingScheme | None = getattr(options, "embeddings", None)
    if scheme is None or getattr(options, "strict", False):
        return
    made: dict[str, QuantizedEmbedding] = {}
    for node in list(program.graph.nodes):
        if node.op != "call_function" or node.target is not EMBEDDING:
            continue
        table, ids = node.args[0], node.args[1]
        if not program.is_constant(table) or _dtype(table) != torch.float32 or \
                _dtype(ids) not in (torch.int64, torch.int32):
            continue
        target = made.get(table.name)
        if target is None:
            found = _table(program, node, scheme, options)
            if isinstance(found, str):
                options.problems.append(found)
                continue
            target = made[table.name] = found
        with program.graph.inserting_before(node):
            lookup = program.graph.call_function(target, (_int64(program, ids, node),))
        lookup.meta = dict(node.meta)
        node.replace_all_uses_with(lookup)
        program.graph.erase_node(node)


def embedding_rows(program: AtenProgram) -> list[ReportRow]:
    """The report rows of the quantized tables of ``program``, in the order of their first lookup."""
    seen: dict[int, ReportRow] = {}
    for node in program.graph.nodes:
        if node.op == "call_function" and isinstance(node.target, QuantizedEmbedding):
            seen.setdefault(id(node.target), node.target.row)
    return list(seen.values())
