"""Inputs that used to train silently wrong or fail obscurely get a clear error or warning."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.utils.data import TensorDataset

from danling.checkpoint import CheckpointError
from danling.runners import RunnerConfig
from tests.runners._torch_toy import TinyRunner, tiny_config
from tests.runners._toy import ToyRunner, toy_config


def test_missing_score_split_fails_at_first_evaluation_listing_splits(tmp_path):
    with ToyRunner(toy_config(tmp_path, score_split="validation")) as runner:
        with pytest.raises(ValueError, match=r"score_split 'validation'.*available splits: \['train', 'val'\]"):
            runner.train()
        assert runner.train_state.epoch == 0  # refused at the first row, not after the whole run


def test_missing_score_name_fails_when_set_and_warns_by_default(tmp_path, caplog):
    pattern = r"score_name 'acc'.*split 'val'.*available metrics: \['loss'\]"
    with ToyRunner(toy_config(tmp_path / "a", score_name="acc")) as runner, pytest.raises(ValueError, match=pattern):
        runner.train()

    class NoLoss(ToyRunner):
        def evaluate_step(self, data):
            return self.model.weight, None  # no loss: the row has no 'loss' metric

    with caplog.at_level(logging.WARNING), NoLoss(toy_config(tmp_path / "b", epochs=1)) as runner:
        runner.evaluate_epoch = lambda split="val": {"acc": 0.5}
        runner.train()
    assert any("score_name 'loss'" in r.getMessage() and "['acc']" in r.getMessage() for r in caplog.records)


def test_zero_epochs_is_refused(tmp_path):
    with (
        ToyRunner(toy_config(tmp_path, epochs=0)) as runner,
        pytest.raises(ValueError, match=r"epochs=0 trains nothing"),
    ):
        runner.train()


def test_steps_with_epochs_is_logged(tmp_path, caplog):
    with caplog.at_level(logging.WARNING), ToyRunner(toy_config(tmp_path, epochs=1, steps=100)) as runner:
        runner.train()
    assert any("steps=100 and epochs=1" in r.getMessage() for r in caplog.records)


@pytest.mark.parametrize(
    ("n_train", "overrides", "message"),
    [
        (0, {}, "its dataset is empty"),
        (
            3,
            {"dataloader.drop_last": True},
            r"its dataset has 3 samples and batch_size=4 with drop_last=True.*batch_size <= 3",
        ),
    ],
)
def test_training_data_that_yields_no_batch_is_refused_before_the_first_step(tmp_path, n_train, overrides, message):
    class Small(TinyRunner):
        pass

    Small.n_train = n_train
    with Small(tiny_config(tmp_path, **overrides)) as runner:
        with pytest.raises(ValueError, match=rf"training split 'train' yields no batch: {message}"):
            runner.train()
        assert runner.train_state.global_step == 0


def test_list_valued_cli_keys_arrive_typed_without_warnings():
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # an "Unrecognized argument" warning fails the test
        config = RunnerConfig().parse(
            [
                "--optim.type",
                "adamw",
                "--optim.betas",
                "0.9",
                "0.99",
                "--scheduler.type",
                "cosine",
                "--optim.lr",
                "1e-3",
            ]
        )
    assert config.optim.betas == [0.9, 0.99] and config.scheduler.type == "cosine" and config.optim.lr == 0.001


def test_truncated_plain_checkpoint_names_the_file(tmp_path):
    path = tmp_path / "weights.pt"
    torch.save({"model": {"w": torch.ones(64)}}, path)
    path.write_bytes(path.read_bytes()[:100])
    with pytest.raises(CheckpointError, match=r"weights\.pt is truncated or corrupt"):
        TinyRunner(tiny_config(tmp_path / "run", pretrained=str(path)))


def test_labels_out_of_range_name_the_range_and_split(tmp_path):
    class Classifier(TinyRunner):
        def __init__(self, config):
            super().__init__(config)
            self.model = nn.Linear(4, 3)
            self.criterion = nn.CrossEntropyLoss()
            self.datasets.train = TensorDataset(torch.randn(8, 4), torch.tensor([0, 1, 2, 3, 0, 1, 2, 0]))
            self.datasets.val = TensorDataset(torch.randn(4, 4), torch.tensor([0, 1, 2, 0]))

    pattern = r"labels out of range on split 'train'.*\[0, 2\].*3 classes.*0 to 3"
    with Classifier(tiny_config(tmp_path)) as runner, pytest.raises(ValueError, match=pattern):
        runner.train()


def test_an_empty_evaluation_split_is_refused_instead_of_giving_nan_rows(tmp_path):
    class EmptyVal(TinyRunner):
        def __init__(self, config):
            super().__init__(config)
            self.datasets.val = TensorDataset(torch.zeros(0, 4), torch.zeros(0, 1))

    with EmptyVal(tiny_config(tmp_path, epochs=1)) as runner:
        with pytest.raises(ValueError, match=r"evaluation split 'val' yields no batch: its dataset is empty"):
            runner.train()
        assert not runner.results  # refused before the first step, not after a row of NaN


@pytest.mark.parametrize(("key", "value"), [("timeout_seconds", -1), ("interval_seconds", 0)])
def test_a_watchdog_time_that_cannot_work_is_refused_in_a_single_process_too(tmp_path, key, value):
    refused = pytest.raises(ValueError, match=rf"watchdog\.{key} must be .*got {value}")
    with ToyRunner(toy_config(tmp_path, **{f"watchdog.{key}": value})) as runner, refused:
        runner.train()


_FAILING_SCRIPT = """
import sys
from tests.runners._toy import ToyRunner, toy_config
with ToyRunner(toy_config(sys.argv[1], epochs=0, log=True)) as runner:
    print(runner.workspace.log_file, flush=True)
    runner.train()
