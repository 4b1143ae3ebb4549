"""Command line: ``xnnquant COMMAND ...`` (``build_parser`` lists the commands, ``main`` runs one).

Each command prints only xnnquant's own lines: what libraries write to stderr while they
load or run (torch and torchao registration warnings, the runtime's log) is held back, and
shown with ``--verbose``.  ``verify`` runs the payload or the program in a separate process
(``graph.worker``), so one that crashes the runtime is reported as an error with the
runtime's last log lines.  Bad input ends a command with one line ``xnnquant: error: ...``
and status 2, a fault of xnnquant with status 3; never a traceback unless ``--verbose``.

``--help`` text is plain: one line saying what the program or command does, its options,
then examples (``DESCRIPTION``, ``EXAMPLES`` and each command's ``Command`` row).
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import math
import os
import sys
import tempfile
import textwrap
import warnings
from collections.abc import Iterator
from typing import Any

from ..arguments import MAX_SECONDS, spelling
from ..errors import XnnquantError
from ..graph.divergence import TOLERANCE


def _report(args: argparse.Namespace) -> None:
    from .weights_report import main

    print(main(group_sizes=args.group_sizes))


#: The model ``xnnquant export`` exports when none is named.
DEFAULT_MODEL = "xnnquant.models.minilm_torch:example"


def load_model(spec: str) -> tuple[object, tuple[object, ...] | None]:
    """``(module, example_inputs)`` from ``package.module:factory`` (the factory's return
    value), or ``(ExportedProgram, None)`` from a ``.pt2`` file saved by ``torch.export.save``."""
    import importlib

    if spec.endswith(".pt2"):
        try:
            import torch
        except ImportError:
            from ..errors import missing_extra

            raise missing_extra("torch", "torch", "loading a .pt2 program") from None
        try:
            return torch.export.load(spec), None
        except Exception as exc:  # torch raises many kinds for files it cannot read
            raise XnnquantError(f"cannot load {spec!r} as a torch.export program (torch.export.save's format): "
                                f"{type(exc).__name__}: {exc}") from None
    expected = "expected package.module:factory, a callable returning (module, example_inputs), or a .pt2 file"
    name, sep, attr = spec.partition(":")
    if not sep or not name or not attr:
        raise XnnquantError(f"MODEL {spec!r} does not resolve: {expected}")
    try:
        factory = getattr(importlib.import_module(name), attr)
    except (ImportError, AttributeError) as exc:
        raise XnnquantError(f"MODEL {spec!r} does not resolve: {exc} ({expected})") from None
    except Exception as exc:  # the module itself fails while it is imported
        raise XnnquantError(f"MODEL {spec!r}: importing {name!r} failed: {type(exc).__name__}: {exc}") from exc
    if not callable(factory):
        raise XnnquantError(f"MODEL {spec!r}: {attr!r} is {type(factory).__name__}, not callable ({expected})")
    try:
        result = factory()
    except XnnquantError:
        raise
    except Exception as exc:  # whatever the user's factory raises: say which factory it was
        raise XnnquantError(f"MODEL {spec!r}: the factory raised {type(exc).__name__}: {exc}") from exc
    if not (isinstance(result, tuple) and len(result) == 2 and isinstance(result[1], (tuple, list))):
        raise XnnquantError(f"MODEL {spec!r}: the factory returned {type(result).__name__}, {expected}")
    return result[0], tuple(result[1])


def _export(args: argparse.Namespace) -> None:
    from pathlib import Path

    import xnnquant as xq

    module, example = load_model(args.model)
    with contextlib.redirect_stderr(args.terminal):  # the progress bar shows; libraries' chatter does not
        fallback = None if args.fallback.strip().lower() == "none" else args.fallback
        calibration = load_calibration(args.calibration) if args.calibration else None
        exported = xq.export(module, example, weights=args.weights, method=args.method, fallback=fallback,
                             target=args.target, progress=not args.no_progress, state_dict=args.weights_from,
                             dynamic_shapes=dynamic_shapes(args.dynamic, len(example or ())),
                             embeddings=args.embeddings, activations=args.activations,
                             calibration=calibration)
        path = exported.save(args.output)  # a streaming export quantizes here
    if args.json:
        print(exported.to_json())
        return
    seconds = sum(exported.timings.values())
    print(f"{exported}\nwrote {path} ({Path(path).stat().st_size:,} bytes), exported in {seconds:.2f} s")


def load_calibration(spec: str) -> Any:
    """The calibration batches of ``--calibration package.module:function`` (the function's
    return value: an iterable of input tuples)."""
    import importlib

    expected = "expected package.module:function, a callable returning an iterable of input tuples"
    name, sep, attr = spec.partition(":")
    if not sep or not name or not attr:
        raise XnnquantError(f"--calibration {spec!r} does not resolve: {expected}")
    try:
        function = getattr(importlib.import_module(name), attr)
    except (ImportError, AttributeError) as exc:
        raise XnnquantError(f"--calibration {spec!r} does not resolve: {exc} ({expected})") from None
    if not callable(function):
        raise XnnquantError(f"--calibration {spec!r}: {attr!r} is {type(function).__name__}, not callable ({expected})")
    try:
        return function()
    except XnnquantError:
        raise
    except Exception as exc:  # whatever the user's function raises: say which one it was
        raise XnnquantError(f"--calibration {spec!r}: the function raised {type(exc).__name__}: {exc}") from exc


def dynamic_shapes(specs: list[str], inputs: int) -> tuple[dict[int, object], ...] | None:
    """``--dynamic`` values as torch.export's ``dynamic_shapes`` (one ``{dim: Dim}`` per input)."""
    if not specs:
        return None
    import torch

    shapes: list[dict[int, object]] = [{} for _ in range(inputs)]
    for spec in specs:
        try:
            name, low, high, where = spec.split(":")
            dim = torch.export.Dim(name, min=int(low), max=int(high))
            places = [tuple(int(v) for v in item.split(".")) for item in where.split(",")]
        except (ValueError, TypeError) as exc:
            raise XnnquantError(f"--dynamic {spec!r}: expected NAME:MIN:MAX:INPUT.DIM[,INPUT.DIM...], e.g. "
                                f"seq:1:128:0.1,1.1 ({exc})") from None
        for place in places:
            if len(place) != 2 or not 0 <= place[0] < inputs:
                raise XnnquantError(f"--dynamic {spec!r}: {'.'.join(map(str, place))} is not INPUT.DIM of one of the "
                                    f"model's {inputs} inputs")
            shapes[place[0]][place[1]] = dim
    return tuple(shapes)


