"""Live objects in saved state, `load_into`, the model/optimizer wrappers, and per-rank entries (one process)."""

from __future__ import annotations

import json
import logging
import threading

import pytest
import torch
from torch import nn

from danling.checkpoint import CheckpointError, CheckpointResizeError, FileCheckpointManager
from danling.checkpoint.dcp import ModelState, OptimizerState, TorchDistributedCheckpointManager, TrainingState
from danling.checkpoint.manifest import read_manifest

BACKENDS = {"file": FileCheckpointManager, "dcp": TorchDistributedCheckpointManager}


def _model(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))


def _step(model: nn.Module, optimizer: torch.optim.Optimizer, seed: int) -> None:
    model(torch.randn(6, 4, generator=torch.Generator().manual_seed(seed))).pow(2).mean().backward()
    optimizer.step()
    optimizer.zero_grad()


class Probe:
    """A live object that records where and with what it is saved and loaded."""

    def __init__(self, value: float = 0.0) -> None:
        self.tensor = torch.full((3,), value)
        self.saved_in: list[int] = []
        self.loaded = None

    def state_dict(self) -> dict:
        self.saved_in.append(threading.get_ident())
        return {"tensor": self.tensor, "note": "probe"}

    def load_state_dict(self, state: dict) -> None:
        self.loaded = state


@pytest.mark.parametrize("backend", sorted(BACKENDS))
def test_async_save_takes_live_state_in_the_callers_thread(tmp_path, backend):
    model, probe = _model(), Probe(1.0)
    manager = BACKENDS[backend](tmp_path, async_save=True)
    before = model[0].weight.detach().clone()
    manager.save({"model": ModelState(model), "probe": probe, "epoch": 1}, "epoch-000001")
    assert probe.saved_in == [threading.get_ident()]
    with torch.no_grad():
        model[0].weight.add_(1.0)
        probe.tensor.add_(1.0)
    manager.wait()
    payload = manager.load("latest")
    assert torch.equal(payload["model"]["0.weight"], before)
    assert torch.equal(payload["probe"]["tensor"], torch.full((3,), 1.0)) and payload["epoch"] == 1
    manager.close()


@pytest.mark.parametrize("backend", sorted(BACKENDS))
def test_load_into_restores_objects_and_returns_plain_entries(tmp_path, backend):
    model = _model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    _step(model, optimizer, seed=0)
    manager = BACKENDS[backend](tmp_path)
    state = {"model": ModelState(model), "optimizer": OptimizerState(model, optimizer)}
    manager.save({**state, "config": {"lr": 0.1}, "results": {"1": {"loss": 0.5}}}, "step-000001")
    fresh = _model(seed=1)
    fresh_optimizer = torch.optim.AdamW(fresh.parameters(), lr=0.1)  # has never stepped
    objects = {"model": ModelState(fresh), "optimizer": OptimizerState(fresh, fresh_optimizer)}
    rest = manager.load_into("latest", objects)
    assert rest == {"config": {"lr": 0.1}, "results": {"1": {"loss": 0.5}}}
    _step(model, optimizer, seed=1)
    _step(fresh, fresh_optimizer, seed=1)
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), fresh.parameters()))
    assert fresh_optimizer.state[fresh[0].weight]["step"] == 2


@pytest.mark.parametrize("backend", sorted(BACKENDS))
def test_unstepped_optimizer_is_neither_advanced_by_saving_nor_by_loading(tmp_path, backend):
    model = _model()
    optimizer = torch.optim.Adam(model.parameters(), lr=0.1)
    manager = BACKENDS[backend](tmp_path)
    manager.save({"training": TrainingState(model, optimizer)}, "seed", aliases=("seed",))
    assert not optimizer.state  # DCP's own get_state_dict would have stepped it with lr=0
    fresh = _model(seed=1)
    fresh_optimizer = torch.optim.Adam(fresh.parameters(), lr=0.1)
    assert manager.load_into("seed", {"training": TrainingState(fresh, fresh_optimizer)}) == {}
    assert not fresh_optimizer.state
    for net, opt in ((model, optimizer), (fresh, fresh_optimizer)):
        _step(net, opt, seed=2)
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), fresh.parameters()))
    assert fresh_optimizer.state[fresh[0].weight]["step"] == 1


