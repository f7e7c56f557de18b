"""`danling runs [ROOT]`: one line per run under a workspace root."""

from __future__ import annotations

import time
from datetime import datetime
from typing import Any, TextIO

from danling.utils.io import dumps_strict

from .records import Run, _duration, find_runs

__all__ = ["run_summary", "runs_command", "format_table", "progress_text"]

COLUMNS = ("experiment", "run", "status", "progress", "best", "started", "duration", "heartbeat")


def run_summary(run: Run, now: float | None = None) -> dict[str, Any]:
    """A JSON-friendly summary of one run (what `danling runs --json` prints per run)."""
    now = time.time() if now is None else now
    status = run.status(now)
    progress = run.progress()
    start = run.start_time()
    end = status["end_time"] if status["end_time"] is not None else now
    score = run.score()
    return {
        "experiment": run.experiment,
        "lineage": run.metadata.get("lineage"),
        "id": run.id,
        "path": str(run.path),
        "status": status["status"],
        "note": status["note"],
        "heartbeat_age": status["heartbeat_age"],
        "progress": progress,
        "best": None if score is None else {"name": score[0], "value": score[1]},
        "start_time": None if start is None else run.metadata["start_time"],  # only a time that reads
        "duration": None if start is None else max(end - start, 0.0),
    }


def progress_text(progress: dict[str, Any]) -> str:
    """`12/20 epochs`, with the budget's history when a launch changed it: `12/20 epochs (budget 15 -> 20)`."""
    done = "?" if progress["done"] is None else progress["done"]
    total = "?" if progress["total"] is None else progress["total"]
    history = progress.get("history") or []
    changed = f" (budget {' -> '.join(map(str, history))})" if len(history) > 1 else ""
    return f"{done}/{total} {progress['unit']}{changed}"


def _cells(summary: dict[str, Any]) -> list[str]:
    best = summary["best"]
    start = summary["start_time"]
    started = datetime.fromisoformat(start).astimezone().strftime("%Y-%m-%d %H:%M") if start else "-"
    age = summary["heartbeat_age"]
    status = summary["status"] + (f" ({summary['note']})" if summary["note"] else "")
    return [
        summary["experiment"],
        summary["id"],
        status,
        progress_text(summary["progress"]),
        "-" if best is None else f"{best['name']}={best['value']:.4g}",
        started,
        "-" if summary["duration"] is None else _duration(summary["duration"]),
        "-" if age is None else f"{_duration(age)} ago",
    ]


def format_table(header: list[str], rows: list[list[str]]) -> str:
    """Left-aligned plain-text table with a header rule."""
    widths = [max(len(str(row[i])) for row in [header, *rows]) for i in range(len(header))]
    lines = ["  ".join(str(cell).ljust(width) for cell, width in zip(row, widths)).rstrip() for row in [header, *rows]]
    lines.insert(1, "  ".join("-" * width for width in widths))
    return "\n".join(lines)


def runs_command(root: str, as_json: bool, out: TextIO) -> int:
    """Print the runs under `root` as a table (or JSON); returns the exit status."""
    now = time.time()
    summaries = [run_summary(run, now) for run in find_runs(root)]
    if as_json:
        out.write(dumps_strict(summaries, indent=2) + "\n")
        return 0
    if not summaries:
        out.write(f"no runs under {root}\n")
        return 0
    out.write(format_table(list(COLUMNS), [_cells(summary) for summary in summaries]) + "\n")
    return 0
