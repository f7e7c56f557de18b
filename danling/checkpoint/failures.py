"""One clear error for a checkpoint save that failed (a full disk, a lost mount, a refused write).

A write that fails inside `torch.save` surfaces as torch's own message (for a full disk
`[enforce fail at inline_container.cc] . unexpected pos`), which names neither the file nor the
cause. [`CheckpointSaveError`][danling.checkpoint.failures.CheckpointSaveError] says which
checkpoint and directory, the operating-system error underneath, about how many bytes the save
needed and how many are free; the checkpoint before it is untouched (the new one was still in
its temporary directory) and stays loadable.

A state holding a value pickle cannot write (a lambda, a lock, an open file) fails deep inside
pickle, with a message that names no checkpoint entry and, from Python 3.13, not even pickling
("Can't get local object ..."). Such a save raises a `TypeError` naming the checkpoint and the
entry instead.
"""

from __future__ import annotations

import os
import pickle
import shutil
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from .manifest import CheckpointError

__all__ = ["CheckpointSaveError", "payload_bytes", "raise_save_error", "unpicklable_error"]


class CheckpointSaveError(CheckpointError, OSError):
    """A checkpoint could not be written; `path`, `needed` and `free` (bytes) say where and how much.

    Also an `OSError`, with the `errno` of the failure underneath when there is one.
    """

    def __init__(self, message: str, *, path: Path, needed: int | None, free: int | None, errno: int | None) -> None:
        super().__init__(message)
        self.path, self.needed, self.free, self.errno = path, needed, free, errno

    def __str__(self) -> str:
        return str(self.args[0])


def payload_bytes(state: Any) -> int:
    """Bytes of the tensors and arrays in `state` (a lower bound for what its save writes)."""
    nbytes = getattr(state, "nbytes", None)
    if isinstance(nbytes, int):
        return nbytes
    if callable(getattr(state, "untyped_storage", None)):  # a tensor without nbytes (older torch)
        return state.numel() * state.element_size()
    if isinstance(state, Mapping):
        return sum(payload_bytes(value) for value in state.values())
    if isinstance(state, (list, tuple)):
        return sum(payload_bytes(value) for value in state)
    return 0


def _root_cause(error: BaseException) -> OSError | None:
    """The first `OSError` in `error`'s chain of causes (torch wraps write errors in RuntimeError)."""
    seen = set()
    while error is not None and id(error) not in seen:
        if isinstance(error, OSError):
            return error
        seen.add(id(error))
        error = error.__cause__ or error.__context__
    return None


def _size(count: int | None) -> str:
    if count is None:
        return "unknown"
    for unit in ("bytes", "KiB", "MiB", "GiB"):
        if count < 1024 or unit == "GiB":
            return f"{count} {unit}" if unit == "bytes" else f"{count:.1f} {unit}"
        count /= 1024
    return str(count)


# What pickle raises for a value it cannot write: `PicklingError`, `TypeError` ("cannot pickle
# '_thread.lock' object") or `AttributeError` ("Can't pickle local object ...", 3.13: "Can't get ...").
_PICKLING_ERRORS = (pickle.PicklingError, TypeError, AttributeError)


class _Discard:
    """A file `torch.save` writes into and that keeps nothing (the search below must not hold a copy)."""

    def write(self, data: Any) -> int:
        return len(memoryview(data))

    def flush(self) -> None:
        pass


def _unpicklable_entry(state: Mapping[str, Any]) -> str | None:
    """The first top-level entry of `state` that `torch.save` cannot write on its own, if any."""
    import torch

    for key, value in state.items():
        try:
            torch.save(value, _Discard())
        except _PICKLING_ERRORS:
            return key
        except Exception:  # some other failure: not this search's to name
            continue
    return None


def unpicklable_error(error: BaseException, name: str, state: Mapping[str, Any]) -> TypeError | None:
    """A `TypeError` naming the entry of `state` that failed the save of checkpoint `name`, when
    `error` is pickle's; `None` for any other error, or when no single entry reproduces it.

    Every entry is saved again on its own, into a file that keeps nothing: only on this failure's path.
    """
    if not isinstance(error, _PICKLING_ERRORS):
        return None
    key = _unpicklable_entry(state)
    if key is None:
        return None
    return TypeError(
        f"saving checkpoint {name} failed: its entry {key!r} cannot be pickled ({type(error).__name__}: {error}); "
        "a checkpoint holds tensors, containers and plain values, so leave the entry out of the state or convert it"
    )


def raise_save_error(error: BaseException, final: Path, state: Any, previous: Path | None) -> None:
    """Raise one clear error for the failed save of checkpoint `final` when an `OSError` caused it,
    or the `TypeError` of `unpicklable_error` when an entry of `state` cannot be pickled.

    Other errors (an interrupt, a failure on another rank) are left to propagate as they are.
    """
    named = unpicklable_error(error, final.name, state)
    if named is not None:
        raise named from error
    cause = _root_cause(error)
    if cause is None or isinstance(error, CheckpointSaveError):
        return
    try:
        free = shutil.disk_usage(final.parent).free
    except OSError:
        free = None
    needed = payload_bytes(state) or None
    errno = getattr(cause, "errno", None)
    reason = f"{type(cause).__name__}: {os.strerror(errno)}" if errno else f"{type(cause).__name__}: {cause}"
    kept = f"the previous checkpoint {previous.name} is untouched and loadable" if previous else "nothing was written"
    message = (
        f"saving checkpoint {final.name} into {final.parent} failed ({reason}); it needs about {_size(needed)} "
        f"and {_size(free)} are free there; {kept}. Free space (or fix the cause) and save again"
    )
    raise CheckpointSaveError(message, path=final, needed=needed, free=free, errno=errno) from error
