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


#: Every member of ``enum xnn_datatype`` in XNNPACK's include/xnnpack.h at commit
#: 1adaa7c709d4839d29e1f219cb962b01c9e6a905 (the XNNPACK inside executorch 1.4.1),
#: transcribed by hand from the header: the golden facts the library's table must hold.
XNNPACK_1ADAA7C7_ENUM_XNN_DATATYPE = dict(
    invalid=0, fp32=1, fp16=2, qint8=3, quint8=4, qint32=5, qcint8=6, qcint32=7, qcint4=8, qdint8=9,
    qpint8=10, int32=11, qbint4=12, pfp32=13, bf16=14, qduint8=15, pfp16=16, pqint8=17, qcint2=18,
)


def test_c_mapping_matches_xnnpack_header():
    assert XNN_C_DATATYPE == XNNPACK_1ADAA7C7_ENUM_XNN_DATATYPE
    assert C.items() <= XNNPACK_1ADAA7C7_ENUM_XNN_DATATYPE.items()


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


#: The runtime's own wire -> C conversion inside executorch 1.4.1's ``_portable_lib``:
#: ``executorch::backends::xnnpack::delegate::getDataType(const fb_xnnpack::XNNDatatype&)``.
GET_DATA_TYPE = "_ZN10executorch8backends7xnnpack8delegate11getDataTypeERKN10fb_xnnpack11XNNDatatypeE"


@pytest.mark.xnnpack
def test_c_mapping_is_what_the_runtime_itself_converts():
    """Independent of any header transcription: ask the compiled runtime and XNNPACK."""
    import ctypes

    from xnnquant.xnnpack._capi import load_library

    lib = load_library()
    get_data_type = lib[GET_DATA_TYPE]
    get_data_type.argtypes, get_data_type.restype = [ctypes.POINTER(ctypes.c_int16)], ctypes.c_int
    assert {d.name: get_data_type(ctypes.byref(ctypes.c_int16(d.value))) for d in xq.Datatype} == {
        d.name: XNN_C_DATATYPE[d.name] for d in xq.Datatype}

    def members(predicate: str) -> set[str]:
        fn = lib[f"xnn_datatype_is_{predicate}"]
        fn.argtypes, fn.restype = [ctypes.c_int], ctypes.c_bool
        return {name for name, value in XNN_C_DATATYPE.items() if fn(value)}

    assert members("blockwise_quantized") == {"qbint4"}
    assert members("channelwise_quantized") == {"qcint8", "qcint32", "qcint4", "qcint2"}
    assert members("integral") == {"int32"}
    assert members("quantized") == {"qint8", "quint8", "qint32", "qcint8", "qcint32", "qcint4", "qdint8",
                                    "qpint8", "qbint4", "qduint8", "pqint8", "qcint2"}
