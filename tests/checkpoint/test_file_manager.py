"""FileCheckpointManager: round trip, aliases, retention, cadence, load-only, exclusions, async."""

from __future__ import annotations

import json
import random
from collections import OrderedDict

import numpy as np
import pytest
import torch
from torch import nn

from danling.checkpoint import (
    CheckpointError,
    CheckpointManager,
    CheckpointNotFoundError,
    FileCheckpointManager,
    read_checkpoint,
)
from danling.checkpoint.manifest import MANIFEST_NAME


def make_payload(seed: int = 0) -> dict:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    model(torch.randn(3, 4)).sum().backward()
    optimizer.step()
    return {
        "config": {"lr": 0.1, "name": "exp"},
        "state": {"epoch": seed, "global_step": 10 * seed, "rng": {"python": random.getstate()}},
        "model": model.state_dict(),
        "optimizer": optimizer.state_dict(),
        "scheduler": {"last_epoch": seed},
        "dataloaders": {"train": {"index": 5}},
        "extra": np.arange(4),
    }


def assert_same(left, right) -> None:
    if isinstance(left, torch.Tensor):
        assert torch.equal(left, right)
    elif isinstance(left, np.ndarray):
        np.testing.assert_array_equal(left, right)
    elif isinstance(left, dict):
        assert left.keys() == right.keys()
        for key in left:
            assert_same(left[key], right[key])
    elif isinstance(left, (list, tuple)):
        assert len(left) == len(right)
        for a, b in zip(left, right):
            assert_same(a, b)
    else:
        assert left == right


def test_round_trip_restores_every_component(tmp_path):
    manager = FileCheckpointManager(tmp_path)
    payload = make_payload(3)
    path = manager.save(payload, "epoch-000003", metadata={"epoch": 3})
    assert path == tmp_path / "epoch-000003"
    loaded = manager.load("latest")
    assert_same(payload, loaded)
    manifest = json.loads((path / MANIFEST_NAME).read_text())
    assert manifest["metadata"] == {"epoch": 3}
    assert manifest["files"]["state.pt"]["size"] == (path / "state.pt").stat().st_size
    assert manifest["history"] is True
    # the same payload is reachable by name, directory, payload file and pointer file
    for ref in ("epoch-000003", path, path / "state.pt", tmp_path / "latest.pointer"):
        assert_same(payload["model"], manager.load(ref)["model"])
    assert_same(payload["optimizer"], read_checkpoint(path)["optimizer"])


def test_loaded_model_and_optimizer_continue_identically(tmp_path):
    torch.manual_seed(0)
    model = nn.Linear(3, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    data = torch.randn(8, 3)
    model(data).sum().backward()
    optimizer.step()
    manager = FileCheckpointManager(tmp_path)
    manager.save({"model": model.state_dict(), "optimizer": optimizer.state_dict()}, "step-000001")

    clone = nn.Linear(3, 1)
    clone_optimizer = torch.optim.SGD(clone.parameters(), lr=0.1, momentum=0.9)
    loaded = manager.load("latest")
    clone.load_state_dict(loaded["model"])
    clone_optimizer.load_state_dict(loaded["optimizer"])
    for net, opt in ((model, optimizer), (clone, clone_optimizer)):
        opt.zero_grad()
        net(data).pow(2).sum().backward()
        opt.step()
    assert torch.equal(model.weight, clone.weight)


def test_aliases_best_and_named(tmp_path):
    manager = FileCheckpointManager(tmp_path)
    assert manager.latest is None and manager.best is None
    manager.save({"v": 1}, "epoch-000001", aliases=("latest", "best"))
    manager.save({"v": 2}, "epoch-000002")
    manager.save({"v": 3}, "epoch-000003", aliases=("latest", "shutdown"))
    assert manager.latest.name == "epoch-000003"
    assert manager.best.name == "epoch-000001"
    assert manager.load("best")["v"] == 1
    assert manager.load("shutdown")["v"] == 3
    assert set(manager.aliases()) == {"latest", "best", "shutdown"}
    assert [p.name for p in manager.checkpoints()] == ["epoch-000003", "epoch-000002", "epoch-000001"]


def test_a_save_that_replaces_a_checkpoint_drops_the_aliases_it_does_not_renew(tmp_path):
    # A run resumed from an older checkpoint saves the same names again: `best` kept naming
    # `epoch-000002`, whose weights were now the resumed run's worst.
    manager = FileCheckpointManager(tmp_path)
    manager.save({"v": 1}, "epoch-000001", aliases=("latest",))
    manager.save({"v": 2}, "epoch-000002", aliases=("latest", "best", "shutdown"))
    manager.save({"v": 20}, "epoch-000002", aliases=("latest", "shutdown"))  # replaced, not the best
    assert set(manager.aliases()) == {"latest", "shutdown"} and manager.best is None
    assert manager.load("shutdown")["v"] == 20
    with pytest.raises(CheckpointNotFoundError):
        manager.load("best")  # refused, never the replaced weights
    manager.save({"v": 3}, "epoch-000001", aliases=("best",))  # another checkpoint's aliases stay
    assert manager.best.name == "epoch-000001" and manager.latest.name == "epoch-000002"


def test_retention_keeps_newest_and_alias_targets(tmp_path):
    manager = FileCheckpointManager(tmp_path, keep_latest_k=2)
    manager.save({"v": 0}, "seed", aliases=())
    manager.save({"v": 1}, "epoch-000001", aliases=("latest", "best"))
    for epoch in range(2, 6):
        manager.save({"v": epoch}, f"epoch-{epoch:06d}")
    names = sorted(p.name for p in manager.checkpoints())
    # two newest history checkpoints + the one `best` points at + the non-history seed
    assert names == ["epoch-000001", "epoch-000004", "epoch-000005", "seed"]
    assert manager.load("best")["v"] == 1
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]


