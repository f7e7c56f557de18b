"""Non-finite updates and loss spikes: the run never goes on silently with NaN weights, and recovers from spikes."""

from __future__ import annotations

import logging

import pytest
import torch

from danling.runners.update.spikes import SpikeDetector, SpikeGuard, TrainingDivergedError
from tests.runners._torch_toy import TinyRunner, tiny_config


class InjectingRunner(TinyRunner):
    """Multiplies the training loss of the batches `inject` names, `(epoch, batch in the pass)` -> factor.

    Keyed by position, so a batch that a rollback replays spikes again unless it is skipped.
    `seen` records every training batch position the criterion saw; `lrs` the learning rate of every
    optimizer step.
    """

    dropout = 0.0
    inject: dict[tuple[int, int], float] = {}

    def __init__(self, config):
        super().__init__(config)
        criterion, self.seen, self.lrs = self.criterion, [], []

        def criterion_with_injections(pred, target):
            loss = criterion(pred, target)
            if not self.model.training:
                return loss
            key = (self.train_state.epoch, self.loop_state.batch)
            self.seen.append(key)
            factor = self.inject.get(key) or self.inject.get((key[0], "*"))
            return loss * factor if factor is not None else loss

        self.criterion = criterion_with_injections

    def build_optimizer(self):
        super().build_optimizer()
        # (restoring optimizer state takes one step at lr 0 to create the state: not an update)
        self.optimizer.register_step_pre_hook(self._record_lr)

    def _record_lr(self, optimizer, args, kwargs):
        if optimizer.param_groups[0]["lr"]:
            self.lrs.append(optimizer.param_groups[0]["lr"])


def _runner(tmp_path, inject, **overrides):
    cls = type("Injected", (InjectingRunner,), {"inject": inject})
    config = tiny_config(tmp_path, **{"epochs": 3, "optim.type": "sgd", "optim.lr": 0.01, **overrides})
    return cls(config)


def _finite(runner):
    return all(torch.isfinite(p).all() for p in runner.model.parameters())


def test_detector_median_window_and_min_history():
    detector = SpikeDetector(factor=2.0, window=3, min_history=2)
    assert [detector.observe(x) for x in (10.0, 30.0, 1.0, 1.0, 1.0, 2.5)] == [False, False, False, False, False, True]
    assert list(detector.history) == [1.0, 1.0, 1.0]  # the spike stays out of the history
    assert detector.observe(float("nan")) is False
    with pytest.raises(ValueError, match="spikes.factor"):
        SpikeDetector(factor=1.0)
    with pytest.raises(ValueError, match="spikes.policy"):
        SpikeGuard("restart")


def test_nan_loss_with_the_skip_off_stops_the_run_before_a_checkpoint(tmp_path):
    runner = _runner(tmp_path / "epochs", {(0, 2): float("nan")})
    with runner, pytest.raises(TrainingDivergedError, match="training loss of the train pass is not finite"):
        runner.train()
    assert runner.checkpoint_manager.latest is None  # no checkpoint holds the NaN weights
    # step mode, a checkpoint every 2 steps: the one due after the NaN at step 3 is not written
    overrides = {"epochs": None, "steps": 8, "checkpoint.interval": 2}
    runner = _runner(tmp_path / "steps", {(0, 2): float("nan")}, **overrides)
    with runner, pytest.raises(TrainingDivergedError, match=r"global step 4\)"):
        runner.train()
    assert runner.checkpoint_manager.latest.name == "step-000002"


def test_nan_loss_with_check_update_is_never_applied_and_stops_after_max_consecutive(tmp_path):
    with _runner(tmp_path / "one", {(0, 2): float("nan")}, **{"nonfinite.check": "update"}) as runner:
        with pytest.raises(TrainingDivergedError, match=r"1 update\(s\) in a row had non-finite"):
            runner.train()
        assert _finite(runner) and runner.train_state.global_step == 2
    nan = float("nan")
    inject = {(0, 2): nan, (1, 1): nan, (1, 2): nan}
    overrides = {"nonfinite.check": "update", "nonfinite.max_consecutive": 2}
    with _runner(tmp_path / "two", inject, **overrides) as runner:
        with pytest.raises(TrainingDivergedError, match=r"2 update\(s\) in a row"):
            runner.train()
        # (0, 2) alone was dropped and training went on; (1, 1) and (1, 2) came in a row
        assert _finite(runner) and runner.optimizer_container.skipped_steps == 3
        assert runner.train_state.global_step == 4 + 1


