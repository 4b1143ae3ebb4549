"""Golden bytes: the XNNHeader and a minimal payload, derived by hand field by field."""

from __future__ import annotations

import pytest

from xnnquant.errors import PayloadError
from xnnquant.graph import Graph, load
from xnnquant.graph.header import XNNHeader


def test_header_golden_bytes() -> None:
    h = XNNHeader(flatbuffer_offset=32, flatbuffer_size=0x0102, constant_data_offset=0x0140,
                  constant_data_size=0x0A0B0C0D0E)
    assert h.to_bytes() == bytes([
        0x00, 0x00, 0x00, 0x00,              # 0..3   placeholder (a bare flatbuffer's root offset)
        0x58, 0x48, 0x30, 0x30,              # 4..7   magic "XH00"
        0x1E, 0x00,                          # 8..9   header length 30, u16 LE
        0x20, 0x00, 0x00, 0x00,              # 10..13 flatbuffer offset 32
        0x02, 0x01, 0x00, 0x00,              # 14..17 flatbuffer size 0x102
        0x40, 0x01, 0x00, 0x00,              # 18..21 constant data offset 0x140
        0x0E, 0x0D, 0x0C, 0x0B, 0x0A, 0x00, 0x00, 0x00,  # 22..29 constant data size, u64 LE
        0x00, 0x00,                          # 30..31 padding to 32
    ])
    assert XNNHeader.for_sizes(0x102, 5) == XNNHeader(32, 0x102, 32 + 0x110, 5)


def test_header_from_bytes_checks_bounds() -> None:
    good = XNNHeader.for_sizes(16, 16)
    payload = good.to_bytes() + bytes(32)
    assert XNNHeader.from_bytes(payload) == good and good.is_valid(len(payload))
    assert not good.is_valid(len(payload) - 1)
    with pytest.raises(PayloadError, match=r"constant region .* extends past the end of the 63-byte payload"):
        XNNHeader.from_bytes(payload[:-1])
    with pytest.raises(PayloadError, match="flatbuffer_size must be at least 8: got 4"):
        XNNHeader.from_bytes(XNNHeader(32, 4, 48, 0).to_bytes() + bytes(16))
    with pytest.raises(PayloadError, match="constant region must start after the flatbuffer"):
        XNNHeader.from_bytes(XNNHeader(32, 16, 40, 0).to_bytes() + bytes(16))
    with pytest.raises(PayloadError, match="no XNNHeader"):
        XNNHeader.from_bytes(b"\0\0\0\0XN01" + bytes(30))


# One fp32 external input of dims [3], nothing else.  Offsets are from the payload start;
# the flatbuffer starts at 32, so "-> n" targets are payload offsets.
MINIMAL_PAYLOAD = bytes.fromhex("".join(line.split("#")[0] for line in """
00000000 58483030 1e00 20000000 b0000000 d0000000 0000000000000000 0000  # header: fb at 32, 176 bytes; constants at 208, 0 bytes
20000000          # 32  root offset: XNNGraph table at 32 + 32 = 64
584e3031          # 36  file identifier "XN01"
0000              # 40  padding (the vtable below is 2-aligned, the table after it 4-aligned)
1600 2000         # 42  XNNGraph vtable: 22 bytes (9 slots), table 32 bytes
1c00 1800 1400    # 46  slot 0 version @+28, slot 1 xnodes @+24, slot 2 xvalues @+20
1000 0c00 0800    # 52  slot 3 num_externs @+16, slot 4 input_ids @+12, slot 5 output_ids @+8
0000 0000 0400    # 58  slot 6 constant_buffer, slot 7 mem_buffer_sizes absent; slot 8 constant_data @+4
16000000          # 64  XNNGraph table: soffset 22 -> vtable at 42
1c000000          # 68  constant_data -> 96
20000000          # 72  output_ids -> 104
20000000          # 76  input_ids -> 108
01000000          # 80  num_externs = 1
20000000          # 84  xvalues -> 116
24000000          # 88  xnodes -> 124
24000000          # 92  version -> 128
01000000 28000000 # 96  constant_data: 1 entry -> ConstantDataOffset table at 140 (reserved entry 0)
00000000          # 104 output_ids: 0 entries
01000000 00000000 # 108 input_ids: 1 entry, id 0
01000000 20000000 # 116 xvalues: 1 entry -> XValue table at 152
00000000          # 124 xnodes: 0 entries
01000000 30 00 0000  # 128 version: 1 byte "0", terminator, 2 padding
0400 0400         # 136 ConstantDataOffset vtable: 4 bytes (no fields present: offset 0, size 0), table 4
04000000          # 140 ConstantDataOffset table: soffset 4 -> vtable at 136
0800 0c00 0b00 0400  # 144 XValue vtable: 8 bytes, table 12; union type @+11, union value @+4
08000000          # 152 XValue table: soffset 8 -> vtable at 144
18000000          # 156 xvalue_union -> XNNTensorValue table at 180
000000 01         # 160 padding, xvalue_union_type = 1 (XNNTensorValue)
1000 1400         # 164 XNNTensorValue vtable: 16 bytes (6 slots; id_out 0 trimmed), table 20
1200 0c00 0800    # 168 datatype @+18, num_dims @+12, dims @+8
0000 0000 0400    # 174 constant_buffer_idx 0, external_id 0 (defaults, absent); flags @+4
10000000          # 180 XNNTensorValue table: soffset 16 -> vtable at 164
01000000          # 184 flags = 1 (external input)
0c000000          # 188 dims -> 200
01000000          # 192 num_dims = 1
0000 0100         # 196 padding, datatype = 1 (fp32), i16
01000000 03000000 # 200 dims: 1 entry, 3
""".splitlines()).replace(" ", ""))


def test_minimal_payload_golden_bytes() -> None:
    g = Graph()
    g.input((3,))
    assert g.to_bytes() == MINIMAL_PAYLOAD
    back = load(MINIMAL_PAYLOAD)
    assert back == g and back.inputs == [0] and back.values[0].dims == (3,)
