"""Corruption, torn writes, crash safety and fallback to the newest checkpoint that verifies."""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from danling.checkpoint import CheckpointError, FileCheckpointManager, read_checkpoint
from danling.checkpoint.manifest import HashingWriter

CHILD = Path(__file__).with_name("_stalling_writer.py")
REPO = Path(__file__).resolve().parents[2]


def save_epochs(directory: Path, count: int, **kwargs) -> FileCheckpointManager:
    manager = FileCheckpointManager(directory, **kwargs)
    for epoch in range(1, count + 1):
        manager.save({"epoch": epoch, "weight": torch.full((64,), float(epoch))}, f"epoch-{epoch:06d}")
    return manager


def flip_byte(path: Path, offset: int | None = None) -> None:
    data = bytearray(path.read_bytes())
    offset = len(data) // 2 if offset is None else offset
    data[offset] ^= 0xFF
    path.write_bytes(bytes(data))


def test_byte_flip_is_refused_naming_the_file(tmp_path):
    manager = save_epochs(tmp_path, 1)
    payload = tmp_path / "epoch-000001" / "state.pt"
    flip_byte(payload)
    for ref in ("latest", tmp_path / "epoch-000001", payload):
        with pytest.raises(CheckpointError, match="corrupt") as info:
            manager.load(ref)
        assert str(payload) in str(info.value)
    with pytest.raises(CheckpointError, match="corrupt"):
        read_checkpoint(tmp_path / "epoch-000001")


def test_torn_and_incomplete_checkpoints_are_refused(tmp_path):
    manager = save_epochs(tmp_path, 3)
    torn = tmp_path / "epoch-000001" / "state.pt"
    torn.write_bytes(torn.read_bytes()[:100])
    with pytest.raises(CheckpointError, match=r"torn: 100 bytes") as info:
        manager.load("epoch-000001")
    assert str(torn) in str(info.value)
    (tmp_path / "epoch-000002" / "manifest.json").unlink()
    with pytest.raises(CheckpointError, match=r"epoch-000002 has no manifest.json"):
        manager.load("epoch-000002")
    (tmp_path / "epoch-000003" / "manifest.json").write_text("{not json")
    with pytest.raises(CheckpointError, match=r"epoch-000003/manifest.json cannot be read"):
        manager.load("epoch-000003")


def test_fallback_to_newest_valid_checkpoint_is_logged(tmp_path, caplog):
    manager = save_epochs(tmp_path, 4)
    flip_byte(tmp_path / "epoch-000004" / "state.pt")
    (tmp_path / "epoch-000003" / "state.pt").unlink()
    with caplog.at_level(logging.WARNING, logger="danling.checkpoint"):
        found = manager.latest_valid()
    assert found == tmp_path / "epoch-000002"
    assert manager.load(found)["epoch"] == 2
    messages = [record.getMessage() for record in caplog.records]
    assert any("epoch-000004" in m and "corrupt" in m for m in messages)
    assert any("epoch-000003" in m and "missing" in m for m in messages)
    assert any("falling back to checkpoint" in m and "epoch-000002" in m for m in messages)


def test_latest_valid_without_any_good_checkpoint(tmp_path):
    assert FileCheckpointManager(tmp_path / "empty").latest_valid() is None
    manager = save_epochs(tmp_path, 1)
    flip_byte(tmp_path / "epoch-000001" / "state.pt", offset=0)
    assert manager.latest_valid() is None


def test_interrupted_replacement_and_leftovers_are_recovered(tmp_path):
    save_epochs(tmp_path, 1)
    os.rename(tmp_path / "epoch-000001", tmp_path / ".old-epoch-000001-0123abcd")
    (tmp_path / ".tmp-epoch-000002-deadbeef").mkdir()
    (tmp_path / ".tmp-epoch-000002-deadbeef" / "state.pt").write_bytes(b"partial")
    manager = FileCheckpointManager(tmp_path)
    assert manager.load("latest")["epoch"] == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == ["epoch-000001", "latest.pointer"]


