"""[`GlobalMetrics`][danling.metrics.GlobalMetrics]: exact dataset-level metrics.

Each task keeps only the artifacts its metrics need: confusion counts (a fixed-size tensor of
label counts), regression moments (merged per batch), or the predictions and targets themselves
(joined every 64 batches into chunks, with class targets on the host narrowed to the smallest
integer dtype that holds them; AUROC and AUPRC read the chunks as they are). A binary task whose
data is read only as a ranking (the catalogue's AUROC and AUPRC) keeps its host scores by label
instead, sorted in place at each read (`danling.metrics.sides`). Confusion counts
are not updated batch by batch: batches wait in a short queue and are counted together (see
`GlobalMetrics`). Updates stay on the device of the inputs and never synchronise with it;
reading gathers and reduces across ranks.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from functools import lru_cache
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from torch import Tensor

from danling.utils import RoundDict
from danling.utils.rounding import row_builder

from .distributed import gather_across_ranks, is_distributed, pack_group, sum_across_ranks, unpack_group
from .functional._common import Confusion, CountedConfusion, LabelCounter
from .functional._host import HostCounts, LabelHostCounts, host_statistics
from .functional.regression import merge_moments
from .global_state import NARROW_DTYPES, GlobalMetricsState, TaskStoreState, join_rows, narrow_join
from .meter import check_weight, format_number
from .metric_meter import Preprocess, batch_size, metric_name
from .preprocess import _plain_multiclass, base_preprocess, positive_predictions
from .sides import BinarySides, keeps_by_label, labelled_chunks, sorted_ranking, split_by_label
from .state import MetricFunc, MetricState, MetricTask

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup

__all__ = ["GlobalMetrics"]

KINDS = ("val", "bat", "avg")
# Bounds of the per-task queue of batches waiting to be counted (see _TaskStore): 64 batches
# make the cost of one count negligible per batch, and 128 KiB of held tensor storage keeps the
# extra memory small (with 1 MiB, counting a queue of evaluation-size batches peaked 2.5 MiB
# above torchmetrics' accuracy, with 256 KiB 1.2 MiB above it; with 128 KiB binary batches of
# 10,000 peak within 0.1 MiB of it); a batch that alone reaches it is counted at once, never held.
# Training-step batches (a few KiB) are queued all the same.
PENDING_BATCHES = 64
PENDING_BYTES = 1 << 17
# Targets of one batch counted at once (larger batches are counted in pieces of rows): a piece's
# int64 temporaries are then a few hundred KiB. Counting multilabel batches of 10,000 x 10 whole,
# their temporaries left holes between the kept scores of AUROC: acc + AUROC over 1e6 x 10
# scores peaked at 3.1x the scores, in pieces of 32,768 at 2.6x (65,536: 2.8x; 16,384: 2.7x).
COUNT_ELEMENTS = 1 << 15
# Batches of at least this many targets are counted by `update`, never queued: waiting gains
# nothing at their size, and a queued evaluation batch held its targets until the next one came
# (binary acc + AUROC over batches of 10,000 peaked 0.4 MiB higher). A store of confusion counts
# alone counts such a batch into counts of its own, which its `val` and `bat` read: it holds no
# batch (binary accuracy held 0.12 MiB more than torchmetrics' at its peak, the latest batch kept
# for `val`). Smaller batches, as in training steps, wait in the queue.
COUNT_ALONE = 1 << 12
# Kept predictions and targets are joined into one chunk every this many batches: reads then
# handle a few large pieces instead of every batch, and a chunk owns its memory (a batch that
# is a view of a larger tensor no longer keeps all of it alive).
DATA_BATCHES = 64
# ... or once they hold this many bytes (scores and targets as they came: int64 class targets are
# narrowed only by the join), or a sixteenth of the bytes kept so far if more: joining copies
# the batches, so this bounds the memory held twice while it runs (and freed afterwards) to a
# small share of the data, while the count of chunks stays small. Counting bytes, not scores,
# keeps one-score binary batches, whose int64 targets are twice their scores, from piling up.
# 256 KiB rather than 1 MiB: binary AUROC over 1e5 scores peaked at 1.3-1.6 MiB above the start
# instead of 1.7 MiB (0.38 MiB of scores); from 4 MiB kept on, the sixteenth decides anyway.
DATA_BYTES = 1 << 18


class _TaskStore(TaskStoreState):
    """Accumulated artifacts of one task (or raw data for plain metric functions: `task=None`).

    Confusion counts are integers, so counting many batches at once gives exactly the counts of
    counting them one by one. `update` therefore only queues what the counting needs (the scores
    of a multiclass batch, whose row-wise argmax does not depend on the other rows; the predicted
    labels of a binary or multilabel batch, whose logit/probability decision is per batch) with
    the targets, and `flush` counts the queue with one concatenation and one scatter. The queue
    is counted when it holds `PENDING_BATCHES` batches or `PENDING_BYTES` of tensor storage,
    when the dtype or device of the batches changes, and before anything reads the counts.
    """

    def __init__(self, task: MetricTask | None, needs: Iterable[str]) -> None:
        self.task = task
        self.needs = frozenset(needs)
        # Looked up once here because update() runs every batch.
        self.wants_confusion = "confusion" in self.needs
        self.wants_moments = "moments" in self.needs
        # "ranking" readers take the data as an unordered set of (score, label) pairs: a binary
        # store of them alone keeps host scores by label (`BinarySides`), other stores keep data.
        self.wants_data = "data" in self.needs or "ranking" in self.needs
        self.order_free = (
            task is not None and task.kind == "binary" and "ranking" in self.needs and "data" not in self.needs
        )
        self.wants_bins = "bins" in self.needs
        # Confusion counts alone: `val` and `bat` read counts (see `COUNT_ALONE`), never the data.
        self.counts_latest = self.needs == {"confusion"}
        # Class targets of these tasks are int64 after format(), so narrowed ones widen back exactly.
        self.narrows = task is not None and task.kind != "regression"
        self.num_classes = task.num_classes if task is not None and task.kind == "multiclass" else None
        # GlobalMetrics requires the task size and format() enforces it on every batch, so one
        # label counter serves every batch.
        self.counter: LabelCounter | None = task.label_counter() if self.wants_confusion else None
        self.reset()

    def reset(self) -> None:
        # Confusion counts stay flat; `confusion` shapes them on read. Queued batches are dropped.
        self._counts: Tensor | None = None
        self._host_view: tuple[Tensor | None, Sequence[int] | None] = (None, None)
        self.pending: list[tuple[Tensor, Tensor]] = []
        self.pending_bytes = 0
        self._queue_kind: tuple[torch.dtype, torch.dtype, torch.device] | None = None  # set by defer
        self.moments: Tensor | None = None
        self.bins: Tensor | None = None  # per-bin score counts: fixed size, added batch by batch
        self.bins_invalid: Tensor | None = None  # per-column errors the bins left out (nan if any)
        self.inputs: list[Tensor] = []  # batches not yet joined into a chunk
        self.targets: list[Tensor] = []
        self.chunks: list[tuple[Tensor, Tensor]] = []
        self.data_bytes = 0  # held by the batches not yet joined
        self.kept_bytes = 0  # held by the joined chunks
        self.data_limit = DATA_BYTES
        # The latest batch, for `val` and `bat`. A store that keeps the data holds it there and
        # sets `last` to None: `latest()` reads it back as the tail of the data, so a joined batch
        # is not held twice (its int64 targets were 0.2x of binary scores at N = 1e5).
        self.last: tuple[Tensor, Tensor] | None = None
        self.last_rows: int | None = None  # rows of the latest batch, where it is the data's tail
        self.last_counts: Tensor | None = None  # counts of the latest batch, where it was counted alone
        # An order-free binary store's data, by label (see `order_free`): set by the first batch
        # when it is on the host; on another device the store keeps the batches in order instead.
        self.sides: BinarySides | None = None

    def update(self, input: Tensor, target: Tensor) -> None:
        task = self.task
        if task is not None:
            if self.num_classes is not None and _plain_multiclass(input, target, self.num_classes):
                # Already in final form: what format() returns for it, without its call chain.
                input = input.detach() if input.requires_grad else input
            else:
                input, target = task.format(input, target)
            if self.wants_confusion:
                # Binary and multilabel decisions wait as booleans (1 byte each, not int64's 8).
                source = input if self.num_classes is not None else positive_predictions(input, task.threshold)
                self.take(source, target)
            if self.wants_moments:
                moments = task.moments(input, target)
                self.moments = moments if self.moments is None else merge_moments(self.moments, moments)
            if self.wants_bins:
                with torch.inference_mode():  # added to in place by later batches, wherever they run
                    bins, invalid = task.binned(input, target), task.binned_invalid(input, target)
                    self.bins = bins if self.bins is None else self.bins.add_(bins)
                    self.bins_invalid = invalid if self.bins_invalid is None else self.bins_invalid.add_(invalid)
        if self.wants_data:
            if self.sides is not None or (self.order_free and not self.kept() and keeps_by_label(input.device)):
                if self.sides is None:
                    self.sides = BinarySides(task.ignore_index)
                self.sides.add(input, target)
                self.last = None  # a loaded latest batch gives way to this one
                return
            self.inputs.append(input)
            self.targets.append(target)
            self.data_bytes += input.numel() * input.element_size() + target.numel() * target.element_size()
            self.last, self.last_rows = None, input.shape[0]
            if len(self.inputs) >= DATA_BATCHES or self.data_bytes >= self.data_limit:
                self.join()
        else:
            self.keep_latest(input, target)

    def keep_latest(self, input: Tensor, target: Tensor) -> None:
        """Hold the latest batch for `val` and `bat`, unless it was counted alone (its counts serve)."""
        self.last = (input, target) if self.last_counts is None else None

    def take(self, source: Tensor, target: Tensor) -> None:
        """Count a batch of `COUNT_ALONE` targets or more at once, or queue it."""
        self.last_counts = None
        if target.numel() < COUNT_ALONE:
            self.defer(source, target)
            return
        self.flush()  # as for any batch counted at once: the queue goes first
        if not self.counts_latest:
            self._count([(source, target)])
            return
        with torch.inference_mode():
            counts = self._accumulate(self.counter.empty(source.device), source, target)
            if self._counts is None:
                self._keep_counts(counts.clone())
            else:
                self._counts.add_(counts)
        self.last_counts = counts

    def kept(self) -> bool:
        """Whether any data is kept (in order or by label)."""
        return bool(self.inputs or self.chunks or self.sides is not None)

    def latest(self) -> tuple[Tensor, Tensor] | None:
        """The latest batch as formatted (int64 class targets), `None` before any update.

        An order-free store gives its rows grouped by label (the metrics that read it take no order).
        """
        if self.sides is not None:
            return self.sides.latest() if self.last is None else self.last
        if self.last_rows is None:
            return self.last
        if self.inputs:
            return self.inputs[-1], self.targets[-1]
        input, target = self.chunks[-1]
        start = input.shape[0] - self.last_rows
        input, target = input[start:], target[start:]
        return input, target.long() if self.narrows and target.dtype in NARROW_DTYPES else target

    def join(self) -> None:
        """Join the batches kept since the last call into one chunk of the kept data."""
        inputs, targets = self.inputs, self.targets
        if not inputs:
            return
        self.inputs, self.targets, self.data_bytes = [], [], 0
        input = inputs[0] if len(inputs) == 1 else torch.cat(inputs)
        del inputs
        target = narrow_join(targets) if self.narrows else join_rows(targets)
        self.chunks.append((input, target))
        self.kept_bytes += input.numel() * input.element_size() + target.numel() * target.element_size()
        self.data_limit = max(DATA_BYTES, self.kept_bytes // 16)

    def defer(self, source: Tensor, target: Tensor) -> None:
        """Queue a batch for counting: multiclass scores or predicted labels, with the targets."""
        pending = self.pending
        if pending:
            # The usual batch joins a queue of its kind (dtypes and device kept from the queue's
            # first batch) and is small: appended with the fewest reads, as this runs every batch.
            source_dtype, target_dtype, device = self._queue_kind
            if (
                source.dtype is source_dtype
                and target.dtype is target_dtype
                and source.device == device
                and target.device == device
            ):
                # Storage, not elements: a small view of a large tensor keeps all of it alive.
                held = source.untyped_storage().nbytes() + target.untyped_storage().nbytes()
                if held < PENDING_BYTES:
                    pending.append((source, target))
                    self.pending_bytes += held
                    if len(pending) >= PENDING_BATCHES or self.pending_bytes >= PENDING_BYTES:
                        self.flush()
                    return
            self.flush()  # a new kind of batch (or one too big to hold): count what is queued first
        device = source.device
        held = source.untyped_storage().nbytes() + target.untyped_storage().nbytes()
        if (
            held >= PENDING_BYTES
            or target.device != device
            or (self._counts is not None and self._counts.device != device)
        ):
            # Too big to gain from waiting, or a device mix that must fail now, as it always did.
            self._count([(source, target)])
            return
        self._queue_kind = (source.dtype, target.dtype, device)
        self.pending.append((source, target))
        self.pending_bytes = held
        if PENDING_BATCHES <= 1:
            self.flush()

    def flush(self) -> None:
        """Count the queued batches into the confusion counts."""
        pending = self.pending
        if pending:
            self.pending, self.pending_bytes = [], 0
            self._count(pending)

    def _count(self, batches: list[tuple[Tensor, Tensor]]) -> None:
        # Always under inference mode: the counts are then inference tensors wherever the
        # updates ran, and every in-place add to them is allowed (reads work on copies).
        with torch.inference_mode():
            if len(batches) == 1:
                ((source, target),) = batches
            else:
                source = torch.cat([source for source, _ in batches])
                target = torch.cat([target for _, target in batches])
            if self._counts is None:
                self._keep_counts(self.counter.empty(source.device))
            self._accumulate(self._counts, source, target)

    def _keep_counts(self, counts: Tensor) -> None:
        # The running table, with a host view of it made now rather than in a read (see
        # `LabelCounter.host_view`); every later update adds to this tensor in place.
        self._counts = counts
        self._host_view = (counts, self.counter.host_view(counts))

    def _accumulate(self, counts: Tensor, source: Tensor, target: Tensor) -> Tensor:
        # Large batches are counted in pieces of rows, so the count's int64 temporaries (predicted
        # labels, rows, flat positions) stay small: those of a whole batch left holes of its size
        # between the data kept at every update.
        rows = max(1, COUNT_ELEMENTS // max(1, math.prod(target.shape[1:])))  # no tensor op: this runs per flush
        pieces = zip(source.split(rows), target.split(rows)) if target.shape[0] > rows else ((source, target),)
        for source_piece, target_piece in pieces:
            pred = self.task.predicted_labels(source_piece) if self.num_classes is not None else source_piece
            self.counter.accumulate(counts, pred, target_piece)
        return counts

    def state_shapes(self) -> dict[str, tuple[int, ...]]:
        """The shape of each tensor a state of this task holds (of one row, for the data), by state key."""
        task, shapes = self.task, {}
        if task is None:  # plain functions: any data
            return shapes
        if self.counter is not None:
            shapes["counts"] = shapes["last_counts"] = (self.counter.size,)
        if self.wants_moments:
            shapes["moments"] = tuple(task.empty_moments("cpu").shape)
        if self.wants_bins:
            shapes["bins"] = (1 if task.kind == "binary" else task.size, 2, task.bins)
            shapes["bins_invalid"] = (1 if task.kind == "binary" else task.size,)
        input, target = _formatted_empty(task, "cpu")
        shapes["inputs"] = shapes["last_input"] = tuple(input.shape[1:])
        shapes["targets"] = shapes["last_target"] = tuple(target.shape[1:])
        return shapes

    def latest_counts(self, device: Any) -> Tensor:
        """Confusion counts of the latest batch (zeros before any update)."""
        if self.last_counts is not None:
            return self.last_counts
        if self.last is None:
            return self.counter.empty(device)
        input, target = self.last
        source = input if self.num_classes is not None else positive_predictions(input, self.task.threshold)
        with torch.inference_mode():
            return self._accumulate(self.counter.empty(input.device), source, target)

    @property
    def counts(self) -> Tensor | None:
        """Flat confusion counts of everything seen since the last reset (queued batches counted first)."""
        self.flush()
        return self._counts

    def __getstate__(self) -> dict[str, Any]:
        self.flush()  # copies and pickles hold counts, not queued references to the caller's tensors
        state = self.__dict__.copy()
        state["_host_view"] = (None, None)  # a view of this table's memory: a copy reads its own with `tolist`
        return state

    @property
    def confusion(self) -> Confusion | None:
        """Local confusion counts of everything seen since the last reset (`None` before any update)."""
        counts = self.counts
        return None if counts is None else self.counter.confusion(counts, copy=True)

    def data_chunks(self) -> list[tuple[Tensor, Tensor]]:
        """All local data as chunks of rows, the batches kept since the last join joined first.

        The join narrows those batches' int64 class targets (8 bytes a binary score of 4) before
        a read makes its copies: it copies at most `data_limit` bytes, a sixteenth of the data or
        less, and the read's sorted copies are as large as the scores, so the join is never the
        peak. Read where they lay, binary AUROC over 1e5 scores held 2.66x the scores at its peak
        instead of 2.48x. A gather sends narrowed targets too.
        """
        if self.sides is not None:
            return self.sides.chunks()
        self.join()
        return list(self.chunks)  # a state keeps its list: later joins append to the store's

    def local_data(self) -> tuple[Tensor, Tensor] | None:
        """All local data, concatenated once and kept concatenated (targets as formatted).

        An order-free store gives a new concatenation of its sides at each call.
        """
        if self.sides is not None:
            chunks = self.sides.chunks()
            if not chunks:
                return None
            return torch.cat([i for i, _ in chunks]), torch.cat([t.long() for _, t in chunks])
        self.join()
        if not self.chunks:
            return None
        if len(self.chunks) > 1:
            self.chunks = [(torch.cat([i for i, _ in self.chunks]), torch.cat([t for _, t in self.chunks]))]
        input, target = self.chunks[0]
        return input, target.long() if self.narrows and target.dtype in NARROW_DTYPES else target

    def state(
        self, kind: str, device: Any, group: ProcessGroup | None = None, distributed: bool | None = None
    ) -> MetricState | tuple[Tensor, Tensor] | None:
        """The state metrics read for `kind`: the latest batch (`val`, `bat`) or all data (`avg`).

        `bat` and `avg` combine the ranks of `group` (every rank when `None`). `distributed` is
        `is_distributed(group)` where the caller knows it already.
        """
        if distributed is None:
            distributed = is_distributed(group)
        chunks = None
        if kind == "avg":
            data, artifacts = None, {}
            if self.wants_data:
                if distributed and self.order_free:
                    chunks, ranking = self._gathered_sides(device, group)
                    if ranking is not None:
                        artifacts["ranking"] = ranking
                elif distributed:
                    # Each rank's chunks go straight into the buffer it sends, and every rank's
                    # data arrives in one buffer: held once, never concatenated again.
                    data = _gather_pair(self.data_chunks(), device, group)
                    chunks = None if data is None or self.task is None else [data]
                elif self.sides is not None:
                    # Sorted in place and counted where they lie: no copy of the scores.
                    artifacts["ranking"] = self.sides.ranking()
                    chunks = self.sides.chunks() or [_formatted_empty(self.task, device)]
                elif self.task is not None:
                    chunks = self.data_chunks()  # read where they lie, no concatenated copy
                else:
                    data = self.local_data()
            if "confusion" in self.needs:
                artifacts["confusion"] = self._synced_confusion(device, group, distributed)
            if "moments" in self.needs:
                artifacts["moments"] = self._synced_moments(device, group, distributed)
            if "bins" in self.needs:
                artifacts["bins"], artifacts["bins_invalid"] = self._synced_bins(device, group, distributed)
        elif self.counts_latest and (self.last_counts is not None or (kind == "bat" and distributed)):
            # Counts of the latest batch, summed over the ranks for `bat`: every rank of a store
            # of counts alone reduces counts, whatever the size of its own latest batch.
            counts = self.latest_counts(device)
            if kind == "bat" and distributed:
                counts = sum_across_ranks(counts, device, group)
            # No data: the store keeps counts alone, so its metrics read only the confusion (a
            # metric that reads data anyway is told so, rather than given an empty batch).
            return MetricState(self.task, confusion=self.counter.confusion(counts))
        else:
            data, artifacts = self.latest(), {}
        if kind == "bat" and distributed:
            data = _gather_pair(data, device, group)
        if self.task is None:
            return data
        if chunks:
            return MetricState(self.task, chunks=chunks, **artifacts)
        if data is None:
            if artifacts and not self.wants_data:
                # Every artifact the store's metrics read is here; an empty batch would only turn a
                # metric that reads data against its declared needs into a silent NaN.
                return MetricState(self.task, **artifacts)
            data = _formatted_empty(self.task, device)
        return MetricState(self.task, *data, **artifacts)

    def _gathered_sides(self, device: Any, group: ProcessGroup | None) -> tuple[list[tuple[Tensor, Tensor]], Any]:
        """Every rank's scores of positives, of negatives and invalid rows, each gathered into one
        new buffer; with their ranking, counted from the buffers sorted in place, where they are
        host float data. No targets travel and the ranking copies nothing: about half of what
        gathering the rows in order and ranking them takes. Every rank of an order-free store
        comes here (the choice depends on the metrics alone, never on a rank's data), whether it
        keeps its rows by label or, on a device, in order (split here, at the read)."""
        if self.sides is not None:
            positives, negatives, invalid = self.sides.sides()
        else:
            positives = negatives = None
            invalid = []
            pieces: tuple[list[Tensor], list[Tensor]] = ([], [])
            for scores, target in self.data_chunks():
                positive, negative, wrong = split_by_label(scores, target, self.task.ignore_index)
                pieces[0].append(positive)
                pieces[1].append(negative)
                if wrong is not None:
                    invalid.append(wrong)
            positives, negatives = (torch.cat(side) if side else None for side in pieces)
        positives = gather_across_ranks(positives, device, group)
        negatives = gather_across_ranks(negatives, device, group)
        wrong_scores = gather_across_ranks([scores for scores, _ in invalid] or None, device, group)
        wrong_targets = gather_across_ranks([target for _, target in invalid] or None, device, group)
        invalid = [] if wrong_scores is None else [(wrong_scores, wrong_targets)]
        chunks = labelled_chunks(positives, negatives, invalid) or [_formatted_empty(self.task, device)]
        sides = [side for side in (positives, negatives) if side is not None]
        if not all(side.device.type == "cpu" and side.dtype in (torch.float32, torch.float64) for side in sides):
            return chunks, None  # device data: ranked there, from the chunks
        empty = np.empty(0, dtype=np.float32)
        # The gathered buffers are new tensors, this read's own: sorting them in place is safe.
        ranking = sorted_ranking(
            positives.numpy() if positives is not None else empty,
            negatives.numpy() if negatives is not None else empty,
            0 if wrong_scores is None else wrong_scores.shape[0],
        )
        return chunks, ranking

    def counted_confusion(self) -> CountedConfusion | None:
        """The `Confusion` of everything counted on this rank (queued batches counted first), `None` before any count.

        A view is enough: it lives for one read, while no update can run. It carries the table's
        host view only for the table the view was made of (a loaded or moved table has none).
        """
        if self.pending:  # `self.counts` without its calls: this runs at every read
            self.flush()
        counts = self._counts
        if counts is None:
            return None
        kept, view = self._host_view
        return CountedConfusion(self.counter, counts, view if kept is counts else None)

    def host_statistics(self) -> HostCounts | LabelHostCounts | None:
        """`counts_of_confusion(self.counted_confusion())` with no confusion object made: the host
        statistics of everything counted on this rank, `None` before any count or where the
        tensor path applies (see `_host.host_statistics`). For a reader that reads them once."""
        if self.pending:
            self.flush()
        counts = self._counts
        if counts is None:
            return None
        kept, view = self._host_view
        return host_statistics(self.counter, counts, view if kept is counts else None)

    def _synced_confusion(self, device: Any, group: ProcessGroup | None, distributed: bool) -> Confusion:
        confusion = self.counted_confusion()
        if confusion is None:
            latest = self.latest()
            confusion = self.task.empty_confusion(latest[0].device if latest else device)
        if not distributed:
            return confusion
        flat = torch.cat([confusion.matrix.reshape(-1), confusion.invalid.reshape(1)])
        flat = sum_across_ranks(flat, device, group)
        return Confusion(flat[:-1].view_as(confusion.matrix), flat[-1])

    def _synced_bins(self, device: Any, group: ProcessGroup | None, distributed: bool) -> tuple[Tensor, Tensor]:
        bins, invalid = self.bins, self.bins_invalid
        task = self.task
        columns = 1 if task.kind == "binary" else task.size
        if bins is None:  # a rank without samples adds zeros of the same shape
            bins = torch.zeros((columns, 2, task.bins), dtype=torch.long, device=device)
        if invalid is None:  # none yet, or a state written before errors were counted
            invalid = torch.zeros(columns, dtype=torch.long, device=bins.device)
        if not distributed:
            return bins, invalid
        # One all-reduce of the counts and the errors together.
        flat = sum_across_ranks(torch.cat([bins.reshape(-1), invalid.to(bins.device)]), device, group)
        return flat[:-columns].view_as(bins), flat[-columns:]

    def _synced_moments(self, device: Any, group: ProcessGroup | None, distributed: bool) -> Tensor:
        moments = self.moments if self.moments is not None else self.task.empty_moments(device)
        if not distributed:
            return moments
        gathered = gather_across_ranks(moments.unsqueeze(0), device, group)
        merged = gathered[0]
        for other in gathered[1:]:
            merged = merge_moments(merged, other)
        return merged.to(moments.device)


class GlobalMetrics(GlobalMetricsState):
    r"""Exact metrics over everything passed to `update`, across all ranks.

    Metrics are [`MetricFunc`][danling.metrics.MetricFunc]s (their task says what to store;
    metrics of one task share the stored artifacts and each artifact is built once per read)
    or plain functions of `(input, target)` (which get all predictions and targets,
    concatenated). Build ready-made sets with
    [`multiclass_metrics`][danling.metrics.multiclass_metrics] and friends.

    `val` holds the metrics of the latest local batch, `bat` those of the latest batch of all
    ranks together, and `avg` those of all data of all ranks; `compute()` is `avg`. "All ranks"
    are the ranks of `group` (every rank when `None`). Reading `bat` or `avg` in a multi-process
    run is a collective: every rank of `group` must read. Shards may differ in size between
    ranks, and a rank may have no data at all.

    Updates are batched. `update` checks a batch and keeps it (for confusion counts: the scores,
    or the predicted labels of binary and multilabel tasks, with the targets) but runs no
    counting then; up to 64 batches, holding at most 128 KiB of tensor storage, are then counted
    with one concatenation and one scatter. The queue is counted when it is full, when the dtype
    or device of the batches changes, and before anything reads the counts (`avg`, `compute`,
    copies and pickles); `reset` drops it. A batch whose tensors alone reach 128 KiB (large
    vocabularies, dense outputs) is counted at once and never held, and so is a batch of 4096
    targets or more (an evaluation batch); a container of confusion metrics only then keeps that
    batch's own counts, which its `val` and `bat` read (`bat` sums them over the ranks) instead of
    the batch. Counts are integers, so the
    results are exactly those of counting each batch on its own. As with metrics that keep the
    data, the tensors passed to `update` are read later: do not change them in place afterwards.
    Counting always runs under `torch.inference_mode()`, so updates and reads may happen inside
    or outside it in any mix. Regression moments and kept data are updated per batch as before.

    A binary task whose metrics read the data only as a ranking (`requires="ranking"`: the
    catalogue's exact AUROC and AUPRC, with or without confusion metrics) keeps host scores
    grouped by label, with no targets, and each read sorts them in place: about half the memory of
    scores kept in order plus their sorted copy. The rows its metrics read (for `val` and `bat`
    too) and those of its `state_dict` are then grouped by label, not in the order they came;
    values are the same. Batches on another device (CUDA) are kept in order.

    Args:
        *metrics: Metric functions, named after their `__name__` (or `MetricFunc.name`).
        preprocess: Preprocessing applied to every batch first (`None` to skip).
        device: If given, inputs are moved there before being stored; also used for collectives.
        group: Process group whose ranks `bat` and `avg` combine, e.g. the data-parallel group of
            a [`Topology`][danling.distributed.Topology] (ranks that hold the same batch must not
            be counted twice); every rank when `None`. Assignable later as `metrics.group`.
        **named_metrics: Metric functions under explicit names.

    Examples:
        >>> import torch
        >>> from danling.metrics import binary_metrics
        >>> metrics = binary_metrics()
        >>> metrics.update([0.2, 0.8, 0.6, 0.3], [0, 1, 0, 1])
        >>> metrics.update([0.9, 0.1], [1, 0])
        >>> metrics.val["acc"], metrics.avg["acc"]
        (1.0, 0.6666...)
        >>> round(metrics.avg["auroc"], 4)
        0.8889
        >>> f"{metrics:.2f}"
        'acc: 1.00 (0.67)\tf1: 1.00 (0.67)\tmcc: 1.00 (0.33)\tauroc: 1.00 (0.89)\tauprc: 1.00 (0.92)'

        Plain functions receive all predictions and targets at once:

        >>> from danling.metrics.functional import binary_auroc
        >>> metrics = GlobalMetrics(auroc=binary_auroc)
        >>> metrics.update(torch.tensor([0.2, 0.8]), torch.tensor([0, 1]))
        >>> metrics.update(torch.tensor([0.7, 0.1]), torch.tensor([0, 1]))
        >>> metrics.compute()["auroc"]
        0.5
    """

    group: ProcessGroup | None = None

    def __init__(
        self,
        *metrics: Callable | MetricFunc,
        preprocess: Preprocess | None = base_preprocess,
        device: torch.device | str | None = None,
        group: ProcessGroup | None = None,
        **named_metrics: Callable | MetricFunc,
    ) -> None:
        self.metrics: dict[str, Callable] = {metric_name(m): m for m in metrics}
        self.metrics.update(named_metrics)
        self.preprocess = preprocess
        self.device = device
        self.group = group
        needs: dict[MetricTask | None, set[str]] = {}
        for name, metric in self.metrics.items():
            if not callable(metric):
                raise TypeError(f"metric {name!r} must be callable, got {type(metric).__name__}")
            task = metric.task if isinstance(metric, MetricFunc) else None
            needs.setdefault(task, set()).update(metric.requires if isinstance(metric, MetricFunc) else {"data"})
            if task is not None and task.size is None:
                raise ValueError(
                    f"metric {name!r}: GlobalMetrics needs the size of a {task.kind} task (num_classes, num_labels or "
                    "num_outputs) so that ranks without data can take part in synchronisation"
                )
        self._stores = {task: _TaskStore(task, need) for task, need in needs.items()}
        # The common case gets a short path in `update`: one multiclass task that needs only
        # confusion counts, plain preprocessing and no device move.
        store = next(iter(self._stores.values())) if len(self._stores) == 1 else None
        plain = (
            store is not None
            and store.num_classes is not None
            and store.needs == {"confusion"}
            and preprocess is base_preprocess
            and device is None
        )
        self._plain_store: _TaskStore | None = store if plain else None
        self._host_reads = _host_reads(self.metrics, self._stores)
        self._cache: dict[str, tuple[RoundDict, int]] = {}
        self.reset()

    def reset(self) -> GlobalMetrics:
        """Drop all stored data; returns the container."""
        for store in self._stores.values():
            store.reset()
        self._cache.clear()
        self._count = 0
        self._last_count = 0
        return self

    def update(self, input: Any, target: Any, *, n: int | None = None) -> None:
        """Check one batch and keep what the metrics need (no host synchronisation; counted in groups).

        Args:
            input: Predictions: a tensor, `NestedTensor` or nested sequence.
            target: Ground truth of the same kinds.
            n: Samples in the batch (used to weight tasks in `MultiTaskMetrics`); defaults to
                the length of the preprocessed target.

        Raises:
            ValueError: If the batch does not fit a metric's task (shapes, dtypes, class count),
                or `n` is negative, NaN or infinite.
            TypeError: If `n` is not a number.
        """
        store = self._plain_store
        # Scores (N, C) and labels (N,) as they come from a classifier: the store's own check, then
        # straight into its queue without the general path's layers (this runs every batch).
        if store is not None and n is None and _plain_multiclass(input, target, store.num_classes):
            if input.requires_grad:
                input = input.detach()
            store.take(input, target)
            store.keep_latest(input, target)
            n = target.shape[0]
            self._last_count = n
            self._count += n
            self._cache.clear()
            return
        if n is not None:  # before anything is kept: a refused batch leaves no trace
            check_weight(n)
        preprocess = self.preprocess
        if preprocess is base_preprocess and type(input) is Tensor and type(target) is Tensor:
            # What base_preprocess does to plain tensors, without its calls (this runs every batch).
            input = input.detach() if input.requires_grad else input
            target = target.detach() if target.requires_grad else target
        elif preprocess is not None:
            input, target = preprocess(input, target)
        if self.device is not None:
            input, target = input.to(self.device), target.to(self.device)
        for store in self._stores.values():
            store.update(input, target)
        if n is None:  # a plain tensor's length without the general helper's conversions
            n = (target.shape[0] if target.ndim else 1) if type(target) is Tensor else batch_size(target)
        self._last_count = n
        self._count += self._last_count
        self._cache.clear()

    def value(self) -> RoundDict:
        """Metrics of the latest batch on this rank."""
        return self._read("val")[0]

    def batch(self) -> RoundDict:
        """Metrics of the latest batch of every rank together."""
        return self._read("bat")[0]

    def average(self) -> RoundDict:
        """Metrics of all data of all ranks."""
        return self._read("avg")[0]

    compute = average

    @property
    def val(self) -> RoundDict:
        return self.value()

    @property
    def bat(self) -> RoundDict:
        return self.batch()

    @property
    def avg(self) -> RoundDict:
        return self.average()

    @property
    def count(self) -> int:
        """Samples seen on this rank since the last reset."""
        return self._count

    def read(self, kind: str) -> tuple[RoundDict, dict[str, int]]:
        """Metric values of kind `"val"`, `"bat"` or `"avg"`, with the sample count behind them."""
        values, count = self._read(kind)
        return values, dict.fromkeys(self.metrics, count)

    def _read(self, kind: str) -> tuple[RoundDict, int]:
        # `read` without the per-metric counts, which `value`, `batch` and `average` drop.
        if kind not in KINDS:
            raise ValueError(f"kind must be one of {', '.join(KINDS)}, got {kind!r}")
        # Synchronised results are never cached: ranks whose caches disagreed would deadlock.
        group = self.group
        distributed = is_distributed(group)
        cacheable = kind == "val" or not distributed
        if cacheable and kind in self._cache:
            return self._cache[kind]
        values = self._host_average() if kind == "avg" and not distributed and self._host_reads is not None else None
        if values is None:
            states = {task: store.state(kind, self.device, group, distributed) for task, store in self._stores.items()}
            values = RoundDict.from_flat({name: _evaluate(metric, states) for name, metric in self.metrics.items()})
        count = self._last_count if kind != "avg" else self._count
        if kind != "val" and distributed:
            count = int(sum_across_ranks(torch.tensor([count], dtype=torch.long), self.device, group).item())
        if cacheable:
            self._cache[kind] = (values, count)
        return values, count

    def _host_average(self) -> RoundDict | None:
        """`avg` of a store of counts alone, its counts read on the host straight into each metric's
        host form (see `_host_reads`); `None` where the general path applies: nothing counted yet, a
        table the host does not read (large, on a device), or metrics changed since construction.

        The same values as the general path, which reaches the same host forms with the same
        statistics through a `MetricState` and each metric's `evaluate`: on a cold read (one per
        epoch) those layers were about 40% of the read's time.
        """
        store, reads, build = self._host_reads
        metrics = self.metrics
        if len(metrics) != len(reads):
            return None
        for name, metric in reads:  # the container's metrics are a public dict: still these?
            if metrics.get(name) is not metric:
                return None
        counts = store.host_statistics()
        if counts is None:
            return None
        values = {}
        for name, metric in reads:
            form = getattr(metric.fn, "host", None)
            if form is None:  # `fn` replaced on the metric
                return None
            host, average = form
            values[name] = host(counts, average)
        return build(values)

    def __format__(self, format_spec: str) -> str:
        bat, avg = self.bat, self.avg
        return "\t".join(
            f"{name}: {format_number(bat[name], format_spec)} ({format_number(avg[name], format_spec)})"
            for name in self.metrics
        )

    def __repr__(self) -> str:
        return f"{type(self).__name__}({', '.join(self.metrics)})"

    def __getstate__(self) -> dict[str, Any]:
        return pack_group(self.__dict__.copy())

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(unpack_group(state))


def _host_reads(
    metrics: Mapping[str, Callable], stores: Mapping[MetricTask | None, _TaskStore]
) -> tuple[_TaskStore, tuple[tuple[str, MetricFunc], ...], Callable[[Mapping[str, Any]], RoundDict]] | None:
    """What `GlobalMetrics._host_average` reads: the one store, of counts alone, each metric by name
    and the builder of the result (`row_builder` of the names), where every metric is a plain
    `MetricFunc` (no `evaluate` of its own) with a host form (the catalogue's confusion metrics,
    see `factories._CatalogMetric.host`); else `None`."""
    if len(stores) != 1:
        return None
    ((task, store),) = stores.items()
    if task is None or not store.counts_latest:
        return None
    reads = []
    for name, metric in metrics.items():
        if type(metric) is not MetricFunc or getattr(metric.fn, "host", None) is None:
            return None
        reads.append((name, metric))
    return store, tuple(reads), row_builder(metrics)


def _evaluate(metric: Callable, states: Mapping[MetricTask | None, Any]) -> Any:
    if isinstance(metric, MetricFunc):
        value = metric.evaluate(states[metric.task])  # a host statistic stays a float: no tensor to read back
    else:
        data = states[None]
        value = math.nan if data is None else metric(*data)
    if isinstance(value, Tensor) and value.ndim == 0:
        return value.item()
    return value


def _gather_pair(
    data: tuple[Tensor, Tensor] | list[tuple[Tensor, Tensor]] | None, device: Any, group: ProcessGroup | None
) -> tuple[Tensor, Tensor] | None:
    """Every rank's `(input, target)` (or chunks of them) concatenated, rank after rank (`group` is distributed)."""
    pairs = [] if data is None else data if isinstance(data, list) else [data]
    input = gather_across_ranks([input for input, _ in pairs] or None, device, group)
    target = gather_across_ranks([target for _, target in pairs] or None, device, group)
    return None if input is None else (input, target)


@lru_cache(maxsize=64)
def _formatted_empty(task: MetricTask, device: Any) -> tuple[Tensor, Tensor]:
    # Shared by every container of the task: zero-size tensors hold nothing to change.
    return task.format(*_empty_pair(task, device))


def _empty_pair(task: MetricTask, device: Any) -> tuple[Tensor, Tensor]:
    size = task.size
    if task.kind == "binary":
        return torch.empty(0, device=device), torch.empty(0, dtype=torch.long, device=device)
    if task.kind == "multiclass":
        return torch.empty((0, size), device=device), torch.empty(0, dtype=torch.long, device=device)
    if task.kind == "multilabel":
        return torch.empty((0, size), device=device), torch.empty((0, size), dtype=torch.long, device=device)
    return torch.empty((0, size), device=device), torch.empty((0, size), device=device)
