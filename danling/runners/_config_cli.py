"""Private helpers of `danling.runners.config`: config files and typed command-line arguments."""

import ast
import sys
import warnings
from collections.abc import Iterable, Mapping, Sequence
from types import UnionType
from typing import Any, NoReturn, Union, get_args, get_origin

from chanfig import Config, ConfigParser
from chanfig.utils import get_cached_annotations

from ._config_refs import merge_config_files
from ._config_utils import peek, unknown_dotted_key

_NoneType = type(None)


def split_file_options(args: list[str], option: str) -> tuple[list[str], list[str]]:
    """Remove `--<option> PATH` / `--<option>=PATH` from `args`; return the rest and the paths."""
    flag = "--" + option
    rest: list[str] = []
    files: list[str] = []
    index = 0
    while index < len(args):
        token = args[index]
        if token == "--":
            rest.extend(args[index:])
            break
        if token == flag:
            if index + 1 >= len(args) or args[index + 1].startswith("--"):
                raise ValueError(f"{flag} needs a file path")
            files.append(args[index + 1])
            index += 2
            if index < len(args) and not args[index].startswith("-"):
                # `--config a.yaml b.yaml`: the second file would be refused as a stray argument.
                raise ValueError(
                    f"{flag} takes one file, but {args[index]!r} follows {args[index - 1]!r}; "
                    f"repeat {flag} before each file"
                )
            continue
        if token.startswith(flag + "="):
            files.append(token[len(flag) + 1 :])
        else:
            rest.append(token)
        index += 1
    return rest, files


def option_key(name: str) -> str:
    """The config key of an option name: dashes read as underscores (`max-grad-norm`), except in the split
    of `dataloader.<split>.<key>`, which names a dataset split as it is spelled (`val-hard`)."""
    parts = name.split(".")
    if len(parts) == 3 and parts[0].replace("-", "_") == "dataloader":
        return ".".join((parts[0].replace("-", "_"), parts[1], parts[2].replace("-", "_")))
    return name.replace("-", "_")


def _literal(token: str) -> Any:
    try:
        return ast.literal_eval(token)
    except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError):
        return token


def _union_members(annotation: Any) -> tuple:
    if get_origin(annotation) in (Union, UnionType):
        return get_args(annotation)
    return (annotation,)


def _argument_kwargs(annotation: Any) -> dict[str, Any] | None:
    """Option settings of an annotated key: values stay the strings typed, for the config's one
    converter (`_config_values.convert`) to read, as it reads the values of files and Python code."""
    members = tuple(member for member in _union_members(annotation) if member is not _NoneType)
    for member in members:
        if (get_origin(member) or member) in (list, tuple, set):
            item = (get_args(member) or (None,))[0]
            # no value at all (`--evaluate_splits`) is the empty list
            return {"nargs": "*", "type": str if item in (bool, int, float, str) else _literal}
    if len(members) != 1:
        return None
    member = members[0]
    if member in (bool, int, float, str):
        return {"type": str}
    if (get_origin(member) or member) is dict:
        return {"type": _literal}
    return None


def _annotated_keys(node: Mapping, prefix: str = "") -> Iterable[tuple[str, Any]]:
    for key, annotation in get_cached_annotations(node).items():
        value = dict.get(node, key) if isinstance(node, dict) else None
        if isinstance(value, Mapping):
            yield from _annotated_keys(value, f"{prefix}{key}.")
        else:
            yield f"{prefix}{key}", annotation


def register_typed_arguments(parser: Any, config: Mapping, args: Sequence[str]) -> list[str]:
    """Declare typed options for annotated keys at every depth (chanfig types top-level keys only).

    Returns the per-split dataloader keys found in `args` (`dataloader.<split>.<key>`).
    """

    def add(key: str, annotation: Any) -> None:
        kwargs = _argument_kwargs(annotation)
        if kwargs is not None and f"--{key}" not in parser:
            parser.add_argument(f"--{key}", dest=key, **kwargs)

    for key, annotation in _annotated_keys(config):
        add(key, annotation)
    loader = peek(config, "dataloader")
    if not isinstance(loader, Config):
        return []
    loader_annotations = get_cached_annotations(loader)
    split_keys = []
    for token in args:
        if not token.startswith("--"):
            continue
        parts = option_key(token[2:].split("=", 1)[0]).split(".")
        is_split_key = len(parts) == 3 and parts[0] == "dataloader" and parts[1] not in loader_annotations
        if is_split_key and parts[2] in loader_annotations:
            split_keys.append(".".join(parts))
            add(split_keys[-1], loader_annotations[parts[2]])
    return split_keys


# Options `RunnerConfig.parse` handles itself.
_OWN_OPTIONS = ("help", "h", "print_config")

# Sections whose keys are free-form options of a user-chosen class (optimizer, scheduler).
_OPEN_SECTIONS = ("optim", "scheduler")


def _scalar(token: str) -> Any:
    """A command-line value as the YAML-like scalar it spells (`0.9`, `1e-3`, `true`, `none`, `cosine`).

    `yes`/`no` and `on`/`off` are booleans too, as a YAML file reads them: `--optim.amsgrad off` was the
    string "off", which is true."""
    lowered = token.strip().lower()
    if lowered in ("none", "null"):
        return None
    if lowered in ("true", "yes", "on"):
        return True
    if lowered in ("false", "no", "off"):
        return False
    return _literal(token)


