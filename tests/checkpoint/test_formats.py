"""The format registry: detection of each layout, unknown layouts, and a format registered by a test."""

from __future__ import annotations

import pytest
import torch

from danling.checkpoint import (
    CheckpointError,
    CheckpointNotFoundError,
    FileCheckpointManager,
    checkpoint_formats,
    detect_format,
    open_checkpoint_reader,
    read_checkpoint,
    register_format,
    unregister_format,
)
from danling.checkpoint.dcp import TorchDistributedCheckpointManager


@pytest.fixture
def saved(tmp_path):
    """One checkpoint of each built-in backend, plus a plain torch.save file."""
    file_path = FileCheckpointManager(tmp_path / "file").save({"step": 1}, "step-000001")
    dcp_path = TorchDistributedCheckpointManager(tmp_path / "dcp").save({"step": 2, "w": torch.ones(2)}, "step-000002")
    plain = tmp_path / "weights.pt"
    torch.save({"step": 3}, plain)
    return {"file": file_path, "dcp": dcp_path, "plain": plain}


def test_detects_each_builtin_layout(saved):
    file_path, dcp_path = saved["file"], saved["dcp"]
    for path in (file_path, file_path / "state.pt", file_path.parent / "latest.pointer", saved["plain"]):
        assert detect_format(path) == "file", path
    for path in (dcp_path, dcp_path / ".metadata", dcp_path.parent / "latest.pointer"):
        assert detect_format(path) == "dcp", path
    (dcp_path / "manifest.json").unlink()  # a DCP directory from elsewhere: recognised by its layout
    assert detect_format(dcp_path) == "dcp"
    assert checkpoint_formats()[-2:] == ("dcp", "file")


def test_read_checkpoint_and_readers_follow_the_format(saved):
    assert read_checkpoint(saved["dcp"])["step"] == 2
    assert read_checkpoint(saved["plain"]) == {"step": 3}
    file_manager = FileCheckpointManager(saved["file"].parent, exclude_from_loading=["w"])
    assert open_checkpoint_reader(saved["file"], manager=file_manager) is file_manager
    reader = open_checkpoint_reader(saved["dcp"], manager=file_manager)
    assert isinstance(reader, TorchDistributedCheckpointManager) and reader.load_only
    assert reader.load(saved["dcp"]) == {"step": 2}  # the exclusions of the manager in use carry over


def test_unknown_and_missing_layouts_are_named(tmp_path):
    odd = tmp_path / "odd"
    odd.mkdir()
    (odd / "something.bin").write_bytes(b"x")
    with pytest.raises(CheckpointError, match=f"{odd} is not a checkpoint of any known format.*dcp, file"):
        detect_format(odd)
    with pytest.raises(CheckpointNotFoundError, match="nowhere"):
        detect_format(tmp_path / "nowhere")


class TaggedManager(FileCheckpointManager):
    backend = "tagged"
    payload_name = "tagged.bin"


def _is_tagged(path):
    return (path / TaggedManager.payload_name).is_file() or path.name == TaggedManager.payload_name


@pytest.fixture
def tagged_format():
    fmt = register_format("tagged", detect=_is_tagged, manager=TaggedManager)
    try:
        yield fmt
    finally:
        unregister_format("tagged")


def test_a_registered_format_is_detected_and_read(tmp_path, tagged_format):
    path = TaggedManager(tmp_path).save({"step": 4}, "step-000004")
    assert checkpoint_formats()[0] == "tagged"
    assert detect_format(path) == detect_format(path / "tagged.bin") == "tagged"
    reader = open_checkpoint_reader(path)
    assert type(reader) is TaggedManager and reader.load_only
    assert reader.load(path) == read_checkpoint(path) == {"step": 4}
    (path / "manifest.json").unlink()
    assert detect_format(path) == "tagged"  # its own detect, tried before the built-in ones
    with pytest.raises(ValueError, match="'tagged' is already registered"):
        register_format("tagged", detect=_is_tagged, manager=TaggedManager)
    with pytest.raises(TypeError, match="manager must be callable"):
        register_format("other", detect=_is_tagged, manager="TaggedManager")


def test_unregistering_an_unknown_format_lists_the_known_ones():
    with pytest.raises(KeyError, match="no checkpoint format 'nope'.*'file'"):
        unregister_format("nope")
