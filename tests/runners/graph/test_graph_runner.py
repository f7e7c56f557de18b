"""GraphRunner (`stack: graph`): the compiled training step against TorchRunner's, graph breaks,
compile artifacts across processes, exact resume and the config checks.

Compiling is slow on small CPUs: the tests share one tiny MLP (so later runners reuse the graphs
the first compiled) and use the `eager` backend where only dynamo's tracing matters.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

from danling.runners import Events, GraphRunner, Runner, RunnerConfig, TorchRunner
from tests.runners._torch_toy import model_state
from tests.runners.graph._graph_toy import GraphToy, graph_config

_REPO = Path(__file__).resolve().parents[3]


def _epoch_losses(runner) -> list[float]:
    return [row["train"]["loss"] for row in runner.results.values()]


def test_the_graph_stack_builds_a_graph_runner_with_torch_runners_losses(tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="danling")
    with GraphToy(graph_config(tmp_path / "graph")) as graph:
        assert isinstance(graph, GraphRunner)
        graph.train()
        compiled = _epoch_losses(graph), model_state(graph)
        assert graph.compiled_step.breaks == []
    assert "runs eagerly" not in caplog.text  # the optimizer step was compiled too
    with GraphToy(graph_config(tmp_path / "torch", stack="torch")) as eager:
        assert type(eager).__mro__[1:3] == (GraphToy, Runner) and not isinstance(eager, GraphRunner)
        eager.train()
        reference = _epoch_losses(eager), model_state(eager)
    assert len(compiled[0]) == 2
    torch.testing.assert_close(compiled[0], reference[0], rtol=1e-5, atol=1e-6)
    for key, value in reference[1].items():
        torch.testing.assert_close(compiled[1][key], value, rtol=1e-5, atol=1e-6)


class Chatty(nn.Module):
    """A model whose forward prints: dynamo cannot trace the print and breaks the graph there."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 1)

    def forward(self, x):
        print("forward", x.shape)
        return self.linear(x)


class ChattyToy(GraphToy):
    def __init__(self, config):
        super().__init__(config)
        self.model = Chatty()


def test_a_graph_break_is_reported_once_by_reason_and_line(tmp_path, caplog):
    with ChattyToy(graph_config(tmp_path, epochs=1, **{"compile.backend": "eager"})) as runner:
        runner.train()
        breaks = runner.compiled_step.breaks
    assert len(breaks) == 1 and "print" in breaks[0] and f"{__file__}:" in breaks[0], breaks
    warnings = [record for record in caplog.records if "graph break in the compiled training step" in record.message]
    assert len(warnings) == 1 and warnings[0].levelno == logging.WARNING  # 4 steps, one report


def test_with_fullgraph_a_graph_break_is_an_error(tmp_path):
    config = graph_config(tmp_path, epochs=1, **{"compile.backend": "eager", "compile.fullgraph": True})
    with ChattyToy(config) as runner, pytest.raises(RuntimeError, match="compile.fullgraph=True.*breaks the graph"):
        runner.train()


def _launch(root: Path, artifacts: Path, cache: Path) -> dict:
    env = {**os.environ, "PYTHONPATH": str(_REPO), "OMP_NUM_THREADS": "1", "TORCHINDUCTOR_CACHE_DIR": str(cache)}
    command = [sys.executable, "-m", "tests.runners.graph._graph_toy", str(root), str(artifacts)]
    done = subprocess.run(command, cwd=_REPO, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_a_second_launch_loads_the_artifacts_the_first_saved(tmp_path):
    """Each launch gets an empty inductor cache: only the artifacts can carry the kernels over."""
    first = _launch(tmp_path / "run1", tmp_path / "artifacts", tmp_path / "cache1")
    assert first["loaded"] == {} and (tmp_path / "artifacts" / "compile-artifacts.bin").stat().st_size > 0
    assert first["inductor"].get("fxgraph_cache_hit", 0) == 0
    second = _launch(tmp_path / "run2", tmp_path / "artifacts", tmp_path / "cache2")
    assert second["loaded"].get("inductor", 0) >= 2  # forward and backward (and the optimizer step)
    assert second["inductor"].get("fxgraph_cache_miss", 0) == 0
    assert second["inductor"]["fxgraph_cache_hit"] == first["inductor"]["fxgraph_cache_miss"]


@pytest.mark.parametrize("damage", ["corrupt", "other-torch"])
def test_unusable_artifacts_are_a_warning_and_a_normal_compile(tmp_path, caplog, damage):
    artifacts = tmp_path / "artifacts"
    artifacts.mkdir()
    (artifacts / "compile-artifacts.bin").write_bytes(b"not artifacts")
    record = {"torch": torch.__version__, "python": sys.version.split()[0], "sha256": "0" * 64}
    if damage == "other-torch":
        record["torch"] = "1.0.0"
    (artifacts / "compile-artifacts.json").write_text(json.dumps(record))
    config = graph_config(
        tmp_path, epochs=1, **{"compile.backend": "eager", "compile.precompile_artifact_dir": str(artifacts)}
    )
    with GraphToy(config) as runner:
        runner.train()
        assert runner.compile_artifacts.loaded == {} and runner.train_state.global_step == 4
    refusals = [record for record in caplog.records if "not loaded" in record.message]
    assert len(refusals) == 1 and refusals[0].levelno == logging.WARNING
    assert ("SHA-256" if damage == "corrupt" else "1.0.0") in refusals[0].message


def test_a_run_stopped_at_a_step_resumes_to_the_uninterrupted_weights(tmp_path):
    with GraphToy(graph_config(tmp_path / "straight", epochs=3)) as straight:
        straight.train()
        expected = model_state(straight), straight.train_state.state_dict()

    def stop_at_step_6(context):
        if context.runner.train_state.global_step == 6:
            context.runner.supervisor.request_stop()

    config = graph_config(tmp_path / "stopped", epochs=3, log_interval=0)
    with pytest.raises(SystemExit), GraphToy(config) as first:
        first.events.subscribe(Events.STEP_END, stop_at_step_6)
        first.train()
    assert first.train_state.global_step == 6  # mid-epoch 1 (4 steps per epoch)
    with GraphToy({**config, "auto_resume": True}) as resumed:
        assert resumed.train_state.global_step == 6
        resumed.train()
        assert resumed.train_state.state_dict() == expected[1]
        for key, value in expected[0].items():
            assert torch.equal(model_state(resumed)[key], value), key


class OwnStep(GraphToy):
    def train_step(self, data):
        return super().train_step(data)


def test_an_overridden_train_step_runs_eagerly_around_the_compiled_model(tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="danling")
    with OwnStep(graph_config(tmp_path, epochs=1, **{"compile.backend": "eager"})) as runner:
        runner.train()
        assert runner.compiler.enabled and runner.train_state.global_step == 4
    assert "OwnStep overrides train_step, so that step runs eagerly" in caplog.text


def test_memory_policy_accepts_default_only_and_other_runners_refuse_graph_keys(tmp_path):
    with pytest.raises(ValueError, match=r"config.compile.memory_policy='remat' is not supported; expected None or"):
        RunnerConfig(**{"compile.memory_policy": "remat"})
    config = graph_config(tmp_path, epochs=1, **{"compile.memory_policy": "default", "compile.backend": "eager"})
    with GraphToy(config) as runner:
        assert runner.config.compile.memory_policy == "default"
    with pytest.raises(ValueError, match="compile.memory_policy='default' is not available"):
        RunnerConfig.check_runner({**config, "stack": "torch"}, TorchRunner)
