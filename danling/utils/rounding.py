"""A result mapping whose numbers can be rounded and formatted in one call.

Meters, metric containers and runners hand back their numbers as a
[`RoundDict`][danling.utils.RoundDict]: a chanfig `NestedDict`, so nested results support both
`result["val"]["acc"]` and `result.val.acc`, plus `round(result, 4)` for a tidy copy and
`f"{result:.4f}"` for a one-line log message.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any

import chanfig.flat_dict
import numpy as np
import torch
from chanfig import FlatDict, NestedDict

try:  # Python 3.11+
    from typing import Self
except ImportError:  # pragma: no cover - Python 3.10
    from typing_extensions import Self

__all__ = ["RoundDict"]


class RoundDict(NestedDict):
    """Nested mapping of results with rounding and number formatting.

    Rounding never mutates the original: `round(d, n)` and `d.round(n)` build a new `RoundDict`
    in which every number has been rounded and keeps its type:

    - Python and NumPy floats go through `round`; `nan` and `inf` stay as they are.
    - Floating-point tensors go through `torch.round(..., decimals=n)` on their own device, so no
      host synchronisation happens; integer and boolean tensors are returned unchanged.
    - NumPy arrays go through `numpy.round`.
    - Mappings, lists and tuples (named tuples included) are rounded element by element.
    - `int`, `bool`, strings, `None` and any other object are left alone.

    Formatting with a non-empty spec (`format(d, ".4f")` or `f"{d:.4f}"`) applies the spec to
    every number and renders `key: value` pairs separated by tabs; nested mappings contribute
    dotted keys (`val.acc`). Values the spec cannot apply to (strings, `None`) are shown with
    `str`. An empty spec gives the usual `str(d)`.

    Examples:
        >>> import torch
        >>> d = RoundDict(loss=0.123456, acc=torch.tensor(0.98765), val={"f1": 0.333333})
        >>> r = round(d, 2)
        >>> r.dict()
        {'loss': 0.12, 'acc': tensor(0.9900), 'val': {'f1': 0.33}}
        >>> type(r).__name__, d["loss"]
        ('RoundDict', 0.123456)
        >>> d.round(3)["val"]["f1"]
        0.333
        >>> f"{d:.4f}"
        'loss: 0.1235\\tacc: 0.9877\\tval.f1: 0.3333'
        >>> RoundDict(count=3, name="run").dict() == round(RoundDict(count=3, name="run"), 1).dict()
        True
    """

    @classmethod
    def from_flat(cls, values: Mapping[str, Any]) -> RoundDict:
        """`RoundDict(values)` for the results meters, metrics and runner loops produce, built
        without chanfig's generic constructor (key splitting, mapping conversion, validation),
        which costs several microseconds per call on paths that run at every log step or epoch.

        The shortcut applies to plain string keys without `.` that are not attribute names of the
        class, holding numbers, tensors, `None`, or mappings of the same (a result row: split ->
        metrics), which become nested `RoundDict`s as the constructor would make them; anything
        else goes through `RoundDict(values)`. The mappings are copied, never shared.

        Examples:
            >>> RoundDict.from_flat({"loss": 0.25, "acc": 1}).dict()
            {'loss': 0.25, 'acc': 1}
            >>> row = RoundDict.from_flat({"val": {"acc": 0.5}, "epoch": 3})
            >>> type(row["val"]).__name__, row.val.acc, row.dict()
            ('RoundDict', 0.5, {'val': {'acc': 0.5}, 'epoch': 3})
            >>> RoundDict.from_flat({"val.acc": 0.5}).dict()  # nested key: the constructor's path
            {'val': {'acc': 0.5}}
        """
        if cls is not RoundDict or not _SHORTCUT or not values:
            return cls(values)
        for key, value in values.items():  # a loop, not `all(...)` of a generator: half the checks' cost
            if not _row_item(key, value):
                return cls(values)
        return _build(values)

    def round(self, ndigits: int | None = None) -> Self:
        """Return a copy with every number rounded to `ndigits` decimal places.

        Args:
            ndigits: Number of decimal places; `None` rounds to whole numbers (floats stay floats).

        Returns:
            A new mapping of the same class; the original is not modified.

        Raises:
            TypeError: If `ndigits` is neither an `int` nor `None`.
        """
        if ndigits is not None and (isinstance(ndigits, bool) or not isinstance(ndigits, int)):
            raise TypeError(f"ndigits must be an int or None, got {ndigits!r}")
        rounded = self.empty_like()
        for key, value in self.items():
            # dict.__setitem__ keeps keys verbatim (no re-splitting of dotted keys).
            dict.__setitem__(rounded, key, _round_value(value, ndigits))
        return rounded

    def __round__(self, ndigits: int | None = None) -> Self:
        return self.round(ndigits)

    def __format__(self, format_spec: str) -> str:
        if not format_spec:
            return str(self)
        return "\t".join(f"{key}: {_format_value(value, format_spec)}" for key, value in _flatten(self))


def _round_value(value: Any, ndigits: int | None) -> Any:
    """Round one value of a result mapping, recursing into containers and keeping types."""
    if isinstance(value, (bool, int, str, bytes)) or value is None:
        return value
    if isinstance(value, torch.Tensor):
        if value.is_floating_point():
            return torch.round(value, decimals=ndigits or 0)
        return value
    if isinstance(value, np.ndarray):
        return np.round(value, ndigits or 0) if np.issubdtype(value.dtype, np.floating) else value
    if isinstance(value, float):
        if not math.isfinite(value):
            return value
        return type(value)(round(value, ndigits or 0))
    if isinstance(value, RoundDict):
        return value.round(ndigits)
    if isinstance(value, Mapping):
        items = {key: _round_value(item, ndigits) for key, item in value.items()}
        return _rebuild_mapping(value, items)
    if isinstance(value, tuple):
        items = [_round_value(item, ndigits) for item in value]
        return type(value)(*items) if hasattr(value, "_fields") else type(value)(items)
    if isinstance(value, list):
        return type(value)(_round_value(item, ndigits) for item in value)
    if isinstance(value, np.floating):
        return value if not np.isfinite(value) else type(value)(round(value, ndigits or 0))
    return value


def _rebuild_mapping(original: Mapping, items: dict) -> Mapping:
    """Rebuild `original`'s class from `items`, falling back to a plain dict."""
    try:
        return type(original)(items)
    except Exception:  # classes with custom constructors cannot always be rebuilt
        return items


def _flatten(mapping: Mapping, prefix: str = "") -> Iterator[tuple[str, Any]]:
    """Yield `(dotted_key, value)` pairs for every non-mapping leaf."""
    for key, value in mapping.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping):
            yield from _flatten(value, f"{name}.")
        else:
            yield name, value


def _format_value(value: Any, format_spec: str) -> str:
    """Format a leaf value; tensors and arrays are formatted element by element."""
    if isinstance(value, (torch.Tensor, np.ndarray)):
        # Reading values for display is the one place a host transfer is expected.
        return _format_value(value.tolist(), format_spec)
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_format_value(item, format_spec) for item in value) + "]"
    if isinstance(value, bool) or not isinstance(value, (int, float, np.number)):
        return str(value)
    return format(value, format_spec)


_PROBE = RoundDict(_probe=0)
# Instance attributes chanfig gives a RoundDict built from a flat mapping (minus the mirrored key);
# all immutable, so every shortcut-built instance can share them.
_INSTANCE_ATTRS = {key: value for key, value in vars(_PROBE).items() if key != "_probe"}
# chanfig's names that `FlatDict.set` never mirrors as attributes (None if a version lacks them).
_CHANFIG_INTERNAL = getattr(chanfig.flat_dict, "_INTERNAL_ATTRS", None)
# The shortcut skips construction hooks, class-default copying and validation, so it is only
# taken while those do nothing for RoundDict (no overridden hooks, no annotated fields); a chanfig
# upgrade that changes this turns it off instead of building different objects.
_SHORTCUT = (
    _CHANFIG_INTERNAL is not None
    and dict(_PROBE) == {"_probe": 0}
    and RoundDict.__post_init__ is FlatDict.__post_init__
    and RoundDict.validate in (FlatDict.validate, NestedDict.validate)
    and not any(vars(klass).get("__annotations__") for klass in RoundDict.__mro__)
)
_PLAIN_VALUES = (float, int, bool, type(None))
# Names chanfig never mirrors as attributes, or that a RoundDict already has (methods,
# properties): such keys take the constructor's path.
_RESERVED = frozenset(_CHANFIG_INTERNAL or ()) | frozenset(dir(RoundDict))


def _plain_key(key: Any) -> bool:
    return type(key) is str and "." not in key and key not in _RESERVED


def _plain_item(key: Any, value: Any) -> bool:
    return _plain_key(key) and (type(value) in _PLAIN_VALUES or isinstance(value, torch.Tensor))


def _row_item(key: Any, value: Any) -> bool:
    """A plain item, or a plain key holding a non-empty mapping of plain items (one level deep)."""
    if type(value) in _PLAIN_VALUES:  # the usual value, checked before the (slower) ABC test
        # `_plain_key`, inlined: this runs for every key of every result read.
        return type(key) is str and "." not in key and key not in _RESERVED
    if isinstance(value, Mapping):
        return bool(value) and _plain_key(key) and all(_plain_item(k, v) for k, v in value.items())
    return _plain_item(key, value)


def row_builder(keys: Iterable[Any]) -> Callable[[Mapping[str, Any]], RoundDict]:
    """What makes `RoundDict.from_flat(values)` of results that always have these `keys`, each holding a
    number, a tensor or `None`: the shortcut's builder with the keys checked once, here, or
    `from_flat` itself where they do not pass (or the shortcut is off).

    For a reader whose keys are fixed (a metric container's names): on a read once an epoch,
    with this code out of the caches, the per-key checks cost about 5 us of a 90 us read.
    """
    if _SHORTCUT and all(_plain_key(key) for key in keys):
        return _build
    return RoundDict.from_flat


def _build(values: Mapping[str, Any]) -> RoundDict:
    """What `FlatDict.set` does for items that passed `_row_item`: store each item and mirror it as an
    attribute (its annotation and reserved-name checks cannot apply); mappings become `RoundDict`s."""
    result = RoundDict.__new__(RoundDict)
    attributes = result.__dict__
    attributes.update(_INSTANCE_ATTRS)
    for key, value in values.items():
        if type(value) not in _PLAIN_VALUES and isinstance(value, Mapping):
            value = _build(value)
        dict.__setitem__(result, key, value)
        attributes[key] = value
    return result