def test_dcp_load_into_reads_into_the_objects_own_tensors(tmp_path):
    manager = TorchDistributedCheckpointManager(tmp_path)
    manager.save({"probe": Probe(5.0), "epoch": 2}, "epoch-000002")
    probe = Probe(0.0)
    target = probe.tensor
    assert manager.load_into("latest", {"probe": probe}) == {"epoch": 2}
    assert probe.loaded["tensor"] is target and torch.equal(target, torch.full((3,), 5.0))
    assert probe.loaded["note"] == "probe"


@pytest.mark.parametrize("backend", sorted(BACKENDS))
def test_load_into_skips_excluded_objects_and_names_missing_ones(tmp_path, backend):
    BACKENDS[backend](tmp_path).save({"probe": Probe(1.0), "epoch": 1}, "epoch-000001")
    probe = Probe()
    manager = BACKENDS[backend](tmp_path, exclude_from_loading=["probe"])
    assert manager.load_into("latest", {"probe": probe}) == {"epoch": 1}
    assert probe.loaded is None
    with pytest.raises(CheckpointError, match="'scheduler'.*exclude_from_loading"):
        BACKENDS[backend](tmp_path).load_into("latest", {"scheduler": Probe()})
    with pytest.raises(TypeError, match=r"objects\['epoch'\] is a dict"):
        manager.load_into("latest", {"epoch": {"value": 1}})


def test_dcp_load_into_honours_dotted_excludes(tmp_path):
    model = _model()
    TorchDistributedCheckpointManager(tmp_path).save({"model": ModelState(model)}, "step-000001")
    fresh = _model(seed=1)
    kept = fresh[0].weight.detach().clone()
    manager = TorchDistributedCheckpointManager(tmp_path, exclude_from_loading=["model.0.weight"])
    manager.load_into("latest", {"model": ModelState(fresh, strict=False)})
    assert torch.equal(fresh[0].weight, kept) and torch.equal(fresh[0].bias, model[0].bias)


@pytest.mark.parametrize("backend", sorted(BACKENDS))
def test_a_dotted_exclude_naming_a_submodule_keeps_all_its_weights(tmp_path, backend):
    # "model.0" names a module, not a stored key: every entry under it ("0.weight", "0.bias") stays
    # out, with either backend (the file backend used to find no key "0" and load them all).
    model = _model()
    BACKENDS[backend](tmp_path).save({"model": ModelState(model)}, "step-000001")
    manager = BACKENDS[backend](tmp_path, exclude_from_loading=["model.0"])
    assert sorted(manager.load("latest")["model"]) == ["2.bias", "2.weight"]
    fresh = _model(seed=1)
    kept = [fresh[0].weight.detach().clone(), fresh[0].bias.detach().clone()]
    manager.load_into("latest", {"model": ModelState(fresh, strict=False)})
    assert torch.equal(fresh[0].weight, kept[0]) and torch.equal(fresh[0].bias, kept[1])
    assert torch.equal(fresh[2].weight, model[2].weight)


# Per-rank entries ------------------------------------------------------------------------------


def _per_rank_manager(directory, data_size: int, data_rank: int = 0, **kwargs) -> TorchDistributedCheckpointManager:
    return TorchDistributedCheckpointManager(
        directory, rank_local_keys=("dataloaders", "rng"), data_rank=data_rank, data_size=data_size, **kwargs
    )


@pytest.fixture
def two_rank_layout(tmp_path):
    """A checkpoint as data rank 0 of 2 writes it (one process stands in for it)."""
    state = {"state": {"step": 12}, "dataloaders": {"train": {"yielded": 7}}, "rng": Probe(3.0), "probe": Probe(2.0)}
    _per_rank_manager(tmp_path, data_size=2).save(state, "step-000012")
    return tmp_path


