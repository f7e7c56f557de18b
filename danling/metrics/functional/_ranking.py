"""Exact AUROC and average precision of large score columns in little memory (host tensors).

[`curves_from_scores`][danling.metrics.functional._common.curves_from_scores] sorts every column
of the whole `(N, K)` score matrix at once and keeps several `(K, N)` int64 count tensors: about
fifteen times the size of the scores at its peak, which decides whether an evaluation set fits
in memory at all. The functions here give the same integer counts, and so the same AUROC (the
same float) and the same average precision (summed in another order), column by column:

- a column is split by score value into buckets of about equal size, taken from the highest
  scores down; a bucket is sorted on its own, so the sort's buffers hold a bucket, not the
  column, and no copy of the whole column is made;
- a bucket is sorted through integer keys that order like the floats (a radix sort, several
  times faster than sorting the floats), ascending in descending-score order;
- the sorted bucket is read in blocks with running totals carried over, so the per-threshold
  counts never exist for more than a block.

Everything reads values on the host (bucket sizes, totals), so this path serves CPU tensors only;
other devices keep the synchronisation-free curves.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import math
from collections.abc import Callable, Sequence
from functools import lru_cache
from typing import NamedTuple

import torch
from torch import Tensor

__all__ = ["Ranking", "column_sums", "ranking", "ranking_from_sums"]

# Bytes a bucket costs per element while it is sorted: the integer keys, the sorted keys with
# their int64 order and the radix sort's buffers (measured: torch.sort of int32 keys peaks at five
# times its input; int64 keys, for logits, cost more and make buckets smaller in practice).
SORT_BYTES = 32
# Bytes per element of a block of a sorted bucket while it is read (about ten int64 and float64
# temporaries): blocks are sized to stay within the budget too, between 16Ki and 256Ki elements.
BLOCK_BYTES = 96
# Rows of a chunk checked for logits and put through the softmax at once.
ROWS = 1 << 14
# Score values sampled to place the bucket boundaries.
SAMPLES = 1 << 12
# Elements of a column masked at once while samples are put into buckets: temporaries stay this
# small whatever the column's length.
BLOCK_ROWS = 1 << 18
# Labels as the sums read them: positive, negative, or neither (ignored or invalid: sorted along
# but counted nowhere).
NEITHER, POSITIVE, NEGATIVE = 0, 1, 2


class Piece(NamedTuple):
    """A piece of one column: 1-D scores, the targets of their rows, and how targets read as
    int8 label codes (`POSITIVE`, `NEGATIVE`, `NEITHER`), applied to blocks of them as needed."""

    scores: Tensor
    target: Tensor
    encode: Callable[[Tensor], Tensor]


class Ranking(NamedTuple):
    """Per-column AUROC, average precision and count of positives (all `(K,)`, float64 / int64)."""

    auroc: Tensor
    auprc: Tensor
    positives: Tensor


def descending_keys(scores: Tensor) -> Tensor:
    """Integer keys of float `scores` whose ascending order is the scores' descending order.

    Equal scores (`-0.0` and `0.0` included) get equal keys, different ones different keys.
    """
    int_dtype = torch.int32 if scores.element_size() == 4 else torch.int64
    bits = (scores.to(torch.float64 if int_dtype is torch.int64 else torch.float32) + 0.0).view(int_dtype)
    # Negative floats order backwards as integers: flipping all but the sign bit fixes that.
    bits.bitwise_xor_((bits >> (bits.element_size() * 8 - 1)) & torch.iinfo(int_dtype).max)
    return bits.bitwise_not_()  # ascending keys of descending scores


def _boundaries(pieces: Sequence[Tensor], total: int, buckets: int) -> list[float]:
    """Score values that split the column into `buckets` parts of about equal size, decreasing."""
    step = max(1, total // SAMPLES)
    sample = torch.cat([piece.reshape(-1)[::step].to(torch.float64) for piece in pieces])
    sample = sample[~sample.isnan()].sort(descending=True).values
    if sample.numel() == 0:
        return []
    cuts = torch.linspace(0, sample.numel() - 1, buckets + 1)[1:-1].long()
    # Decreasing and distinct: a heavily tied score ends up in a single (larger) bucket.
    return sorted({float(sample[i]) for i in cuts.tolist()}, reverse=True)


def _sorted_bucket(bucket: list[Tensor]) -> tuple[Tensor, Tensor | None]:
    """Sort one bucket `[scores, negative]` of numeric scores with their negative flags (int8).

    Returns ascending keys of descending scores and the negative flags in that order. Where
    the key has room, the flag is its lowest bit (returned as `None`): the sort then carries the
    labels along, and no gather by the sort's order (random reads, the slowest step) is needed.
    The bucket's tensors are let go before the sort, whose buffers are the largest.
    """
    scores, negative = bucket
    bucket.clear()
    if scores.element_size() == 4:
        keys = descending_keys(scores)
        del scores
        low, high = (int(value) for value in torch.aminmax(keys))
        if high - low < 1 << 31:
            # A bucket's keys span less than 2^31 (unless it straddles zero over many binades):
            # shifted into [-2^30, 2^30) they leave the low bit of 32 for the flag, and the
            # 32-bit radix sort is the fastest. `key >> 1` is the shifted key again.
            keys.sub_(low).sub_(1 << 30)
            return torch.sort(keys.mul_(2).add_(negative)).values, None
        # Wider (a bucket straddling zero over many binades, such as a single bucket of logits):
        # 64-bit keys. numpy sorts them in place but took 1.4-2x torch's radix sort here.
        wide = keys.long().mul_(2).add_(negative)
        del keys
        return torch.sort(wide).values, None
    keys, order = torch.sort(descending_keys(scores))
    return keys, negative[order]


@lru_cache(maxsize=1)
def _malloc_trim() -> Callable[[int], int] | None:
    """glibc's `malloc_trim`, or `None` elsewhere."""
    try:
        return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").malloc_trim
    except (OSError, AttributeError):
        return None


