"""Oracle: the constant bytes and payload framing of ExecuTorch 1.4.1's XNNPACK serializer.

Run in a subprocess only (importing ``executorch.backends.xnnpack`` registers ExecuTorch's
own ``XnnpackBackend``).  Usage::

    et_constant_segment.py IN.npz FLATBUFFER.bin OUT_DIR

``IN.npz`` holds arrays ``c0, c1, ...`` and a string array ``kinds`` saying how
ExecuTorch turns each into constant bytes, following ``NodeVisitor.get_serialized_buffer_index``:

* ``raw``: the tensor's storage as is (fp32, fp16, int8 codes, int32 biases);
* ``qc4w``: int8 codes in [-8, 7], packed by ``NodeVisitor.convert_to_qc4w``;
* ``conv``: an OIHW weight made channels-last (``convert_to_nhwc``);
* ``depthwise``: an ``[OC, 1, KH, KW]`` weight with in/out swapped, then channels-last.

Each blob goes into a ``NamedDataStore`` under its sha256 key with alignment
``CONSTANT_TENSOR_ALIGNMENT`` (as 1.4.1 does; the store keeps identical bytes once), and
the store's buffers are laid out with ``_pad_to(_aligned_size(...))``.  The payload is
``serialize_xnnpack_binary`` over that segment, with ``convert_to_flatbuffer`` replaced by
the given flatbuffer bytes (so only ExecuTorch's framing is exercised, not its flatc).

Writes ``segment.bin``, ``payload.bin`` and ``entries.json`` (``[[offset, size], ...]``,
one per input constant, in input order).
"""

from __future__ import annotations

import ctypes
import hashlib
import json
import sys
from pathlib import Path

import numpy as np
import torch
from executorch.backends.xnnpack.operators.node_visitor import NodeVisitor
from executorch.backends.xnnpack.serialization import xnnpack_graph_serialize as ser
from executorch.exir._serialize._named_data_store import NamedDataStore


def storage_bytes(t: torch.Tensor) -> bytes:
    """The tensor's whole storage, read through ctypes the way the node visitor does."""
    size = t.untyped_storage().nbytes()
    array = ctypes.cast(t.untyped_storage().data_ptr(), ctypes.POINTER(ctypes.c_char * size)).contents
    return bytes(array)


def et_bytes(arr: np.ndarray, kind: str) -> bytes:
    t = torch.from_numpy(np.ascontiguousarray(arr)).contiguous()
    if kind == "qc4w":
        t = NodeVisitor.convert_to_qc4w(t)
    elif kind == "conv":
        t = t.to(memory_format=torch.channels_last)
    elif kind == "depthwise":  # swap_in_out_for_weights with groups=1, then channels-last
        shape = t.shape
        t = t.reshape((1, shape[0]) + tuple(shape[1:])).permute(0, 2, 1, 3, 4)
        t = t.reshape((shape[1], shape[0]) + tuple(shape[2:])).contiguous()
        t = t.to(memory_format=torch.channels_last)
    elif kind != "raw":
        raise SystemExit(f"unknown kind {kind}")
    return storage_bytes(t)


def main(npz: Path, flatbuffer: Path, out: Path) -> None:
    data = np.load(npz)
    kinds = [str(k) for k in data["kinds"]]
    store = NamedDataStore()
    keys = []
    for i, kind in enumerate(kinds):
        blob = et_bytes(data[f"c{i}"], kind)
        key = hashlib.sha256(blob).hexdigest()
        store.add_named_data(key, blob, alignment=ser.CONSTANT_TENSOR_ALIGNMENT)
        keys.append((key, len(blob)))
    output = store.get_named_data_store_output()
    offsets, segment = [], b""
    for buf in output.buffers:
        offsets.append(len(segment))
        segment += ser._pad_to(buf, ser._aligned_size(len(buf), ser.CONSTANT_TENSOR_ALIGNMENT))
    entries = [[offsets[output.pte_data[key].buffer_index], size] for key, size in keys]

    fb = flatbuffer.read_bytes()
    original = ser.convert_to_flatbuffer
    ser.convert_to_flatbuffer = lambda graph: fb
    try:
        payload = ser.serialize_xnnpack_binary(None, bytearray(segment))
    finally:
        ser.convert_to_flatbuffer = original
    (out / "segment.bin").write_bytes(segment)
    (out / "payload.bin").write_bytes(payload)
    (out / "entries.json").write_text(json.dumps(entries))


if __name__ == "__main__":
    main(Path(sys.argv[1]), Path(sys.argv[2]), Path(sys.argv[3]))
