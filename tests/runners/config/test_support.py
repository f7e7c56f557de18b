"""RunnerConfig keys that do something: the read/not-built audit, unknown keys and unbuilt stacks/features."""

from __future__ import annotations

import re
import warnings
from pathlib import Path
from types import UnionType
from typing import Any, Union, get_args, get_origin

import pytest
import torch
import yaml
from chanfig import Config
from chanfig.utils import get_cached_annotations

from danling.runners import RUNNERS, BaseRunner, Runner, RunnerConfig, TorchRunner, register_runner
from danling.runners._config_utils import feature_keys
from danling.runners.runner import runner_stacks
from tests.runners._torch_toy import TinyRunner, tiny_config
from tests.runners._toy import ToyRunner, toy_config

ROOT = Path(__file__).resolve().parents[3]
# Stacks another runner class implements (TorchRunner and its subclasses refuse them).
OTHER_RUNNER_STACKS = ("graph",)


def declared_keys() -> dict[str, Any]:
    """Every declared key of RunnerConfig (dotted) with its default."""
    return RunnerConfig().dict(flatten=True)


def gated_keys() -> dict[str, str]:
    return feature_keys(RunnerConfig.FEATURES, declared_keys())


# ------------------------------------------------------------------ the audit


def key_table() -> list[tuple[list[str], str]]:
    """Rows of the "Where each key is read" table of docs/config.md: (key patterns, where)."""
    text = (ROOT / "docs" / "config.md").read_text()
    section = text.split("### Where each key is read", 1)[1]
    rows = []
    for line in section.splitlines():
        cells = [cell.strip() for cell in line.strip().strip("|").split("|")]
        if len(cells) == 2 and cells[0].startswith("`"):
            rows.append((re.findall(r"`([^`]+)`", cells[0]), cells[1]))
        elif rows and not line.strip():
            break
    return rows


def expand(pattern: str, declared: dict[str, Any]) -> list[str]:
    if pattern.endswith(".*"):
        return [key for key in declared if key.startswith(pattern[:-1])]
    return [pattern]


def test_every_declared_key_is_read_or_raises_as_not_built():
    declared = declared_keys()
    owners = gated_keys()
    rows = key_table()
    assert rows, "docs/config.md has no key table"
    covered: dict[str, str] = {}
    for patterns, where in rows:
        for pattern in patterns:
            keys = expand(pattern, declared)
            assert keys and set(keys) <= set(declared), f"docs table names undeclared keys: {pattern}"
            for key in keys:
                assert key not in covered, f"{key} has two rows in the docs table"
                covered[key] = where
    assert sorted(set(declared) - set(covered)) == [], "declared keys missing from the docs table"
    for key, where in covered.items():
        unbuilt = re.fullmatch(r"not built yet: raises \(`([^`]+)`\)", where)
        if unbuilt:
            assert owners.get(key) == unbuilt.group(1), f"{key} is documented as not built but is not gated"
            builders = [
                runner.__name__
                for runner in RUNNERS.values()
                if unbuilt.group(1) in getattr(runner, "supported_features", ())
            ]
            assert not builders, f"{key} is documented as not built, but {builders} implement {unbuilt.group(1)!r}"
            continue
        # A gated key read by the runner that implements its feature names that feature in its row.
        feature = re.search(r"the `([^`]+)` feature of", where)
        assert owners.get(key) == (feature and feature.group(1)), f"{key}: gated by {owners.get(key)!r}, row {where!r}"
        files = re.findall(r"`(danling/[\w/]+\.py)`", where)
        assert files, f"{key}: no file named in {where!r}"
        leaf = re.escape(key.rsplit(".", 1)[-1])
        for name in files:
            source = (ROOT / name).read_text()
            assert re.search(rf"[.\"']{leaf}\b", source), f"{key} is said to be read by {name}, which never names it"
    assert set(owners) <= set(covered)


def test_features_name_only_declared_keys():
    declared = declared_keys()
    for feature, patterns in RunnerConfig.FEATURES.items():
        for pattern in patterns:
            assert expand(pattern, declared), f"{feature}: {pattern} matches no declared key"
            assert set(expand(pattern, declared)) <= set(declared), f"{feature}: {pattern} is not declared"


# ------------------------------------------------------------------ unknown keys


@pytest.mark.parametrize(
    ("overrides", "key", "suggestion"),
    [
        ({"checkpoint.intervall": 3}, "checkpoint.intervall", "checkpoint.interval"),
        ({"ema": {"decya": 0.9}}, "ema.decya", "ema.decay"),
        ({"dataloader.batchsize": 8}, "dataloader.batchsize", "dataloader.batch_size"),
        ({"dataloader.val.batchsize": 8}, "dataloader.val.batchsize", "dataloader.val.batch_size"),
        ({"parallel.axes.shards": 2}, "parallel.axes.shards", "parallel.axes.shard"),
        ({"wandb": {"projct": "x"}}, "wandb.projct", "wandb.project"),
    ],
)
def test_unknown_section_key_names_the_key_and_the_closest_ones(overrides, key, suggestion):
    match = rf"config\.{re.escape(key)} is not a key of .*did you mean {re.escape(suggestion)}\b"
    with pytest.raises(ValueError, match=match):
        RunnerConfig(**overrides)
    with pytest.raises(ValueError, match=match):
        RunnerConfig().merge(overrides)


