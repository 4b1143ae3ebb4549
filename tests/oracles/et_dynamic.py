"""Oracle: a ``.pte`` program that ExecuTorch 1.4.1's own flow writes for a dynamic
sequence length.

Run in a subprocess only: importing ``executorch.backends.xnnpack`` registers ExecuTorch's
own ``XnnpackBackend``, which must never happen inside the pytest process.

Usage: ``et_dynamic.py OUT_DIR [BOUND]``.  ``Heads`` (x ``[1, S, 32]`` -> ReLU of
``x.view(1, -1, 4, 8)``, permuted to ``[1, 4, S, 8]``) is exported with ``dynamic_shapes=({1: Dim("seq", min=2, max=BOUND)},)`` from an
example of 8 rows (BOUND 16 by default), lowered with
``to_edge_transform_and_lower(..., partitioner=[XnnpackPartitioner()])`` and written with
``to_executorch()`` to ``OUT_DIR/dynamic.pte``.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
from executorch.backends.xnnpack.partition.xnnpack_partitioner import XnnpackPartitioner
from executorch.exir import to_edge_transform_and_lower


class Heads(torch.nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(x.view(1, -1, 4, 8)).permute(0, 2, 1, 3)


def main(out: Path, bound: int) -> None:
    seq = torch.export.Dim("seq", min=2, max=bound)
    exported = torch.export.export(Heads(), (torch.randn(1, 8, 32),), dynamic_shapes=({1: seq},), strict=False)
    lowered = to_edge_transform_and_lower(exported, partitioner=[XnnpackPartitioner()])
    (out / "dynamic.pte").write_bytes(lowered.to_executorch().buffer)


if __name__ == "__main__":
    main(Path(sys.argv[1]), int(sys.argv[2]) if len(sys.argv) > 2 else 16)
