"""`CompileArtifacts`: the compiler's cache artifacts of a run, saved once and loaded at the next start.

`torch.compiler.save_cache_artifacts()` serialises what this process compiled (inductor kernels,
AOTAutograd graphs) into one blob, and `load_cache_artifacts(blob)` puts them into the caches of a
new process, which then finds its graphs compiled instead of compiling them. The blob is only
valid for the torch that wrote it, so the directory holds it next to a record of its torch and
Python versions and its SHA-256: a blob of another version, a damaged one or one torch refuses is
reported as a warning and the run compiles as usual; nothing is ever loaded on a guess.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import platform
from pathlib import Path

import torch

__all__ = ["CompileArtifacts"]

_BLOB = "compile-artifacts.bin"
_RECORD = "compile-artifacts.json"


def _environment() -> dict[str, str]:
    """What the blob depends on: the torch build and the Python version."""
    return {"torch": torch.__version__, "python": platform.python_version()}


class CompileArtifacts:
    """Save and load the compiler cache artifacts of one run in `directory`.

    Args:
        directory: Where the artifacts live (created on the first save).
        logger: Where loads, saves and refusals are reported.

    Examples:
        >>> import tempfile
        >>> artifacts = CompileArtifacts(tempfile.mkdtemp())
        >>> artifacts.load()  # nothing saved yet: the run compiles as usual
        False
    """

    def __init__(self, directory: str | os.PathLike[str], logger: logging.Logger | None = None) -> None:
        self.directory = Path(directory)
        self.logger = logger or logging.getLogger("danling.runners")
        self.loaded: dict[str, int] = {}  # artifacts loaded at start, by kind (empty: none)
        self.saved_bytes = 0  # size of the last blob written (0: none yet)

    def __repr__(self) -> str:
        return f"CompileArtifacts({str(self.directory)!r}, loaded={self.loaded})"

    def load(self) -> bool:
        """Put the saved artifacts into this process's compiler caches; `True` when they were loaded.

        A missing directory is a first launch (nothing is said); anything else that prevents the
        load is a warning naming the file and why, and the run compiles as usual.
        """
        blob_path, record_path = self.directory / _BLOB, self.directory / _RECORD
        if not blob_path.exists():
            return False
        try:
            record = json.loads(record_path.read_text(encoding="utf-8"))
            blob = blob_path.read_bytes()
        except (OSError, ValueError) as err:
            return self._refuse(f"its record {record_path} cannot be read ({err})")
        wanted = _environment()
        saved = {key: record.get(key) for key in wanted} if isinstance(record, dict) else {}
        if saved != wanted:
            return self._refuse(f"it was written by {saved}, and this process runs {wanted}")
        if hashlib.sha256(blob).hexdigest() != record.get("sha256"):
            return self._refuse("its SHA-256 does not match the record (a damaged or replaced file)")
        try:
            info = torch.compiler.load_cache_artifacts(blob)
        except Exception as err:  # torch's own refusal of a blob: whatever it raises, compiling still works
            return self._refuse(f"torch refused it ({type(err).__name__}: {err})")
        if info is None:
            return self._refuse("torch found no artifacts in it")
        self.loaded = {kind: len(keys) for kind, keys in info.artifacts.items() if keys}
        self.logger.info("compile artifacts loaded from %s: %s", blob_path, self.loaded)
        return True

    def save(self) -> Path | None:
        """Write what this process compiled so far; the blob's path, or `None` when there was nothing.

        Written to temporary names and renamed, so a reader never sees half a file; a failed write
        is a warning (the run goes on, the next launch compiles).
        """
        result = torch.compiler.save_cache_artifacts()
        if result is None or not result[0]:
            return None
        blob = result[0]
        record = {**_environment(), "sha256": hashlib.sha256(blob).hexdigest(), "bytes": len(blob)}
        blob_path = self.directory / _BLOB
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
            _write_replace(blob_path, blob)
            _write_replace(self.directory / _RECORD, json.dumps(record, indent=2).encode("utf-8"))
        except OSError as err:
            self.logger.warning("compile artifacts not saved to %s: %s", self.directory, err)
            return None
        self.saved_bytes = len(blob)
        self.logger.info("compile artifacts saved to %s (%d bytes)", blob_path, len(blob))
        return blob_path

    def _refuse(self, why: str) -> bool:
        self.logger.warning(
            "compile artifacts in %s not loaded: %s; compiling as usual (the next save replaces them)",
            self.directory,
            why,
        )
        return False


def _write_replace(path: Path, data: bytes) -> None:
    partial = path.with_name(f".{path.name}.partial")
    partial.write_bytes(data)
    os.replace(partial, path)
