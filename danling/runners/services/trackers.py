"""Experiment trackers: every value the runner logs also goes to TensorBoard, W&B, CSV, MLflow or your own.

Trackers receive nested result mappings (`{"train": {"loss": tensor(0.3)}, "val": {...}}`) and a
step. [`flatten_result`][danling.runners.services.trackers.flatten_result] turns them into
`{"train/loss": 0.3, ...}`; [`Trackers`][danling.runners.services.trackers.Trackers] fans one call out to
all configured backends. W&B is imported when its tracker is built, TensorBoard at its tracker's first write.
"""

from __future__ import annotations

import importlib.util
import numbers
import os
from collections.abc import Iterable, Iterator, Mapping
from typing import Any

from danling.utils import optional_import
from danling.utils.io import dumps_strict

__all__ = ["Tracker", "TensorBoardTracker", "WandbTracker", "Trackers", "flatten_result"]


def _scalar(value: Any) -> float | None:
    if isinstance(value, bool):
        return float(value)
    if isinstance(value, numbers.Real):
        return float(value)
    # torch tensors expose numel(); NumPy arrays and scalars expose an integer size
    count = value.numel() if callable(getattr(value, "numel", None)) else getattr(value, "size", None)
    if callable(getattr(value, "item", None)) and count == 1:
        item = value.item()
        return float(item) if isinstance(item, numbers.Real) else None
    return None


def flatten_result(result: Mapping[str, Any], sep: str = "/") -> dict[str, float]:
    """Flatten a nested result mapping into `{"a/b": float}` for scalar loggers.

    Python numbers, NumPy scalars and one-element tensors become floats (this reads tensors
    back to the host, so call it where results are written, not per step). Anything else
    (strings, `None`, multi-element arrays) is left out.

    Examples:
        >>> import torch
        >>> flatten_result({"train": {"loss": torch.tensor(0.5), "acc": 1}, "epoch": 3, "note": "x"})
        {'train/loss': 0.5, 'train/acc': 1.0, 'epoch': 3.0}
        >>> flatten_result({"val": {"f1": 0.25}}, sep=".")
        {'val.f1': 0.25}
    """
    if not isinstance(result, Mapping):
        raise TypeError(f"flatten_result() expects a mapping of results, got {type(result).__name__}")
    flat: dict[str, float] = {}

    def visit(node: Mapping, prefix: str) -> None:
        for key, value in node.items():
            name = f"{prefix}{sep}{key}" if prefix else str(key)
            if isinstance(value, Mapping):
                visit(value, name)
                continue
            number = _scalar(value)
            if number is not None:
                flat[name] = number

    visit(result, "")
    return flat


class Tracker:
    """A destination for logged values: the plug-in a runner's `trackers` list holds.

    The base class accepts everything and does nothing. A tracker implements `log(result, step)`
    (called at log steps and result rows, never per batch, with a flat `{"val/acc": 0.91}` mapping
    of floats and the global step; steps never go back and never repeat for a name) and `close()`
    (flush and release files or network handles); `resume_at(step)` is optional. The run's config,
    where a backend records it, is given when the tracker is built. Add one to a runner with
    `runner.trackers.append(MyTracker())`, or to every runner with
    [`register_tracker`][danling.runners.services.tracking.register_tracker].
    """

    def log(self, result: Mapping[str, Any], step: int) -> None:
        """Record `result` at `step`."""

    def resume_at(self, step: int) -> None:
        """A run resumed from a checkpoint taken at `step`: forget what was recorded after it, where possible.

        [`Trackers`][danling.runners.services.trackers.Trackers] calls it right before the resumed run's
        first value past `step`, so a run resumed only to evaluate erases nothing.
        """

    def close(self) -> None:
        """Flush and release resources."""

    def __enter__(self) -> Tracker:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


