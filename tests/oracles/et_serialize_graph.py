"""Oracle: ExecuTorch 1.4.1's own serializer writes a graph described in JSON.

Run in a subprocess only (importing ``executorch.backends.xnnpack`` registers ExecuTorch's
own ``XnnpackBackend``).  Usage::

    et_serialize_graph.py GRAPH.json OUT_DIR

GRAPH.json describes values and nodes field by field with the schema's names (what
``xnnquant.graph.writer`` puts in each table) plus the constant blobs in hex.  This script
builds ExecuTorch's ``xnnpack_graph_schema`` dataclasses from it and serializes them with
``serialize_xnnpack_binary`` (dataclasses -> JSON -> flatc with ExecuTorch's schema.fbs),
twice:

* ``seed.bin``: constants in the payload's own segment (offset/size entries, no
  ``named_key``), scales inline: the seed-era form;
* ``named.bin``: the form ExecuTorch 1.4.1 itself emits: every constant and every
  per-channel / blockwise scale vector moved to named data under its sha256 key
  (``scale_`` prefix for scales, blockwise scales as bf16), entries with offset
  UINT64_MAX, empty inline scale lists; the blobs go to ``named/<key>.bin``.
"""

from __future__ import annotations

import hashlib
import json
import math
import struct
import sys
from pathlib import Path
from typing import Any

from executorch.backends.xnnpack.serialization import xnnpack_graph_schema as S
from executorch.backends.xnnpack.serialization.xnnpack_graph_serialize import serialize_xnnpack_binary

UINT64_MAX = 2**64 - 1
INVALID = 0xFFFFFFFF


def _bound(x: float) -> float | str:
    return ("+inf" if x > 0 else "-inf") if math.isinf(x) else x


def _bf16_bits(values: list[float]) -> bytes:
    """fp32 -> bf16 bit patterns, as torch's .to(torch.bfloat16) does (values already bf16-exact)."""
    import torch

    return torch.tensor(values, dtype=torch.float32).to(torch.bfloat16).view(torch.uint16).numpy().tobytes()


class _Builder:
    def __init__(self, desc: dict[str, Any], named: bool) -> None:
        self.desc, self.named = desc, named
        self.blobs = [bytes.fromhex(h) for h in desc["constants"]]
        self.entries: list[Any] = [S.ConstantDataOffset(offset=0, size=0, named_key=None)]
        self.segment = b""
        self.named_data: dict[str, bytes] = {}

    def constant(self, blob: bytes, prefix: str = "") -> int:
        idx = len(self.entries)
        if self.named:
            key = prefix + hashlib.sha256(blob).hexdigest()
            self.named_data[key] = blob
            self.entries.append(S.ConstantDataOffset(offset=UINT64_MAX, size=len(blob), named_key=key))
        else:
            self.entries.append(S.ConstantDataOffset(offset=len(self.segment), size=len(blob), named_key=None))
            self.segment += blob + b"\0" * (-len(blob) % 16)
        return idx

    def quant(self, q: dict[str, Any]) -> Any:
        kind = q.pop("type")
        if kind in ("PerTensorQuant", "PerTokenDynamicQuant"):
            return getattr(S, kind)(**q)
        if not self.named:
            return getattr(S, kind)(**q, scale_buffer_idx=0, num_scales=0)
        scale = q.pop("scale")
        q.pop("scale_bf16", None)
        blob = _bf16_bits(scale) if kind == "PerChannelGroupQuant" else struct.pack(f"<{len(scale)}f", *scale)
        idx = self.constant(blob, prefix="scale_")
        return getattr(S, kind)(scale=[], **q, scale_buffer_idx=idx, num_scales=len(scale))

    def value(self, v: dict[str, Any]) -> Any:
        idx = self.constant(self.blobs[v["constant"]]) if v["constant"] is not None else 0
        tv = S.XNNTensorValue(datatype=S.XNNDatatype(v["datatype"]), num_dims=len(v["dims"]), dims=v["dims"],
                              constant_buffer_idx=idx, external_id=v["external_id"], flags=v["flags"],
                              id_out=v["id_out"])
        if v["quant"] is None:
            return S.XValue(xvalue_union=tv)
        return S.XValue(xvalue_union=S.XNNQuantizedTensorValue(tensor_value=tv, quant_params=self.quant(v["quant"])))

    def node(self, n: dict[str, Any]) -> Any:
        fields = dict(n["fields"])
        if n["kind"].startswith("XNNConcatenate"):
            fields.setdefault("input5_id", INVALID)
        bounds = None
        if n["output_min"] is not None:
            bounds = S.OutputMinMax(output_min=_bound(n["output_min"]), output_max=_bound(n["output_max"]))
        return S.XNode(xnode_union=getattr(S, n["kind"])(**fields), debug_handle=n["debug_handle"],
                       output_min_max=bounds)

    def payload(self) -> bytes:
        values = [self.value(v) for v in self.desc["values"]]
        nodes = [self.node(n) for n in self.desc["nodes"]]
        graph = S.XNNGraph(version="0", xnodes=nodes, xvalues=values, num_externs=self.desc["num_externs"],
                           input_ids=self.desc["input_ids"], output_ids=self.desc["output_ids"],
                           constant_data=self.entries)
        return serialize_xnnpack_binary(graph, bytearray(self.segment))


def main(graph_json: Path, out: Path) -> None:
    for named, name in ((False, "seed.bin"), (True, "named.bin")):
        b = _Builder(json.loads(graph_json.read_text()), named)
        (out / name).write_bytes(b.payload())
        if named:
            (out / "named").mkdir(exist_ok=True)
            for key, blob in b.named_data.items():
                (out / "named" / f"{key}.bin").write_bytes(blob)


if __name__ == "__main__":
    main(Path(sys.argv[1]), Path(sys.argv[2]))
