"""``load`` on malformed bytes: a ``Graph`` or an ``XnnquantError``, never anything else.

Targeted cases (truncation at every length, wrong magic and identifier, header regions
past the end, wrong union tags, huge vector lengths, offset cycles) and random mutations
of valid payloads: with a header and a constant segment, a bare legacy flatbuffer with
inline constants, an XN00 one.  Each load must also finish quickly (no hang); memory
is bounded by construction (every length is checked against the buffer before use).
"""

from __future__ import annotations

import base64
import struct
import time

import numpy as np
import pytest
from graph_examples import random_graph
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from xnnquant.errors import PayloadError, UnsupportedConfigError, XnnquantError
from xnnquant.graph import Graph, Target, load
from xnnquant.graph.segment import ConstantSegment
from xnnquant.graph.writer import flatbuffer

MAX_SECONDS = 2.0  # per load; a valid load of these payloads takes milliseconds


# The delegate payload ExecuTorch 1.4.1 wrote for a three-linear MLP quantized by torchao
# (tests/oracles/et_torchao_8da4w.py): flatc's own layout, constants and scales in named
# data (8 keys), offsets UINT64_MAX.
ET_PAYLOAD = base64.b64decode(
    "AAAAAFhIMDAeACAAAADQCAAA8AgAAAAAAAAAAAAAAAAgAAAAWE4wMQAAFgAgAAQACAAMABAAFAAYAAAAAAAcABYAAACkCAAAcAcA"
    "AJADAAACAAAAgAMAAHQDAAAEAAAACQAAAFgDAADoAgAAdAIAAAgCAACkAQAAOAEAANQAAABoAAAABAAAALL9//8UAAAA////////"
    "//9AAAAAAAAAAEAAAABkNjQ3NTAzYmIzZmM4YjQ0NDBlZjIwMzZkYTQ4ZDBlZTlkNTg0ODdlNDA1MDgzMWJhYmU1ZjQ1YzUxNDYx"
    "YjZhAAAAAKL9//8YAAAA//////////9AAAAAAAAAAAAAAABGAAAAc2NhbGVfZThlYjIwMWYyOTRmZDA5ZmRiMzI5MDg0MjMxMmJl"
    "MjIyMjZhOTUxOGQ2OGYzZWIwOTAzN2FiZGZkZmUyZGU0YQAAev7//xQAAAD//////////wADAAAAAAAAQAAAADAyYjBhMzY1N2M3"
    "YTkxZjEwMDVhNjNkZjZkY2VlYTBiYmRhMTFlZWU3ZjVkYTFmZTZjOGRmNDVhZmRkYzBmZWQAAAAAav7//xgAAAD//////////2AA"
    "AAAAAAAAAAAAAEYAAABzY2FsZV8wNGEwODc0NjZkOGJlOGUxOTYxMzdjYzgxMDA1OWY2M2FlZGRkODZiMzA5ZWZhZmZjMGEyMWE5"
    "MTdhMmYyZTdkAABC////FAAAAP//////////AAYAAAAAAABAAAAAY2Q0OGUxMjlmMGZkNmI5N2QxNGFiNzBmNDQ1YWRmMjAzY2Iw"
    "YWE4MDgwNzI3Mjk5NDkyMTUxYjg3ZDRiN2M2YQAAAACi////FAAAAP//////////AAEAAAAAAABAAAAAMzU0OWQxNjA4NGNkYjZk"
    "YTI2MDYzZWJiNDI2N2IwNmY5OTEyODBjMTU5ZWI4ZWZiMDNmZTI2NjUxZmRhOWJkMgAACgAYAAgAEAAEAAoAAAAUAAAA////////"
    "//8AAgAAAAAAAEYAAABzY2FsZV9iMWRiOTUyZTdkMmQ5OWYwZTMyN2UzYzg2YjIyOWIxZTA4Y2YwM2U1ODY0NjM3Y2I4YzQ1ZWFm"
    "MjE0Y2I0ZTgxAAAAAAoAHAAIABAABAAKAAAAGAAAAP//////////ABAAAAAAAAAAAAAAQAAAAGQ1ZDNlZDhjZDFhMzE3NjA2MTFl"
    "YzE5MDczNzNhNjU5NTY3MjM0MTQzYzBiNGFjYWQ5YTFlYjlhM2FhMzYwNDEAAAoACAAAAAAABAAKAAAABAAAAAAAAAAAAAAAAQAA"
    "AAsAAAABAAAAAAAAAAwAAACcAwAAIAMAAIgCAABUAgAAIAIAAMwBAABsAQAAOAEAAOwAAACEAAAAUAAAAAQAAAAU/f//AAAAARgA"
    "AAAAABIAHAAGAAgADAAAABAAFAAYABIAAAAAAAEAAgAAABAAAAABAAAAAgAAAAsAAAACAAAABAAAABAAAADk/P//AAAAAQQAAACi"
    "/f//AAABAAEAAAAQAAAACAAAAP////8KAAAAAQAAABAAAAAU/f//AAAAAgQAAAAW/v//AAAAASgAAAAQAAAADAAQAAQAAAAIAAwA"
    "DAAAAAwAAAAHAAAAEAAAAAAAAAAC/v//AAAGAAIAAAAQAAAABgAAAP////8JAAAAAgAAABAAAAAwAAAAeP3//wAAAAIEAAAAev7/"
    "/wAAAAMQAAAABAAAACr///8BAAAA0v3//wAACQACAAAADAAAAP////8IAAAAAgAAAAQAAAAwAAAAwP3//wAAAAEEAAAAAv7//wAA"
    "AQACAAAADAAAAP////8HAAAAAgAAAAQAAAAwAAAA8P3//wAAAAIEAAAA8v7//wAAAAQgAAAABAAAAOj+//8QAAAAQAAAAAUAAAAw"
    "AAAAAAAAANb+//8AAAoAAgAAABAAAAAEAAAA/////wYAAAACAAAAMAAAAEAAAABM/v//AAAAAgQAAAC6/v//AAAAAxgAAAAMAAAA"
    "AAAGAAgABAAGAAAAAQAAAK7+//8AAAkAAgAAAAwAAAD/////BQAAAAIAAAAEAAAAQAAAAJz+//8AAAABBAAAAN7+//8AAAEAAgAA"
    "AAwAAAD/////BAAAAAIAAAAEAAAAQAAAAMz+//8AAAABBAAAAIr///8AAAEAAQAAABAAAAADAAAA/////wMAAAABAAAAQAAAAHT/"
    "//8AAAACEAAAAAAACgAQAAgABwAMAAoAAAAAAAAERAAAABQAAAAQABQABAAAAAgAAAAMABAAEAAAABAAAAAgAAAAAgAAAAABAAAA"
    "AAAAAAASABwABgAIAAwAEAAUAAAAGAASAAAAAAAKAAIAAAAQAAAAAQAAAP////8CAAAAAgAAAEAAAACAAAAACAAOAAcACAAIAAAA"
    "AAAAAhAAAAAAAAoAEgAIAAcADAAKAAAAAAAAAywAAAAMAAAAAAAGAAoABAAGAAAAAQAAAAAAEgAYAAYACAAMAAAAEAAAABQAEgAA"
    "AAAACQACAAAADAAAAP////8BAAAAAgAAAAQAAACAAAAACAAMAAcACAAIAAAAAAAAARQAAAAQABQABgAIAAwAAAAAABAAEAAAAAAA"
    "AQACAAAACAAAAAEAAAACAAAABAAAAIAAAAAGAAAADAEAAMAAAACMAAAATAAAACwAAAAEAAAAFv///wAAAAIIAAAAEQAAALT///8I"
    "AAAACQAAAAoAAAALAAAAOv///wAAABIIAAAADgAAAKj///8HAAAACAAAAKD///8AAAACIAAAAAsAAAAEAAAAUP///wAAgH8MABQA"
    "BAAIAAwAEAAMAAAABQAAAAYAAAD/////BwAAAJL///8AAAASEAAAAAgAAAAIAAwABAAIAAgAAAAEAAAABQAAAAwAFAAHAAgADAAQ"
    "AAwAAAAAAAACIAAAAAUAAAAEAAAAvP///wAAgH8MABYABAAIAAwAEAAMAAAAAQAAAAIAAAADAAAABAAAAAAACgAQAAcACAAMAAoA"
    "AAAAAAASEAAAAAIAAAAIAAgAAAAEAAgAAAABAAAAAQAAADAAAAA="
)


