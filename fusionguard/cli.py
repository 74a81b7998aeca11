"""Command line: ``fusionguard report PATH...``, ``fusionguard doctor`` and ``fusionguard run -- CMD``
(also ``python -m fusionguard``).

Exit status, the same contract for every command (``docs/cli.md``):

- ``report``: 0 the report was written (also when it lists dense calls: only a gate flag fails);
  1 a gate flag failed (``--fail-on-dense``: a dense call that was not allowed;
  ``--fail-on-recompile-pressure``: a frame holding FlexAttention near the recompile limit;
  ``--expect-fused`` / ``--expect-calls N``: fewer fused calls than expected); 2 usage or input
  error (a bad option, a missing path, no fusionguard event in the input, an unwritable
  ``-o`` / ``--plot`` / ``--html`` path, an empty one, one that is an input or a crash file a log
  names, two naming one file (nothing is written then), a ``--plot`` format matplotlib cannot write, ``--plot`` without matplotlib).
- ``doctor``: 0 every compiled case ran fused; 1 something ran dense or an experiment failed;
  2 usage error (a bad ``--shape``, ``--device``, ``--backend``).
- ``run``: the command's own status (it is exec-ed); 2 usage error before anything starts (no
  command, ``FUSIONGUARD`` set to a value that is not a mode); 126 / 127 the command cannot be
  run / is not found.
"""

from __future__ import annotations

import argparse
import os
import stat
import sys
from typing import Any, Dict, List, Optional

from fusionguard._version import __version__

PLOT_HINT = "pip install 'fusionguard[plot]'  (or: pip install matplotlib)"


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="fusionguard", description="fusionguard: FlexAttention dense-fallback logs")
    p.add_argument("--version", action="version", version=f"fusionguard {__version__}")
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
    r.add_argument(
        "--html",
        metavar="FILE.html",
        help="also write the report as one self-contained HTML page (verdict, layers, memory chart, ranks, timeline, versions)",
    )
    r.add_argument("--last", type=int, default=10, metavar="N", help="events shown before a crash or stop (default 10)")
    r.add_argument("-o", "--output", metavar="FILE", help="write the report here instead of stdout")
    r.add_argument(
        "--fail-on-dense",
        action="store_true",
        help="exit status 1 when the logs hold a dense FlexAttention call that was not allowed (allow_dense() calls never fail it)",
    )
    r.add_argument(
        "--fail-on-recompile-pressure",
        action="store_true",
        help="exit status 1 when the logs hold a recompile_pressure event: a frame holding FlexAttention that Dynamo "
        "recompiled up to half its recompile limit (--fail-on-dense does not fail on it)",
    )
    r.add_argument(
        "--expect-fused",
        action="store_true",
        help="exit status 1 unless the logs hold at least one fused FlexAttention call (a gate never passes on silence)",
    )
    r.add_argument("--expect-calls", type=int, metavar="N", help="exit status 1 when the logs hold fewer than N fused FlexAttention calls")
    d = sub.add_parser(
        "doctor",
        help="check that this machine's torch.compile fuses FlexAttention forward and backward",
        description="Run eager vs torch.compile(flex_attention), without and with a causal BlockMask, "
        "with GQA, forward and backward (CPU: inference only); print what fusionguard logged and the "
        "peak memory of each, then FUSED - OK (exit 0) or what failed (exit 1).",
    )
    d.add_argument(
        "--shape",
        metavar="B,HQ,HKV,Q,KV,D",
        help="default: the reference shape 1,32,8,2048,10240,128 on a GPU with room, smaller otherwise",
    )
    d.add_argument("--device", help="cuda, cuda:1, cpu (default: cuda if available)")
    d.add_argument(
        "--backend",
        default="inductor",
        help="torch.compile backend for the compiled cases (default inductor; aot_eager shows a failing stack)",
    )
    u = sub.add_parser(
        "run",
        help="run a command with fusionguard enabled in every Python process it starts",
        description="Run CMD with FUSIONGUARD set and fusionguard's start-up hook first on PYTHONPATH: "
        "every Python process of the command (torchrun workers, spawn/forkserver children) enables "
        "fusionguard when it imports torch. Example: fusionguard run --strict -- torchrun --nproc-per-node 8 train.py",
    )
    mode = u.add_mutually_exclusive_group()
    mode.add_argument("--strict", dest="mode", action="store_const", const="strict", help="raise before a dense call (FUSIONGUARD=strict)")
    mode.add_argument(
        "--warn", dest="mode", action="store_const", const="warn", help="warn and log (the default, unless FUSIONGUARD is set)"
    )
    mode.add_argument(
        "--oom",
        dest="mode",
        action="store_const",
        const="oom",
        help="let dense calls run, except one predicted not to fit on its GPU (FUSIONGUARD=oom)",
    )
    u.add_argument("--log", metavar="PATH", help="FUSIONGUARD_LOG: a file, or a directory (end it with /) for one file per process")
    u.add_argument("cmd", nargs=argparse.REMAINDER, metavar="-- CMD ...", help="the command and its arguments")
    return p


