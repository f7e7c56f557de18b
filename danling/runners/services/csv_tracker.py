"""`metrics.csv`: every logged value of a run as one wide CSV table, one row per step.

The file is the run's plain-text metric history: `danling report` plots it, and pandas,
spreadsheets or `awk` read it without any tracker installed. Columns are `step` followed by the
flattened keys (`train_step/loss`, `val/loss`, `lr`, ...) in the order they first appeared.

How the header grows: a key never seen before adds a column. Rows already on disk are then
rewritten once with the wider header (to a temporary file renamed over the old one), so the file
is always a valid rectangular CSV. New keys appear a handful of times per run (the first step
log, the first evaluation), so the rewrites stay rare; every other row is a plain append.
"""

from __future__ import annotations

import atexit
import csv
import functools
import os
import time
import weakref
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from .trackers import Tracker, flatten_result

__all__ = ["CSVTracker", "read_metrics_csv"]


class CSVTracker(Tracker):
    """Append each logged result to a CSV file, one row per step.

    Results logged at the same step are merged into one row (a step log and the epoch's result
    row usually share the step). A row is written once a later step arrives or on `close`; the
    file is flushed to the OS at most every `flush_seconds` and on `close`, so logging costs a
    buffered write, not a disk round trip.

    An existing file is continued (a resumed run appends to its own history); its header is
    read back first so columns keep their order, and
    [`resume_at`][danling.runners.services.csv_tracker.CSVTracker.resume_at] drops the rows the
    earlier run wrote after the checkpoint it resumes from. A script that never closes its runner still
    gets the last row: the tracker closes itself when the interpreter exits.

    Args:
        path: The CSV file to write (its directory is created on the first write).
        flush_seconds: Longest time written rows may sit in Python's buffer.

    Examples:
        >>> import tempfile, os
        >>> path = os.path.join(tempfile.mkdtemp(), "metrics.csv")
        >>> with CSVTracker(path) as tracker:
        ...     tracker.log({"train": {"loss": 0.5}}, step=1)
        ...     tracker.log({"train": {"loss": 0.25}, "val": {"acc": 0.75}}, step=2)
        >>> print(open(path).read().strip())
        step,train/loss,val/acc
        1,0.5,
        2,0.25,0.75
    """

    def __init__(self, path: str | os.PathLike, flush_seconds: float = 5.0) -> None:
        if not isinstance(flush_seconds, (int, float)) or isinstance(flush_seconds, bool) or flush_seconds < 0:
            raise ValueError(f"flush_seconds must be a non-negative number, got {flush_seconds!r}")
        self.path = Path(path)
        self.flush_seconds = float(flush_seconds)
        self.columns: list[str] = ["step"]
        self._pending: dict[str, Any] | None = None
        self._file: Any = None
        self._writer: Any = None
        self._last_flush = time.monotonic()
        # A weak reference: exiting closes a live tracker, and registering never keeps one alive.
        self._at_exit = functools.partial(_close_at_exit, weakref.ref(self))
        atexit.register(self._at_exit)
        if self.path.is_file() and self.path.stat().st_size:
            with open(self.path, newline="", encoding="utf-8") as file:
                header = next(csv.reader(file), None)
            if header and header[0] == "step":
                self.columns = list(header)

    def log(self, result: Mapping[str, Any], step: int) -> None:
        flat = flatten_result(result)
        pending = self._pending
        if pending is not None and pending["step"] == step and not (flat.keys() & pending.keys()):
            pending.update(flat)
            return
        if pending is not None:
            self._write_row(pending)
        self._pending = {"step": step, **flat}
        if time.monotonic() - self._last_flush >= self.flush_seconds:
            self.flush()

    def resume_at(self, step: int) -> None:
        """Drop the rows after `step` (written by the run before it resumed from that step's checkpoint).

        The resumed run writes those steps again, so the file keeps one row per step in step order.
        """
        pending = self._pending
        if pending is not None and pending["step"] > step:
            self._pending = None
        if self._file is not None:
            self._file.close()
            self._file = self._writer = None
        if not self.path.is_file() or self.path.stat().st_size == 0:
            return
        with open(self.path, newline="", encoding="utf-8") as file:
            rows = list(csv.reader(file))
        kept = [row for row in rows[1:] if row and row[0] and float(row[0]) <= step]
        if len(kept) == len(rows) - 1:
            return
        temporary = self.path.with_name(f".{self.path.name}.{os.getpid()}.tmp")
        with open(temporary, "w", newline="", encoding="utf-8") as file:
            csv.writer(file).writerows([rows[0], *kept])
        os.replace(temporary, self.path)

    def flush(self) -> None:
        """Push written rows to the OS (the row of the newest step stays pending until the next step)."""
        if self._file is not None:
            self._file.flush()
        self._last_flush = time.monotonic()

    def close(self) -> None:
        """Write the pending row and close the file; idempotent."""
        if self._pending is not None:
            self._write_row(self._pending)
            self._pending = None
        if self._file is not None:
            self._file.close()
            self._file = self._writer = None
        atexit.unregister(self._at_exit)

    def _write_row(self, row: Mapping[str, Any]) -> None:
        new = [key for key in row if key not in self.columns]
        if new:
            self._widen(new)
        if self._file is None:
            self._open()
        self._writer.writerow([_cell(row.get(column)) for column in self.columns])

    def _open(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fresh = not self.path.is_file() or self.path.stat().st_size == 0
        self._file = open(self.path, "a", newline="", encoding="utf-8")  # noqa: SIM115 - closed in close()
        self._writer = csv.writer(self._file)
        if fresh:
            self._writer.writerow(self.columns)

    def _widen(self, new: list[str]) -> None:
        """Add columns; rows already on disk are rewritten under the wider header."""
        if self._file is not None:
            self._file.close()
            self._file = self._writer = None
        old_columns = self.columns
        self.columns = old_columns + new
        if not self.path.is_file() or self.path.stat().st_size == 0:
            return
        with open(self.path, newline="", encoding="utf-8") as file:
            rows = list(csv.reader(file))[1:]
        temporary = self.path.with_name(f".{self.path.name}.{os.getpid()}.tmp")
        with open(temporary, "w", newline="", encoding="utf-8") as file:
            writer = csv.writer(file)
            writer.writerow(self.columns)
            padding = [""] * len(new)
            for row in rows:
                writer.writerow(row + [""] * (len(old_columns) - len(row)) + padding)
        os.replace(temporary, self.path)


def _close_at_exit(reference: weakref.ref) -> None:
    tracker = reference()
    if tracker is not None:
        tracker.close()


def _cell(value: Any) -> str:
    if value is None:
        return ""
    if isinstance(value, float) and value.is_integer() and abs(value) < 2**53:
        return str(int(value))
    return repr(value) if isinstance(value, float) else str(value)


def read_metrics_csv(path: str | os.PathLike) -> dict[str, list[tuple[int, float]]]:
    """Read a `metrics.csv` back as `{column: [(step, value), ...]}`, skipping empty cells.

    When a step appears more than once (a run resumed from an earlier checkpoint logs it again),
    the last value wins, so curves never go back in time.

    Examples:
        >>> import tempfile, os
        >>> path = os.path.join(tempfile.mkdtemp(), "metrics.csv")
        >>> _ = open(path, "w").write("step,loss\\n1,0.5\\n2,0.4\\n1,0.45\\n")
        >>> read_metrics_csv(path)
        {'loss': [(1, 0.45), (2, 0.4)]}
    """
    series: dict[str, dict[int, float]] = {}
    with open(path, newline="", encoding="utf-8") as file:
        reader = csv.reader(file)
        header = next(reader, None)
        if not header or header[0] != "step":
            raise ValueError(f"{os.fspath(path)} is not a metrics.csv: its first column is not 'step'")
        for row in reader:
            if not row or not row[0]:
                continue
            step = int(float(row[0]))
            for column, cell in zip(header[1:], row[1:]):
                if cell != "":
                    series.setdefault(column, {})[step] = float(cell)
    return {column: sorted(points.items()) for column, points in series.items()}
