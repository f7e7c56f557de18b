"""Private helpers of `danling.runners.config`: value checks, config identity, files and CLI typing."""

import difflib
import math
import os
from collections.abc import Iterable, Mapping
from fnmatch import fnmatchcase
from typing import Any

from chanfig import Config, NestedDict
from chanfig.utils import get_cached_annotations

from ._config_base import accepted_keys, is_strict

_NoneType = type(None)


# ---------------------------------------------------------------------------------------------
# validation

# minimum of each integer key; None is accepted unless the key is in _REQUIRED
_INT_RULES = {
    "seed": 0,
    "steps": 0,
    "epochs": 0,
    "accum_steps": 1,
    "log_interval": 0,  # 0: no step logs
    "checkpoint.interval": 1,
    "checkpoint.keep_latest_k": 0,
    "checkpoint.save_top_k": 0,
    "evaluate_interval": 0,  # 0: evaluate only after the last step
    "evaluate_batches": 1,
    "dry_run": 1,
    "gc.interval": 1,
    "profiling.wait": 0,
    "profiling.warmup": 0,
    "profiling.active": 1,
    "profiling.repeat": 0,
    "parallel.pipeline_microbatch_size": 1,
    "parallel.pipeline_n_microbatches": 1,
    "comm.init_timeout_seconds": 1,
    "comm.train_timeout_seconds": 1,
    "ft.process_group_timeout_ms": 1,
    "ft.replica_id": 0,
    "ft.group_size": 1,
    "ft.min_replica_size": 1,
    "inference.progress_interval": 1,
}
_REQUIRED = frozenset({"accum_steps", "inference.progress_interval"})
_LOADER_INT_RULES = {"batch_size": 1, "num_workers": 0, "prefetch_factor": 1, "snapshot_every_n_steps": 1}
_POSITIVE_NUMBERS = (
    "max_grad_norm",
    "max_grad_value",
    "heartbeat.interval_seconds",
    "checkpoint.wait_timeout",
    "telemetry.peak_tflops",  # a MFU over a negative or zero peak is no number at all
)
_NON_NEGATIVE_NUMBERS = ("patience", "score.min_delta")
_UNIT_INTERVAL = ("ema.decay",)
_DTYPES = ("fp32", "float32", "fp16", "float16", "half", "bf16", "bfloat16", "fp64", "float64", "double")
_CHOICES: dict[str, tuple] = {
    "score_mode": ("min", "max"),
    "scheduler.interval": ("step", "epoch", "validation"),
    "checkpoint.backend": ("auto", "file", "dcp", "deepspeed"),
    "checkpoint.async_mode": ("disabled", "async", "async_with_pinned_mem"),
    "checkpoint.async_process_group_backend": ("gloo", "nccl"),
    "checkpoint.export_dtype": _DTYPES,
    "checkpoint.checksum": ("xxh3_128", "sha256"),
    "checkpoint.unverifiable": ("new-version", "stop"),
    "ft.process_group": ("gloo", "nccl"),
    "gc.generation": (0, 1, 2),
    "parallel.activation_checkpointing": ("none", "block", "selective"),
    "compile.memory_policy": ("default",),
}
# Why a choice outside the list is refused, where the list alone does not say.
_CHOICE_REASONS = {
    "compile.memory_policy": "rematerialisation and offload policies need a graph pass pipeline this version lacks",
}
# Choices read in any letter case ("DCP"); `RunnerConfig` stores them lower-cased.
CASELESS_CHOICES = ("checkpoint.backend",)
_EXCLUDE_ALIASES = {"data_loader": "dataloaders", "dataloader": "dataloaders", "lr_scheduler": "scheduler"}
# The top-level entries a runner's checkpoint holds (`state_dict` and the live components): what an
# `exclude_from_loading` entry, or the part of it before the first dot, may name. A name outside
# them excludes nothing, so a misspelling (`optimiser`) would load the state it meant to keep out.
CHECKPOINT_PARTS = frozenset(
    {"runner", "state", "rng", "dataloaders", "results", "topology", "loop", "fingerprints", "pass_meters"}
    | {"backend", "model", "optimizer", "ema", "scheduler"}
)


def peek(mapping: Any, dotted: str, default: Any = None) -> Any:
    """Value at a dotted path, or `default` when absent; never creates keys through default factories."""
    node = mapping
    for part in dotted.split("."):
        if not isinstance(node, Mapping) or part not in node:
            return default
        node = node[part]
    return node


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and not math.isnan(value)


def _is_str_list(value: Any) -> bool:
    return isinstance(value, (list, tuple)) and all(isinstance(item, str) for item in value)


