"""What keeps a save or load short: deferred deletion, records riding on DCP's gather, cached plain scalars,
one parse of DCP's index per restore, and entries stored whole read without dcp.load."""

from __future__ import annotations

import collections
import io
import logging
import warnings

import pytest
import torch
import torch.distributed.checkpoint as dcp

from danling.checkpoint import FileCheckpointManager
from danling.checkpoint._dcp_io import RecordingWriter
from danling.checkpoint._dcp_read import NOT_PLAIN, read_plain
from danling.checkpoint.layout import _HOST_TAG, Discard, recover_directory
from danling.checkpoint.manifest import file_record
from danling.checkpoint.unpickling import SAFE_GLOBALS


def _hidden(directory):
    return sorted(p.name for p in directory.iterdir() if p.name.startswith("."))


def test_retired_directory_waits_for_flush_and_survives_recovery(tmp_path):
    victim = tmp_path / "step-000001"
    victim.mkdir()
    (victim / "state.pt").write_bytes(b"x" * 100)
    discard = Discard()
    discard.retire(victim, "step-000001")
    assert not victim.exists()
    (trash,) = _hidden(tmp_path)
    assert trash.startswith(".trash-step-000001-")
    recover_directory(tmp_path, logging.getLogger("test"))  # another manager of this process: not its entry
    assert _hidden(tmp_path) == [trash]
    discard.drain()
    assert not list(tmp_path.iterdir())


def test_replaced_and_pruned_checkpoints_are_gone_once_the_manager_waits(tmp_path):
    manager = FileCheckpointManager(tmp_path, keep_latest_k=1)
    for step in (1, 2, 2, 3):  # step 2 replaces itself once; steps 1 and 2 get pruned
        assert manager.save({"v": step}, f"step-{step:06d}") == tmp_path / f"step-{step:06d}"
        assert not [name for name in _hidden(tmp_path) if name.startswith(".old-")]  # never left to be restored
    assert [p.name for p in manager.checkpoints()] == ["step-000003"]
    manager.wait()
    assert _hidden(tmp_path) == []
    assert manager.load("latest")["v"] == 3
    manager.close()


def test_dead_writers_trash_is_removed_never_restored(tmp_path):
    trash = tmp_path / f".trash-step-000001-p999999999.{_HOST_TAG}.ab"  # this host, a process that is gone
    trash.mkdir()
    (trash / "state.pt").write_bytes(b"partial")
    recover_directory(tmp_path, logging.getLogger("test"))
    assert not list(tmp_path.iterdir())


def test_recording_writer_returns_the_records_of_the_files_it_wrote(tmp_path):
    state = {"w": torch.arange(4096, dtype=torch.float32), "cfg": {"lr": 0.1}}
    writer = RecordingWriter(str(tmp_path), "xxh3_128")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        dcp.save(state, storage_writer=writer, no_dist=True)
    data_files = sorted(p.name for p in tmp_path.glob("*.distcp"))
    assert sorted(writer.records) == data_files and data_files
    # what hashing them afterwards gives
    assert writer.records == {name: file_record(tmp_path / name, chunked=True) for name in data_files}
    loaded = {"w": torch.zeros(4096), "cfg": {"lr": 0.0}}
    dcp.load(loaded, checkpoint_id=tmp_path, no_dist=True)  # the side-channel records left DCP's metadata clean
    assert torch.equal(loaded["w"], state["w"]) and loaded["cfg"]["lr"] == 0.1


def _archive(value):
    buffer = io.BytesIO()
    torch.save(value, buffer)
    buffer.seek(0)
    return buffer


def test_plain_scalars_are_unpickled_once_per_cache():
    cache: dict = {}
    first = read_plain(_archive(0.001), list(SAFE_GLOBALS), cache)
    assert first == 0.001 and list(cache.values()) == [0.001]
    assert read_plain(_archive(0.001), list(SAFE_GLOBALS), cache) == 0.001
    assert read_plain(_archive(True), list(SAFE_GLOBALS), cache) is True  # not confused with 1
    assert len(cache) == 2
    lists = [read_plain(_archive([1, 2]), list(SAFE_GLOBALS), cache) for _ in range(2)]
    assert lists == [[1, 2], [1, 2]] and lists[0] is not lists[1]  # mutable values: never shared
    assert len(cache) == 2


def test_cached_scalars_still_refuse_what_the_unpickler_refuses():
    class Evil:
        def __reduce__(self):
            return (print, ("pwned",))

    cache: dict = {}
    assert read_plain(_archive(Evil()), list(SAFE_GLOBALS), cache) is NOT_PLAIN
    assert cache == {}


@pytest.mark.parametrize("value", [None, "text", 3, 2.5, b"raw"])
def test_each_atom_round_trips_through_the_cache(value):
    cache: dict = {}
    assert read_plain(_archive(value), list(SAFE_GLOBALS), cache) == value
    assert read_plain(_archive(value), list(SAFE_GLOBALS), cache) == value


