"""An optimizer the user binds over parameters outside the model trains, checkpoints and resumes exactly.

"Either `self.optimizer` or `config.optim`": a learnable loss scale in the criterion is the usual
case. Its optimizer state is stored under the name of the attribute holding it
(`criterion.log_scale`); under DDP, where no wrapper synchronises it, its gradient is averaged
over the ranks at every update so the replicas stay equal.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from danling.checkpoint import read_checkpoint
from tests.dist import run_distributed
from tests.runners._parallel_toy import ParallelRegression, full_weights, parallel_config
from tests.runners._torch_toy import TinyRunner, model_state, tiny_config


class ScaledLoss(nn.Module):
    """Mean squared error of the prediction times a learnable scale."""

    def __init__(self) -> None:
        super().__init__()
        self.log_scale = nn.Parameter(torch.zeros(()))

    def forward(self, pred: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return nn.functional.mse_loss(pred * self.log_scale.exp(), target)


class BoundRunner(TinyRunner):
    """Binds its own AdamW over the model and the criterion's scale."""

    def __init__(self, config) -> None:
        super().__init__(config)
        self.criterion = ScaledLoss()
        self.optimizer = torch.optim.AdamW([*self.model.parameters(), *self.criterion.parameters()], lr=0.01)


def _config(root, **overrides):
    return tiny_config(root, deterministic=True, **{"optim.type": None, **overrides})


def _final(runner: BoundRunner) -> dict[str, torch.Tensor]:
    state = model_state(runner)
    state["criterion.log_scale"] = runner.criterion.log_scale.detach().clone()
    exp_avg = runner.optimizer.state[runner.criterion.log_scale]["exp_avg"]
    state["exp_avg of criterion.log_scale"] = exp_avg.detach().clone()
    return state


def _assert_equal(expected: dict[str, torch.Tensor], got: dict[str, torch.Tensor]) -> None:
    assert expected.keys() == got.keys()
    for key, value in expected.items():
        assert torch.equal(value, got[key]), f"{key} differs"


@pytest.mark.parametrize("backend", ["file", "dcp"])
def test_a_bound_optimizer_over_a_criterion_parameter_checkpoints_and_resumes_exactly(tmp_path, backend):
    with BoundRunner(_config(tmp_path / "whole", **{"checkpoint.backend": backend})) as runner:
        runner.train()
        expected = _final(runner)
        assert runner.criterion.log_scale.item() != 0.0  # it trained
        directory = runner.checkpoint_manager.directory

    saved = read_checkpoint(directory / "epoch-000001")
    optimizer = saved["optimizer"]
    assert "criterion.log_scale" in optimizer["state"]
    assert optimizer["param_groups"][0]["params"][-1] == "criterion.log_scale"

    with BoundRunner(_config(tmp_path / "half", epochs=1, **{"checkpoint.backend": backend})) as first:
        first.train()
        checkpoint = first.checkpoint_manager.directory / "latest.pointer"
    with BoundRunner(_config(tmp_path / "half", resume=str(checkpoint), **{"checkpoint.backend": backend})) as resumed:
        resumed.train()
        _assert_equal(expected, _final(resumed))


def test_a_parameter_held_nowhere_is_refused_with_its_shape(tmp_path):
    class Orphan(TinyRunner):
        def __init__(self, config) -> None:
            super().__init__(config)
            orphan = nn.Parameter(torch.zeros(3))  # a local: nothing the runner holds can name it
            self.optimizer = torch.optim.SGD([*self.model.parameters(), orphan], lr=0.1)

    with pytest.raises(ValueError, match=r"parameter of shape \(3,\) that is not in the model"):
        Orphan(_config(tmp_path))


def test_a_bare_parameter_attribute_is_named_by_its_attribute(tmp_path):
    class Temperature(TinyRunner):
        def __init__(self, config) -> None:
            super().__init__(config)
            self.temperature = nn.Parameter(torch.ones(()))
            self.optimizer = torch.optim.SGD([*self.model.parameters(), self.temperature], lr=0.1)

    with Temperature(_config(tmp_path)) as runner:
        assert list(runner.update.outside_parameters) == ["temperature"]


def _ddp_bound(rank: int, world_size: int, root: str) -> dict[str, torch.Tensor]:
    with BoundRunner(_config(root, epochs=1)) as runner:
        runner.train()
        checkpoint = runner.checkpoint_manager.directory / "latest.pointer"
    with BoundRunner(_config(root, resume=str(checkpoint))) as resumed:
        resumed.train()
        return _final(resumed)


def test_under_ddp_the_outside_parameter_is_averaged_and_resumes_on_every_rank(tmp_path):
    ranks = run_distributed(_ddp_bound, str(tmp_path), world_size=2, init_process_group=False)
    assert ranks[0]["criterion.log_scale"].item() != 0.0
    _assert_equal(ranks[0], ranks[1])  # replicas equal: the scale's gradient was averaged at every update


class ParallelBound(ParallelRegression):
    """The parallel toy with its own SGD over the model and the criterion's scale, bound before sharding."""

    def __init__(self, config) -> None:
        super().__init__(config)
        self.criterion = ScaledLoss()
        self.optimizer = torch.optim.SGD([*self.model.parameters(), self.criterion.log_scale], lr=0.01, momentum=0.5)


def _parallel_bound(rank: int, world_size: int, root: str) -> dict[str, dict[str, torch.Tensor]]:
    results = {}
    layouts = {"ddp": {"parallel.axes.replicate": 2}, "fsdp": {"parallel.axes.shard": 2, "fsdp.enabled": True}}
    for name, layout in layouts.items():
        with ParallelBound(parallel_config(root, name, **{"optim.type": None, **layout})) as runner:
            runner.train()
            results[name] = {**full_weights(runner), "log_scale": runner.criterion.log_scale.detach().clone()}
    layout = {"optim.type": None, **layouts["fsdp"]}
    with ParallelBound(parallel_config(root, "fsdp-half", epochs=1, **layout)) as runner:
        runner.train()
        checkpoint = runner.checkpoint_manager.directory / "latest.pointer"
    with ParallelBound(parallel_config(root, "fsdp-half", resume=str(checkpoint), **layout)) as runner:
        runner.train()
        results["fsdp-resumed"] = {**full_weights(runner), "log_scale": runner.criterion.log_scale.detach().clone()}
    return results


def test_sharded_layouts_follow_the_bound_optimizer_onto_the_sharded_parameters(tmp_path):
    """Bound in `__init__`, before FSDP2 replaced the parameters: it steps the sharded ones, like DDP."""
    ranks = run_distributed(_parallel_bound, str(tmp_path), world_size=2, init_process_group=False)
    ddp, fsdp = ranks[0]["ddp"], ranks[0]["fsdp"]
    assert ddp["log_scale"].item() != 0.0
    for key, value in ddp.items():
        torch.testing.assert_close(fsdp[key], value, rtol=1e-5, atol=1e-6, msg=key)
    _assert_equal(ranks[0]["fsdp"], ranks[0]["fsdp-resumed"])  # resumed exactly, the scale included
    for name in ("ddp", "fsdp", "fsdp-resumed"):
        _assert_equal(ranks[0][name], ranks[1][name])
