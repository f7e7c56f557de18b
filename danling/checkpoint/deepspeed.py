"""Checkpoints in DeepSpeed's tagged layout, with danling's manifest, aliases, retention and recovery.

A DeepSpeed save is collective: every rank enters `engine.save_checkpoint(directory, tag)`, which
writes the module states (`mp_rank_00_model_states.pt`) and each rank's ZeRO optimizer partition
(`zero_pp_rank_<r>_mp_rank_00_optim_states.pt`, or `*_model_states.pt` under ZeRO-3) into
`<directory>/<tag>/`. [`DeepSpeedCheckpointManager`][danling.checkpoint.deepspeed.DeepSpeedCheckpointManager]
lets the engine write into danling's temporary directory, adds danling's own state next to it and
publishes the directory like any other backend:

```text
<directory>/
  step-000004/                        the DeepSpeed tag
    mp_rank_00_model_states.pt        DeepSpeed (module, engine-owned scheduler, client state)
    zero_pp_rank_0_mp_rank_00_optim_states.pt
    danling.pt                        runner state, results, loop position, EMA, runner-owned scheduler
    danling-rank0.pt                  per-rank entries (RNG, loader positions), one file per data rank
    manifest.json                     size + checksum (XXH3-128) of every file above
  latest.pointer                      written only after the tag is complete
```

The collective choreography (rank 0 picks the directory, everyone writes and all ranks agree that
every write succeeded, rank 0 hashes, renames into place, moves the pointers and prunes, then
reports the outcome to the others) is the one of
[`TorchDistributedCheckpointManager`][danling.checkpoint.dcp.TorchDistributedCheckpointManager]; only
the payload I/O differs. A torn tag fails verification, so `latest_valid` (and `auto_resume`)
falls back to the previous good one. The engine state itself is restored by the runner with
`engine.load_checkpoint`; `load` returns danling's part of the payload.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import io
import os
import tempfile
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import torch

from .base import Verified
from .dcp import TorchDistributedCheckpointManager
from .file import _torch_load
from .manifest import CheckpointError
from .unpickling import torch_load

__all__ = [
    "DeepSpeedCheckpointManager",
    "convert_to_universal",
    "is_deepspeed_checkpoint",
    "restricted_deepspeed_loads",
    "tag_view",
    "zero_data_size",
]

GLOBAL_FILE = "danling.pt"
CLIENT_STEP_KEY = "danling_global_step"


def _rank_file(data_rank: int) -> str:
    return f"danling-rank{data_rank}.pt"


def is_deepspeed_checkpoint(path: Path) -> bool:
    """Whether `path` (a directory, or a file inside one) is a DeepSpeed tag directory."""
    directory = path if path.is_dir() else path.parent
    return (directory / "mp_rank_00_model_states.pt").is_file() or any(directory.glob("zero_pp_rank_*"))


def zero_data_size(tag: Path) -> int | None:
    """The data-parallel size a DeepSpeed tag was saved with: its number of ZeRO optimizer partitions.

    `None` when the tag has no ZeRO partitions (stage 0), which load on any size.
    """
    return len(list(tag.glob("*zero_pp_rank_*_mp_rank_00_optim_states.pt"))) or None


# The plain-data classes DeepSpeed pickles into its own checkpoint files (ZeRO optimizer states,
# loss scalers), admitted by name: none of them runs code when it is unpickled.
DEEPSPEED_GLOBALS = (
    "deepspeed.runtime.fp16.loss_scaler.LossScaler",
    "deepspeed.runtime.fp16.loss_scaler.DynamicLossScaler",
    "deepspeed.runtime.zero.config.ZeroStageEnum",
    "deepspeed.utils.tensor_fragment.fragment_address",
)


def _deepspeed_globals() -> list[Any]:
    found = []
    for qualified in DEEPSPEED_GLOBALS:
        module, _, name = qualified.rpartition(".")
        with contextlib.suppress(ImportError):
            value = getattr(importlib.import_module(module), name, None)
            if value is not None:
                found.append(value)
    return found


@contextlib.contextmanager
def restricted_deepspeed_loads(trusted: bool = False) -> Iterator[None]:
    """Within the block, DeepSpeed's reads of its own files go through danling's restricted unpickler.

    DeepSpeed reads its module and optimizer files with `torch.load(..., weights_only=False)`, in the
    engine's loader and in its conversion tools alike; within the block `torch.load` admits only
    the weights-only types, [`SAFE_GLOBALS`][danling.checkpoint.unpickling.SAFE_GLOBALS] and
    `DEEPSPEED_GLOBALS`, so a payload planted in such a file raises
    [`UnsafePickleError`][danling.checkpoint.unpickling.UnsafePickleError] instead of running. With
    `trusted` (`checkpoint.trust_pickle`) nothing changes. `torch.load` is replaced for the whole
    process while the block runs; calls made meanwhile from other threads are restricted too.
    """
    if trusted:
        yield
        return
    allowed = _deepspeed_globals()

    def load(source: Any, map_location: Any = None, *args: Any, **kwargs: Any) -> Any:
        return torch_load(source, map_location=map_location, extra_globals=allowed, mmap=bool(kwargs.get("mmap")))

    previous, torch.load = torch.load, load
    try:
        yield
    finally:
        torch.load = previous


@contextlib.contextmanager
def tag_view(tag: Path) -> Iterator[Path]:
    """A private directory that holds only `tag` (a symlink) and a DeepSpeed `latest` file naming it.

    DeepSpeed 0.19's ZeRO-3 loader reads the module weights of the directory's `latest` tag, not the
    requested one, when optimizer states are not loaded. Loading from this view, `latest` is the
    requested tag. The directory is local to the calling rank and removed on exit.
    """
    with tempfile.TemporaryDirectory(prefix="danling-deepspeed-") as root:
        view = Path(root)
        (view / tag.name).symlink_to(tag.resolve(), target_is_directory=True)
        (view / "latest").write_text(tag.name)
        yield view


def convert_to_universal(tag: Path, directory: Path) -> Path:
    """Convert the ZeRO tag `tag` into DeepSpeed's universal format at `directory/<tag name>`.

    Universal checkpoints hold every parameter and optimizer state whole, so an engine of any
    data-parallel size loads them (with `checkpoint.load_universal`); DeepSpeed's format holds
    Adam-style optimizer states only (`exp_avg`, `exp_avg_sq`). Runs DeepSpeed's
    `ds_to_universal` in this process (no worker pool), on one rank; its progress output is
    discarded. Returns the converted tag directory.

    Raises:
        CheckpointError: the optimizer states are not Adam-style.
    """
    from deepspeed.checkpoint import ds_to_universal

    output = directory / tag.name
    args = argparse.Namespace(
        input_folder=str(tag),
        output_folder=str(output),
        num_extract_workers=1,
        num_merge_workers=1,
        keep_temp_folder=False,
        strict=True,
        inject_missing_state=True,  # engines without a model-provided universal info block
    )
    directory.mkdir(parents=True, exist_ok=True)
    try:
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
            ds_to_universal.main(args)
    except KeyError as error:
        if error.args and error.args[0] in ("exp_avg", "exp_avg_sq"):
            raise CheckpointError(
                f"DeepSpeed's universal format holds Adam-style optimizer states (exp_avg, exp_avg_sq) only, and the "
                f"optimizer states of {tag} have no {error.args[0]!r}"
            ) from error
        raise
    return output


class DeepSpeedCheckpointManager(TorchDistributedCheckpointManager):
    """Collective checkpoints in DeepSpeed's tag layout.

    Call [`bind`][danling.checkpoint.deepspeed.DeepSpeedCheckpointManager.bind] with the engine
    before saving.

    `save` is collective (every rank, same name and aliases). The state's top-level keys listed in
    `rank_local_keys` are stored once per data rank; the rest is written by rank 0. Asynchronous
    saves are not supported (the engine writes synchronously).

    Args:
        directory: Where tags, manifests and pointers live (shared by all ranks).
        **kwargs: Options of
            [`TorchDistributedCheckpointManager`][danling.checkpoint.dcp.TorchDistributedCheckpointManager].
    """

    backend = "deepspeed"
    required_entries = (GLOBAL_FILE,)
    """danling's own file of the tag: a tag DeepSpeed wrote without danling lacks it."""

    def __init__(self, directory: str | os.PathLike, **kwargs: Any) -> None:
        kwargs["async_save"] = False
        super().__init__(directory, **kwargs)
        self.engine: Any = None

    def bind(self, engine: Any) -> None:
        """Save through `engine` (a `DeepSpeedEngine`) from now on."""
        self.engine = engine

    # saving ----------------------------------------------------------------------------------

    def _save(self, state: Mapping[str, Any], directory: Path) -> dict[str, Any]:
        """Write through the engine plus danling's own files; no records: rank 0 hashes the whole directory."""
        engine = self.engine
        if engine is None:
            raise CheckpointError("DeepSpeedCheckpointManager has no engine to save: call bind(engine) first")
        step = (state.get("state") or {}).get("train", {}).get("global_step")
        engine.save_checkpoint(
            str(directory.parent), tag=directory.name, client_state={CLIENT_STEP_KEY: step}, save_latest=False
        )
        error: BaseException | None = None
        try:
            local = {key: value for key, value in state.items() if key in self.rank_local_keys}
            _save_file(local, directory / _rank_file(self.data_rank))
            if self.is_main_process:
                shared = {key: value for key, value in state.items() if key not in self.rank_local_keys}
                _save_file(shared, directory / GLOBAL_FILE)
        except Exception as err:  # every rank must still reach the agreement below
            error = err
        # Every rank's files exist before rank 0 hashes the directory, or every rank learns that
        # one of them failed: one all-reduce, which every rank enters whatever happened locally
        # (a barrier skipped by a failed rank would leave the others waiting on a collective that
        # never matches theirs).
        failed = self._any_failed(error is not None)
        if error is not None:
            raise error
        if failed:
            raise CheckpointError("writing the DeepSpeed checkpoint failed on another rank; nothing was published")
        return {}

    def _any_failed(self, failed: bool) -> bool:
        if not self.distributed:
            return failed
        flag = torch.tensor([int(failed)], device=getattr(self.engine, "device", None))
        torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.MAX, group=self.process_group)
        return bool(flag.item())

    # loading ---------------------------------------------------------------------------------

    def _reads_in_place(self, path: Path) -> bool:
        return False  # the engine restores its own state; `load_into` reads danling's files whole

    def _verifies_while_reading(self, directory: Path) -> bool:
        return False  # plain torch.save files: verified up front

    def _read_payload(self, directory: Path, verified: Verified, map_location: Any) -> dict[str, Any]:
        payload = _torch_load(directory / GLOBAL_FILE, map_location, directory / GLOBAL_FILE, self.trusted)
        ranks = sorted(directory.glob("danling-rank*.pt"))
        mine = directory / _rank_file(self.data_rank)
        if mine.is_file() and len(ranks) == self.data_size:
            payload.update(_torch_load(mine, map_location, mine, self.trusted))
        return payload

    def _read_file(self, path: Path, map_location: Any) -> dict[str, Any]:
        if path.parent.is_dir() and (path.parent / GLOBAL_FILE).is_file():
            return self._read_payload(path.parent, Verified(path.parent, None), map_location)
        return _torch_load(path, map_location, path, self.trusted)


def _save_file(obj: Any, path: Path) -> None:
    with open(path, "wb") as handle:
        torch.save(obj, handle)
        handle.flush()
        os.fsync(handle.fileno())