def test_retention_zero_keeps_everything(tmp_path):
    manager = FileCheckpointManager(tmp_path, keep_latest_k=0)
    for step in range(1, 5):
        manager.save({"v": step}, f"step-{step:06d}")
    assert len(manager.checkpoints()) == 4


def test_overwriting_a_name_replaces_it(tmp_path):
    manager = FileCheckpointManager(tmp_path)
    manager.save({"v": 1}, "last")
    manager.save({"v": 2}, "last")
    assert manager.load("last")["v"] == 2
    assert [p.name for p in tmp_path.iterdir() if p.is_dir()] == ["last"]


def test_cadence():
    manager = CheckpointManager("unused", interval=3)
    assert [i for i in range(10) if manager.should_save(i)] == [3, 6, 9]
    assert manager.should_save(1, force=True) and manager.should_save(1, last=True)
    assert CheckpointManager("unused").should_save(1)
    assert not CheckpointManager("unused", load_only=True).should_save(3, force=True)


def test_load_only_and_non_main_process_never_write(tmp_path):
    FileCheckpointManager(tmp_path).save({"v": 1}, "epoch-000001")
    for manager in (
        FileCheckpointManager(tmp_path, load_only=True),
        FileCheckpointManager(tmp_path, is_main_process=False),
    ):
        assert manager.save({"v": 2}, "epoch-000002") is None
        assert manager.load("latest")["v"] == 1
    assert [p.name for p in FileCheckpointManager(tmp_path).checkpoints()] == ["epoch-000001"]


def test_exclude_from_loading_with_aliases_and_dotted_keys(tmp_path):
    FileCheckpointManager(tmp_path).save(make_payload(1), "epoch-000001")
    manager = FileCheckpointManager(
        tmp_path, exclude_from_loading=["optimizer", "lr_scheduler", "dataloader", "model.2.bias", "state.rng"]
    )
    loaded = manager.load("latest")
    assert not {"optimizer", "scheduler", "dataloaders"} & loaded.keys()
    assert "2.bias" not in loaded["model"] and "2.weight" in loaded["model"]
    assert loaded["state"] == {"epoch": 1, "global_step": 10}
    assert FileCheckpointManager(tmp_path, exclude_from_loading="optimizer,scheduler").exclude_from_loading == (
        "optimizer",
        "scheduler",
    )


def test_async_save_snapshots_state_before_returning(tmp_path):
    manager = FileCheckpointManager(tmp_path, async_save=True)
    weight = torch.zeros(1000)
    tied = {"a": weight, "b": weight.view(10, 100), "c": weight.detach()}
    state = OrderedDict(model=tied, step=1)
    path = manager.save(state, "step-000001")
    weight.add_(1)  # training keeps mutating; the checkpoint must hold the zeros
    assert manager.wait()
    assert manager.close()
    loaded = manager.load(path)
    assert torch.equal(loaded["model"]["a"], torch.zeros(1000))
    assert loaded["model"]["a"].untyped_storage().data_ptr() == loaded["model"]["c"].untyped_storage().data_ptr()
    assert loaded["model"]["b"].untyped_storage().data_ptr() == loaded["model"]["a"].untyped_storage().data_ptr()