def _minilm(args: argparse.Namespace) -> None:
    from pathlib import Path

    from .main_job import main

    stream = None if args.no_progress else args.terminal
    if args.save is not None and not Path(args.save).is_dir():
        raise XnnquantError(f"--save must name an existing directory: got {args.save!r}")
    print(main(as_json=args.json, with_executorch=not args.no_executorch, progress=stream, save=args.save))


def inspect_checks(file: str, validated: bool) -> dict[str, Any]:
    """What ``xnnquant inspect`` checked of ``file`` and what it did not: it reads, it never
    runs (a file that passes may still crash the runtime: ``xnnquant verify`` runs it isolated)."""
    read = "the file's structure: headers, offsets, flatbuffers"
    rules = "every payload against XNNPACK 1.4.1's rules for values and nodes (graph.validate)"
    return {"checked": [read] + ([rules] if validated else []),
            "not_checked": ([] if validated else [rules + ": --no-validate"])
            + [f"the runtime: nothing was loaded or run (xnnquant verify {file} runs it, isolated)"],
            "run": False}


def _inspect(args: argparse.Namespace) -> None:
    import json

    from ..pte import is_pte, read_pte
    from .summary import describe, describe_program, graph_record, program_record

    checks = inspect_checks(args.file, not args.no_validate)
    if is_pte(args.file):
        program = read_pte(args.file, args.data, validate=not args.no_validate)
        record, text = (program_record(program, args.file), describe_program(program, args.file))
    else:
        _no_data_files(args)
        from ..graph import load

        graph = load(args.file, validate=not args.no_validate)
        record, text = {"file": args.file, **graph_record(graph)}, describe(graph)
    if args.json:
        print(json.dumps({**record, **checks}, indent=2))
    else:
        print(text)
        print("checked: " + "; ".join(checks["checked"]))
        print("not checked: " + "; ".join(checks["not_checked"]))


