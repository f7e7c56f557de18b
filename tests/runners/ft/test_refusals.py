"""What `ft.enabled` refuses before training, each with one line naming the key."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from danling.runners import RunnerConfig
from danling.runners.ft import FT_REPLICA_ID_ENV, LIGHTHOUSE_ENV, check_fault_tolerance
from tests.runners._torch_toy import TinyRunner, tiny_config

pytest.importorskip("torchft")

DDP = {"replicate": 1, "shard": 1, "context": 1, "pipeline": 1, "tensor": 1, "expert": 1}


def _section(**keys):
    return RunnerConfig(**{"ft.enabled": True, **{f"ft.{key}": value for key, value in keys.items()}}).ft


@pytest.mark.parametrize(
    ("keys", "message"),
    [
        ({"group_size": 2, "replica_id": 2}, r"ft.replica_id=2 must be in \[0, ft.group_size=2\)"),
        ({"group_size": 2, "min_replica_size": 3}, r"ft.min_replica_size=3 must be in \[1, ft.group_size=2\]"),
    ],
)
def test_bad_ft_values_are_refused_naming_the_key(keys, message):
    with pytest.raises(ValueError, match=message):
        check_fault_tolerance(_section(**keys), DDP)


@pytest.mark.parametrize(
    ("key", "value", "message"),
    [
        ("group_size", 0, "config.ft.group_size must be an integer >= 1"),
        ("process_group_timeout_ms", 0, "config.ft.process_group_timeout_ms must be an integer >= 1"),
        ("process_group", "mpi", "config.ft.process_group='mpi' is not supported; expected None or one of: gloo, nccl"),
    ],
)
def test_the_config_refuses_values_out_of_range(key, value, message):
    with pytest.raises(ValueError, match=message):
        RunnerConfig(**{f"ft.{key}": value})


@pytest.mark.parametrize("axis", ["shard", "tensor", "pipeline", "context", "expert"])
def test_layouts_torchft_does_not_cover_are_refused(axis):
    with pytest.raises(ValueError, match=rf"covers replica groups of DDP .* this layout has \{{'{axis}': 2\}}"):
        check_fault_tolerance(_section(), {**DDP, axis: 2})
    check_fault_tolerance(_section(), {**DDP, "replicate": 2})  # DDP inside a replica group is covered


def test_no_lighthouse_address_is_refused_before_training(tmp_path, monkeypatch):
    monkeypatch.delenv(LIGHTHOUSE_ENV, raising=False)
    with pytest.raises(ValueError, match=rf"ft.enabled=True needs the lighthouse address in \${LIGHTHOUSE_ENV}"):
        TinyRunner(tiny_config(tmp_path, **{"ft.enabled": True}))


def test_deepspeed_refuses_ft():
    from danling.runners.deepspeed.runner import DeepSpeedRunner

    stub = SimpleNamespace(config=RunnerConfig(**{"ft.enabled": True}))
    with pytest.raises(ValueError, match="ft.enabled=True is not supported by DeepSpeedRunner"):
        DeepSpeedRunner.init_fault_tolerance(stub)
    DeepSpeedRunner.init_fault_tolerance(SimpleNamespace(config=RunnerConfig()))  # off: nothing to refuse


def test_dataloader_checkpoints_are_a_torch_runner_feature_that_needs_ft(tmp_path):
    config = RunnerConfig(**{"checkpoint.enable_ft_dataloader_checkpoints": True})
    RunnerConfig.check_runner(config, TinyRunner)  # the feature is built: the keys are no longer refused
    with pytest.raises(ValueError, match=r"enable_ft_dataloader_checkpoints=True needs ft.enabled=True"):
        TinyRunner(tiny_config(tmp_path / "off", **{"checkpoint.enable_ft_dataloader_checkpoints": True}))
    on = {"checkpoint.enable_ft_dataloader_checkpoints": True, "ft.enabled": True, "checkpoint.backend": "file"}
    with pytest.raises(ValueError, match=r"writes DCP checkpoints, but checkpoint.backend='file'; use 'auto' or 'dcp'"):
        TinyRunner(tiny_config(tmp_path / "file", **on))


def test_deepspeed_refuses_dataloader_checkpoints():
    from danling.runners.deepspeed.runner import DeepSpeedRunner

    stub = SimpleNamespace(config=RunnerConfig(**{"checkpoint.enable_ft_dataloader_checkpoints": True}))
    with pytest.raises(ValueError, match="enable_ft_dataloader_checkpoints=True is not supported by DeepSpeedRunner"):
        DeepSpeedRunner.init_fault_tolerance(stub)


@pytest.fixture
def lighthouse(monkeypatch):
    from torchft.coordination import LighthouseServer

    server = LighthouseServer(bind="[::]:0", min_replicas=1)
    monkeypatch.setenv(LIGHTHOUSE_ENV, server.address())
    yield server
    server.shutdown()


@pytest.mark.parametrize(
    ("keys", "env", "directory"),
    [
        ({"ft.replica_id": 1, "ft.group_size": 2}, None, "ft-replica-1"),
        ({"ft.replica_id": 1, "ft.group_size": 2}, "7", "ft-replica-7"),
        ({"checkpoint.ft_replica_id": "a", "checkpoint.ft_dataloader_checkpoint_prefix": "pos"}, "7", "pos-a"),
    ],
)
def test_the_runner_binds_a_torchft_checkpoint_manager(tmp_path, monkeypatch, lighthouse, keys, env, directory):
    from danling.checkpoint import TorchFTCheckpointManager

    if env is None:
        monkeypatch.delenv(FT_REPLICA_ID_ENV, raising=False)
    else:
        monkeypatch.setenv(FT_REPLICA_ID_ENV, env)
    overrides = {"ft.enabled": True, "checkpoint.enable_ft_dataloader_checkpoints": True, **keys}
    with TinyRunner(tiny_config(tmp_path, **overrides)) as runner:
        manager = runner.checkpoint_manager
        assert isinstance(manager, TorchFTCheckpointManager)  # backend 'auto' resolves to DCP for it
        assert manager.replica_directory == runner.workspace.checkpoint_dir.parent / directory
        assert runner.ft.positions is manager


def test_parallel_runner_covers_fsdp2_sharding_only():
    from danling.runners.parallel_runner import ParallelRunner

    check_fault_tolerance(_section(), {**DDP, "shard": 2}, sharded=True)  # HSDP: the groups replicate the shards
    check_fault_tolerance(_section(), {**DDP, "replicate": 2}, sharded=True)  # DDP inside a group
    sharded = r"covers replica groups of FSDP2 sharding .* this layout has "
    with pytest.raises(ValueError, match=sharded + r"\{'replicate': 2\}"):
        check_fault_tolerance(_section(), {**DDP, "shard": 2, "replicate": 2}, sharded=True)
    runner = object.__new__(ParallelRunner)  # unbuilt: the refusal needs only the class, the config and the layout
    runner.__dict__["config"] = RunnerConfig(**{"ft.enabled": True})
    runner.__dict__["topology"] = SimpleNamespace(degrees={**DDP, "shard": 2, "tensor": 2})
    with pytest.raises(ValueError, match=sharded + r"\{'tensor': 2\}"):
        runner.init_fault_tolerance()
