"""BaseRunner: construction lifecycle, properties, loops, results and seeding."""

from __future__ import annotations

import gc
import json
import math
import random
import signal
import threading

import pytest
import torch

from danling.checkpoint import FileCheckpointManager
from danling.checkpoint.manifest import HashingWriter
from danling.runners import BaseRunner, RunnerConfig, RunnerMode, Tracker
from danling.runners.services import trackers as tracker_module
from danling.utils import RoundDict
from tests.dist import run_distributed
from tests.runners._torch_toy import TinyRunner, model_state, tiny_config
from tests.runners._toy import TRAIN, VAL, ToyRunner, toy_config


class RecordingRunner(ToyRunner):
    """Records the order in which the lifecycle hooks run."""

    def __init__(self, config):
        self.calls = []
        super().__init__(config)
        self.calls.append("subclass __init__ done")

    def _record(self, name, method, *args, **kwargs):
        self.calls.append(name)
        return method(*args, **kwargs)

    def init_distributed(self):
        self._record("init_distributed", super().init_distributed)

    def init_checkpoint_manager(self):
        self._record("init_checkpoint_manager", super().init_checkpoint_manager)

    def init_fault_tolerance(self):
        self._record("init_fault_tolerance", super().init_fault_tolerance)

    def init_garbage_collection(self):
        self._record("init_garbage_collection", super().init_garbage_collection)

    def set_seed(self, seed=None, bias=None):
        return self._record("set_seed", super().set_seed, seed, bias)

    def set_deterministic(self):
        self._record("set_deterministic", super().set_deterministic)

    def _init_logging(self):
        self._record("_init_logging", super()._init_logging)

    def init_tensorboard(self, *args, **kwargs):
        self.calls.append("init_tensorboard")

    def init_wandb(self, *args, **kwargs):
        self.calls.append("init_wandb")

    def init_signal_handlers(self):
        self._record("init_signal_handlers", super().init_signal_handlers)

    def init_heartbeat(self):
        self._record("init_heartbeat", super().init_heartbeat)

    def __post_init__(self):
        self.calls.append(("__post_init__", self.model is not None, "val" in self.dataloaders))
        super().__post_init__()

    def auto_restore(self):
        self._record("auto_restore", super().auto_restore)


class ListTracker(Tracker):
    def __init__(self):
        self.logged = []

    def log(self, result, step):
        self.logged.append((step, dict(result)))


# ---------------------------------------------------------------------------------- lifecycle


def test_hook_order(make_runner):
    runner = make_runner(RecordingRunner, deterministic=True, tensorboard=True, **{"wandb.enabled": True})
    assert runner.calls == [
        "init_distributed",
        "init_checkpoint_manager",
        "init_fault_tolerance",
        "init_garbage_collection",
        "set_seed",
        "set_deterministic",
        "_init_logging",
        "init_tensorboard",
        "init_wandb",
        "init_signal_handlers",
        "init_heartbeat",
        "subclass __init__ done",
        ("__post_init__", True, True),  # runs after the whole subclass __init__
        "set_seed",  # again, with the data rank added, now that the model is built
        "auto_restore",
    ]
    assert (runner.workspace.path / "metadata.json").is_file()


def test_optional_hooks_are_skipped_when_disabled(make_runner):
    calls = make_runner(RecordingRunner).calls
    assert "set_deterministic" not in calls and "init_tensorboard" not in calls and "init_wandb" not in calls


def test_failed_construction_restores_process_state(tmp_path):
    class Broken(ToyRunner):
        def __init__(self, config):
            super().__init__(config)
            raise RuntimeError("boom")

    before = signal.getsignal(signal.SIGTERM)
    with pytest.raises(RuntimeError, match="boom"):
        Broken(toy_config(tmp_path))
    assert signal.getsignal(signal.SIGTERM) is before


def test_config_is_normalized_and_validated(make_runner, tmp_path):
    runner = make_runner()
    assert isinstance(runner.config, RunnerConfig)
    assert runner.state.config is runner.config
    with pytest.raises(ValueError, match="accum_steps"):
        ToyRunner(toy_config(tmp_path, accum_steps=0))
    with pytest.raises(TypeError, match="RunnerConfig or a mapping"):
        ToyRunner(["epochs", 3])


