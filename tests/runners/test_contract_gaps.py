"""Runner behaviours the API contract states: stack resolution, config spellings, checkpoint
delegation and restore paths, step-mode scheduling and closing."""

from __future__ import annotations

import logging

import pytest
import torch

from danling.runners import RunnerConfig
from tests.runners._torch_toy import TinyRunner, tiny_config
from tests.runners._toy import ToyRunner, toy_config


def test_checkpoint_backend_is_read_in_any_case(tmp_path):
    from danling.checkpoint import FileCheckpointManager

    config = RunnerConfig(**{"checkpoint.backend": "DCP"}).boot()
    assert config.checkpoint.backend == "dcp"
    built = RunnerConfig(**tiny_config(tmp_path / "a", **{"checkpoint.backend": "FILE"}))
    with TinyRunner(built) as runner:  # a config object the caller built (validated, not booted)
        assert runner.config.checkpoint.backend == "file"
        assert isinstance(runner.checkpoint_manager, FileCheckpointManager)
    with pytest.raises(ValueError, match="checkpoint.backend='tape'"):
        RunnerConfig(**{"checkpoint.backend": "tape"}).boot()


def test_log_interval_zero_turns_step_logs_off(tmp_path, caplog):
    RunnerConfig(log_interval=0).boot()  # accepted
    with pytest.raises(ValueError, match="log_interval"):
        RunnerConfig(log_interval=-1).boot()
    with ToyRunner(toy_config(tmp_path, log_interval=0, epochs=1)) as runner:
        assert runner.log_interval == 0
        with caplog.at_level(logging.INFO, logger=runner.logger.name):
            runner.train()
    step_lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith(("train [", "val ["))]
    assert step_lines == []
    assert runner.results[0]["train"]["loss"] >= 0  # rounds still run and are recorded


def test_split_lists_are_deduplicated(tmp_path):
    overrides = {"train_splits": ["train", "train"], "evaluate_splits": ["val", "val", "infer", "val"], "epochs": 1}
    with ToyRunner(toy_config(tmp_path, **overrides)) as runner:
        assert runner.train_splits == ["train"] and runner.evaluate_splits == ["val", "infer"]
        assert runner._resolve_splits(["val", "val"], [], "evaluate") == ["val"]
        runner.train()
        assert runner.train_state.global_step == 5  # one pass over the 5 training items, not two


def test_stack_auto_is_resolved_to_ddp(tmp_path):
    from danling.runners import Runner, TorchRunner

    class TinyEntry(Runner):  # built through the stack registry: combined with TorchRunner
        def __init__(self, config):
            super().__init__(config)
            self.model = torch.nn.Linear(4, 1)

    with TinyRunner(tiny_config(tmp_path / "direct")) as runner:
        assert runner.config.stack == "ddp"
        # Recording the resolved backend leaves the experiment (and its run directory) as it was.
        assert runner.config.config_id == RunnerConfig(**tiny_config(tmp_path / "direct")).config_id
    config = RunnerConfig(**tiny_config(tmp_path / "entry"))
    assert config.stack == "auto"
    with TinyEntry(config) as runner:
        assert isinstance(runner, TorchRunner) and runner.config.stack == "ddp" and config.stack == "ddp"
    with TinyRunner(tiny_config(tmp_path / "named", stack="torch")) as runner:
        assert runner.config.stack == "torch"  # an explicit choice is kept
    # A run resumed with `stack: auto` again matches the checkpoint it wrote.
    with TinyRunner(tiny_config(tmp_path / "resume", epochs=1)) as first:
        first.train()
    with TinyRunner(tiny_config(tmp_path / "resume", epochs=1, auto_resume=True)) as again:
        assert again.train_state.epoch == 1


def test_save_checkpoint_overrides_change_the_save_policy(tmp_path):
    class RecordingRunner(ToyRunner):
        """A user's policy: records each request, and writes every other one with the default policy."""

        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self.requests = []

        def save_checkpoint(self, name="latest", epochs=None, save_best=True, last_step=False, force=False):
            self.requests.append((name, epochs, last_step, force))
            if len(self.requests) % 2:
                return None
            return super().save_checkpoint(name, epochs, save_best, last_step, force)

    with RecordingRunner(toy_config(tmp_path, epochs=3)) as runner:
        manager = runner.checkpoint_manager
        runner.train()
        expected = [("latest", 0, False, False), ("latest", 1, False, False), ("latest", 2, True, False)]
        assert runner.requests == expected
        assert [path.name for path in manager.checkpoints()] == ["epoch-000001"]  # the policy above: 2nd only
        assert manager.alias("best") is not None and manager.latest.name == "epoch-000001"
        assert runner.save_checkpoint(name="manual", force=True).name == "step-000015"  # the 4th request
        assert manager.alias("manual").name == "step-000015"
        assert runner.save_checkpoint(name="again", force=True) is None and manager.alias("again") is None


