"""Oracle: ``.pte`` programs ExecuTorch 1.4.1 writes through its own flow, and what its
runtime computes on them.

Run in a subprocess only: importing ``executorch.backends.xnnpack`` registers ExecuTorch's
own ``XnnpackBackend``, which must never happen inside the pytest process.

Usage: ``et_programs.py OUT_DIR``.  Every model is lowered with
``to_edge_transform_and_lower(..., partitioner=[XnnpackPartitioner()])`` and written with
``to_executorch()``; every program is run with ExecuTorch's runtime on ``input_<name>.npy``.
OUT_DIR receives:

=======================  ================================================================
file                     what
=======================  ================================================================
``torchao.pte``          ``Mlp`` quantized by torchao 0.18 (8-bit dynamic activations):
                         fc1 int4 PerGroup(32) affine (torchao's default), fc2 int4
                         PerGroup(64) HQQ scale-only, fc3 int8 PerAxis(0); named data in
                         the program
``torchao_ext.pte``      the same model, its constants tagged for an external file
``model.ptd``            (``unwrap_tensor_subclass``, then ExecuTorch's
                         ``delegate_external_constants_pass_unlifted`` with tag "model")
``xnnquant.pte``         three methods.  ``forward``: ``Split``, fc1 ``qb4w:32`` mse, a cumsum
                         (not delegated) between fc1 and fc2, fc2 ``qc4w`` minmax, fc3
                         ``qc8w`` mse: two XNNPACK delegates.  ``head``: ``Head``, one
                         linear ``qb4w:64`` minmax.  ``weight_only``: ``Head``, ``qc8w``
                         with ``activations=None``.  All through ``XnnquantConfig``
``decoder.pte``           transformers' Llama (one layer of width 64, eager attention, token
                         ids in, logits out), every linear through ``XnnquantConfig("qb4w:32",
                         method="mse")``: the linears among the rest of a real model
``torchao_<layer>_{qdata,scale,zero_point}.npy``  torchao's tensors of torchao.pte's layers
``float_<method>_<layer>.npy``   xnnquant.pte's float weights before quantization (and
                         ``float_decoder_<module path>.npy``, decoder.pte's)
``input_<name>.npy``, ``output_<name>.npy``   an input and what the ExecuTorch runtime
                         computed on it (name: torchao, torchao_ext, forward, head,
                         weight_only, decoder)
``eager_<name>.npy``     what the quantized torch module computed on the same input
=======================  ================================================================
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import torch
from executorch.backends.xnnpack.partition.xnnpack_partitioner import XnnpackPartitioner
from executorch.exir import to_edge_transform_and_lower
from executorch.exir.passes.external_constants_pass import delegate_external_constants_pass_unlifted
from executorch.extension.pybindings.portable_lib import _load_for_executorch_from_buffer
from torchao.quantization.granularity import PerAxis, PerGroup
from torchao.quantization.quant_api import Int8DynamicActivationIntxWeightConfig, quantize_
from torchao.quantization.quantize_.workflows.intx.intx_choose_qparams_algorithm import (
    IntxChooseQParamsAlgorithm,
)
from torchao.utils import unwrap_tensor_subclass

from xnnquant.torchao import XnnquantConfig


class Mlp(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = torch.nn.Linear(128, 64)
        self.fc2 = torch.nn.Linear(64, 96, bias=False)
        self.fc3 = torch.nn.Linear(96, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc3(torch.relu(self.fc2(torch.relu(self.fc1(x)))))


class Split(Mlp):
    """``Mlp`` with a cumsum, which XNNPACK does not take, between fc1 and fc2."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc3(torch.relu(self.fc2(torch.cumsum(self.fc1(x), dim=-1) / 8)))