def _dcp_checkpoint(directory):
    from danling.checkpoint.dcp import ModelState, TorchDistributedCheckpointManager

    torch.manual_seed(0)
    model = torch.nn.Linear(8, 4)
    manager = TorchDistributedCheckpointManager(directory)
    manager.saved_rng = torch.get_rng_state()
    manager.save({"model": ModelState(model), "state": {"step": 7}, "rng": {"torch": manager.saved_rng}}, "step-7")
    return manager, model


def test_a_restore_unpickles_the_dcp_index_once_per_verification_scope(tmp_path, monkeypatch):
    from danling.checkpoint import _dcp_io
    from danling.checkpoint.dcp import ModelState
    from danling.checkpoint.manifest import verification_scope

    manager, model = _dcp_checkpoint(tmp_path)
    unpickled = []
    original = _dcp_io.read_dcp_metadata
    monkeypatch.setattr(_dcp_io, "read_dcp_metadata", lambda *a, **k: unpickled.append(1) or original(*a, **k))
    fresh = torch.nn.Linear(8, 4)
    with verification_scope():  # a runner restore: the plain entries, then the live objects
        assert manager.load("latest")["state"] == {"step": 7}
        manager.load_into("latest", {"model": ModelState(fresh)})
    assert len(unpickled) == 1 and torch.equal(fresh.weight, model.weight)
    manager.load("latest")
    manager.load("latest")
    assert len(unpickled) == 3  # outside a scope every load reads the index afresh


def test_entries_stored_whole_are_read_without_dcp_load(tmp_path, monkeypatch):
    import torch.distributed.checkpoint as dcp

    from danling.checkpoint.dcp import ModelState

    manager, model = _dcp_checkpoint(tmp_path)
    calls = []
    original = dcp.load
    monkeypatch.setattr(dcp, "load", lambda *a, **k: calls.append(1) or original(*a, **k))
    payload = manager.load("latest")
    assert torch.equal(payload["model"]["weight"], model.weight) and payload["state"] == {"step": 7}
    assert torch.equal(payload["rng"]["torch"], manager.saved_rng)  # a plain tensor entry, read into a new tensor
    fresh = torch.nn.Linear(8, 4)
    manager.load_into("latest", {"model": ModelState(fresh)})
    assert torch.equal(fresh.bias, model.bias)
    assert calls == []  # no planning round for whole entries: plain tensors and pickled values


def test_a_save_syncs_its_directory_and_pointers_off_its_own_path(tmp_path, monkeypatch):
    import os
    import threading

    manager = FileCheckpointManager(tmp_path)
    manager.save({"v": 1}, "step-000001")
    synced = []
    original = os.fsync

    def counting(fd):
        synced.append((threading.current_thread().name, os.readlink(f"/proc/self/fd/{fd}")))
        return original(fd)

    monkeypatch.setattr(os, "fsync", counting)
    manager.save({"v": 2}, "step-000002", aliases=("latest", "best"))
    monkeypatch.undo()
    root = os.path.realpath(tmp_path)
    pointers = [thread for thread, path in synced if ".pointer.tmp-" in path]
    assert len(pointers) == 2 and all(thread.startswith("danling-pointers") for thread in pointers)
    # The publication's rename and both pointers' renames are made durable by one directory sync.
    assert [path for _, path in synced].count(root) == 1
    (staging,) = [thread for thread, path in synced if os.path.basename(path).startswith(".tmp-step-000002-")]
    assert staging.startswith("danling-hash")  # the staging directory syncs alongside its manifest
    assert manager.alias("best").name == manager.alias("latest").name == "step-000002"
    assert not [path for path in tmp_path.iterdir() if ".tmp-" in path.name]
    synced.clear()
    monkeypatch.setattr(os, "fsync", counting)
    manager.save({"v": 3}, "step-000003", aliases=())  # no pointer to commit: the rename is still synced
    manager.save({"v": 4}, "step-000003", aliases=("latest",))  # a replacement syncs before retiring the old
    monkeypatch.undo()
    assert [path for _, path in synced].count(root) == 3
    manager.close()


def test_plain_data_skips_the_python_unpickler_and_globals_still_go_through_it(monkeypatch):
    from torch import _weights_only_unpickler

    built = []
    real = _weights_only_unpickler.Unpickler

    def counting(*args, **kwargs):
        built.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(_weights_only_unpickler, "Unpickler", counting)
    rng_like = (3, tuple(range(625)), None)  # what random.getstate() returns
    plain = [0.001, True, None, "adamw", rng_like, {"lr": 0.1, "betas": (0.9, 0.999), "sizes": [1, 2]}]
    assert [read_plain(_archive(value), list(SAFE_GLOBALS)) for value in plain] == plain
    assert built == []  # none of these needs a global: the C unpickler read them
    ordered = read_plain(_archive(collections.OrderedDict(a=1)), list(SAFE_GLOBALS))
    assert ordered == collections.OrderedDict(a=1) and type(ordered) is collections.OrderedDict
    assert built == [1]  # an allowed global: the weights-only unpickler, as before

    class Evil:
        def __reduce__(self):
            return (print, ("pwned",))

    assert read_plain(_archive(Evil()), list(SAFE_GLOBALS)) is NOT_PLAIN and built == [1, 1]
