"""`profiling.*`: a bounded torch.profiler window over training steps, with trace files read back."""

from __future__ import annotations

import json
import re

import pytest

from danling.runners.services.profiling import StepProfiler
from tests.runners._torch_toy import TinyRunner, tiny_config


def test_profiler_traces_the_configured_window_of_training_steps(tmp_path):
    profiling = {"profiling.enabled": True, "profiling.wait": 1, "profiling.warmup": 1, "profiling.active": 2}
    profiling["profiling.repeat"] = 2
    with TinyRunner(tiny_config(tmp_path, epochs=3, **profiling)) as runner:  # 5 steps per epoch, 15 in all
        runner.train()
        traces = runner._profiler.traces
        trace_dir = tmp_path.joinpath(*runner._profiler.trace_dir.relative_to(tmp_path).parts)
        assert runner._profiler.steps == 8 and runner._profiler._profiler is None  # stopped after 2 cycles
    assert [path.name for path in traces] == ["rank0-cycle0.pt.trace.json", "rank0-cycle1.pt.trace.json"]
    assert trace_dir == traces[0].parent and trace_dir.name == "profiles" and trace_dir.parent == runner.workspace.dir
    for path, expected in zip(traces, ([2, 3], [6, 7])):  # torch numbers steps from 0: steps 3-4 and 7-8
        events = json.loads(path.read_text())["traceEvents"]
        names = [event.get("name", "") for event in events]
        steps = sorted({int(m.group(1)) for name in names if (m := re.fullmatch(r"ProfilerStep#(\d+)", name))})
        assert steps == expected  # the active steps of the cycle, and only those
        assert any(e.get("name", "").startswith("aten::addmm") for e in events)  # the model's work is in it


def test_profiler_is_off_by_default_and_checks_its_window(tmp_path):
    with TinyRunner(tiny_config(tmp_path, epochs=1)) as runner:
        runner.train()
        assert runner._profiler is None
    assert not (runner.workspace.dir / "profiles").exists()
    with pytest.raises(ValueError, match=r"profiling.active must be an integer >= 1, got 0"):
        StepProfiler(tmp_path, active=0)


def test_run_summary_is_logged_once_when_training_starts(tmp_path):
    import logging

    records = []
    handler = logging.Handler()
    handler.emit = records.append
    with TinyRunner(tiny_config(tmp_path, epochs=1, precision="bf16", accum_steps=2)) as runner:
        runner.logger.addHandler(handler)
        summary = runner._run_summary()
        runner.train()
        runner.epochs = 2
        runner.train()  # continues: no second summary
    blocks = [record.getMessage() for record in records if record.getMessage().startswith("run summary")]
    assert len(blocks) == 1
    assert summary["parameters"] == summary["trainable"] == 4 * 8 + 8 + 8 + 1
    assert summary["precision"] == "bf16" and summary["optimizer_steps"] == 3 and summary["world_size"] == 1
    for expected in (
        "Sequential: 49 parameters (49 trainable), 196 B",
        "bf16 on cpu",
        "1 epochs (3 optimizer steps, 2 micro",
        str(runner.workspace.dir),
    ):
        assert expected in blocks[0]
