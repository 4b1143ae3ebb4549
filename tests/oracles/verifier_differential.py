"""Oracle: our flatbuffer verifier and ``load`` against ExecuTorch 1.4.1's own checks.

Usage: ``verifier_differential.py OUT.json COUNT SEED``.  A valid payload is mutated
COUNT times (one or two random bytes inside its flatbuffer, so the header stays
consistent).  For each mutant the JSON records:

* ``bounds``: whether ``xnnquant.graph.bounds.check_bounds`` accepts the flatbuffer;
* ``load``: whether ``xnnquant.graph.load`` (with validation) accepts the payload;
* ``runtime``: what the runtime does when loading the program: ``ok``, ``verifier``
  (its ``flatbuffers::Verifier`` refused the bytes), ``refused`` (a later check) or
  ``crashed``.

The parent builds one ``.pte`` and splices each mutant into it; each mutant is loaded
in a forked child (the parent imports the runtime once, before any fork, and never loads
a program), so crashes are contained.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
from typing import Any

import numpy as np

from xnnquant.errors import XnnquantError
from xnnquant.graph import load, to_pte
from xnnquant.graph.bounds import check_bounds
from xnnquant.graph.header import XNNHeader

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tests/: the fixtures
from graph_examples import random_graph

Runtime: Any = None  # executorch.runtime's, imported by main


def _runtime(pte: bytes) -> str:
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(read)
        log = tempfile.TemporaryFile()  # noqa: SIM115 (the child exits without cleanup)
        os.dup2(log.fileno(), 2)
        try:
            program = Runtime.get().load_program(pte)
            program.load_method("forward")
            verdict = "ok"
        except Exception:
            log.seek(0)
            verdict = "verifier" if b"FlatBuffer verification failed" in log.read() else "refused"
        os.write(write, verdict.encode())
        os._exit(0)
    os.close(write)
    verdict = os.read(read, 100).decode()
    os.close(read)
    _, status = os.waitpid(pid, 0)
    return "crashed" if os.WIFSIGNALED(status) else verdict or "no verdict"


def main(out: str, count: int, seed: int) -> None:
    global Runtime
    from executorch.runtime import Runtime  # once: each child would otherwise import torch again

    g = random_graph(11, ("XNNFullyConnected", "XNNConcatenate3", "XNNStaticTranspose"), every_datatype=False)
    base = g.to_bytes()
    header = XNNHeader.from_bytes(base)
    pte = to_pte(base, constants="inline")  # the payload as written, so that mutants can be spliced in
    at = pte.find(base)
    assert at >= 0
    rng = np.random.default_rng(seed)
    results = []
    for _ in range(count):
        mutant = bytearray(base)
        for _ in range(int(rng.integers(1, 3))):
            j = int(rng.integers(header.flatbuffer_offset, header.flatbuffer_offset + header.flatbuffer_size))
            mutant[j] = int(rng.integers(0, 256))
        fb = bytes(mutant[header.flatbuffer_offset:header.flatbuffer_offset + header.flatbuffer_size])
        try:
            check_bounds(fb)
            ours = True
        except XnnquantError:
            ours = False
        try:
            load(bytes(mutant))
            loaded = True
        except XnnquantError:
            loaded = False
        runtime = _runtime(pte[:at] + bytes(mutant) + pte[at + len(base):])
        changed = [(j, base[j], mutant[j]) for j in range(len(base)) if base[j] != mutant[j]]
        results.append({"bounds": ours, "load": loaded, "runtime": runtime, "changed": changed})
    with open(out, "w") as f:
        json.dump(results, f)


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]))
