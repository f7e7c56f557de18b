"""A planted pickle payload never runs at any checkpoint entry point unless the file is trusted.

The payload's `__reduce__` calls `open(marker, "w")`: if any loader unpickled it with the full
unpickler, the marker file would appear. Every entry point must refuse it with an error that
names the refused type and the opt-in (`trusted=True` / `checkpoint.trust_pickle`).
"""

from __future__ import annotations

import io
import json
import pickle
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch

import danling
from danling.checkpoint import CheckpointError, FileCheckpointManager, read_checkpoint
from danling.checkpoint.manifest import MANIFEST_NAME, file_record
from danling.checkpoint.unpickling import UnsafePickleError, torch_load
from danling.cli import main as cli_main
from tests.runners._toy import ToyRunner, toy_config

REFUSED = r"(builtins|io)\.open.*trusted=True.*checkpoint\.trust_pickle"


class Planted:
    """Unpickling this calls `open(marker, "w")`, creating the marker file."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (open, (str(self.marker), "w"))


def _payload(marker: Path, **extra) -> dict:
    return {"runner": toy_config(marker.parent), "model": {"weight": Planted(marker)}, **extra}


def _rehash(directory: Path) -> None:
    """Recompute the manifest as an attacker would, so verification passes."""
    manifest = json.loads((directory / MANIFEST_NAME).read_text())
    files = {p.relative_to(directory).as_posix(): file_record(p) for p in directory.rglob("*") if p.is_file()}
    manifest["files"] = {key: value for key, value in files.items() if key != MANIFEST_NAME}
    (directory / MANIFEST_NAME).write_text(json.dumps(manifest))


def _plant_file_checkpoint(directory: Path, marker: Path) -> Path:
    path = FileCheckpointManager(directory).save({"weight": torch.zeros(1)}, "epoch-000000")
    torch.save(_payload(marker), path / "state.pt")
    _rehash(path)
    return path


@pytest.fixture
def marker(tmp_path):
    path = tmp_path / "marker"
    yield path
    assert not path.exists(), "the planted payload ran"


def test_manager_and_read_checkpoint_refuse_planted_payload(tmp_path, marker):
    path = _plant_file_checkpoint(tmp_path / "ckpt", marker)
    plain = tmp_path / "plain.pt"
    torch.save(_payload(marker), plain)
    buffer = io.BytesIO()
    torch.save(_payload(marker), buffer)
    for load in (
        lambda: FileCheckpointManager(tmp_path / "ckpt").load("latest"),
        lambda: FileCheckpointManager(tmp_path / "ckpt").load(plain),
        lambda: read_checkpoint(path),
        lambda: read_checkpoint(path / "state.pt"),
        lambda: read_checkpoint(plain),
        lambda: read_checkpoint(buffer.getvalue()),
    ):
        with pytest.raises(UnsafePickleError, match=REFUSED):
            load()


def test_trusted_opt_in_uses_the_full_unpickler(tmp_path):
    marker = tmp_path / "marker"
    plain = tmp_path / "plain.pt"
    torch.save(_payload(marker), plain)
    read_checkpoint(plain, trusted=True)
    assert marker.exists()


def test_dcp_metadata_and_entries_refuse_planted_payload(tmp_path, marker):
    from danling.checkpoint.dcp import TorchDistributedCheckpointManager, read_dcp_checkpoint

    # a plain (non-tensor) entry: DCP itself would torch.load it with weights_only=False
    entry = TorchDistributedCheckpointManager(tmp_path / "entry").save(
        {"model": {"w": torch.ones(2)}, "extra": {"obj": Planted(marker)}}, "epoch-000000"
    )
    with pytest.raises(UnsafePickleError, match=REFUSED):
        read_dcp_checkpoint(entry)
    # the .metadata index, which DCP reads with plain pickle
    index = TorchDistributedCheckpointManager(tmp_path / "index").save({"model": {"w": torch.ones(2)}}, "epoch-000000")
    (index / ".metadata").write_bytes(pickle.dumps(Planted(marker)))
    _rehash(index)
    with pytest.raises(UnsafePickleError, match=REFUSED):
        read_dcp_checkpoint(index)
    with pytest.raises(UnsafePickleError, match=REFUSED):
        read_checkpoint(index)
    assert cli_main(["ckpt", str(index)]) != 0


def test_danling_load_pickle_refuses_planted_payload(tmp_path, marker):
    path = tmp_path / "x.pkl"
    path.write_bytes(pickle.dumps({"a": Planted(marker)}))
    with pytest.raises(pickle.UnpicklingError, match=REFUSED):
        danling.load(path)


def test_runner_entry_points_refuse_planted_payload(tmp_path, marker):
    directory = _plant_file_checkpoint(tmp_path / "ckpt", marker)
    plain = tmp_path / "plain.pt"
    torch.save(_payload(marker), plain)
    for source in (directory, plain):
        for key in ("resume", "pretrained"):
            with pytest.raises(UnsafePickleError, match=REFUSED):
                ToyRunner(toy_config(tmp_path / "run", **{key: str(source)}))
        with pytest.raises(UnsafePickleError, match=REFUSED):
            ToyRunner.from_checkpoint(source)
        with pytest.raises(UnsafePickleError, match=REFUSED):
            ToyRunner.read_config(source)


def test_auto_resume_refuses_planted_checkpoint(tmp_path, marker):
    with ToyRunner(toy_config(tmp_path, epochs=1)) as runner:
        runner.train()
        latest = runner.checkpoint_manager.latest
    torch.save(_payload(marker), latest / "state.pt")
    _rehash(latest)
    with pytest.raises(UnsafePickleError, match=REFUSED):
        ToyRunner(toy_config(tmp_path, epochs=1, auto_resume=True))


def test_runner_checkpoints_load_without_trust(tmp_path):
    """danling's own payloads need nothing beyond the allow-list (also through from_checkpoint)."""
    with ToyRunner(toy_config(tmp_path, epochs=1)) as runner:
        runner.train()
        latest = runner.checkpoint_manager.latest
    with ToyRunner.from_checkpoint(latest) as restored:
        assert restored.train_state.epoch == 1


class System:
    """Unpickling this calls `os.system` (pickled as the global `posix.system`)."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        import os

        return (os.system, (f"touch {self.marker}",))


def test_a_refusal_names_the_blocked_global_and_the_opt_in_never_weights_only(tmp_path, marker):
    plain = tmp_path / "plain.pt"
    torch.save({"model": System(marker)}, plain)
    with pytest.raises(UnsafePickleError) as info:
        read_checkpoint(plain)
    message = str(info.value)
    assert "needs posix.system," in message and "checkpoint.trust_pickle" in message
    assert "weights_only" not in message and "Weights only" not in message


def test_damaged_bytes_are_reported_as_a_corrupt_file_not_as_a_type_to_trust(tmp_path):
    # Random bytes failed inside torch's reader as IndexError or KeyError tracebacks, or were
    # refused as "needs Unsupported operand 105 ... load it with trusted=True": advice to run them.
    path = tmp_path / "weights.pt"
    kinds = set()
    for seed in range(300):
        path.write_bytes(np.random.RandomState(seed).bytes(300))
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # torch warns about the "protocol" the bytes spell
            with pytest.raises(CheckpointError, match="corrupt") as error:
                torch_load(path)
        kinds.add(type(error.value.__cause__).__name__)
        assert "needs" not in str(error.value)
    assert len(kinds) > 1  # several ways of failing inside torch, one finding