def test_unknown_key_without_close_match_lists_the_section():
    with pytest.raises(ValueError, match=r"config\.gc\.zzz is not a key of config\.gc; known keys: disable_automatic"):
        RunnerConfig(**{"gc.zzz": 1})


def test_unknown_key_from_a_yaml_file_and_the_command_line(tmp_path):
    path = tmp_path / "exp.yaml"
    path.write_text(yaml.safe_dump({"epochs": 2, "checkpoint": {"keep_latest": 2}}))
    with pytest.raises(ValueError, match=r"config\.checkpoint\.keep_latest .*did you mean checkpoint\.keep_latest_k"):
        RunnerConfig().parse(["--config", str(path)])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # chanfig's own typo warning precedes the error
        with pytest.raises(ValueError, match=r"config\.heartbeat\.enabld .*did you mean heartbeat\.enabled"):
            RunnerConfig().parse(["--heartbeat.enabld", "true"])
        with pytest.raises(ValueError, match=r"config\.dataloader\.train\.shufle .*dataloader\.train\.shuffle"):
            RunnerConfig().parse(["--dataloader.train.shufle", "false"])


def test_assigned_unknown_key_fails_validation_and_runner_construction(tmp_path):
    config = RunnerConfig(**toy_config(tmp_path))
    config.checkpoint.dirname = "elsewhere"
    with pytest.raises(ValueError, match=r"config\.checkpoint\.dirname .*checkpoint\.dir_name"):
        config.validate()
    with pytest.raises(ValueError, match=r"config\.checkpoint\.dirname"):
        ToyRunner(config)


class _UserConfig(RunnerConfig):
    """Top-level keys are declared: `network` is a free-form section, `my_setting` a typed key."""

    network: Config = Config()
    my_setting: int | None = None


def test_open_sections_declared_top_level_and_loader_options_stay_accepted():
    overrides = {
        "optim.lr": 0.1,
        "optim.betas": [0.9, 0.99],
        "scheduler.warmup_steps": 10,
        "scheduler.type": "cosine",
        "network.type": "mlp",
        "dataloader.timeout": 5.0,
        "dataloader.train.shuffle": False,
        "dataloader.val.batch_size": 4,
    }
    config = _UserConfig(**overrides).boot()
    assert config.optim.lr == 0.1 and config.network.type == "mlp" and config.dataloader.val.batch_size == 4
    parsed = _UserConfig().parse(["--optim.momentum", "0.9", "--my_setting", "3", "--dataloader.val.num_workers", "0"])
    assert parsed.optim.momentum == 0.9 and parsed.my_setting == 3


# ------------------------------------------------------------------ stacks a runner does not implement


def test_torch_runner_stacks_come_from_the_registry():
    assert runner_stacks(TorchRunner) == ("auto", "ddp", "torch")
    assert runner_stacks(TinyRunner) == ("auto", "ddp", "torch")
    assert runner_stacks(ToyRunner) == ("auto",)


@pytest.mark.parametrize("stack", OTHER_RUNNER_STACKS)
def test_check_supported_refuses_a_stack_the_runner_lacks(stack):
    config = RunnerConfig(stack=stack)  # a valid spelling ...
    with pytest.raises(ValueError, match=rf"config\.stack='{stack}' is not available with TorchRunner in this version"):
        config.check_supported(runner_stacks(TorchRunner), runner="TorchRunner")  # ... that TorchRunner lacks
    with pytest.raises(ValueError, match=r"available stacks: \['auto', 'ddp', 'torch'\]"):
        RunnerConfig.check_runner(config, TorchRunner)


@pytest.mark.parametrize("stack", OTHER_RUNNER_STACKS)
def test_torch_runner_subclass_refuses_another_runners_stack_before_any_side_effect(tmp_path, stack):
    with pytest.raises(ValueError, match=rf"config\.stack='{stack}' is implemented by \w+Runner, not by TinyRunner"):
        TinyRunner(tiny_config(tmp_path, stack=stack))
    assert list(tmp_path.iterdir()) == []  # no run directory, log or checkpoint was created


def test_backend_free_runner_refuses_a_backend_stack(tmp_path):
    with pytest.raises(ValueError, match=r"config\.stack='torch' is implemented by TorchRunner, not by ToyRunner"):
        ToyRunner(toy_config(tmp_path, stack="torch"))


@pytest.fixture
def registry():
    saved_runners, saved_stacks = dict(RUNNERS), RunnerConfig.STACKS
    yield
    RUNNERS.clear()
    RUNNERS.update(saved_runners)
    RunnerConfig.STACKS = saved_stacks


