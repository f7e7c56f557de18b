"""`danling report RUN [RUN ...]`: training curves, validation metrics, learning rate and throughput.

Writes `report.html` (self-contained: the plots are embedded as PNG data) and the same plots as
`plots/*.png` into the first run directory (or `--out`). Several runs are drawn on the same axes.

The curves come from the run's `metrics.csv` (written by the CSV tracker, on by default): step
losses, the learning rate and throughput at every log step, and each result row at its global
step. A run without it (older runs, `csv.enabled: false`) falls back to `results.json`, one
point per epoch; learning rate and throughput are then not available. Needs matplotlib:
`pip install danling[report]`.
"""

from __future__ import annotations

import base64
import html
import io
import os
from pathlib import Path
from typing import Any, TextIO

from .records import CLIError, Run, flatten, load_run
from .runs import progress_text, run_summary

__all__ = ["run_series", "write_report", "report_command", "PLOTS"]

Series = dict[str, list[tuple[int, float]]]
PLOTS = ("loss", "validation", "lr", "throughput")
# Columns that describe the run, not the model: never drawn as metrics.
_NOT_METRICS = ("lr", "throughput", "epoch", "memory", "time", "system")


def run_series(run: Run) -> tuple[Series, str]:
    """Every recorded curve of `run` as `{column: [(x, value), ...]}`, and the x-axis label."""
    from danling.runners.services.csv_tracker import read_metrics_csv

    name = str((run.config.get("csv") or {}).get("file_name") or "metrics.csv")
    path = run.path / name
    if path.is_file():
        try:
            return read_metrics_csv(path), "global step"
        except (ValueError, OSError) as err:
            raise CLIError(f"{path} cannot be read: {err}") from None
    series: Series = {}
    for index, row in sorted(run.results.items()):
        for key, value in flatten(row, sep="/").items():
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                series.setdefault(key, []).append((index, float(value)))
    return series, "epoch" if run.current_config.get("epochs") else "step"


def _is_metric(column: str) -> bool:
    """A split's metric per result row (`val/acc`, `train/acc`): not a step log (`train_step/loss`),
    and not a column about the run (learning rate, throughput, memory)."""
    split = column.split("/", 1)[0]
    return "/" in column and split not in _NOT_METRICS and not split.endswith("_step")


def _pick(plot: str, series: Series) -> list[tuple[str, str]]:
    """(column, legend suffix) pairs of `series` drawn in `plot`."""
    columns = list(series)
    if plot == "loss":
        return [(c, c) for c in columns if c.endswith("_step/loss") or (c.startswith("train") and c.endswith("/loss"))]
    if plot == "lr":
        return [(c, c) for c in columns if c == "lr" or c.startswith("lr/")]
    if plot == "throughput":
        wanted = "throughput/samples_per_second"
        if wanted not in series:
            wanted = "throughput/steps_per_second"
        return [(c, c.split("/", 1)[1].replace("_", " ")) for c in columns if c == wanted]
    return [(c, c) for c in columns if _is_metric(c)]


_TITLES = {
    "loss": "Training loss",
    "validation": "Metrics per evaluation (training dashed)",
    "lr": "Learning rate",
    "throughput": "Throughput",
}


def _figure(plot: str, data: list[tuple[Run, Series, str]]) -> Any:
    from danling.utils import optional_import

    figure_module = optional_import("matplotlib.figure", "report")
    optional_import("matplotlib.backends.backend_agg", "report")
    if plot == "validation":
        # One panel per metric name, with every split that has it: validation and training curves
        # side by side (training dashed), one colour per run.
        columns = list(dict.fromkeys(c for _, series, _ in data for c, _ in _pick(plot, series)))
        metrics = list(dict.fromkeys(column.split("/", 1)[1] for column in columns))
        figure = figure_module.Figure(figsize=(6.4, 2.6 * max(len(metrics), 1)), layout="constrained")
        axes = figure.subplots(max(len(metrics), 1), 1, squeeze=False)[:, 0]
        for ax, metric in zip(axes, metrics or [None]):
            for index, (run, series, xlabel) in enumerate(data):
                for column in (c for c in columns if c.split("/", 1)[1] == metric and c in series):
                    xs, ys = zip(*series[column])
                    split = column.split("/", 1)[0]
                    style = "--" if split.startswith("train") else "-"
                    label = f"{_legend(run, xlabel, data)} {split}" if len(data) > 1 else split
                    ax.plot(xs, ys, marker="o", linestyle=style, color=f"C{index}", label=label)
            ax.set_title(metric or _TITLES[plot])
            ax.set_xlabel(data[0][2])
        _finish(axes, metrics, data)
        return figure
    figure = figure_module.Figure(figsize=(6.4, 3.6), layout="constrained")
    ax = figure.subplots()
    drawn = []
    for index, (run, series, xlabel) in enumerate(data):
        for column, suffix in _pick(plot, series):
            xs, ys = zip(*series[column])
            style = {"marker": "o", "linestyle": "--"} if "_step/" not in column and plot == "loss" else {}
            style["color"] = f"C{index}"  # one colour per run; a run's epoch rows are the dashed line
            ax.plot(xs, ys, label=f"{_legend(run, xlabel, data)} {suffix}" if len(data) > 1 else suffix, **style)
            drawn.append(column)
    ax.set_title(_TITLES[plot])
    ax.set_xlabel(data[0][2])
    _finish([ax], drawn, data)
    return figure


