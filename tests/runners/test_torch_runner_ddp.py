"""TorchRunner on two gloo ranks: replicas, counters and results agree, gradients match one process."""

from __future__ import annotations

import pytest
import torch

from danling.metrics import regression_metrics
from tests.dist import run_distributed
from tests.runners._torch_toy import TinyRunner, make_data, model_state, tiny_config

pytestmark = pytest.mark.distributed


class DataParallelRunner(TinyRunner):
    """40 training samples (20 per rank), a metric, and a NaN loss on rank 1's third batch."""

    n_train = 40

    def __init__(self, config):
        super().__init__(config)
        self.metrics = regression_metrics(metrics=["mse"])
        self.batches = 0
        criterion = self.criterion

        def flaky(pred, target):
            loss = criterion(pred, target)
            if self.mode == "train":
                self.batches += 1
                if self.rank == 1 and self.batches == 3:
                    return loss * float("nan")
            return loss

        self.criterion = flaky


class GradientRunner(TinyRunner):
    """No dropout and no shuffling; records the gradient of every update."""

    n_train = 40
    dropout = 0.0

    def __init__(self, config):
        super().__init__(config)
        self.grads = []

    def optimizer_step(self):
        self.grads.append({name: p.grad.clone() for name, p in self.unwrap(self.model).named_parameters()})
        return super().optimizer_step()


class StoppingRunner(TinyRunner):
    """Rank 0 alone is asked to stop after its second update; both ranks must stop together."""

    n_train = 40

    def optimizer_step(self):
        applied = super().optimizer_step()
        if self.rank == 0 and self.train_state.global_step == 2:
            self.supervisor.request_stop()
        return applied


class UnusedBranch(torch.nn.Module):
    """The toy model beside a layer no forward uses: DDP waits for its gradient unless told."""

    def __init__(self, model):
        super().__init__()
        self.model, self.unused = model, torch.nn.Linear(3, 3)

    def forward(self, x):
        return self.model(x)


class UnusedBranchRunner(TinyRunner):
    def __init__(self, config):
        super().__init__(config)
        self.model = UnusedBranch(self.model)


def _gradient_config(root, batch_size):
    return tiny_config(
        root, epochs=None, steps=1, **{"dataloader.batch_size": batch_size, "dataloader.train.shuffle": False}
    )


def _ddp_scenarios(rank: int, world_size: int, root: str) -> dict:
    torch.set_num_threads(1)
    out = {}
    config = tiny_config(f"{root}/train", accum_steps=2, skip_nonfinite_grad=True, **{"checkpoint.async_enabled": True})
    with DataParallelRunner(config) as runner:
        out["wrapped"] = type(runner.model).__name__
        out["backend"] = runner.checkpoint_manager.backend
        out["loader_len"] = len(runner.dataloaders["train"])
        runner.train()
        out["skipped"] = runner.optimizer_container.skipped_steps
        out["global_step"] = runner.train_state.global_step
        out["latest"] = runner.latest_result.dict()
        out["evaluate"] = runner.evaluate().dict()
        # 7 samples over 2 ranks: the sampler pads rank 1's shard with sample 0.
        runner.datasets["infer"] = make_data(7, seed=2)
        runner.build_dataloaders()
        out["infer"] = runner.infer()
        model = runner.unwrap(runner.model).eval()
        with torch.no_grad():
            out["infer_expected"] = model(runner.datasets["infer"].tensors[0]).squeeze(-1).tolist()
        out["infer_shard"] = list(runner.dataloaders["infer"].sampler)
        out["weights"] = model_state(runner)
        runner.checkpoint_manager.wait()
        latest = runner.checkpoint_manager.latest
        out["dcp_files"] = (latest / ".metadata").is_file()
    with DataParallelRunner(dict(config, resume=str(latest))) as restored:
        out["restored_step"] = restored.train_state.global_step
        out["restored_equal"] = all(torch.equal(out["weights"][k], v) for k, v in model_state(restored).items())
    # `ddp.*` reaches the wrapper: a model with a parameter no forward uses trains only with
    # find_unused_parameters (without it DDP stops at the second step, waiting for that gradient).
    unused = tiny_config(f"{root}/unused", epochs=None, steps=3, **{"ddp.find_unused_parameters": True})
    with UnusedBranchRunner(unused) as runner:
        out["unused_options"] = runner.model.find_unused_parameters
        runner.train()
        out["unused_steps"] = runner.train_state.global_step
    with UnusedBranchRunner(tiny_config(f"{root}/stuck", epochs=None, steps=3)) as runner:
        try:
            runner.train()
        except RuntimeError as error:
            out["unused_error"] = str(error)
    with GradientRunner(_gradient_config(f"{root}/grad", batch_size=4)) as runner:
        runner.train()
        out["grads"] = runner.grads
    runner = StoppingRunner(tiny_config(f"{root}/stop", epochs=3))
    try:
        runner.train()
    except SystemExit as exit:
        out["stop"] = (
            exit.code,
            runner.train_state.global_step,
            runner.checkpoint_manager.alias("shutdown") is not None,
        )
    return out


