"""The bytes of a representative set of exported programs, hashed: the check that a change meant
to leave every program as it was (a refactor of the front end) does.

Programs (116): the tests' small models (``tests/export_models.py``) with every weight
scheme, a calibrated and a dynamic one, a streamed one, a saved program, the dynamic-dim and
buffer-updating modules of the tests; every tiny Hugging Face architecture of
``tests/hf_models.py`` (eager and sdpa attention, token ids and embeddings, dynamic tokens,
int8 embeddings); the whole all-MiniLM-L6-v2 with the main job's schemes; static int8 on the
benchmark's four networks (MobileNetV2 and EfficientNet-Lite0 with ImageNet weights and
photos) with the benchmark's variants, and on the six small architectures of
``tests/test_static_int8_architectures.py``; tiny decoders through ``xq.export_llm``.  For
each: the sha256 of ``to_pte()``, and of what else the export says that does not depend on
timing: its report rows, static int8 boundaries, its Fallback/Option warnings (text, and the
file and the text of the line they point at), and ``str(xq.check(...))`` for the small models.

Hashes depend on the CPU (static int8 calibrates on the real XNNPACK, whose kernels differ
between CPU classes, and prices its choices for a CPU class) and on the installed packages:
compare two runs on one machine, not against a stored file from another.  The source tree
used is the one this file is in (``python /path/to/tree/benchmarks/export_bytes.py``), so two
checkouts of the project can be compared with one virtual environment.

    python benchmarks/export_bytes.py --out before.json [--only static_int8 ...]
    python benchmarks/export_bytes.py --out after.json --compare before.json [--match rounding=learned]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import linecache
import sys
import tempfile
import time
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]  # this tree's xnnquant and its test models, first

#: Cases by group: name -> a function returning an ``Exported`` (or a string, for ``xq.check``).
CASES: dict[str, dict[str, Callable[[], Any]]] = {}


def case(group: str, name: str) -> Callable[[Callable[[], Any]], Callable[[], Any]]:
    def register(fn: Callable[[], Any]) -> Callable[[], Any]:
        CASES.setdefault(group, {})[name] = fn
        return fn
    return register


def sha(data: bytes | str) -> str:
    return hashlib.sha256(data.encode() if isinstance(data, str) else data).hexdigest()


def described(exported: Any) -> str:
    """What an export says besides its bytes that does not depend on timing."""
    rows = [(r.path, tuple(r.shape), r.scheme, r.nbytes, round(float(r.sqnr_db), 4), r.fallback)
            for r in exported.report]
    return repr((rows, list(exported.boundaries), exported.mutated_inputs, exported.state,
                 [str(t) for t in exported.inputs], [str(t) for t in exported.outputs]))


# ------------------------------------------------------------------ small models


def _small(name: str) -> tuple[Any, tuple[Any, ...]]:
    from export_models import MODELS

    return MODELS[name]()


def _register_small() -> None:
    import xnnquant as xq

    for model in ("mlp", "cnn", "mobilenet", "transformer"):
        for weights in ("fp32", "qc8w", "qc4w", "qb4w:32"):
            def export(model: str = model, weights: str = weights) -> Any:
                from export_models import FALLBACK

                module, inputs = _small(model)
                return xq.export(module, inputs, weights=weights, fallback=FALLBACK, progress=False)
            case("small", f"{model} {weights}")(export)

        def check(model: str = model) -> str:
            module, inputs = _small(model)
            return str(xq.check(module, inputs))
        case("small", f"{model} check")(check)
    for method in ("minmax", "gptq"):
        def calibrated(method: str = method) -> Any:
            import torch

            module, inputs = _small("transformer")
            g = torch.Generator().manual_seed(1)
            batches = [(torch.randn(inputs[0].shape, generator=g),) for _ in range(4)]
            return xq.export(module, inputs, weights="qb4w:32", method=method, calibration=batches, progress=False)
        case("small", f"transformer qb4w:32 {method} calibrated")(calibrated)

    @case("small", "transformer dynamic tokens")
    def dynamic() -> Any:
        import torch

        module, inputs = _small("transformer")
        return xq.export(module, inputs, weights="qc8w", progress=False,
                         dynamic_shapes=({1: torch.export.Dim("tokens", min=2, max=32)},))

    @case("small", "mlp saved program")
    def saved() -> Any:
        import torch

        module, inputs = _small("mlp")
        return xq.export(torch.export.export(module, inputs, strict=False), weights="qb4w:32", progress=False)

    @case("small", "llama-shaped decoder streamed")
    def streamed() -> Any:
        import torch

        from xnnquant.models.llama import LlamaConfig, decoder, write_random_safetensors

        config = LlamaConfig(hidden=64, intermediate=128, layers=2, heads=4, seq=8)
        with tempfile.TemporaryDirectory() as folder:
            path = write_random_safetensors(Path(folder) / "model.safetensors", config, seed=3)
            exported = xq.export(decoder(config), (torch.empty(1, config.seq, config.hidden, device="meta"),),
                                 weights="qb4w:32", state_dict=path, progress=False)
            exported.to_pte()  # read while the file exists
            return exported

    for module_name in ("TwoDynamic", "FromTheEnd", "MeanOverTime", "LinearsAroundATail"):
        def portable(module_name: str = module_name) -> Any:
            import test_export_dynamic as dyn
            import torch

            dims = {1: torch.export.Dim("seq", min=3, max=16)}
            if module_name == "TwoDynamic":
                dims[0] = torch.export.Dim("batch", max=4)
            module = getattr(dyn, module_name)().eval()
            return xq.export(module, (torch.randn(2, 5, 32),), weights="qb4w:32", dynamic_shapes=(dims,),
                             progress=False)
        case("small", f"dynamic {module_name}")(portable)

    @case("small", "MeanOverTime check")
    def mean_check() -> str:
        import test_export_dynamic as dyn
        import torch

        return str(xq.check(dyn.MeanOverTime().eval(), (torch.randn(2, 5, 32),), weights="fp32",
                            dynamic_shapes=({1: torch.export.Dim("seq", max=16)},)))

    for kind in ("cache", "slice", "index_put", "copy", "accumulate"):
        def stateful(kind: str = kind) -> Any:
            import test_export_state as state

            module = state.Cache() if kind == "cache" else state.Patterns(kind)
            return state._export(module.eval())
        case("small", f"state {kind}")(stateful)


# ------------------------------------------------------------------ transformers


def _register_hf() -> None:
    import hf_models

    import xnnquant as xq

    for name, build in hf_models.ARCHITECTURES.items():
        for attention in ("eager", "sdpa") if name in hf_models.WITH_ATTENTION else ("eager",):
            def export(build: Any = build, attention: str = attention) -> Any:
                module, inputs = build(attention)
                return xq.export(module, inputs, weights="qb4w:32", progress=False)
            case("transformers", f"{name} {attention}")(export)
        if name in hf_models.TEXT:
            def floats(build: Any = build) -> Any:
                module, inputs = hf_models.with_float_inputs(build())
                return xq.export(module, inputs, weights="qc8w", progress=False)
            case("transformers", f"{name} embeddings in")(floats)

    @case("transformers", "bert dynamic tokens, int8 embeddings")
    def bert_dynamic() -> Any:
        import torch

        module, inputs = hf_models.bert()
        tokens = torch.export.Dim("tokens", min=2, max=64)
        return xq.export(module, inputs, weights="qb4w:32", embeddings="int8", progress=False,
                         dynamic_shapes=tuple({1: tokens} for _ in inputs))


# ------------------------------------------------------------------ MiniLM


def _register_minilm() -> None:
    import xnnquant as xq

    for weights, method, calibrated, embeddings in (("fp32", "mse", False, None), ("qb4w:32", "mse", False, None),
                                                    ("qb4w:32", "gptq", True, None),
                                                    ("qb4w:32", "mse", False, "int8")):
        for batch in (1, 8):
            def export(weights: str = weights, method: str = method, calibrated: bool = calibrated,
                       embeddings: str | None = embeddings, batch: int = batch) -> Any:
                from xnnquant.cli import main_job

                module = _minilm()
                batches = main_job.calibration_batches()[:4] if calibrated else None
                return xq.export(module, main_job.examples()[batch], weights=weights, method=method,
                                 calibration=batches, calibration_mask=1 if calibrated else None,
                                 dynamic_shapes=main_job.dynamic_shapes(), embeddings=embeddings, progress=False)
            label = f"{weights} {method}" + (" calibrated" if calibrated else "") + (f" embeddings={embeddings}"
                                                                                     if embeddings else "")
            case("minilm", f"minilm {label} batch {batch}")(export)

    @case("minilm", "minilm encoder qc8w static int8")
    def static() -> Any:
        import torch

        from xnnquant.models import minilm

        module, (hidden, mask) = minilm.example(batch=2, tokens=16)
        g = torch.Generator().manual_seed(1)
        batches = [(torch.randn(hidden.shape, generator=g), mask) for _ in range(4)]
        return xq.export(module, (hidden, mask), weights="qc8w", activations="qint8", calibration=batches,
                         progress=False)


_MINILM: list[Any] = []


def _minilm() -> Any:
    if not _MINILM:
        from xnnquant.models import minilm_torch

        _MINILM.append(minilm_torch.sentence_encoder())
    return _MINILM[0]


# ------------------------------------------------------------------ static int8


def _register_static() -> None:
    import xnnquant as xq

    def network(name: str) -> tuple[Any, list[tuple[Any, ...]]]:
        import torch

        from xnnquant.models import cnn, efficientnet_lite, mobilenet_v2

        if name == "mobilenet_v2":
            module, batches = mobilenet_v2.build(), mobilenet_v2.photo_batches("calibration", 32)
        elif name == "efficientnet_lite0":
            module, batches = efficientnet_lite.build(), efficientnet_lite.photo_batches("calibration", 32)
        else:
            module = cnn.residual() if name == "residual" else cnn.inverted_residual()
            batches = cnn.random_batches(16, 1)
        return module, [(torch.from_numpy(x),) for x in batches]

    from static_int8 import VARIANTS  # the benchmark's (benchmarks/static_int8.py)

    every: dict[str, dict[str, Any]] = {"default": {}, **VARIANTS}
    for name in ("residual", "inverted", "mobilenet_v2", "efficientnet_lite0"):
        variants = every if name in ("residual", "inverted") else {k: every[k] for k in ("default", "budget=0.1")}
        for label, change in variants.items():
            def export(name: str = name, change: dict[str, Any] = change) -> Any:
                module, cal = network(name)
                return xq.export(module, cal[0], weights="qc8w", activations=xq.StaticInt8(**change),
                                 calibration=cal, progress=False)
            case("static_int8", f"{name} {label}")(export)

    import test_static_int8_architectures as zoo

    for name, (make, _, _) in zoo.ARCHITECTURES.items():
        for budget in (0.0, 0.3):
            def architecture(make: Any = make, budget: float = budget) -> Any:
                import torch

                module = zoo._normed(make())
                g = torch.Generator().manual_seed(2)
                cal = [(torch.randn(1, 3, 32, 32, generator=g),) for _ in range(16)]
                return xq.export(module, cal[0], weights="qc8w", calibration=cal, progress=False,
                                 activations=xq.StaticInt8(budget=budget))
            case("static_int8", f"{name.split(' (')[0]} budget={budget}")(architecture)


# ------------------------------------------------------------------ LLMs


def _register_llm() -> None:
    import xnnquant as xq

    def decoder(family: str) -> Any:
        import test_llm

        return test_llm._model(family)

    for family in ("llama", "qwen3", "phi3", "gemma", "phi", "gpt2"):
        def export(family: str = family) -> Any:
            return xq.export_llm(decoder(family), max_context=32, progress=False)
        case("llm", f"{family} qb4w:32 int8 embeddings")(export)
    for label, options in (("fp32", {"weights": "fp32", "embeddings": None}),
                           ("qc8w int4:32 embeddings", {"weights": "qc8w", "embeddings": "int4:32"}),
                           ("hadamard", {"rotation": "hadamard"})):
        def variant(options: dict[str, Any] = options) -> Any:
            return xq.export_llm(decoder("llama"), max_context=32, progress=False, **options)
        case("llm", f"llama {label}")(variant)


# ------------------------------------------------------------------ running


def _warning_lines(caught: list[warnings.WarningMessage]) -> str:
    import xnnquant as xq

    told = (xq.FallbackWarning, xq.OptionWarning)  # where each points: the file and the text of its line
    return repr([(w.category.__name__, str(w.message), Path(w.filename).name, linecache.getline(w.filename, w.lineno)
                  .strip()) for w in caught if issubclass(w.category, told)])


def run(groups: list[str], match: str = "") -> Iterator[tuple[str, dict[str, str], float]]:
    import torch

    registered = {"small": _register_small, "transformers": _register_hf, "minilm": _register_minilm,
                  "static_int8": _register_static, "llm": _register_llm}
    for group in groups:
        registered[group]()
        for name, make in CASES[group].items():
            if match not in f"{group}: {name}":
                continue
            torch.manual_seed(0)  # as the tests' conftest does before each test
            start = time.perf_counter()
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                made = make()
            if isinstance(made, str):
                hashes = {"check": sha(made)}
            else:
                pte = made.to_pte() if made.builder is not None or made.graph is not None else b""
                hashes = {"pte": sha(pte), "said": sha(described(made)), "warnings": sha(_warning_lines(caught))}
            yield f"{group}: {name}", hashes, time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, help="write the hashes here (JSON)")
    parser.add_argument("--compare", type=Path, help="a JSON of hashes from another run: list every difference")
    parser.add_argument("--only", nargs="+", default=["small", "transformers", "minilm", "static_int8", "llm"],
                        help="groups to run: small, transformers, minilm, static_int8, llm")
    parser.add_argument("--match", default="", help="only the programs whose 'group: name' contains this text")
    args = parser.parse_args()
    import xnnquant

    print(f"xnnquant from {Path(xnnquant.__file__).parent}", flush=True)
    found: dict[str, dict[str, str]] = {}
    for name, hashes, seconds in run(args.only, args.match):
        found[name] = hashes
        print(f"{seconds:7.1f} s  {hashes.get('pte', hashes.get('check', ''))[:12]}  {name}", flush=True)
    if args.out is not None:
        args.out.write_text(json.dumps(found, indent=1, sort_keys=True) + "\n")
    if args.compare is not None:
        before = json.loads(args.compare.read_text())
        differ = [f"  {name}: {what}" for name, hashes in found.items() for what, h in hashes.items()
                  if name in before and before[name].get(what) != h]
        missing = [name for name in found if name not in before]
        print(f"{len(found)} programs, {sum(name in before for name in found)} compared: "
              f"{len(differ)} difference(s)" + (f", {len(missing)} not in {args.compare}" if missing else ""))
        print("\n".join(differ))
        if differ:
            sys.exit(1)


if __name__ == "__main__":
    main()
