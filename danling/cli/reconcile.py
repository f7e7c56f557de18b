"""`danling reconcile RUN`: repair a run directory's aliases, result files and leftovers after a crash.

Runs [`reconcile_run`][danling.runners.reconcile.reconcile_run] on the run directory and prints
what it changed. Only for a run that is not writing any more (a live run repairs itself when it
starts again).
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import TextIO

from danling.utils.io import dumps_strict

from .records import CLIError, is_run_dir

__all__ = ["reconcile_command"]


def reconcile_command(run: str, as_json: bool, out: TextIO, *, trusted: bool = False) -> int:
    """Reconcile the run directory `run` and print the report; exit status 0 (`trusted`: `--trust-pickle`)."""
    from danling.checkpoint.unpickling import UnsafePickleError
    from danling.runners.reconcile import reconcile_run
    from danling.runners.services.run_lock import RunDirectoryLockedError

    path = Path(run)
    if not path.is_dir() or not is_run_dir(path):
        raise CLIError(f"{run} is not a run directory (no metadata.json)")
    logger = logging.getLogger("danling.reconcile")
    logger.addHandler(logging.NullHandler())  # the report below says it all
    try:
        report = reconcile_run(path, logger=logger, trusted=trusted)
    except (UnsafePickleError, RunDirectoryLockedError) as err:  # a refused file, or a run still training
        raise CLIError(str(err)) from None
    if as_json:
        out.write(dumps_strict(report, indent=2) + "\n")
        return 0
    lines = [f"run:        {path}", f"checkpoint: {report['checkpoint'] or '-'} (newest that verifies)"]
    for alias in ("latest", "best"):
        change = report[alias]
        lines.append(f"{alias + ':':<11} " + ("ok" if change is None else f"{change[0] or '-'} -> {change[1]}"))
    lines.append(f"rebuilt:    {', '.join(report['rebuilt']) or 'nothing'}")
    lines.append(f"removed:    {', '.join(report['removed']) or 'nothing'}")
    out.write("\n".join(lines) + "\n")
    return 0
