"""The diagnosis plug-ins on two gloo ranks (one launch): a slow data loader is named with its phase,
and a flipped bit in one replica's weights is caught, named and handled by each policy."""

from __future__ import annotations

import time

import pytest
import torch
from torch.utils.data import Dataset

from danling.runners import Events
from tests.dist import run_distributed
from tests.runners._torch_toy import TinyRunner, make_data, model_state, tiny_config

pytestmark = pytest.mark.distributed

SLEEP = 0.02  # seconds per sample on rank 1: 80 ms per batch of 4


class SlowOnRankOne(Dataset):
    """`make_data`'s samples; on rank 1 every `__getitem__` sleeps first."""

    def __init__(self, data: Dataset, rank: int) -> None:
        self.data, self.rank = data, rank

    def __len__(self) -> int:
        return len(self.data)

    def __getitem__(self, index: int):
        if self.rank == 1:
            time.sleep(SLEEP)
        return self.data[index]


class StragglingRunner(TinyRunner):
    """Rank 1 loads its batches slowly; the LOG values of the step logs are recorded."""

    n_train = 64

    def __init__(self, config):
        super().__init__(config)
        self.datasets.train = SlowOnRankOne(make_data(self.n_train), self.rank)
        self.step_logs = []
        self.events.subscribe(Events.LOG, self._record)

    def _record(self, context):
        if "train_step" in context.values:
            self.step_logs.append(dict(context.values["train_step"]))


class FlippingRunner(TinyRunner):
    """Rank 1 flips one bit of one weight right after global step 3 (the top mantissa bit: a flip of the
    lowest one in a small weight can be rounded away by the next update, making the replicas equal again)."""

    n_train = 64
    dropout = 0.0

    def optimizer_step(self):
        applied = super().optimizer_step()
        if self.rank == 1 and self.train_state.global_step == 3 and not getattr(self, "flipped", False):
            self.flipped = True
            weight = self.unwrap(self.model)[3].weight
            with torch.no_grad():
                weight.view(-1).view(torch.int32)[0] ^= 1 << 22  # the top mantissa bit
        return applied


def _stragglers(root: str) -> dict:
    config = tiny_config(
        root,
        epochs=1,
        log_interval=2,
        **{"stragglers.enabled": True, "stragglers.window": 2, "stragglers.patience": 2, "stragglers.factor": 2.0},
    )
    with StragglingRunner(config) as runner:
        with _warnings(runner) as warned:
            runner.train()
        monitor = runner.diagnosis.stragglers
        return {
            "logs": runner.step_logs,
            "latest": monitor.latest,
            "warnings": monitor.warnings,
            "warned": warned,
            "restored": runner.supervisor.watchdog is None or type(runner.supervisor.watchdog).__name__ == "Watchdog",
        }


def _consistency(root: str, policy: str, **overrides) -> dict:
    settings = {"epochs": 2, "consistency.interval": 2, "consistency.policy": policy, **overrides}
    config = tiny_config(root, **settings)
    out: dict = {}
    runner = FlippingRunner(config)
    try:
        with _warnings(runner) as warned:
            runner.train()
    except SystemExit as exit:
        out["exit"] = exit.code
    sentinel = runner.diagnosis.consistency
    out.update(
        mismatches=[(m.step, m.ranks, m.tensor) for m in sentinel.mismatches],
        checks=sentinel.checks,
        rollbacks=sentinel.rollbacks,
        step=runner.train_state.global_step,
        warned=warned,
        weights=model_state(runner),
    )
    runner.close()
    return out


class _warnings:
    """Collect the WARNING/ERROR records of the runner's logger inside the block."""

    def __init__(self, runner) -> None:
        import logging

        self.logger, self.records = runner.logger, []
        self.handler = logging.Handler(logging.WARNING)
        self.handler.emit = lambda record: self.records.append(record.getMessage())

    def __enter__(self):
        self.logger.addHandler(self.handler)
        return self.records

    def __exit__(self, *exc):
        self.logger.removeHandler(self.handler)


def _scenarios(rank: int, world_size: int, root: str) -> dict:
    torch.set_num_threads(1)
    return {
        "stragglers": _stragglers(f"{root}/stragglers"),
        "warn": _consistency(f"{root}/warn", "warn"),
        "stop": _consistency(f"{root}/stop", "stop"),
        # Step mode, so that checkpoints fall on the checks' steps (every 2 steps).
        "rollback": _consistency(f"{root}/rollback", "rollback", epochs=None, steps=16, **{"checkpoint.interval": 2}),
    }


def test_two_ranks_name_the_straggler_and_catch_a_flipped_bit(tmp_path):
    first, second = run_distributed(_scenarios, str(tmp_path), world_size=2, init_process_group=False)

    # Stragglers: every step log names rank 1 and its data loading, the same on both ranks.
    for out in (first["stragglers"], second["stragglers"]):
        logs = [log["straggler"] for log in out["logs"]]
        assert logs and all(
            log["rank"] == 1 and log["phase"] == "data loading" and log["phase_id"] == 0 for log in logs
        ), logs
        assert all(log["lag_ms"] > 0.5 * 1000 * 4 * SLEEP for log in logs), logs
        # The first window also holds the first steps' one-off costs; from the second on rank 1 is far
        # slower, and rank 0 waits for it in backward (the all-reduce).
        assert all(log["slowdown"] > 2.0 and log["waiting_ms"] > 0.5 * 1000 * 4 * SLEEP for log in logs[1:]), logs
        assert out["latest"].rank == 1 and out["warnings"] == 1 and out["restored"]
    assert any(
        "straggler: rank 1" in message and "data loading" in message for message in first["stragglers"]["warned"]
    )
    assert not second["stragglers"]["warned"]  # the main process reports

    # Consistency: the flip after step 3 is caught by the check at step 4, naming rank 1 and the tensor.
    caught = (4, (1,), "model.3.weight")
    warn = first["warn"]
    for out in (first["warn"], second["warn"]):
        assert out["mismatches"][0] == caught and "exit" not in out
    assert any("rank(s) [1]" in m and "model.3.weight" in m for m in warn["warned"])
    assert warn["step"] == 16  # training went on: 2 epochs of 8 updates

    # The stop lands where the ranks next agree on stop requests (every 8 batches), both at the same step.
    for out in (first["stop"], second["stop"]):
        assert out["mismatches"][0] == caught and out["exit"] == 0 and 4 <= out["step"] < 4 + 8
    assert first["stop"]["step"] == second["stop"]["step"]

    # Rollback: back to step 2's checkpoint (saved right after a passing check), then on to the end;
    # the rolled-back replicas agree again (later checks pass) and end identical.
    for out in (first["rollback"], second["rollback"]):
        assert out["mismatches"] == [caught] and out["rollbacks"] == 1 and out["step"] == 16
        assert "exit" not in out
    assert any("rolled back to" in m for m in first["rollback"]["warned"])
    for name, value in first["rollback"]["weights"].items():
        assert torch.equal(value, second["rollback"]["weights"][name])