def _verify(args: argparse.Namespace) -> None:
    from pathlib import Path

    from ..pte import is_pte

    if args.no_isolate and args.timeout is not None:
        raise XnnquantError(f"--timeout limits the isolated runtime: got --timeout {args.timeout:g} with --no-isolate "
                            "(drop one of them)")
    try:
        if is_pte(args.file):
            from ..pte.run import verify_pte

            errors, text = verify_pte(args.file, args.data, seed=args.seed, isolate=not args.no_isolate,
                                      timeout=args.timeout)
        else:
            from ..graph.divergence import check_payload

            _no_data_files(args)
            errors, text = check_payload(Path(args.file).read_bytes(), seed=args.seed, isolate=not args.no_isolate,
                                         timeout=args.timeout)
    finally:
        if args.verbose and not args.no_isolate:  # the isolated runtime's log (graph.worker)
            from ..graph.worker import worker

            sys.stderr.write(worker().log_text())
    worst = max(errors, default=0.0, key=lambda e: math.inf if math.isnan(e) else e)
    ok = worst <= args.tolerance  # NaN is never within it
    if args.json:
        import json

        print(json.dumps({"file": args.file, "ok": ok, "worst_relative_error": _json_number(worst),
                          "tolerance": args.tolerance, "errors": [_json_number(e) for e in errors],
                          "seed": args.seed, "isolated": not args.no_isolate, "report": text.splitlines()}, indent=2))
    else:
        print(text)
        print(f"{'OK' if ok else 'MISMATCH'}: worst relative error {worst:.3g} (tolerance {args.tolerance:g})")
    if not ok:
        raise SystemExit(1)


def _json_number(x: float) -> float | str:
    """``x`` as JSON holds it: a number, or ``"inf"`` / ``"nan"`` (which JSON has not)."""
    return x if math.isfinite(x) else str(x)


def _no_data_files(args: argparse.Namespace) -> None:
    """``--data`` goes with a ``.pte``: a payload has no data files to read."""
    if args.data:
        raise XnnquantError(f"--data goes with an ExecuTorch program (.pte): {args.file!r} is not one (its bytes 4..7 "
                            "are not b'ET12'), and an XNNGraph payload has no data files")


def _seconds(text: str) -> float:
    """``--timeout``: a number of seconds > 0 (``arguments.seconds``)."""
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not 0 < value <= MAX_SECONDS:
        raise argparse.ArgumentTypeError(f"expected a number of seconds > 0 and at most {MAX_SECONDS:g}, got {text!r}")
    return value


def _seed(text: str) -> int:
    """``--seed``: an integer >= 0."""
    try:
        value = int(text)
    except ValueError:
        value = -1
    if value < 0:
        raise argparse.ArgumentTypeError(f"expected an integer >= 0, got {text!r}")
    return value


def _tolerance(text: str) -> float:
    """``--tolerance``: a finite number >= 0."""
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and value >= 0):
        raise argparse.ArgumentTypeError(f"expected a finite number >= 0, got {text!r}")
    return value


#: The program's one-line description: the first line of ``xnnquant --help``.
DESCRIPTION = "Quantize PyTorch models for XNNPACK; write, inspect and check .pte programs."

#: ``xnnquant --help``'s closing lines.
EPILOG = """examples:
  xnnquant export xnnquant.models.cnn:example -o cnn.pte --weights qc8w
  xnnquant inspect cnn.pte
  xnnquant verify cnn.pte
  make run                      (= xnnquant minilm: the main job)

xnnquant COMMAND --help shows a command's options and examples."""


class _CommandsFormatter(argparse.RawDescriptionHelpFormatter):
    """argparse's, with the commands' summaries in one column: it measures the command names
    at the section's indent but prints them indented once more, so a name of more than 8
    characters (export-llm) was put on a line of its own."""

    def add_argument(self, action: argparse.Action) -> None:
        super().add_argument(action)
        if isinstance(action, argparse._SubParsersAction):
            longest = max((len(name) for name in action.choices), default=0)
            self._action_max_length = max(self._action_max_length, longest + self._current_indent + 2)