class TensorBoardTracker(Tracker):
    """Write each flattened result as TensorBoard scalars in `log_dir`.

    Requires the `tensorboard` extra. Events are flushed after every `log`, so a crash loses at
    most the result being written. `config`, when given, is written once as a `config` text entry
    (a fresh log directory only: a resumed run already has it). The writer and its event file are
    made at the first write (or at `close`), so TensorBoard is not imported before a run's first step.

    A resumed run keeps writing to the same directory:
    [`resume_at`][danling.runners.services.trackers.TensorBoardTracker.resume_at] marks the restart,
    and TensorBoard then hides every point the earlier run wrote after the checkpoint's step, so
    the curve continues from the checkpoint instead of doubling back.
    """

    def __init__(self, log_dir: str | os.PathLike, config: Mapping[str, Any] | None = None, **kwargs: Any) -> None:
        if importlib.util.find_spec("tensorboard") is None:  # refuse now, as a missing extra should
            optional_import("tensorboard", "tensorboard")
        self.log_dir = os.fspath(log_dir)
        self._fresh = not os.path.isdir(self.log_dir) or not any("tfevents" in n for n in os.listdir(self.log_dir))
        self._config, self._options = config, kwargs
        self._writer: Any = None

    @property
    def writer(self) -> Any:
        """The `SummaryWriter`, made at the first write: importing TensorBoard takes about 0.1 s, which
        a run would otherwise spend before its first step."""
        if self._writer is None:
            module = optional_import("torch.utils.tensorboard", "tensorboard")
            self._writer = module.SummaryWriter(log_dir=self.log_dir, **self._options)
            if self._config is not None and self._fresh:
                # strict JSON like the run's other records: a non-finite value shows as null (config.yaml has it)
                text = dumps_strict(self._config, indent=2, sort_keys=True, default=str)
                # Indented by four spaces: TensorBoard renders text entries as Markdown, this keeps it a code block.
                self._writer.add_text("config", "    " + text.replace("\n", "\n    "), global_step=0)
                self._writer.flush()
        return self._writer

    def resume_at(self, step: int) -> None:
        """Write a restart marker at `step + 1`: TensorBoard drops the earlier points at steps after `step`."""
        from tensorboard.compat.proto.event_pb2 import Event, SessionLog

        self.writer._get_file_writer().add_event(Event(step=step + 1, session_log=SessionLog(status=SessionLog.START)))
        self.writer.flush()

    def log(self, result: Mapping[str, Any], step: int) -> None:
        for tag, value in flatten_result(result).items():
            self.writer.add_scalar(tag, value, global_step=step)
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


class WandbTracker(Tracker):
    """Send each flattened result to a Weights & Biases run.

    Requires the `wandb` extra. Arguments map onto `wandb.init`; `mode="offline"` records
    locally without network access (`wandb sync` uploads later). W&B drops values logged at a
    step lower than one it has already seen, so log with a non-decreasing step.

    Args:
        project: W&B project.
        name: Display name of the run.
        dir: Directory for W&B's local files.
        mode: `"online"`, `"offline"` or `"disabled"`; `None` lets W&B decide (e.g. from `WANDB_MODE`).
        config: Hyper-parameters recorded with the run.
        **kwargs: Passed to `wandb.init` (entity, group, job_type, tags, ...).
    """

    def __init__(
        self,
        project: str | None = None,
        name: str | None = None,
        dir: str | os.PathLike | None = None,  # same name as the wandb.init argument
        mode: str | None = None,
        config: Mapping[str, Any] | None = None,
        **kwargs: Any,
    ) -> None:
        wandb = optional_import("wandb", "wandb")
        if dir is not None:
            os.makedirs(dir, exist_ok=True)
        options = {"project": project, "name": name, "dir": None if dir is None else os.fspath(dir), "mode": mode}
        options = {key: value for key, value in options.items() if value is not None}
        if config is not None:
            options["config"] = dict(config)
        self._wandb = wandb
        self.run = wandb.init(**options, **kwargs)

    def log(self, result: Mapping[str, Any], step: int) -> None:
        flat = flatten_result(result)
        if flat:
            self.run.log(flat, step=step)

    def close(self) -> None:
        """Finish the run and, when no other W&B run is active, shut down W&B's background service.

        `run.finish()` can return before the service has written the last records to the local
        run file; shutting the service down (`wandb.teardown`) waits for that, so the run
        directory is complete when `close` returns. The service restarts on the next `wandb.init`.
        """
        self.run.finish()
        if self._wandb.run is None:
            self._wandb.teardown()


