"""`--help` of `RunnerConfig.parse`: every key with its type, default and description, by section.

Descriptions are the first sentence of the key's entry in the `Attributes:` section of the
docstring of the class that declares it (a section class or the user's config class).
"""

import inspect
import re
from collections.abc import Mapping
from typing import Any

from chanfig.utils import get_cached_annotations

from ._config_base import declared_keys, is_strict

_ENTRY = re.compile(r"^(\s*)(\w+)(?: \([^)]*\))?:\s*(.*)$")


def key_descriptions(kind: type) -> dict[str, str]:
    """Key -> one-line description from the `Attributes:` docstring sections of `kind` and its bases."""
    result: dict[str, str] = {}
    for klass in reversed(kind.__mro__):
        doc = inspect.cleandoc(klass.__dict__.get("__doc__") or "")
        lines = doc.splitlines()
        if "Attributes:" not in lines:
            continue
        entries: dict[str, list[str]] = {}
        indent, current = None, None
        for line in lines[lines.index("Attributes:") + 1 :]:
            if line.strip() and not line.startswith(" "):
                break  # the next docstring section
            match = _ENTRY.match(line)
            if match and (indent is None or len(match.group(1)) == indent):
                indent, current = len(match.group(1)), match.group(2)
                entries[current] = [match.group(3)]
            elif current is not None and line.strip():
                entries[current].append(line.strip())
        for key, words in entries.items():
            result[key] = " ".join(words)
    return result


def _type_name(annotation: Any) -> str:
    name = annotation.__name__ if isinstance(annotation, type) else str(annotation)
    return name.replace("typing.", "").replace("NoneType", "None")


def _section_lines(node: Mapping, prefix: str, out: dict[str, list[str]]) -> None:
    descriptions = key_descriptions(type(node))
    group = prefix.rstrip(".") or "top level"
    lines = out.setdefault(group, [])
    doc = (inspect.getdoc(type(node)) or "").split("\n", 1)[0] if prefix else ""
    if is_strict(node) and not getattr(type(node), "STRICT", False):
        doc = "Keys the config class's own code (`__init__`, `post()`) sets."
    if doc and not lines:
        lines.append(f"  {doc}")
    annotations = dict(get_cached_annotations(node))
    # keys the config class's own code declared (`self.network.type = ...` in `__init__`), typed by their value
    declared = sorted(declared_keys(node) - set(annotations))
    annotations.update({key: type(dict.get(node, key)) for key in declared})
    for key, annotation in annotations.items():
        value = dict.get(node, key) if isinstance(node, dict) else None
        strict = getattr(type(value), "STRICT", None)
        if isinstance(value, Mapping) and strict is not None:
            _section_lines(value, f"{prefix}{key}.", out)
            continue
        shown = value.dict() if isinstance(value, Mapping) and hasattr(value, "dict") else value
        text = f"  --{prefix}{key} {_type_name(annotation)} (default: {shown!r})"
        if isinstance(value, Mapping):
            text += " [free-form: any key below it]"
        description = descriptions.get(key)
        lines.append(f"{text}\n      {description}" if description else text)
    extra = sorted(set(getattr(type(node), "EXTRA_KEYS", ())) - set(get_cached_annotations(node)))
    if extra:
        free = " (free-form)" if not prefix else ""
        lines.append(f"  also accepted{free}: {', '.join(prefix + key for key in extra)}")
    if getattr(type(node), "NAMED_SUBSECTIONS", False):
        lines.append(f"  --{prefix}<split>.<key> VALUE overrides one of the keys above for one split")
    if prefix == "optim." and isinstance(node.get("type"), str):
        lines.extend(_optimizer_lines(node["type"]))  # the only other keys `optim.*` accepts
    elif prefix and not is_strict(node):
        lines.append(f"  any other --{prefix}<key> VALUE is passed on as an option")


def _optimizer_lines(name: str) -> list[str]:
    """The configured optimizer's arguments with their defaults (what `optim.*` accepts)."""
    from ._config_utils import optimizer_options

    try:
        options = optimizer_options(name)
    except ValueError as exc:
        return [f"  optim.type={name!r}: {exc}"]
    if options is None:
        return [f"  optimizer {name!r} takes any keyword argument"]
    lines = [f"  arguments of optimizer {name!r} (optim.type), with their defaults:"]
    return lines + [f"  --optim.{key} (default: {default!r})" for key, default in options.items()]


def help_text(config: Mapping, prog: str, config_option: str | None) -> str:
    """The text `--help` prints for `config`: options of `parse`, then every key grouped by section."""
    sections: dict[str, list[str]] = {}
    _section_lines(config, "", sections)
    # "[--config FILE]..." (the option repeats), not "[--config FILE ...]", which reads as one
    # option taking several files: `--config a.yaml b.yaml` is refused.
    head = [f"usage: {prog} [--{config_option} FILE]... [--KEY VALUE]..." if config_option else f"usage: {prog}", ""]
    head += ["options:", "  -h, --help          show this message and exit"]
    if config_option:
        head.append(f"  --{config_option} FILE       YAML, JSON or TOML file merged before the other keys (repeatable)")
    head += ["  --print-config      print the merged config as YAML and exit", ""]
    head += ["Keys are checked: an unknown key or a bad value exits with status 2.", "", ""]
    body = [f"{name}:\n" + "\n".join(lines) for name, lines in sections.items()]
    return "\n".join(head) + "\n\n".join(body) + "\n"