def test_fault_tolerance_needs_a_backend(tmp_path):
    with pytest.raises(ValueError, match="fault-tolerance"):
        ToyRunner(toy_config(tmp_path, **{"ft.enabled": True}))


def test_close_restores_signal_handlers_and_is_idempotent(tmp_path):
    before = signal.getsignal(signal.SIGTERM)
    runner = ToyRunner(toy_config(tmp_path))
    assert signal.getsignal(signal.SIGTERM) is not before
    assert runner.close() is True
    assert signal.getsignal(signal.SIGTERM) is before
    assert runner.close() is True


def test_heartbeat_and_gc_pacing_are_wired(make_runner, monkeypatch):
    collections = []
    monkeypatch.setattr(gc, "collect", lambda generation=2: collections.append(generation))
    runner = make_runner(**{"heartbeat.enabled": True, "heartbeat.interval_seconds": 1e-6, "gc.interval": 2})
    runner.train()
    heartbeat = json.loads((runner.workspace.heartbeat_dir / "heartbeat-rank0.json").read_text())
    assert heartbeat["step"] == runner.train_state.global_step == 15
    assert collections == [1] * 7  # global steps 2, 4, ..., 14, generation 1 by default


def test_objects_alive_at_construction_are_frozen_until_close(make_runner):
    """`gc.freeze`: start-up's full collections skip torch's objects; `close` gives them back."""
    gc.unfreeze()  # a runner an earlier test left open keeps its freeze: start from none
    runner = make_runner()
    assert gc.get_freeze_count() > 0
    runner.close()
    assert gc.get_freeze_count() == 0
    runner = make_runner(**{"gc.freeze": False})
    assert gc.get_freeze_count() == 0
    runner.close()
    gc.freeze()  # frozen by someone else: the runner neither adds to it nor undoes it
    try:
        frozen = gc.get_freeze_count()
        runner = make_runner()
        assert 0 < gc.get_freeze_count() <= frozen  # nothing built since was frozen (some frozen ones were freed)
        runner.close()
        assert 0 < gc.get_freeze_count() <= frozen
    finally:
        gc.unfreeze()


def test_tensorboard_receives_every_written_result(make_runner):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    runner = make_runner(tensorboard=True)
    runner.train()
    runner.close()
    events = EventAccumulator(str(runner.workspace.path / "tensorboard"))
    events.Reload()
    assert [event.step for event in events.Scalars("val/loss")] == [5, 10, 15]
    assert [event.value for event in events.Scalars("epoch")] == [0, 1, 2]
    assert events.Scalars("val/loss")[-1].value == pytest.approx(runner.results[2]["val"]["loss"])


def test_wandb_tracker_gets_run_identity(make_runner, monkeypatch):
    created = []

    class FakeWandb(Tracker):
        def __init__(self, **options):
            created.append(options)

    monkeypatch.setattr(tracker_module, "WandbTracker", FakeWandb)
    runner = make_runner(**{"wandb.enabled": True, "wandb.tags": "smoke", "wandb.mode": "offline"})
    (options,) = created
    assert options["project"] == runner.workspace.lineage and options["name"] == runner.id
    assert options["group"] == runner.workspace.experiment and options["tags"] == ["smoke"]
    assert options["mode"] == "offline" and options["config"]["epochs"] == 3
    assert isinstance(runner.trackers.trackers[0], FakeWandb)


# ---------------------------------------------------------------------------------- properties


def test_process_properties(make_runner, monkeypatch):
    runner = make_runner()
    assert (runner.rank, runner.world_size, runner.local_rank) == (0, 1, 0)
    assert runner.is_main_process and runner.is_local_main_process and not runner.distributed
    monkeypatch.setenv("RANK", "3")
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("LOCAL_RANK", "1")
    assert (runner.rank, runner.world_size, runner.local_rank) == (3, 4, 1)
    assert runner.distributed and not runner.is_main_process and not runner.is_local_main_process
    assert runner.id == runner.workspace.id and runner.config_id == runner.config.config_id