def test_manifest_records_the_layout_and_same_size_gets_own_copies(two_rank_layout):
    manifest = read_manifest(two_rank_layout / "step-000012")
    assert manifest["metadata"]["rank_layout"] == {
        "data_size": 2,
        "keys": ["dataloaders", "probe", "rng", "state"],
        "rank_local_keys": ["dataloaders", "rng"],
    }
    rng = Probe()
    rest = _per_rank_manager(two_rank_layout, data_size=2).load_into("latest", {"probe": Probe(), "rng": rng})
    assert rest == {"state": {"step": 12}, "dataloaders": {"train": {"yielded": 7}}}
    assert rng.loaded["tensor"] is rng.tensor and torch.equal(rng.tensor, torch.full((3,), 3.0))


@pytest.mark.parametrize("load", ["load", "load_into"])
def test_other_data_size_raises_naming_sizes_and_per_rank_keys(two_rank_layout, load):
    manager = _per_rank_manager(two_rank_layout, data_size=1)
    probe = Probe()
    call = (
        (lambda: manager.load("latest")) if load == "load" else (lambda: manager.load_into("latest", {"probe": probe}))
    )
    with pytest.raises(CheckpointResizeError) as info:
        call()
    message = str(info.value)
    assert "2 data-parallel ranks" in message and "this run has 1" in message
    assert "['dataloaders', 'rng']" in message and "exclude_from_loading" in message
    assert probe.loaded is None  # refused before anything was restored


def test_optional_per_rank_keys_drop_with_a_warning_and_global_state_loads(two_rank_layout, caplog):
    manager = _per_rank_manager(
        two_rank_layout, data_size=3, data_rank=2, optional_rank_local_keys=["rng"], exclude_from_loading="dataloader"
    )
    probe, rng = Probe(), Probe()
    with caplog.at_level(logging.WARNING, logger="danling.checkpoint"):
        rest = manager.load_into("latest", {"probe": probe, "rng": rng})
    assert rest == {"state": {"step": 12}} and rng.loaded is None
    assert torch.equal(probe.loaded["tensor"], torch.full((3,), 2.0))
    assert "per-rank entries ['rng']" in caplog.text and "2 data-parallel ranks" in caplog.text


def test_data_coordinates_and_reserved_metadata_are_checked(tmp_path):
    with pytest.raises(ValueError, match="data_rank must be below data_size=2, got 2"):
        TorchDistributedCheckpointManager(tmp_path, data_rank=2, data_size=2)
    with pytest.raises(ValueError, match="data_rank must be given with data_size=4"):
        TorchDistributedCheckpointManager(tmp_path, data_size=4)
    with pytest.raises(ValueError, match="data_size must be an integer >= 1, got 0"):
        TorchDistributedCheckpointManager(tmp_path, data_rank=0, data_size=0)
    with pytest.raises(ValueError, match="'rank_layout' is reserved"):
        TorchDistributedCheckpointManager(tmp_path).save({"a": 1}, "step-000001", metadata={"rank_layout": 1})


def test_checkpoints_without_a_recorded_layout_infer_it_from_their_copies(tmp_path):
    # Written as before layouts were recorded: per-rank copies under "<key>.rank<r>", no manifest entry.
    copies = {"rank0": {"seed": 10}, "rank1": {"seed": 11}}
    writer = TorchDistributedCheckpointManager(tmp_path, rank_local_keys=())
    writer.pack_plain = False  # nor were plain mappings packed then
    writer.save({"rng": copies, "step": 5}, "step-000005")
    manifest_path = tmp_path / "step-000005" / "manifest.json"
    manifest = json.loads(manifest_path.read_text())
    del manifest["metadata"]["rank_layout"]
    manifest_path.write_text(json.dumps(manifest))
    options = {"rank_local_keys": ["rng"]}
    rest = TorchDistributedCheckpointManager(tmp_path, data_rank=1, data_size=2, **options).load("latest")
    assert rest == {"rng": {"seed": 11}, "step": 5}
    with pytest.raises(CheckpointResizeError, match="written by 2 data-parallel ranks, but this run has 3"):
        TorchDistributedCheckpointManager(tmp_path, data_rank=0, data_size=3, **options).load("latest")
