"""The training loop over rounds: what a round whose updates were all skipped reports."""

from __future__ import annotations

import pytest

from tests.runners._torch_toy import TinyRunner, tiny_config


def test_a_round_whose_updates_were_all_non_finite_says_so(tmp_path):
    class AllNaN(TinyRunner):
        def train_step(self, data):
            x, y = self.to_device(data)
            loss = self.criterion(self.model(x), y) * float("nan")
            self.backward(loss)
            self.step()
            return None, loss.detach()

    config = tiny_config(tmp_path, epochs=None, steps=5, skip_nonfinite_grad=True)
    with AllNaN(config) as runner, pytest.raises(RuntimeError, match=r"all 5 updates were skipped for non-finite"):
        runner.train()