def _check_int(key: str, value: Any, minimum: int, optional: bool) -> None:
    if value is None and optional:
        return
    if not _is_int(value) or value < minimum:
        suffix = " or None" if optional else ""
        raise ValueError(f"config.{key} must be an integer >= {minimum}{suffix}, got {value!r}")


def check_values(config: Mapping) -> None:
    """Range, choice and shape checks of the known keys; raises `ValueError` on the first failure."""
    for key, minimum in _INT_RULES.items():
        _check_int(key, peek(config, key), minimum, key not in _REQUIRED)
    loader = peek(config, "dataloader")
    sections = [("dataloader", loader)] if isinstance(loader, Mapping) else []
    if isinstance(loader, Mapping):
        sections += [(f"dataloader.{k}", v) for k, v in loader.items() if isinstance(v, Mapping)]
    for prefix, section in sections:
        for key, minimum in _LOADER_INT_RULES.items():
            _check_int(f"{prefix}.{key}", section.get(key), minimum, True)
    for key in _POSITIVE_NUMBERS + _NON_NEGATIVE_NUMBERS:
        value = peek(config, key)
        strict = key in _POSITIVE_NUMBERS
        if value is not None and (not _is_number(value) or value < 0 or (strict and value == 0)):
            bound = "> 0" if strict else ">= 0"
            raise ValueError(f"config.{key} must be a number {bound} or None, got {value!r}")
    for key in _UNIT_INTERVAL:
        value = peek(config, key)
        if value is not None and (not _is_number(value) or not 0 <= value <= 1):
            raise ValueError(f"config.{key} must be a number in [0, 1], got {value!r}")
    for key, choices in _CHOICES.items():
        value = peek(config, key)
        if key in CASELESS_CHOICES and isinstance(value, str):
            value = value.lower()
        if value is not None and value not in choices:
            raise ValueError(
                f"config.{key}={value!r} is not supported; expected None or one of: {', '.join(map(str, choices))}"
                + (f" ({_CHOICE_REASONS[key]})" if key in _CHOICE_REASONS else "")
            )
    for key in ("lineage", "experiment"):
        value = peek(config, key)
        if value is not None and (
            not isinstance(value, str) or not value.strip() or os.path.isabs(value) or ".." in value.split("/")
        ):
            raise ValueError(f"config.{key} must be a non-empty relative name without '..', got {value!r}")
    exclude = peek(config, "checkpoint.exclude_from_loading")
    if exclude is not None and not isinstance(exclude, str) and not _is_str_list(exclude):
        raise ValueError(
            f"config.checkpoint.exclude_from_loading must be a key, a list of keys or None, got {exclude!r}"
        )
    for entry in normalize_exclude(exclude) if exclude is not None else ():
        head = entry.partition(".")[0]
        if head not in CHECKPOINT_PARTS:
            close = difflib.get_close_matches(head, sorted(CHECKPOINT_PARTS), n=1, cutoff=0.6)
            hint = f"did you mean {close[0]!r}? " if close else ""
            raise ValueError(
                f"config.checkpoint.exclude_from_loading names {entry!r}, which is not part of a checkpoint; "
                f"{hint}accepted: {', '.join(sorted(CHECKPOINT_PARTS))} (or a dotted key inside one)"
            )
    _check_axes(peek(config, "parallel.axes"))


def _check_axes(axes: Any) -> None:
    if not isinstance(axes, Mapping):
        return
    for name, degree in axes.items():
        if not _is_int(degree) or (degree < 1 and degree != -1):
            raise ValueError(
                f"config.parallel.axes.{name} must be an integer >= 1, or -1 to fill from WORLD_SIZE, got {degree!r}"
            )
    auto = [name for name, degree in axes.items() if degree == -1]
    if len(auto) > 1:
        raise ValueError(f"at most one config.parallel.axes entry may be -1, got -1 for: {', '.join(auto)}")


def optimizer_options(name: Any) -> dict[str, Any] | None:
    """Keyword arguments (with their defaults) of the optimizer registered as `name`; None when
    they are open (`**kwargs`) or `name` is not a string.

    Raises:
        ValueError: No optimizer is registered as `name` (the message lists the registered ones).
    """
    if not isinstance(name, str):
        return None
    import inspect

    from danling.optim import OPTIMIZERS

    parameters = list(inspect.signature(OPTIMIZERS.get(name)).parameters.values())[1:]  # after `params`
    if any(parameter.kind is inspect.Parameter.VAR_KEYWORD for parameter in parameters):
        return None
    empty = inspect.Parameter.empty
    return {parameter.name: None if parameter.default is empty else parameter.default for parameter in parameters}