def test_every_skip_is_logged_and_counted_in_the_step_logs(tmp_path, caplog):
    caplog.set_level(logging.INFO)
    with _runner(tmp_path, {(0, 1): float("inf"), (2, 3): float("nan")}, skip_nonfinite_grad=True) as runner:
        runner.config.log_interval = 1
        runner.train()
        assert _finite(runner) and runner.optimizer_container.skipped_steps == 2
    skips = [r.getMessage() for r in caplog.records if "non-finite" in r.getMessage()]
    assert len(skips) == 2 and "2 skipped so far" in skips[1]
    steps = [r.getMessage() for r in caplog.records if r.getMessage().startswith("train [")]
    assert "skipped" not in steps[0] and "skipped: 1" in steps[1] and "skipped: 2" in steps[-1]


SPIKES = {"spikes.window": 4, "spikes.min_history": 3, "spikes.factor": 5.0}


def test_spike_policy_skip_drops_the_update(tmp_path):
    with _runner(tmp_path, {(1, 2): 1e4}, **SPIKES, **{"spikes.policy": "skip"}) as runner:
        runner.train()
        guard = runner.update.spike_guard
        assert guard.spikes == 1 and runner.optimizer_container.skipped_steps == 1
        assert runner.train_state.global_step == 14 and _finite(runner)


def test_spike_rollback_reloads_lowers_the_lr_and_skips_the_spiked_batch(tmp_path):
    overrides = {**SPIKES, "spikes.policy": "rollback", "spikes.lr_factor": 0.1, "spikes.cooldown_steps": 2}
    with _runner(tmp_path, {(1, 2): 1e4}, **overrides) as runner:
        runner.train()
        guard = runner.update.spike_guard
        assert guard.rollbacks == 1 and guard.skipped_batches == {("train", 1, 2)}
        # epoch 1 ran batches 0-2, spiked, rolled back to the end of epoch 0, replayed 0-1, skipped 2
        epoch1 = [batch for epoch, batch in runner.seen if epoch == 1]
        assert epoch1 == [0, 1, 2, 0, 1, 3, 4]
        # steps: 5 of epoch 0, 2 before the spike, then (after the rollback) 5 more: the first two lowered
        assert runner.lrs[:7] == [0.01] * 7
        assert runner.lrs[7:] == pytest.approx([0.001, 0.001] + [0.01] * 8)
        assert runner.train_state.global_step == 15 and runner.train_state.epoch == 3 and _finite(runner)
        path = runner.checkpoint_manager.latest
    saved = runner.read_checkpoint(str(path))["loop"]["update"]["spikes"]
    assert saved["skipped_batches"] == [["train", 1, 2]] and saved["rollbacks"] == 1


def test_spike_rollback_stops_after_max_rollbacks(tmp_path):
    overrides = {**SPIKES, "spikes.policy": "rollback", "spikes.max_rollbacks": 1}
    with _runner(tmp_path, {(1, "*"): 1e4}, **overrides) as runner:
        with pytest.raises(TrainingDivergedError, match=r"after 1 rollback\(s\), the most spikes.max_rollbacks=1"):
            runner.train()
        assert runner.update.spike_guard.rollbacks == 1 and _finite(runner)


def test_spike_rollback_without_a_checkpoint_says_so(tmp_path):
    overrides = {**SPIKES, "spikes.policy": "rollback", "spikes.min_history": 1}
    runner = _runner(tmp_path, {(0, 2): 1e4}, **overrides)
    with runner, pytest.raises(TrainingDivergedError, match="no checkpoint in .* to roll back to"):
        runner.train()


def _spike_on_one_rank(rank, world_size, root):
    # rank 1 alone spikes: the window loss is averaged over the ranks, so both roll back together
    # (2 batches per rank and pass)
    inject = {(1, 1): 1e4} if rank == 1 else {}
    overrides = {**SPIKES, "spikes.policy": "rollback", "spikes.cooldown_steps": 2, "spikes.min_history": 2}
    with _runner(root, inject, **overrides) as runner:
        runner.train()
        guard = runner.update.spike_guard
        return {
            "rollbacks": guard.rollbacks,
            "skipped": sorted(guard.skipped_batches),
            "step": runner.train_state.global_step,
            "weights": [p.detach().clone() for p in runner.model.parameters()],
        }


@pytest.mark.distributed
def test_ranks_agree_on_a_spike_one_of_them_saw(tmp_path):
    from tests.dist import run_distributed

    first, second = run_distributed(_spike_on_one_rank, str(tmp_path), init_process_group=False)
    assert first["rollbacks"] == second["rollbacks"] == 1
    assert first["skipped"] == second["skipped"] == [("train", 1, 1)]
    assert first["step"] == second["step"]
    assert all(torch.equal(a, b) and torch.isfinite(a).all() for a, b in zip(first["weights"], second["weights"]))