def _fail(command: str, message: str) -> int:
    sys.stderr.write(f"fusionguard {command}: {message}\n")
    return 2


def _run(args: argparse.Namespace) -> int:
    from fusionguard import activate  # lazy: each subcommand loads only what it runs

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
            return _fail("doctor", "--shape takes six positive integers B,HQ,HKV,Q,KV,D")
        if shape[1] % shape[2]:
            return _fail("doctor", "HQ must be a multiple of HKV (GQA)")
    from fusionguard import doctor  # lazy: each subcommand loads only what it runs

    problem = doctor.check_options(args.device, args.backend)
    if problem:
        return _fail("doctor", problem)
    return doctor.main(shape=shape, device=args.device, backend=args.backend)


def _write_stdout(text: str) -> None:
    """Print, also on a terminal whose encoding lacks ``Δ`` / ``×`` (escaped, never a traceback)."""
    try:
        sys.stdout.write(text)
    except UnicodeEncodeError:
        enc = getattr(sys.stdout, "encoding", None) or "ascii"
        sys.stdout.flush()
        sys.stdout.buffer.write(text.encode(enc, "backslashreplace"))
    sys.stdout.flush()


def _gates(args: argparse.Namespace, totals: Dict[str, Any]) -> List[str]:
    """Why the gate flags fail (empty: they pass)."""
    failed = []
    dense = totals["dense_calls"]
    if args.fail_on_dense and dense:
        allowed = f" ({totals['allowed_dense_calls']:,} allowed ones not counted)" if totals["allowed_dense_calls"] else ""
        failed.append(f"--fail-on-dense: {dense:,} dense FlexAttention call{'s' if dense != 1 else ''}{allowed}")
    frames = totals.get("recompile_pressure_frames") or 0
    if args.fail_on_recompile_pressure and frames:
        at_least = "at least " if totals.get("recompile_pressure_frames_at_least") else ""
        failed.append(
            f"--fail-on-recompile-pressure: {at_least}{frames:,} frame{'s' if frames != 1 else ''} "
            "holding FlexAttention near Dynamo's recompile limit"
        )
    expected = max(1 if args.expect_fused else 0, args.expect_calls or 0)
    if expected and totals["fused_calls"] < expected:
        flag = f"--expect-calls {args.expect_calls}" if args.expect_calls else "--expect-fused"
        failed.append(f"{flag}: {totals['fused_calls']:,} fused FlexAttention call(s) in the logs, expected at least {expected:,}")
    return failed


def _input_mode(rep: Dict[str, Any]) -> int:
    """The most restrictive permission bits of the logs read (0o600 when none can be read): a
    report holds what its logs hold, so it is no more readable than the most private of them."""
    mode = 0o777
    for f in rep.get("files") or ():
        try:
            mode &= stat.S_IMODE(os.stat(f["path"]).st_mode)
        except OSError:
            return 0o600
    return mode & 0o666 if rep.get("files") else 0o600


