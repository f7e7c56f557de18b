"""One converter for every value a config key receives, whatever its source.

A value from a YAML/JSON/TOML file, the command line (a string), an `!include`d file or a Python
assignment goes through [`convert`][danling.runners._config_values.convert] against the key's
annotation, so the same value gives the same result (or the same error) from each of them:

- booleans take real booleans, 0/1, and the words `true/false`, `yes/no`, `on/off`, `1/0` (any case);
- integers take whole numbers only (`3`, `3.0`, `"3"`, `"1e3"`); `2.7` is an error, never 2;
- floats take numbers and their spellings (`"1e-3"`, which YAML 1.1 reads as a string);
- a nullable key reads `none`/`null` (any case) as None;
- a list key reads one value as a one-element list.

A value that fits none of these raises [`ConfigValueError`][danling.runners._config_values.ConfigValueError],
naming the key, the value, where it came from (when known) and what the key accepts.
"""

from __future__ import annotations

import ast
import math
from collections.abc import Mapping
from types import UnionType
from typing import Any, Union, get_args, get_origin

__all__ = ["ConfigValueError", "convert", "BOOLEAN_WORDS"]

_NoneType = type(None)
_TRUE = ("true", "yes", "on", "1")
_FALSE = ("false", "no", "off", "0")
BOOLEAN_WORDS = "true/false, yes/no, on/off or 1/0"
_NULL = ("none", "null")
_UNCONVERTED = object()


class ConfigValueError(ValueError):
    """A value a key cannot take: names the key, the value, its source and what is accepted.

    `source` is filled in by whoever knows it (`file.yaml:3`, `the command line`), after the error
    is raised by the key's section.
    """

    def __init__(self, key: str, value: Any, accepted: str, source: str | None = None) -> None:
        super().__init__(key, value, accepted, source)
        self.key, self.value, self.accepted, self.source = key, value, accepted, source

    def __str__(self) -> str:
        where = f" (from {self.source})" if self.source else ""
        return f"config.{self.key}={self.value!r}{where} is not accepted: expected {self.accepted}"


class _Rejected(Exception):
    def __init__(self, accepted: str) -> None:
        super().__init__(accepted)
        self.accepted = accepted


def _members(annotation: Any) -> tuple:
    return get_args(annotation) if get_origin(annotation) in (Union, UnionType) else (annotation,)


def _to_bool(value: Any) -> bool:
    if isinstance(value, bool):
        return value
    if isinstance(value, int) and value in (0, 1):
        return bool(value)
    if isinstance(value, str):
        word = value.strip().lower()
        if word in _TRUE or word in _FALSE:
            return word in _TRUE
    raise _Rejected(f"a boolean: {BOOLEAN_WORDS}")


def _to_int(value: Any) -> int:
    if isinstance(value, bool):
        raise _Rejected("an integer, not a boolean")
    if isinstance(value, int):
        return value
    number = value
    if isinstance(value, str):
        text = value.strip()
        try:
            return int(text)
        except ValueError:
            try:
                number = float(text)
            except ValueError:
                raise _Rejected("an integer") from None
    if isinstance(number, float):
        if math.isfinite(number) and number.is_integer():
            return int(number)
        raise _Rejected("an integer (a whole number; it is never rounded)")
    raise _Rejected("an integer")


def _to_float(value: Any) -> float:
    if isinstance(value, bool):
        raise _Rejected("a number, not a boolean")
    try:
        if isinstance(value, (int, float)):
            return float(value)
        if isinstance(value, str):
            return float(value.strip())
    except (ValueError, OverflowError):
        pass
    raise _Rejected("a number (such as 0.1 or 1e-3)")


def _to_str(value: Any) -> str:
    if isinstance(value, str):
        return value
    if isinstance(value, bool):  # the spelling a YAML file and the command line share
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return str(value)
    raise _Rejected("a string")


_SCALARS = {bool: _to_bool, int: _to_int, float: _to_float, str: _to_str}
_NAMES = {bool: "a boolean", int: "an integer", float: "a number", str: "a string"}


def _conforms(value: Any, member: Any) -> bool:
    """Whether `value` already is of `member` (a bool is not an int here)."""
    if member is bool:
        return isinstance(value, bool)
    if member in (int, float):
        return isinstance(value, member) and not isinstance(value, bool)
    if member is str:
        return isinstance(value, str)
    origin = get_origin(member) or member
    if origin in (list, tuple):
        return isinstance(value, (list, tuple))
    if origin is dict:
        return isinstance(value, Mapping)
    return False


