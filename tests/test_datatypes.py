"""Datatype wire values, the storage table and the explicit C-enum mapping."""

import numpy as np
import pytest

import xnnquant as xq
from xnnquant.datatypes import STORAGE, XNN_C_DATATYPE, ZeroPoint, from_xnn_c, to_xnn_c

# Wire values from the schema (seed-schema.fbs, XNNDatatype).
WIRE = dict(invalid=0, fp32=1, fp16=2, qint8=3, quint8=4, qint32=5, qcint8=6, qcint32=7,
            qcint4=8, qdint8=9, qbint4=10)
# C values from XNNPACK 1adaa7c7 include/xnnpack.h (enum xnn_datatype).
C = dict(fp32=1, fp16=2, qint8=3, quint8=4, qint32=5, qcint8=6, qcint32=7, qcint4=8, qdint8=9, qbint4=12)


def test_wire_values():
    assert {d.name: d.value for d in xq.Datatype} == WIRE


def test_c_mapping_is_explicit_and_differs_for_qbint4():
    assert {d.name: to_xnn_c(d) for d in STORAGE} == C
    assert to_xnn_c(xq.Datatype.qbint4) != xq.Datatype.qbint4
    assert all(from_xnn_c(v) == xq.Datatype[k] for k, v in C.items())
    assert XNN_C_DATATYPE["qpint8"] == 10


def test_c_mapping_matches_xnnpack_header():
    import re
    from pathlib import Path
    header = Path("/work/.mirror/google+XNNPACK/repo")
    if not header.exists():
        pytest.skip("XNNPACK mirror not present (only on developer machines)")
    import subprocess
    text = subprocess.run(["git", "-C", str(header), "show",
                           "1adaa7c709d4839d29e1f219cb962b01c9e6a905:include/xnnpack.h"],
                          capture_output=True, text=True, check=True).stdout
    body = text[text.index("enum xnn_datatype {"):]
    body = body[: body.index("};")]
    names = re.findall(r"xnn_datatype_(\w+)\s*=\s*(\d+)", body)
    assert {n: int(v) for n, v in names} == XNN_C_DATATYPE


def test_unknown_c_value_is_named():
    with pytest.raises(xq.XnnquantError, match=r"XNNPACK datatype 10 \(qpint8\) has no XN01 wire value"):
        from_xnn_c(10)
    with pytest.raises(xq.XnnquantError, match="unknown datatype: got 42"):
        xq.storage(42)


def test_storage_facts_are_consistent():
    for dt, facts in STORAGE.items():
        if facts.quantized and facts.bits in (8, 32) and dt is not xq.Datatype.qdint8:
            info = np.iinfo(facts.numpy_dtype)
            assert (facts.code_min, facts.code_max) == (info.min, info.max), dt
    assert STORAGE[xq.Datatype.qcint4].zero_point is ZeroPoint.EIGHT
    assert STORAGE[xq.Datatype.qbint4].quant_params is xq.QuantParamsKind.PerChannelGroupQuant
    assert STORAGE[xq.Datatype.qdint8].quant_params is xq.QuantParamsKind.PerTokenDynamicQuant
    assert issubclass(xq.XnnquantError, ValueError)