def _add_command(sub: Any, name: str, summary: str, examples: tuple[str, ...], notes: str = "") -> Any:
    """A subcommand whose ``--help`` reads like the program's: ``summary`` (one line, also its
    row in ``xnnquant --help``), its options, then ``examples`` and ``notes`` (plain text)."""
    epilog = "examples:\n" + "\n".join(f"  {line}" for line in examples)
    if notes:
        epilog += "\n\n" + textwrap.fill(notes, width=78)
    return sub.add_parser(name, help=summary, description=summary[0].upper() + summary[1:] + ".", epilog=epilog,
                          formatter_class=argparse.RawDescriptionHelpFormatter)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="xnnquant", description=DESCRIPTION, epilog=EPILOG,
                                     formatter_class=_CommandsFormatter)
    sub = parser.add_subparsers(dest="command", required=True, title="commands", metavar="COMMAND")
    export = _add_command(
        sub, "export", "export a torch module to one XNNPACK program (.pte or .xnn)",
        ("xnnquant export xnnquant.models.cnn:example -o cnn.pte --weights qc8w",
         "xnnquant export my_models:factory -o model.pte --method mse --embeddings int8",
         "xnnquant export my_models:factory -o model.pte --dynamic seq:1:128:0.1,1.1",
         "xnnquant export xnnquant.models.cnn:example -o cnn-int8.pte --weights qc8w \\",
         "    --activations qint8 --calibration xnnquant.models.cnn:calibration",
         "xnnquant export my_models:on_meta -o big.pte --weights-from model.safetensors"),
        "MODEL is package.module:factory, a callable returning (module, example_inputs), or a .pt2 file "
        "saved by torch.export.save.  The report (one row per weight) and the delegation report follow.")
    export.add_argument("model", nargs="?", default=DEFAULT_MODEL,
                        help="package.module:factory (a callable returning (module, example_inputs)) or a .pt2 "
                             f"file saved by torch.export.save (default: {DEFAULT_MODEL}, the MiniLM encoder)")
    export.add_argument("-o", "--output", required=True, help="output file: .pte (ExecuTorch program) or .xnn "
                                                              "(bare XNNGraph payload)")
    export.add_argument("--weights", default="qb4w:32", help="fp32, qc8w, qc4w or qb4w:G (default qb4w:32)")
    export.add_argument("--method", default="mse", help="scale choice: minmax or mse (default mse)")
    export.add_argument("--embeddings", default=None, help="embedding tables: fp32 (default), int8 (per row) or "
                        "int4:G (groups of G along the embedding dim), on ExecuTorch's quantized embedding kernels")
    export.add_argument("--fallback", default="auto", help="schemes for layers that cannot take --weights: auto "
                        "(default: the most compact scheme each layer takes), none (refuse them), or schemes tried in "
                        "order, e.g. qc8w,fp32")
    export.add_argument("--dynamic", action="append", default=[], metavar="NAME:MIN:MAX:INPUT.DIM[,INPUT.DIM...]",
                        help="a dynamic dim: torch.export.Dim(NAME, min=MIN, max=MAX) for dim DIM of input INPUT "
                             "(0-based), e.g. seq:1:128:0.1,1.1; repeat for several dims")
    export.add_argument("--target", default="1.4.1", help="1.4.1 (default) or xn01 (XN01 node kinds only)")
    export.add_argument("--activations", default="dynamic", choices=("dynamic", "qint8"), type=spelling,
                        help="dynamic (int8 per token at run time, default) or qint8 (full-integer static int8: "
                             "needs --weights qc8w and --calibration)")
    export.add_argument("--calibration", default=None, metavar="package.module:function",
                        help="a callable returning the calibration batches (an iterable of input tuples)")
    export.add_argument("--weights-from", default=None, metavar="FILE.safetensors",
                        help="streaming export: the module is built on the meta device and its tensors are read "
                             "from this file (or the files of a sharded checkpoint's .json index) one at a time "
                             "while the output is written")
    export.add_argument("--json", action="store_true", help="print the report as JSON")
    export.add_argument("--no-progress", action="store_true", help="no progress bar")
    export.set_defaults(func=_export)
    from .llm import add_commands
    from .llm_job import add_command as add_llm_job

    add_commands(sub)
    inspect = _add_command(
        sub, "inspect", "list the values and nodes of a payload or a .pte's delegates",
        ("xnnquant inspect model.pte", "xnnquant inspect model.pte --data model.ptd --json",
         "xnnquant inspect model.xnn"),
        "A .pte is recognised by its identifier (ET12), whatever its name.")
    inspect.add_argument("file", help="payload file (with or without XNNHeader, XN00 or XN01) or ExecuTorch .pte")
    inspect.add_argument("--no-validate", action="store_true", help="show payloads the runtime would refuse")
    inspect.add_argument("--json", action="store_true", help="print the same as JSON")
    inspect.set_defaults(func=_inspect)
    verify = _add_command(
        sub, "verify", "check a payload or .pte on XNNPACK against the interpreter",
        ("xnnquant verify model.pte", "xnnquant verify model.xnn --seed 1 --tolerance 1e-3",
         "xnnquant verify model.pte --timeout 60"),
        "A payload runs on random inputs; a .pte runs every method on the ExecuTorch runtime and each "
        "XNNPACK delegate is checked on the inputs the program fed it.  The run happens in a separate "
        "process, so a payload that crashes the runtime is reported as an error.  Status 1 on a mismatch.")
    verify.add_argument("file", help="payload file or ExecuTorch .pte")
    verify.add_argument("--seed", type=_seed, default=0, help="seed of the random inputs (an integer >= 0)")
    verify.add_argument("--json", action="store_true", help="print the result as JSON (exit status as without it)")
    verify.add_argument("--tolerance", type=_tolerance, default=TOLERANCE,
                        help=f"largest relative error accepted (default {TOLERANCE:g})")
    verify.add_argument("--no-isolate", action="store_true",
                        help="run the payload in this process (a runtime crash then ends xnnquant)")
    verify.add_argument("--timeout", type=_seconds, default=None, metavar="SECONDS",
                        help="stop the isolated runtime after this long (default 300)")
    verify.set_defaults(func=_verify)
    report = _add_command(
        sub, "report", "every scheme on all-MiniLM-L6-v2's linears: bytes and SQNR",
        ("xnnquant report", "xnnquant report --group-sizes 32 128"))
    report.add_argument("--group-sizes", type=int, nargs="+", default=[32, 64, 128], metavar="G",
                        help="blockwise int4 group sizes (multiples of 32 dividing 384)")
    report.set_defaults(func=_report)
    minilm = _add_command(
        sub, "minilm", "the main job of make run: MiniLM, xq.export against ExecuTorch",
        ("xnnquant minilm", "xnnquant minilm --no-executorch --json", "xnnquant minilm --save programs/"),
        "Exports all-MiniLM-L6-v2 whole (token ids and mask in, sentence embedding out; tokens dynamic "
        "1..128) with each scheme, and with ExecuTorch's own flow; runs each .pte on the real XNNPACK on "
        "held-out sentences at their own lengths; prints size, export time, latency and embedding "
        "accuracy side by side.")
    minilm.add_argument("--json", action="store_true", help="print the rows as JSON")
    minilm.add_argument("--no-executorch", action="store_true", help="leave out ExecuTorch's own flow")
    minilm.add_argument("--no-progress", action="store_true", help="no progress bar")
    minilm.add_argument("--save", metavar="DIR", default=None,
                        help="also write every program to DIR (e.g. xnnquant-qb4w_32-mse-b1.pte), for xnnquant verify")
    minilm.set_defaults(func=_minilm)
    add_llm_job(sub)
    for command in (report, export, minilm, inspect, verify):
        command.add_argument("-v", "--verbose", action="store_true",
                             help="also show what torch, executorch and the runtime log")
    for command in (inspect, verify):
        command.add_argument("--data", action="append", default=[], metavar="PTD",
                             help="a .pte's data file (.ptd) holding its external constants; repeatable")
    return parser