def _scalar_text(value: str) -> Any:
    """A string as the scalar it spells (`"2"` -> 2, `"0.5"` -> 0.5), else unchanged."""
    try:
        parsed = ast.literal_eval(value.strip())
    except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError):
        return value
    return parsed if isinstance(parsed, (int, float)) else value


def _describe(members: tuple) -> str:
    names = []
    for member in members:
        origin = get_origin(member) or member
        if member in _NAMES:
            names.append(_NAMES[member])
        elif origin in (list, tuple):
            names.append("a list")
        elif origin is dict or _is_section(member):
            names.append("a mapping")
        else:
            names.append(getattr(member, "__name__", str(member)))
    return " or ".join(names)


def _convert_member(value: Any, member: Any) -> Any:
    if member in _SCALARS:
        return _SCALARS[member](value)
    origin = get_origin(member) or member
    if origin in (list, tuple):
        items = value if isinstance(value, (list, tuple)) else [value]
        item_type = (get_args(member) or (Any,))[0]
        if item_type is Ellipsis or item_type is Any:
            return list(items)
        converted = [convert_annotated(item, item_type) for item in items]
        return tuple(converted) if origin is tuple else converted
    if origin is dict:
        if isinstance(value, Mapping):
            return value
        raise _Rejected("a mapping")
    if _is_section(member):  # a section (`checkpoint`, a user's `network: Config`): chanfig merges the mapping
        if isinstance(value, Mapping):
            return _UNCONVERTED
        raise _Rejected("a mapping of its keys (it is a section)")
    return _UNCONVERTED


def _is_section(member: Any) -> bool:
    return isinstance(member, type) and issubclass(member, Mapping)


def _known(member: Any) -> bool:
    """Whether this module converts to `member` (other types are left to chanfig)."""
    return member in _SCALARS or (get_origin(member) or member) in (list, tuple, dict) or _is_section(member)


def _spells_null(value: Any) -> bool:
    """`none`/`null`, alone or as the one item of a list (`--splits none` gives `['none']`)."""
    if isinstance(value, (list, tuple)) and len(value) == 1:
        value = value[0]
    return isinstance(value, str) and value.strip().lower() in _NULL


def convert_annotated(value: Any, annotation: Any) -> Any:
    """`value` converted to `annotation`; raises `_Rejected` with what the annotation accepts.

    Annotations this module does not know (a user's class, a typed section) are left to chanfig:
    the value is returned as it is.
    """
    if annotation is Any:
        return value
    members = _members(annotation)
    nullable = _NoneType in members
    members = tuple(member for member in members if member is not _NoneType)
    if nullable and (value is None or _spells_null(value)):
        return None
    if value is None:  # a key that cannot be unset: refused here, not only when the config is validated
        if all(_known(member) for member in members):
            raise _Rejected(_describe(members) + ", not None")
        return value
    if len(members) == 1:
        converted = _convert_member(value, members[0])
        return value if converted is _UNCONVERTED else converted
    if any(_conforms(value, member) for member in members):
        return value
    if isinstance(value, str) and str not in members:  # "2" for `int | float`: the number it spells
        spelled = _scalar_text(value)
        if any(_conforms(spelled, member) for member in members):
            return spelled
    for member in members:
        try:
            converted = _convert_member(value, member)
        except _Rejected:
            continue
        if converted is not _UNCONVERTED:
            return converted
    known = [
        member for member in members if member in _SCALARS or (get_origin(member) or member) in (list, tuple, dict)
    ]
    if len(known) < len(members):
        return value  # a member this module cannot convert to: chanfig decides
    raise _Rejected(_describe(members) + (" or None" if nullable else ""))


def convert(key: str, value: Any, annotation: Any) -> Any:
    """`value` for the key `key` (dotted, for messages) of type `annotation`.

    Raises:
        ConfigValueError: The value does not fit the annotation.

    Examples:
        >>> convert("log", "off", bool), convert("epochs", 3.0, int), convert("lr", "1e-3", float)
        (False, 3, 0.001)
        >>> convert("steps", "none", int | None), convert("splits", "train", list[str])
        (None, ['train'])
        >>> convert("epochs", 2.7, int)
        Traceback (most recent call last):
        danling.runners._config_values.ConfigValueError: config.epochs=2.7 is not accepted: expected an integer ...
    """
    try:
        return convert_annotated(value, annotation)
    except _Rejected as exc:
        accepted = exc.accepted
        if _NoneType in _members(annotation) and "None" not in accepted:
            accepted += ", or none/null to unset it"
        raise ConfigValueError(key, value, accepted) from None
