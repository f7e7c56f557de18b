"""`danling diff RUN_A RUN_B`: how two runs' configs differ, and their best and latest results."""

from __future__ import annotations

import json
from typing import Any, TextIO

from danling.utils.io import dumps_strict

from .records import Run, flatten, load_run
from .runs import format_table

__all__ = ["diff_runs", "diff_command"]

_MISSING = "<unset>"


def _show(value: Any) -> str:
    if value is _MISSING:
        return value
    if isinstance(value, float):
        return f"{value:.6g}"
    return json.dumps(value) if not isinstance(value, str) else value


def _cell(value: Any) -> str:
    return "-" if value is None else _show(value)


def diff_runs(a: Run, b: Run) -> dict[str, Any]:
    """Config keys whose values differ (with each run's budget now, after any extension), and the
    flattened best/latest rows of both runs."""
    config_a, config_b = flatten(a.current_config), flatten(b.current_config)
    changed = {
        key: (config_a.get(key, _MISSING), config_b.get(key, _MISSING))
        for key in sorted(config_a.keys() | config_b.keys())
        if config_a.get(key, _MISSING) != config_b.get(key, _MISSING)
    }
    results = {}
    for which in ("best", "latest"):
        row_a, row_b = a.result_row(which) or {}, b.result_row(which) or {}
        flat_a, flat_b = flatten(row_a, sep="/"), flatten(row_b, sep="/")
        keys = list(dict.fromkeys([*flat_a, *flat_b]))
        results[which] = {key: (flat_a.get(key), flat_b.get(key)) for key in keys}
    return {"config": changed, "results": results, "budgets": (a.budget_history(), b.budget_history())}


def diff_command(path_a: str, path_b: str, as_json: bool, out: TextIO) -> int:
    """Print the difference between two run directories; returns the exit status."""
    a, b = load_run(path_a), load_run(path_b)
    diff = diff_runs(a, b)
    if as_json:
        plain = {
            "a": str(a.path),
            "b": str(b.path),
            "config": {k: [None if v is _MISSING else v for v in pair] for k, pair in diff["config"].items()},
            # `null` above is also a key set to None: name the keys a run does not have at all
            "unset": {
                side: [key for key, pair in diff["config"].items() if pair[index] is _MISSING]
                for index, side in enumerate(("a", "b"))
            },
            "results": diff["results"],
            "budgets": list(diff["budgets"]),
        }
        out.write(dumps_strict(plain, indent=2, default=str) + "\n")
        return 0
    out.write(f"A: {a.path}\nB: {b.path}\n\n")
    rows = [[key, _show(va), _show(vb)] for key, (va, vb) in diff["config"].items()]
    out.write("config: identical\n" if not rows else format_table(["config key", "A", "B"], rows) + "\n")
    if any(len(history) > 1 for history in diff["budgets"]):  # a launch extended a budget: say from what
        shown = [" -> ".join(map(str, history)) or "-" for history in diff["budgets"]]
        out.write(f"budget by launch: A {shown[0]}, B {shown[1]}\n")
    for which, pairs in diff["results"].items():
        out.write("\n")
        if not pairs:
            out.write(f"{which}: no {which}.json in either run\n")
            continue
        rows = [
            [key, "-" if va is None else _show(va), "-" if vb is None else _show(vb)] for key, (va, vb) in pairs.items()
        ]
        out.write(format_table([f"{which} result", "A", "B"], rows) + "\n")
    return 0