def _legend(run: Run, xlabel: str, data: list[tuple[Run, Series, str]]) -> str:
    # A run read from results.json is indexed by epoch, not global step: its legend says so.
    return run.label if xlabel == data[0][2] else f"{run.label} (x: {xlabel})"


def _finish(axes: Any, drawn: list[str], data: list[tuple[Run, Series, str]]) -> None:
    for ax in axes:
        if not drawn:
            ax.text(0.5, 0.5, "not recorded by these runs", ha="center", va="center", transform=ax.transAxes)
        elif ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize="small")
        ax.grid(alpha=0.3)


def _png(figure: Any) -> bytes:
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    buffer = io.BytesIO()
    FigureCanvasAgg(figure).print_png(buffer)
    return buffer.getvalue()


def _table(header: list[str], rows: list[list[Any]]) -> str:
    head = "".join(f"<th>{html.escape(str(cell))}</th>" for cell in header)
    body = "".join("<tr>" + "".join(f"<td>{html.escape(str(cell))}</td>" for cell in row) + "</tr>" for row in rows)
    return f"<table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"


def _summary_rows(runs: list[Run]) -> list[list[Any]]:
    rows = []
    for run in runs:
        summary = run_summary(run)
        progress = summary["progress"]
        best = summary["best"]
        rows.append(
            [
                run.label,
                summary["status"] + (f" ({summary['note']})" if summary["note"] else ""),
                progress_text(progress),
                "-" if best is None else f"{best['name']} = {best['value']:.4g}",
                summary["start_time"] or "-",
                str(run.path),
            ]
        )
    return rows


def _result_rows(runs: list[Run], which: str) -> list[list[Any]]:
    flat = [flatten(run.result_row(which) or {}, sep="/") for run in runs]
    keys = list(dict.fromkeys(key for row in flat for key in row))
    return [[key, *(_fmt(row.get(key)) for row in flat)] for key in keys]


def _fmt(value: Any) -> str:
    if value is None:
        return "-"
    return f"{value:.6g}" if isinstance(value, float) else str(value)


_STYLE = (
    "body{font-family:system-ui,sans-serif;margin:2rem auto;max-width:60rem;color:#222}"
    "table{border-collapse:collapse;margin:1rem 0}td,th{border:1px solid #ccc;padding:.25rem .5rem;text-align:left}"
    "th{background:#f3f3f3}img{max-width:100%;display:block;margin:1rem 0}code{background:#f3f3f3}"
)


def write_report(paths: list[str | os.PathLike], out: str | os.PathLike | None = None) -> Path:
    """Write `report.html` and `plots/<name>.png` for the runs at `paths`; returns the HTML path.

    Raises:
        CLIError: A path is not a run directory, or the report cannot be written into `out`.
        ImportError: matplotlib is missing (install the `report` extra).
    """
    runs = [load_run(path) for path in paths]
    directory = Path(out) if out is not None else runs[0].path
    data = [(run, *run_series(run)) for run in runs]
    images = {plot: _png(_figure(plot, data)) for plot in PLOTS}
    try:
        (directory / "plots").mkdir(parents=True, exist_ok=True)
        for plot, png in images.items():
            (directory / "plots" / f"{plot}.png").write_bytes(png)
    except OSError as error:  # `--out` names a file, or a place this user cannot write
        raise CLIError(f"cannot write the report into {os.fspath(directory)}: {error}") from None
    labels = [run.label for run in runs]
    sections = [
        f"<h1>danling report: {html.escape(', '.join(labels))}</h1>",
        "<h2>Runs</h2>",
        _table(["run", "status", "progress", "best", "started", "directory"], _summary_rows(runs)),
    ]
    for which in ("best", "latest"):
        rows = _result_rows(runs, which)
        if rows:
            sections += [f"<h2>{which.capitalize()} result</h2>", _table(["metric", *labels], rows)]
    for plot in PLOTS:
        encoded = base64.b64encode(images[plot]).decode("ascii")
        sections += [f"<h2>{_TITLES[plot]}</h2>", f'<img alt="{plot}" src="data:image/png;base64,{encoded}">']
    page = (
        f'<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8"><title>danling report</title>'
        f"<style>{_STYLE}</style></head><body>\n" + "\n".join(sections) + "\n</body></html>\n"
    )
    path = directory / "report.html"
    path.write_text(page, encoding="utf-8")
    return path


def report_command(paths: list[str], out: str | None, stream: TextIO) -> int:
    """Write the report and print where it went; returns the exit status."""
    try:
        path = write_report(paths, out)
    except ImportError as err:
        cause = err.__cause__ or err
        raise CLIError(f"danling report needs matplotlib: pip install 'danling[report]' ({cause})") from None
    stream.write(f"wrote {path}\n")
    for plot in PLOTS:
        stream.write(f"wrote {path.parent / 'plots' / f'{plot}.png'}\n")
    return 0
