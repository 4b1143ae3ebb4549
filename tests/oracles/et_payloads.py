"""Oracle: the XNNGraph payloads ExecuTorch 1.4.1 writes for a torchao-quantized MLP
and for a float model using node kinds that only ExecuTorch 1.4.1's schema has.

Run in a subprocess only: importing ``executorch.backends.xnnpack`` registers ExecuTorch's
own ``XnnpackBackend``, which must never happen inside the pytest process.

Usage: ``et_payloads.py OUT_DIR``.  The MLP is three linears quantized with torchao's
``Int8DynamicActivationIntxWeightConfig`` (8-bit per-token dynamic activations):

====  ==========  ========================================  ===========================
name  features    weights                                   payload type
====  ==========  ========================================  ===========================
fc1   128 -> 64   int4, PerGroup(32), fp32 scales, bias     qbint4, group 32
fc2   64 -> 48    int4, PerAxis(0), no bias                 qbint4, group 64 (= K)
fc3   48 -> 16    int8, PerAxis(0), bias                    qcint8
====  ==========  ========================================  ===========================

It lowers the model with ``XnnpackPartitioner`` (the path of ExecuTorch's docs), runs the
resulting ``.pte`` with ``executorch.runtime`` and writes into OUT_DIR:

* ``payload.bin``: the delegate's processed bytes (XNNHeader + XN01 flatbuffer);
* ``named/<key>.bin``: every named-data blob of the delegate, one file per key;
* ``torchao_<name>_qdata.npy`` (int8 ``[N, K]``), ``_scale.npy`` (fp32 ``[N, K // g]`` or
  ``[N, 1]``), ``_zero_point.npy``, and ``_bias.npy`` (fp32 ``[N]``) when the layer has one;
* ``input.npy`` (fp32 ``[4, 128]``) and ``et_output.npy`` (fp32 ``[4, 16]``): what the
  ExecuTorch runtime computed on the ``.pte`` ExecuTorch wrote;
* ``program.pte``;
* ``later/payload.bin`` and ``later/named/<key>.bin``: the payload of ``Later`` (a
  transposed conv, tanh, exp, gelu, log, sin, cos, rsqrt and a 5-way concatenation),
  the node kinds ExecuTorch 1.4.1 appended to the schema;
* ``clash_input.npy`` / ``clash_output.npy``: ``xnnquant.graph.run`` on a small payload
  built with ``Graph``, executed in this process, where ExecuTorch's own
  ``XnnpackBackend`` is registered (``to_pte`` must not depend on which class of that
  name ``to_backend`` would pick).
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import numpy as np
import torch
from executorch.backends.xnnpack.partition.xnnpack_partitioner import XnnpackPartitioner
from executorch.exir import to_edge_transform_and_lower
from executorch.exir.lowered_backend_module import get_lowered_backend_modules
from executorch.runtime import Runtime
from torchao.quantization.granularity import PerAxis, PerGroup
from torchao.quantization.quant_api import Int8DynamicActivationIntxWeightConfig, quantize_


class Mlp(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = torch.nn.Linear(128, 64, bias=True)
        self.fc2 = torch.nn.Linear(64, 48, bias=False)
        self.fc3 = torch.nn.Linear(48, 16, bias=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc3(torch.relu(self.fc2(torch.relu(self.fc1(x)))))


CONFIGS = {
    "fc1": Int8DynamicActivationIntxWeightConfig(weight_dtype=torch.int4, weight_granularity=PerGroup(32)),
    "fc2": Int8DynamicActivationIntxWeightConfig(weight_dtype=torch.int4, weight_granularity=PerAxis(0)),
    "fc3": Int8DynamicActivationIntxWeightConfig(weight_dtype=torch.int8, weight_granularity=PerAxis(0)),
}


class Later(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.deconv = torch.nn.ConvTranspose2d(4, 6, 3, stride=2, padding=1, output_padding=1)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        a = self.deconv(x)
        b = (torch.tanh(a) + torch.exp(-a.abs()) + torch.nn.functional.gelu(a) + torch.log(a.abs() + 1)
             + torch.sin(a) * torch.cos(a) + torch.rsqrt(a.abs() + 1))
        return b, torch.cat([y, y * 2, y + 1, y - 1, y * y], dim=1)


def write_delegate(edge: Any, out: Path) -> None:
    """The single delegate's payload and named data of ``edge``, into ``out``."""
    lowered = get_lowered_backend_modules(edge.exported_program().graph_module)
    if len(lowered) != 1:
        raise SystemExit(f"expected one delegate, got {len(lowered)}")
    (out / "payload.bin").write_bytes(lowered[0].processed_bytes)
    store = lowered[0].named_data_store_output
    (out / "named").mkdir(parents=True, exist_ok=True)
    for key, entry in store.pte_data.items():
        (out / "named" / f"{key}.bin").write_bytes(bytes(store.buffers[entry.buffer_index]))


def main(out: Path) -> None:
    torch.manual_seed(0)
    model = Mlp().eval()
    for name, config in CONFIGS.items():
        quantize_(model, config, filter_fn=lambda m, fqn, name=name: fqn == name)
    for name in CONFIGS:
        layer = getattr(model, name)
        weight = layer.weight
        for field in ("qdata", "scale", "zero_point"):
            np.save(out / f"torchao_{name}_{field}.npy", getattr(weight, field).detach().numpy())
        if layer.bias is not None:
            np.save(out / f"torchao_{name}_bias.npy", layer.bias.detach().numpy())

    x = torch.randn(4, 128)
    exported = torch.export.export(model, (x,))
    edge = to_edge_transform_and_lower(exported, partitioner=[XnnpackPartitioner()])
    write_delegate(edge, out)
    pte = edge.to_executorch().buffer
    (out / "program.pte").write_bytes(pte)
    program = Runtime.get().load_program(pte)
    method = program.load_method("forward")
    np.save(out / "input.npy", x.numpy())
    np.save(out / "et_output.npy", method.execute([x])[0].numpy())
    later = Later().eval()
    examples = (torch.randn(1, 4, 5, 5), torch.randn(2, 3))
    (out / "later").mkdir(exist_ok=True)
    write_delegate(to_edge_transform_and_lower(torch.export.export(later, examples),
                                               partitioner=[XnnpackPartitioner()]), out / "later")
    clash_check(out)


def clash_check(out: Path) -> None:
    from xnnquant.graph import Graph, run

    g = Graph()
    a = g.input((3, 5))
    g.output(g.multiply(g.add(a, g.constant(np.arange(5, dtype=np.float32))), a))
    x = np.linspace(-1, 1, 15, dtype=np.float32).reshape(3, 5)
    np.save(out / "clash_input.npy", x)
    np.save(out / "clash_output.npy", run(g.to_bytes(), [x])[0])


if __name__ == "__main__":
    main(Path(sys.argv[1]))