def check_optimizer_keys(config: Mapping) -> None:
    """Every `optim.*` key must be an argument of the optimizer `optim.type` names, so a typo
    (`optim.lrr`) fails when the config is read, not when the optimizer is built."""
    optim = peek(config, "optim")
    if not isinstance(optim, Mapping) or optim.get("type") is None:
        return
    try:
        options = optimizer_options(optim["type"])
    except ValueError as exc:
        raise ValueError(f"config.optim.type={optim['type']!r} is not an optimizer: {exc}") from None
    if options is None:
        return
    for key in optim:
        if key in ("type", "param_groups"):
            continue
        if key in options:
            number = _check_number(optim["type"], key, optim[key], options[key])
            if number is not None:  # "1e-3" (quoted in a file, or from !env): the optimizer compares it as a number
                optim[key] = number
            if isinstance(options[key], bool) and isinstance(optim[key], str):  # "false" is true to the optimizer
                optim[key] = _flag(key, optim[key])
            continue
        close = difflib.get_close_matches(str(key), list(options), n=1, cutoff=0.6)
        hint = f"did you mean optim.{close[0]}? " if close else ""
        raise ValueError(
            f"config.optim.{key} is not an argument of optimizer {optim['type']!r}; {hint}"
            f"its arguments: {', '.join(options)}"
        )


def _check_number(optimizer: str, key: str, value: Any, default: Any) -> int | float | None:
    """A value for an argument whose default is a number must read as one (`--optim.lr abc` failed at the
    optimizer's first comparison, with "'<' not supported between 'str' and 'int'"); returns the number a
    string spells (`"1e-3"`), None when there is nothing to convert."""
    if not isinstance(default, (int, float)) or isinstance(default, bool) or not isinstance(value, (str, bool)):
        return None
    try:
        if isinstance(value, bool):
            raise ValueError(value)
        try:
            return int(value.strip())
        except ValueError:
            return float(value)
    except ValueError:
        raise ValueError(
            f"config.optim.{key}={value!r} is not a number: optimizer {optimizer!r} takes a number for {key} "
            f"(default {default!r})"
        ) from None


def _flag(key: str, value: str) -> bool:
    """The boolean a string spells, for an optimizer argument whose default is a boolean (one converter)."""
    from ._config_values import convert

    return convert(f"optim.{key}", value, bool)


def check_annotations(config: Config) -> None:
    """chanfig's annotation check on every section (raises `TypeError`)."""
    NestedDict.validate(config)


def normalize_exclude(value: Any) -> Any:
    """`checkpoint.exclude_from_loading` as a list, with `dataloader`/`lr_scheduler` spellings canonicalised."""
    if value is None:
        return []
    if isinstance(value, str):
        value = [value]
    if not isinstance(value, (list, tuple)):
        return value
    result = []
    for item in value:
        if isinstance(item, str):
            head, dot, tail = item.partition(".")
            item = _EXCLUDE_ALIASES.get(head, head) + dot + tail
        result.append(item)
    return result


def _plain(value: Any) -> Any:
    """Config sections as plain dicts, for messages a person reads."""
    return {key: _plain(item) for key, item in value.items()} if isinstance(value, Mapping) else value


# ---------------------------------------------------------------------------------------------
# keys: undeclared keys of typed sections, and keys of features a runner does not provide


def unknown_keys(node: Mapping, prefix: str = "") -> list[str]:
    """One message per key that a strict typed section of `node` does not declare, with close matches.

    A section is strict when its class sets `STRICT`; it accepts its annotated keys and `EXTRA_KEYS`.
    With `NAMED_SUBSECTIONS`, an undeclared key holding a mapping is a named override section
    (`dataloader.<split>`) whose keys must be accepted ones. Free-form mappings are searched for
    nested typed sections but never checked themselves.
    """
    kind = type(node)
    strict = is_strict(node)
    accepted = accepted_keys(node) if strict else set()
    problems: list[str] = []
    for key, value in node.items():
        name = f"{prefix}{key}"
        if not strict or key in accepted:
            if isinstance(value, Mapping):
                problems += unknown_keys(value, f"{name}.")
        elif isinstance(value, Mapping) and getattr(kind, "NAMED_SUBSECTIONS", False):
            problems += [_unknown(f"{name}.{sub}", name, accepted) for sub in value if sub not in accepted]
        else:
            problems.append(_unknown(name, prefix.rstrip("."), accepted, node if not prefix else None))
    return problems


