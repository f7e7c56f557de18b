"""The model a runner's subclass builds without manual seeding is the same on every rank and in every layout."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

from danling.runners import Runner
from tests.dist import run_distributed
from tests.runners._parallel_toy import TENSOR_PLAN, ResidualMLP, full_weights, parallel_config
from tests.runners._torch_toy import make_data

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(600)]

LAYOUTS = {
    "ddp": {"parallel.axes.replicate": 2},
    "fsdp": {"parallel.axes.shard": 2, "fsdp.enabled": True},
    "tensor": {"parallel.axes.tensor": 2, "parallel.tensor_plan": TENSOR_PLAN},
    "pipeline": {
        "parallel.axes.pipeline": 2,
        "parallel.module_fqns_per_model_part": [["inp", "layers.0"], ["layers.1", "head"]],
    },
}


class Unseeded(Runner):
    """Builds its model in `__init__` from the global generator, as most scripts do: no `manual_seed`."""

    def __init__(self, config: Any) -> None:
        super().__init__(config)
        self.model = ResidualMLP()
        self.criterion = nn.MSELoss()
        self.datasets.train = make_data(16, seed=0)


def _initial_weights(runner: Any) -> dict[str, torch.Tensor]:
    parts = getattr(runner, "model_parts", None)
    if parts and len(parts) and runner.topology.size("pipeline") > 1:  # each stage holds its own part
        state = {key: value for part in parts for key, value in runner.unwrap(part).state_dict().items()}
        return {key: value.detach().cpu().clone() for key, value in state.items()}
    return full_weights(runner)  # gathers shards (a collective)


def _build_layouts(rank: int, world_size: int, root: str) -> dict:
    results = {}
    for name, layout in LAYOUTS.items():
        with Unseeded(parallel_config(root, name, **layout)) as runner:
            results[name] = {"weights": _initial_weights(runner), "draw": torch.rand(3)}
    return results


def test_initial_weights_are_equal_in_every_layout_and_per_rank_draws_differ_only_after(tmp_path):
    with Unseeded(parallel_config(str(tmp_path), "single", stack="torch")) as runner:
        reference = _initial_weights(runner)
    results = run_distributed(_build_layouts, str(tmp_path / "dist"), init_process_group=False)
    for name in LAYOUTS:
        weights = dict(results[0][name]["weights"])
        if name == "pipeline":  # the two stages together hold the model
            weights.update(results[1][name]["weights"])
        else:
            for key, value in results[1][name]["weights"].items():
                torch.testing.assert_close(value, weights[key], rtol=0, atol=0, msg=f"{name}: ranks differ at {key}")
        assert sorted(weights) == sorted(reference), name
        for key, value in reference.items():
            torch.testing.assert_close(
                weights[key], value, rtol=0, atol=0, msg=f"{name}: {key} differs from one process"
            )
    # After construction each data-parallel rank draws its own numbers (dropout, augmentations) ...
    assert not torch.equal(results[0]["ddp"]["draw"], results[1]["ddp"]["draw"])
    # ... while ranks that read the same batch (tensor parallel) draw alike.
    assert torch.equal(results[0]["tensor"]["draw"], results[1]["tensor"]["draw"])
