"""A tiny pure-Python runner used by the BaseRunner/Runner tests and the shutdown child process.

`ToyRunner` fits one scalar weight to its data with SGD. The update draws from Python's `random`
module, so a resumed run only matches an uninterrupted one if the RNG state is restored too.
"""

from __future__ import annotations

import random
from typing import Any

from danling.runners import BaseRunner

TRAIN = [1.0, 2.0, 3.0, 4.0, 5.0]
VAL = [2.5, 3.5]


class ScalarModel:
    """A one-parameter model with the `state_dict` / `load_state_dict` protocol."""

    def __init__(self, weight: float = 0.0) -> None:
        self.weight = weight

    def state_dict(self) -> dict[str, float]:
        return {"weight": self.weight}

    def load_state_dict(self, state: dict[str, float]) -> None:
        self.weight = float(state["weight"])


class ToyRunner(BaseRunner):
    lr = 0.1

    def __init__(self, config: Any) -> None:
        super().__init__(config)
        self.model = ScalarModel()
        self.grad = 0.0
        self.dataloaders["train"] = list(TRAIN)
        self.dataloaders["val"] = list(VAL)
        self.dataloaders["infer"] = [0.5, 1.5, 2.5]

    def __post_init__(self) -> None:
        super().__post_init__()
        self.auto_restore()  # restore at construction, as the backend runners do

    def train_step(self, data: float) -> tuple[float, float]:
        error = self.model.weight - data
        self.grad += 2 * error / self.accum_steps
        self.step()
        return self.model.weight, error * error

    def optimizer_step(self) -> bool:
        self.model.weight -= self.lr * self.grad + random.gauss(0.0, 0.01)
        self.grad = 0.0
        return super().optimizer_step()

    def evaluate_step(self, data: float) -> tuple[float, float]:
        error = self.model.weight - data
        return self.model.weight, error * error

    def infer_step(self, data: float) -> list[float]:
        return [self.model.weight + data]

    def state_dict(self, cls: type = dict) -> Any:
        payload = super().state_dict(cls)
        payload["model"] = self.model.state_dict()
        return payload


def toy_config(root: Any, **overrides: Any) -> dict[str, Any]:
    """Config for a ToyRunner under `root`: 3 epochs, seeded, synchronous checkpoints."""
    config = {"workspace_root": str(root), "epochs": 3, "seed": 7, "checkpoint.async_enabled": False}
    config.update(overrides)
    return config