def test_budget_properties(make_runner):
    runner = make_runner(accum_steps=2)
    assert not runner.is_step_mode and runner.epochs == 3
    assert runner.steps == 3 * math.ceil(len(TRAIN) / 2)  # derived from the train loader
    assert runner.progress == 0.0
    runner.train_state.global_step = 3
    assert runner.progress == pytest.approx(3 / 9)
    runner.steps = 6
    assert runner.config.steps == 6 and runner.progress == 0.5
    runner.epochs = None
    assert runner.is_step_mode
    with pytest.raises(ValueError, match="epochs"):
        runner.epochs = -1


def test_interval_and_batch_size_properties(make_runner):
    runner = make_runner()
    assert runner.checkpoint_interval == 1 and runner.log_interval == 1  # 5 batches // 10 -> at least 1
    with pytest.raises(ValueError, match="batch size"):
        runner.batch_size  # noqa: B018
    runner.config.dataloader.batch_size = 4
    assert runner.batch_size == 4
    step_runner = make_runner(epochs=None, steps=50, log_interval=7, experiment="steps")
    assert step_runner.checkpoint_interval == 5 and step_runner.log_interval == 7


def test_split_inference(make_runner):
    runner = make_runner()
    runner.datasets["train_extra"] = [1.0]
    runner.datasets["test"] = [1.0]
    assert runner.train_splits == ["train_extra", "train"]
    assert runner.evaluate_splits == ["test", "val"]  # `infer` is neither
    runner.config.train_splits = ["train"]
    runner.config.evaluate_splits = ["val"]
    assert (runner.train_splits, runner.evaluate_splits) == (["train"], ["val"])


def test_config_derived_settings(make_runner):
    runner = make_runner(precision="bfloat16", max_grad_norm=1.0, skip_nonfinite_grad=True, accum_steps=4)
    assert runner.precision == "bf16" and runner.max_grad_norm == 1.0 and runner.max_grad_value is None
    assert runner.skip_nonfinite_grad is True and runner.accum_steps == 4
    assert runner.patience == math.inf


# ---------------------------------------------------------------------------------- loops


def test_epoch_training_writes_results(make_runner):
    runner = make_runner()
    tracker = ListTracker()
    runner.trackers.append(tracker)
    results = runner.train()
    assert list(results) == [0, 1, 2]
    assert runner.train_state.epoch == 3 and runner.train_state.global_step == 3 * len(TRAIN)
    assert set(results[2]) == {"train", "val"}
    directory = runner.workspace.path
    saved = json.loads((directory / "results.json").read_text())
    assert saved["id"] == runner.id and list(saved["results"]) == ["0", "1", "2"]
    latest = json.loads((directory / "latest.json").read_text())
    assert latest["index"] == 2 and latest["val"]["loss"] == pytest.approx(results[2]["val"]["loss"])
    best = json.loads((directory / "best.json").read_text())
    assert best["index"] == runner.best_index
    # every written row reaches the trackers at the global step (one x-axis with the step logs),
    # carrying its epoch index
    rows = [(step, row) for step, row in tracker.logged if "val/loss" in row]
    assert [step for step, _ in rows] == [5, 10, 15]
    assert [row["epoch"] for _, row in rows] == [0, 1, 2]
    assert rows[-1][1]["val/loss"] == pytest.approx(results[2]["val"]["loss"])


def test_result_files_are_complete_when_train_returns_and_rows_are_snapshots(make_runner):
    # The files are written on a helper thread; train() waits for it before returning.
    runner = make_runner(epochs=2)
    runner.train()
    saved = json.loads((runner.workspace.path / "results.json").read_text())
    assert list(saved["results"]) == ["0", "1"]
    # A row replaced after it was written is converted again, not served from a stale snapshot.
    runner.bookkeeping.append({"val": {"loss": 123.0}}, 1)
    runner._save_result()
    runner.bookkeeping.flush()
    saved = json.loads((runner.workspace.path / "results.json").read_text())
    assert saved["results"]["1"] == {"val": {"loss": 123.0}}


