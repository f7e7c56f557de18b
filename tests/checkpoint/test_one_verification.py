"""Every backend shares the final `save`/`load`/`load_into` and one verification path on load."""

from __future__ import annotations

import pytest
import torch

from danling.checkpoint import CheckpointError, CheckpointManager, FileCheckpointManager
from danling.checkpoint.dcp import ModelState, TorchDistributedCheckpointManager

from ._files import flip_byte, manifest_of


@pytest.mark.parametrize("name", ["save", "load", "load_into"])
@pytest.mark.parametrize("base", [CheckpointManager, FileCheckpointManager, TorchDistributedCheckpointManager])
def test_a_backend_cannot_override_the_public_entry_points(base, name):
    with pytest.raises(TypeError, match=rf"overrides \['{name}'\] of CheckpointManager, which are final"):
        type("Custom", (base,), {name: lambda self, *args, **kwargs: None})


def test_backends_implement_the_protected_hooks_instead(tmp_path):
    class Upper(FileCheckpointManager):
        def _extend_metadata(self, state, metadata):
            return {**metadata, "keys": sorted(state)}

    path = Upper(tmp_path).save({"a": 1}, "step-000001")
    assert manifest_of(path)["metadata"]["keys"] == ["a"]


def _damaged(manager_type, tmp_path):
    manager = manager_type(tmp_path)
    path = manager.save({"model": {"weight": torch.arange(64.0)}, "state": {"epoch": 1}}, "epoch-000001")
    data = max(manifest_of(path)["files"], key=lambda key: manifest_of(path)["files"][key]["size"])
    flip_byte(path / data, manifest_of(path)["files"][data]["size"] // 2)
    return manager, path, path / data


@pytest.mark.parametrize("manager_type", [FileCheckpointManager, TorchDistributedCheckpointManager])
def test_a_corrupt_checkpoint_is_refused_the_same_way_by_every_backend(tmp_path, manager_type):
    manager, path, damaged = _damaged(manager_type, tmp_path)
    expected = rf"checkpoint file {damaged} is corrupt: its XXH3-128 (of bytes \d+-\d+ )?does not match the manifest"
    with pytest.raises(CheckpointError, match=expected):
        manager.load("latest")
    with pytest.raises(CheckpointError, match=expected):
        manager.load_into("latest", {"model": ModelState(torch.nn.Linear(8, 8))})
    assert manager.latest_valid() is None


@pytest.mark.parametrize("manager_type", [FileCheckpointManager, TorchDistributedCheckpointManager])
def test_a_checkpoint_of_another_backend_is_refused_the_same_way(tmp_path, manager_type):
    other = TorchDistributedCheckpointManager if manager_type is FileCheckpointManager else FileCheckpointManager
    path = other(tmp_path).save({"state": {"epoch": 1}}, "epoch-000001")
    with pytest.raises(
        CheckpointError, match=rf"written by the '{other.backend}' backend; .* reads '{manager_type.backend}'"
    ):
        manager_type(tmp_path, load_only=True).load(path)
