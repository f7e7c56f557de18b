"""`FileCheckpointManager.load_into` reads through a memory map: verified first, copied once, nothing left mapped."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from torch import nn

from danling.checkpoint import CheckpointError, FileCheckpointManager

MAPS = Path("/proc/self/maps")


def _trained(seed: int) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model(torch.randn(5, 4)).pow(2).mean().backward()
    optimizer.step()
    optimizer.zero_grad()
    return model, optimizer


def _mapped(path: Path) -> bool:
    return str(path.resolve()) in MAPS.read_text()


def test_load_into_fills_the_optimizers_own_tensors_and_matches_a_plain_load(tmp_path):
    model, optimizer = _trained(0)
    manager = FileCheckpointManager(tmp_path)
    manager.save({"model": model, "optimizer": optimizer, "epoch": 3, "extra": torch.arange(4)}, "step-1")
    expected = manager.load("latest")
    other, other_optimizer = _trained(1)
    moments = [state["exp_avg"] for state in other_optimizer.state.values()]
    rest = manager.load_into("latest", {"model": other, "optimizer": other_optimizer})
    assert rest["epoch"] == 3 and torch.equal(rest["extra"], torch.arange(4))
    for key, value in expected["model"].items():
        assert torch.equal(other.state_dict()[key], value)
    assert [state["exp_avg"] for state in other_optimizer.state.values()] == moments  # the same tensor objects
    loaded = other_optimizer.state_dict()
    for index, state in expected["optimizer"]["state"].items():
        for key, value in state.items():
            assert torch.equal(loaded["state"][index][key], value)


@pytest.mark.skipif(not MAPS.is_file(), reason="needs /proc/self/maps")
def test_nothing_keeps_the_file_mapped_after_load_into(tmp_path):
    class Assigning(nn.Linear):  # keeps the tensors it is given instead of copying them
        def load_state_dict(self, state_dict, strict=True, assign=False):
            return super().load_state_dict(state_dict, strict=strict, assign=True)

    model, optimizer = _trained(0)
    head = Assigning(2, 2)
    manager = FileCheckpointManager(tmp_path)
    path = manager.save({"model": model, "optimizer": optimizer, "head": head, "extra": torch.ones(3)}, "step-1")
    other, other_optimizer = _trained(1)
    other_head = Assigning(2, 2)
    objects = {"model": other, "optimizer": other_optimizer, "head": other_head}
    rest = manager.load_into("latest", objects)
    assert torch.equal(other_head.weight, head.weight) and torch.equal(rest["extra"], torch.ones(3))
    assert not _mapped(path / "state.pt")  # the returned entries and the live objects own their memory
    with torch.no_grad():
        other_head.weight.add_(1.0)
    assert not torch.equal(manager.load("latest")["head"]["weight"], other_head.weight)


def test_a_corrupt_payload_is_refused_before_any_object_is_touched(tmp_path):
    model, optimizer = _trained(0)
    manager = FileCheckpointManager(tmp_path)
    path = manager.save({"model": model, "optimizer": optimizer}, "step-1")
    payload = path / "state.pt"
    data = bytearray(payload.read_bytes())
    data[len(data) // 2] ^= 0xFF
    payload.write_bytes(bytes(data))
    other, other_optimizer = _trained(1)
    before = {key: value.clone() for key, value in other.state_dict().items()}
    moments = [state["exp_avg"].clone() for state in other_optimizer.state.values()]
    with pytest.raises(CheckpointError, match="state.pt is corrupt"):
        manager.load_into("latest", {"model": other, "optimizer": other_optimizer})
    assert all(torch.equal(other.state_dict()[key], value) for key, value in before.items())
    assert all(torch.equal(s["exp_avg"], m) for s, m in zip(other_optimizer.state.values(), moments))


def test_an_optimizer_of_other_groups_is_refused_as_load_state_dict_refuses_it(tmp_path):
    model, optimizer = _trained(0)
    manager = FileCheckpointManager(tmp_path)
    manager.save({"model": model, "optimizer": optimizer}, "step-1")
    other = nn.Linear(3, 3)
    wrong = torch.optim.AdamW(other.parameters())
    with pytest.raises(ValueError, match="parameter group"):
        manager.load_into("latest", {"optimizer": wrong})
    assert wrong.state_dict()["state"] == {}


def test_excluded_and_dotted_keys_behave_as_with_load(tmp_path):
    model, optimizer = _trained(0)
    manager = FileCheckpointManager(tmp_path, exclude_from_loading="optimizer")
    manager.save({"model": model, "optimizer": optimizer, "epoch": 1}, "step-1")
    other, other_optimizer = _trained(1)
    before = [state["exp_avg"].clone() for state in other_optimizer.state.values()]
    rest = manager.load_into("latest", {"model": other, "optimizer": other_optimizer})
    assert rest == {"epoch": 1}
    assert all(torch.equal(s["exp_avg"], b) for s, b in zip(other_optimizer.state.values(), before))
    assert os.fspath(manager.latest).endswith("step-1")