"""


@pytest.mark.parametrize("debug", [False, True])
def test_a_user_error_is_one_line_on_stderr_and_its_traceback_goes_to_the_run_log(tmp_path, debug):
    env = {key: value for key, value in os.environ.items() if key != "DANLING_DEBUG"}
    if debug:
        env["DANLING_DEBUG"] = "1"
    repo = Path(__file__).resolve().parents[2]
    done = subprocess.run(
        [sys.executable, "-c", _FAILING_SCRIPT, str(tmp_path)], cwd=repo, env=env, capture_output=True, text=True
    )
    assert done.returncode == 1
    log = Path(done.stdout.split()[0])
    errors = [line for line in done.stderr.splitlines() if "| INFO " not in line and "| WARNING " not in line]
    if debug:
        assert errors[0] == "Traceback (most recent call last):", done.stderr
    else:
        assert errors == [
            f"-c: error: ValueError: epochs=0 trains nothing: set epochs to a positive int (or call evaluate()) "
            f"(traceback in {log}; DANLING_DEBUG=1 prints it here)"
        ]
    kept = log.read_text()
    assert "the run ended with an exception" in kept and "Traceback (most recent call last)" in kept


def test_debug_on_the_command_line_of_a_parsed_script_prints_the_traceback(tmp_path):
    # `--debug` used to reach parse() as an unknown key: the flag the one-line error offers could not be given.
    script = "import sys\nimport danling as dl\nfrom tests.runners._toy import ToyRunner, toy_config\n"
    script += "config = dl.RunnerConfig(**toy_config(sys.argv[1], epochs=0)).parse(sys.argv[2:])\n"
    script += "ToyRunner(config).train()"
    env = {key: value for key, value in os.environ.items() if key != "DANLING_DEBUG"}
    repo = Path(__file__).resolve().parents[2]
    for extra, traceback in (([], False), (["--debug"], True)):
        command = [sys.executable, "-c", script, str(tmp_path), "--seed", "1", *extra]
        done = subprocess.run(command, cwd=repo, env=env, capture_output=True, text=True)
        assert done.returncode == 1 and "epochs=0 trains nothing" in done.stderr, done.stderr
        assert ("Traceback (most recent call last):" in done.stderr) is traceback, done.stderr


def test_a_scheduler_that_needs_a_length_without_a_budget_says_to_set_one(tmp_path):
    config = tiny_config(tmp_path, epochs=None, **{"scheduler.type": "cosine"})
    with pytest.raises(
        ValueError, match=r"scheduler 'cosine' needs the run length, but this run has no length: set epochs .* or steps"
    ):
        TinyRunner(config)


@pytest.mark.parametrize("root", ["file", "read-only"])
def test_a_workspace_root_that_cannot_hold_runs_names_it(tmp_path, root):
    if root == "file":
        path = tmp_path / "not-a-directory"
        path.write_text("")
    else:
        if os.geteuid() == 0:
            pytest.skip("root writes into read-only directories")
        path = tmp_path / "read-only"
        path.mkdir(mode=0o500)
    with pytest.raises(OSError, match=rf"cannot create the run directory .*workspace_root \(now '{path}'\)"):
        TinyRunner(tiny_config(path))


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


def test_a_metric_that_is_nan_from_out_of_range_labels_warns_once(tmp_path, caplog):
    from danling.metrics import StreamMetrics
    from danling.metrics.functional import accuracy

    class OutOfRange(TinyRunner):
        def __init__(self, config):
            super().__init__(config)
            self.model = nn.Sequential(nn.Linear(4, 3))
            self.criterion = nn.CrossEntropyLoss(ignore_index=5)  # the loss skips label 5; accuracy cannot
            x = torch.randn(8, 4)
            self.datasets.train = TensorDataset(x, torch.zeros(8, dtype=torch.long))
            self.datasets.val = TensorDataset(x, torch.full((8,), 5))  # class 5 of 3
            self.evaluate_metrics = StreamMetrics(acc=accuracy)

    with caplog.at_level(logging.WARNING), OutOfRange(tiny_config(tmp_path, epochs=2)) as runner:
        runner.train()
    assert runner.results[1]["val"]["acc"] != runner.results[1]["val"]["acc"]  # NaN, as documented
    warnings = [r.getMessage() for r in caplog.records if "metric 'acc' of split 'val' is NaN" in r.getMessage()]
    assert len(warnings) == 1 and "outside [0, num_classes)" in warnings[0]  # once, over both epochs


def test_an_error_before_the_run_log_exists_is_one_line_too(tmp_path):
    script = "import sys\nfrom tests.runners._toy import ToyRunner, toy_config\n"
    script += "ToyRunner(toy_config(sys.argv[1], resume=sys.argv[2]))"  # fails while choosing the run directory
    missing = tmp_path / "no-such-run"
    env = {key: value for key, value in os.environ.items() if key != "DANLING_DEBUG"}
    command = [sys.executable, "-c", script, str(tmp_path), str(missing)]
    repo = Path(__file__).resolve().parents[2]
    done = subprocess.run(command, cwd=repo, env=env, capture_output=True, text=True)
    assert done.returncode == 1 and done.stderr.count("\n") == 1, done.stderr
    assert done.stderr.startswith(f"-c: error: CheckpointNotFoundError: cannot resume from '{missing}'")


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