def register_free_form_arguments(parser: Any, config: Mapping, args: Sequence[str]) -> list[str]:
    """Type the free-form keys in `args`: `optim.*`, `scheduler.*` and keys the config does not have.

    Each value is read as a scalar and several values make a list, so `--optim.betas 0.9 0.99`
    gives `[0.9, 0.99]` (not strings). Returns the keys of the open sections, which chanfig would
    otherwise report as unrecognized.
    """
    counts: dict[str, int] = {}
    key = None
    for token in args:
        if token == "--":
            break
        if token.startswith("--"):
            key, _, value = token[2:].partition("=")
            key = option_key(key)
            counts[key] = 1 if value else 0
        elif key is not None:
            counts[key] += 1
    open_keys = []
    for key, count in counts.items():
        if f"--{key}" in parser or key in _OWN_OPTIONS:
            continue
        problem = unknown_dotted_key(config, key)
        if problem:
            parser.error(f"unknown option --{key} on the command line: {problem}")
        parser.add_argument(f"--{key}", dest=key, type=_scalar, nargs="+" if count > 1 else None)
        head = key.split(".")[0]
        if getattr(type(config), "ALIASES", {}).get(head, head) in _OPEN_SECTIONS:
            open_keys.append(key)
    return open_keys


class CommandLineError(SystemExit, ValueError):
    """A bad command line or config file given to `parse`: exits with status 2 when not caught.

    It is a `ValueError` too, so code that catches the errors of `parse` keeps working; the
    message is written to stderr when raised, since an uncaught `SystemExit` prints nothing.
    """

    def __init__(self, message: str) -> None:
        super().__init__(2)
        self.message = message

    def __str__(self) -> str:
        return self.message


def fail(prog: str, message: str) -> CommandLineError:
    """Write `prog: error: message` to stderr (argparse's style, without the usage) and return the error to raise."""
    sys.stderr.write(f"{prog}: error: {message}\n")
    return CommandLineError(message)


class StrictParser(ConfigParser):
    """chanfig's parser, with errors that name the key and value and leave the usage out."""

    def error(self, message: str) -> NoReturn:  # type: ignore[override]
        raise fail(self.prog, message)

    @staticmethod
    def _normalize_dash_to_underscore(args: Sequence[str]) -> list[str]:
        """chanfig's `--max-grad-norm` -> `--max_grad_norm`, keeping a dataloader split's name as typed."""
        normalized = []
        for arg in args:
            if arg.startswith("--") and len(arg) > 2:
                key, equals, value = arg[2:].partition("=")
                arg = "--" + option_key(key) + equals + value
            normalized.append(arg)
        return normalized

    def parse_args(self, args: Any = None, namespace: Any = None, eval_str: bool = False) -> Any:  # type: ignore[override]
        """chanfig's `parse_args` without evaluating strings: typed keys get the text as typed (the
        config converts it, like a file's value); free-form keys were read as scalars already."""
        return super().parse_args(args, namespace, eval_str=eval_str)


def wants(args: Sequence[str], *flags: str) -> bool:
    """Whether one of `flags` is among `args` before a `--` separator."""
    head = args[: args.index("--")] if "--" in args else args
    return any(flag in head for flag in flags)


def prepare_arguments(
    config: Any, parser: Any, args: list[str], default_config: str | None, no_default_config_action: str
) -> tuple[list[str], list[str]]:
    """Merge the `--<default_config>` files into `config` and declare an option for every key in `args`.

    Returns the remaining arguments and the per-split dataloader / open-section keys, which chanfig
    would report as unrecognized. An unknown key stops at `parser.error`.
    """
    files: list[str] = []
    if default_config is not None:
        args, files = split_file_options(args, default_config)
        if not files and no_default_config_action != "ignore":
            message = f"no --{default_config} file was given on the command line"
            if no_default_config_action == "raise":
                raise ValueError(message)
            warnings.warn(message, RuntimeWarning, stacklevel=3)
    merge_config_files(config, files)  # remembers !env/!include values, recorded as references
    split_keys = register_typed_arguments(parser, config, args) + register_free_form_arguments(parser, config, args)
    return args, split_keys


def apply_arguments(
    config: Any, parser: Any, args: list[str], default_config: str | None, no_default_config_action: str, strict: bool
) -> None:
    """Merge the config files, then the command-line values, into `config` (no `boot`).

    A bad command-line value names its flag as its source (a file's names its line already).
    """
    from ._config_values import ConfigValueError

    args, _ = prepare_arguments(config, parser, args, default_config, no_default_config_action)
    with warnings.catch_warnings():
        # every key was checked above (split overrides, free-form sections); chanfig would flag them as typos
        warnings.filterwarnings("ignore", message="Unrecognized argument", category=RuntimeWarning)
        try:
            Config.parse(config, args, default_config=None, boot=False, strict=strict)
        except ConfigValueError as exc:
            exc.source = exc.source or f"--{exc.key} on the command line"
            raise