def _payloads() -> list[bytes]:
    small = random_graph(11, ("XNNFullyConnected", "XNNConcatenate3", "XNNStaticTranspose"), every_datatype=False)
    quant = random_graph(12, ("XNNConv2d", "XNNAdd"), every_datatype=False)
    legacy = flatbuffer(random_graph(13, ("XNNFullyConnected", "XNNStaticSlice"), every_datatype=False),
                        ConstantSegment(), inline_constants=True, identifier=b"XN00")
    return [small.to_bytes(), quant.to_bytes(), legacy, ET_PAYLOAD]


PAYLOADS = _payloads()


def _load_or_error(data: bytes) -> Graph | None:
    start = time.perf_counter()
    try:
        return load(data)
    except XnnquantError:
        return None
    finally:
        assert time.perf_counter() - start < MAX_SECONDS, f"load took too long on {len(data)} bytes"


def _mutate(rng: np.random.Generator, data: bytes) -> bytes:
    p = bytearray(data)
    op = int(rng.integers(0, 6))
    if op == 0:  # flip a few bytes
        for _ in range(int(rng.integers(1, 4))):
            p[int(rng.integers(0, len(p)))] = int(rng.integers(0, 256))
    elif op == 1:  # truncate
        del p[int(rng.integers(0, len(p))):]
    elif op == 2:  # an interesting u32 over an aligned word (offsets, lengths, ids)
        j = int(rng.integers(0, len(p) // 4)) * 4
        word = int(rng.choice([0, 1, 0xFFFFFFFF, 0x7FFFFFFF, 0x80000000, len(p), len(p) - j, 37, 38, 99]))
        p[j:j + 4] = word.to_bytes(4, "little")
    elif op == 3:  # insert junk
        j = int(rng.integers(0, len(p)))
        p[j:j] = rng.integers(0, 256, int(rng.integers(1, 9))).astype(np.uint8).tobytes()
    elif op == 4:  # delete a run
        j = int(rng.integers(0, len(p)))
        del p[j:j + int(rng.integers(1, 9))]
    else:  # small signed change of a u16 (vtable sizes and field offsets)
        j = int(rng.integers(0, len(p) // 2)) * 2
        v = struct.unpack_from("<H", p, j)[0]
        struct.pack_into("<H", p, j, (v + int(rng.choice([-4, -2, 2, 4, 0x100]))) & 0xFFFF)
    return bytes(p)


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.integers(0, 2**32 - 1))
def test_random_mutations_of_valid_payloads(seed: int) -> None:
    """120 seeds x 100 mutations: 12000 malformed payloads per run."""
    rng = np.random.default_rng(seed)
    for i in range(100):
        _load_or_error(_mutate(rng, PAYLOADS[i % len(PAYLOADS)]))


@settings(max_examples=500, deadline=None)
@given(st.sampled_from(PAYLOADS), st.lists(st.tuples(st.integers(0, 10**6), st.integers(0, 255)), max_size=6),
       st.integers(0, 10**6))
def test_hypothesis_byte_edits(data: bytes, edits: list[tuple[int, int]], cut: int) -> None:
    p = bytearray(data)
    for pos, byte in edits:
        p[pos % len(p)] = byte
    _load_or_error(bytes(p[: max(1, len(p) - cut % 64)]))


@pytest.mark.parametrize("which", range(len(PAYLOADS)))
def test_every_truncation(which: int) -> None:
    data = PAYLOADS[which]
    assert load(data) is not None
    for n in range(len(data)):
        with pytest.raises(XnnquantError):
            load(data[:n])


def test_executorch_payload_reads_without_named_data() -> None:
    g = load(ET_PAYLOAD)
    assert len(g.load_info.named_keys) == 8 and g.load_info.missing_named_keys == g.load_info.named_keys
    assert sum(k.startswith("scale_") for k in g.load_info.named_keys) == 3
    assert [n.kind for n in g.nodes] == ["XNNConvert", "XNNFullyConnected"] * 3
    assert [g.value(n.inputs[1]).datatype.name for n in g.nodes[1::2]] == ["qbint4", "qbint4", "qcint8"]


def test_wrong_magic_and_identifier() -> None:
    data = bytearray(PAYLOADS[0])
    data[36:40] = b"XN99"  # flatbuffer identifier
    with pytest.raises(PayloadError, match=r"not an XNNGraph payload: got identifier b'XN99'"):
        load(bytes(data))
    data = bytearray(PAYLOADS[0])
    data[4:8] = b"XH01"  # no header magic: read as a bare flatbuffer whose identifier is wrong
    with pytest.raises(PayloadError, match="not an XNNGraph payload"):
        load(bytes(data))
    with pytest.raises(PayloadError):
        load(b"")


def test_header_regions_past_the_end() -> None:
    data = bytearray(PAYLOADS[0])
    struct.pack_into("<Q", data, 22, len(data))  # constant segment size
    with pytest.raises(PayloadError, match=r"constant region .* extends past the end"):
        load(bytes(data))
    data = bytearray(PAYLOADS[0])
    struct.pack_into("<I", data, 14, 0xFFFFFFF0)  # flatbuffer size
    with pytest.raises(PayloadError, match=r"flatbuffer region .* extends past the end"):
        load(bytes(data))


MINIMAL = Graph()
MINIMAL.input((3,))
MINIMAL_BYTES = MINIMAL.to_bytes()  # layout spelled out in test_graph_header.py


@pytest.mark.parametrize("tag, message", [(0, "type tag is NONE"), (3, "unknown type tag 3"),
                                          (255, "unknown type tag 255")])
def test_wrong_value_union_tag(tag: int, message: str) -> None:
    data = bytearray(MINIMAL_BYTES)
    data[163] = tag  # XValue.xvalue_union_type
    with pytest.raises(PayloadError, match=message):
        load(bytes(data))


def test_tensor_table_as_wrong_union_member_is_refused() -> None:
    data = bytearray(MINIMAL_BYTES)
    data[163] = 2  # claims XNNQuantizedTensorValue: its slot 0 would be a table offset
    with pytest.raises(XnnquantError):
        load(bytes(data))


@pytest.mark.parametrize("where", [200, 116, 108, 96, 128])  # dims, xvalues, input_ids, constant_data, version
@pytest.mark.parametrize("length", [0x7FFFFFFF, 0xFFFFFFFF, 1 << 20])
def test_huge_vector_lengths(where: int, length: int) -> None:
    data = bytearray(MINIMAL_BYTES)
    struct.pack_into("<I", data, where, length)
    start = time.perf_counter()
    with pytest.raises(PayloadError, match="lies outside the buffer"):
        load(bytes(data))
    assert time.perf_counter() - start < 0.5


def _root(data: bytes):
    from xnnquant.graph import schema_generated as fb

    return fb.XNNGraph.GetRootAs(data[32:], 0)


def test_zero_offsets_and_shared_tables() -> None:
    data = bytearray(MINIMAL_BYTES)
    struct.pack_into("<I", data, 156, 0)  # XValue -> union offset 0 (would point at itself)
    with pytest.raises(PayloadError, match="holds offset 0"):
        load(bytes(data))
    # every xvalues entry pointing at the same XValue table: the verifier counts each
    # visit (capped by the buffer size), the reader sees one id defined 64 times
    g = Graph()
    for _ in range(64):
        g.input((1,))
    data = bytearray(g.to_bytes())
    root = _root(bytes(data))
    vec = root._tab.Vector(root._tab.Offset(8)) + 32  # xvalues elements, payload offsets
    target = vec + struct.unpack_from("<I", data, vec)[0]
    for j in range(64):
        struct.pack_into("<I", data, vec + 4 * j, target - (vec + 4 * j))
    with pytest.raises(XnnquantError, match="value id 0 is defined more than once"):
        load(bytes(data))


def test_node_with_unknown_kind_tag() -> None:
    g = Graph()
    g.output(g.abs(g.input((2,))))
    data = bytearray(g.to_bytes())
    node = _root(bytes(data)).Xnodes(0)
    tag_at = 32 + node._tab.Pos + node._tab.Offset(4)  # XNode slot 0: xnode_union_type
    assert data[tag_at] == 30  # XNNAbs
    data[tag_at] = 99
    with pytest.raises(PayloadError, match="unknown type tag 99"):
        load(bytes(data))
    data[tag_at] = 41  # XNNLog: a 1.4.1 kind with the same table layout
    back = load(bytes(data))
    assert back.nodes[0].kind == "XNNLog"
    assert back.target == "1.4.1"  # read as a 1.4.1 graph, so written back as one
    assert back.to_bytes() == bytes(data)
    back.target = Target.XN01
    with pytest.raises(UnsupportedConfigError, match="not part of the schema of target xn01"):
        back.to_bytes()