def _section_keys(node: Mapping, prefix: str = "") -> Iterable[str]:
    """Dotted keys declared inside the typed sections of `node`."""
    for key in get_cached_annotations(node):
        value = dict.get(node, key) if isinstance(node, dict) else None
        if isinstance(value, Mapping) and is_strict(value):
            yield from (f"{prefix}{key}.{sub}" for sub in get_cached_annotations(value))
            yield from _section_keys(value, f"{prefix}{key}.")


def _unknown(dotted: str, section: str, accepted: set[str], root: Mapping | None = None) -> str:
    leaf = dotted.rsplit(".", 1)[-1]
    close = difflib.get_close_matches(str(leaf), sorted(accepted), n=3, cutoff=0.6)
    if not close and root is not None:  # a section key given at the top level: `batch_size`
        close = [key for key in dict.fromkeys(_section_keys(root)) if key.rsplit(".", 1)[-1] == leaf][:3]
    dot = "." if section else ""
    if close:
        hint = "did you mean " + " or ".join(f"{section}{dot}{key}" for key in close) + "?"
    elif section:
        hint = "known keys: " + ", ".join(sorted(accepted))
    else:
        hint = "declare it as an annotated attribute of your RunnerConfig subclass (--help lists the known keys)"
    where = f"config.{section}" if section else "the config"
    return f"config.{dotted} is not a key of {where}; {hint}"


def unknown_dotted_key(config: Mapping, dotted: str) -> str | None:
    """Why `dotted` (a command-line key) is not a key of `config`, or None when it is accepted.

    Walks the typed sections; below a section that is not strict (`optim`, `scheduler`, or a
    user section annotated as `dict`/`Config`) and below a `dict`-annotated value anything goes.
    """
    node, parts = config, dotted.split(".")
    for index, part in enumerate(parts):
        if not is_strict(node):
            return None
        part = parts[index] = getattr(type(node), "ALIASES", {}).get(part, part)  # renamed on input too
        accepted, section = accepted_keys(node), ".".join(parts[:index])
        if part not in accepted:
            rest = parts[index + 1 :]
            if getattr(type(node), "NAMED_SUBSECTIONS", False) and len(rest) == 1:  # dataloader.<split>.<key>
                return None if rest[0] in accepted else _unknown(dotted, f"{section}.{part}", accepted)
            return _unknown(".".join(parts[: index + 1]), section, accepted, node if not index else None)
        value = dict.get(node, part) if isinstance(node, dict) else None
        if isinstance(value, Mapping):
            node = value
            continue
        annotation = get_cached_annotations(node).get(part)
        if annotation is None and part in getattr(type(node), "EXTRA_KEYS", ()):
            return None  # an `EXTRA_KEYS` entry: free-form
        if index + 1 < len(parts) and "dict" not in str(annotation):
            name = ".".join(parts[: index + 1])
            return f"config.{name} is a value, not a section; it has no key {parts[index + 1]!r}"
        return None
    return None


_MISSING = object()


def feature_keys(features: Mapping[str, Iterable[str]], declared: Iterable[str]) -> dict[str, str]:
    """Map each gated key to its feature; `section.*` patterns expand to the declared keys below `section`."""
    declared = list(declared)
    owners: dict[str, str] = {}
    for feature, patterns in features.items():
        for pattern in patterns:
            if pattern.endswith(".*"):
                keys = [key for key in declared if key.startswith(pattern[:-1])]
            else:
                keys = [pattern]
            owners.update(dict.fromkeys(keys, feature))
    return owners


def feature_requests(config: Mapping, owners: Mapping[str, str], defaults: Mapping[str, Any]) -> list[tuple]:
    """`(feature, key, value, default)` for each gated key of `config` that holds a non-default value."""
    requests = []
    for key, feature in owners.items():
        value = peek(config, key, _MISSING)
        if value is not _MISSING and value != defaults.get(key):
            requests.append((feature, key, value, defaults.get(key)))
    return requests


def unsupported(
    config: Mapping,
    stacks: Iterable[str],
    features: Iterable[str],
    runner: str | None,
    owners: Mapping[str, str],
    defaults: Mapping[str, Any],
) -> str | None:
    """What a runner offering `stacks` and `features` cannot run in `config`, as a message; None when nothing."""
    stack = str(peek(config, "stack") or "auto").strip().lower()
    available = sorted({str(name).lower() for name in stacks})
    if stack not in available:
        with_runner = f" with {runner}" if runner else ""
        return f"config.stack={stack!r} is not available{with_runner} in this version of danling; " + (
            f"available stacks: {available}"
        )
    features = set(features)
    lacking = f", which {runner} does not implement" if runner else ""
    return (
        "; ".join(
            f"config.{key}={_plain(value)!r} is not available yet in this version of danling: it needs the {feature!r} "
            f"feature{lacking}; leave it at its default {default!r}"
            for feature, key, value, default in feature_requests(config, owners, defaults)
            if feature not in features
        )
        or None
    )


