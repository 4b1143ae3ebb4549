"""Command line.

* ``xnnquant report``: every scheme on all-MiniLM-L6-v2's linears (the main job of ``make run``);
* ``xnnquant inspect FILE``: the values and nodes of an XNNGraph payload, or of every
  XNNPACK delegate of an ExecuTorch program (``.pte``), with bytes by datatype;
* ``xnnquant verify FILE``: run a payload on the real XNNPACK and on the reference
  interpreter; run every method of a ``.pte`` on the ExecuTorch runtime and check each
  XNNPACK delegate against the interpreter on the inputs the program fed it.

``.pte`` files are recognised by their identifier (``ET12``), whatever their name; the
``.ptd`` data files ExecuTorch writes for external constants are given with ``--data``.

Normal runs print only xnnquant's own lines: what libraries write to stderr while they
load or run (torch and torchao registration warnings, the runtime's log) is held back,
and shown with ``--verbose``.  ``verify`` runs the payload in a separate process, so a
payload that crashes the runtime is reported as an error.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import sys
import tempfile
import warnings
from collections.abc import Iterator

from .errors import XnnquantError


def _report(args: argparse.Namespace) -> None:
    from .report import main

    print(main(group_sizes=args.group_sizes))


def _inspect(args: argparse.Namespace) -> None:
    import json

    from .pte import is_pte, read_pte
    from .summary import describe, describe_program, graph_record, program_record

    if is_pte(args.file):
        program = read_pte(args.file, args.data, validate=not args.no_validate)
        print(json.dumps(program_record(program, args.file), indent=2) if args.json
              else describe_program(program, args.file))
        return
    from .graph import load

    graph = load(args.file, validate=not args.no_validate)
    if args.json:
        print(json.dumps({"file": args.file, **graph_record(graph)}, indent=2))
    else:
        print(describe(graph))


#: Largest relative output error ``verify`` accepts: the interpreter and XNNPACK round
#: float sums in different orders, and dynamic quantization amplifies that on rare ties.
VERIFY_TOLERANCE = 1e-4


def _verify(args: argparse.Namespace) -> None:
    from pathlib import Path

    from .pte import is_pte

    if is_pte(args.file):
        from .pte_run import verify_pte

        errors, text = verify_pte(args.file, args.data, seed=args.seed, isolate=not args.no_isolate,
                                  timeout=args.timeout)
    else:
        from .verify import verify

        try:
            errors, text = verify(Path(args.file).read_bytes(), seed=args.seed, isolate=not args.no_isolate,
                                  timeout=args.timeout)
        finally:
            if args.verbose and not args.no_isolate:
                from .graph.worker import worker

                sys.stderr.write(worker().log_text())
    print(text)
    worst = max(errors, default=0.0)
    print(f"{'OK' if worst <= args.tolerance else 'MISMATCH'}: worst relative error {worst:.3g} "
          f"(tolerance {args.tolerance:g})")
    if worst > args.tolerance:
        raise SystemExit(1)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="xnnquant", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    report = sub.add_parser("report", help="quantize all-MiniLM-L6-v2's linear weights with every scheme; "
                                           "print bytes and SQNR")
    report.add_argument("--group-sizes", type=int, nargs="+", default=[32, 64, 128], metavar="G",
                        help="blockwise int4 group sizes (multiples of 32 dividing 384)")
    report.set_defaults(func=_report)
    inspect = sub.add_parser("inspect", help="print the values and nodes of an XNNGraph payload or of every "
                                             "XNNPACK delegate of a .pte")
    inspect.add_argument("file", help="payload file (with or without XNNHeader, XN00 or XN01) or ExecuTorch .pte")
    inspect.add_argument("--no-validate", action="store_true", help="show payloads the runtime would refuse")
    inspect.add_argument("--json", action="store_true", help="print the same as JSON")
    inspect.set_defaults(func=_inspect)
    verify = sub.add_parser("verify", help="run a payload or a .pte on the real XNNPACK and its payloads on the "
                                           "reference interpreter")
    verify.add_argument("file", help="payload file or ExecuTorch .pte")
    verify.add_argument("--seed", type=int, default=0, help="seed of the random inputs")
    verify.add_argument("--tolerance", type=float, default=VERIFY_TOLERANCE)
    verify.add_argument("--no-isolate", action="store_true",
                        help="run the payload in this process (a runtime crash then ends xnnquant)")
    verify.add_argument("--timeout", type=float, default=None, metavar="SECONDS",
                        help="stop the isolated runtime after this long (default 300)")
    verify.set_defaults(func=_verify)
    for command in (report, inspect, verify):
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
    args = build_parser().parse_args(argv)
    try:
        with _held_back(args.verbose) as held:
            args.func(args)
    except (XnnquantError, OSError) as exc:
        print(f"xnnquant: error: {exc}", file=sys.stderr)
        return 2
    except BaseException:
        sys.stderr.write("".join(held))  # an unexpected failure: show everything
        raise
    return 0
