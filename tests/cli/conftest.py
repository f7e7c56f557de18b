"""Runs the CLI tests look at: tiny TorchRunners trained for 2 epochs (about a second each)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.runners._torch_toy import TinyRunner, tiny_config


def train(root: Path, **overrides) -> Path:
    """Train a TinyRunner into `root` and return its run directory."""
    runner = TinyRunner(tiny_config(root, **overrides))
    try:
        runner.train()
    finally:
        runner.close()
    return runner.workspace.path


@pytest.fixture(scope="session")
def workspace(tmp_path_factory) -> dict[str, Path]:
    """A workspace root with two finished runs that differ in learning rate, and a DCP run elsewhere."""
    root = tmp_path_factory.mktemp("workspace")
    runs = {
        "root": root,
        "a": train(root, experiment="base", **{"heartbeat.enabled": True}),
        "b": train(root, experiment="highlr", **{"optim.lr": 0.05}),
        "dcp": train(tmp_path_factory.mktemp("dcp"), experiment="dcp", **{"checkpoint.backend": "dcp"}),
    }
    return runs
