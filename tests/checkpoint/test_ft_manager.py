"""`TorchFTCheckpointManager`: the usual DCP checkpoints, and a replica group's own data position beside them."""

from __future__ import annotations

import pytest
import torch

from danling.checkpoint import TorchFTCheckpointManager
from danling.checkpoint.dcp import ModelState, TorchDistributedCheckpointManager


def _position(batch: int) -> dict:
    return {
        "dataloaders": {"train": {"_num_yielded": batch}},
        "fingerprints": {"train": f"next-{batch}"},
        "position": {"split": "train", "batch": batch, "step": batch},
    }


def test_is_importable_from_the_checkpoint_package_and_is_a_dcp_manager():
    from danling.checkpoint.ft import TorchFTCheckpointManager as direct

    assert direct is TorchFTCheckpointManager
    assert issubclass(TorchFTCheckpointManager, TorchDistributedCheckpointManager)
    assert TorchFTCheckpointManager.backend == "dcp"


def test_each_replica_keeps_its_own_newest_position_beside_the_usual_checkpoints(tmp_path):
    first = TorchFTCheckpointManager(tmp_path / "checkpoints", replica_id="0", keep_latest_k=1)
    second = TorchFTCheckpointManager(tmp_path / "checkpoints", replica_id="1", prefix="mine")
    assert first.replica_directory == tmp_path / "ft-replica-0"
    assert second.replica_directory == tmp_path / "mine-1"
    assert first.load_dataloaders() is None  # a first start: nothing of its own yet
    for batch in (2, 3, 4):
        first.save_dataloaders(_position(batch), batch)
    second.save_dataloaders(_position(7), 7)
    assert first.load_dataloaders() == _position(4)
    assert second.load_dataloaders() == _position(7)
    assert sorted(p.name for p in first.positions.checkpoints()) == ["step-000003", "step-000004"]

    model = torch.nn.Linear(2, 1)
    first.save({"model": ModelState(model), "state": {"epoch": 1}}, "step-000004")
    # The usual checkpoints never list the per-replica directories (they live beside them).
    assert [path.name for path in first.checkpoints()] == ["step-000004"]
    assert first.load("latest")["state"] == {"epoch": 1}
    assert first.close() is True


def test_a_torn_newest_position_falls_back_to_the_one_before(tmp_path):
    manager = TorchFTCheckpointManager(tmp_path / "checkpoints", replica_id="3")
    manager.save_dataloaders(_position(5), 5)
    newest = manager.save_dataloaders(_position(6), 6)
    (newest / ".metadata").write_bytes(b"torn")
    assert manager.load_dataloaders() == _position(5)


def test_bad_names_and_extra_entries_are_refused(tmp_path):
    with pytest.raises(ValueError, match="TorchFT dataloader checkpoint directory 'ft-replica-../x' is not valid"):
        TorchFTCheckpointManager(tmp_path, replica_id="../x")
    manager = TorchFTCheckpointManager(tmp_path / "checkpoints", replica_id="0")
    with pytest.raises(ValueError, match=r"a dataloader checkpoint holds .*, got also \['model'\]"):
        manager.save_dataloaders({**_position(1), "model": {}}, 1)


def test_load_only_writes_no_position(tmp_path):
    writer = TorchFTCheckpointManager(tmp_path / "checkpoints", replica_id="0")
    writer.save_dataloaders(_position(2), 2)
    reader = TorchFTCheckpointManager(tmp_path / "checkpoints", replica_id="0", load_only=True)
    assert reader.save_dataloaders(_position(9), 9) is None
    assert reader.load_dataloaders() == _position(2)
