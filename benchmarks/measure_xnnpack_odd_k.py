"""Re-measure what the real XNNPACK computes for odd K (and transposed filters).

The table in ``xnnquant/xnnpack/fully_connected.py`` comes from this script.  Every case
is a raw one-node subgraph (no refusals of ours, bias handed over as XNNPACK wants it:
``bias / scale`` on the weight-only path), compared with a float64 reference built from
the integer codes.  The input buffer is followed by floats of value 1000, so a kernel
that reads past a row shows up even for M = 1.  Cases run in a child process; a case
that kills the child (segfault) is reported as a crash and the child is restarted.

Prints one line per (weight, path, layout): cases, right, wrong, crashed, examples.
"""

from __future__ import annotations

import itertools
import json
import subprocess
import sys

import numpy as np

MS, NS = (1, 2, 3, 5, 17), (1, 7, 16, 33)
ODD_K = (1, 3, 5, 7, 9, 15, 17, 31, 33, 63, 65, 67, 127, 129, 255)
GROUPS = [  # (weight, dynamic, transposed, K values)
    ("qcint8", True, False, ODD_K), ("qcint8", False, False, ODD_K),
    ("qcint4", True, False, ODD_K), ("qcint4", False, False, ODD_K),
    ("fp32", False, False, ODD_K),
    ("qcint8", True, True, (3, 33, 64)), ("qcint8", False, True, (3, 33, 64)),
    ("qcint4", True, True, (33, 64)), ("qcint4", False, True, (64,)),
    ("qbint4", True, True, (64, 128)),
]
RTOL = 1e-5


def run_case(kind: str, dynamic: bool, transposed: bool, m: int, n: int, k: int) -> float:
    """Relative error of XNNPACK's output for one configuration (bias included)."""
    from xnnquant import Datatype
    from xnnquant.constants import (
        XNN_FLAG_TRANSPOSE_WEIGHTS,
        XNN_VALUE_FLAG_EXTERNAL_INPUT,
        XNN_VALUE_FLAG_EXTERNAL_OUTPUT,
    )
    from xnnquant.packing import pack_int4, to_bf16
    from xnnquant.xnnpack import convert_f32_qd8
    from xnnquant.xnnpack.subgraph import Runtime, Subgraph

    rng = np.random.default_rng([m, n, k])
    x = rng.standard_normal((m, k)).astype(np.float32)
    b = rng.standard_normal(n).astype(np.float32)
    lo, hi = (-8, 8) if "4" in kind else (-127, 128)
    codes = rng.integers(lo, hi, (n, k)).astype(np.int8)
    scale = rng.uniform(0.01, 0.1, (n, 1)).astype(np.float32)
    stored = np.ascontiguousarray(codes.T) if transposed else codes
    dims = stored.shape
    with Subgraph(2) as sg:
        x_id = sg.tensor(Datatype.fp32, (m, k), external_id=0, flags=XNN_VALUE_FLAG_EXTERNAL_INPUT)
        if dynamic:
            q_id = sg.dynamic_tensor((m, k))
            sg.convert(x_id, q_id)
            x_id = q_id
        channel_dim = 1 if transposed else 0
        if kind == "fp32":
            codes = codes.astype(np.float32) * scale
            scale = np.ones_like(scale)
            w_id = sg.tensor(Datatype.fp32, dims, np.ascontiguousarray(codes.T) if transposed else codes)
        elif kind == "qbint4":
            g = 32
            bf = to_bf16(rng.uniform(0.01, 0.1, (n, k // g)).astype(np.float32))
            scale = np.repeat(bf.values, g, axis=1)
            w_id = sg.blockwise_tensor(dims, bf.bits, g, 8, pack_int4(stored), channel_dim=channel_dim)
        else:
            dt = Datatype.qcint4 if kind == "qcint4" else Datatype.qcint8
            data = pack_int4(stored) if dt is Datatype.qcint4 else stored
            w_id = sg.channelwise_tensor(dt, dims, scale[:, 0], channel_dim, 8 if dt is Datatype.qcint4 else 0, data)
        bias = b if dynamic or kind in ("fp32", "qbint4") else (b / scale[:, 0]).astype(np.float32)
        b_id = sg.tensor(Datatype.fp32, (n,), bias)
        y_id = sg.tensor(Datatype.fp32, (m, n), external_id=1, flags=XNN_VALUE_FLAG_EXTERNAL_OUTPUT)
        sg.fully_connected(x_id, w_id, b_id, y_id, flags=XNN_FLAG_TRANSPOSE_WEIGHTS if transposed else 0)
        runtime = Runtime(sg)
    buffer = np.full(m * k + 64, 1000.0, np.float32)
    buffer[: m * k] = x.ravel()
    y = np.zeros((m, n), np.float32)
    with runtime:
        runtime.run({0: buffer, 1: y})
    if dynamic:
        q = convert_f32_qd8(x)
        x = (q.codes.astype(np.float64) - q.zero_point[:, None]) * q.scale[:, None]
    ref = x.astype(np.float64) @ (codes.astype(np.float64) * scale).T + b
    return float(np.abs(y - ref).max() / np.abs(ref).max())


def child() -> None:
    """Read cases (JSON lines) from stdin, print one JSON result per case, flushed."""
    for line in sys.stdin:
        case = json.loads(line)
        try:
            result = {"err": run_case(*case)}
        except Exception as exc:  # an XnnquantError from a status: XNNPACK rejected it
            result = {"rejected": str(exc)}
        print(json.dumps(result), flush=True)


def measure(cases: list[tuple]) -> list[dict]:
    """Results for ``cases``, restarting the child after each crash."""
    results: list[dict] = []
    while len(results) < len(cases):
        todo = cases[len(results):]
        proc = subprocess.run([sys.executable, __file__, "--child"], capture_output=True, text=True,
                              input="".join(json.dumps(c) + "\n" for c in todo))
        done = [json.loads(line) for line in proc.stdout.splitlines()]
        results += done
        if len(results) < len(cases):
            results.append({"crash": proc.returncode})
    return results


def main() -> None:
    print(f"M in {MS}, N in {NS}; input followed by 1000.0; right means relative error <= {RTOL}")
    for kind, dynamic, transposed, ks in GROUPS:
        cases = [(kind, dynamic, transposed, m, n, k) for m, n, k in itertools.product(MS, NS, ks)]
        results = measure(cases)
        right = [c for c, r in zip(cases, results) if r.get("err", 1) <= RTOL]
        wrong = [c for c, r in zip(cases, results) if r.get("err", 0) > RTOL]
        crash = [c for c, r in zip(cases, results) if "crash" in r]
        rejected = [c for c, r in zip(cases, results) if "rejected" in r]
        label = f"{kind:6} {'dynamic' if dynamic else 'weight-only':11} {'(K, N)' if transposed else '(N, K)'}"
        print(f"{label} K={list(ks)}: {len(cases)} cases, {len(right)} right, {len(wrong)} wrong, "
              f"{len(crash)} crashed, {len(rejected)} rejected")
        for name, group in (("wrong", wrong), ("crashed", crash), ("rejected", rejected)):
            if group:
                shown = ", ".join(f"M{m} N{n} K{k}" for *_, m, n, k in group[:6])
                print(f"    {name}: {shown}{' ...' if len(group) > 6 else ''}")


if __name__ == "__main__":
    child() if "--child" in sys.argv else main()
