"""Drive `runner.infer(split, output=PATH)`: sinks, progress records, resume and the distributed merge.

[`run_inference`][danling.runners.inference.writer.run_inference] is what `infer` calls when an
output path is given. Every `progress_interval` batches the ranks flush their sinks, agree (one
all-reduce, which also carries any stop request) and then each replaces its progress record; so the
ranks' records are never more than one commit apart, and a restart steps every rank back to the
oldest commit any rank holds. Outputs past a rank's share of the dataset (the sampler's padding)
are dropped before they reach the sink.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from itertools import islice
from pathlib import Path
from typing import Any

from ..loop.events import Events, InferenceContext
from ..loop.hooks import RunnerMode
from .progress import (
    Commit,
    ProgressRecord,
    jsonable,
    model_digest,
    progress_dir,
    read_complete,
    remove,
    write_complete,
)
from .sinks import Sink, sink_for

__all__ = ["InferencePlan", "run_inference"]


class _Ranks:
    """The few collectives the writer needs, over the default group (all no-ops in one process)."""

    def __init__(self) -> None:
        import torch.distributed as dist

        self.dist = dist if dist.is_available() and dist.is_initialized() else None
        self.rank = self.dist.get_rank() if self.dist else 0
        self.size = self.dist.get_world_size() if self.dist else 1

    def reduce(self, value: int, op: str) -> int:
        if self.dist is None:
            return value
        import torch

        cuda = self.dist.get_backend() == "nccl"
        device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
        tensor = torch.tensor([value], dtype=torch.int64, device=device)
        self.dist.all_reduce(tensor, op=getattr(self.dist.ReduceOp, op))
        return int(tensor.item())

    def barrier(self) -> None:
        if self.dist is not None:
            self.dist.barrier()


@dataclass
class InferencePlan:
    """Where this rank writes: its data shard, whether it writes at all, and how many outputs it keeps."""

    output: Path
    sink_type: type[Sink]
    shard: int
    shards: int
    writes: bool
    capacity: int | None
    dataset_length: int | None

    @property
    def target(self) -> Path:
        """This rank's file: the output itself with one shard, else a shard file beside the records."""
        if self.shards == 1:
            return self.output
        return progress_dir(self.output) / f"shard-{self.shard}-of-{self.shards}-{self.output.name}"


def _writes(runner: Any) -> bool:
    """Only the ranks holding the last pipeline stage, and the first of any tensor/context group, write."""
    if not getattr(runner, "pipeline_has_last_stage", True):
        return False
    coordinates = getattr(getattr(runner, "topology", None), "coordinates", {})
    return all(coordinates.get(axis, 0) == 0 for axis in ("context", "tensor"))


def _length(value: Any) -> int | None:
    try:
        return len(value)
    except TypeError:
        return None


def make_plan(runner: Any, split: str, output: Path) -> InferencePlan:
    """Work out this rank's shard and share of `split` (see `InferencePlan`).

    Raises:
        ValueError: The split's sampler shuffles (outputs would not be in dataset order), or the
            data is split over several ranks without a `DistributedSampler`.
    """
    from torch.utils.data import DistributedSampler

    sink_type = sink_for(output)
    loader = runner.dataloaders[split]
    loader = getattr(loader, "loader", loader)  # a pipeline stage's step proxy wraps the real loader
    dataset_length = _length(getattr(loader, "dataset", None))
    sampler = getattr(loader, "sampler", None)
    if getattr(sampler, "shuffle", False):
        raise ValueError(
            f"infer(output=...) writes outputs in dataset order, but split {split!r} is shuffled: "
            f"set dataloader.{split}.shuffle=False"
        )
    topology = getattr(runner, "topology", None)
    data_size = topology.size("data") if topology is not None else 1
    if isinstance(sampler, DistributedSampler) and dataset_length is not None:
        shard, shards = sampler.rank, sampler.num_replicas
        capacity = sampler.num_samples if sampler.drop_last else len(range(shard, dataset_length, shards))
    elif data_size > 1:
        raise ValueError(
            f"infer(output=...) over {data_size} data-parallel ranks needs a map-style dataset sharded by a "
            f"DistributedSampler for split {split!r}, got sampler {type(sampler).__name__}"
        )
    else:
        shard, shards, capacity = 0, 1, dataset_length
    return InferencePlan(output, sink_type, shard, shards, _writes(runner), capacity, dataset_length)