def _open_output(path: str, mode: int, newline: str) -> Any:
    """``path`` opened for writing text with ``mode`` (also when it exists already: its old mode
    may be wider than the logs')."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | getattr(os, "O_CLOEXEC", 0), mode)
    try:
        os.fchmod(fd, mode & ~_umask())
    except (OSError, AttributeError):  # not our file, or no fchmod (Windows): its mode stays
        pass
    return os.fdopen(fd, "w", encoding="utf-8", newline=newline)


def _umask() -> int:
    old = os.umask(0o077)
    os.umask(old)
    return old


def _write_html(rep: Dict[str, Any], path: str, mode: int) -> Optional[str]:
    """Write ``--html``; the problem when it cannot be written (None: written)."""
    from fusionguard.report.html import render_html  # lazy: each subcommand loads only what it runs

    page = render_html(rep)
    try:
        with _open_output(path, mode, "\n") as fh:
            fh.write(page)
    except OSError as exc:
        return f"cannot write --html {path}: {exc.strerror or exc}"
    sys.stderr.write(f"fusionguard report: HTML report written to {path}\n")
    return None


def _clobbers(args: argparse.Namespace) -> Optional[str]:
    """Why an output would destroy an input (None: it would not); nothing is written then."""
    from fusionguard.report.plot import PLOT_NAME  # lazy: each subcommand loads only what it runs
    from fusionguard.report.read import input_named  # lazy: each subcommand loads only what it runs

    outputs = [("-o", args.output), ("--html", args.html)]
    if args.plot:  # the file plot() writes: into a directory, or with .png added (plot_target)
        target = args.plot
        if target.endswith(("/", os.sep)) or os.path.isdir(target):
            target = os.path.join(target, PLOT_NAME)
        elif not os.path.splitext(target)[1]:
            target += ".png"
        outputs += [("--plot", args.plot), ("--plot", target)]
    for flag, out in outputs:
        if out:
            hit = input_named(out, args.paths)
            if hit is not None:
                return f"{flag} {out} is an input ({hit}): writing it would destroy the log; nothing written"
    written = [(flag, out) for flag, out in outputs[:2] + outputs[3:] if out]  # (--plot: the file it writes)
    for i, (flag, out) in enumerate(written):
        for other_flag, other in written[i + 1 :]:
            if _same_file(out, other):
                return f"{flag} {out} and {other_flag} {other} name the same file: one would replace the other; nothing written"
    return None


def _same_file(a: str, b: str) -> bool:
    """Two output paths that name one regular file (by any name), or one path that does not exist
    yet; a terminal, a pipe or ``/dev/null`` named twice is not a file one write replaces."""
    try:
        sa, sb = os.stat(a), os.stat(b)
    except OSError:
        return os.path.realpath(a) == os.path.realpath(b)
    return stat.S_ISREG(sa.st_mode) and (sa.st_dev, sa.st_ino) == (sb.st_dev, sb.st_ino)


def _crash_file_written(args: argparse.Namespace) -> Optional[str]:
    """Why an output would replace a native crash file the report read (None: none would): the
    only record of a segfault, named by a log's header, not by ``PATH``."""
    from fusionguard.report.crashfile import CRASH_FILES_READ  # lazy: each subcommand loads only what it runs

    for flag, out in (("-o", args.output), ("--html", args.html), ("--plot", args.plot_file)):
        for crash in CRASH_FILES_READ if out else ():
            if _same_file(out, crash):
                return f"{flag} {out} is an input (a crash file the logs name): writing it would destroy it; nothing written"
    return None


def _report(args: argparse.Namespace) -> int:
    from fusionguard.report.build import build as build_report_dict  # lazy: each subcommand loads only what it runs
    from fusionguard.report.plot import plot, plot_target  # lazy: each subcommand loads only what it runs
    from fusionguard.report.read import ReportError  # lazy: each subcommand loads only what it runs
    from fusionguard.report.render import render_csv, render_json, render_text  # lazy: each subcommand loads only what it runs

    if args.last < 0:
        return _fail("report", "--last must be >= 0")
    if args.expect_calls is not None and args.expect_calls < 0:
        return _fail("report", "--expect-calls must be >= 0")
    if args.html == "" or args.output == "" or args.plot == "":
        return _fail("report", "an empty output path (-o, --html, --plot): name a file")
    problem = _clobbers(args)
    if problem:
        return _fail("report", problem)
    plot_file = None
    if args.plot:
        try:
            import matplotlib  # noqa: F401  (lazy: each subcommand loads only what it runs)
        except ImportError:
            return _fail("report", f"--plot needs matplotlib, which is not installed: {PLOT_HINT}")
        try:
            plot_file = plot_target(args.plot)[0]
        except ValueError as exc:
            return _fail("report", f"--plot {args.plot}: {exc}")
    from fusionguard.report.crashfile import CRASH_FILES_READ  # lazy: each subcommand loads only what it runs

    CRASH_FILES_READ.clear()  # (the crash files this report reads: never written over)
    try:
        rep = build_report_dict(args.paths, last=args.last)
    except ReportError as exc:
        return _fail("report", str(exc))
    args.plot_file = plot_file
    problem = _crash_file_written(args)
    if problem:
        return _fail("report", problem)
    text = {"text": render_text, "json": render_json, "csv": render_csv}[args.format](rep)
    mode = _input_mode(rep)
    if args.output:
        try:
            with _open_output(args.output, mode, "") as fh:
                fh.write(text)
        except OSError as exc:
            return _fail("report", f"cannot write -o {args.output}: {exc.strerror or exc}")
    else:
        try:
            _write_stdout(text)
        except BrokenPipeError:  # `fusionguard report ... | head`
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, sys.stdout.fileno())
    if args.html:
        problem = _write_html(rep, args.html, mode)
        if problem:
            return _fail("report", problem)
    if plot_file is not None:
        try:
            _open_output(plot_file, mode, "").close()  # created with the logs' mode before matplotlib writes it
            note = plot(rep, plot_file)
        except OSError as exc:
            return _fail("report", f"cannot write --plot {plot_file}: {exc.strerror or exc}")
        except Exception as exc:  # e.g. .pgf without LaTeX: one line, never a traceback
            return _fail("report", f"cannot draw --plot {plot_file}: {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}")
        sys.stderr.write(f"fusionguard report: plot written to {plot_file}{note}\n")
    failed = _gates(args, rep["totals"])
    for f in failed:
        sys.stderr.write(f"fusionguard report: gate failed: {f}\n")
    return 1 if failed else 0


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
