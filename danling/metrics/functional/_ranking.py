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

import math
from collections.abc import Sequence
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
# Labels as the sums read them: positive, negative, or neither (ignored or invalid: sorted along
# but counted nowhere).
NEITHER, POSITIVE, NEGATIVE = 0, 1, 2


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
    """Sort one bucket `[scores, codes]` of numeric scores with labels (positive or negative only).

    Returns ascending keys of descending scores and the negative flags in that order. Where
    the key has room, the flag is its lowest bit (returned as `None`): the sort then carries the
    labels along, and no gather by the sort's order (random reads, the slowest step) is needed.
    The bucket's tensors are let go before the sort, whose buffers are the largest.
    """
    scores, codes = bucket
    bucket.clear()
    negative = codes == NEGATIVE
    del codes
    low, high = torch.aminmax(scores)
    if float(low) >= 0 and float(high) <= 1:
        # Probabilities: their bits order like them and stop at those of 1.0, which leaves a bit
        # for the flag (int32 for float32: 2 * 0x3F800000 < 2 ** 31).
        int_dtype = torch.int32 if scores.dtype is torch.float32 else torch.int64
        one = torch.tensor(1.0, dtype=scores.dtype).view(int_dtype)
        keys = torch.sub(one, (scores + 0.0).view(int_dtype)).mul_(2)  # + 0.0: -0.0 and 0.0 are one score
        del scores
        return torch.sort(keys.add_(negative)).values, None
    if scores.element_size() == 4:  # other float32 scores: 32-bit keys, the flag in an int64 one
        keys = descending_keys(scores).long()
        del scores
        return torch.sort(keys.mul_(2).add_(negative)).values, None
    keys, order = torch.sort(descending_keys(scores))
    return keys, negative[order]


