"""The values of a step log: the mean over the steps since the previous log, not since the pass began.

A pass's [`AverageMeters`][danling.metrics.AverageMeters] keep the running sum and count of every
step loss on the device. [`StepWindow`][danling.runners.services.step_window.StepWindow] remembers
the sum and count it saw at the previous read, so each read returns the mean of what was added in
between: a curve of those values shows the loss of those steps, not a running mean that smooths
(and saw-tooths at every pass boundary) the curve. Nothing happens per step; a read is one host
synchronisation (one collective in a multi-process run), like reading the running mean.
"""

from __future__ import annotations

from typing import Any

import torch

from danling.metrics import AverageMeter, AverageMeters
from danling.metrics.meter_sync import sync_meters
from danling.utils import RoundDict

__all__ = ["StepWindow"]


class StepWindow:
    """Means of the meter values added since the previous read.

    Start one window per pass (the pass resets its meters). A meter with nothing added since the
    previous read reads as NaN.

    Examples:
        >>> import torch
        >>> meters, window = AverageMeters(), StepWindow()
        >>> for loss in (1.0, 3.0):
        ...     meters.update(loss=torch.tensor(loss))
        >>> window.read(meters)["loss"], meters.avg["loss"]
        (2.0, 2.0)
        >>> for loss in (5.0, 7.0):
        ...     meters.update(loss=torch.tensor(loss))
        >>> window.read(meters)["loss"], meters.avg["loss"]  # the last two steps vs. the whole pass
        (6.0, 4.0)
    """

    def __init__(self) -> None:
        self._marks: dict[str, tuple[Any, Any]] = {}

    def mark_read(self, meters: AverageMeters) -> None:
        """Count what `meters` hold now as read: the next read averages only the values added after this.

        A pass that continues the meters of an interrupted pass (a mid-pass resume) calls it, so its
        first step log covers the steps since the resume, not the restored ones.
        """
        self._marks = {name: (meter._running_sum(), meter._count) for name, meter in meters.items()}

    def read(self, meters: AverageMeters) -> RoundDict:
        """Mean of each meter over the values added since the previous read (a collective when distributed)."""
        names, views, marks = [], [], []
        for name, meter in meters.items():
            total, count = meter._running_sum(), meter._count  # the sum stays on the device
            mark_total, mark_count = self._marks.get(name, (0.0, 0))
            views.append(_window_view(meter, total - mark_total, count - mark_count))
            names.append(name)
            marks.append((total, count))
        synced = sync_meters(views, meters.device, names=names, group=meters.group)
        for name, mark, values in zip(names, marks, synced):
            # A NaN or inf step makes its window NaN (on every rank, once synced); its meter's running
            # sum is then set apart, so that the later windows, differences of that sum, are finite
            # again. The window's value is on the host already: a finite one costs no more reads.
            if not bool(torch.isfinite(torch.as_tensor(values.avg)).all()) and meters[name].isolate_nonfinite():
                mark = (meters[name]._running_sum(), mark[1])
            self._marks[name] = mark
        return RoundDict.from_flat({name: values.avg for name, values in zip(names, synced)})


def _window_view(meter: AverageMeter, total: Any, count: Any) -> AverageMeter:
    """A meter holding only the window's sum and count, with the source's latest value (its shape and dtype)."""
    view = AverageMeter(group=meter.group)
    view._total, view._count = total, count
    view._val, view._n, view._updated = meter._val, meter._n, meter._updated
    return view
