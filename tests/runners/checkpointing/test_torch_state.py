"""The torch checkpoint payload: models without parameters, and data positions on resume."""

from __future__ import annotations

import logging

import pytest
import torch
from torch.utils.data import DataLoader, IterableDataset

from danling.data import DataResumeError
from tests.runners._torch_toy import TinyRunner, make_data, tiny_config


class PlainLoaderRunner(TinyRunner):
    """Trains on a user-bound plain `DataLoader`, which cannot save its position."""

    def __init__(self, config):
        super().__init__(config)
        self.dataloaders.train = DataLoader(make_data(20), batch_size=4, shuffle=False)


def _crash_after_update(runner_cls: type, config: dict, step: int) -> None:
    class Crashing(runner_cls):
        def optimizer_step(self):
            applied = super().optimizer_step()
            if applied and self.train_state.global_step == step:
                self.save_checkpoint(force=True)
                raise KeyboardInterrupt("simulated crash")
            return applied

    with pytest.raises(KeyboardInterrupt), Crashing(config) as runner:
        runner.train()


class Stream(IterableDataset):
    def __init__(self, n: int) -> None:
        self.data = make_data(n)

    def __iter__(self):
        return iter(self.data)


class StreamRunner(TinyRunner):
    def __init__(self, config):
        super().__init__(config)
        self.datasets.train = Stream(20)


def test_mid_pass_resume_of_a_plain_dataloader_fails_loudly(tmp_path):
    config = tiny_config(tmp_path, epochs=1)
    _crash_after_update(PlainLoaderRunner, config, step=2)
    with pytest.raises(DataResumeError, match=r"split 'train' mid-pass.*StatefulDataLoader"):
        PlainLoaderRunner({**config, "auto_resume": True})
    # Excluding the loader state restarts the pass knowingly; an epoch-boundary checkpoint needs no position.
    with PlainLoaderRunner({**config, "auto_resume": True, "checkpoint.exclude_from_loading": ["dataloaders"]}) as r:
        assert r.train_state.global_step == 2


def test_plain_dataloader_resumes_from_an_epoch_boundary(tmp_path):
    config = tiny_config(tmp_path, epochs=2)

    class CrashInEpoch1(PlainLoaderRunner):
        def optimizer_step(self):
            applied = super().optimizer_step()
            if self.train_state.global_step == 6:  # epoch 0 was checkpointed at its end, nothing since
                raise KeyboardInterrupt("simulated crash")
            return applied

    with pytest.raises(KeyboardInterrupt), CrashInEpoch1(config) as runner:
        runner.train()
    with PlainLoaderRunner({**config, "auto_resume": True}) as resumed:  # no position needed: no error
        assert (resumed.train_state.epoch, resumed.train_state.global_step) == (1, 5)
        resumed.train()
        assert resumed.train_state.global_step == 10


def test_mid_pass_resume_of_an_iterable_dataset_warns_that_it_cannot_verify(tmp_path, caplog):
    config = tiny_config(tmp_path, epochs=None, steps=4, **{"dataloader.train.shuffle": False})
    _crash_after_update(StreamRunner, config, step=3)
    with caplog.at_level(logging.WARNING, logger="danling"), StreamRunner({**config, "auto_resume": True}) as runner:
        assert runner.train_state.global_step == 3
        warnings = [record.getMessage() for record in caplog.records if record.levelno == logging.WARNING]
        assert any("'train' mid-pass without verifying" in message for message in warnings), warnings
        runner.train()
        assert runner.train_state.global_step == 4


def test_a_model_without_parameters_checkpoints_in_one_process(tmp_path):
    from danling.checkpoint.training import ModelState

    class FeatureSum(torch.nn.Module):  # no parameters, no buffers
        def forward(self, x):
            return x.sum(dim=-1, keepdim=True)

    class Parameterless(TinyRunner):
        def __init__(self, config):
            super().__init__(config)
            self.model = FeatureSum()

    assert ModelState(torch.nn.ReLU()).state_dict() == {}
    ModelState(torch.nn.ReLU()).load_state_dict({})  # nothing to load, nothing missing
    with pytest.raises(ValueError, match="no weights"):
        ModelState(torch.nn.Linear(2, 1)).load_state_dict({})
    config = {key: value for key, value in tiny_config(tmp_path).items() if not key.startswith("optim.")}
    with Parameterless(config) as runner:
        path = runner.save_checkpoint(force=True)
        assert path is not None and runner.evaluate()["val"]["loss"] >= 0
    with Parameterless(dict(config, resume=str(path))) as resumed:
        assert resumed.config.resume == str(path)


@pytest.mark.parametrize("backend", ["file", "dcp"])
def test_a_dotted_model_exclude_keeps_those_weights_and_restores_the_rest(tmp_path, backend):
    # `checkpoint.exclude_from_loading: [model.3]` (a submodule), `[model.0.weight]` (one entry) or
    # `[ema.3]`: those weights keep the fresh run's values, everything else of the model (or EMA) is
    # restored (strict loading used to fail on the entries the exclusion itself left out).
    config = tiny_config(tmp_path, epochs=1, **{"checkpoint.backend": backend, "ema.enabled": True})

    def weights(runner, part):
        return {k: v.detach().clone() for k, v in runner.unwrap(getattr(runner, part)).state_dict().items()}

    with TinyRunner(config) as runner:
        runner.train()
        trained = {part: weights(runner, part) for part in ("model", "ema")}
        latest, steps = str(runner.checkpoint_manager.latest), runner.train_state.global_step
    cases = (("model", ["model.3"], {"3.weight", "3.bias"}), ("model", ["model.0.weight"], {"0.weight"}))
    for part, exclude, kept in (*cases, ("ema", ["ema.3"], {"3.weight", "3.bias"})):
        resumed = TinyRunner({**config, "resume": latest, "checkpoint.exclude_from_loading": exclude})
        fresh = TinyRunner({**config, "workspace_root": str(tmp_path / "fresh")})  # the weights a new run starts with
        with resumed, fresh:
            state, initial = weights(resumed, part), weights(fresh, part)
            for key, value in state.items():
                assert torch.equal(value, initial[key] if key in kept else trained[part][key]), (exclude, key)
            assert resumed.train_state.global_step == steps
            if part == "model":
                # The EMA of those weights and their optimizer state start afresh with them: an average
                # of the old weights would evaluate them, and the old moments would move the new ones.
                ema, fresh_ema = weights(resumed, "ema"), weights(fresh, "ema")
                for key, value in ema.items():
                    assert torch.equal(value, fresh_ema[key] if key in kept else trained["ema"][key]), (exclude, key)
                named = dict(resumed.unwrap(resumed.model).named_parameters())
                stateful = {name for name, param in named.items() if param in resumed.optimizer.state}
                assert stateful == set(named) - kept, exclude
