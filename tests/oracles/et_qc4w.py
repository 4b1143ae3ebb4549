"""Oracle: ExecuTorch 1.4.1's own int4 serializer (NodeVisitor.convert_to_qc4w).

Run in a subprocess (importing executorch.backends.xnnpack would shadow the test-only
XnnpackBackend that graph.run defines).  Usage: et_qc4w.py IN.npy OUT.npy
"""

import sys

import numpy as np
import torch
from executorch.backends.xnnpack.operators.node_visitor import NodeVisitor

for src, dst in zip(sys.argv[1::2], sys.argv[2::2]):
    codes = torch.from_numpy(np.load(src)).to(torch.int8)
    np.save(dst, NodeVisitor.convert_to_qc4w(codes).numpy())
