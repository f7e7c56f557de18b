"""The base of every typed config section: one conversion path, declared keys and aliases.

[`_TypedConfig`][danling.runners._config_base._TypedConfig] routes every value into a key through
one place, whether it comes from a file, the command line (both merged as mappings), keyword
arguments or a Python assignment, so [`convert`][danling.runners._config_values.convert] types it
the same way from each source; chanfig's own conversion (`int(2.7) == 2`, `bool("false") is True`)
never sees a value it could get wrong.

It also tells declarations from input. Keys the author's Python code creates while a config
class is constructed (`__init__`) or in `post()` (`self.network.type = "resnet50"`, which
auto-creates the `network` section) are declared keys; keys arriving from files, the command line
and keyword arguments are checked against them, so `--network.typ` is still an error naming
`network.type`.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Any

from chanfig import Config, NestedDict
from chanfig.utils import Null, get_cached_annotations

from ._config_values import ConfigValueError, convert

__all__ = ["_TypedConfig", "_DeclaredSection", "declaring", "is_strict", "accepted_keys", "declared_keys"]

# > 0 while a mapping from a file, the command line or keyword arguments is merged: input, not declarations
_INPUT: ContextVar[int] = ContextVar("danling_config_input", default=0)
# True while a config class is constructed or its `post()` hooks run: keys created then are declarations
_DECLARING: ContextVar[bool] = ContextVar("danling_config_declaring", default=False)

_PATH, _DECLARED, _STRICT = "_danling_path", "_danling_declared", "_danling_strict"
_MISSING = object()


@contextmanager
def declaring() -> Iterator[None]:
    """Keys the code inside creates (outside a merge) are declarations of the config."""
    token = _DECLARING.set(True)
    try:
        yield
    finally:
        _DECLARING.reset(token)


@contextmanager
def _input() -> Iterator[None]:
    token = _INPUT.set(_INPUT.get() + 1)
    try:
        yield
    finally:
        _INPUT.reset(token)


def is_strict(node: Any) -> bool:
    """Whether `node` rejects keys it does not declare (its class's `STRICT`, or a section the
    author's code created, which accepts the keys that code set)."""
    return bool(getattr(node, "__dict__", {}).get(_STRICT, getattr(type(node), "STRICT", False)))


def declared_keys(node: Any) -> set[str]:
    """Keys of `node` that the config class's own code created (see the module docstring)."""
    return set(getattr(node, "__dict__", {}).get(_DECLARED) or ())


def accepted_keys(node: Any) -> set[str]:
    """Keys a strict `node` accepts: annotations, `EXTRA_KEYS` and the keys declared in Python."""
    return set(get_cached_annotations(node)) | set(getattr(type(node), "EXTRA_KEYS", ())) | declared_keys(node)


def _stamp(node: _TypedConfig, path: str) -> None:
    """Record each typed section's dotted path, so its errors name the full key."""
    node.__dict__[_PATH] = path
    for key, value in dict.items(node):
        if isinstance(value, _TypedConfig):
            _stamp(value, f"{path}.{key}")


class _ConfigMeta(type(Config)):  # type: ignore[misc]
    """Construction (with the subclass's `__init__`) is the author's code: it declares keys."""

    def __call__(cls, *args: Any, **kwargs: Any) -> Any:
        with declaring():
            return super().__call__(*args, **kwargs)


class _TypedConfig(Config, metaclass=_ConfigMeta):
    """Config whose subclasses inherit their parents' annotations and convert every value they receive.

    chanfig converts and checks values against the annotations of the instance's own class
    only; merging the inherited ones here keeps `epochs: int | None` honoured in user subclasses.

    A section rejects keys it does not declare (`STRICT`), so a typo such as
    `checkpoint.intervall` fails validation instead of being ignored; `EXTRA_KEYS` are accepted
    too, and with `NAMED_SUBSECTIONS` an undeclared mapping is a named override section.
    `ALIASES` maps another spelling of a key to its name: it is renamed on input, and one source
    setting both spellings is an error. With `DECLARES`, keys set by the class's own code (see the
    module docstring) are accepted too. (Plain class attributes, not annotations: annotated names
    would become config keys.)
    """

    STRICT = True
    EXTRA_KEYS = frozenset()
    NAMED_SUBSECTIONS = False
    ALIASES = {}
    DECLARES = False

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        merged: dict[str, Any] = {}
        for klass in reversed(cls.__mro__[1:]):
            if issubclass(klass, _TypedConfig):
                merged.update(get_cached_annotations(klass))
        merged.update(cls.__dict__.get("__annotations__", {}))
        cls.__annotations__ = merged

    def __init__(self, *args: Any, default_factory: Any = Null, **kwargs: Any) -> None:
        super().__init__(
            *args, default_factory=_DeclaredSection if default_factory is Null else default_factory, **kwargs
        )

    # ------------------------------------------------------------------ names
    def _key(self, name: Any) -> str:
        path = self.__dict__.get(_PATH)
        return f"{path}.{name}" if path else str(name)

    def _canonical(self, name: Any) -> Any:
        if not self.ALIASES or not isinstance(name, str):
            return name
        head, dot, rest = name.partition(".")
        return self.ALIASES.get(head, head) + dot + rest

    def _declares_now(self) -> bool:
        if _INPUT.get():
            return False
        if self.__dict__.get(_STRICT):  # a section the author's code created: it takes what that code sets
            return True
        return self.DECLARES and _DECLARING.get()

    def _declare(self, name: Any) -> None:
        declared = self.__dict__.get(_DECLARED)
        if declared is None:
            declared = self.__dict__[_DECLARED] = set()
        declared.add(name)

    # ------------------------------------------------------------------ reading and writing
    def get(self, name: Any, *args: Any, **kwargs: Any) -> Any:
        return super().get(self._canonical(name), *args, **kwargs)

    def set(self, name: Any, value: Any, convert_mapping: bool | None = None) -> None:  # type: ignore[override]
        name = self._canonical(name)
        if isinstance(name, str) and "." in name:  # into the section's own `set`, which knows its keys' types
            head, rest = name.split(".", 1)
            if not dict.__contains__(self, head):
                self.__missing__(head)
            child = dict.get(self, head)
            if isinstance(child, _TypedConfig):
                child.set(rest, value, convert_mapping)
                return
        annotation = get_cached_annotations(self).get(name)
        if annotation is not None:
            value = convert(self._key(name), value, annotation)
        new = not dict.__contains__(self, name)
        if isinstance(value, Config):  # a section as it is (chanfig would copy it into the default factory's class)
            convert_mapping = False
        super().set(name, value, convert_mapping)
        if new and self._declares_now():
            self._declare(name)
        stored = dict.get(self, name)
        if isinstance(stored, _TypedConfig):
            _stamp(stored, self._key(name))

    def __missing__(self, name: Any, default: Any = Null) -> Any:
        declares = self._declares_now()
        result = super().__missing__(name, default)
        child = dict.get(self, name) if dict.__contains__(self, name) else None
        if isinstance(child, _TypedConfig):
            for attribute in (_DECLARED, _STRICT):  # chanfig copies the parent's attributes into the child
                child.__dict__.pop(attribute, None)
            if declares and isinstance(child, _DeclaredSection):
                child.__dict__[_STRICT] = True
            _stamp(child, self._key(name))
        if declares:
            self._declare(name)
        return result

    @staticmethod
    def _merge(this: Any, that: Any, overwrite: bool = True) -> Any:
        if not isinstance(this, _TypedConfig):
            return NestedDict._merge(this, that, overwrite)
        if not that:
            return this
        items = list(that.items() if isinstance(that, Mapping) else that)
        with _input():
            for key, value in this._renamed(items):
                this._merge_item(key, value, overwrite)
        return this

    def _renamed(self, items: Iterable[tuple[Any, Any]]) -> list[tuple[Any, Any]]:
        """`items` with aliases renamed; one source setting a key under both spellings is an error."""
        items = list(items)
        if not self.ALIASES:
            return items
        heads = {key.partition(".")[0] for key, _ in items if isinstance(key, str)}
        for alias, name in self.ALIASES.items():
            if alias in heads and name in heads:
                raise ValueError(
                    f"config.{self._key(alias)} and config.{self._key(name)} are the same section ({alias} is an "
                    f"alias of {name}), set twice in one source; keep one, under {name}"
                )
        return [(self._canonical(key), value) for key, value in items]

    def _merge_item(self, key: Any, value: Any, overwrite: bool) -> None:
        if isinstance(key, str) and "." in key:
            head, rest = key.split(".", 1)
            child = dict.get(self, head) if dict.__contains__(self, head) else None
            if isinstance(child, Mapping):
                type(child)._merge(child, {rest: value}, overwrite)
                return
        current = dict.get(self, key, _MISSING) if not isinstance(key, str) or "." not in key else _MISSING
        if (
            current is _MISSING
            and not (isinstance(key, str) and "." in key)
            and isinstance(value, Mapping)
            and not isinstance(value, Config)
            and key not in get_cached_annotations(self)
        ):
            # A new section from input (`dataloader: {train: {batch_size: x}}`): create it empty first, so it
            # knows its dotted path before its values are converted and a refused one names its full key.
            created = self.__missing__(key)
            if isinstance(created, _TypedConfig):
                type(created)._merge(created, value, overwrite)
                return
            current = created
        if (
            isinstance(current, _TypedConfig)
            and not isinstance(value, Mapping)
            and key in declared_keys(self)
            and key not in get_cached_annotations(self)  # annotated sections: the converter refuses it
            and key not in self.EXTRA_KEYS
            and is_strict(self)
        ):
            # `--model x` or `model: null` for the section the class's code built (`self.model.depth = 4`)
            # would replace it and silently drop every key the code set in it.
            raise ConfigValueError(self._key(key), value, "a mapping of its keys (it is a section)")
        if isinstance(current, Mapping) and isinstance(value, Mapping):
            type(current)._merge(current, value, overwrite)
        elif overwrite or key not in self:
            self.set(key, value)


class _DeclaredSection(_TypedConfig):
    """A section no class declares: created by the author's code (then it accepts the keys that
    code sets, and checks input against them) or arriving from input under a free-form key."""

    STRICT = False


def adopt_declarations(target: Any, source: Any) -> None:
    """Declare in `target` every key declared in `source`, a copy of it that ran more of the class's code."""
    if not isinstance(target, _TypedConfig) or not isinstance(source, _TypedConfig):
        return
    for key in declared_keys(source) - declared_keys(target):
        target._declare(key)
    for key, child in dict.items(source):
        if not isinstance(child, _TypedConfig):
            continue
        if not dict.__contains__(target, key):
            if not child.__dict__.get(_STRICT):
                continue
            with declaring():  # a section the code creates: there, empty, checking what input puts in it
                target.__missing__(key)
        adopt_declarations(dict.__getitem__(target, key), child)
