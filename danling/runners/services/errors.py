"""How an error that ends a run reaches the user: one line on stderr, the whole traceback in the run log.

A run that stops on a bad value (a missing split, a refused checkpoint, a full disk, a loss that
diverged) is best told in one line naming what went wrong; a page of traceback through the
runner's internals hides that line. [`report_errors_briefly`][danling.runners.services.errors.report_errors_briefly]
installs a `sys.excepthook` (once per process; every runner calls it as it sets up logging) that,
for an exception that ends the script:

- appends the full traceback to the run's log file (`run.log`, or `rank<N>.log` on other ranks),
  whatever else happens, so nothing is lost;
- prints `<script>: error: <Type>: <message>` as one line on stderr, and where the traceback is;
- prints the usual traceback instead when `DANLING_DEBUG` is set (to anything but `0`/`false`) or
  the command line has `--debug`.

The exit status stays Python's (1). `KeyboardInterrupt` and exceptions that are not `Exception`s
keep Python's own report.
"""

from __future__ import annotations

import os
import sys
import time
import traceback
from pathlib import Path
from types import TracebackType

__all__ = ["DEBUG_ENV", "report_errors_briefly"]

DEBUG_ENV = "DANLING_DEBUG"
"""Environment variable that brings the full traceback back to stderr."""

_state: dict = {"log": None, "previous": None}


def report_errors_briefly(log_file: str | os.PathLike | None) -> None:
    """Report an exception that ends the script in one line, its traceback appended to `log_file`.

    Installs the hook once (a later runner only changes the log file); `None` keeps no traceback.
    """
    _state["log"] = Path(log_file) if log_file is not None else None
    if sys.excepthook is not _brief:
        _state["previous"] = sys.excepthook
        sys.excepthook = _brief


def _debugging() -> bool:
    flag = os.environ.get(DEBUG_ENV, "").strip().lower()
    return flag not in ("", "0", "false", "no", "off") or "--debug" in sys.argv[1:]


def _keep(kind: type[BaseException], error: BaseException, trace: TracebackType | None) -> Path | None:
    """Append the traceback to the run log; the log's path, or `None` when there is none or it cannot be written."""
    log = _state["log"]
    if log is None:
        return None
    stamp = time.strftime("%Y-%m-%d %H:%M:%S")
    text = "".join(traceback.format_exception(kind, error, trace))
    try:
        log.parent.mkdir(parents=True, exist_ok=True)
        with open(log, "a", encoding="utf-8") as handle:
            handle.write(f"{stamp} | ERROR   | the run ended with an exception:\n{text}")
    except OSError:
        return None
    return log


def _brief(kind: type[BaseException], error: BaseException, trace: TracebackType | None) -> None:
    previous = _state["previous"] or sys.__excepthook__
    log = _keep(kind, error, trace)
    if not issubclass(kind, Exception) or _debugging():
        previous(kind, error, trace)
        return
    message = " ".join(line.strip() for line in str(error).splitlines() if line.strip())
    where = f"traceback in {log}" if log is not None else "no run log kept the traceback"
    program = os.path.basename(sys.argv[0]) if sys.argv and sys.argv[0] else "python"
    sys.stderr.write(f"{program}: error: {kind.__name__}: {message} ({where}; {DEBUG_ENV}=1 prints it here)\n")
    sys.stderr.flush()