def column_sums(pieces: Sequence[tuple[Tensor, Tensor]], budget: int) -> tuple[int, float, int, int, bool]:
    """Rank sums of one column given in pieces of `(scores, labels)` (1-D, labels as int8 codes).

    Returns twice the area under the ROC curve in units of one positive-negative pair (an
    integer), the sum over positives of the precision at their threshold, the counts of
    positives and negatives, and whether every score was a number. Buckets are sized so that
    sorting one costs at most about `budget` bytes.
    """
    total = sum(scores.numel() for scores, _ in pieces)
    if total == 0:
        return 0, 0.0, 0, 0, True
    buckets = max(1, min(64, math.ceil(total * SORT_BYTES / max(budget, 1))))
    cuts = _boundaries([scores for scores, _ in pieces], total, buckets) if buckets > 1 else []
    limits = [math.inf, *cuts, -math.inf]
    twice_area, precision_sum = 0, 0.0
    block_size = min(max(budget // BLOCK_BYTES, 1 << 14), 1 << 18)
    counted = fps = last_tp = last_fp = 0  # samples and negatives so far, and the latest threshold's counts
    # Samples that are neither positive nor negative (ignored, invalid) count nowhere: leaving
    # them out gives the same sums. A nan score falls in no bucket, so fewer samples than these
    # get counted when one of them has a nan score.
    pieces = [(scores.reshape(-1), codes.reshape(-1)) for scores, codes in pieces]
    kept = [codes != NEITHER for _, codes in pieces]
    expected = sum(int(mask.sum()) for mask in kept)
    for high, low in zip(limits[:-1], limits[1:]):
        chosen = []
        for (scores, codes), valid in zip(pieces, kept):
            if high == math.inf and low == -math.inf:
                mask = valid & ~scores.isnan()
            elif high == math.inf:
                mask = valid & (scores > low)
            else:
                mask = valid & (scores <= high)
                if low != -math.inf:
                    mask &= scores > low
            chosen.append((scores[mask], codes[mask]))
        if len(chosen) > 1:
            bucket = [torch.cat([s for s, _ in chosen]), torch.cat([c for _, c in chosen])]
        else:
            bucket = list(chosen[0])
        del chosen
        if bucket[0].numel() == 0:
            continue
        keys, negative = _sorted_bucket(bucket)
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
    return twice_area, precision_sum, counted - fps, fps, counted == expected


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


def _invalid(target: Tensor, valid: Tensor, ignore_index: int | float | None, dim: int | None) -> Tensor:
    invalid = ~valid if ignore_index is None else ~valid & (target != ignore_index)
    return invalid.sum() if dim is None else invalid.sum(dim)


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
    stored = sum(scores.numel() * scores.element_size() for scores, _ in chunks)
    # Sorting a bucket may take up to 1.5 times the memory of the scores (256 KiB at least), 0.75
    # times where the softmax of logits is held as well: the peak, kept scores included, stays
    # within 3x the scores. Fewer, larger buckets are faster: each one is a pass over the column.
    budget = max(stored * 3 // 2, 1 << 18)
    if kind == "binary":
        invalid = sum((_invalid(t, (t == 0) | (t == 1), ignore_index, None) for _, t in chunks), torch.tensor(0))
        pieces = [(scores, _label_codes(target)) for scores, target in chunks]
        return ranking_from_sums([column_sums(pieces, budget)], invalid)
    if kind == "multilabel":
        codes = [_label_codes(target) for _, target in chunks]
        invalid = sum(
            (_invalid(t, (t == 0) | (t == 1), ignore_index, 0) for _, t in chunks),
            torch.zeros(num_columns, dtype=torch.long),
        )
        if micro:
            pieces = [(scores.reshape(-1), code.reshape(-1)) for (scores, _), code in zip(chunks, codes)]
            return ranking_from_sums([column_sums(pieces, budget)], invalid.sum())
        sums = [
            column_sums([(scores[:, j], code[:, j]) for (scores, _), code in zip(chunks, codes)], budget)
            for j in range(num_columns)
        ]
        return ranking_from_sums(sums, invalid)
    if kind != "multiclass":
        raise ValueError(f"{kind} tasks have no ranking metrics")
    counted = [(t >= 0) & (t < num_columns) for _, t in chunks]
    invalid = sum((_invalid(t, c, ignore_index, None) for (_, t), c in zip(chunks, counted)), torch.tensor(0))
    logits = any(bool(((part < 0) | (part > 1)).any()) for scores, _ in chunks for part in scores.split(ROWS))
    if micro:
        if logits:  # the softmax of every row, chunk by chunk (a row's is what a whole-matrix softmax gives it)
            chunks = [(scores.softmax(-1), target) for scores, target in chunks]
        classes = torch.arange(num_columns)
        pieces = []
        for (scores, target), kept in zip(chunks, counted):
            code = (target.unsqueeze(-1) != classes).to(torch.int8).add_(POSITIVE)
            pieces.append((scores.reshape(-1), code.mul_(kept.unsqueeze(-1)).reshape(-1)))
        return ranking_from_sums([column_sums(pieces, budget)], invalid)
    if logits:
        budget = max(stored * 3 // 4, 1 << 18)
        # One softmax per chunk, its columns copied out: each class then sorts a contiguous
        # column, freed once read, instead of every chunk's strided one.
        rows = sum(scores.shape[0] for scores, _ in chunks)
        dtype = chunks[0][0].dtype
        for scores, _ in chunks[1:]:
            dtype = torch.promote_types(dtype, scores.dtype)
        columns: list[Tensor | None] = [torch.empty(rows, dtype=dtype) for _ in range(num_columns)]
        row = 0
        for scores, _ in chunks:
            for part in scores.split(ROWS):  # equal pieces: the allocator reuses one block for all
                probabilities = part.softmax(-1).T
                for k, column in enumerate(columns):
                    column[row : row + part.shape[0]] = probabilities[k]
                row += part.shape[0]
                del probabilities
        labels = torch.cat([target for _, target in chunks]) if len(chunks) > 1 else chunks[0][1]
        kept = torch.cat(counted) if len(counted) > 1 else counted[0]
        sums = []
        for k in range(num_columns):
            code = (labels != k).to(torch.int8).add_(POSITIVE).mul_(kept)  # NEGATIVE = POSITIVE + 1
            sums.append(column_sums([(columns[k], code)], budget))
            columns[k] = None
        return ranking_from_sums(sums, invalid)
    sums = []
    for k in range(num_columns):
        pieces = []
        for (scores, target), kept in zip(chunks, counted):
            code = (target != k).to(torch.int8).add_(POSITIVE).mul_(kept)  # NEGATIVE = POSITIVE + 1
            pieces.append((scores[:, k], code))
        sums.append(column_sums(pieces, budget))
    return ranking_from_sums(sums, invalid)
