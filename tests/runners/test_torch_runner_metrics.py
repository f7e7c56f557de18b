"""A runner whose train metrics keep accuracy batches reads the values of counting each batch at once.

`MetricMeter(accuracy)` keeps small CPU batches and counts them later (see
`tests/metrics/test_host_values.py`); a runner reads its metrics at step logs, mid-pass
checkpoints, the end of each pass and in its result rows. Each of those reads must give what a
container counting every batch right away gives, to the bit.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.utils.data import TensorDataset

from danling.metrics import StreamMetrics
from danling.metrics.functional import accuracy
from tests.runners._torch_toy import TinyRunner, tiny_config


def counted_at_once(input, target):
    """`accuracy` behind a function the meters do not know: counted at every batch."""
    return accuracy(input, target)


def classes(n: int, seed: int) -> TensorDataset:
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 4, generator=generator)
    return TensorDataset(x, (x[:, 0] > 0).long() + (x[:, 1] > 0).long())


def plain(state: dict) -> dict:
    return {key: value.tolist() if isinstance(value, torch.Tensor) else value for key, value in state.items()}


class Classifier(TinyRunner):
    n_train = 36  # 9 batches of 4: step logs and checkpoints land inside passes
    metric = staticmethod(accuracy)

    def __init__(self, config):
        super().__init__(config)
        self.model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 3))
        self.criterion = nn.CrossEntropyLoss()
        self.datasets.train, self.datasets.val = classes(self.n_train, 0), classes(8, 1)
        self.train_metrics = StreamMetrics(acc=self.metric, again=counted_at_once)
        self.evaluate_metrics = StreamMetrics(acc=self.metric)


class CountedAtOnce(Classifier):
    metric = staticmethod(counted_at_once)


@pytest.mark.parametrize(
    "overrides",
    [{"log_interval": 2}, {"epochs": None, "steps": 13, "checkpoint.interval": 3, "log_interval": 4}],
    ids=["step-logs", "mid-pass-checkpoints"],
)
def test_kept_accuracy_batches_give_the_rows_of_counting_each_batch(tmp_path, overrides):
    rows, states = {}, {}
    for name, cls in (("kept", Classifier), ("at once", CountedAtOnce)):
        with cls(tiny_config(tmp_path / name, **{"deterministic": True, **overrides})) as runner:
            runner.train()
            rows[name] = repr(runner.results.dict())  # repr: every float to the bit
            # Values as Python numbers (a kept meter's latest value is the float, the other's a 0-d tensor).
            states[name] = repr({meter: plain(state) for meter, state in runner.train_metrics.state_dict().items()})
            kept = runner.train_metrics["acc"]
            assert (type(kept).__name__ == "_HostMetricMeter") == (name == "kept")
    assert rows["kept"] == rows["at once"]
    assert states["kept"] == states["at once"]
