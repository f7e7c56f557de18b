"""FileCheckpointManager.load_into reading straight into live tensors, verified piece by piece.

Most tests shrink the piece span (`CHUNK_BYTES`) to 1 KiB, so small payloads have many pieces,
tensors straddle piece boundaries, and the manifest records pieces as it does for files above
4 MiB; one test keeps the real span.
"""

from __future__ import annotations

import copy
import datetime
import json
from pathlib import Path

import pytest
import torch
from torch import nn

from danling.checkpoint import CheckpointError, FileCheckpointManager, UnsafePickleError, checksums
from danling.checkpoint import _file_read as file_read
from danling.checkpoint._writeback import WritebackWriter
from danling.checkpoint.dcp import ModelState, OptimizerState
from danling.checkpoint.manifest import MANIFEST_NAME, file_record, verification_scope
from tests.checkpoint._files import flip_byte, manifest_of

SPAN = 1024


@pytest.fixture
def small_pieces(monkeypatch):
    monkeypatch.setattr(checksums, "CHUNK_BYTES", SPAN)


class Streamed(FileCheckpointManager):
    """The reader without the in-place path: `torch.load` through the hashing reader, then `load_state_dict`."""

    def _reads_in_place(self, path):
        return False


class Probe:
    """A live object whose state is one tensor; it keeps what it was given."""

    def __init__(self, value: float = 0.0) -> None:
        self.tensor = torch.full((300,), value)
        self.loaded = None

    def state_dict(self) -> dict:
        return {"tensor": self.tensor}

    def load_state_dict(self, state: dict) -> None:
        self.loaded = state


def _trained(seed: int = 0, width: int = 16) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(width, width), nn.BatchNorm1d(width), nn.Linear(width, 3))
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    for _ in range(2):
        model(torch.randn(8, width)).pow(2).mean().backward()
        optimizer.step()
        optimizer.zero_grad()
    return model, optimizer


def _extras() -> dict:
    shared = torch.arange(40.0)
    return {
        "epoch": 3,
        "config": {"root": Path("/data/run"), "lr": 0.1, "tags": {"a", "b"}},
        "rest": {"whole": shared, "slice": shared[5:17], "transposed": shared.view(5, 8).t(), "ints": torch.arange(9)},
        "pair": (torch.ones(3, dtype=torch.float16), [torch.zeros(0), torch.tensor(2.5, dtype=torch.float64)]),
    }


def _save(manager: FileCheckpointManager):
    model, optimizer = _trained()
    return manager.save({"model": model, "optimizer": optimizer, **_extras()}, "epoch-000003"), model, optimizer


def _assert_identical(left, right) -> None:
    if isinstance(left, torch.Tensor):
        assert type(left) is type(right) and left.dtype == right.dtype and left.stride() == right.stride()
        assert torch.equal(left, right) and left.requires_grad == right.requires_grad
    elif isinstance(left, dict):
        assert list(left) == list(right)
        for key in left:
            _assert_identical(left[key], right[key])
    elif isinstance(left, (list, tuple)):
        assert type(left) is type(right) and len(left) == len(right)
        for a, b in zip(left, right):
            _assert_identical(a, b)
    else:
        assert left == right


def _restore_both(tmp_path, objects_of, **kwargs):
    """`load_into` of the in-place and of the streamed reader, each into fresh objects: (rest, objects) twice."""
    out = []
    for manager_type in (FileCheckpointManager, Streamed):
        objects = objects_of()
        rest = manager_type(tmp_path, **kwargs).load_into("latest", objects)
        out.append((rest, objects))
    return out


def test_the_manifest_records_the_pieces_of_the_payload(tmp_path, small_pieces):
    path, _, _ = _save(FileCheckpointManager(tmp_path))
    entry = manifest_of(path)["files"]["state.pt"]
    assert entry == file_record(path / "state.pt", chunked=True) and entry["chunks"]["bytes"] == SPAN
    assert FileCheckpointManager(tmp_path)._reads_in_place(path)
    assert FileCheckpointManager(tmp_path).verify("latest") == manifest_of(path)


def test_load_into_matches_the_streamed_reader_bit_for_bit(tmp_path, small_pieces):
    path, model, optimizer = _save(FileCheckpointManager(tmp_path))

    def fresh():
        model, optimizer = _trained(seed=1)
        model[2].double()  # a destination of another dtype: read into new memory, cast by load_state_dict
        return {"model": model, "optimizer": optimizer}

    assert file_read.parse(path / "state.pt") is not None  # a payload the in-place reader takes
    (rest, objects), (streamed_rest, streamed) = _restore_both(tmp_path, fresh)
    _assert_identical(rest, streamed_rest)
    _assert_identical(rest, _extras())
    assert rest["rest"]["slice"].untyped_storage().data_ptr() == rest["rest"]["whole"].untyped_storage().data_ptr()
    _assert_identical(objects["model"].state_dict(), streamed["model"].state_dict())
    _assert_identical(objects["optimizer"].state_dict(), streamed["optimizer"].state_dict())
    _assert_identical(objects["optimizer"].state_dict()["state"][0], optimizer.state_dict()["state"][0])
    assert torch.equal(objects["model"][0].weight, model[0].weight)
    assert objects["model"][2].weight.dtype == torch.float64


def test_load_into_reads_into_the_objects_own_tensors(tmp_path, small_pieces):
    FileCheckpointManager(tmp_path).save({"probe": Probe(5.0), "epoch": 2}, "epoch-000002")
    probe = Probe(0.0)
    target = probe.tensor
    assert FileCheckpointManager(tmp_path).load_into("latest", {"probe": probe}) == {"epoch": 2}
    assert probe.loaded["tensor"] is target and torch.equal(target, torch.full((300,), 5.0))


def test_name_keyed_wrappers_and_a_never_stepped_optimizer_load_in_place(tmp_path, small_pieces):
    model, optimizer = _trained()
    FileCheckpointManager(tmp_path).save(
        {"model": ModelState(model), "optimizer": OptimizerState(model, optimizer)}, "step-000002"
    )

    def fresh():
        model, _ = _trained(seed=1)
        return {"model": ModelState(model), "optimizer": OptimizerState(model, torch.optim.AdamW(model.parameters()))}

    (rest, objects), (_, streamed) = _restore_both(tmp_path, fresh)
    assert rest == {}
    for key in ("model", "optimizer"):
        _assert_identical(objects[key].state_dict(), streamed[key].state_dict())
    _assert_identical(objects["optimizer"].state_dict(), OptimizerState(model, optimizer).state_dict())


def test_the_real_piece_span_is_read_in_place(tmp_path):
    model = nn.Linear(1024, 1024)  # 4 MiB of weights, 12 MiB with the AdamW moments: four 4 MiB pieces
    optimizer = torch.optim.AdamW(model.parameters())
    model(torch.randn(2, 1024)).sum().backward()
    optimizer.step()
    path = FileCheckpointManager(tmp_path).save({"model": model, "optimizer": optimizer}, "step-000001")
    entry = manifest_of(path)["files"]["state.pt"]
    assert entry["chunks"]["bytes"] == checksums.CHUNK_BYTES == 4 << 20
    assert len(entry["chunks"]["xxh3_128"]) == 4  # 12 MiB of tensors plus the archive's pickle and index
    fresh = nn.Linear(1024, 1024)
    fresh_optimizer = torch.optim.AdamW(fresh.parameters())
    weight = fresh.weight.data_ptr()
    assert FileCheckpointManager(tmp_path).load_into("latest", {"model": fresh, "optimizer": fresh_optimizer}) == {}
    assert fresh.weight.data_ptr() == weight and torch.equal(fresh.weight, model.weight)
    _assert_identical(fresh_optimizer.state_dict(), optimizer.state_dict())


def test_pieces_of_an_earlier_span_are_read_in_place(tmp_path, monkeypatch):
    # Checkpoints of earlier versions record 8 MiB pieces: the reader takes the manifest's span.
    model = nn.Linear(1024, 1024)
    optimizer = torch.optim.AdamW(model.parameters())
    model(torch.randn(2, 1024)).sum().backward()
    optimizer.step()
    with monkeypatch.context() as patch:
        patch.setattr(checksums, "CHUNK_BYTES", 8 << 20)
        path = FileCheckpointManager(tmp_path).save({"model": model, "optimizer": optimizer}, "step-000001")
    assert manifest_of(path)["files"]["state.pt"]["chunks"]["bytes"] == 8 << 20
    spans = []
    read_pieces = file_read.read_pieces

    def spy(path, size, reads, pieces, *args):
        spans.append(None if pieces is None else pieces[0])
        return read_pieces(path, size, reads, pieces, *args)

    monkeypatch.setattr("danling.checkpoint.file.read_pieces", spy)
    fresh = nn.Linear(1024, 1024)
    fresh_optimizer = torch.optim.AdamW(fresh.parameters())
    assert FileCheckpointManager(tmp_path).load_into("latest", {"model": fresh, "optimizer": fresh_optimizer}) == {}
    assert spans == [8 << 20]
    assert torch.equal(fresh.weight, model.weight)
    _assert_identical(fresh_optimizer.state_dict(), optimizer.state_dict())


def test_a_load_in_place_reads_the_manifest_once(tmp_path, small_pieces, monkeypatch):
    _save(FileCheckpointManager(tmp_path))
    from danling.checkpoint import manifest

    reads = []
    read_manifest = manifest.read_manifest
    counted = lambda directory: reads.append(directory) or read_manifest(directory)  # noqa: E731
    monkeypatch.setattr(manifest, "read_manifest", counted)
    monkeypatch.setattr("danling.checkpoint.file.read_manifest", counted, raising=False)  # its own import, if any
    fresh, fresh_optimizer = _trained(seed=1)
    FileCheckpointManager(tmp_path).load_into("latest", {"model": fresh, "optimizer": fresh_optimizer})
    assert len(reads) == 1  # by the verification; deciding to read in place parsed it a second time


def _record_offset(path, name: str) -> int:
    return torch._C.PyTorchFileReader(str(path)).get_record_offset(name)


@pytest.mark.parametrize("region", ["pickle", "data", "index"])
def test_a_flipped_byte_is_refused_naming_the_file(tmp_path, small_pieces, region):
    path, _, _ = _save(FileCheckpointManager(tmp_path))
    payload = path / "state.pt"
    size = payload.stat().st_size
    offset = {"pickle": _record_offset(payload, "data.pkl") + 20, "data": size // 2, "index": size - 30}[region]
    flip_byte(payload, offset)
    model, optimizer = _trained(seed=1)
    before = copy.deepcopy(model.state_dict())
    with pytest.raises(CheckpointError, match="corrupt") as info:
        FileCheckpointManager(tmp_path).load_into("latest", {"model": model, "optimizer": optimizer})
    assert str(payload) in str(info.value)
    if region == "data":  # the damaged piece is named; the pieces before it may have reached the objects
        start = offset // SPAN * SPAN
        assert f"of bytes {start}-{start + SPAN} does not match" in str(info.value)
    if region == "pickle":  # nothing reached the live objects
        _assert_identical(model.state_dict(), before)


def test_a_damaged_first_data_piece_reaches_no_live_tensor(tmp_path, small_pieces):
    FileCheckpointManager(tmp_path).save({"probe": Probe(5.0)}, "epoch-000001")
    payload = tmp_path / "epoch-000001" / "state.pt"
    flip_byte(payload, _record_offset(payload, "data/0") + 4)
    probe = Probe(1.0)
    with pytest.raises(CheckpointError, match=f"{payload} is corrupt: its XXH3-128 of bytes") as info:
        FileCheckpointManager(tmp_path).load_into("latest", {"probe": probe})
    assert probe.loaded is None and torch.equal(probe.tensor, torch.full((300,), 1.0))
    assert "already read into the live objects" not in str(info.value)


def test_a_later_damaged_piece_says_the_objects_may_hold_part_of_the_checkpoint(tmp_path, small_pieces):
    FileCheckpointManager(tmp_path).save({"probe": Probe(5.0)}, "epoch-000001")
    payload = tmp_path / "epoch-000001" / "state.pt"
    flip_byte(payload, _record_offset(payload, "data/0") + 1100)  # the tensor's second piece
    with pytest.raises(CheckpointError, match="load another checkpoint into them"):
        FileCheckpointManager(tmp_path).load_into("latest", {"probe": Probe(1.0)})


def test_a_torn_payload_is_refused(tmp_path, small_pieces):
    path, _, _ = _save(FileCheckpointManager(tmp_path))
    (path / "state.pt").write_bytes((path / "state.pt").read_bytes()[:-10])
    with pytest.raises(CheckpointError, match="torn"):
        FileCheckpointManager(tmp_path).load_into("latest", {"probe": Probe()})


class Unpieced(FileCheckpointManager):
    """A manager as earlier versions wrote: the payload's manifest entry has no pieces."""

    def _payload_stream(self, raw):
        return WritebackWriter(raw, self.checksum)


@pytest.mark.parametrize("writer", ["unpieced", "sha256"])
def test_checkpoints_without_pieces_load_through_the_streamed_reader(tmp_path, small_pieces, writer, monkeypatch):
    manager = Unpieced(tmp_path) if writer == "unpieced" else FileCheckpointManager(tmp_path, checksum="sha256")
    path, model, optimizer = _save(manager)
    assert "chunks" not in manifest_of(path)["files"]["state.pt"]
    reader = FileCheckpointManager(tmp_path)

    def no_piece_reads(*args, **kwargs):
        raise AssertionError("a payload without pieces was read piece by piece")

    monkeypatch.setattr("danling.checkpoint.file.read_pieces", no_piece_reads)
    fresh, fresh_optimizer = _trained(seed=1)
    _assert_identical(reader.load_into("latest", {"model": fresh, "optimizer": fresh_optimizer}), _extras())
    _assert_identical(fresh.state_dict(), model.state_dict())
    _assert_identical(fresh_optimizer.state_dict(), optimizer.state_dict())


def test_exclusions_and_missing_entries_behave_as_in_the_streamed_reader(tmp_path, small_pieces):
    FileCheckpointManager(tmp_path).save({**_extras(), "optimizer": _trained()[1]}, "epoch-000004")
    excluded = {"exclude_from_loading": ["optimizer", "rest.whole", "pair"]}
    (rest, objects), (streamed_rest, streamed) = _restore_both(
        tmp_path, lambda: {"optimizer": _trained(seed=1)[1]}, **excluded
    )
    _assert_identical(rest, streamed_rest)
    assert set(rest) == {"epoch", "config", "rest"} and set(rest["rest"]) == {"slice", "transposed", "ints"}
    _assert_identical(objects["optimizer"].state_dict(), streamed["optimizer"].state_dict())
    assert objects["optimizer"].state_dict()["state"][0]["step"] == 2  # kept its own state
    assert not torch.equal(
        objects["optimizer"].state_dict()["state"][0]["exp_avg"], _trained()[1].state_dict()["state"][0]["exp_avg"]
    )
    for manager_type in (FileCheckpointManager, Streamed):
        probe = Probe(1.0)
        with pytest.raises(CheckpointError, match=r"no 'probe' entry to load into the Probe.*exclude_from_loading"):
            manager_type(tmp_path).load_into("latest", {"probe": probe})
        assert probe.loaded is None and torch.equal(probe.tensor, torch.full((300,), 1.0))


def test_a_planted_payload_is_refused(tmp_path, small_pieces):
    marker = tmp_path / "marker"

    class Planted:
        def __reduce__(self):
            return (open, (str(marker), "w"))

    path = FileCheckpointManager(tmp_path / "ckpt").save({"probe": Probe()}, "epoch-000000")
    torch.save(
        {"probe": {"tensor": torch.zeros(300)}, "planted": Planted(), "pad": torch.zeros(2000)}, path / "state.pt"
    )
    manifest = manifest_of(path)
    manifest["files"]["state.pt"] = file_record(path / "state.pt", chunked=True)
    (path / MANIFEST_NAME).write_text(json.dumps(manifest))
    assert FileCheckpointManager(tmp_path / "ckpt")._reads_in_place(path)
    with pytest.raises(UnsafePickleError, match="posix.open|builtins.open|io.open"):
        FileCheckpointManager(tmp_path / "ckpt").load_into("latest", {"probe": Probe()})
    assert not marker.exists()


def test_other_map_locations_and_unusual_payloads_take_the_streamed_reader(tmp_path, small_pieces, monkeypatch):
    _, saved, _ = _save(FileCheckpointManager(tmp_path))
    calls = []
    real = FileCheckpointManager._read_streamed
    monkeypatch.setattr(
        FileCheckpointManager,
        "_read_streamed",
        lambda self, path, *args: (calls.append(path), real(self, path, *args))[1],
    )
    model, optimizer = _trained(seed=1)
    objects = {"model": model, "optimizer": optimizer}
    rest = FileCheckpointManager(tmp_path).load_into("latest", objects, map_location=lambda storage, _: storage)
    _assert_identical(rest, _extras())
    _assert_identical(model.state_dict(), saved.state_dict())
    assert len(calls) == 1
    monkeypatch.setattr("danling.checkpoint.file.parse", lambda *args: None)  # a payload it does not understand
    model = _trained(seed=2)[0]
    rest = FileCheckpointManager(tmp_path).load_into("latest", {"model": model})
    assert len(calls) == 2 and set(rest) == {"optimizer", *_extras()}
    _assert_identical(model.state_dict(), saved.state_dict())


def test_a_file_verified_earlier_in_the_scope_is_read_without_hashing_it_again(tmp_path, small_pieces, monkeypatch):
    _, model, optimizer = _save(FileCheckpointManager(tmp_path))
    manager = FileCheckpointManager(tmp_path)
    hashed = []
    real = file_read.xxhash.xxh3_128_hexdigest
    monkeypatch.setattr(file_read.xxhash, "xxh3_128_hexdigest", lambda data: (hashed.append(1), real(data))[1])
    fresh, fresh_optimizer = _trained(seed=1)
    with verification_scope():
        manager.load("latest")
        rest = manager.load_into("latest", {"model": fresh, "optimizer": fresh_optimizer})
    assert not hashed
    _assert_identical(rest, _extras())
    _assert_identical(fresh.state_dict(), model.state_dict())
    _assert_identical(fresh_optimizer.state_dict(), optimizer.state_dict())


def test_payloads_the_restricted_reader_does_not_take_are_left_to_torch(tmp_path):
    plain = {"weight": torch.ones(2), "names": ["a"], "betas": (0.9, 0.99)}
    for name, payload in {
        "plain": plain,
        "parameter": {**plain, "p": nn.Parameter(torch.ones(2))},
        "storage": {**plain, "s": torch.ones(2).untyped_storage()},
        "device": {**plain, "d": torch.device("cpu")},
        "frozenset": {**plain, "f": frozenset([1])},  # the restricted unpickler admits it, torch's does not
        "date": {**plain, "d": datetime.date(2020, 1, 1)},
    }.items():
        torch.save(payload, tmp_path / name)
        parsed = file_read.parse(tmp_path / name)
        assert (parsed is not None) == (name == "plain"), name


def test_a_payload_torch_refuses_is_refused_by_both_readers(tmp_path, small_pieces):
    FileCheckpointManager(tmp_path).save({"probe": Probe(), "when": datetime.date(2020, 1, 1)}, "epoch-000001")
    for manager_type in (FileCheckpointManager, Streamed):
        with pytest.raises(UnsafePickleError, match="datetime.date"):
            manager_type(tmp_path).load_into("latest", {"probe": Probe()})
