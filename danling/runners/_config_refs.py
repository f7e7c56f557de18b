"""Where config values came from `!env` / `!include` tags, so records keep the reference, not the value.

A YAML config may say `token: !env API_TOKEN` or `model: !include model.yaml`. The runner needs
the resolved values, but `config.yaml` and `metadata.json` in the run directory must not copy
an environment secret: they record `!env API_TOKEN` instead. Each config file is read a second
time with a loader that keeps the tags; the dotted keys holding one, with the value they
resolved to, are remembered on the config and substituted back when the run's records are written
(only while the value is still the resolved one: a later override is recorded as it is).
"""

from __future__ import annotations

import copy
import json
import os
import re
from collections.abc import Mapping
from typing import Any

import yaml
from chanfig import NestedDict
from chanfig.io import YamlLoader

__all__ = [
    "Reference",
    "merge_config_files",
    "file_references",
    "with_references",
    "references_yaml",
    "load_yaml",
    "key_lines",
    "value_source",
]

_TAGS = ("!env", "!include", "!includes")


class Reference:
    """A tagged YAML value as written in the file: `tag` and its argument."""

    def __init__(self, tag: str, value: Any) -> None:
        self.tag, self.value = tag, value

    def __str__(self) -> str:
        value = " ".join(map(str, self.value)) if isinstance(self.value, list) else self.value
        return f"{self.tag} {value}"


# YAML 1.1 reads `1e-3` (no dot) as a string; YAML 1.2, JSON and the command line read a number.
_FLOAT_SPELLINGS = re.compile(
    r"^[-+]?(?:[0-9][0-9_]*\.[0-9_]*(?:[eE][-+]?[0-9]+)?|[0-9][0-9_]*[eE][-+]?[0-9]+|\.[0-9_]+(?:[eE][-+]?[0-9]+)?)$"
)


class _ConfigLoader(YamlLoader):
    """chanfig's loader (`!include`, `!env`) with `1e-3` read as a number, also in included files."""

    def __init__(self, stream: Any) -> None:
        super().__init__(stream)
        self.add_constructor("!include", _ConfigLoader._include_file)
        self.add_constructor("!includes", _ConfigLoader._include_files)

    @staticmethod
    def _include_files(loader: Any, node: yaml.Node) -> list[Any]:
        if not isinstance(node, yaml.SequenceNode):
            raise yaml.constructor.ConstructorError(
                None, None, f"!includes needs a list, got {node.id}", node.start_mark
            )
        return [_ConfigLoader._include_file(loader, item) for item in node.value]

    @staticmethod
    def _include_file(loader: Any, node: yaml.Node) -> Any:
        path = os.path.join(loader._root, loader.construct_scalar(node))
        if not os.path.exists(path):
            raise FileNotFoundError(f"included file not found: {path}")
        if os.path.splitext(path)[1].lower() in (".yaml", ".yml"):
            return load_yaml(path)
        return NestedDict.load(path)


_ConfigLoader.add_implicit_resolver("tag:yaml.org,2002:float", _FLOAT_SPELLINGS, list("-+0123456789."))


def load_yaml(path: str | os.PathLike) -> Any:
    """The YAML file at `path`, with `!include`/`!env` resolved and `1e-3` read as a float."""
    with open(path, encoding="utf-8") as handle:
        return yaml.load(handle, Loader=_ConfigLoader)  # a SafeLoader with three tags


def key_lines(path: str | os.PathLike) -> dict[str, int]:
    """Dotted key -> line number of each key of a YAML or JSON file ({} when it cannot be read so)."""
    try:
        with open(path, encoding="utf-8") as handle:
            root = yaml.compose(handle, Loader=yaml.SafeLoader)  # nodes only: tags are not resolved
    except (yaml.YAMLError, OSError, UnicodeDecodeError):
        return {}
    lines: dict[str, int] = {}

    def walk(node: Any, prefix: str) -> None:
        if not isinstance(node, yaml.MappingNode):
            return
        for key_node, value_node in node.value:
            if isinstance(key_node, yaml.ScalarNode):
                dotted = f"{prefix}{key_node.value}"
                lines[dotted] = key_node.start_mark.line + 1
                walk(value_node, dotted + ".")

    walk(root, "")
    return lines