def test_sigkill_during_async_save_keeps_previous_checkpoint(tmp_path):
    proc = subprocess.Popen(
        [sys.executable, str(CHILD), str(tmp_path)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        cwd=REPO,
    )
    try:
        line = proc.stdout.readline()
        assert line == b"writing\n", proc.stderr.read().decode()
        partial = [p for p in tmp_path.iterdir() if p.name.startswith(".tmp-step-000002-")]
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=60)
    finally:
        if proc.poll() is None:  # only when an assertion above failed
            proc.kill()
            proc.wait()
        for stream in (proc.stdin, proc.stdout, proc.stderr):
            stream.close()
    assert proc.returncode == -signal.SIGKILL
    # the kill landed mid-write: a half-written payload exists, no manifest, nothing published
    assert len(partial) == 1 and not (partial[0] / "manifest.json").exists()
    assert 0 < (partial[0] / "state.pt").stat().st_size < (4 << 20) * 4
    assert not (tmp_path / "step-000002").exists()

    reader = FileCheckpointManager(tmp_path, load_only=True)
    assert reader.latest_valid() == tmp_path / "step-000001"
    assert reader.load("latest")["step"] == 1

    writer = FileCheckpointManager(tmp_path)  # a restarted run cleans up and continues
    assert not partial[0].exists()
    writer.save({"step": 2}, "step-000002")
    assert writer.load("latest")["step"] == 2


@settings(max_examples=15, deadline=None)
@given(
    keep=st.integers(min_value=1, max_value=3),
    plan=st.lists(st.sampled_from(["plain", "best", "named"]), min_size=1, max_size=6),
)
def test_retention_invariant(tmp_path_factory, keep, plan):
    directory = tmp_path_factory.mktemp("retention")
    manager = FileCheckpointManager(directory, keep_latest_k=keep)
    saved = []
    for step, kind in enumerate(plan, start=1):
        aliases = {"plain": ("latest",), "best": ("latest", "best"), "named": ("latest", f"tag{step}")}[kind]
        saved.append(manager.save({"step": step}, f"step-{step:06d}", aliases=aliases).name)
    remaining = {p.name for p in manager.checkpoints()}
    protected = {p.name for p in manager.aliases().values()}
    assert remaining == set(saved[-keep:]) | protected
    for path in manager.checkpoints():
        assert manager.load(path)["step"] == int(path.name.split("-")[1])


def test_new_manager_leaves_an_in_flight_write_alone(tmp_path):
    started, release = threading.Event(), threading.Event()

    class GatedWriter(HashingWriter):
        def write(self, data):
            started.set()
            release.wait()
            return super().write(data)

    class GatedManager(FileCheckpointManager):
        def _payload_stream(self, raw):
            return GatedWriter(raw)

    writer = GatedManager(tmp_path, async_save=True)
    writer.save({"step": 1}, "step-000001")
    assert started.wait(timeout=60)
    (in_progress,) = [p for p in tmp_path.iterdir() if p.name.startswith(".tmp-")]
    FileCheckpointManager(tmp_path)  # e.g. a runner swapping in a new manager
    assert in_progress.exists()
    release.set()
    assert writer.close()
    assert FileCheckpointManager(tmp_path).load("latest")["step"] == 1


def test_a_runner_restore_hashes_each_file_once_and_a_scope_still_sees_changes(tmp_path, monkeypatch):
    from danling.checkpoint import checksums as manifest_module
    from danling.checkpoint.manifest import CheckpointError, verification_scope, verify_directory
    from tests.runners._torch_toy import TinyRunner, tiny_config

    config = tiny_config(tmp_path, epochs=1, **{"checkpoint.backend": "dcp"})
    with TinyRunner(config) as runner:
        runner.train()
        path = runner.checkpoint_manager.latest
    hashed = []
    real = manifest_module._digest_file
    monkeypatch.setattr(manifest_module, "_digest_file", lambda p, c: (hashed.append(Path(p).name), real(p, c))[1])
    with TinyRunner(tiny_config(tmp_path, epochs=1, resume=str(path), **{"checkpoint.backend": "dcp"})) as runner:
        assert runner.train_state.global_step == 5
    assert hashed and len(hashed) == len(set(hashed))  # the state and the in-place load share one verification
    # inside a scope, a file that changed after it verified is checked again (and refused)
    with verification_scope():
        verify_directory(path)
        victim = next(p for p in sorted(path.iterdir()) if p.suffix == ".distcp")
        victim.write_bytes(victim.read_bytes()[:-1])
        with pytest.raises(CheckpointError, match="torn"):
            verify_directory(path)