@contextlib.contextmanager
def _held_back(verbose: bool) -> Iterator[list[str]]:
    """Hold back what libraries write to stderr (file descriptor 2, ``sys.stderr``,
    warnings, logging) while the block runs, unless ``verbose``.  Yields a list that
    holds the text once the block has ended."""
    held: list[str] = []
    if verbose:
        yield held
        return
    sys.stderr.flush()
    with tempfile.TemporaryFile() as sink, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        saved_fd, saved_stream = os.dup(2), sys.stderr
        previous_disable = logging.root.manager.disable
        os.dup2(sink.fileno(), 2)
        sys.stderr = open(os.dup(2), "w", encoding="utf-8", errors="replace", closefd=True)  # noqa: SIM115
        logging.disable(logging.WARNING)
        try:
            yield held
        finally:
            logging.disable(previous_disable)
            sys.stderr.close()
            sys.stderr = saved_stream
            os.dup2(saved_fd, 2)
            os.close(saved_fd)
            sink.seek(0)
            held.append(sink.read().decode("utf-8", "replace"))


def main(argv: list[str] | None = None) -> int:
    from ..pte.runtime_log import every_line

    args = build_parser().parse_args(argv)
    sys.stderr.flush()
    args.terminal = os.fdopen(os.dup(2), "w", encoding="utf-8", errors="replace")  # for progress bars
    try:
        # --verbose: the runtime's own log in full too (pte/runtime_log.py)
        with _held_back(args.verbose), every_line() if args.verbose else contextlib.nullcontext():
            args.func(args)
    except (XnnquantError, OSError) as exc:
        print(f"xnnquant: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("xnnquant: interrupted", file=sys.stderr)
        return 130
    except Exception as exc:  # a fault of xnnquant, not of the input: one line, unless asked for more
        if args.verbose:  # nothing was held back: the traceback follows what the libraries logged
            raise
        print(f"xnnquant: unexpected error (a fault of xnnquant; --verbose shows the traceback and what the "
              f"libraries logged): {type(exc).__name__}: {exc}", file=sys.stderr)
        return 3
    finally:
        args.terminal.close()
    return 0
