"""A pass's loss is the mean per sample: each step's loss weighs as many samples as its batch holds."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from danling.runners.services.csv_tracker import read_metrics_csv
from danling.tensors import NestedTensor
from tests.runners._torch_toy import TinyRunner, tiny_config
from tests.runners._toy import ToyRunner, toy_config

# 100 samples in batches of 32: batches of 32, 32, 32 and 4 (training keeps its partial batch too).
UNEVEN = {"epochs": 1, "dataloader.batch_size": 32, "dataloader.train.drop_last": False, "deterministic": True}


class Uneven(TinyRunner):
    """100 training and 100 validation samples; the criterion records every loss with its batch's size."""

    n_train = 100
    n_val = 100
    dropout = 0.0

    def __init__(self, config: Any) -> None:
        super().__init__(config)
        self.seen: list[tuple[bool, float, int]] = []  # (training, loss, samples) of every batch
        criterion = self.criterion

        def recording(pred: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
            loss = criterion(pred, target)
            self.seen.append((self.mode == "train", loss.item(), len(target)))
            return loss

        self.criterion = recording


class HookedUneven(Uneven):
    """The same, through the `train_step` hook rather than the plain fused step."""

    def train_step(self, data: Any) -> tuple[Any, Any]:
        return super().train_step(data)


def _per_sample(seen: list[tuple[bool, float, int]], training: bool) -> tuple[float, float, list[int]]:
    """The sample-weighted mean of the recorded losses, the mean of the batch means, and the batch sizes."""
    steps = [(loss, n) for mode, loss, n in seen if mode is training]
    weighted = sum(loss * n for loss, n in steps) / sum(n for _, n in steps)
    return weighted, sum(loss for loss, _ in steps) / len(steps), [n for _, n in steps]


@pytest.mark.parametrize("runner_type", [Uneven, HookedUneven], ids=["fused", "hooked"])
def test_the_pass_loss_is_the_mean_per_sample_with_a_short_last_batch(tmp_path, runner_type):
    with runner_type(tiny_config(tmp_path, **UNEVEN)) as runner:
        result = runner.train()
        fused = runner.loop.fused_step
        model = runner.unwrap(runner.model).eval()
        with torch.no_grad():
            x, y = runner.datasets.val.tensors
            val_mean = torch.nn.functional.mse_loss(model(x), y).item()  # over all 100 samples at once
    assert fused is (runner_type is Uneven)
    train_mean, train_batch_mean, sizes = _per_sample(runner.seen, training=True)
    assert sizes == [32, 32, 32, 4]
    assert result[0]["train"]["loss"] == pytest.approx(train_mean, rel=1e-6)
    assert result[0]["train"]["loss"] != pytest.approx(train_batch_mean, rel=1e-3)  # the old mean of batch means
    weighted, batch_mean, sizes = _per_sample(runner.seen, training=False)
    assert sizes == [32, 32, 32, 4]
    assert result[0]["val"]["loss"] == pytest.approx(val_mean, rel=1e-5)
    assert result[0]["val"]["loss"] == pytest.approx(weighted, rel=1e-6)
    assert result[0]["val"]["loss"] != pytest.approx(batch_mean, rel=1e-3)


def test_a_step_log_averages_the_samples_of_its_steps(tmp_path):
    with HookedUneven(tiny_config(tmp_path, log_interval=2, **UNEVEN)) as runner:
        runner.train()
        path = runner.workspace.path / "metrics.csv"
    steps = [(loss, n) for training, loss, n in runner.seen if training]
    logged = dict(read_metrics_csv(path)["train_step/loss"])
    assert list(logged) == [2, 4]  # after batches 2 and 4, each window of its own two steps
    for step, window in ((2, steps[0:2]), (4, steps[2:4])):
        expected = sum(loss * n for loss, n in window) / sum(n for _, n in window)
        assert logged[step] == pytest.approx(expected, rel=1e-5), step


class Texts(ToyRunner):
    """Batches of texts whose loss a step reads from the batch: `{"text": [...], "loss": mean}`."""

    def __init__(self, config: Any) -> None:
        super().__init__(config)
        self.dataloaders["val"] = [{"text": ["a", "b", "c"], "loss": 1.0}, {"text": ["d"], "loss": 5.0}]

    def evaluate_step(self, data: Any) -> tuple[Any, float]:
        return None, data["loss"]


class CountedTexts(Texts):
    def loss_weight(self, data: Any) -> int:
        return len(data["text"])


def test_a_batch_the_default_cannot_count_is_refused_and_the_hook_counts_it(tmp_path):
    with Texts(toy_config(tmp_path / "refused")) as runner, pytest.raises(ValueError, match="loss_weight"):
        runner.evaluate(["val"])
    with CountedTexts(toy_config(tmp_path / "counted")) as runner:
        assert runner.evaluate(["val"])["val"]["loss"] == pytest.approx((3 * 1.0 + 1 * 5.0) / 4)


def test_the_default_weight_counts_the_samples_of_a_batch(tmp_path):
    with ToyRunner(toy_config(tmp_path)) as runner:
        weigh = runner.loss_weight
        assert weigh(torch.zeros(5, 3)) == 5 and weigh(torch.tensor(2.0)) == 1 and weigh(2.5) == 1
        assert weigh((torch.zeros(6, 2), torch.zeros(6))) == 6
        assert weigh({"input": {"ids": torch.zeros(3, 7)}, "target": [torch.zeros(3)], "step": torch.tensor(9)}) == 3
        assert weigh(torch.zeros(0, 4)) == 0  # an empty batch adds nothing to the loss
        ragged = NestedTensor([torch.zeros(2), torch.zeros(5), torch.zeros(1)], batch_first=False)
        assert weigh({"input": ragged, "target": torch.zeros(3)}) == 3
        for batch, reason in (
            ({"input": torch.zeros(4, 2), "vocab": torch.zeros(10, 2)}, r"differ .*\[4, 10\]"),
            ([1.0, 2.0], "holds no tensor"),
            ("text", "of type str"),
        ):
            with pytest.raises(ValueError, match=reason):
                weigh(batch)
