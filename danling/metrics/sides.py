"""Binary scores kept by label, for metrics that read them in any order (AUROC, AUPRC).

Exact AUROC and average precision need each side's scores sorted (`functional._ranking`). A
store that keeps the batches in order must copy every score into sorted per-side arrays at each
read: as much memory again as the scores, on top of the scores and their targets (2.25x the
scores at the least for binary data). When every metric of a binary task reads the data only as
an unordered set of (score, label) pairs (the `"ranking"` artifact), the store can keep them as
the ranking wants them instead:

- each batch's scores go straight into one of two growing arrays, those of its positives and
  those of its negatives, so the targets need no storage at all (the array says the label);
- a read sorts both arrays in place and counts from them: no copy, no index tensor;
- the arrays live in anonymous memory maps grown with `mremap` (`mmap.resize`), which moves page
  tables rather than bytes: growing never holds the old and the new array at once, and capacity
  never written is never resident.

Rows whose target is neither a label nor `ignore_index` make both metrics `nan`, as everywhere;
they are kept as they came (score and target) so that every read sees them. The latest batch is
kept apart (its pieces, a batch of scores) for `val` and `bat`, since a read reorders the arrays.
"""

from __future__ import annotations

import mmap
from typing import Any

import numpy as np
import torch
from torch import Tensor

from .functional._ranking import Ranking, column_sums, ranking_from_sums

__all__ = ["BinarySides", "HostBuffer", "keeps_by_label", "labelled_chunks", "sorted_ranking", "split_by_label"]

_PAGE = mmap.PAGESIZE
# Devices whose batches an order-free binary store keeps by label: splitting a batch by label
# reads it on the host, which elsewhere (CUDA) would wait for the device at every update.
HOST_DEVICES = ("cpu",)


def keeps_by_label(device: torch.device) -> bool:
    """Whether an order-free binary store keeps data on `device` by label (else in order)."""
    return device.type in HOST_DEVICES