class _NullSink(Sink):
    """What ranks that do not write hold: they take part in every commit, with nothing to flush."""

    def open(self) -> None:
        pass

    def truncate(self, state: Any) -> None:
        pass

    def write(self, outputs: Any) -> None:
        pass

    def state(self) -> dict[str, Any]:
        return {}

    def close(self) -> None:
        pass


def run_inference(
    runner: Any, split: str, output: str | os.PathLike[str], *, steps: int | None = None, resume: bool = True
) -> Path:
    """Run `runner.infer_step` over `split`, streaming the outputs into `output`; return its path.

    A collective under data or pipeline parallelism: every rank calls it. See
    [`Loop.infer`][danling.runners.loop.loops.Loop.infer] for the arguments.

    Raises:
        ValueError: No sink for the suffix, a shuffled split, or a progress record that does not
            match this run (dataset length, split, number of ranks or `steps`). An output written by other
            weights is moved to `<output>.weights-<digest>/` with a warning, and written anew.
    """
    session = _Session(runner, split, Path(output), steps)
    context = InferenceContext(runner, split, str(session.plan.output), record=str(session.record_path))
    with runner.events.pair(Events.INFERENCE_START, Events.INFERENCE_END, context):
        session.context = context
        session.run(resume)
    return session.plan.output


