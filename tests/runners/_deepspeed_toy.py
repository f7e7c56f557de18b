"""The regression runner and configs shared by the DeepSpeedRunner tests (real DeepSpeed, CPU, gloo).

Importing it sets `DS_ACCELERATOR=cpu` and keeps DeepSpeed's compiled ops in the project's
git-ignored `.torch_extensions/`, so repeated runs reuse the comm op build.
"""

from __future__ import annotations

import os
from pathlib import Path

from torch import nn

from danling.runners import Runner
from tests.runners._torch_toy import make_data, make_model

ROOT = Path(__file__).resolve().parents[2]
os.environ.setdefault("DS_ACCELERATOR", "cpu")
os.environ.setdefault("TORCH_EXTENSIONS_DIR", str(ROOT / ".torch_extensions"))

# ZeRO-3 keeps parameters below this many elements whole on every rank; 0 partitions them all,
# so the toy model really is partitioned.
PARTITIONED = {"stage3_param_persistence_threshold": 0}


class Regression(Runner):
    """Dropout-free MLP regression (16 training samples) that records every micro-step loss.

    `weighted` trains on a per-sample masked loss and passes the number of kept samples as the
    micro-step's weight; `poison = (rank, micro_step)` makes that one micro-step's loss infinite.
    """

    weighted = False
    poison: tuple[int, int] | None = None

    def __init__(self, config):
        super().__init__(config)
        self.model = make_model(0.0)
        self.criterion = nn.MSELoss()
        self.datasets.train = make_data(16, seed=0)
        self.datasets.val = make_data(8, seed=1)
        self.losses = []
        self.micro_steps = 0

    def train_step(self, data):
        if not self.weighted:
            pred, loss = super().train_step(data)
            self.losses.append(loss.item())
            return pred, loss
        x, y = self.to_device(data)
        keep = (x[:, 0] > -0.5).float()  # a data-dependent number of "valid tokens" per micro-batch
        with self.train_context():
            pred = self.model(x)
            loss = (((pred - y) ** 2).squeeze(-1) * keep).sum() / keep.sum().clamp(min=1)
        self.backward(loss, weight=keep.sum())
        self.step()
        self.losses.append(loss.item())
        return pred, loss.detach()

    def backward(self, loss, weight=None):
        self.micro_steps += 1
        if self.poison == (self.rank, self.micro_steps):
            loss = loss * float("inf")
        super().backward(loss, weight)


def ds_config(root, name, stack="deepspeed", stage=None, optim="sgd", **overrides):
    """Two epochs of SGD with momentum (or `optim="adamw"`), batch size 4 per rank, synchronous checkpoints.

    SGD by default: Adam divides by the gradient's magnitude, which turns the last-bit differences
    of another reduction order into visible ones for near-zero gradients. DeepSpeed's universal
    format (a resume on another data-parallel size) holds Adam states only.
    """
    config = {
        "stack": stack,
        "workspace_root": os.path.join(root, name),
        "epochs": 2,
        "seed": 0,
        "log": False,
        "optim.type": optim,
        "optim.lr": 0.01,
        **({"optim.momentum": 0.9} if optim == "sgd" else {}),
        "dataloader.batch_size": 4,
        "checkpoint.async_enabled": False,
    }
    if stage is not None:
        config["deepspeed"] = {"zero_optimization": {"stage": stage, **(PARTITIONED if stage == 3 else {})}}
    config.update(overrides)
    return config


def weights(runner):
    """The module's whole weights on every rank (gathered under ZeRO-3)."""
    gather = getattr(runner, "model_state_dict", None)
    if gather is not None:
        return gather()
    return {key: value.detach().cpu().clone() for key, value in runner.unwrap(runner.model).state_dict().items()}