def test_async_saves_are_serialized_and_load_waits(tmp_path):
    manager = FileCheckpointManager(tmp_path, async_save=True, keep_latest_k=2)
    for step in range(1, 6):
        manager.save({"w": torch.full((256,), float(step))}, f"step-{step:06d}")
    # load waits for the in-flight save, so `latest` is the last one requested
    assert manager.load("latest")["w"][0].item() == 5.0
    assert [p.name for p in manager.checkpoints()] == ["step-000005", "step-000004"]
    assert manager.close(timeout=5)


def test_async_saves_stage_into_the_previous_snapshots_buffers(tmp_path):
    manager = FileCheckpointManager(tmp_path, async_save=True, keep_latest_k=3)
    weight, moment = torch.zeros(4096), torch.ones(64)
    state = {"model": {"w": weight, "w_view": weight.view(64, 64)}, "moment": moment}
    manager.save(state, "step-000001")
    manager.wait()
    staged = {key[1:]: buffer.data_ptr() for key, buffer in manager._staging_buffers.items()}
    assert sorted(size for _, size in staged) == [64 * 4, 4096 * 4]  # one buffer per storage, views share it
    weight.add_(1)
    manager.save(state, "step-000002")  # the same layout: copied into the same buffers
    assert {key[1:]: buffer.data_ptr() for key, buffer in manager._staging_buffers.items()} == staged
    weight.add_(1)
    manager.save({"model": {"w": weight}, "moment": torch.ones(128)}, "step-000003")  # a new storage
    assert manager.close()
    assert len(manager._staging_buffers) == 0  # released with the worker
    first, second, third = (manager.load(f"step-00000{step}") for step in (1, 2, 3))
    assert torch.equal(first["model"]["w"], torch.zeros(4096)) and torch.equal(second["model"]["w"], torch.ones(4096))
    assert torch.equal(second["model"]["w_view"], torch.ones(64, 64)) and torch.equal(third["model"]["w"], weight)
    assert torch.equal(third["moment"], torch.ones(128))


def test_async_error_is_reraised_on_next_call(tmp_path):
    class Unpicklable:
        def __deepcopy__(self, memo):  # the snapshot succeeds; pickling on the worker fails
            return self

        def __reduce__(self):
            raise RuntimeError("cannot pickle me")

    manager = FileCheckpointManager(tmp_path, async_save=True)
    manager.save({"bad": [Unpicklable()]}, "step-000001")
    with pytest.raises(RuntimeError, match="cannot pickle me"):
        manager.wait()
    manager.save({"bad": [Unpicklable()]}, "step-000002")
    with pytest.raises(RuntimeError, match="cannot pickle me"):
        manager.close()
    assert manager.checkpoints() == [] and not list(tmp_path.iterdir())


def test_missing_checkpoint_and_bad_arguments(tmp_path):
    manager = FileCheckpointManager(tmp_path)
    with pytest.raises(CheckpointNotFoundError, match="'latest'"):
        manager.load("latest")
    with pytest.raises(ValueError, match="'../escape'"):
        manager.save({}, "../escape")
    with pytest.raises(ValueError, match="'x.pointer'"):
        manager.save({}, "ok", aliases=("x.pointer",))
    with pytest.raises(TypeError, match="list"):
        manager.save([1], "ok")
    with pytest.raises(TypeError, match="JSON-serializable"):
        manager.save({}, "ok", metadata={"when": object()})
    with pytest.raises(ValueError, match="interval"):
        FileCheckpointManager(tmp_path, interval=0)
    with pytest.raises(ValueError, match="keep_latest_k"):
        FileCheckpointManager(tmp_path, keep_latest_k=-1)
    (tmp_path / "ghost.pointer").write_text("nowhere\n")
    with pytest.raises(CheckpointError, match="ghost.pointer"):
        manager.load("ghost")


def test_plain_torch_file_loads_without_manifest(tmp_path):
    torch.save({"model": {"w": torch.ones(2)}}, tmp_path / "weights.pt")
    assert torch.equal(read_checkpoint(tmp_path / "weights.pt")["model"]["w"], torch.ones(2))
    assert read_checkpoint((tmp_path / "weights.pt").read_bytes())["model"]["w"].shape == (2,)
    with pytest.raises(TypeError, match="42"):
        read_checkpoint(42)
