"""Checkpoint checksums: XXH3-128 by default, SHA-256 on request, old SHA-256 manifests still verify."""

from __future__ import annotations

import hashlib
import json
import random

import pytest
import torch
import xxhash

from danling.checkpoint import FileCheckpointManager
from danling.checkpoint.checksums import HashingReader, HashingWriter, file_record
from danling.checkpoint.dcp import ModelState, TorchDistributedCheckpointManager
from danling.checkpoint.manifest import MANIFEST_NAME, CheckpointError, read_manifest, verify_directory
from tests.checkpoint._files import flip_byte, manifest_of


def _state() -> dict:
    torch.manual_seed(0)
    return {"weight": torch.randn(256, 300), "bias": torch.randn(300), "step": 3}


def test_new_checkpoints_record_xxh3_and_sha256_is_an_option(tmp_path):
    fast = FileCheckpointManager(tmp_path / "fast").save(_state(), "step-1")
    entry = manifest_of(fast)["files"]["state.pt"]
    assert set(entry) == {"size", "xxh3_128"}
    assert entry["xxh3_128"] == xxhash.xxh3_128((fast / "state.pt").read_bytes()).hexdigest()

    strong = FileCheckpointManager(tmp_path / "strong", checksum="sha256").save(_state(), "step-1")
    entry = manifest_of(strong)["files"]["state.pt"]
    assert set(entry) == {"size", "sha256"}
    assert entry["sha256"] == hashlib.sha256((strong / "state.pt").read_bytes()).hexdigest()
    for path in (fast, strong):
        assert torch.equal(FileCheckpointManager(path.parent).load(path)["weight"], _state()["weight"])


def test_an_unknown_checksum_is_refused_by_name(tmp_path):
    with pytest.raises(ValueError, match=r"checksum must be one of .*'xxh3_128'.*got 'md5'"):
        FileCheckpointManager(tmp_path, checksum="md5")
    with pytest.raises(ValueError, match="got 'crc'"):
        TorchDistributedCheckpointManager(tmp_path, checksum="crc")


def _as_old_manifest(path) -> None:
    """Rewrite a manifest the way earlier versions wrote it: SHA-256 only."""
    manifest = manifest_of(path)
    for name, entry in manifest["files"].items():
        manifest["files"][name] = {
            "size": entry["size"],
            "sha256": hashlib.sha256((path / name).read_bytes()).hexdigest(),
        }
    (path / MANIFEST_NAME).write_text(json.dumps(manifest))


