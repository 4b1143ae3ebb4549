"""The schema as data: every table's fields in slot order, the unions, the node kinds.

``schema.fbs`` is the source of truth; this module restates it so that the bounds check
(bounds.py) can bound-check any buffer before a single generated accessor runs, and so
that the writer and reader can handle the 37 node kinds by table instead of by hand.
``tests/test_graph_schema.py`` checks it against ``schema.fbs`` and the generated code.

Field types: ``u8 i16 u32 i32 u64 f32`` scalars; ``[u8] [u16] [u32] [f32]`` scalar
vectors; ``string``; a table name; ``[Table]`` a vector of tables; ``union:Name`` the
offset slot of a union (always right after its ``u8`` type slot).
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Any

Field = tuple[str, str]

_NODE_1X1: tuple[Field, ...] = (("input_id", "u32"), ("output_id", "u32"), ("flags", "u32"))
_POOL_FIELDS = ("padding_top", "padding_right", "padding_bottom", "padding_left", "pooling_height",
                "pooling_width", "stride_height", "stride_width", "dilation_height", "dilation_width")
_CONV_FIELDS = ("padding_top", "padding_right", "padding_bottom", "padding_left", "kernel_height",
                "kernel_width", "subsampling_height", "subsampling_width", "dilation_height", "dilation_width",
                "group_input_channels", "group_output_channels", "groups", "adjustment_height",
                "adjustment_width")

#: Tables of the XN01 schema (schema.fbs), fields in slot order (slot i sits at vtable offset 4 + 2i).
TABLES: dict[str, tuple[Field, ...]] = {
    "Buffer": (("storage", "[u8]"),),
    "PerChannelGroupQuant": (("scale", "[f32]"), ("channel_dim", "i32"), ("group_size", "i32"),
                             ("scale_bf16", "[u16]")),
    "PerChannelQuant": (("scale", "[f32]"), ("channel_dim", "i32")),
    "PerTokenDynamicQuant": (("num_nonbatch_dims", "i32"),),
    "PerTensorQuant": (("scale", "f32"), ("zero_point", "i32")),
    "XNNTensorValue": (("datatype", "i16"), ("num_dims", "u32"), ("dims", "[u32]"),
                       ("constant_buffer_idx", "u32"), ("external_id", "u32"), ("flags", "u32"),
                       ("id_out", "u32")),
    "XNNQuantizedTensorValue": (("tensor_value", "XNNTensorValue"), ("quant_params_type", "u8"),
                                ("quant_params", "union:XNNQuantParams")),
    "OutputMinMax": (("output_min", "f32"), ("output_max", "f32")),
    "XNode": (("xnode_union_type", "u8"), ("xnode_union", "union:XNodeUnion"), ("debug_handle", "u32"),
              ("output_min_max", "OutputMinMax")),
    "XValue": (("xvalue_union_type", "u8"), ("xvalue_union", "union:XValueUnion")),
    "XNNStaticTranspose": (("num_dims", "u32"), ("perm", "[u32]"), *_NODE_1X1),
    "XNNStaticResizeBilinear2D": (("new_height", "u32"), ("new_width", "u32"), *_NODE_1X1),
    "XNNStaticConstantPad": (("pre_paddings", "[u32]"), ("post_paddings", "[u32]"), ("padding_value", "f32"),
                             *_NODE_1X1),
    "_XNNNode2x1": (("input1_id", "u32"), ("input2_id", "u32"), ("output_id", "u32"), ("flags", "u32")),
    "_XNNNode1x1": _NODE_1X1,
    "_XNNCat": (("axis", "u32"), ("input1_id", "u32"), ("input2_id", "u32"), ("input3_id", "u32"),
                ("input4_id", "u32"), ("output_id", "u32"), ("flags", "u32")),
    "XNNELU": (("alpha", "f32"), *_NODE_1X1),
    "XNNFullyConnected": (("input1_id", "u32"), ("filter_id", "u32"), ("bias_id", "u32"), ("output_id", "u32"),
                          ("flags", "u32")),
    "_XNNNodeConv": (*((f, "u32") for f in _CONV_FIELDS), ("input1_id", "u32"), ("filter_id", "u32"),
                     ("bias_id", "u32"), ("output_id", "u32"), ("flags", "u32")),
    "_XNNPooling2D": (*((f, "u32") for f in _POOL_FIELDS), *_NODE_1X1),
    "XNNStaticReshape": (("num_dims", "u32"), ("new_shape", "[u32]"), *_NODE_1X1),
    "XNNStaticSlice": (("num_dims", "u32"), ("offsets", "[u32]"), ("sizes", "[u32]"), *_NODE_1X1),
    "XNNScaledDotProductAttention": (("query_id", "u32"), ("key_id", "u32"), ("value_id", "u32"),
                                     ("scale_id", "u32"), ("mask_id", "u32"), ("output_id", "u32"),
                                     ("flags", "u32")),
    "XNNArgMaxPooling2d": (*((f, "u32") for f in _POOL_FIELDS[:6]), ("input_id", "u32"),
                           ("output_value_id", "u32"), ("output_index_id", "u32"), ("flags", "u32")),
    "XNNLeakyReLU": (("negative_slope", "f32"), *_NODE_1X1),
    "ConstantDataOffset": (("offset", "u64"), ("size", "u64")),
    "XNNGraph": (("version", "string"), ("xnodes", "[XNode]"), ("xvalues", "[XValue]"), ("num_externs", "u32"),
                 ("input_ids", "[u32]"), ("output_ids", "[u32]"), ("constant_buffer", "[Buffer]"),
                 ("mem_buffer_sizes", "[u32]"), ("constant_data", "[ConstantDataOffset]")),
}

#: Fields later ExecuTorch schemas append (not in schema.fbs; read by slot, never written).
EXTENSIONS: dict[str, tuple[Field, ...]] = {
    "ConstantDataOffset": (("named_key", "string"),),
    "PerChannelQuant": (("scale_buffer_idx", "u32"), ("num_scales", "u32")),
    "PerChannelGroupQuant": (("scale_buffer_idx", "u32"), ("num_scales", "u32")),
    "XNNTensorValue": (("dq_datatype", "i16"),),
    "_XNNCat": (("input5_id", "u32"),),
}


def fields(table: str) -> tuple[Field, ...]:
    """XN01 fields then extension fields of ``table``, in slot order."""
    return TABLES[table] + EXTENSIONS.get(table, ())


def slot(table: str, name: str) -> int:
    """Vtable byte offset of field ``name`` of ``table`` (4 + 2 * field index)."""
    names = [f for f, _ in fields(table)]
    return 4 + 2 * names.index(name)


@dataclass(frozen=True)
class NodeKind:
    """One ``XNodeUnion`` member: its tag, table and how the table's fields are used."""

    name: str
    tag: int
    table: str
    n_required: int  # leading input fields that must name a value
    xn01: bool = True  # False: one of the 1.4.1 kinds (written only by Graph(target='1.4.1'))

    @property
    def input_fields(self) -> tuple[str, ...]:
        return tuple(f for f, _ in fields(self.table)
                     if f.endswith("_id") and not f.startswith("output") and self._has(f))

    @property
    def output_fields(self) -> tuple[str, ...]:
        return tuple(f for f, _ in fields(self.table) if f.startswith("output") and f.endswith("_id"))

    @property
    def param_fields(self) -> tuple[Field, ...]:
        return tuple((f, t) for f, t in fields(self.table) if not f.endswith("_id") and f != "flags")

    def _has(self, f: str) -> bool:
        # _XNNCat: ConcatenateN uses input1..inputN (input5 only exists in the extension)
        if self.table == "_XNNCat" and f.startswith("input"):
            return int(f[5]) <= self.n_required
        return True


