"""Where config values came from `!env` / `!include` tags, so records keep the reference, not the value.

A YAML config may say `token: !env API_TOKEN` or `model: !include model.yaml`. The runner needs
the resolved values, but `config.yaml` and `metadata.json` in the run directory must not copy
an environment secret: they record `!env API_TOKEN` instead. Each config file is read a second
time with a loader that keeps the tags; the dotted keys holding one, with the value they
resolved to, are remembered on the config and substituted back when the run's records are written
(only while the value is still the resolved one: a later override is recorded as it is).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

import yaml

__all__ = ["Reference", "merge_config_files", "file_references", "with_references", "references_yaml"]

_TAGS = ("!env", "!include", "!includes")


class Reference:
    """A tagged YAML value as written in the file: `tag` and its argument."""

    def __init__(self, tag: str, value: Any) -> None:
        self.tag, self.value = tag, value

    def __str__(self) -> str:
        value = " ".join(map(str, self.value)) if isinstance(self.value, list) else self.value
        return f"{self.tag} {value}"


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
    from ._config_cli import read_config_file

    references = dict(config.getattr("references", None) or {})
    for path in files:
        data = read_config_file(path)
        try:
            config.merge(data)
        except (ValueError, TypeError) as exc:  # name the file the bad key or value came from
            raise type(exc)(f"in config file {os.fspath(path)!r}: {exc}") from exc
        references.update(file_references(path, data))
    if references:
        config.setattr("references", references)
    return ()


def _plain(value: Any) -> Any:
    to_dict = getattr(value, "dict", None)
    return to_dict() if callable(to_dict) else value


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
            if parts[-1] in node and _plain(node[parts[-1]]) == _plain(resolved):
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