class _Session:
    """One `run_inference` call on this rank."""

    def __init__(self, runner: Any, split: str, output: Path, steps: int | None) -> None:
        self.runner, self.split, self.steps = runner, split, steps
        self.plan = make_plan(runner, split, output)
        length = _length(runner.dataloaders[split])
        # the limit as recorded: one that reaches the end of the loader is no limit at all
        self.limit = None if steps is None or (length is not None and steps >= length) else steps
        self.ranks = _Ranks()
        self.interval = _interval(runner)
        self.record_path = progress_dir(output) / f"rank-{self.ranks.rank}.json"
        # the weights that predict: the EMA's when there is one (one that holds only sharded weights is
        # swapped into the model around each step, so the model itself would show the live weights)
        model = getattr(runner, "ema", None)
        self.digest = model_digest(model if model is not None else getattr(runner, "model", None))
        self.sink: Sink = _NullSink(self.plan.target)
        if self.plan.writes:
            self.sink = self.plan.sink_type(self.plan.target, self.plan.capacity)
        self.record: ProgressRecord | None = None
        self.context: InferenceContext

    def run(self, resume: bool) -> None:
        progress_dir(self.plan.output).mkdir(parents=True, exist_ok=True)
        record = self._verified_record() if resume else None
        # finished once, then deleted (to be written again): its records must not pass for it (a
        # collective on every rank, whatever its own record says)
        if self.ranks.reduce(int(record is not None and record.done and self._output_gone()), "MAX"):
            self.runner.logger.warning("%s was complete but is gone; writing it again", self.plan.output)
            record = None
        done = record is not None and record.done
        if resume and self.ranks.reduce(int(done and read_complete(self.plan.output) is not None), "MIN"):
            self.context.rows = read_complete(self.plan.output)["rows"]
            self.runner.logger.info("%s is complete already; nothing to do", self.plan.output)
            return
        start = self.ranks.reduce(record.current.batches if record is not None else 0, "MIN")
        self.ranks.barrier()  # every rank has read the old state before anything is removed
        if start == 0:
            self._start_fresh()
            commit, done = self.record.current, False
        else:
            self.record = record
            commit = self._agreed_commit(record, start)
            self.context.resumed = True
            self.context.batches, self.context.rows = commit.batches, commit.rows
            self.runner.events.emit(Events.INFERENCE_RESUMED, self.context)
        if not done:
            if start:
                self.sink.truncate(commit.sink)
            self._loop(commit)
            self.sink.close()
            self.record.done = True
            self.record.save()
        self.ranks.barrier()  # every shard is closed
        self._finish()

    def _output_gone(self) -> bool:
        """Whether a completed output is no longer on disk (the merged file, or the index of unmerged shards)."""
        output = self.plan.output
        if read_complete(output) is None:
            return False
        return not (self.plan.sink_type.present(output) or output.with_name(output.name + ".index.json").exists())

    def _verified_record(self) -> ProgressRecord | None:
        """This rank's record, checked against this run on every rank (one refusal stops them all).

        An output written by other weights (more training since) is not continued: it is kept,
        moved aside by `_set_aside`, and a new one is written (None is returned).
        """
        record, message, other_weights = None, None, False
        try:
            record = ProgressRecord.read(self.record_path)
            if record is not None:
                run = (self.plan.dataset_length, self.ranks.size, self.limit)
                message = record.mismatch(self.split, self.digest, *run)
                same_run = record.mismatch(self.split, record.digest, *run)
                other_weights = message is not None and same_run is None  # only the weights differ
        except ValueError as error:
            message = str(error)
        refused = message is not None and not other_weights
        if self.ranks.reduce(int(other_weights), "MAX") and not self.ranks.reduce(int(refused), "MAX"):
            self._set_aside(record)
            return None
        if self.ranks.reduce(int(message is not None), "MAX"):
            raise ValueError(
                f"cannot resume inference into {self.plan.output}: "
                f"{message or 'another rank refused its progress record'}; "
                "pass resume=False (or set inference.resume=False) to start over"
            )
        return record

    def _set_aside(self, record: ProgressRecord | None) -> None:
        """Move an output written by other weights, with its records, into a sibling directory named
        after those weights (`<output>.weights-<digest>/`), so a new output starts in its place."""
        plan = self.plan
        self.ranks.barrier()  # every rank has read its record
        if self.ranks.rank == 0:
            digest = record.digest[:12] if record is not None else "unknown"
            aside = plan.output.with_name(f"{plan.output.name}.weights-{digest}")
            aside.mkdir(parents=True, exist_ok=True)
            state = record.current.sink if record is not None and plan.shards == 1 else {}
            files = [*plan.sink_type.files(plan.output, state), plan.output.with_name(plan.output.name + ".index.json")]
            for path in [*files, progress_dir(plan.output)]:
                if path.exists():
                    os.replace(path, aside / path.name)
            self.runner.logger.warning(
                "%s was written by other weights (digest %s; the model changed since, e.g. by more training): "
                "kept in %s, writing a new output for the current weights",
                plan.output,
                digest,
                aside,
            )
        self.ranks.barrier()  # moved before any rank writes anew
        progress_dir(plan.output).mkdir(parents=True, exist_ok=True)

    def _agreed_commit(self, record: ProgressRecord, start: int) -> Commit:
        """This rank's commit at `start`; if any rank lacks one, every rank raises (none waits for the others)."""
        try:
            commit, message = record.at(start), None
        except ValueError as error:
            commit, message = None, str(error)
        if self.ranks.reduce(int(message is not None), "MAX"):
            raise ValueError(message or f"another rank holds no commit at batch {start}; start over with resume=False")
        return commit

    def _start_fresh(self) -> None:
        remove(self.record_path)
        if self.plan.writes and self.plan.shard == 0:
            remove(progress_dir(self.plan.output) / "complete.json")
        self.sink.open()
        plan = self.plan
        self.record = ProgressRecord(
            path=self.record_path,
            split=self.split,
            rank=self.ranks.rank,
            world_size=self.ranks.size,
            shard=plan.shard,
            shards=plan.shards,
            writes=plan.writes,
            digest=self.digest,
            dataset_length=plan.dataset_length,
            current=Commit(0, 0, self.sink.state(), None),
            steps=self.limit,
        )
        self.record.save()

    def _loop(self, commit: Commit) -> None:
        runner = self.runner
        runner.mode = RunnerMode.infer
        runner.split = self.split
        batches, rows, capacity = commit.batches, commit.rows, self.plan.capacity
        loader = runner.dataloaders[self.split]
        for data in self._batches(loader, commit):
            with runner.inference_context():
                outputs = runner.infer_step(data)
            runner.loop.passes.inference_progress()  # a watchdog started by training sees the batches go by
            if not isinstance(outputs, (list, tuple)):
                # a dict or tensor would fail deep in a sink (or be cut and counted per key or row)
                raise TypeError(
                    f"infer_step must return a list with one output per example for infer(output=...), "
                    f"got {type(outputs).__name__} on batch {batches} of split {self.split!r}; "
                    "wrap a batch tensor as list(tensor) and a dict of columns as a list of per-example dicts"
                )
            if capacity is not None:
                outputs = outputs[: max(capacity - rows, 0)]  # the sampler's padding repeats earlier examples
            self.sink.write(outputs)
            rows += len(outputs)
            batches += 1
            if batches % self.interval == 0:
                if self._commit(loader, batches, rows):
                    runner._shutdown()  # every rank stops at this commit, where a restart continues
            elif self.ranks.size == 1 and runner._stop_requested():
                self._commit(loader, batches, rows)  # alone, stop at once and lose nothing
                runner._shutdown()
        if batches != self.record.current.batches:
            self._commit(loader, batches, rows)

    def _batches(self, loader: Any, commit: Commit) -> Iterable[Any]:
        """The loader's batches after `commit`: restored from its state when it can, else skipped by count."""
        remaining = None if self.steps is None else max(self.steps - commit.batches, 0)
        if commit.batches and commit.loader is not None and hasattr(loader, "load_state_dict"):
            loader.load_state_dict(commit.loader)
            return islice(loader, remaining)
        skipped: Iterator[Any] = islice(iter(loader), commit.batches, None)
        return islice(skipped, remaining)

    def _commit(self, loader: Any, batches: int, rows: int) -> bool:
        """Commit `batches`; whether any rank asked to stop (agreed in the same collective)."""
        state = self.sink.state()
        position = jsonable(loader.state_dict()) if hasattr(loader, "state_dict") else None
        # The all-reduce is the agreement: every rank's outputs up to `batches` are durable before
        # any record says so, and the ranks learn together whether one of them was asked to stop.
        stop = self.ranks.reduce(int(self.runner._stop_requested()), "MAX")
        self.record.commit(Commit(batches, rows, state, position))
        self.context.batches, self.context.rows = batches, rows
        self.runner.events.emit(Events.INFERENCE_PROGRESS, self.context)
        return bool(stop)

    def _finish(self) -> None:
        """Merge the shards into the output (the writer of shard 0), mark it complete, then wait for it."""
        plan = self.plan
        if plan.writes and plan.shard == 0:
            if plan.shards > 1:
                rows = _merge(plan)
            else:
                rows = self.record.current.rows
            write_complete(plan.output, rows)
        self.ranks.barrier()
        self.context.rows = read_complete(plan.output)["rows"]


