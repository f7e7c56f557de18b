"""Classify 8x8 handwritten digits with a `TorchRunner`: the script to copy for your own task.

The data is scikit-learn's bundled digits set (1797 images, nothing to download). The script
shows the whole user-facing surface of danling in one file:

- a typed config (`DigitsConfig`) whose defaults come from the class, `demo/digits.yaml` and
  the command line, in that order of precedence (last wins);
- a runner (`DigitsRunner`) that only says *what* to train: model, loss, datasets, metrics;
- `train()`, `evaluate()` and `infer()`, with checkpoints, results and TensorBoard logs
  written to the run directory.

Examples:
    python demo/digits.py --config demo/digits.yaml
    python demo/digits.py --config demo/digits.yaml --optim.lr 0.003 --hidden 128
    python demo/digits.py --config demo/digits.yaml --resume <run dir>/checkpoints/epoch-000009

`demo/run.py` (what `make demo` runs) drives this script end to end, including a resume.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence
from typing import Any

import torch
from sklearn.datasets import load_digits
from torch import nn
from torch.utils.data import TensorDataset

import danling as dl

NUM_CLASSES = 10


class DigitsConfig(dl.RunnerConfig):
    """Settings of the digits run; every key can be overridden from YAML or the command line.

    Attributes:
        hidden: Width of the two hidden layers of the MLP.
        dropout: Dropout probability after each hidden layer.
        val_fraction: Share of the images held out for validation (model selection).
        test_fraction: Share held out for the final inference pass; its labels never reach the runner.
        split_seed: Seed of the train/val/test shuffle, separate from `seed` so that changing the
            training seed keeps the same split.
        threads: Intra-op CPU threads for torch (`torch.set_num_threads`). A model this small
            gains nothing from more, and on a busy machine extra threads mostly wait on each other.
    """

    epochs: int = 20
    hidden: int = 256
    dropout: float = 0.1
    val_fraction: float = 0.15
    test_fraction: float = 0.15
    split_seed: int = 0
    threads: int = 1

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__()
        # Defaults for sections the base config leaves open; YAML and CLI values override them.
        self.optim.type = "adamw"
        self.optim.lr = 1e-2
        self.optim.weight_decay = 1e-4
        self.dataloader.batch_size = 32
        self.score_name = "acc"
        if args or kwargs:
            self.merge(*args, **kwargs)

    def post(self) -> None:
        super().post()
        if not 0 < self.val_fraction + self.test_fraction < 1:
            raise ValueError(
                f"val_fraction + test_fraction must lie in (0, 1), got {self.val_fraction} + {self.test_fraction}"
            )


def split_digits(val_fraction: float, test_fraction: float, seed: int) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """Load the digits, scale pixels to [0, 1] and shuffle them into train/val/test tensors."""
    digits = load_digits()
    images = torch.tensor(digits.data, dtype=torch.float32) / 16.0
    labels = torch.tensor(digits.target, dtype=torch.long)
    order = torch.randperm(len(images), generator=torch.Generator().manual_seed(seed))
    n_val, n_test = round(len(images) * val_fraction), round(len(images) * test_fraction)
    parts = {"val": order[:n_val], "test": order[n_val : n_val + n_test], "train": order[n_val + n_test :]}
    return {name: (images[index], labels[index]) for name, index in parts.items()}


def build_model(hidden: int, dropout: float) -> nn.Module:
    """A two-hidden-layer MLP over the 64 pixels."""
    return nn.Sequential(
        nn.Linear(64, hidden),
        nn.ReLU(),
        nn.Dropout(dropout),
        nn.Linear(hidden, hidden),
        nn.ReLU(),
        nn.Dropout(dropout),
        nn.Linear(hidden, NUM_CLASSES),
    )


class DigitsRunner(dl.TorchRunner):
    """Binds model, loss, data and metrics; the runner supplies loops, checkpoints and logging."""

    def __init__(self, config: DigitsConfig) -> None:
        super().__init__(config)
        splits = split_digits(config.val_fraction, config.test_fraction, config.split_seed)
        self.datasets.train = TensorDataset(*splits["train"])
        self.datasets.val = TensorDataset(*splits["val"])
        # The infer split has images only: batches are `[images]`, so there is no target to leak.
        self.datasets.infer = TensorDataset(splits["test"][0])
        self.test_labels = splits["test"][1]
        self.model = build_model(config.hidden, config.dropout)
        self.criterion = nn.CrossEntropyLoss()
        self.metrics = dl.multiclass_metrics(num_classes=NUM_CLASSES, metrics=["acc", "f1"])

    @torch.inference_mode()
    def infer_step(self, data: Any) -> list[int]:
        # The default returns one float per example; a classifier should return the predicted class.
        images = self.to_device(dl.split_batch(data)[0])
        with self.forward_context():
            logits = (self.ema if self.ema is not None else self.model)(images)
        return logits.argmax(dim=-1).tolist()


def describe_outputs(runner: DigitsRunner) -> str:
    """Where this run keeps what it wrote, for printing."""
    run_dir = runner.dir
    lines = [
        f"run directory   {run_dir}",
        f"results         {os.path.join(run_dir, 'results.json')}  (plus latest.json, best.json)",
        f"checkpoints     {runner.workspace.checkpoint_dir}  (aliases: latest, best)",
    ]
    if runner.config.log:
        lines.append(f"log file        {runner.workspace.log_file}")
    if runner.config.tensorboard:
        tensorboard = os.path.join(run_dir, "tensorboard")
        lines.append(f"tensorboard     {tensorboard}  (view: tensorboard --logdir {tensorboard})")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    """Train (or resume), evaluate on `val`, predict the held-out test images; return a summary."""
    config = DigitsConfig().parse(list(sys.argv[1:] if argv is None else argv))
    torch.set_num_threads(config.threads)
    with DigitsRunner(config) as runner:
        start_epoch = runner.train_state.epoch
        if start_epoch:
            print(f"resumed from {config.resume} at epoch {start_epoch}, global step {runner.train_state.global_step}")
        runner.train()
        val = runner.evaluate(["val"])["val"]
        predictions = runner.infer("infer")
        test_accuracy = (torch.tensor(predictions) == runner.test_labels).float().mean().item()
        print(f"val accuracy {val['acc']:.4f}; test accuracy of the inferred labels {test_accuracy:.4f}")
        print(describe_outputs(runner))
        return {
            "start_epoch": start_epoch,
            "epochs": config.epochs,
            "val": dict(val),
            "test_accuracy": test_accuracy,
            "predictions": predictions,
            "dir": runner.dir,
            "checkpoint_dir": os.fspath(runner.workspace.checkpoint_dir),
            "results": runner.results,
        }


if __name__ == "__main__":
    main()
