"""The core (schemes, packing, graph writer/reader, .pte writer/reader) imports and works without torch or executorch."""

import subprocess
import sys

SCRIPT = """
import sys
sys.modules["torch"] = None          # any 'import torch' now raises ImportError
sys.modules["executorch"] = None
import numpy as np
import xnnquant as xq
from xnnquant.graph import Graph, interpret, load, run, to_pte  # run imports torch on first use
from xnnquant.pte import read_pte
w = np.linspace(-1, 1, 64 * 32, dtype=np.float32).reshape(32, 64)
qt = xq.quantize_blockwise(w, group_size=32)
g = Graph()
x = g.input((2, 64))
y = g.fully_connected(g.convert(x, xq.Datatype.qdint8), g.constant(qt))
g.output(y)
assert load(g.to_bytes()).values[-1].dims is not None
pte = to_pte(g.to_bytes())  # xnnquant's own program writer and reader, constants as named data
(delegate,) = read_pte(pte).delegates
assert pte[4:8] == b"ET12" and len(delegate.named_data) == len(delegate.graph.load_info.named_keys) > 0
inline = to_pte(g.to_bytes(), constants="inline")
assert read_pte(inline).delegates[0].payload == g.to_bytes()
try:
    import xnnquant.xnnpack as bridge
    bridge.convert_f32_qd8(np.ones((1, 4), np.float32))
except xq.MissingExtraError as exc:
    assert "xnnpack" in str(exc), exc
else:
    raise SystemExit("the bridge ran without executorch")
print("ok")
"""


def test_core_without_torch_or_executorch():
    out = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr
