"""DCP data files are hashed while DCP writes them: no second read, the same records as reading them back."""

from __future__ import annotations

import os
import warnings

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch import nn

from danling.checkpoint import FileCheckpointManager, _dcp_io, _writeback, checksums
from danling.checkpoint._dcp_io import RecordingWriter, _HashingFileSystem
from danling.checkpoint.checksums import CHUNK_BYTES, HashingWriter, file_record
from danling.checkpoint.dcp import ModelState, TorchDistributedCheckpointManager
from danling.checkpoint.manifest import read_manifest


@pytest.fixture
def read_back(monkeypatch):
    """Names of the files hashed by reading them (the read-back pass a save should not need)."""
    names: list[str] = []
    digest_file = checksums._digest_file

    def recording(path, *args, **kwargs):
        names.append(os.path.basename(path))
        return digest_file(path, *args, **kwargs)

    monkeypatch.setattr(checksums, "_digest_file", recording)
    return names


@pytest.fixture
def synced(monkeypatch):
    """Names of the files fsynced."""
    names: list[str] = []
    fsync = os.fsync

    def recording(fd):
        names.append(os.path.basename(os.readlink(f"/proc/self/fd/{fd}")))
        return fsync(fd)

    monkeypatch.setattr(os, "fsync", recording)
    return names


@pytest.mark.parametrize(
    "sizes",
    [
        [],
        [5],
        [CHUNK_BYTES],
        [CHUNK_BYTES - 1, 1, CHUNK_BYTES],  # pieces ending exactly where writes end
        [3, 2 * CHUNK_BYTES + 7, 1 << 20, 11],  # one write spanning whole pieces, small ones across a boundary
    ],
)
@pytest.mark.parametrize("checksum", ["xxh3_128", "sha256"])
def test_chunked_writer_records_what_reading_the_file_back_records(tmp_path, sizes, checksum):
    path = tmp_path / "data.bin"
    data = torch.randint(0, 256, (sum(sizes),), dtype=torch.uint8, generator=torch.Generator().manual_seed(0))
    view = memoryview(data.numpy())
    with open(path, "wb") as raw:
        writer, start = HashingWriter(raw, checksum, chunked=True), 0
        for size in sizes:
            writer.write(view[start : start + size])
            start += size
    expected = file_record(path, checksum=checksum, chunked=True)
    assert writer.record() == expected
    assert ("chunks" in expected) == (checksum == "xxh3_128" and sum(sizes) > CHUNK_BYTES)


def test_chunked_writer_cuts_pieces_inside_buffers_of_any_item_format(tmp_path):
    path = tmp_path / "data.bin"
    values = torch.randn(3 * CHUNK_BYTES // 4 + 5)  # float32: a piece boundary falls inside each write
    with open(path, "wb") as raw:
        writer = HashingWriter(raw, "xxh3_128", chunked=True)
        writer.write(b"head")
        for part in values.split(CHUNK_BYTES // 3):
            writer.write(memoryview(part.numpy()))
    assert writer.record() == file_record(path, chunked=True)
    assert writer.size == 4 + values.numel() * 4


def test_dcp_save_records_its_files_without_reading_them_back(tmp_path, read_back, synced):
    manager = TorchDistributedCheckpointManager(tmp_path)
    model = nn.Linear(2000, 1500)  # 12 MB of weights: the data file spans pieces, the last one partial
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        saved = manager.save({"model": ModelState(model), "config": {"lr": 0.5}}, "step-1")
    files = sorted(saved.glob("*.distcp"))
    assert files and not [name for name in read_back if name.endswith(".distcp")]
    assert {path.name for path in files} <= set(synced)
    records = read_manifest(saved)["files"]
    for path in files:  # the records a read-back gives, pieces included
        assert records[path.name] == file_record(path, chunked=True)
    pieces = {path.name: len(records[path.name].get("chunks", {}).get("xxh3_128", [])) for path in files}
    assert max(pieces.values()) > 1
    assert all(count in (0, -(-path.stat().st_size // CHUNK_BYTES)) for path, count in zip(files, pieces.values()))
    expected = {key: value.clone() for key, value in model.state_dict().items()}
    with torch.no_grad():
        model.weight.zero_()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        manager.load_into("step-1", {"model": ModelState(model)})  # verifies every file, piece by piece
    assert all(torch.equal(value, expected[key]) for key, value in model.state_dict().items())


def test_a_file_not_written_front_to_back_is_read_back(tmp_path, read_back):
    fs = _HashingFileSystem("xxh3_128")
    with fs.create_stream(tmp_path / "a.distcp", "wb") as stream:  # appending only, a seek to the end included
        stream.write(b"x" * 100)
        assert stream.seek(0, os.SEEK_END) == stream.tell() == 100
        stream.write(b"y")
        stream.close()
    with fs.create_stream(tmp_path / "b.distcp", "wb") as stream:  # a byte rewritten after a seek back
        stream.write(b"x" * 100)
        stream.seek(10)
        stream.write(b"z")
        stream.close()
    with fs.create_stream(tmp_path / "c.distcp", "wb") as stream:  # bytes written past the wrapper
        stream.write(b"x" * 100)
        stream.flush()
        os.write(stream.fileno(), b"w")
        stream.close()
    assert read_back == ["b.distcp", "c.distcp"]
    records = fs.take()
    names = ("a.distcp", "b.distcp", "c.distcp")
    assert records == {name: file_record(tmp_path / name, chunked=True) for name in names}
    assert records["c.distcp"]["size"] == 101 and fs.take() == {}


def test_a_failed_write_records_nothing(tmp_path):
    fs = _HashingFileSystem("xxh3_128")
    with pytest.raises(RuntimeError), fs.create_stream(tmp_path / "a.distcp", "wb") as stream:
        stream.write(b"x")
        raise RuntimeError("the state could not be serialised")
    assert fs.take() == {}


def test_recording_writer_records_every_file_of_a_multithreaded_write(tmp_path, read_back):
    writer = RecordingWriter(str(tmp_path), "xxh3_128")
    writer.thread_count = 2  # one file per thread
    state = {f"t{index}": torch.randn(1 << 18) for index in range(4)}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        dcp.save(state, storage_writer=writer, no_dist=True)
    names = sorted(path.name for path in tmp_path.glob("*.distcp"))
    assert len(names) == 2 and not read_back
    assert writer.records == {name: file_record(tmp_path / name, chunked=True) for name in names}


@pytest.mark.skipif(_writeback.START_WRITEBACK is None, reason="the OS offers no way to start writeback early")
def test_the_disk_starts_writing_a_data_file_out_while_it_is_being_written(tmp_path, monkeypatch):
    started = []
    start_writeback = _writeback.START_WRITEBACK

    def recording(fd, offset, count, flags):
        written = os.fstat(fd).st_size  # the range reached the kernel before its writeback was asked for
        started.append((offset, count, written >= offset + count, start_writeback(fd, offset, count, flags)))
        return started[-1][-1]

    monkeypatch.setattr(_writeback, "START_WRITEBACK", recording)
    fs, step = _HashingFileSystem("xxh3_128"), _dcp_io._HashedFile.writeback_bytes
    with fs.create_stream(tmp_path / "a.distcp", "wb") as stream:
        for _ in range(8):  # every second write crosses a writeback step: four requests
            stream.write(b"h" * 100)  # small writes stay in the file object's buffer until flushed
            stream.write(bytes(3 * step // 4))
        stream.close()
    assert len(started) >= 4 and all(reached and result == 0 for _, _, reached, result in started)
    ends = [0] + [offset + count for offset, count, _, _ in started]
    assert [offset for offset, _, _, _ in started] == ends[:-1]  # consecutive ranges from the start
    assert all(count >= step for _, count, _, _ in started) and ends[-1] <= fs.take()["a.distcp"]["size"]


@pytest.mark.skipif(_writeback.START_WRITEBACK is None, reason="the OS offers no way to start writeback early")
def test_the_file_manager_starts_writing_its_payload_out_while_torch_save_writes_it(tmp_path, monkeypatch):
    started = []
    start_writeback = _writeback.START_WRITEBACK

    def recording(fd, offset, count, flags):
        started.append((offset, count))
        return start_writeback(fd, offset, count, flags)

    monkeypatch.setattr(_writeback, "START_WRITEBACK", recording)
    manager = FileCheckpointManager(tmp_path / "ckpt")
    state = {f"layer{index}": torch.randn(1 << 20) for index in range(10)}  # 40 MiB in 4 MiB writes
    path = manager.save(state, "one")
    manager.close()
    assert [offset for offset, _ in started] == [0] + [offset + count for offset, count in started][:-1]
    assert len(started) >= 2 and all(count >= _writeback.WritebackWriter.writeback_bytes for _, count in started)
    loaded = manager.load(path)  # the recorded digest verifies
    assert all(torch.equal(loaded[key], value) for key, value in state.items())
