"""Command line: ``fusionguard report PATH...`` (also ``python -m fusionguard report``).

Exit status: 0 done; 1 ``--fail-on-dense`` and dense calls were found; 2 bad input (a missing
path, a directory without logs), a bad option, or ``--plot`` without matplotlib.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import List, Optional

PLOT_HINT = "pip install 'fusionguard[plot]'  (or: pip install matplotlib)"


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="fusionguard", description="fusionguard: FlexAttention dense-fallback logs")
    sub = p.add_subparsers(dest="command", metavar="COMMAND")
    r = sub.add_parser(
        "report",
        help="what ran dense, where, why, how much memory, how the run ended",
        description="Read fusionguard JSON-lines logs (files, or directories: every *.jsonl inside, "
        "rotated parts included) and print a per-layer report.",
    )
    r.add_argument("paths", nargs="+", metavar="PATH", help="log file or directory (several: ranks, runs)")
    r.add_argument("--format", choices=("text", "json", "csv"), default="text", help="text (default) for people; json / csv for scripts")
    r.add_argument("--plot", metavar="FILE.png", help="also write per-layer forward/backward peak-memory bars (needs matplotlib)")
    r.add_argument("--last", type=int, default=10, metavar="N", help="events shown before a crash or stop (default 10)")
    r.add_argument("-o", "--output", metavar="FILE", help="write the report here instead of stdout")
    r.add_argument("--fail-on-dense", action="store_true", help="exit status 1 when any dense FlexAttention call is in the logs")
    return p


def _report(args: argparse.Namespace) -> int:
    from . import report

    if args.last < 0:
        sys.stderr.write("fusionguard report: --last must be >= 0\n")
        return 2
    if args.plot:
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            sys.stderr.write(f"fusionguard report: --plot needs matplotlib, which is not installed: {PLOT_HINT}\n")
            return 2
    try:
        rep = report.build(args.paths, last=args.last)
    except report.ReportError as exc:
        sys.stderr.write(f"fusionguard report: {exc}\n")
        return 2
    text = {"text": report.render_text, "json": report.render_json, "csv": report.render_csv}[args.format](rep)
    if args.output:
        with open(args.output, "w", encoding="utf-8", newline="") as fh:
            fh.write(text)
    else:
        try:
            sys.stdout.write(text)
            sys.stdout.flush()
        except BrokenPipeError:  # `fusionguard report ... | head`
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, sys.stdout.fileno())
    if args.plot:
        report.plot(rep, args.plot)
        sys.stderr.write(f"fusionguard report: plot written to {args.plot}\n")
    if args.fail_on_dense and rep["totals"]["dense_calls"]:
        return 1
    return 0


def main(argv: Optional[List[str]] = None) -> int:
    parser = _parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:  # argparse: --help (0) or a usage error (2)
        return int(exc.code or 0)
    if args.command == "report":
        return _report(args)
    parser.print_help(sys.stderr)
    return 2


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