def value_source(path: str | os.PathLike, key: str) -> str:
    """`file:line` of the dotted `key` in the config file `path`, following `!include`s."""
    name = os.fspath(path)
    lines = key_lines(name)
    if key in lines:
        return f"{name}:{lines[key]}"
    parts = key.split(".")
    for cut in range(len(parts) - 1, 0, -1):  # the longest prefix that holds an included file
        head = ".".join(parts[:cut])
        if head not in lines:
            continue
        where = f"{name}:{lines[head]}"
        reference = file_references(name, {}).get(head, (None,))[0] if name.endswith((".yaml", ".yml")) else None
        if reference is not None and reference.tag == "!include":
            return f"{value_source(reference.value, '.'.join(parts[cut:]))}, included at {where}"
        return where
    return name


class _ReferenceLoader(yaml.SafeLoader):
    """Reads tagged values as `Reference`s, resolving nothing."""


def _construct(loader: yaml.SafeLoader, tag: str, node: yaml.Node) -> Reference:
    if isinstance(node, yaml.SequenceNode):
        return Reference(tag, loader.construct_sequence(node))
    return Reference(tag, loader.construct_scalar(node))


for _tag in _TAGS:
    _ReferenceLoader.add_constructor(_tag, lambda loader, node, tag=_tag: _construct(loader, tag, node))


def _walk(tree: Any, resolved: Any, prefix: str, found: dict[str, tuple[Reference, Any]], root: str) -> None:
    if isinstance(tree, Reference):
        if tree.tag != "!env":  # included files are named absolutely, so the record loads from anywhere
            paths = [
                os.path.join(root, path) for path in (tree.value if isinstance(tree.value, list) else [tree.value])
            ]
            tree = Reference(tree.tag, paths if isinstance(tree.value, list) else paths[0])
        found[prefix] = (tree, resolved)
    elif isinstance(tree, Mapping) and isinstance(resolved, Mapping):
        for key, value in tree.items():
            _walk(value, resolved.get(key), f"{prefix}.{key}" if prefix else str(key), found, root)


def file_references(path: str | os.PathLike, resolved: Mapping[str, Any]) -> dict[str, tuple[Reference, Any]]:
    """Dotted key -> (reference, resolved value) for every tagged value of the YAML file at `path`."""
    if os.path.splitext(os.fspath(path))[1].lower() not in (".yaml", ".yml"):
        return {}
    full = os.path.abspath(os.path.expanduser(os.fspath(path)))
    with open(full, encoding="utf-8") as handle:
        tree = yaml.load(handle, Loader=_ReferenceLoader)  # a SafeLoader that keeps tags unresolved
    found: dict[str, tuple[Reference, Any]] = {}
    _walk(tree, resolved, "", found, os.path.dirname(full))
    return found


def merge_config_files(config: Any, files: list[str]) -> tuple:
    """Merge each config file into `config` in order, remembering its tagged values on `config`.

    Returns an empty tuple (what is left to merge), so a constructor can chain it.
    """
    from ._config_values import ConfigValueError

    references = dict(config.getattr("references", None) or {})
    for path in files:
        data = read_config_file(path)
        try:
            config.merge(data)
        except ConfigValueError as exc:  # name the file and line the bad value came from
            exc.source = value_source(path, exc.key)
            raise
        except (ValueError, TypeError) as exc:  # name the file the bad key or value came from
            raise type(exc)(f"in config file {os.fspath(path)!r}: {exc}") from exc
        # Remember each tagged value as the config stores it (converted: `epochs: !env EPOCHS` holds 3, not
        # "3"; an included typed section holds its defaults too), so the record can tell it is unchanged.
        found = file_references(path, data)
        references.update({key: (reference, _stored(config, key)) for key, (reference, _) in found.items()})
    if references:
        config.setattr("references", references)
    return ()


def _plain(value: Any) -> Any:
    to_dict = getattr(value, "dict", None)
    return to_dict() if callable(to_dict) else value