class HostBuffer:
    """A 1-D host array that grows in place: appended to without copying what it holds.

    Its memory is an anonymous map, grown by `mremap`; where that cannot run (a view of the
    array still alive, or a system without `mremap`) it grows by copying into a new map, which
    is correct and only costs the copy. Read it through `array()`, a view to drop before the
    next `append`.
    """

    def __init__(self, dtype: Any = np.float32) -> None:
        self.dtype = np.dtype(dtype)
        self.size = 0
        self._map: mmap.mmap | None = None

    @property
    def nbytes(self) -> int:
        """Bytes of the values held (not of the capacity reserved)."""
        return self.size * self.dtype.itemsize

    def append(self, values: np.ndarray) -> None:
        """Add `values` at the end (converted to this buffer's dtype)."""
        count = values.size
        if not count:
            return
        end = (self.size + count) * self.dtype.itemsize
        if self._map is None or end > len(self._map):
            self._grow(end)
        tail = np.frombuffer(self._map, self.dtype, count=count, offset=self.nbytes)
        tail[...] = values
        del tail  # a view left alive would stop the next `mremap`
        self.size += count

    def array(self) -> np.ndarray:
        """The values held, as a writable view of the buffer (drop it before the next `append`)."""
        if not self.size:
            return np.empty(0, dtype=self.dtype)
        return np.frombuffer(self._map, self.dtype, count=self.size)

    def widen(self, dtype: Any) -> None:
        """Hold the values in `dtype` from now on (float32 data meeting a float64 batch)."""
        held = self.array().astype(dtype)
        self.dtype, self.size, self._map = np.dtype(dtype), 0, None
        self.append(held)

    def _grow(self, needed: int) -> None:
        # An eighth more each time keeps appends amortised constant (a remap moves page tables, not
        # bytes) and the reserve small: pages never touched are not resident, but a private map is
        # charged at its whole length where the system does not overcommit.
        held = len(self._map) if self._map is not None else 0
        capacity = max(needed, held + held // 8, _PAGE)
        capacity = -(-capacity // _PAGE) * _PAGE
        if self._map is None:
            self._map = _anonymous(capacity)
            return
        try:
            self._map.resize(capacity)
        except (BufferError, OSError, SystemError, ValueError):
            # A view of the old map is alive (its holder keeps that map), or this system has no
            # mremap: copy into a new map.
            grown = _anonymous(capacity)
            grown[: self.nbytes] = self._map[: self.nbytes]
            self._map = grown

    def __getstate__(self) -> dict[str, Any]:
        return {"dtype": self.dtype.str, "values": self.array().tobytes()}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(np.dtype(state["dtype"]))  # type: ignore[misc]
        self.append(np.frombuffer(state["values"], dtype=self.dtype))


class BinarySides:
    """Formatted binary scores kept by label, in any order; see the module docstring.

    Args:
        ignore_index: Target value to leave out (a label, 0 or 1, still counts as a label).
    """

    def __init__(self, ignore_index: int | float | None = None) -> None:
        self.ignore_index = ignore_index
        self.positives = HostBuffer()
        self.negatives = HostBuffer()
        self.invalid: list[tuple[Tensor, Tensor]] = []  # rows whose target is no label and not ignored
        # The latest batch as its pieces (scores of positives, of negatives, invalid rows): a batch
        # of scores, no targets; `latest` joins them on demand.
        self.last: tuple[Tensor, Tensor, tuple[Tensor, Tensor] | None] | None = None

    def add(self, input: Tensor, target: Tensor) -> None:
        """Keep one formatted batch (host float scores, int64 targets): its scores by label."""
        if input.device.type != "cpu" or target.device.type != "cpu":
            raise ValueError(
                f"this binary metric store keeps host scores, but a batch came on {input.device} (targets on "
                f"{target.device}): keep every batch of a container on one device, or pass device='cpu'"
            )
        positives, negatives, invalid = split_by_label(input, target, self.ignore_index)
        dtype = np.result_type(self.positives.dtype, positives.numpy().dtype)
        if dtype != self.positives.dtype:
            self.positives.widen(dtype)
            self.negatives.widen(dtype)
        self.positives.append(positives.numpy())
        self.negatives.append(negatives.numpy())
        if invalid is not None:
            self.invalid.append(invalid)
        self.last = (positives, negatives, invalid)

    @property
    def nbytes(self) -> int:
        return self.positives.nbytes + self.negatives.nbytes

    def ranking(self) -> Ranking:
        """AUROC and average precision of everything kept: both sides sorted in place, then counted."""
        invalid = sum(scores.shape[0] for scores, _ in self.invalid)
        return sorted_ranking(self.positives.array(), self.negatives.array(), invalid)

    def sides(self) -> tuple[Tensor | None, Tensor | None, list[tuple[Tensor, Tensor]]]:
        """The scores of the positives and of the negatives (views; `None` where there are none)
        and the invalid rows. Read them before the next `add`."""
        positives, negatives = (self._view(self.positives), self._view(self.negatives))
        return positives, negatives, list(self.invalid)

    @staticmethod
    def _view(side: HostBuffer) -> Tensor | None:
        return torch.from_numpy(side.array()) if side.size else None

    def chunks(self) -> list[tuple[Tensor, Tensor]]:
        """Everything kept as `(scores, targets)` chunks: views of the sides (with int8 labels that
        take no memory) and the invalid rows. Read them before the next `add`."""
        return labelled_chunks(*self.sides())

    def latest(self) -> tuple[Tensor, Tensor] | None:
        """The latest batch as `(scores, int64 targets)`, its rows grouped by label; `None` before any."""
        if self.last is None:
            return None
        positives, negatives, invalid = self.last
        scores = [positives, negatives]
        targets = [torch.ones(positives.shape[0], dtype=torch.long), torch.zeros(negatives.shape[0], dtype=torch.long)]
        if invalid is not None:
            scores.append(invalid[0])
            targets.append(invalid[1])
        return torch.cat(scores), torch.cat(targets)


def sorted_ranking(positives: np.ndarray, negatives: np.ndarray, invalid: int) -> Ranking:
    """AUROC and average precision of one binary column from its sides' scores, which this sorts in
    place (so they must be the caller's own), and its count of invalid targets."""
    sums = column_sums(positives, negatives)
    return ranking_from_sums([sums], torch.tensor([invalid], dtype=torch.long))


def split_by_label(
    scores: Tensor, target: Tensor, ignore_index: int | float | None
) -> tuple[Tensor, Tensor, tuple[Tensor, Tensor] | None]:
    """Formatted binary scores split into those of positives, of negatives, and the rows whose
    target is neither a label nor `ignore_index` (`None` if none), on the data's own device.

    Boolean indexing reads the masks on the host: for reads, not for updates on an accelerator.
    Host tensors are split by numpy (about half the time of torch's indexing on a batch of 10,000).
    """
    host = scores.device.type == "cpu" and target.device.type == "cpu"
    values, labels = (scores.numpy(), target.long().numpy()) if host else (scores, target.long())
    positive, negative = labels == 1, labels == 0
    rest = ~(positive | negative)
    if ignore_index is not None:
        rest &= labels != ignore_index
    wrap = torch.from_numpy if host else (lambda piece: piece)
    invalid = (wrap(values[rest]), wrap(labels[rest])) if bool(rest.any()) else None
    return wrap(values[positive]), wrap(values[negative]), invalid


def labelled_chunks(
    positives: Tensor | None, negatives: Tensor | None, invalid: list[tuple[Tensor, Tensor]]
) -> list[tuple[Tensor, Tensor]]:
    """`(scores, targets)` chunks of sides: each side with its label, then the invalid rows."""
    chunks = []
    for scores, label in ((positives, 1), (negatives, 0)):
        if scores is not None and scores.shape[0]:
            chunks.append((scores, _labels(label, scores.shape[0], scores.device)))
    return chunks + list(invalid)


def _labels(label: int, count: int, device: torch.device) -> Tensor:
    # One byte, expanded: the chunk's targets hold no memory until something joins them.
    return torch.full((), label, dtype=torch.int8, device=device).expand(count)


def _anonymous(size: int) -> mmap.mmap:
    # Private: a shared anonymous map is a shmem object of fixed size, and pages that `mremap`
    # adds past it fault (SIGBUS) when touched. Windows has no flags (its anonymous maps are
    # private, and never resized in place: growth copies there).
    private = getattr(mmap, "MAP_PRIVATE", None)
    return mmap.mmap(-1, size) if private is None else mmap.mmap(-1, size, flags=private)