def test_stack_registered_to_another_runner_names_it(registry, tmp_path):
    register_runner("toyds", ToyRunner)
    with pytest.raises(ValueError, match=r"'toyds' is implemented by ToyRunner, not by TinyRunner .*Runner\(config\)"):
        TinyRunner(tiny_config(tmp_path, stack="toyds"))
    with Runner(toy_config(tmp_path, stack="toyds", log=False)) as runner:
        assert type(runner) is ToyRunner


# ------------------------------------------------------------------ features a runner does not implement


def other_value(key: str, default: Any) -> Any:
    """A valid value different from `default` for the declared key `key`."""
    section, _, leaf = key.rpartition(".")
    node = RunnerConfig()
    for part in section.split("."):
        node = node[part]
    annotation = get_cached_annotations(node)[leaf]
    members = get_args(annotation) if get_origin(annotation) in (Union, UnionType) else (annotation,)
    if isinstance(default, bool) or (default is None and bool in members):
        return not default
    if isinstance(default, int) or (default is None and int in members):
        return (default or 1) + 1
    if key == "ddp.bucket_cap_mb":
        return 50.0
    if key == "ft.process_group":
        return "nccl"
    if key == "compile.memory_policy":
        return "default"  # the one value besides None that passes the config's own check
    if key == "parallel.activation_checkpointing":
        return "block"
    if key == "parallel.tensor_plan":
        return {"layer": "colwise"}
    if key == "fsdp.modules":
        return ["layers.*"]
    if isinstance(default, str) or (default is None and str in members):
        return f"{default or ''}x"
    return [["layer"]]  # parallel.module_fqns_per_model_part


@pytest.mark.parametrize("key", sorted(gated_keys()))
def test_every_gated_key_raises_when_set(key):
    feature, default = gated_keys()[key], declared_keys()[key]
    value = other_value(key, default)
    config = RunnerConfig(**{key: value})
    pattern = rf"config\.{re.escape(key)}={re.escape(repr(value))} is not available yet in this version of danling"
    with pytest.raises(ValueError, match=rf"{pattern}: it needs the '{feature}' feature"):
        config.check_supported(runner_stacks(TorchRunner))
    config.check_supported(runner_stacks(TorchRunner), [feature])  # a runner implementing it lifts the check
    RunnerConfig().check_supported(["auto"])  # defaults need no feature


def test_torch_runner_subclass_refuses_unbuilt_features(tmp_path):
    overrides = {"fsdp.enabled": True, "compile.memory_policy": "default", "parallel.axes.shard": -1}
    with pytest.raises(ValueError) as error:
        TinyRunner(tiny_config(tmp_path, **overrides))
    message = str(error.value)
    for key, value in overrides.items():
        assert f"config.{key}={value!r} is not available yet" in message
    assert "which TinyRunner does not implement" in message
    assert list(tmp_path.iterdir()) == []


def test_supported_features_are_inherited_and_lift_the_check():
    class ShardedRunner(BaseRunner):
        supported_features = frozenset({"fsdp", "parallel"})

    class ProfiledShardedRunner(ShardedRunner):
        supported_features = frozenset({"profiling"})

    config = RunnerConfig(**{"fsdp.enabled": True, "parallel.axes.shard": 2, "profiling.enabled": True})
    RunnerConfig.check_runner(config, ProfiledShardedRunner)
    with pytest.raises(ValueError, match=r"profiling\.enabled=True .*'profiling' feature, which ShardedRunner"):
        RunnerConfig.check_runner(config, ShardedRunner)


def test_ddp_options_reach_only_runners_that_wrap_in_ddp():
    from danling.distributed import ddp_options
    from danling.distributed.fsdp import wrap_data_parallel
    from danling.runners import DeepSpeedRunner
    from danling.runners.config_sections import FsdpConfig

    config = RunnerConfig(**{"ddp.find_unused_parameters": True, "ddp.bucket_cap_mb": 50.0})
    assert ddp_options(config) == {"find_unused_parameters": True, "bucket_cap_mb": 50.0}
    assert ddp_options(RunnerConfig()) == {}  # DDP's own defaults: nothing passed
    RunnerConfig.check_runner(config, TorchRunner)
    with pytest.raises(ValueError, match=r"ddp\.find_unused_parameters=True .*'ddp' feature, which DeepSpeedRunner"):
        RunnerConfig.check_runner(config, DeepSpeedRunner)  # the engine synchronises gradients itself
    with pytest.raises(ValueError, match=r"config\.ddp\.bucket_cap_mb must be a positive number of MiB or None, got 0"):
        ddp_options({"ddp": {"bucket_cap_mb": 0}})
    with pytest.raises(ValueError, match=r"config\.ddp sets \['find_unused_parameters'\].* fsdp\.enabled shards"):
        wrap_data_parallel(
            torch.nn.Linear(2, 2),
            None,
            FsdpConfig(enabled=True),
            precision=None,
            device=torch.device("cpu"),
            distributed=True,
            compile=lambda module, distributed: module,
            ddp={"find_unused_parameters": True},
        )