def test_old_sha256_manifests_verify_load_and_catch_damage(tmp_path):
    manager = FileCheckpointManager(tmp_path)
    path = manager.save(_state(), "step-1")
    _as_old_manifest(path)
    assert verify_directory(path)["files"]["state.pt"].keys() == {"size", "sha256"}
    assert manager.load("latest")["step"] == 3
    flip_byte(path / "state.pt", (path / "state.pt").stat().st_size // 2)
    with pytest.raises(CheckpointError, match="corrupt: its SHA-256 does not match"):
        manager.load("latest")


def test_old_sha256_manifests_of_dcp_checkpoints_load_in_place(tmp_path):
    model = torch.nn.Linear(8, 4)
    manager = TorchDistributedCheckpointManager(tmp_path)
    path = manager.save({"model": ModelState(model), "state": {"step": 2}}, "step-000002")
    _as_old_manifest(path)
    fresh = torch.nn.Linear(8, 4)
    assert manager.load_into("latest", {"model": ModelState(fresh)}) == {"state": {"step": 2}}
    assert torch.equal(fresh.weight, model.weight)


@pytest.mark.parametrize("where", ["start", "middle", "index at the end"])
def test_a_damaged_payload_is_caught_while_it_is_read(tmp_path, where):
    manager = FileCheckpointManager(tmp_path)
    path = manager.save(_state(), "step-1")
    payload = path / "state.pt"
    size = payload.stat().st_size
    flip_byte(payload, {"start": 40, "middle": size // 2, "index at the end": size - 30}[where])
    with pytest.raises(CheckpointError, match=r"state\.pt is corrupt: its XXH3-128 does not match"):
        manager.load("latest")


def test_a_torn_write_is_caught_before_unpickling(tmp_path):
    manager = FileCheckpointManager(tmp_path)
    path = manager.save(_state(), "step-1")
    payload = path / "state.pt"
    payload.write_bytes(payload.read_bytes()[:-1])
    with pytest.raises(CheckpointError, match=r"torn: \d+ bytes on disk"):
        manager.load("latest")
    with pytest.raises(CheckpointError, match="torn"):
        manager.load(payload)  # the file itself, not the directory


def test_a_damaged_dcp_shard_is_refused_before_the_live_object_changes(tmp_path):
    model = torch.nn.Linear(64, 64)
    manager = TorchDistributedCheckpointManager(tmp_path)
    path = manager.save({"model": ModelState(model)}, "step-000001")
    shard = next(path.glob("*.distcp"))
    flip_byte(shard, shard.stat().st_size // 2)
    live = torch.nn.Linear(64, 64)
    before = live.weight.detach().clone()
    with pytest.raises(CheckpointError, match="corrupt: its XXH3-128"):
        manager.load_into("latest", {"model": ModelState(live)})
    assert torch.equal(live.weight, before)


def test_hashing_reader_checks_the_whole_file_whatever_order_it_is_read_in(tmp_path):
    path = tmp_path / "blob"
    data = random.Random(0).randbytes(300_000)
    path.write_bytes(data)
    entry = file_record(path)
    rng = random.Random(1)
    with HashingReader(path, entry) as reader:
        for _ in range(50):  # jumps forwards and backwards, small and large
            reader.seek(rng.randrange(len(data)))
            buffer = bytearray(rng.randrange(1, 70_000))
            count = reader.readinto(buffer)
            assert bytes(buffer[:count]) == data[reader.tell() - count : reader.tell()]
        reader.finish()
    wrong = {"size": entry["size"], "xxh3_128": "0" * 32}
    with HashingReader(path, wrong) as reader, pytest.raises(CheckpointError, match="corrupt"):
        reader.finish()


def test_hashing_writer_and_file_record_agree_for_both_checksums(tmp_path):
    import io

    data = random.Random(2).randbytes(3 << 20)  # above the threshold where SHA-256 hashes on a helper thread
    for checksum in ("xxh3_128", "sha256"):
        sink = HashingWriter(io.BytesIO(), checksum=checksum)
        sink.write(data[:100])
        sink.write(memoryview(data)[100:])
        (tmp_path / checksum).write_bytes(data)
        assert sink.record() == file_record(tmp_path / checksum, checksum=checksum)


def test_a_manifest_entry_without_a_known_checksum_is_malformed(tmp_path):
    path = FileCheckpointManager(tmp_path).save(_state(), "step-1")
    manifest = manifest_of(path)
    manifest["files"]["state.pt"] = {"size": manifest["files"]["state.pt"]["size"], "md5": "abc"}
    (path / MANIFEST_NAME).write_text(json.dumps(manifest))
    with pytest.raises(CheckpointError, match="malformed entry for 'state.pt'"):
        read_manifest(path)


def test_a_file_checkpoint_is_read_once_its_checksum_computed_on_the_way(tmp_path, monkeypatch):
    from danling.checkpoint import checksums

    path = FileCheckpointManager(tmp_path).save(_state(), "step-1")
    passes = []
    real = checksums._digest_file
    monkeypatch.setattr(checksums, "_digest_file", lambda p, c: (passes.append(p), real(p, c))[1])
    assert FileCheckpointManager(tmp_path).load("latest")["step"] == 3
    assert passes == []  # no separate hashing pass: HashingReader checked the bytes torch.load read
    verify_directory(path)  # an explicit verification still hashes the file
    assert [p.name for p in passes] == ["state.pt"]


def _records(directory):
    from danling.checkpoint.checksums import file_record

    # fsync=True hands each file's fsync to the helper pool while the caller hashes it
    return {path.name: file_record(path, fsync=True, checksum="xxh3_128") for path in sorted(directory.iterdir())}


def _records_in_child(directory, queue):
    queue.put(_records(directory))


def test_a_forked_child_hashes_with_pools_of_its_own(tmp_path):
    # The parent's hashing pool exists (each file's fsync ran on it); a child forked now inherits
    # it without its threads, and used to wait forever in its first save.
    import multiprocessing

    for name in ("a.bin", "b.bin", "c.bin"):
        (tmp_path / name).write_bytes(random.randbytes(1 << 16))
    expected = _records(tmp_path)
    context = multiprocessing.get_context("fork")
    queue = context.Queue()
    child = context.Process(target=_records_in_child, args=(tmp_path, queue))
    child.start()
    child.join(60)
    alive = child.is_alive()
    if alive:
        child.kill()
    assert not alive, "the forked child hung in file_record"
    assert queue.get(timeout=5) == expected
