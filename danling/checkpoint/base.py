"""Backend-neutral checkpoint manager: layout, aliases, retention, cadence and async writes.

Every backend shares one layout under `directory`: one directory per checkpoint (payload files
plus `manifest.json`, the size and checksum of each) and one-line `<alias>.pointer` files naming
the checkpoint an alias points at (see [`danling.checkpoint.layout`][]). A save fills `.tmp-<name>-<token>/`,
fsyncs it, renames it into place, rewrites the alias pointers, and only then prunes old history.
The public `save`, `load` and `load_into` are final: a backend implements the protected hooks
(`_write_payload`, `_read_payload`, `_read_file`, `_read_into`, `_extend_metadata`, ... ; see
"Writing another backend" in the checkpoint docs) and, when several ranks write, the `_temp_dir`,
`_gather_records` and `_barrier` seams. Every load is checked by one path, `_verified`, whatever the
backend, so a corrupt checkpoint is refused the same way by all of them.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import logging
import os
import re
import shutil
import sys
import weakref
from collections.abc import Iterator, Mapping, MutableMapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeoutError
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar, final

from .failures import raise_save_error
from .layout import (
    NAME_PATTERN,
    POINTER_SUFFIX,
    Discard,
    PendingPointers,
    check_count,
    check_name,
    first_valid,
    follow_pointer,
    in_flight,
    publish,
    recover_directory,
    scan_checkpoints,
    temp_token,
)
from .manifest import (
    MANIFEST_NAME,
    CheckpointError,
    CheckpointNotFoundError,
    read_manifest,
    seal_directory,
    streamed_verification,
    verify_directory,
    verify_in_background,
)
from .payload import capture_state, check_objects, drop_key, normalize_excludes, restore_objects, snapshot_state
from .retention import prunable

__all__ = ["CheckpointManager", "Verified"]

# The public entry points every backend shares as they are; backends implement the protected hooks.
_FINAL = ("save", "load", "load_into")


@dataclass
class Verified:
    """What `CheckpointManager._verified` hands a reader.

    Attributes:
        path: The resolved checkpoint directory, or the single file to read.
        manifest: The directory's manifest (`None` for a file read on its own).
        background: The verification still running while the reader reads (DCP), else `None`:
            the reader waits on it before each byte range and calls `finish` once done.
    """

    path: Path
    manifest: dict[str, Any] | None
    background: Any = None


class CheckpointManager:
    r"""Save, find, verify and load checkpoints under one directory.

    This base class owns the policy shared by all backends; subclasses supply the payload I/O
    (see [`FileCheckpointManager`][danling.checkpoint.FileCheckpointManager]).

    Args:
        directory: Where checkpoints, manifests and alias pointers live.
        interval: Save cadence used by [`should_save`][danling.checkpoint.CheckpointManager.should_save]
            (epochs or steps, whichever the caller counts). `None` saves at every index.
        keep_latest_k: Newest history checkpoints to keep; aliased ones are never pruned.
        save_top_k: Best scored history checkpoints to keep ([`retention`][danling.checkpoint.retention]);
            with neither count set (`None`/`0`) every checkpoint is kept.
        async_save: Write on a background thread, from a CPU copy of the state: the caller may
            change its tensors as soon as `save` returns.
        load_only: Never write; `save` becomes a no-op while loading keeps working.
        exclude_from_loading: Top-level or dotted keys removed from loaded payloads
            (`"optimizer"`, `"model.head"`, ...). `dataloader`, `data_loader` and `lr_scheduler`
            are read as `dataloaders` and `scheduler`.
        is_main_process: Whether this process writes (non-collective backends write on the main
            process only).
        timeout: Default seconds `close` waits for an in-flight async save; `None` waits forever.
        logger: Where to report saves, pruning and verification fallbacks.
        trusted: Unpickle with the full unpickler; by default a restricted one never runs code
            stored in a file (see [`danling.checkpoint.unpickling`][]). Only for files you trust.
    """

    backend: ClassVar[str] = "base"
    is_collective: ClassVar[bool] = False
    history_pattern: ClassVar[re.Pattern] = re.compile(r"^(epoch|step|iter)-\d+$")
    required_entries: tuple[str, ...] = ()
    """Manifest entries every checkpoint directory of this backend lists (its format check on load)."""
    streamed_entries: tuple[str, ...] = ()
    """Entries whose checksum the backend's reader checks while it reads them (see `_verified`)."""

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        overridden = [
            name for name in _FINAL if name in vars(cls) and vars(cls)[name] is not vars(CheckpointManager)[name]
        ]
        if overridden:
            raise TypeError(
                f"{cls.__qualname__} overrides {overridden} of CheckpointManager, which are final: implement the "
                "protected hooks instead (_write_payload, _read_payload, _read_file, _read_into, _extend_metadata)"
            )

    def __init__(
        self,
        directory: str | os.PathLike,
        *,
        interval: int | None = None,
        keep_latest_k: int | None = None,
        save_top_k: int | None = None,
        async_save: bool = False,
        load_only: bool = False,
        exclude_from_loading: Sequence[str] | str | None = (),
        is_main_process: bool = True,
        timeout: float | None = 600.0,
        logger: logging.Logger | None = None,
        trusted: bool = False,
    ) -> None:
        check_count(interval, "interval", 1)
        for count, label in ((keep_latest_k, "keep_latest_k"), (save_top_k, "save_top_k")):
            check_count(count, label, 0)
        if timeout is not None and (not isinstance(timeout, (int, float)) or timeout < 0):
            raise ValueError(f"timeout must be a non-negative number of seconds or None, got {timeout!r}")
        self.directory = Path(directory)
        self.interval = interval
        self.keep_latest_k, self.save_top_k = keep_latest_k, save_top_k
        self.async_save = bool(async_save)
        self.load_only = bool(load_only)
        self.exclude_from_loading = normalize_excludes(exclude_from_loading)
        self.is_main_process = bool(is_main_process)
        self.timeout = timeout
        self.logger = logger or logging.getLogger("danling.checkpoint")
        self.trusted = bool(trusted)
        self._executor: ThreadPoolExecutor | None = None
        self._pending: Future | None = None
        self._staging_buffers: dict = {}  # CPU copies of the last async snapshot, reused by the next
        self._pending_path: Path | None = None
        self._discard = Discard()  # replaced and pruned checkpoints are removed on its thread
        self._syncing: dict[Path, list[Future]] = {}  # fsyncs a writer started, by staging directory
        if self._writes and self.directory.is_dir():
            self._recover()

    def __repr__(self) -> str:
        return f"{type(self).__name__}({str(self.directory)!r}, backend={self.backend!r})"

    @property
    def _writes(self) -> bool:
        return not self.load_only and (self.is_main_process or self.is_collective)

    # cadence ---------------------------------------------------------------------------------

    def should_save(self, index: int, *, last: bool = False, force: bool = False) -> bool:
        """Whether a save is due after `index` completed epochs or steps.

        `force` and `last` always save (unless the manager is load-only); otherwise a save is
        due when `index` is a positive multiple of `interval`.

        Examples:
            >>> manager = CheckpointManager("ckpt", interval=2)
            >>> [manager.should_save(i) for i in range(5)]
            [False, False, True, False, True]
            >>> manager.should_save(3, last=True)
            True
        """
        if self.load_only:
            return False
        if force or last:
            return True
        return index > 0 and index % (self.interval or 1) == 0

    # saving ----------------------------------------------------------------------------------

    @final
    def save(
        self,
        state: Mapping[str, Any],
        name: str,
        *,
        aliases: Sequence[str] = ("latest",),
        history: bool | None = None,
        metadata: Mapping[str, Any] | None = None,
    ) -> Path | None:
        """Write `state` as checkpoint `name` and point each alias at it.

        Args:
            state: The payload mapping (config, runner state, model, optimizer, ...). Top-level
                values may be live objects with `state_dict()`/`load_state_dict()` (see
                [`Stateful`][danling.checkpoint.Stateful]); their `state_dict()` is taken here, in
                the caller's thread, before an async write starts.
            name: Checkpoint directory name, e.g. `"epoch-000003"`. Saving an existing name
                replaces it atomically.
            aliases: Pointer names to update once the checkpoint is durable.
            history: Whether retention may prune this checkpoint later. By default names like
                `epoch-N`, `step-N` and `iter-N` count as history and others (`"seed"`) do not.
            metadata: JSON-serializable facts stored in the manifest (epoch, step, ...).

        Returns:
            The checkpoint directory (for async saves, where it will appear), or `None` when this
            process does not write (load-only manager or non-main process).

        Raises:
            CheckpointSaveError: The write failed (full disk, ...), naming the directory, bytes needed
                and free; an async save raises it at the next `save`, `wait` or `maybe_wait_for_staging`.
        """
        if not isinstance(state, Mapping):
            raise TypeError(f"checkpoint state must be a mapping, got {type(state).__name__}")
        check_name(name, "checkpoint name")
        aliases = (aliases,) if isinstance(aliases, str) else tuple(aliases)
        for alias in aliases:
            check_name(alias, "checkpoint alias")
        if history is None:
            history = bool(self.history_pattern.match(name))
        metadata = self._extend_metadata(state, dict(metadata or {}))
        try:
            json.dumps(metadata)
        except (TypeError, ValueError) as err:
            raise TypeError(f"checkpoint metadata must be JSON-serializable, got {metadata!r}: {err}") from err
        if not self._writes:
            return None
        state = self._capture(state)
        self.wait()
        target = self.directory / name
        if not self.async_save:
            return self._persist(state, name, aliases, history, metadata)
        snapshot = self._snapshot(state)
        if self._executor is None:
            self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="danling-checkpoint")
        self._pending = self._executor.submit(self._persist, snapshot, name, aliases, history, metadata)
        self._pending_path = target
        _WRITING.add(self)
        return target

    @property
    def pending_path(self) -> Path | None:
        """The checkpoint a background save writes (or wrote: its outcome not yet collected by `wait`), or `None`."""
        return self._pending_path if self._pending is not None else None

    def maybe_wait_for_staging(self) -> None:
        """Called before every optimizer step: raise the error of a failed async save (staging is synchronous)."""
        if self._pending is not None and self._pending.done():
            self.wait(0)

    def wait(self, timeout: float | None = None) -> bool:
        """Wait for the in-flight async save (re-raising its error); `False` on timeout.

        Without a timeout, also wait until the checkpoints replaced or pruned so far are deleted."""
        pending = self._pending
        try:
            if pending is not None:
                pending.result(timeout=timeout)
        except FutureTimeoutError:
            return False
        except BaseException as err:
            if hasattr(err, "add_note"):
                err.add_note(f"raised by the asynchronous save of checkpoint {self._pending_path}")
            raise
        finally:
            if pending is not None and pending.done():
                self._pending = None
        if timeout is None:
            self._discard.drain()
        return True

    def close(self, timeout: float | None = None) -> bool:
        """Drain pending async writes (up to `timeout`, default `self.timeout`) and release the worker.

        Returns `True` when nothing is left in flight. A save still running after the timeout
        goes on in the background; the previous checkpoint stays valid either way.
        """
        timeout = self.timeout if timeout is None else timeout
        drained = True
        try:
            drained = self.wait(timeout)
        finally:
            if not drained:
                self.logger.warning(
                    "checkpoint %s is still being written after %ss; leaving it to finish in the background",
                    self._pending_path,
                    timeout,
                )
            self._staging_buffers.clear()  # a running write keeps its own references
            if drained:
                self._discard.close()
            if self._executor is not None:
                self._executor.shutdown(wait=False)
                self._executor = None
        return drained

    def _persist(
        self, state: Mapping[str, Any], name: str, aliases: tuple[str, ...], history: bool, metadata: dict
    ) -> Path:
        """Write, publish, re-point aliases, then prune (in that order: a crash loses nothing old); the main process
        completes the save (`_complete`), collective backends override the seams or fold it into their collectives."""
        tmp, final = self._temp_dir(name), self.directory / name
        try:
            with in_flight(tmp):
                return self._persist_into(tmp, final, state, aliases, history, metadata)
        finally:
            self._discard.flush()  # after the save's last fsync (see `Discard`)

    def _persist_into(
        self, tmp: Path, final: Path, state: Mapping[str, Any], aliases: tuple[str, ...], history: bool, metadata: dict
    ) -> Path:
        try:
            tmp.mkdir(parents=True, exist_ok=True)
            records = self._gather_records(dict(self._write_payload(state, tmp)))
            self._barrier()
        except BaseException as err:
            self._abandon(tmp, final, state, err)
            raise
        if self.is_main_process:
            self._complete(tmp, final, state, records, aliases, history, metadata)
        self._barrier()
        return final

    def _complete(
        self, tmp: Path, final: Path, state: Any, records: dict, aliases: tuple[str, ...], history: bool, metadata: dict
    ) -> None:
        """Seal the written `tmp` (main process), publish it as `final`, point the aliases at it, then prune."""
        pointers = PendingPointers(self.directory, aliases, final.name)  # written while `tmp` is sealed
        fields = {"history": history, "metadata": metadata}
        try:
            syncing = self._syncing.pop(tmp, [])
            seal_directory(tmp, records, syncing=syncing, name=final.name, backend=self.backend, **fields)
            # The publication's rename and the pointers' renames share one sync of the directory
            # (the commit's). Should power fail between them, a pointer may name a checkpoint whose
            # rename was lost: an alias whose target is gone is skipped, and loads fall back to
            # the newest checkpoint that verifies, so nothing old is lost either way.
            published_unsynced = not final.exists()
            # Aliases naming the checkpoint this save replaces, and not re-pointed by it, would
            # name new weights under an old meaning: a run resumed from an older checkpoint
            # rewrote `epoch-000002`, and `best` still named it, now the worst weights.
            stale = [] if published_unsynced else self._aliases_of(final.name, exclude=aliases)
            self._publish(tmp, final.name, sync=not published_unsynced)
        except BaseException as err:
            pointers.discard()
            self._abandon(tmp, final, state, err)
            raise
        for alias in stale:
            (self.directory / f"{alias}{POINTER_SUFFIX}").unlink(missing_ok=True)
            self.logger.warning(
                "checkpoint %s was replaced by a new save that is not its %r: the alias is removed until a new "
                "checkpoint earns it",
                final.name,
                alias,
            )
        pointers.commit(sync=published_unsynced or bool(stale))
        size = sum(record["size"] for record in records.values())
        self.logger.info("saved checkpoint %s (%d bytes; aliases: %s)", final, size, ", ".join(aliases) or "none")
        self._prune()

    def _aliases_of(self, name: str, *, exclude: Sequence[str] = ()) -> list[str]:
        """The aliases whose pointer names the checkpoint `name` (main process only), minus `exclude`."""
        if not self.is_main_process:
            return []
        found = []
        for pointer in sorted(self.directory.glob(f"*{POINTER_SUFFIX}")):
            alias = pointer.name[: -len(POINTER_SUFFIX)]
            if alias in exclude:
                continue
            try:
                target = pointer.read_text(encoding="utf-8").strip()
            except (OSError, ValueError):  # unreadable or not text: it names no checkpoint
                continue
            if target == name:
                found.append(alias)
        return found

    def _abandon(self, tmp: Path, final: Path, state: Any, error: BaseException) -> None:
        """Remove the unpublished `tmp` (main process) and turn a disk error into one clear error."""
        for sync in self._syncing.pop(tmp, []):
            sync.exception()  # the write failed anyway; its sync must end before the files go
        if self.is_main_process:
            shutil.rmtree(tmp, ignore_errors=True)
        raise_save_error(error, final, state, self.aliases(wait=False).get("latest"))

    def _temp_dir(self, name: str) -> Path:
        """Private directory the payload is written into before publication (ranks must agree on it)."""
        return self.directory / f".tmp-{name}-{temp_token()}"  # names the writer: recovery spares live ones

    def _gather_records(self, records: dict[str, Any]) -> dict[str, Any]:
        """Merge the manifest records written by every rank (single-writer backends: unchanged)."""
        return records

    def _barrier(self) -> None:
        """Synchronise participating ranks (single-writer backends: nothing to do)."""

    def _publish(self, tmp: Path, name: str, *, sync: bool = True) -> Path:
        return publish(tmp, self.directory / name, self._discard, sync=sync)

    def _prune(self) -> None:
        history = [(path, manifest) for path, manifest in self._scan() if manifest.get("history")]
        keep = {"keep_latest_k": self.keep_latest_k, "save_top_k": self.save_top_k}
        for path in prunable(history, protected=set(self.aliases(wait=False).values()), **keep):
            self._discard.retire(path, path.name)
            self.logger.info("pruned checkpoint %s (keep_latest_k=%s, save_top_k=%s)", path, *keep.values())

    def _recover(self) -> None:
        """Undo what a killed writer left behind: partial temp dirs, half-finished replacements."""
        recover_directory(self.directory, self.logger)

    def _capture(self, state: Mapping[str, Any]) -> dict[str, Any]:
        """Take the `state_dict()` of live objects and check the payload (backends add their own checks)."""
        return capture_state(state)

    def _snapshot(self, state: Mapping[str, Any]) -> Any:
        """Copy `state` for a background writer, reusing the previous copy's buffers (`save` waited for its write)."""
        return snapshot_state(state, self._staging_buffers)

    # backend hooks ---------------------------------------------------------------------------

    def _extend_metadata(self, state: Mapping[str, Any], metadata: dict[str, Any]) -> dict[str, Any]:
        """Add what this backend records in the manifest about `state` (called by `save`, before any write).

        `metadata` is the caller's copy; raise `ValueError` for a key the backend reserves.
        """
        return metadata

    def _write_payload(self, state: Mapping[str, Any], directory: Path) -> Mapping[str, Mapping[str, Any]]:
        """Write the payload files of `state` into the empty `directory` and fsync them.

        Return manifest records (`size` and a checksum) for files hashed while writing; any file left
        out is hashed and fsynced afterwards by the base class. Instead of waiting for a recorded
        file's fsync, a writer may start it on a helper thread and list the future under
        `self._syncing[directory]`: the seal waits for it alongside the manifest's and the
        directory's syncs, before anything is published.
        """
        raise NotImplementedError(f"{type(self).__name__} does not implement checkpoint writing")

    def _read_payload(self, directory: Path, verified: Verified, map_location: Any) -> dict[str, Any]:
        """Load the payload of checkpoint `directory`, inside `_verified` (its manifest is `verified.manifest`)."""
        raise NotImplementedError(f"{type(self).__name__} does not implement checkpoint reading")

    def _read_into(self, verified: Verified, objects: Mapping[str, Any], map_location: Any) -> dict[str, Any]:
        """Read the entries of `objects` straight into them and return the plain rest (when `_reads_in_place`)."""
        raise NotImplementedError(f"{type(self).__name__} does not read into live objects")

    def _read_file(self, path: Path, map_location: Any) -> dict[str, Any]:
        """Load a single payload file (a file inside a checkpoint, or a plain external file)."""
        raise NotImplementedError(f"{type(self).__name__} cannot read single checkpoint files")

    # finding and loading ---------------------------------------------------------------------

    def resolve(self, checkpoint: str | os.PathLike) -> Path:
        """Turn an alias, checkpoint name, pointer file or path into an existing path.

        Bare names are looked up as aliases first, then as checkpoint names under `directory`,
        then relative to the working directory.
        """
        if not isinstance(checkpoint, (str, os.PathLike)):
            raise TypeError(f"checkpoint must be an alias, name or path, got {type(checkpoint).__name__}")
        text = os.fspath(checkpoint)
        if isinstance(checkpoint, str) and NAME_PATTERN.match(text) and not text.endswith(POINTER_SUFFIX):
            pointer = self.directory / f"{text}{POINTER_SUFFIX}"
            if pointer.is_file():
                return self._follow(pointer)
            if (self.directory / text).exists():
                return self.directory / text
        path = Path(text)
        if path.is_file() and path.name.endswith(POINTER_SUFFIX):
            return self._follow(path)
        if path.exists():
            return path
        known = sorted(self.aliases(wait=False)) + [p.name for p, _ in self._scan()]
        raise CheckpointNotFoundError(
            f"no checkpoint, alias or path matches {text!r} (directory {self.directory}; known: {known or 'none'})"
        )

    def _follow(self, pointer: Path) -> Path:
        return follow_pointer(pointer)

    def verify(self, checkpoint: str | os.PathLike) -> dict[str, Any]:
        """Check a checkpoint against its manifest; return the manifest or raise `CheckpointError`."""
        path = self.resolve(checkpoint)
        if path.is_dir():
            return verify_directory(path)
        if (path.parent / MANIFEST_NAME).is_file():
            return verify_directory(path.parent, [path.name])
        raise CheckpointError(f"{path} is not part of a checkpoint with a {MANIFEST_NAME}; nothing to verify")

    @final
    def load(self, checkpoint: str | os.PathLike, *, map_location: Any = "cpu") -> dict[str, Any]:
        """Verify and load a checkpoint, then drop the `exclude_from_loading` keys.

        Every backend loads through `_verified`,
        the one verification path, then its `_read_payload` (or `_read_file` for a single file).

        Args:
            checkpoint: Alias (`"latest"`, `"best"`, ...), checkpoint name, checkpoint
                directory, pointer file, or payload file. A plain file with no manifest beside
                it (for example weights saved by `torch.save`) is loaded unverified.
            map_location: Forwarded to `torch.load`.

        Raises:
            CheckpointError: The checkpoint is torn, corrupt, of another backend or unreadable
                (the message names the file).
            CheckpointNotFoundError: Nothing matches `checkpoint`.
        """
        return self._load_agreed(checkpoint, map_location)

    def _load_agreed(self, checkpoint: str | os.PathLike, map_location: Any) -> dict[str, Any]:
        """`load` as the processes that load together agree on it (collective backends wrap `_load`)."""
        return self._load(checkpoint, map_location)

    def _load(self, checkpoint: str | os.PathLike, map_location: Any) -> dict[str, Any]:
        self.wait()
        path = self._read_whole(self.resolve(checkpoint))
        with self._verified(path) as verified:
            if path.is_dir():
                payload = self._read_payload(path, verified, map_location)
            else:
                payload = self._read_file(path, map_location)
        if not isinstance(payload, MutableMapping):
            raise CheckpointError(f"checkpoint {path} holds a {type(payload).__name__}, expected a mapping")
        for key in self.exclude_from_loading:
            drop_key(payload, key)
        return payload

    @final
    def load_into(
        self, checkpoint: str | os.PathLike, objects: Mapping[str, Any], *, map_location: Any = "cpu"
    ) -> dict[str, Any]:
        """Restore live objects in place from a checkpoint and return its remaining plain entries.

        `checkpoint` is what [`load`][danling.checkpoint.CheckpointManager.load] accepts; `objects`
        maps top-level keys to live objects ([`Stateful`][danling.checkpoint.Stateful]), and each
        gets `load_state_dict(payload[key])` unless its key is in `exclude_from_loading`. Returns
        the payload without the objects' entries (config, results, counters, ...). A backend that
        reads straight into live tensors (DCP; the file backend for a payload that records its
        piece digests) does so through `_read_into`, after the same verification as `load`; a
        damaged piece found after earlier ones were read raises, and the objects may then hold
        part of the checkpoint: load another checkpoint into them.

        Raises:
            CheckpointError: The checkpoint is unusable or lacks an entry for one of `objects`.
        """
        objects = check_objects(objects)
        self.wait()
        path = self.resolve(checkpoint)
        if not self._reads_in_place(path):
            payload = self.load(path, map_location=map_location)
            return dict(restore_objects(payload, objects, self.exclude_from_loading, checkpoint))
        with self._verified(self._read_whole(path)) as verified:
            return self._read_into(verified, objects, map_location)

    @contextlib.contextmanager
    def _verified(self, path: Path, share: Any = None) -> Iterator[Verified]:
        """The one verification path of every load, whatever the backend.

        For a checkpoint directory: its manifest is read, the writing backend must be this one and
        the manifest must list the backend's `required_entries` (its format check), then every
        listed file is checked for presence, size and checksum. Backends differ only in *when*
        the checksums are compared: up front (the default), while the reader streams the
        `streamed_entries` through a hashing reader (file backend), or on helper threads while the
        reader reads (`_verifies_while_reading`: DCP; `share` limits the hashing to the entries this
        process checks for a group). A file inside a checkpoint is checked against the manifest
        beside it; a file with no manifest beside it loads unverified. Any mismatch raises
        `CheckpointError` naming the file.
        """
        with streamed_verification(*self.streamed_entries):
            if not path.is_dir():
                if (path.parent / MANIFEST_NAME).is_file():
                    verify_directory(path.parent, [path.name])
                else:
                    self.logger.debug("loading %s without verification: no %s beside it", path, MANIFEST_NAME)
                yield Verified(path, None)
                return
            if not self._verifies_while_reading(path):
                yield Verified(path, self._check_manifest(path, verify_directory(path)))
                return
            manifest, background = verify_in_background(
                path, now=self.required_entries, manifest=read_manifest(path), share=share
            )
            try:
                yield Verified(path, self._check_manifest(path, manifest), background)
            finally:
                background.stop()

    def _check_manifest(self, directory: Path, manifest: dict[str, Any]) -> dict[str, Any]:
        """Refuse a checkpoint of another backend, or one that lacks this backend's `required_entries`."""
        if manifest.get("backend", self.backend) != self.backend:
            raise CheckpointError(
                f"checkpoint {directory} was written by the {manifest['backend']!r} backend; "
                f"{type(self).__name__} reads {self.backend!r} checkpoints"
            )
        for entry in self.required_entries:
            if entry not in manifest["files"]:
                raise CheckpointError(
                    f"checkpoint {directory} has no {entry} in its manifest: it is not a {self.backend!r} checkpoint"
                )
        return manifest

    def _read_whole(self, path: Path) -> Path:
        """What a load of `path` reads: the path itself, or the checkpoint directory holding it (DCP)."""
        return path

    def _verifies_while_reading(self, directory: Path) -> bool:
        """Whether the checksums of `directory` are compared on helper threads while it is read (see `_verified`)."""
        return False

    def _reads_in_place(self, path: Path) -> bool:
        """Whether `load_into` reads `path` straight into live objects through `_read_into`."""
        return False

    def latest_valid(self) -> Path | None:
        """Return the newest checkpoint that passes verification, logging every one it skips.

        The `latest` alias is tried first, then all checkpoints from newest to oldest.
        """
        self.wait()
        latest = self.latest
        candidates = ([latest] if latest else []) + [path for path, _ in self._scan() if path != latest]
        return first_valid(candidates, self.logger)

    def checkpoints(self) -> list[Path]:
        """Checkpoint directories under `directory`, newest first."""
        return [path for path, _ in self._scan()]

    def _scan(self) -> list[tuple[Path, dict[str, Any]]]:
        """List checkpoint directories (newest first) with their manifests (empty when unreadable)."""
        return scan_checkpoints(self.directory, self.history_pattern)

    def aliases(self, *, wait: bool = True) -> dict[str, Path]:
        """Map each alias to the checkpoint it points at (aliases whose target is gone are skipped)."""
        if wait:
            self.wait()
        if not self.directory.is_dir():
            return {}
        result = {}
        for pointer in sorted(self.directory.glob(f"*{POINTER_SUFFIX}")):
            try:
                result[pointer.name[: -len(POINTER_SUFFIX)]] = self._follow(pointer)
            except (CheckpointError, OSError):
                continue
        return result

    def alias(self, name: str) -> Path | None:
        """The checkpoint directory alias `name` points at, or `None`."""
        return self.aliases().get(name)

    @property
    def latest(self) -> Path | None:
        """The checkpoint the `latest` alias points at, or `None`."""
        return self.alias("latest")

    @property
    def best(self) -> Path | None:
        """The checkpoint the `best` alias points at, or `None`."""
        return self.alias("best")


# Managers whose background save may still run. The interpreter lets such a save finish before it
# exits (the writer thread is not a daemon); this reports the ones that failed meanwhile.
_WRITING: weakref.WeakSet[CheckpointManager] = weakref.WeakSet()


@atexit.register
def _report_at_exit() -> None:
    failed = False
    for manager in list(_WRITING):
        path = manager.pending_path
        try:
            manager.wait()
        except BaseException as err:  # nobody is left to raise it to
            manager.logger.error("checkpoint %s was not saved before the process exited: %s", path, err)
            failed = True
    if failed:
        # The interpreter is past the point where an exception sets the exit status, and a script that
        # lost its checkpoint must not end with 0: flush what was written and leave with status 1.
        logging.shutdown()
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(Exception):
                stream.flush()
        os._exit(1)
