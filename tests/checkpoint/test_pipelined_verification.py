"""DCP loads verify chunk by chunk while they read, and read plain tensor entries straight into place."""

from __future__ import annotations

import json
import warnings

import pytest
import torch
import torch.distributed.checkpoint as dcp
import xxhash

from danling.checkpoint import checksums
from danling.checkpoint._dcp_read import read_into
from danling.checkpoint.dcp import ModelState, TorchDistributedCheckpointManager
from danling.checkpoint.manifest import MANIFEST_NAME, CheckpointError
from tests.checkpoint._files import flip_byte, manifest_of

SPAN = 64 * 1024  # small chunks, so small tensors span several


@pytest.fixture
def small_chunks(monkeypatch):
    monkeypatch.setattr(checksums, "CHUNK_BYTES", SPAN)


class Pair(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.first = torch.nn.Parameter(torch.randn(256, 256))  # 256 KiB: chunks 0-3 or so
        self.second = torch.nn.Parameter(torch.randn(256, 256))


def _saved(tmp_path):
    torch.manual_seed(0)
    model = Pair()
    manager = TorchDistributedCheckpointManager(tmp_path)
    path = manager.save({"model": ModelState(model), "state": {"step": 4}}, "step-000004")
    return manager, model, path


def test_dcp_files_record_a_digest_per_chunk(tmp_path, small_chunks):
    _, _, path = _saved(tmp_path)
    shard = next(path.glob("*.distcp"))
    entry = manifest_of(path)["files"][shard.name]
    data = shard.read_bytes()
    assert entry["xxh3_128"] == xxhash.xxh3_128(data).hexdigest()  # the whole-file form stays
    assert entry["chunks"]["bytes"] == SPAN
    expected = [xxhash.xxh3_128(data[start : start + SPAN]).hexdigest() for start in range(0, len(data), SPAN)]
    assert entry["chunks"]["xxh3_128"] == expected and len(expected) > 4


def _span_of(path, fqn: str) -> tuple[int, int]:
    stored = dcp.FileSystemReader(str(path)).read_metadata().storage_data.items()
    info = next(info for index, info in stored if index.fqn == fqn)
    return info.offset, info.offset + info.length


def test_a_damaged_later_chunk_is_refused_naming_the_file_and_nothing_unverified_lands(tmp_path, small_chunks):
    manager, saved, path = _saved(tmp_path)
    shard = next(path.glob("*.distcp"))
    start, end = _span_of(path, "model.second")
    flip_byte(shard, (start + end) // 2)
    live = Pair()
    before = {name: value.detach().clone() for name, value in live.state_dict().items()}
    with pytest.raises(CheckpointError, match=rf"{shard.name} is corrupt: its XXH3-128 of bytes \d+-\d+ does not"):
        manager.load_into("latest", {"model": ModelState(live)})
    assert torch.equal(live.second, before["second"])  # its bytes never matched: untouched
    # an entry read before the damage was found came from bytes that matched
    assert torch.equal(live.first, before["first"]) or torch.equal(live.first, saved.first)


def test_manifests_without_chunk_digests_still_verify_and_catch_damage(tmp_path, small_chunks):
    manager, saved, path = _saved(tmp_path)
    manifest = manifest_of(path)
    for entry in manifest["files"].values():
        entry.pop("chunks", None)  # as written before chunk digests existed
    (path / MANIFEST_NAME).write_text(json.dumps(manifest))
    live = Pair()
    assert manager.load_into("latest", {"model": ModelState(live)}) == {"state": {"step": 4}}
    assert torch.equal(live.second, saved.second)
    shard = next(path.glob("*.distcp"))
    flip_byte(shard, shard.stat().st_size - 100)
    fresh = Pair()
    before = fresh.first.detach().clone()
    with pytest.raises(CheckpointError, match=rf"{shard.name} is corrupt: its XXH3-128 does not match"):
        manager.load_into("latest", {"model": ModelState(fresh)})
    assert torch.equal(fresh.first, before)  # a whole-file digest guards the whole file


def test_direct_reads_take_plain_entries_and_leave_the_rest_to_dcp(tmp_path):
    torch.manual_seed(0)
    base = torch.randn(6, 4)
    state = {"plain": base.clone(), "transposed": base.t(), "half": base.to(torch.bfloat16)}
    dcp.save(state, checkpoint_id=tmp_path, no_dist=True)
    spans = {
        index.fqn: (info.relative_path, info.offset, info.length)
        for index, info in dcp.FileSystemReader(str(tmp_path)).read_metadata().storage_data.items()
    }

    def attempt(fqn: str, target: torch.Tensor) -> bool:
        name, offset, length = spans[fqn]
        with open(tmp_path / name, "rb", buffering=0) as handle:
            return read_into(handle, offset, length, target)

    target = torch.empty(6, 4)
    assert attempt("plain", target) and torch.equal(target, base)
    stored_transposed = torch.zeros(4, 6)  # its bytes are in the other order: DCP's path reads it
    assert not attempt("transposed", stored_transposed) and not stored_transposed.any()
    other_dtype = torch.zeros(6, 4)
    assert not attempt("half", other_dtype) and not other_dtype.any()
    strided = torch.zeros(4, 6).t()  # a non-contiguous destination
    assert not attempt("plain", strided) and not strided.any()
    manager = TorchDistributedCheckpointManager(tmp_path / "managed")  # its loads mix both paths
    manager.save({"tensors": state}, "step-000001")
    loaded = manager.load("latest")["tensors"]
    assert all(torch.equal(loaded[key], state[key]) for key in state)


def test_direct_reads_leave_no_warning_about_legacy_storage_classes(tmp_path):
    # The archive header names a legacy storage class (`torch.FloatStorage`), whose dtype torch
    # reports with a deprecation warning that would reach every user's log at every load.
    dcp.save({"weights": torch.randn(8, 8, dtype=torch.float64)}, checkpoint_id=tmp_path, no_dist=True)
    info = next(iter(dcp.FileSystemReader(str(tmp_path)).read_metadata().storage_data.values()))
    target = torch.empty(8, 8, dtype=torch.float64)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with open(tmp_path / info.relative_path, "rb", buffering=0) as handle:
            assert read_into(handle, info.offset, info.length, target)
    assert [str(warning.message) for warning in caught] == []


def _config() -> dict:
    return {f"section{i}": {"lr": 0.1 * i, "name": f"s{i}", "sizes": [i, i + 1]} for i in range(20)}


def test_a_mapping_without_tensors_is_stored_as_one_entry_and_read_back_whole(tmp_path):
    manager = TorchDistributedCheckpointManager(tmp_path, exclude_from_loading=("config.section3",))
    model = torch.nn.Linear(4, 2)
    path = manager.save({"model": ModelState(model), "config": _config(), "state": {"step": 7}}, "step-000007")
    stored = dcp.FileSystemReader(str(path)).read_metadata().state_dict_metadata
    assert [fqn for fqn in stored if fqn.startswith("config")] == ["config.__danling_packed__"]
    assert len([fqn for fqn in stored if fqn.startswith("model")]) == 2  # tensors stay entries of their own
    expected = _config()
    del expected["section3"]  # dotted exclusions reach inside a packed entry
    live = torch.nn.Linear(4, 2)
    assert manager.load_into("latest", {"model": ModelState(live)}) == {"config": expected, "state": {"step": 7}}
    assert torch.equal(live.weight, model.weight)
    assert TorchDistributedCheckpointManager(tmp_path).load("latest")["config"] == _config()


def test_checkpoints_stored_leaf_by_leaf_still_load(tmp_path):
    writer = TorchDistributedCheckpointManager(tmp_path)
    writer.pack_plain = False  # as checkpoints were written before packing
    path = writer.save({"config": _config(), "state": {"step": 7}}, "step-000007")
    stored = dcp.FileSystemReader(str(path)).read_metadata().state_dict_metadata
    assert len([fqn for fqn in stored if fqn.startswith("config")]) == 60
    assert TorchDistributedCheckpointManager(tmp_path).load("latest") == {"config": _config(), "state": {"step": 7}}
