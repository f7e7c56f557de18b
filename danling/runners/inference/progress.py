"""The progress record of an inference run with `output=`: what is committed, and for which model and data.

Each rank keeps one small JSON record next to the output (`<output>.progress/rank-<r>.json`),
replaced atomically at every commit. It holds the two latest commits, each with the number of
batches consumed, the outputs kept, the sink's committed state and the loader's position, plus
the digest of the model weights and the dataset length the outputs were computed with. Two
commits are kept because ranks commit together: a rank may be killed between the agreement and
its own write, so the others must be able to step back to the commit before.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from danling.checkpoint.manifest import atomic_write_text

__all__ = ["Commit", "ProgressRecord", "model_digest", "progress_dir"]

VERSION = 1


def progress_dir(output: Path) -> Path:
    """Directory of the records and shards of `output`."""
    return output.with_name(output.name + ".progress")


@dataclass
class Commit:
    """One committed position: `batches` consumed, `rows` outputs kept, the sink's `sink` state, the `loader` state."""

    batches: int
    rows: int
    sink: dict[str, Any]
    loader: Any = None


@dataclass
class ProgressRecord:
    """One rank's record; see the module docstring. `done` is set once this rank's sink is closed.

    `steps` is the batch limit the output was written with (`infer(steps=...)`), `None` for the
    whole split; a limit at or past the loader's length is recorded as `None`.
    """

    path: Path
    split: str
    rank: int
    world_size: int
    shard: int
    shards: int
    writes: bool
    digest: str
    dataset_length: int | None
    current: Commit
    previous: Commit | None = None
    done: bool = False
    steps: int | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def read(cls, path: Path) -> ProgressRecord | None:
        """The record at `path`, or None when there is none.

        Raises:
            ValueError: The file is not a record of this version.
        """
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
        except FileNotFoundError:
            return None
        except ValueError as error:
            raise ValueError(f"unreadable inference progress record {path}: {error}") from error
        if not isinstance(data, dict) or data.get("version") != VERSION:
            raise ValueError(f"{path} is not an inference progress record of version {VERSION}")
        data.pop("version")
        current, previous = Commit(**data.pop("current")), data.pop("previous")
        return cls(path=path, current=current, previous=None if previous is None else Commit(**previous), **data)

    def save(self) -> None:
        """Write the record atomically (readers see the old or the new one, never a mix)."""
        data = asdict(self)
        data.pop("path")
        atomic_write_text(self.path, json.dumps({"version": VERSION, **data}, sort_keys=True, default=str))

    def commit(self, commit: Commit) -> None:
        """Make `commit` the current one (the current one becomes the previous) and save."""
        if commit.batches != self.current.batches:
            self.previous = self.current
        self.current = commit
        self.save()

    def at(self, batches: int) -> Commit:
        """The kept commit at `batches`.

        Raises:
            ValueError: Neither kept commit is at `batches` (the records of the ranks disagree).
        """
        for commit in (self.current, self.previous):
            if commit is not None and commit.batches == batches:
                return commit
        kept = [c.batches for c in (self.current, self.previous) if c is not None]
        raise ValueError(
            f"{self.path} holds commits at batches {kept}, not at {batches} where the other ranks are: "
            "the records are inconsistent; start over with resume=False"
        )

    def mismatch(
        self, split: str, digest: str, dataset_length: int | None, world_size: int, steps: int | None = None
    ) -> str | None:
        """Why this record cannot be continued with the given run, or None when it can."""
        if self.split != split:
            return f"{self.path} belongs to split {self.split!r}, not {split!r}"
        if self.world_size != world_size:
            return f"{self.path} was written by {self.world_size} ranks; this run has {world_size}"
        if self.dataset_length != dataset_length:
            return f"the dataset length changed from {self.dataset_length} to {dataset_length} since {self.path}"
        if self.digest != digest:
            return (
                f"the model weights changed since {self.path} was written (digest {self.digest[:12]} != {digest[:12]})"
            )
        if self.steps != steps:
            # A smoke test with steps=2 must not pass for the full output later (nor the reverse):
            # a finished output is returned as it is, so the limit is part of what was written.
            return f"{self.path} was written with steps={self.steps}; this call asks for steps={steps}"
        return None


def model_digest(model: Any) -> str:
    """SHA-256 of a model's weights: every `state_dict` entry's name, dtype, shape and bytes, in order.

    Sharded tensors (DTensor) contribute this rank's local shard; each rank records its own digest.
    Nothing is written to disk. A model of `None` has the digest of nothing.
    """
    import torch

    digest = hashlib.sha256()
    if model is None:
        return digest.hexdigest()
    for name, value in model.state_dict().items():
        digest.update(name.encode("utf-8"))
        if not isinstance(value, torch.Tensor):
            digest.update(repr(value).encode("utf-8"))
            continue
        tensor = value.to_local() if hasattr(value, "to_local") else value
        tensor = tensor.detach().cpu().contiguous()
        digest.update(f"{tensor.dtype}{tuple(tensor.shape)}".encode())
        digest.update(tensor.reshape(-1).view(torch.uint8).numpy())  # hashed in place, no copy
    return digest.hexdigest()


def jsonable(value: Any) -> Any:
    """`value` if it survives a JSON round trip unchanged, else None (the loader state is then skipped by count)."""
    try:
        return value if json.loads(json.dumps(value)) == value else None
    except (TypeError, ValueError):
        return None


def complete_marker(output: Path) -> Path:
    """The file saying `output` is complete (its shards merged); the rank records keep digest and length."""
    return progress_dir(output) / "complete.json"


def read_complete(output: Path) -> Mapping[str, Any] | None:
    """The completion marker of `output`, or None."""
    try:
        return json.loads(complete_marker(output).read_text(encoding="utf-8"))
    except FileNotFoundError:
        return None


def write_complete(output: Path, rows: int) -> None:
    """Mark `output` complete with `rows` outputs."""
    text = json.dumps({"rows": rows}, sort_keys=True)
    atomic_write_text(complete_marker(output), text)


def remove(path: Path) -> None:
    """Delete a file if present."""
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)