def test_a_failed_result_write_is_not_silent(make_runner):
    runner = make_runner(epochs=1)
    (runner.workspace.path / "latest.json").mkdir(parents=True)  # os.replace cannot put a file there
    with pytest.raises(OSError, match="latest.json"):
        runner.train()


def test_step_logs_follow_log_interval(make_runner, caplog):
    runner = make_runner(epochs=1, log_interval=2)
    tracker = ListTracker()
    runner.trackers.append(tracker)
    with caplog.at_level("INFO", logger="danling"):
        runner.train()
    step_logs = [step for step, row in tracker.logged if "train_step/loss" in row]
    assert step_logs == [2, 4, 5]  # every 2 iterations, plus the last one of the split
    assert any(record.getMessage().startswith("train [2/5]") for record in caplog.records)


def test_gradient_accumulation_flushes_partial_window(make_runner):
    runner = make_runner(epochs=2, accum_steps=2)
    runner.train()
    assert runner.train_state.micro_step == 2 * len(TRAIN)
    assert runner.train_state.global_step == 2 * math.ceil(len(TRAIN) / 2)


def test_step_mode(make_runner):
    runner = make_runner(epochs=None, steps=7, evaluate_interval=0)  # 0: evaluate after the last step only
    results = runner.train()
    assert runner.train_state.global_step == 7
    assert runner.train_state.epoch == 1  # one full round over the 5-batch train split
    assert list(results) == [7]
    assert set(results[7]) == {"train", "val"}
    assert runner.checkpoint_manager.latest.name == "step-000007"


def test_step_mode_without_progress_fails_clearly(make_runner):
    class Lazy(ToyRunner):
        def train_step(self, data):
            return data, None

    with pytest.raises(RuntimeError, match="self.step"):
        make_runner(Lazy, epochs=None, steps=3).train()


def test_early_stop_with_patience(make_runner):
    class Worsening(ToyRunner):
        def evaluate_step(self, data):
            return None, float(self.train_state.epoch)  # validation loss grows every epoch

    runner = make_runner(Worsening, epochs=10, patience=1)
    runner.train()
    assert list(runner.results) == [0, 1, 2]
    assert runner.best_index == 0 and runner.train_state.epoch == 3


def test_train_rejects_unknown_or_missing_splits(make_runner):
    runner = make_runner()
    with pytest.raises(ValueError, match="nope"):
        runner.train(["nope"])
    del runner.dataloaders["train"]
    with pytest.raises(ValueError, match="no training split"):
        runner.train()


def test_evaluate_and_evaluate_steps(make_runner):
    runner = make_runner()
    result = runner.evaluate()
    expected = sum(v * v for v in VAL) / len(VAL)  # the weight is still 0
    assert result["val"]["loss"] == pytest.approx(expected)
    assert runner.mode is RunnerMode.evaluate
    assert runner.evaluate_steps("val", 1)["loss"] == pytest.approx(VAL[0] ** 2)
    with pytest.raises(ValueError, match="ran out"):
        runner.evaluate_steps("val", 3)
    with pytest.raises(ValueError, match="non-negative"):
        runner.evaluate_steps("val", -1)


def test_infer(make_runner):
    runner = make_runner()
    assert runner.infer() == [0.5, 1.5, 2.5]
    assert runner.infer(steps=2) == [0.5, 1.5]
    assert [batch for batch in runner.infer(stream=True)] == [[0.5], [1.5], [2.5]]
    runner.dataloaders["stream"] = iter([1.0, 2.0])
    assert list(runner.infer("stream")) == [[1.0], [2.0]]  # unsized loaders stream by default
    runner.dataloaders["stream"] = iter([1.0, 2.0])
    with pytest.raises(ValueError, match="no length"):
        runner.infer("stream", stream=False)
    with pytest.raises(ValueError, match="non-negative"):
        runner.infer(steps=-1)


class NoRestoreRunner(ToyRunner):
    """A BaseRunner subclass that leaves `auto_restore()` out of its construction."""

    def __post_init__(self) -> None:
        BaseRunner.__post_init__(self)