# ---------------------------------------------------------------------------------------------
# identity

# dataloader keys that change throughput, not results; left out of config_id
_LOADER_RUNTIME_KEYS = ("num_workers", "persistent_workers", "prefetch_factor", "pin_memory", "snapshot_every_n_steps")

# Keys left out of `config_id` by default: the budget (how long: a run continues when it is
# raised), paths, logging, evaluation and checkpoint cadence, infrastructure.
CONFIG_ID_IGNORES = (
    "config",
    "epochs",
    "steps",
    "patience",
    "score",  # early-stopping threshold: when to stop, like patience
    "dry_run",
    "workspace_root",
    "lineage",
    "experiment",
    "resume",
    "auto_resume",
    "resume_allow_changes",
    "log",
    "log_interval",
    "evaluate_interval",
    "evaluate_batches",
    "tensorboard",
    "wandb",
    "csv",
    "mlflow",
    "checkpoint",
    "heartbeat",
    "profiling",
    "gc",
    "comm",
    "ft",
    "compile",
    "ddp",  # how gradients are synchronised, not what is trained
    # how the work is laid out over the ranks, not what is trained: a run may resume on another layout
    "stack",
    "parallel",
    "fsdp",
    *(f"dataloader.{split}{key}" for split in ("", "*.") for key in _LOADER_RUNTIME_KEYS),
)


def auto_stack(semantic_config: dict[str, Any], runners: Mapping[str, Any]) -> dict[str, Any]:
    """`semantic_config` with a `stack` naming the runner `"auto"` resolves to written as `"auto"`."""
    stack, default = semantic_config.get("stack"), runners.get("auto")
    if isinstance(stack, str) and default is not None and runners.get(stack.strip().lower()) is default:
        semantic_config["stack"] = "auto"
    return semantic_config


def semantic(obj: Any, path: tuple[str, ...], ignores: tuple[tuple[str, ...], ...]) -> Any:
    """Copy of `obj` without ignored keys, None values and empty mappings (keys stringified).

    A key is left out when its dotted path equals a pattern of `ignores` (`*` matches one level);
    everything below it goes with it. Each level keeps only the patterns whose leading parts
    matched the path so far, so a key is compared with a handful of patterns, not all of them.
    """
    if isinstance(obj, Mapping):
        depth = len(path)
        result = {}
        for key, value in obj.items():
            name = str(key)
            alive = tuple(p for p in ignores if len(p) > depth and _part_matches(name, p[depth]))
            if any(len(p) == depth + 1 for p in alive):
                continue
            value = semantic(value, (*path, name), alive)
            if value is None or (isinstance(value, dict) and not value):
                continue
            result[name] = value
        return result
    if isinstance(obj, (list, tuple)):
        return [semantic(item, path, ()) for item in obj]
    if isinstance(obj, (set, frozenset)):
        return sorted((semantic(item, path, ()) for item in obj), key=repr)
    return obj


def _part_matches(part: str, glob: str) -> bool:
    """`fnmatchcase` for one path level, with a plain comparison for globs without wildcards."""
    if glob == "*":
        return True
    if not _GLOB_CHARS.intersection(glob):
        return part == glob
    return fnmatchcase(part, glob)


_GLOB_CHARS = frozenset("*?[")


def normalize_config(config: Any, precisions: Mapping[str, str]) -> None:
    """Canonical spellings in place: stack and caseless choices lower-case, precision aliases,
    `checkpoint.exclude_from_loading` aliases, a string `wandb.tags` as a list."""
    stack = peek(config, "stack")
    if isinstance(stack, str) and stack != stack.strip().lower():
        config.stack = stack.strip().lower()
    precision = peek(config, "precision")
    if isinstance(precision, str) and precisions.get(precision.lower(), precision) != precision:
        config.precision = precisions[precision.lower()]
    for key in CASELESS_CHOICES:
        value = peek(config, key)
        if isinstance(value, str) and value != value.lower():
            config[key] = value.lower()
    checkpoint = peek(config, "checkpoint")
    if isinstance(checkpoint, Mapping) and "exclude_from_loading" in checkpoint:
        exclude = normalize_exclude(checkpoint["exclude_from_loading"])
        if exclude != checkpoint["exclude_from_loading"]:
            checkpoint["exclude_from_loading"] = exclude
    wandb = peek(config, "wandb")
    if isinstance(wandb, Mapping) and isinstance(wandb.get("tags"), str):
        wandb["tags"] = [wandb["tags"]]