def _release_freed() -> None:
    """Hand memory freed by a bucket back to the system before the next one.

    glibc raises its mmap threshold each time a large block is freed, so later buckets' buffers
    come from the heap, which is not returned: without a trim the resident memory grew by most
    of a bucket's sort per bucket (1e7 binary scores: 37 to 103 MiB over seven buckets).
    """
    trim = _malloc_trim()
    if trim is not None:
        trim(0)


def _bucket_ids(pieces: Sequence[Piece], cuts: list[float]) -> tuple[list[Tensor], list[int], bool]:
    """Which bucket each counted sample falls in, read block by block (no column-sized temporaries).

    Returns per piece the bucket of every sample (int8; -1 for samples counted nowhere and for
    nan scores), the size of every bucket, and whether every counted sample had a numeric score.
    """
    ids, finite = [], True
    sizes = torch.zeros(len(cuts) + 2, dtype=torch.long)
    for scores, target, encode in pieces:
        column = torch.empty(scores.shape[0], dtype=torch.int8)
        boundaries = torch.tensor(cuts[::-1], dtype=scores.dtype)  # exact: cuts are sampled scores
        for start in range(0, scores.shape[0], BLOCK_ROWS):
            block = scores[start : start + BLOCK_ROWS]
            counted = encode(target[start : start + BLOCK_ROWS]) != NEITHER
            numeric = counted & ~block.isnan()
            if finite and not torch.equal(numeric, counted):
                finite = False
            if cuts:  # descending order: scores above the first cut are bucket 0
                found = torch.bucketize(block.contiguous(), boundaries, out_int32=True).neg_().add_(len(cuts))
            else:
                found = torch.zeros(block.shape[0], dtype=torch.int32)
            found.masked_fill_(~numeric, -1)
            column[start : start + BLOCK_ROWS] = found
            sizes += torch.bincount(found.add_(1), minlength=len(cuts) + 2)
        ids.append(column)
    return ids, sizes[1:].tolist(), finite