def test_train_restores_what_the_config_asks_when_construction_did_not(tmp_path):
    first = NoRestoreRunner(toy_config(tmp_path, epochs=2))
    first.train()
    first.close()
    checkpoints = first.workspace.path / "checkpoints"
    saved = {path.name: (path / "state.pt").read_bytes() for path in checkpoints.glob("epoch-*")}
    runner = NoRestoreRunner(toy_config(tmp_path, epochs=3, auto_resume=True))
    assert runner.workspace.path == first.workspace.path and runner.train_state.epoch == 0
    runner.train()  # continues the run: epoch 3 only, the earlier checkpoints stay as they were
    assert (runner.workspace.path / ".lock").is_file()
    runner.close()
    assert sorted(runner.results) == [0, 1, 2] and runner.train_state.epoch == 3
    assert {name: (checkpoints / name / "state.pt").read_bytes() for name in saved} == saved
    launches = json.loads((first.workspace.path / "metadata.json").read_text())["launches"]
    assert [launch["epochs"] for launch in launches] == [2, 3]


def test_step_hooks_must_be_implemented(tmp_path):
    with BaseRunner(toy_config(tmp_path)) as runner:
        runner.dataloaders["train"] = [1.0]
        with pytest.raises(NotImplementedError, match="train_step"):
            runner.train()


# ---------------------------------------------------------------------------------- results


def test_best_score_bookkeeping(make_runner):
    runner = make_runner()
    assert runner.is_best and runner.latest_result is None and runner.best_result is None
    for index, loss in enumerate([0.5, 0.3, 0.4]):
        runner.bookkeeping.append({"train": {"loss": 9.0}, "val": {"loss": loss, "acc": 1 - loss}}, index)
    assert runner.score_split == "val" and runner.scores.dict() == {0: 0.5, 1: 0.3, 2: 0.4}
    assert (runner.best_index, runner.best_score, runner.latest_score) == (1, 0.3, 0.4)
    assert not runner.is_best
    assert runner.latest_result["index"] == 2 and runner.best_result["index"] == 1
    runner.config.score_name = "acc"  # higher is better for non-loss names
    assert runner.best_index == 1 and runner.best_score == pytest.approx(0.7)
    runner.bookkeeping.append({"val": {"loss": 0.1, "acc": 0.9}}, 3)
    assert runner.is_best


def test_result_rows_are_copies_and_scores_resolve_plain_and_dotted_names(make_runner):
    runner = make_runner()
    source = {"val": {"loss": 0.5, "acc": 0.5}}
    runner.bookkeeping.append(source, 0)
    source["val"]["loss"] = 99.0  # the stored row is a copy
    row = runner.results[0]
    assert type(row) is RoundDict and type(row["val"]) is RoundDict and row.val.loss == 0.5
    runner.bookkeeping.append({"val": {"loss": 0.2, "acc": 0.1}}, 1)
    assert runner.scores.dict() == {0: 0.5, 1: 0.2} and runner.best_index == 1
    runner.config.score_name = "acc"
    assert runner.best_index == 0
    # A dotted score name reads nested metrics through the mapping's own path lookup.
    runner.bookkeeping.append({"val": {"head": {"acc": 0.75}}}, 2)
    runner.config.score_name = "head.acc"
    assert runner.scores.dict() == {2: 0.75} and runner.is_best


def test_is_best_is_false_without_a_resolvable_score(make_runner):
    runner = make_runner()
    runner.bookkeeping.append({"note": "no split metrics"}, 0)
    assert runner.scores is None and runner.is_best is False


def test_format_helpers(make_runner):
    runner = make_runner()
    row = {"train": {"loss": 0.123456}, "val": {"loss": 0.5}}
    assert runner.bookkeeping.format_result(row) == "train: loss: 0.1235\nval: loss: 0.5000"
    # one line per split, each carrying the epoch, so every line can be found with grep; row 1 of
    # 3 epochs is the second epoch, numbered from 1 as the progress bar numbers it
    assert runner.bookkeeping.format_epoch_result(row, 1, runner.epochs).splitlines() == [
        "epoch [2/3] train: loss: 0.1235",
        "epoch [2/3] val: loss: 0.5000",
    ]
    assert runner.bookkeeping.format_step_result({"loss": 0.25}, "train", 3, 10) == "train [3/10]\tloss: 0.2500"


