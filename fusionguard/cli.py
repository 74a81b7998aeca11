"""Command line: ``fusionguard report PATH...``, ``fusionguard doctor`` and ``fusionguard run -- CMD``
(also ``python -m fusionguard``).

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
    d = sub.add_parser(
        "doctor",
        help="check that this machine's torch.compile fuses FlexAttention forward and backward",
        description="Run eager vs torch.compile(flex_attention), without and with a causal BlockMask, "
        "with GQA, forward and backward (CPU: inference only); print what fusionguard logged and the "
        "peak memory of each, then FUSED - OK (exit 0) or what failed (exit 1).",
    )
    d.add_argument("--shape", metavar="B,HQ,HKV,Q,KV,D", help="default: the seed shape 1,32,8,2048,10240,128 on a GPU with room, smaller otherwise")
    d.add_argument("--device", help="cuda, cuda:1, cpu (default: cuda if available)")
    d.add_argument("--backend", default="inductor", help="torch.compile backend for the compiled cases (default inductor; aot_eager shows a failing stack)")
    u = sub.add_parser(
        "run",
        help="run a command with fusionguard enabled in every Python process it starts",
        description="Run CMD with FUSIONGUARD set and fusionguard's start-up hook first on PYTHONPATH: "
        "every Python process of the command (torchrun workers, spawn/forkserver children) enables "
        "fusionguard when it imports torch. Example: fusionguard run --strict -- torchrun --nproc-per-node 8 train.py",
    )
    mode = u.add_mutually_exclusive_group()
    mode.add_argument("--strict", dest="mode", action="store_const", const="strict", help="raise before a dense call (FUSIONGUARD=strict)")
    mode.add_argument("--warn", dest="mode", action="store_const", const="warn", help="warn and log (the default, unless FUSIONGUARD is set)")
    u.add_argument("--log", metavar="PATH", help="FUSIONGUARD_LOG: a file, or a directory (end it with /) for one file per process")
    u.add_argument("cmd", nargs=argparse.REMAINDER, metavar="-- CMD ...", help="the command and its arguments")
    return p


def _run(args: argparse.Namespace) -> int:
    from . import activate

    cmd = list(args.cmd)
    if cmd and cmd[0] == "--":
        cmd = cmd[1:]
    return activate.run(cmd, mode=args.mode, log=args.log)


def _doctor(args: argparse.Namespace) -> int:
    shape = None
    if args.shape:
        try:
            shape = tuple(int(x) for x in args.shape.split(","))
            if len(shape) != 6 or min(shape) < 1:
                raise ValueError
        except ValueError:
            sys.stderr.write("fusionguard doctor: --shape takes six positive integers B,HQ,HKV,Q,KV,D\n")
            return 2
        if shape[1] % shape[2]:
            sys.stderr.write("fusionguard doctor: HQ must be a multiple of HKV (GQA)\n")
            return 2
    from . import doctor

    return doctor.main(shape=shape, device=args.device, backend=args.backend)


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
    if args.command == "doctor":
        return _doctor(args)
    if args.command == "run":
        return _run(args)
    parser.print_help(sys.stderr)
    return 2


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
