"""``weights="auto:B"``: a scheme per linear layer from each layer's measured effect, under a budget.

llama.cpp's K-quant mixes give some layers more bits by rule (``attn_v`` and ``ffn_down``
at 6 bits in Q4_K_M); here the rule is measured on the model being exported:

1. **Tokens.** The calibration batches when given; else text the float model writes itself
   (``SAMPLES`` sequences of ``SAMPLE_TOKENS`` tokens sampled from its bos token, a fixed
   seed): no data needed, and the statistics are those of the model's own distribution.
   A streaming export (no weights in memory) or ExecuTorch's llama ``Transformer`` (no
   ``transformers`` model to sample) takes the smallest candidate for every layer.
2. **Each layer's effect.** The loss's sensitivity to each weight, the diagonal of the
   empirical Fisher ``F = sum over sequences of (dL/dW)^2`` (one backward pass a sequence,
   float model), weighs the error of each candidate's stored weight::

       cost(layer, scheme) = 1/2 * sum_ij F_ij * (W_ij - dequantize(Q_scheme(W))_ij)^2

   the second-order estimate of the NLL a token gains when that layer alone is stored so
   (``method``'s codes; an activation-aware method is estimated with ``"mse"``'s).
3. **The budget.** Every planned layer starts at the smallest candidate (``CANDIDATES``:
   qb4w:32, then qc8w); the upgrades that buy the most estimated NLL a byte are taken
   until the layers' bytes reach ``B`` bits a weight (``B >= 4.5``, qb4w:32's own cost).

The LM head tied to an int8 token table is no candidate: it reads the table's codes
(``qc8w``, the same bytes, ``pte/writer.py``) for nothing, as llama.cpp reads its 8-bit
table for both.  An untied head is planned as any other layer.

``PlanRow`` says per layer what it got and why (its estimated costs, its bytes);
``format_plan`` prints them.  Measured on SmolLM2-135M: ``docs/llm.md``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ..errors import XnnquantError
from ..frontend.weights import LayerPlan, WeightScheme
from ..schemes.checks import ACTIVATION_AWARE_METHODS

#: The schemes a planned layer may take, smallest first.
CANDIDATES = ("qb4w:32", "qc8w")
#: ``weights="auto"``'s bits a weight.  On SmolLM2-135M (``docs/llm.md``) the upgrades past it buy
#: less a byte (emulated perplexity 43.19 at 4.6, 41.35 at 4.75, 40.33 at 5.0, 39.42 at 5.6; float
#: 35.99), and decode reads every layer's bytes each token (the program's time grows with them).
DEFAULT_BITS = 4.75
#: Sequences the float model writes for the Fisher when no calibration is given, and their length.
SAMPLES = 4
SAMPLE_TOKENS = 128
#: The seed of that sampling.
SEED = 0


def parse_auto(weights: Any) -> float | None:
    """The bits a weight of ``weights="auto"`` / ``"auto:B"`` (None for any other value)."""
    if not isinstance(weights, str):
        return None
    text = weights.strip().lower().replace(" ", "")
    head, sep, tail = text.partition(":")
    if head != "auto":
        return None
    if not sep:
        return DEFAULT_BITS
    try:
        bits = float(tail)
    except ValueError:
        bits = float("nan")
    smallest = 8 * WeightScheme.parse(CANDIDATES[0]).stored_nbytes((1, 32)) / 32
    if not smallest <= bits <= 32:
        raise XnnquantError(f"weights='auto:B' takes B, the bits a weight of the linear layers, in [{smallest}, 32] "
                            f"({CANDIDATES[0]} costs {smallest}): got {weights!r}")
    return bits


@dataclass(frozen=True)
class PlanRow:
    """One layer of a plan: its path, weight shape, the scheme it got, its bytes, the estimated
    NLL a token gains per candidate scheme (``cost``), and why."""

    path: str
    shape: tuple[int, ...]
    scheme: str
    nbytes: int
    cost: dict[str, float] = field(default_factory=dict)
    why: str = ""


def sample_tokens(model: Any, count: int = SAMPLES, length: int = SAMPLE_TOKENS, seed: int = SEED) -> Any:
    """``count`` sequences of ``length`` tokens the model writes from its bos token (int64
    ``[count, length]``), sampled with its own distribution (temperature 1), seeded."""
    import torch

    config = model.config
    bos = getattr(config, "bos_token_id", None)
    start = torch.full((count, 1), 0 if bos is None else int(bos), dtype=torch.int64)
    with torch.random.fork_rng(), torch.no_grad():
        torch.manual_seed(seed)
        out = model.generate(input_ids=start, attention_mask=torch.ones_like(start), do_sample=True, top_k=0,
                             top_p=1.0, temperature=1.0, max_new_tokens=length - 1, min_new_tokens=length - 1,
                             pad_token_id=int(bos or 0))
    return out[:, :length]


def fisher(model: Any, sequences: Sequence[Any], names: Sequence[str]) -> dict[str, np.ndarray]:
    """The diagonal empirical Fisher of the linear layers ``names``: per layer, float32 like its
    weight, the sum over ``sequences`` (int64 ``[1, n]`` each) of the squared gradient of that
    sequence's summed NLL."""
    import torch

    modules = dict(model.named_modules())
    weights = {n: modules[n].weight for n in names}
    out = {n: torch.zeros_like(w, dtype=torch.float32) for n, w in weights.items()}
    saved = {n: w.requires_grad for n, w in weights.items()}
    others = [p for p in model.parameters() if all(p is not w for w in weights.values())]
    others_saved = [p.requires_grad for p in others]
    try:
        for p in others:
            p.requires_grad_(False)
        for w in weights.values():
            w.requires_grad_(True)
        with torch.enable_grad():
            for ids in sequences:
                ids = torch.as_tensor(ids, dtype=torch.int64).reshape(1, -1)
                logits = model(input_ids=ids, use_cache=False).logits[0, :-1].float()
                loss = torch.nn.functional.cross_entropy(logits, ids[0, 1:], reduction="sum")
                grads = torch.autograd.grad(loss, list(weights.values()))
                for n, g in zip(weights, grads):
                    out[n] += g.float() ** 2
    finally:
        for n, w in weights.items():
            w.requires_grad_(saved[n])
        for p, flag in zip(others, others_saved):
            p.requires_grad_(flag)
    return {n: f.numpy() for n, f in out.items()}