def _merge(plan: InferencePlan) -> int:
    """Interleave the writers' shards into `plan.output` (or index them) and remove them; the row count."""
    records = [ProgressRecord.read(path) for path in sorted(progress_dir(plan.output).glob("rank-*.json"))]
    # a record of an earlier run on more ranks may linger beside this run's: only this run's shards count
    shards = {r.shard: r for r in records if r is not None and r.writes and r.shards == plan.shards and r.done}
    if sorted(shards) != list(range(plan.shards)):
        raise RuntimeError(f"expected shards 0..{plan.shards - 1} of {plan.output}, found {sorted(shards)}")
    ordered = [shards[index] for index in range(plan.shards)]
    paths = [InferencePlan(plan.output, plan.sink_type, r.shard, r.shards, True, None, None).target for r in ordered]
    states = [record.current.sink for record in ordered]
    try:
        plan.sink_type.merge(plan.output, paths, states)
    except NotImplementedError:
        index = {"order": "row i is row i // W of shard i % W", "shards": [str(path) for path in paths]}
        index["rows"] = [record.current.rows for record in ordered]
        plan.output.with_name(plan.output.name + ".index.json").write_text(json.dumps(index, indent=2))
        return sum(index["rows"])
    for path, state in zip(paths, states):
        for file in plan.sink_type.files(path, state):
            remove(file)
    return sum(record.current.rows for record in ordered)


def _interval(runner: Any) -> int:
    section = runner.config.get("inference") if hasattr(runner.config, "get") else None
    interval = section.get("progress_interval", 100) if section is not None else 100
    if isinstance(interval, bool) or not isinstance(interval, int) or interval < 1:
        raise ValueError(f"inference.progress_interval must be an int >= 1, got {interval!r}")
    return interval
