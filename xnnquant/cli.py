"""Command line.

* ``xnnquant report``: every scheme on all-MiniLM-L6-v2's linears (the main job of ``make run``);
* ``xnnquant inspect PAYLOAD``: the values and nodes of an XNNGraph payload;
* ``xnnquant verify PAYLOAD``: run it on the real XNNPACK and on the reference interpreter.
"""

from __future__ import annotations

import argparse
import sys

from .errors import XnnquantError


def _report(args: argparse.Namespace) -> None:
    from .report import main

    print(main(group_sizes=args.group_sizes))


def _inspect(args: argparse.Namespace) -> None:
    from .graph import load
    from .summary import describe

    print(describe(load(args.payload, validate=not args.no_validate)))


#: Largest relative output error ``verify`` accepts: the interpreter and XNNPACK round
#: float sums in different orders, and dynamic quantization amplifies that on rare ties.
VERIFY_TOLERANCE = 1e-4


def _verify(args: argparse.Namespace) -> None:
    from pathlib import Path

    from .verify import verify

    errors, text = verify(Path(args.payload).read_bytes(), seed=args.seed)
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
    inspect = sub.add_parser("inspect", help="print the values and nodes of an XNNGraph payload")
    inspect.add_argument("payload", help="payload file (with or without XNNHeader, XN00 or XN01)")
    inspect.add_argument("--no-validate", action="store_true", help="show payloads the runtime would refuse")
    inspect.set_defaults(func=_inspect)
    verify = sub.add_parser("verify", help="run a payload on the real XNNPACK and on the reference interpreter")
    verify.add_argument("payload")
    verify.add_argument("--seed", type=int, default=0, help="seed of the random inputs")
    verify.add_argument("--tolerance", type=float, default=VERIFY_TOLERANCE)
    verify.set_defaults(func=_verify)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        args.func(args)
    except (XnnquantError, OSError) as exc:
        print(f"xnnquant: error: {exc}", file=sys.stderr)
        return 2
    return 0