def plan_weights(model: Any, bits: float, method: str, tokens: Sequence[Any] | None, *, prefix: str = "",
                 head_reads_table: bool = False) -> tuple[LayerPlan, list[PlanRow]]:
    """The ``LayerPlan`` of ``weights="auto:B"`` for a ``transformers`` causal LM (module docstring),
    and its rows.  ``tokens``: int64 ``[1, n]`` sequences (None: the model's own,
    ``sample_tokens``); ``prefix``: what the export's paths put before the model's module names;
    ``head_reads_table``: the head is tied to an int8 table (qc8w, outside the budget)."""
    from .emulate import head_name, linear_modules

    modules = linear_modules(model)
    head = head_name(model)
    planned = [n for n in modules if not (head_reads_table and n == head)]
    if not planned:
        raise XnnquantError(f"weights='auto' found no linear layer to plan in {type(model).__name__}")
    sequences = list(tokens) if tokens is not None else list(sample_tokens(model)[:, None])
    grams = fisher(model, sequences, planned)
    chosen = "mse" if method in ACTIVATION_AWARE_METHODS else method
    schemes = [WeightScheme.parse(s) for s in CANDIDATES]
    options: dict[str, list[tuple[int, float]]] = {}  # name -> (bytes, cost) per candidate
    shapes = {}
    for name in planned:
        w = modules[name].weight.detach().float().numpy()
        shapes[name] = tuple(int(d) for d in w.shape)
        found = []
        for scheme in schemes:
            if scheme.refusal(_linear(w.shape[1])) is not None:
                found.append((-1, float("inf")))
                continue
            q = scheme.quantize(w, chosen)
            stored = q.dequantize() if hasattr(q, "dequantize") else np.asarray(q)
            cost = 0.5 * float(np.dot(grams[name].ravel().astype(np.float64),
                                      ((w - stored).ravel().astype(np.float64)) ** 2)) / _predictions(sequences)
            found.append((scheme.stored_nbytes(shapes[name]), cost))
        options[name] = found
    budget = bits / 8 * sum(int(np.prod(s)) for s in shapes.values())
    pick = {n: next(k for k, (b, _) in enumerate(o) if b >= 0) for n, o in options.items()}
    spent = sum(options[n][k][0] for n, k in pick.items())
    upgrades = sorted(((o[0][1] - o[k][1]) / max(o[k][0] - o[0][0], 1), n, k)
                      for n, o in options.items() for k in range(1, len(o)) if o[k][0] > 0 and o[0][0] > 0)
    for gain, name, k in reversed(upgrades):
        extra = options[name][k][0] - options[name][pick[name]][0]
        if gain > 0 and extra > 0 and k > pick[name] and spent + extra <= budget:
            pick[name], spent = k, spent + extra
    rows, layers = [], {}
    ranked = sorted(upgrades, reverse=True)
    rank = {(n, k): i + 1 for i, (_, n, k) in enumerate(ranked)}
    for name in modules:
        path = prefix + name
        if name not in pick:
            shared = f"qc8w@{table_method(method)}"  # the table's codes whatever method= is
            layers[path] = shared
            rows.append(PlanRow(path, tuple(modules[name].weight.shape), shared, 0, {},
                                "tied to the int8 token table: reads its codes (no byte of its own)"))
            continue
        k = pick[name]
        spelled = CANDIDATES[k]
        layers[path] = spelled
        costs = {s: c for s, (_, c) in zip(CANDIDATES, options[name])}
        if k:
            why = (f"upgrade ranked {rank[(name, k)]} of {len(ranked)}: {costs[CANDIDATES[0]]:.2e} -> "
                   f"{costs[spelled]:.2e} estimated NLL a token for {options[name][k][0] - options[name][0][0]} bytes")
        else:
            better = rank.get((name, 1))
            why = "smallest candidate" + (f" (the upgrade to qc8w ranked {better} of {len(ranked)}: over budget)"
                                          if better else "")
        rows.append(PlanRow(path, shapes[name], spelled, options[name][k][0], costs, why))
    return LayerPlan.of(CANDIDATES[0], layers, {r.path: r.why for r in rows}), rows


def table_method(method: str) -> str:
    """The method an int8 token table is quantized with under ``method`` (``EmbeddingScheme.quantize``)."""
    return method if method in ("minmax", "range") else "mse"


def _linear(in_features: int) -> Any:
    from ..frontend.weights import Layer, LayerKind

    return Layer(LayerKind.LINEAR, int(in_features))


def _predictions(sequences: Sequence[Any]) -> int:
    return max(1, sum(int(np.prod(np.shape(s))) - 1 for s in sequences))


def format_plan(rows: Sequence[PlanRow]) -> str:
    """The plan as a table: path, shape, scheme, bytes, estimated costs, why."""
    lines = [f"{'layer':48s} {'shape':>12s} {'scheme':8s} {'bytes':>9s}  {'cost qb4w:32':>12s} {'cost qc8w':>10s}  why"]
    for r in rows:
        costs = [f"{r.cost.get(s, float('nan')):.2e}" for s in CANDIDATES]
        lines.append(f"{r.path:48s} {'x'.join(map(str, r.shape)):>12s} {r.scheme:8s} {r.nbytes:9d}  {costs[0]:>12s} "
                     f"{costs[1]:>10s}  {r.why}")
    return "\n".join(lines)