class Head(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = torch.nn.Linear(128, 24)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(x)


TORCHAO = {
    "fc1": Int8DynamicActivationIntxWeightConfig(weight_dtype=torch.int4, weight_granularity=PerGroup(32)),
    "fc2": Int8DynamicActivationIntxWeightConfig(
        weight_dtype=torch.int4, weight_granularity=PerGroup(64),
        intx_choose_qparams_algorithm=IntxChooseQParamsAlgorithm.HQQ_SCALE_ONLY),
    "fc3": Int8DynamicActivationIntxWeightConfig(weight_dtype=torch.int8, weight_granularity=PerAxis(0)),
}
XNNQUANT = {
    ("forward", "fc1"): XnnquantConfig("qb4w:32", method="mse"),
    ("forward", "fc2"): XnnquantConfig("qc4w", method="minmax"),
    ("forward", "fc3"): XnnquantConfig("qc8w", method="mse"),
    ("head", "proj"): XnnquantConfig("qb4w:64", method="minmax"),
    ("weight_only", "proj"): XnnquantConfig("qc8w", method="mse", activations=None),
}


def quantize_layers(model: torch.nn.Module, configs: dict) -> None:
    for name, config in configs.items():
        quantize_(model, config, filter_fn=lambda m, fqn, name=name: fqn == name)


def run(pte: bytes, x: torch.Tensor, method: str = "forward", ptd: bytes | None = None) -> np.ndarray:
    module = _load_for_executorch_from_buffer(pte, ptd)  # reads pte and ptd in place: the caller keeps them
    return np.array(module.run_method(method, [x])[0].numpy())  # a copy: the module goes with this call


def save(out: Path, name: str, x: torch.Tensor, eager: torch.Tensor, result: np.ndarray) -> None:
    np.save(out / f"input_{name}.npy", x.numpy())
    np.save(out / f"eager_{name}.npy", eager.detach().numpy())
    np.save(out / f"output_{name}.npy", result)


def torchao_programs(out: Path) -> None:
    torch.manual_seed(0)
    model = Mlp().eval()
    quantize_layers(model, TORCHAO)
    for name in TORCHAO:
        weight = getattr(model, name).weight
        for field in ("qdata", "scale", "zero_point"):
            np.save(out / f"torchao_{name}_{field}.npy", getattr(weight, field).detach().numpy())
    x = torch.randn(4, 128)
    eager = model(x)
    pte = to_edge_transform_and_lower(torch.export.export(model, (x,)),
                                      partitioner=[XnnpackPartitioner()]).to_executorch().buffer
    (out / "torchao.pte").write_bytes(pte)
    save(out, "torchao", x, eager, run(pte, x))

    unwrap_tensor_subclass(model)
    tagged = torch.export.export(model, (x,)).module()
    delegate_external_constants_pass_unlifted(tagged, gen_tag_fn=lambda node: "model")
    manager = to_edge_transform_and_lower(torch.export.export(tagged, (x,)),
                                          partitioner=[XnnpackPartitioner()]).to_executorch()
    (out / "torchao_ext.pte").write_bytes(manager.buffer)
    manager.write_tensor_data_to_file(str(out))
    save(out, "torchao_ext", x, eager, run(manager.buffer, x, ptd=(out / "model.ptd").read_bytes()))


def xnnquant_program(out: Path) -> None:
    torch.manual_seed(1)
    models = {"forward": Split().eval(), "head": Head().eval(), "weight_only": Head().eval()}
    for method, layer in XNNQUANT:
        np.save(out / f"float_{method}_{layer}.npy", getattr(models[method], layer).weight.detach().numpy())
    for method, model in models.items():
        quantize_layers(model, {layer: c for (m, layer), c in XNNQUANT.items() if m == method})
    x = torch.randn(3, 128)
    exported = {method: torch.export.export(model, (x,)) for method, model in models.items()}
    pte = to_edge_transform_and_lower(exported, partitioner=[XnnpackPartitioner()]).to_executorch().buffer
    (out / "xnnquant.pte").write_bytes(pte)
    for method, model in models.items():
        save(out, method, x, model(x), run(pte, x, method))


class Decoder(torch.nn.Module):
    """transformers' Llama, one layer of width 64 (eager attention, no cache): ids -> logits."""

    def __init__(self) -> None:
        super().__init__()
        from transformers import LlamaConfig, LlamaForCausalLM

        config = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32,
                             attn_implementation="eager")
        self.model = LlamaForCausalLM(config)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.model(ids, use_cache=False).logits


def decoder_program(out: Path) -> None:
    torch.manual_seed(2)
    model = Decoder().eval()
    for name, layer in model.named_modules():
        if isinstance(layer, torch.nn.Linear):
            np.save(out / f"float_decoder_{name}.npy", layer.weight.detach().numpy())
    quantize_(model, XnnquantConfig("qb4w:32", method="mse"))
    ids = torch.randint(0, 128, (1, 12), generator=torch.Generator().manual_seed(3))
    pte = to_edge_transform_and_lower(torch.export.export(model, (ids,)),
                                      partitioner=[XnnpackPartitioner()]).to_executorch().buffer
    (out / "decoder.pte").write_bytes(pte)
    with torch.no_grad():
        save(out, "decoder", ids, model(ids), run(pte, ids))


if __name__ == "__main__":
    target = Path(sys.argv[1])
    torchao_programs(target)
    xnnquant_program(target)
    decoder_program(target)
