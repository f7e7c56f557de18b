"""The default batch contract of the runners."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

__all__ = ["split_batch"]


def split_batch(data: Any) -> tuple[Any, Any]:
    """Split one batch into ``(input, target)`` following the runners' default contract.

    - a mapping gives ``(data["input"], data.get("target"))``;
    - a list or tuple (any sequence except strings and bytes) gives ``(data[0], data[1])``,
      or ``(data[0], None)`` when it has a single element;
    - anything else (a tensor, a custom object) is the input and there is no target.

    Inference uses only the first element. Tasks whose batches look different override the
    runner's ``train_step``/``evaluate_step``/``infer_step`` instead of bending this function.

    Raises:
        ValueError: a mapping without an ``"input"`` key, or an empty sequence.

    Examples:
        >>> split_batch({"input": 1, "target": 2, "mask": 3})
        (1, 2)
        >>> split_batch({"input": 1})
        (1, None)
        >>> split_batch((1, 2, 3))
        (1, 2)
        >>> import torch
        >>> split_batch(torch.ones(2))[1] is None
        True
        >>> split_batch({"x": 1})
        Traceback (most recent call last):
        ValueError: a mapping batch needs an 'input' key (optionally 'target'); got keys ['x']
    """
    if type(data) in (tuple, list) and len(data) > 1:  # the usual batch, without the ABC checks below
        return data[0], data[1]
    if isinstance(data, Mapping):
        if "input" not in data:
            raise ValueError(f"a mapping batch needs an 'input' key (optionally 'target'); got keys {list(data)}")
        return data["input"], data.get("target")
    if isinstance(data, Sequence) and not isinstance(data, (str, bytes)):
        if len(data) == 0:
            raise ValueError("an empty sequence is not a batch; expected (input,) or (input, target, ...)")
        return data[0], data[1] if len(data) > 1 else None
    return data, None
