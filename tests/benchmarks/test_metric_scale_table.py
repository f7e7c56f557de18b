"""`bench_metric_scale.table`: the figures a run prints, with and without its A/A control."""

from __future__ import annotations

import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "benchmarks"))

from bench_metric_scale import table  # noqa: E402

ROW = {
    "task": "binary",
    "metrics": "acc+auroc",
    "n": 100_000,
    "scores_bytes": 400_000,
    "danling_update_s": 0.002,
    "danling_compute_s": 0.003,
    "danling_peak_bytes": 1_000_000,
    "torchmetrics_update_s": 0.005,
    "torchmetrics_compute_s": 0.010,
    "torchmetrics_peak_bytes": 8_000_000,
}


def cells(line: str) -> list[str]:
    return [cell.strip() for cell in line.strip("|").split("|")]


def test_a_run_with_its_control_gives_torchmetrics_second_median_over_its_first():
    row = {**ROW, "control_update_s": 0.005, "control_compute_s": 0.012, "control_peak_bytes": 7_200_000}
    header, _, line = table([row]).splitlines()
    assert cells(header)[-2:] == ["A/A peak", "A/A compute"]
    values = dict(zip(cells(header), cells(line)))
    assert values["A/A peak"] == "0.90"  # 7.2 MB over 8 MB
    assert values["A/A compute"] == "1.20"  # 12 ms over 10 ms
    assert values["compute ratio"] == "0.30x"  # the row's own ratio is unchanged by the control


def test_a_run_without_the_control_has_no_control_columns():
    header, rule, line = table([ROW]).splitlines()
    assert "A/A" not in header
    assert len(cells(header)) == len(cells(rule)) == len(cells(line)) == 8