class Trackers(Tracker):
    """Fan one `log` / `close` call out to several trackers.

    Examples:
        >>> class Recorder(Tracker):
        ...     def __init__(self):
        ...         self.seen = []
        ...     def log(self, result, step):
        ...         self.seen.append((step, result))
        >>> recorder = Recorder()
        >>> trackers = Trackers([recorder, Tracker()])
        >>> trackers.log({"val": {"acc": 0.5}}, step=10)
        >>> recorder.seen
        [(10, {'val/acc': 0.5})]
        >>> len(trackers), bool(Trackers())
        (2, False)
    """

    def __init__(self, trackers: Iterable[Tracker] = ()) -> None:
        self.trackers: list[Tracker] = []
        self._last_step: dict[str, int] = {}  # the latest step each name was recorded at
        self._floor = -(2**63)  # no step at or below it is recorded: the resumed checkpoint's step
        self._resumed: int | None = None  # a resume's step, told to the trackers at the first later value
        for tracker in trackers:
            self.append(tracker)

    def append(self, tracker: Tracker) -> None:
        """Add a tracker to the fan-out."""
        if not isinstance(tracker, Tracker):
            raise TypeError(f"Trackers accepts Tracker instances, got {type(tracker).__name__}: {tracker!r}")
        self.trackers.append(tracker)

    def log(self, result: Mapping[str, Any], step: int) -> None:
        """Send `result` to every tracker, leaving out the values of a name already recorded at `step` or later.

        So no curve gets two points at one step (`evaluate()` right after `train()` repeats the
        last evaluation's step) or steps going backwards, and after
        [`resume_at`][danling.runners.services.trackers.Trackers.resume_at] nothing at or before
        the checkpoint's step is recorded again.
        """
        if not self.trackers:
            return
        last, floor = self._last_step, self._floor
        flat = {name: value for name, value in flatten_result(result).items() if step > last.get(name, floor)}
        if not flat:
            return
        if self._resumed is not None and step > self._resumed:
            resumed, self._resumed = self._resumed, None
            for tracker in self.trackers:
                tracker.resume_at(resumed)
        for name in flat:
            last[name] = step
        for tracker in self.trackers:
            tracker.log(flat, step)

    def resume_at(self, step: int, recorded: Iterable[str] | None = None) -> None:
        """The run resumed from a checkpoint taken at `step`: record only later steps, and tell every tracker.

        `recorded` names what the earlier run recorded at `step` itself (a runner passes its restored
        result row): those names get no second point there, while others still may (a `test` split
        first evaluated after the resume). `None` counts every name as recorded at `step`.

        The trackers are told (and drop what the earlier run recorded after `step`) just before the
        first value of a later step: a run resumed only to evaluate, such as a scoring job on the
        `best` checkpoint, must not erase the history of the run it reads.
        """
        if recorded is None:
            self._floor, self._last_step = step, {}
        else:
            self._floor, self._last_step = step - 1, dict.fromkeys(recorded, step)
        self._resumed = step

    def close(self) -> None:
        """Close every tracker, even if one of them fails; the first error is re-raised."""
        error: BaseException | None = None
        for tracker in self.trackers:
            try:
                tracker.close()
            except Exception as err:  # keep closing the others before reporting
                error = error or err
        if error is not None:
            raise error

    def __len__(self) -> int:
        return len(self.trackers)

    def __iter__(self) -> Iterator[Tracker]:
        return iter(self.trackers)