# ---------------------------------------------------------------------------------- seeding


def test_set_seed_biases_by_rank(make_runner, monkeypatch):
    runner = make_runner()
    assert runner.set_seed(5) == 5
    first = random.random()
    runner.set_seed(5)
    assert random.random() == first
    monkeypatch.setenv("RANK", "2")
    monkeypatch.setenv("WORLD_SIZE", "4")
    assert runner.set_seed(5) == 7 and runner.set_seed(5, bias=False) == 5 and runner.set_seed(5, bias=10) == 15


def test_missing_seed_is_drawn_and_recorded(tmp_path):
    with ToyRunner(toy_config(tmp_path, seed=None)) as runner:
        assert isinstance(runner.config.seed, int)


# ---------------------------------------------------------------------------------- processes


def _train_on_rank(rank, world_size, root):
    # Each rank gets its own workspace root, so anything a non-main rank writes is visible.
    with ToyRunner(toy_config(f"{root}/rank{rank}", epochs=2)) as runner:
        runner.train()
        return {
            "main": runner.is_main_process,
            "world_size": runner.world_size,
            "seed": runner.set_seed(),
            "epoch": runner.train_state.epoch,
        }


@pytest.mark.distributed
def test_only_the_main_process_writes(tmp_path):
    reports = run_distributed(_train_on_rank, str(tmp_path), world_size=2)
    assert [r["main"] for r in reports] == [True, False]
    assert [r["seed"] for r in reports] == [7, 8]  # per-rank bias
    assert all(r["world_size"] == 2 and r["epoch"] == 2 for r in reports)
    written = {path.name for path in (tmp_path / "rank0").rglob("*")}
    assert {"results.json", "latest.json", "best.json", "metadata.json", "epoch-000001"} <= written
    assert not (tmp_path / "rank1").exists()


def test_standalone_evaluate_logs_at_the_global_step(make_runner):
    # Every tracker log shares the global-step axis; W&B drops a step lower than one it has seen.
    runner = make_runner()
    tracker = ListTracker()
    runner.trackers.append(tracker)
    runner.train()
    runner.evaluate()
    steps = [step for step, _ in tracker.logged]
    assert steps == sorted(steps) and steps[-1] == runner.train_state.global_step


def test_close_with_timeout_reports_a_stalled_save_which_still_completes(tmp_path):
    release = threading.Event()

    class StalledWriter(HashingWriter):
        def write(self, data):
            release.wait()
            return super().write(data)

    class StalledManager(FileCheckpointManager):
        def _payload_stream(self, raw):
            return StalledWriter(raw)

    with TinyRunner(tiny_config(tmp_path / "run")) as runner:
        manager = StalledManager(tmp_path / "checkpoints", async_save=True)
        runner.set_checkpoint_manager(manager)
        expected = model_state(runner)
        runner.save_checkpoint(force=True)
        try:
            with pytest.warns(RuntimeWarning, match="still running"):
                assert runner.close(timeout=0) is False  # the write is stuck: not drained
        finally:
            release.set()
    assert manager.wait()  # the abandoned write finished in the background
    payload = FileCheckpointManager(tmp_path / "checkpoints").load("latest")
    assert payload["model"].keys() == expected.keys()
    for key, value in expected.items():
        assert torch.equal(payload["model"][key], value)


def test_split_lists_are_deduplicated(tmp_path):
    overrides = {"train_splits": ["train", "train"], "evaluate_splits": ["val", "val", "infer", "val"], "epochs": 1}
    with ToyRunner(toy_config(tmp_path, **overrides)) as runner:
        assert runner.train_splits == ["train"] and runner.evaluate_splits == ["val", "infer"]
        assert runner._resolve_splits(["val", "val"], [], "evaluate") == ["val"]
        runner.train()
        assert runner.train_state.global_step == 5  # one pass over the 5 training items, not two


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