def _unchanged(value: Any, resolved: Any) -> bool:
    """Whether `value` is still what the tag resolved to; an optimizer argument read from `!env` is stored
    as the number or boolean its text spells (`"0.5"` -> 0.5, `"off"` -> False), which is the same value."""
    if value == resolved:
        return True
    if isinstance(resolved, str) and isinstance(value, bool):
        return resolved.strip().lower() in (("true", "yes", "on", "1") if value else ("false", "no", "off", "0"))
    if isinstance(resolved, str) and isinstance(value, (int, float)):
        try:
            return float(resolved) == value
        except ValueError:
            return False
    return False


def _stored(config: Any, key: str) -> Any:
    """A copy of the value at the dotted `key` of `config` as plain data (None when absent)."""
    node = config
    for part in key.split("."):
        if not isinstance(node, Mapping) or part not in node:
            return None
        node = node[part]
    return copy.deepcopy(_plain(node))


def with_references(config: Any, plain: Mapping[str, Any], as_text: bool = True) -> dict[str, Any]:
    """`plain` (the config as a dict) with each still-resolved tagged value replaced by its reference.

    `as_text` gives the reference as a string (`"!env API_TOKEN"`, for JSON); otherwise the
    `Reference` itself (for [`references_yaml`][danling.runners._config_refs.references_yaml]).
    """
    references = getattr(config, "__dict__", {}).get("references") or {}
    result = dict(plain)
    for key, (reference, resolved) in references.items():
        parts = key.split(".")
        node = result
        for part in parts[:-1]:
            if not isinstance(node.get(part), Mapping):
                break
            node[part] = node = dict(node[part])
        else:
            if parts[-1] in node and _unchanged(_plain(node[parts[-1]]), _plain(resolved)):
                node[parts[-1]] = str(reference) if as_text else reference
    return result


class _ReferenceDumper(yaml.SafeDumper):
    pass


_ReferenceDumper.add_representer(
    Reference,
    lambda dumper, ref: (
        dumper.represent_sequence(ref.tag, ref.value)
        if isinstance(ref.value, list)
        else dumper.represent_scalar(ref.tag, str(ref.value))
    ),
)


def references_yaml(config: Any, plain: Mapping[str, Any]) -> str | None:
    """YAML of `plain` with tagged values written back as tags, or `None` when the config has none."""
    if not (getattr(config, "__dict__", {}).get("references")):
        return None
    return yaml.dump(with_references(config, plain, as_text=False), Dumper=_ReferenceDumper, sort_keys=False)


def read_config_file(path: str | bytes | os.PathLike) -> Mapping:
    """Load a YAML/JSON/TOML config file as a mapping, with errors that name the file."""
    name = os.fsdecode(path)
    full = os.path.expanduser(name)
    if not os.path.isfile(full):
        if os.path.exists(full):  # a directory: "does not exist" would send the user looking for a typo
            raise ValueError(f"config file {name!r} is not a file; give the YAML, JSON or TOML file in it")
        raise FileNotFoundError(f"config file {name!r} does not exist")
    suffix = os.path.splitext(full)[1].lower()
    if suffix not in (".yaml", ".yml", ".json", ".toml"):
        raise ValueError(f"config file {name!r} must end in .yaml, .yml, .json or .toml, got {suffix or 'no suffix'!r}")
    try:
        data = load_yaml(full) if suffix in (".yaml", ".yml") else _load_plain(full, suffix)
    except Exception as exc:  # parser errors carry the line/column; keep them and name the file
        detail = " ".join(str(exc).split())  # YAML's spans several lines; the error is one line on stderr
        raise ValueError(f"cannot read config file {name!r}: {detail}") from exc
    if data is None:
        return {}
    if not isinstance(data, Mapping):
        raise ValueError(f"config file {name!r} must hold a mapping at the top level, got {type(data).__name__}")
    return data


def _load_plain(path: str, suffix: str) -> Any:
    """A JSON or TOML file as plain Python values (chanfig's loader turns an empty JSON list into a mapping)."""
    if suffix == ".json":
        with open(path, encoding="utf-8") as handle:
            return json.load(handle)
    try:
        import tomllib
    except ImportError:  # Python 3.10: chanfig's reader
        return NestedDict.load(path)
    with open(path, "rb") as handle:
        return tomllib.load(handle)