_2X1, _1X1, _CAT, _CONV, _POOL = "_XNNNode2x1", "_XNNNode1x1", "_XNNCat", "_XNNNodeConv", "_XNNPooling2D"

# (name, table, required inputs) in union order; tag = position + 1
_XN01_KINDS: tuple[tuple[str, str, int], ...] = (
    ("XNNAdd", _2X1, 2), ("XNNFullyConnected", "XNNFullyConnected", 2), ("XNNSoftmax", _1X1, 1),
    ("XNNSigmoid", _1X1, 1), ("XNNStaticTranspose", "XNNStaticTranspose", 1), ("XNNClamp", _1X1, 1),
    ("XNNConv2d", _CONV, 2), ("XNNDiv", _2X1, 2), ("XNNStaticResizeBilinear2D", "XNNStaticResizeBilinear2D", 1),
    ("XNNStaticConstantPad", "XNNStaticConstantPad", 1), ("XNNAvgPooling2d", _POOL, 1), ("XNNMinimum", _2X1, 2),
    ("XNNDepthwiseConv2d", _CONV, 2), ("XNNMaxPooling2d", _POOL, 1), ("XNNMultiply", _2X1, 2),
    ("XNNSubtract", _2X1, 2), ("XNNFloor", _1X1, 1), ("XNNConvert", _1X1, 1), ("XNNGlobalAvgPooling2d", _1X1, 1),
    ("XNNStaticReshape", "XNNStaticReshape", 1), ("XNNArgMaxPooling2d", "XNNArgMaxPooling2d", 1),
    ("XNNSquareRoot", _1X1, 1), ("XNNCeiling", _1X1, 1), ("XNNHardswish", _1X1, 1),
    ("XNNLeakyReLU", "XNNLeakyReLU", 1), ("XNNMaximum", _2X1, 2), ("XNNNegate", _1X1, 1), ("XNNSquare", _1X1, 1),
    ("XNNELU", "XNNELU", 1), ("XNNAbs", _1X1, 1), ("XNNPReLU", _2X1, 2), ("XNNConcatenate2", _CAT, 2),
    ("XNNConcatenate3", _CAT, 3), ("XNNConcatenate4", _CAT, 4), ("XNNStaticSlice", "XNNStaticSlice", 1),
    ("XNNScaledDotProductAttention", "XNNScaledDotProductAttention", 5), ("XNNBatchMatrixMultiply", _2X1, 2),
)
# the 1.4.1 kinds: appended by ExecuTorch 1.4.1's schema (tags 38..47)
_ET141_KINDS: tuple[tuple[str, str, int], ...] = (
    ("XNNConcatenate5", _CAT, 5), ("XNNConvTranspose2d", _CONV, 2), ("XNNReciprocalSquareRoot", _1X1, 1),
    ("XNNLog", _1X1, 1), ("XNNGelu", _1X1, 1), ("XNNTanh", _1X1, 1), ("XNNExp", _1X1, 1), ("XNNSin", _1X1, 1),
    ("XNNCopy", _1X1, 1), ("XNNCos", _1X1, 1),
)