def test_two_ranks_train_in_lockstep_and_match_one_process(tmp_path):
    ranks = run_distributed(_ddp_scenarios, str(tmp_path), world_size=2, init_process_group=False)
    first, second = ranks
    for out in ranks:
        assert out["wrapped"] == "DistributedDataParallel" and out["backend"] == "dcp" and out["dcp_files"]
        assert out["loader_len"] == 5  # 40 samples sharded over 2 ranks, batches of 4
        # 2 epochs x 3 windows, minus the update whose gradients were NaN on rank 1 only.
        assert out["skipped"] == 1 and out["global_step"] == 5
        assert out["restored_step"] == 5 and out["restored_equal"]
        assert out["unused_options"] is True and out["unused_steps"] == 3
        assert "find_unused_parameters" in out.get("unused_error", "")
    for key, value in first["weights"].items():
        assert torch.equal(value, second["weights"][key])  # replicas stay identical
    assert first["latest"] == second["latest"] and first["evaluate"] == second["evaluate"]
    assert set(first["latest"]["val"]) == {"loss", "mse"}
    # infer() gathers every rank's shard back into dataset order, without the sampler's padding.
    assert first["infer_shard"] == [0, 2, 4, 6] and second["infer_shard"] == [1, 3, 5, 0]
    for out in ranks:
        assert out["infer"] == pytest.approx(out["infer_expected"], rel=1e-6)
    # The stop request is agreed every few batches: both ranks stop after the same update and
    # write the shutdown checkpoint together.
    assert first["stop"] == second["stop"] and first["stop"][0] == 0 and first["stop"][2]
    assert 2 <= first["stop"][1] < 15
    # One update on 2 ranks x 4 samples equals one update on 8 samples in one process.
    with GradientRunner(_gradient_config(tmp_path / "single", batch_size=8)) as single:
        single.train()
        expected = single.grads
    assert len(first["grads"]) == len(expected) == 1
    for name, grad in expected[0].items():
        torch.testing.assert_close(first["grads"][0][name], grad, rtol=1e-5, atol=1e-6)
        assert torch.equal(first["grads"][0][name], second["grads"][0][name])


def _init_distributed_with_a_running_group(rank: int, world_size: int, root: str) -> str:
    import torch.distributed as dist

    assert dist.is_initialized()  # started by the harness, not by the runner
    try:
        TinyRunner(tiny_config(f"{root}/{rank}", log=False))
    except RuntimeError as error:
        return str(error)
    return "constructed"


def _init_distributed_owns_the_group(rank: int, world_size: int, root: str) -> dict:
    import torch.distributed as dist

    assert not dist.is_initialized()
    with TinyRunner(tiny_config(root, epochs=1, log=False)) as runner:
        started = dist.is_initialized() and dist.get_world_size() == world_size and runner.world_size == world_size
    return {"started": started, "destroyed": not dist.is_initialized()}


@pytest.mark.distributed
def test_init_distributed_refuses_a_group_it_did_not_start(tmp_path):
    from tests.dist import run_distributed

    errors = run_distributed(_init_distributed_with_a_running_group, str(tmp_path / "adopt"))
    assert all("already initialised" in error for error in errors), errors
    owned = run_distributed(_init_distributed_owns_the_group, str(tmp_path / "own"), init_process_group=False)
    assert owned == [{"started": True, "destroyed": True}] * 2


class PaddedEvaluationRunner(TinyRunner):
    """Mean squared error (from running moments) and Spearman (from the gathered predictions)."""

    def __init__(self, config):
        super().__init__(config)
        self.metrics = regression_metrics(metrics=["mse", "spearman"])


def _evaluate_splits(rank: int | None, world_size: int, root: str) -> dict:
    """Evaluate splits whose size the ranks do not divide: 7 samples in batches of 4, 5 and 1 in batches of 1."""
    torch.set_num_threads(1)
    out = {}
    for name, samples, batch_size in (("seven", 7, 4), ("five", 5, 1), ("one", 1, 1)):
        config = tiny_config(f"{root}/{name}", **{"dataloader.batch_size": batch_size})
        with type("Runner", (PaddedEvaluationRunner,), {"n_val": samples})(config) as runner:
            out[name] = runner.evaluate(["val"])["val"].dict()
    return out


def test_evaluation_on_two_ranks_counts_each_sample_once(tmp_path):
    # The sampler pads the shards to equal length by repeating the first samples (so the ranks stay
    # in lockstep); evaluation must not count those repeats: two ranks report what one process does.
    ranks = run_distributed(_evaluate_splits, str(tmp_path / "two"), world_size=2, init_process_group=False)
    single = _evaluate_splits(None, 1, str(tmp_path / "one"))
    assert repr(ranks[0]) == repr(ranks[1])  # (repr: one sample has no Spearman correlation, NaN)
    for name in ("seven", "five", "one"):
        assert ranks[0][name]["mse"] == pytest.approx(single[name]["mse"], rel=1e-6), name
        assert ranks[0][name]["spearman"] == pytest.approx(single[name]["spearman"], rel=1e-6, nan_ok=True), name
    # The loss leaves the repeats out too, each step weighing its own samples: in batches of 4, rank 1's
    # one batch holds a repeat after its 3 samples (one process: batches of 4 and 3). In batches of 1,
    # rank 1's last batch is nothing but the repeat: it adds no loss. With one sample, rank 1 has
    # nothing else (its loss meter still takes part in the reduction).
    for name in ("seven", "five", "one"):
        assert ranks[0][name]["loss"] == pytest.approx(single[name]["loss"], rel=1e-6), name