def _gather_bucket(pieces: Sequence[Piece], ids: list[Tensor], index: int, size: int) -> list[Tensor]:
    """The scores of one bucket and their negative flags, copied block by block into their own tensors."""
    dtype = pieces[0][0].dtype
    for scores, _, _ in pieces[1:]:
        dtype = torch.promote_types(dtype, scores.dtype)
    scores_out, negative_out = torch.empty(size, dtype=dtype), torch.empty(size, dtype=torch.int8)
    row = 0
    for (scores, target, encode), column in zip(pieces, ids):
        for start in range(0, scores.shape[0], BLOCK_ROWS):
            chosen = column[start : start + BLOCK_ROWS] == index
            picked = scores[start : start + BLOCK_ROWS][chosen]
            if picked.numel():
                stop = row + picked.numel()
                scores_out[row:stop] = picked
                negative_out[row:stop] = encode(target[start : start + BLOCK_ROWS][chosen]) == NEGATIVE
                row = stop
    return [scores_out, negative_out]


def column_sums(pieces: Sequence[Piece], budget: int) -> tuple[int, float, int, int, bool]:
    """Rank sums of one column given in pieces of `(scores, targets, encode)` (1-D).

    `encode` turns a block of targets into int8 label codes (`POSITIVE`, `NEGATIVE`, `NEITHER`).
    Returns twice the area under the ROC curve in units of one positive-negative pair (an
    integer), the sum over positives of the precision at their threshold, the counts of
    positives and negatives, and whether every counted score was a number. Buckets are sized
    so that sorting one costs at most about `budget` bytes.
    """
    pieces = [Piece(scores.reshape(-1), target.reshape(-1), encode) for scores, target, encode in pieces]
    total = sum(scores.numel() for scores, _, _ in pieces)
    if total == 0:
        return 0, 0.0, 0, 0, True
    buckets = max(1, min(64, math.ceil(total * SORT_BYTES / max(budget, 1))))
    cuts = _boundaries([scores for scores, _, _ in pieces], total, buckets) if buckets > 1 else []
    ids, sizes, finite = _bucket_ids(pieces, cuts)
    twice_area, precision_sum = 0, 0.0
    block_size = min(max(budget // BLOCK_BYTES, 1 << 14), 1 << 18)
    counted = fps = last_tp = last_fp = 0  # samples and negatives so far, and the latest threshold's counts
    for index, size in enumerate(sizes):
        if size == 0:
            continue
        keys, negative = _sorted_bucket(_gather_bucket(pieces, ids, index, size))
        for start in range(0, keys.numel(), block_size):
            stop = min(start + block_size, keys.numel())
            # One element more than the block (where there is one): a threshold ends where the
            # next key differs, also across blocks. A bucket's last element always ends one, as
            # buckets hold disjoint score ranges.
            ahead = keys[start : stop + 1]
            flags = (ahead[: stop - start] & 1) if negative is None else negative[start:stop]
            groups = (ahead >> 1) if negative is None else ahead
            running_fp = flags.cumsum(0, dtype=torch.long).add_(fps)
            ends = torch.ones(stop - start, dtype=torch.bool)
            ends[: groups.numel() - 1] = groups[1:] != groups[:-1]
            where = ends.nonzero().squeeze(1)
            fp = running_fp[where]
            tp = where.add(counted + 1).sub_(fp)  # everything counted is a positive or a negative
            previous_tp = torch.cat([tp.new_tensor([last_tp]), tp[:-1]])
            previous_fp = torch.cat([fp.new_tensor([last_fp]), fp[:-1]])
            # Each negative scores every positive above it and half of the tied ones.
            twice_area += int(((fp - previous_fp) * (tp + previous_tp)).sum())
            new_positives = (tp - previous_tp).double()
            precision = tp.double() / (tp + fp).double()
            precision_sum += float((new_positives * precision.nan_to_num(nan=0.0)).sum())
            counted += stop - start
            fps = int(running_fp[-1])
            last_tp, last_fp = int(tp[-1]), int(fp[-1])
        del keys, negative
        _release_freed()
    return twice_area, precision_sum, counted - fps, fps, finite


def ranking_from_sums(sums: Sequence[tuple[int, float, int, int, bool]], invalid: Tensor) -> Ranking:
    """AUROC and average precision per column from `column_sums`; `nan` where undefined.

    `invalid` counts, per column (or once for all), targets that were neither a label nor
    ignored: any of them makes the column `nan`, as it does for the curves.
    """
    auroc, auprc, positives = [], [], []
    for twice_area, precision_sum, tps, fps, finite in sums:
        pairs = 2 * tps * fps
        ok = finite
        # The curves divide the same integers as float64: the same float, bit for bit.
        auroc.append(float(twice_area) / float(pairs) if ok and pairs else math.nan)
        auprc.append(precision_sum / float(tps) if ok and tps else math.nan)
        positives.append(tps)
    bad = invalid.reshape(-1) != 0
    auroc_t = torch.tensor(auroc, dtype=torch.float64).masked_fill(bad, math.nan)
    auprc_t = torch.tensor(auprc, dtype=torch.float64).masked_fill(bad, math.nan)
    return Ranking(auroc_t, auprc_t, torch.tensor(positives, dtype=torch.long))


def _label_codes(target: Tensor) -> Tensor:
    """Codes of binary or multilabel 0/1 targets: 1 positive, 0 negative, anything else neither."""
    # Built in int8 throughout: a where() of Python numbers would make an int64 tensor first.
    code = (target == 0).to(torch.int8).mul_(NEGATIVE)
    return code.add_((target == 1).to(torch.int8))


def _invalid(
    chunks: Sequence[tuple[Tensor, Tensor]], classes: int | None, ignore_index: int | float | None, per_column: bool
) -> Tensor:
    """Targets that are neither a label (0/1, or a class below `classes`) nor ignored, counted in
    blocks of rows (whole-column masks would outweigh the kept targets): in all, or per column."""
    total = torch.zeros(())
    for _, target in chunks:
        for block in target.split(BLOCK_ROWS):
            valid = (block == 0) | (block == 1) if classes is None else (block >= 0) & (block < classes)
            invalid = ~valid if ignore_index is None else ~valid & (block != ignore_index)
            total = total + (invalid.sum(0) if per_column else invalid.sum())
    return total.long()


def _class_codes(k: int, num_classes: int) -> Callable[[Tensor], Tensor]:
    """Label codes of class `k` against the rest, from class targets (out of range: neither)."""

    def encode(target: Tensor) -> Tensor:
        code = (target != k).to(torch.int8).add_(POSITIVE)  # NEGATIVE = POSITIVE + 1
        return code.mul_((target >= 0) & (target < num_classes))

    return encode


def _as_codes(codes: Tensor) -> Tensor:
    return codes


def _budget(chunks: Sequence[tuple[Tensor, Tensor]], rows: int, extra: int = 0) -> int:
    """Bytes one bucket's sort may take so that the peak, kept data included, stays near 3x the scores.

    Kept are the scores and their targets; a column's bucket ids (one byte a row) and `extra`
    (what the caller holds besides, such as a softmax) come on top, with a sixteenth of the
    scores left for the allocator. Fewer, larger buckets are faster: each is a pass over the column.
    """
    scores = sum(s.numel() * s.element_size() for s, _ in chunks)
    targets = sum(t.numel() * t.element_size() for _, t in chunks)
    return max(3 * scores - scores - targets - rows - extra - scores // 16, 1 << 18)


def ranking(
    kind: str,
    chunks: Sequence[tuple[Tensor, Tensor]],
    num_columns: int,
    ignore_index: int | float | None = None,
    *,
    micro: bool = False,
) -> Ranking:
    """Per-column (pooled with `micro`) AUROC and average precision of formatted CPU data.

    `chunks` hold the data as pieces of rows: binary `(n,)` scores and labels, multiclass
    `(n, C)` scores (logits anywhere make every row a softmax, as for the curves) with `(n,)`
    class indices, multilabel `(n, L)` scores and labels. Targets may use any integer dtype.
    """
    chunks = [(scores, target) for scores, target in chunks if scores.shape[0]]
    rows = sum(scores.shape[0] for scores, _ in chunks)
    if kind == "binary":
        invalid = _invalid(chunks, None, ignore_index, per_column=False)
        pieces = [Piece(scores, target, _label_codes) for scores, target in chunks]
        return ranking_from_sums([column_sums(pieces, _budget(chunks, rows))], invalid)
    if kind == "multilabel":
        invalid = _invalid(chunks, None, ignore_index, per_column=True).expand(num_columns)
        if micro:
            pieces = [Piece(scores, target, _label_codes) for scores, target in chunks]
            return ranking_from_sums([column_sums(pieces, _budget(chunks, rows * num_columns))], invalid.sum())
        # A column is copied out whole (strided reads of every block were twice as slow): it counts too.
        budget = _budget(chunks, rows, extra=rows * 5)
        sums = [
            column_sums(
                [
                    Piece(scores[:, j].contiguous(), target[:, j].contiguous(), _label_codes)
                    for scores, target in chunks
                ],
                budget,
            )
            for j in range(num_columns)
        ]
        return ranking_from_sums(sums, invalid)
    if kind != "multiclass":
        raise ValueError(f"{kind} tasks have no ranking metrics")
    invalid = _invalid(chunks, num_columns, ignore_index, per_column=False)
    logits = any(bool(((part < 0) | (part > 1)).any()) for scores, _ in chunks for part in scores.split(ROWS))
    if micro:
        if logits:  # the softmax of every row, chunk by chunk (a row's is what a whole-matrix softmax gives it)
            chunks = [(scores.softmax(-1), target) for scores, target in chunks]
        classes = torch.arange(num_columns)
        pieces = []
        for scores, target in chunks:
            kept = (target >= 0) & (target < num_columns)
            code = (target.unsqueeze(-1) != classes).to(torch.int8).add_(POSITIVE)
            pieces.append(Piece(scores, code.mul_(kept.unsqueeze(-1)), _as_codes))
        return ranking_from_sums([column_sums(pieces, _budget(chunks, rows * num_columns))], invalid)
    if not logits:
        budget = _budget(chunks, rows, extra=rows * 4)  # a column copied out whole, as for multilabel
        sums = [
            column_sums(
                [Piece(scores[:, k].contiguous(), target, _class_codes(k, num_columns)) for scores, target in chunks],
                budget,
            )
            for k in range(num_columns)
        ]
        return ranking_from_sums(sums, invalid)
    # One softmax per chunk, its columns copied out: each class then sorts a contiguous column,
    # freed once read, instead of every chunk's strided one.
    dtype = chunks[0][0].dtype
    for scores, _ in chunks[1:]:
        dtype = torch.promote_types(dtype, scores.dtype)
    columns: list[Tensor | None] = [torch.empty(rows, dtype=dtype) for _ in range(num_columns)]
    budget = _budget(chunks, rows, extra=rows * num_columns * dtype.itemsize)
    row = 0
    for scores, _ in chunks:
        for part in scores.split(ROWS):  # equal pieces: the allocator reuses one block for all
            probabilities = part.softmax(-1).T
            for k, column in enumerate(columns):
                column[row : row + part.shape[0]] = probabilities[k]
            row += part.shape[0]
            del probabilities
    labels = torch.cat([target for _, target in chunks]) if len(chunks) > 1 else chunks[0][1]
    sums = []
    for k in range(num_columns):
        sums.append(column_sums([Piece(columns[k], labels, _class_codes(k, num_columns))], budget))
        columns[k] = None
    return ranking_from_sums(sums, invalid)