NODE_KINDS: dict[str, NodeKind] = {
    name: NodeKind(name, i + 1, table, req, xn01=i < len(_XN01_KINDS))
    for i, (name, table, req) in enumerate(_XN01_KINDS + _ET141_KINDS)
}
KIND_BY_TAG: dict[int, NodeKind] = {k.tag: k for k in NODE_KINDS.values()}
#: The 37 node kinds of the XN01 schema (schema.fbs), in union order: what ``Graph()`` writes.
XN01_NODE_KINDS: tuple[str, ...] = tuple(name for name, _, _ in _XN01_KINDS)
#: The 10 node kinds ExecuTorch 1.4.1's schema appended (tags 38..47): ``load`` reads them,
#: ``Graph(target="1.4.1")`` writes them (schema_141.fbs).
ET141_NODE_KINDS: tuple[str, ...] = tuple(name for name, _, _ in _ET141_KINDS)

#: Union members by tag (index 0 is NONE).
UNIONS: dict[str, tuple[str | None, ...]] = {
    "XNodeUnion": (None, *(KIND_BY_TAG[t].table for t in sorted(KIND_BY_TAG))),
    "XValueUnion": (None, "XNNTensorValue", "XNNQuantizedTensorValue"),
    "XNNQuantParams": (None, "PerChannelQuant", "PerTensorQuant", "PerTokenDynamicQuant", "PerChannelGroupQuant"),
}


def __getattr__(name: str) -> Any:
    if name == "SEED_NODE_KINDS":
        warnings.warn("xnnquant.graph.layout.SEED_NODE_KINDS is deprecated: use XN01_NODE_KINDS",
                      DeprecationWarning, stacklevel=2)
        return XN01_NODE_KINDS
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
