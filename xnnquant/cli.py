"""Command line: ``xnnquant report`` (the main job of ``make run``)."""

from __future__ import annotations

import argparse
import sys

from .errors import XnnquantError


def _report(args: argparse.Namespace) -> None:
    from .report import main

    print(main(group_sizes=args.group_sizes))


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="xnnquant", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    report = sub.add_parser("report", help="quantize all-MiniLM-L6-v2's linear weights with every scheme; print bytes and SQNR")
    report.add_argument("--group-sizes", type=int, nargs="+", default=[32, 64, 128], metavar="G",
                        help="blockwise int4 group sizes (multiples of 32 dividing 384)")
    report.set_defaults(func=_report)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        args.func(args)
    except XnnquantError as exc:
        print(f"xnnquant: error: {exc}", file=sys.stderr)
        return 2
    return 0
