"""The `danling` command: list runs, compare two, look inside a checkpoint, write a report.

```
danling runs [ROOT] [--json]          # table of the runs under a workspace root
danling diff RUN_A RUN_B [--json]     # config differences, best and latest results side by side
danling ckpt PATH [--json]            # what a checkpoint holds, with its manifest verified
danling report RUN [RUN ...] [--out]  # report.html and PNG plots, several runs overlaid
danling reconcile RUN [--json] [--trust-pickle]  # repair aliases, result files and leftovers after a crash
danling replay BUNDLE [--json] [--workdir DIR]    # re-run a failing update, name its first non-finite value
```

Also available as `python -m danling`. [`main`][danling.cli.main] takes the argument list and
returns the exit status: 0 on success, 1 when a checkpoint fails verification, 2 for a usage
error or a path that is not a run or a checkpoint (one line on stderr, no traceback).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from typing import TextIO

from .records import CLIError

__all__ = ["main", "build_parser", "CLIError"]


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of the `danling` command."""
    parser = argparse.ArgumentParser(prog="danling", description="Look at danling runs and checkpoints.")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    runs = commands.add_parser("runs", help="list the runs under a workspace root")
    runs.add_argument("root", nargs="?", default="experiments", help="workspace root (default: experiments)")
    runs.add_argument("--json", action="store_true", help="print JSON instead of a table")
    diff = commands.add_parser("diff", help="compare the configs and results of two runs")
    diff.add_argument("run_a", help="first run directory")
    diff.add_argument("run_b", help="second run directory")
    diff.add_argument("--json", action="store_true", help="print JSON instead of tables")
    ckpt = commands.add_parser("ckpt", help="describe a checkpoint and verify it against its manifest")
    ckpt.add_argument("path", help="checkpoint directory or file, *.pointer alias, checkpoints directory or run")
    ckpt.add_argument("--json", action="store_true", help="print JSON instead of a table")
    report = commands.add_parser("report", help="write report.html and PNG plots for one or more runs")
    report.add_argument("runs", nargs="+", help="run directories; several are overlaid")
    report.add_argument("--out", default=None, help="output directory (default: the first run directory)")
    reconcile = commands.add_parser("reconcile", help="repair a run's aliases, result files and leftovers")
    reconcile.add_argument("run", help="run directory (not one that is still writing)")
    reconcile.add_argument("--json", action="store_true", help="print JSON instead of text")
    reconcile.add_argument(
        "--trust-pickle", action="store_true", help="read the checkpoints with the full unpickler (files you trust)"
    )
    replay = commands.add_parser("replay", help="re-run a bundled update and name its first non-finite value")
    replay.add_argument("bundle", help="bundle directory (<run dir>/replay/step-...)")
    replay.add_argument("--json", action="store_true", help="print JSON instead of text")
    replay.add_argument("--workdir", default=None, help="workspace root of the rebuilt runner (default: a temp dir)")
    return parser


def _dispatch(args: argparse.Namespace, out: TextIO) -> int:
    if args.command == "runs":
        from .runs import runs_command

        return runs_command(args.root, args.json, out)
    if args.command == "diff":
        from .diff import diff_command

        return diff_command(args.run_a, args.run_b, args.json, out)
    if args.command == "ckpt":
        from .ckpt import ckpt_command

        return ckpt_command(args.path, args.json, out)
    if args.command == "reconcile":
        from .reconcile import reconcile_command

        return reconcile_command(args.run, args.json, out, trusted=args.trust_pickle)
    if args.command == "replay":
        from .replay import replay_command

        return replay_command(args.bundle, args.json, out, args.workdir)
    from .report import report_command

    return report_command(args.runs, args.out, out)


def main(argv: Sequence[str] | None = None, out: TextIO | None = None, err: TextIO | None = None) -> int:
    """Run the `danling` command with `argv` (default `sys.argv[1:]`) and return the exit status.

    Examples:
        >>> import io, tempfile
        >>> err = io.StringIO()
        >>> main(["diff", tempfile.mkdtemp(), "nowhere"], err=err)
        2
        >>> err.getvalue().startswith("danling: error: ")
        True
    """
    out = sys.stdout if out is None else out
    err = sys.stderr if err is None else err
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exit:  # argparse has printed its usage message
        return int(exit.code or 0)
    try:
        return _dispatch(args, out)
    except CLIError as error:
        message = " ".join(str(error).split())  # one line, whatever the message holds
        err.write(f"danling: error: {message}\n")
        return 2
    except BrokenPipeError:  # `danling runs | head`
        return 0