@pytest.mark.parametrize("source", ["path", "mapping", "bytes"])
def test_exclude_from_loading_honours_dotted_keys_and_runner(tmp_path, source):
    import io

    with ToyRunner(toy_config(tmp_path / "done")) as done:
        done.train()
        payload = done.state_dict()
        sources = {"path": done.checkpoint_manager.latest, "mapping": payload}
        buffer = io.BytesIO()
        torch.save(payload, buffer)
        sources["bytes"] = buffer.getvalue()
    checkpoint = sources[source]
    excluded = {"checkpoint.exclude_from_loading": ["state.train"]}
    with ToyRunner(toy_config(tmp_path / "fresh", **excluded)) as runner:
        runner.load_checkpoint(checkpoint)
        assert runner.train_state.epoch == 0 and runner.train_state.global_step == 0  # counters kept
        assert runner.model.weight == done.model.weight and list(runner.results) == [0, 1, 2]
    assert payload["state"]["train"]["epoch"] == 3  # the caller's payload is left as it was
    # Excluding the saved config skips the check that it describes the same experiment.
    other = {"checkpoint.exclude_from_loading": "runner", "max_grad_norm": 1.0}
    with ToyRunner(toy_config(tmp_path / "other", **other)) as runner:
        runner.load_checkpoint(checkpoint)
        assert runner.train_state.epoch == 3 and runner.config.max_grad_norm == 1.0
    checked = toy_config(tmp_path / "checked", max_grad_norm=1.0)
    with ToyRunner(checked) as runner, pytest.raises(ValueError, match="max_grad_norm: None -> 1.0"):
        runner.load_checkpoint(checkpoint)


def test_a_backend_free_runner_restores_nothing_at_construction(tmp_path):
    from danling.runners import BaseRunner

    class Bare(BaseRunner):  # no model: nothing a checkpoint's weights could load into
        pass

    with ToyRunner(toy_config(tmp_path / "done")) as done:
        done.train()
        latest = str(done.checkpoint_manager.latest)
    for key in ("resume", "pretrained"):
        with Bare({"workspace_root": str(tmp_path / key), "log": False, key: latest}) as bare:
            assert bare.train_state.epoch == 0 and not bare.results and bare.config[key] == latest
    # A concrete runner restores at construction.
    with TinyRunner(tiny_config(tmp_path / "tiny", epochs=1)) as tiny:
        tiny.train()
        tiny_latest = str(tiny.checkpoint_manager.latest)
    with TinyRunner(tiny_config(tmp_path / "tiny", epochs=1, resume=tiny_latest)) as resumed:
        assert resumed.train_state.epoch == 1


def test_from_checkpoint_of_a_fine_tuned_run(tmp_path):
    with ToyRunner(toy_config(tmp_path / "base")) as base:
        base.train()
        source = str(base.checkpoint_manager.latest)
    with ToyRunner(toy_config(tmp_path / "tuned", pretrained=source, epochs=2)) as tuned:
        tuned.train()
        latest, weight = tuned.checkpoint_manager.latest, tuned.model.weight
    for checkpoint in (latest, latest / "state.pt"):
        with ToyRunner.from_checkpoint(checkpoint) as restored:
            assert restored.config.pretrained == source and restored.config.epochs == 2
            assert restored.model.weight == weight and restored.train_state.epoch == 2


def test_auto_resume_on_a_fresh_run_starts_from_pretrained(tmp_path, caplog):
    with ToyRunner(toy_config(tmp_path / "base")) as base:
        base.train()
        source, weight = str(base.checkpoint_manager.latest), base.model.weight
    config = toy_config(tmp_path / "tuned", pretrained=source, auto_resume=True, epochs=1)
    with caplog.at_level(logging.INFO), ToyRunner(config) as first:
        assert first.model.weight == weight and first.train_state.epoch == 0  # weights only
        first.train()
        trained = first.model.weight
    assert any("starting from the pretrained weights" in r.getMessage() for r in caplog.records)
    with ToyRunner(config) as again:  # the resubmitted job resumes its own checkpoint instead
        assert again.model.weight == trained and again.train_state.epoch == 1


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


def test_close_after_a_timeout_warns_and_a_second_close_drains(tmp_path):
    import threading

    from danling.checkpoint import FileCheckpointManager
    from danling.checkpoint.manifest import HashingWriter

    release = threading.Event()

    class StalledWriter(HashingWriter):
        def write(self, data):
            release.wait()
            return super().write(data)

    class StalledManager(FileCheckpointManager):
        def _payload_stream(self, raw):
            return StalledWriter(raw)

    runner = TinyRunner(tiny_config(tmp_path / "run"))
    manager = StalledManager(tmp_path / "checkpoints", async_save=True)
    runner.set_checkpoint_manager(manager)
    runner.save_checkpoint(force=True)
    try:
        with pytest.warns(RuntimeWarning, match="still running"):
            assert runner.close(timeout=0) is False
    finally:
        release.set()
    assert manager._pending is not None  # left in flight by the first call
    assert runner.close() is True  # waits for the write the first call left behind
    assert manager._pending is None and FileCheckpointManager(tmp_path / "checkpoints").load("latest")["model"]
    assert runner.close() is True  # and a closed runner stays closed


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
