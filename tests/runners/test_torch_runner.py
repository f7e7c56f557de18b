"""TorchRunner in one process: construction, default steps, the update, schedulers, metrics, loops, checkpoints."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torchdata.stateful_dataloader import StatefulDataLoader

from danling.data import DataResumeError, ResumableSampler
from danling.metrics import regression_metrics
from danling.runners import EMA, RUNNERS, Runner, RunnerConfig, TorchRunner
from tests.runners._torch_toy import TinyRunner, make_data, make_model, model_state, tiny_config


class RecordingRunner(TinyRunner):
    """Records the __post_init__ hooks and, per optimizer update, the gradients it applies."""

    def __init__(self, config):
        self.calls = []
        self.grads = []
        super().__init__(config)

    def materialize_model(self):
        self.calls.append("materialize_model")
        super().materialize_model()

    def build_optimizer(self):
        self.calls.append("build_optimizer")
        super().build_optimizer()

    def build_scheduler(self):
        self.calls.append("build_scheduler")
        super().build_scheduler()

    def build_dataloaders(self):
        self.calls.append("build_dataloaders")
        super().build_dataloaders()

    def auto_restore(self):
        self.calls.append("auto_restore")
        super().auto_restore()

    def optimizer_step(self):
        self.grads.append([p.grad.clone() for p in self.model.parameters()])
        return super().optimizer_step()


class LinearRunner(RecordingRunner):
    """No dropout, no shuffling: every update can be recomputed by hand."""

    dropout = 0.0


def _linear_config(tmp_path, **overrides):
    config = {"optim.type": "sgd", "optim.lr": 1.0, "dataloader.train.shuffle": False}
    config.update(overrides)
    return tiny_config(tmp_path, **config)


def test_post_init_builds_components_in_order(tmp_path):
    config = tiny_config(tmp_path, **{"scheduler.type": "cosine", "dataloader.val.batch_size": 3})
    with RecordingRunner(config) as runner:
        assert runner.calls == [
            "materialize_model",
            "build_optimizer",
            "build_scheduler",
            "build_dataloaders",
            "auto_restore",
        ]
        assert isinstance(runner.optimizer, torch.optim.AdamW) and runner.optimizer.defaults["lr"] == 0.01
        # 20 samples / batch 4 = 5 steps per epoch, 2 epochs: known before the loaders existed.
        assert runner.scheduler.total_steps == 10 and runner.scheduler_interval == "step"
        train, val = runner.dataloaders["train"], runner.dataloaders["val"]
        assert isinstance(train, StatefulDataLoader) and isinstance(train.sampler, ResumableSampler)
        assert train.sampler.shuffle and train.drop_last and len(train) == 5
        assert not val.sampler.shuffle and not val.drop_last and val.batch_size == 3 and len(val) == 3
        assert runner.checkpointing.backend == "file" and runner.device == torch.device("cpu")


def test_model_is_required(tmp_path):
    class NoModel(TorchRunner):
        pass

    with pytest.raises(ValueError, match="needs self.model"):
        NoModel(tiny_config(tmp_path))


def test_default_batch_contract(tmp_path):
    with TinyRunner(tiny_config(tmp_path)) as runner:
        x, y = make_data(3).tensors
        runner.mode = "train"
        for batch in ({"input": x, "target": y}, [x, y], (x, y)):
            pred, loss = runner.train_step(batch)
            assert pred.shape == (3, 1) and loss.shape == () and not loss.requires_grad
        assert runner.train_state.micro_step == 3 and runner.train_state.global_step == 3
        runner.mode = "evaluate"
        assert not runner.model.training
        with runner.inference_context():
            assert runner.evaluate_step({"input": x, "target": y})[1].shape == ()
            assert runner.evaluate_step({"input": x})[1] is None  # no target, no loss
            runner.criterion = None
            assert runner.evaluate_step((x, y))[1] is None
        runner.mode = "infer"
        predictions = runner.infer_step({"input": x, "target": y})
        assert isinstance(predictions, list) and len(predictions) == 3 and isinstance(predictions[0], float)
        assert runner.infer_step(x[:1]) == predictions[:1]
        runner.mode = "train"
        with pytest.raises(ValueError, match="needs self.criterion"):
            runner.train_step((x, y))


def test_accumulation_windows_normalise_by_their_size(tmp_path):
    # 5 batches per epoch with accum_steps=2: windows of 2, 2 and a final window of 1.
    with LinearRunner(_linear_config(tmp_path, epochs=1, accum_steps=2)) as runner:
        initial = model_state(runner)
        runner.train()
        assert runner.train_state.global_step == 3 and runner.train_state.micro_step == 5
        final = model_state(runner)
    net = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Dropout(0.0), nn.Linear(8, 1))
    net.load_state_dict(initial)
    optimizer = torch.optim.SGD(net.parameters(), lr=1.0)
    x, y = make_data(20).tensors
    for window, (start, stop) in enumerate([(0, 2), (2, 4), (4, 5)]):
        for index in range(start, stop):
            batch = slice(4 * index, 4 * index + 4)
            (nn.functional.mse_loss(net(x[batch]), y[batch]) / (stop - start)).backward()
        for got, expected in zip(runner.grads[window], [p.grad for p in net.parameters()]):
            torch.testing.assert_close(got, expected)
        optimizer.step()
        optimizer.zero_grad()
    for key, value in net.state_dict().items():
        torch.testing.assert_close(final[key], value)


def test_gradient_clipping(tmp_path):
    with LinearRunner(_linear_config(tmp_path, epochs=1, max_grad_norm=0.5)) as runner:
        before = [p.detach().clone() for p in runner.model.parameters()]
        runner.train_step(next(iter(runner.dataloaders["train"])))
        assert runner.optimizer_container.last_grad_norm > 0.5  # the raw norm was larger
        update = torch.cat([(b - p.detach()).flatten() for b, p in zip(before, runner.model.parameters())])
        assert update.norm() == pytest.approx(0.5, rel=1e-4)  # SGD with lr=1 applies the clipped gradient
    with LinearRunner(_linear_config(tmp_path / "value", epochs=1, max_grad_value=0.01)) as runner:
        before = [p.detach().clone() for p in runner.model.parameters()]
        runner.train_step(next(iter(runner.dataloaders["train"])))
        update = torch.cat([(b - p.detach()).flatten() for b, p in zip(before, runner.model.parameters())])
        assert update.abs().max() <= 0.01 + 1e-7


class NanOnThirdBatch(LinearRunner):
    def __init__(self, config):
        super().__init__(config)
        self.batches = 0
        criterion = self.criterion

        def flaky(pred, target):
            self.batches += 1
            loss = criterion(pred, target)
            return loss * float("nan") if self.batches == 3 else loss

        self.criterion = flaky


def test_nonfinite_gradients_are_skipped(tmp_path):
    with NanOnThirdBatch(_linear_config(tmp_path, epochs=1, skip_nonfinite_grad=True)) as runner:
        runner.train()
        assert runner.optimizer_container.skipped_steps == 1
        assert runner.train_state.global_step == 4 and runner.train_state.micro_step == 5
        assert all(torch.isfinite(p).all() for p in runner.model.parameters())
        assert all(p.grad is None for p in runner.model.parameters())


def test_mixed_precision_on_cpu(tmp_path):
    for precision, dtype in (("bf16", torch.bfloat16), ("fp16", torch.float16)):
        with TinyRunner(tiny_config(tmp_path / precision, epochs=1, precision=precision)) as runner:
            assert runner.precision_policy.scaler is None  # loss scaling is for CUDA fp16 only
            runner.mode = "train"
            pred, loss = runner.train_step(next(iter(runner.dataloaders["train"])))
            assert pred.dtype == dtype and loss.isfinite()
            assert all(p.dtype == torch.float32 for p in runner.model.parameters())
            assert runner.train_state.global_step == 1


def test_ema_is_used_for_evaluation_and_checkpointed(tmp_path):
    config = tiny_config(tmp_path, epochs=1, **{"ema.enabled": True, "ema.decay": 0.5})
    with TinyRunner(config) as runner:
        assert isinstance(runner.ema, EMA) and runner.ema.decay == 0.5
        runner.train()
        x, y = make_data(4, seed=3).tensors
        runner.mode = "evaluate"
        with runner.inference_context():
            pred, _ = runner.evaluate_step((x, y))
            assert torch.equal(pred, runner.ema(x)) and not torch.equal(pred, runner.model(x))
        payload = runner.checkpoint_manager.load("latest")
        assert payload["ema"].keys() == payload["model"].keys()
        ema_weights = {k: v.clone() for k, v in runner.ema.module.state_dict().items()}
    with TinyRunner(
        tiny_config(tmp_path / "fresh", epochs=1, pretrained=str(runner.checkpoint_manager.latest))
    ) as fresh:
        for key, value in model_state(fresh).items():  # load_pretrained prefers the EMA weights
            assert torch.equal(value, ema_weights[key])


def test_a_fine_tune_with_ema_averages_from_the_pretrained_weights(tmp_path):
    # The EMA copy is made before `pretrained` loads; evaluation runs on it, so it must start from
    # the loaded weights, not from the random initialisation.
    with TinyRunner(tiny_config(tmp_path / "base", epochs=1)) as base:
        base.train()
        source, weights = str(base.checkpoint_manager.latest), model_state(base)
    config = tiny_config(tmp_path / "tuned", epochs=1, pretrained=source, **{"ema.enabled": True})
    with TinyRunner(config) as tuned:
        averaged = tuned.ema.module.state_dict()
        assert all(torch.equal(averaged[key], value) for key, value in weights.items())
        x, y = make_data(4, seed=3).tensors
        tuned.mode = "evaluate"
        with tuned.inference_context():
            assert torch.equal(tuned.evaluate_step((x, y))[0], tuned.model(x))


def test_schedulers_step_on_their_interval(tmp_path):
    config = tiny_config(tmp_path, epochs=3, **{"sched.type": "steplr", "sched.step_size": 1, "sched.gamma": 0.5})
    config["sched.interval"] = "epoch"
    with TinyRunner(config) as runner:
        assert runner.scheduler_interval == "epoch"
        runner.train()
        assert runner.optimizer.param_groups[0]["lr"] == pytest.approx(0.01 * 0.5**3)
    plateau = {"sched.type": "reducelronplateau", "sched.patience": 0, "sched.threshold": 0.99}
    with TinyRunner(tiny_config(tmp_path / "plateau", epochs=3, **plateau, **{"sched.monitor": "val.loss"})) as runner:
        assert runner.scheduler_interval == "epoch"
        runner.train()  # the first epoch sets the best value; the next two never beat it by 99%
        assert runner.optimizer.param_groups[0]["lr"] == pytest.approx(0.01 * 0.1**2)
    with pytest.raises(ValueError, match="monitored metric"):
        TinyRunner(tiny_config(tmp_path / "bad", **plateau, **{"sched.interval": "step"}))
    missing = tiny_config(tmp_path / "missing", **plateau, **{"sched.monitor": "val.acc"})
    with TinyRunner(missing) as runner, pytest.raises(ValueError, match=r"'val\.acc' is not in the epoch result"):
        runner.train()


def test_epoch_interval_scheduler_steps_once_per_round_in_step_mode(tmp_path):
    # 20 samples in batches of 4: 5 updates per round; 12 steps finish 2 rounds and stop inside the third.
    sched = {"sched.type": "steplr", "sched.step_size": 1, "sched.gamma": 0.5, "sched.interval": "epoch"}
    with TinyRunner(tiny_config(tmp_path, epochs=None, steps=12, **sched)) as runner:
        runner.train()
        assert runner.train_state.epoch == 2
        assert runner.optimizer.param_groups[0]["lr"] == pytest.approx(0.01 * 0.5**2)


def test_metrics_reach_the_results(tmp_path):
    class WithMetrics(TinyRunner):
        def __init__(self, config):
            super().__init__(config)
            self.metrics = regression_metrics(metrics=["mse", "r2"])
            self.train_metrics = regression_metrics(metrics=["mae"], mode="stream")

    with WithMetrics(tiny_config(tmp_path, epochs=1)) as runner:
        runner.train()
        latest = runner.latest_result
        assert set(latest["train"]) == {"loss", "mae"} and set(latest["val"]) == {"loss", "mse", "r2"}
        assert latest["val"]["mse"] == pytest.approx(latest["val"]["loss"], rel=1e-4)  # MSELoss averages alike
        assert set(runner.evaluate()["val"]) == {"loss", "mse", "r2"}


def test_step_mode_evaluation_and_inference(tmp_path):
    config = tiny_config(tmp_path, epochs=None, steps=7, evaluate_interval=3, **{"checkpoint.interval": 3})
    with TinyRunner(config) as runner:
        runner.train()
        assert runner.train_state.global_step == 7 and list(runner.results) == [3, 6, 7]
        assert set(runner.latest_result) == {"train", "val", "index"}
        names = sorted(path.name for path in runner.checkpoint_manager.checkpoints())
        assert names == ["step-000003", "step-000006", "step-000007"]
        stream = runner.infer("val", stream=True)
        assert [len(batch) for batch in stream] == [4, 4]
        assert len(runner.infer("val", steps=1)) == 4


def test_checkpoint_round_trip_continues_exactly(tmp_path):
    config = tiny_config(tmp_path, **{"scheduler.type": "cosine"})
    with TinyRunner(config) as runner:
        runner.train()
        weights, optimizer = model_state(runner), runner.optimizer.state_dict()
        first_epoch = runner.checkpoint_manager.directory / "epoch-000000"
        latest = runner.checkpoint_manager.latest
    with TinyRunner(dict(config, resume=str(latest))) as restored:
        assert restored.train_state.global_step == 10 and restored.train_state.epoch == 2
        assert all(torch.equal(weights[k], v) for k, v in model_state(restored).items())
        restored_state = restored.optimizer.state_dict()["state"]
        assert all(torch.equal(optimizer["state"][0][key], restored_state[0][key]) for key in ("exp_avg", "step"))
        assert restored.scheduler.last_epoch == 10 and list(restored.results) == [0, 1]
    # Resuming after the first epoch replays the second one bit for bit (dropout RNG included).
    with TinyRunner(dict(config, resume=str(first_epoch))) as resumed:
        assert resumed.train_state.global_step == 5 and list(resumed.results) == [0]
        resumed.train()
        assert resumed.train_state.global_step == 10
        assert all(torch.equal(weights[k], v) for k, v in model_state(resumed).items())
    assert TorchRunner.read_config(latest).config_id == RunnerConfig(**config).config_id


def test_fresh_optimizer_state_is_not_touched_by_a_save(tmp_path):
    with TinyRunner(tiny_config(tmp_path)) as runner:
        payload = runner.state_dict()
        assert not runner.optimizer.state and payload["optimizer"]["state"] == {}
        assert payload["optimizer"]["param_groups"][0]["params"][0] == "0.weight"


def test_dcp_backend_in_one_process_and_cross_reading(tmp_path):
    config = tiny_config(tmp_path, epochs=1, **{"checkpoint.backend": "dcp"})
    with TinyRunner(config) as runner:
        runner.train()
        assert runner.checkpoint_manager.backend == "dcp"
        latest = runner.checkpoint_manager.latest
        assert (latest / ".metadata").is_file()
        weights = model_state(runner)
    file_config = tiny_config(tmp_path / "file", epochs=1)
    with TinyRunner(file_config) as reader:  # a file-backend runner reads the DCP checkpoint too
        reader.load_checkpoint(latest)
        assert reader.train_state.global_step == 5
        assert all(torch.equal(weights[k], v) for k, v in model_state(reader).items())
    with TinyRunner.from_checkpoint(latest) as again:
        assert again.train_state.global_step == 5


class ShorterData(TinyRunner):
    n_train = 22  # same number of batches (drop_last), different shuffle order


class OtherBatchSize(TinyRunner):
    def __init__(self, config):
        super().__init__(config)
        self.dataloaders.train = StatefulDataLoader(
            self.datasets.train, batch_size=5, sampler=ResumableSampler(self.datasets.train, shuffle=True)
        )


def test_resume_check_fails_loudly_when_the_data_changed(tmp_path):
    config = tiny_config(tmp_path, epochs=1)
    with TinyRunner(config) as runner:
        runner.train()
    resumed = dict(config, auto_resume=True)
    with pytest.raises(DataResumeError, match="next-batch fingerprint"):
        ShorterData(resumed)
    with pytest.raises(DataResumeError, match="next-batch fingerprint"):
        OtherBatchSize(resumed)
    with TinyRunner(resumed) as runner:  # the unchanged data resumes
        assert runner.train_state.global_step == 5


class ViaRunner(Runner):
    """A script written against `Runner`: the backend comes from `config.stack`."""

    def __init__(self, config):
        super().__init__(config)
        self.model = make_model(0.0)
        self.criterion = nn.MSELoss()
        self.datasets.train = make_data(8)


def test_runner_dispatch_and_compile(tmp_path):
    for stack in ("auto", "torch", "ddp"):
        assert RUNNERS[stack] is TorchRunner
    stacks = r"registered stacks: \['auto', 'ddp', 'deepspeed', 'ds', 'graph', 'parallel', 'torch'"
    with pytest.raises(ValueError, match=stacks):
        Runner(tiny_config(tmp_path, stack="nonesuch"))
    config = tiny_config(tmp_path, epochs=1, stack="ddp", **{"compile.enable": True, "compile.backend": "eager"})
    with ViaRunner(config) as runner:
        assert isinstance(runner, TorchRunner) and isinstance(runner, ViaRunner)
        assert hasattr(runner.model, "_orig_mod") and runner.unwrap(runner.model) is runner.model._orig_mod
        runner.train()
        assert runner.train_state.global_step == 2
        assert "0.weight" in runner.checkpoint_manager.load("latest")["model"]


def test_deterministic_mode_is_restored_on_close(tmp_path):
    assert not torch.are_deterministic_algorithms_enabled()
    runner = TinyRunner(tiny_config(tmp_path, deterministic=True))
    assert torch.are_deterministic_algorithms_enabled()
    runner.close()
    assert not torch.are_deterministic_algorithms_enabled()


def test_iterable_datasets_flush_the_last_window(tmp_path):
    class Stream(torch.utils.data.IterableDataset):
        def __iter__(self):
            yield from zip(*make_data(12).tensors)

    class StreamRunner(LinearRunner):
        def __init__(self, config):
            super().__init__(config)
            self.datasets.train = Stream()

    with StreamRunner(
        _linear_config(tmp_path, epochs=1, accum_steps=2, **{"dataloader.train.shuffle": None})
    ) as runner:
        runner.train()  # 3 batches of unknown count: one full window, then a flushed window of 1
        assert runner.train_state.global_step == 2 and runner.train_state.micro_step == 3
        assert len(runner.grads) == 2


def test_final_export_can_be_model_only(tmp_path):
    options = {"checkpoint.last_save_model_only": True, "checkpoint.export_dtype": "bf16", "ema.enabled": True}
    with TinyRunner(tiny_config(tmp_path, **options)) as runner:
        runner.train()
        intermediate = runner.checkpoint_manager.load("epoch-000000")
        final = runner.checkpoint_manager.load("latest")
    assert {"optimizer", "loop", "dataloaders"} <= set(intermediate)
    assert set(final) == {"runner", "model", "ema"}
    assert all(value.dtype == torch.bfloat16 for value in final["model"].values())


def test_score_mode_is_a_validated_config_key():
    assert RunnerConfig().score_mode is None and RunnerConfig(score_mode="max").score_mode == "max"
    with pytest.raises(ValueError, match="score_mode='up'"):
        RunnerConfig(score_mode="up")
    with pytest.raises(ValueError, match=r"ema\.decay"):
        RunnerConfig(**{"ema.decay": 1.5})


def test_a_scheduler_stepped_per_round_gets_the_run_length_in_rounds(tmp_path):
    # A cosine stepped once per epoch must end its schedule with the run, not after a fraction of it
    # (5 updates per epoch: the update count, 15, would leave the rate barely decayed after 3 epochs).
    cosine = {"sched.type": "cosine", "sched.interval": "epoch", "sched.cooldown_steps": 0}
    with TinyRunner(tiny_config(tmp_path, epochs=3, **cosine)) as runner:
        assert runner.scheduler.total_steps == 3
        runner.train()
        assert runner.optimizer.param_groups[0]["lr"] == pytest.approx(0.01 * 1e-3)  # final_lr_ratio reached
    annealing = {"sched.type": "cosineannealinglr", "sched.interval": "epoch"}
    with TinyRunner(tiny_config(tmp_path / "annealing", epochs=3, **annealing)) as runner:
        assert runner.scheduler.T_max == 3
    # Step mode: 12 steps of 5-update rounds train in 3 rounds (the last one partial).
    steps = tiny_config(tmp_path / "steps", epochs=None, steps=12, **cosine)
    with TinyRunner(steps) as runner:
        assert runner.scheduler.total_steps == 3


@pytest.mark.parametrize("passes", [1, 3])
def test_epoch_interval_scheduler_steps_once_per_pass_in_step_mode(tmp_path, passes):
    class Scheduled(TinyRunner):
        def __init__(self, config):
            super().__init__(config)
            self.optimizer = torch.optim.SGD(self.model.parameters(), lr=1.0)
            self.scheduler = torch.optim.lr_scheduler.StepLR(self.optimizer, step_size=1, gamma=0.5)

    batches = TinyRunner.n_train // 4  # batch size 4: one pass is 5 optimizer steps
    # lr=1 diverges to NaN (which nonfinite.check would stop); only the scheduler's steps matter here
    options = {"scheduler.interval": "epoch", "nonfinite.check": "off"}
    config = tiny_config(tmp_path, epochs=None, steps=passes * batches, **options)
    with Scheduled(config) as runner:
        runner.train()
        assert runner.train_state.global_step == passes * batches
        assert runner.train_state.epoch == passes and runner.scheduler.last_epoch == passes
        assert runner.optimizer.param_groups[0]["lr"] == 0.5**passes
    # A budget that ends inside a pass leaves that pass uncounted.
    config = tiny_config(tmp_path / "partial", epochs=None, steps=batches + 2, **options)
    with Scheduled(config) as runner:
        runner.train()
        assert runner.train_state.epoch == 1 and runner.scheduler.last_epoch == 1


def test_a_scheduler_that_needs_a_length_without_a_budget_says_to_set_one(tmp_path):
    config = tiny_config(tmp_path, epochs=None, **{"scheduler.type": "cosine"})
    with pytest.raises(
        ValueError, match=r"scheduler 'cosine' needs the run length, but this run has no length: set epochs .* or steps"
    ):
        TinyRunner(config)


@pytest.mark.filterwarnings("ignore:Initializing zero-element tensors")  # torch's own, at nn.Linear(4, 0)
def test_a_model_with_a_size_of_zero_is_refused_naming_the_parameter(tmp_path):
    # `hidden: 0` in a config built nn.Linear(4, 0): the run trained a model that computes nothing, silently.
    from torch import nn

    class ZeroWidth(TinyRunner):
        def __init__(self, config):
            super().__init__(config)
            self.model = nn.Sequential(nn.Linear(4, 0), nn.ReLU(), nn.Linear(0, 1))

    with pytest.raises(ValueError, match=r"model parameter '0.weight' has shape \(0, 4\), no element: a size of 0"):
        ZeroWidth(tiny_config(tmp_path))
