from __future__ import annotations

import json
import pickle
import re
import subprocess
import sys
import textwrap

import pytest
import yaml
from chanfig import Config
from hypothesis import given, settings
from hypothesis import strategies as st

from danling.runners._config_refs import references_yaml
from danling.runners.config import CheckpointConfig, DataloaderConfig, RunnerConfig
from tests.runners._torch_toy import TinyRunner, tiny_config

# Every key of the reference RunnerConfig table (plus the runner-property keys) with its default.
REFERENCE_DEFAULTS = {
    "stack": "auto",
    "seed": None,
    "deterministic": False,
    "steps": None,
    "epochs": None,
    "accum_steps": 1,
    "precision": None,
    "max_grad_norm": None,
    "max_grad_value": None,
    "skip_nonfinite_grad": False,
    "score_split": None,
    "score_name": "loss",
    "scheduler.interval": None,
    "scheduler.monitor": None,
    "optim.param_groups": None,
    "workspace_root": "experiments",
    "lineage": "lin",
    "experiment": "exp",
    "resume": None,
    "auto_resume": False,
    "pretrained": None,
    "log": True,
    "log_interval": None,
    "tensorboard": False,
    "checkpoint.dir_name": "checkpoints",
    "checkpoint.async_enabled": True,
    "checkpoint.async_mode": None,
    "checkpoint.dedicated_async_process_group": True,
    "checkpoint.async_process_group_backend": "gloo",
    "checkpoint.backend": "auto",
    "checkpoint.interval": None,
    "checkpoint.keep_latest_k": 0,
    "checkpoint.load_only": False,
    "checkpoint.enable_ft_dataloader_checkpoints": False,
    "checkpoint.ft_replica_id": None,
    "checkpoint.ft_dataloader_checkpoint_prefix": "ft-replica",
    "checkpoint.exclude_from_loading": [],
    "checkpoint.last_save_model_only": False,
    "checkpoint.export_dtype": None,
    "dataloader.batch_size": None,
    "dataloader.shuffle": None,
    "dataloader.drop_last": None,
    "dataloader.num_workers": 0,
    "dataloader.persistent_workers": False,
    "dataloader.prefetch_factor": None,
    "dataloader.pin_memory": False,
    "dataloader.in_order": True,
    "wandb.enabled": False,
    "wandb.project": None,
    "wandb.entity": None,
    "wandb.group": None,
    "wandb.name": None,
    "wandb.job_type": None,
    "wandb.tags": None,
    "wandb.dir": None,
    "wandb.mode": None,
    "ft.enabled": False,
    "ft.process_group": "gloo",
    "ft.process_group_timeout_ms": 10000,
    "ft.replica_id": 0,
    "ft.group_size": 1,
    "ft.min_replica_size": 1,
    **{f"parallel.axes.{axis}": 1 for axis in ("replicate", "shard", "context", "pipeline", "tensor", "expert")},
    "parallel.axes.expert_tensor": 1,
    "parallel.pipeline_schedule": "1F1B",
    "parallel.pipeline_microbatch_size": 1,
    "parallel.pipeline_n_microbatches": None,
    "parallel.module_fqns_per_model_part": None,
    "fsdp.enabled": False,
    "fsdp.reshard_after_forward": None,
    "fsdp.mp_policy": None,
    "fsdp.offload_policy": None,
    "compile.enable": False,
    "compile.optimize_ddp": None,
    "compile.precompile_artifact_dir": None,
    "compile.memory_policy": None,
    "comm.init_timeout_seconds": None,
    "comm.train_timeout_seconds": None,
    "gc.interval": None,
    "gc.generation": 1,
    "gc.disable_automatic": True,
    "profiling.enabled": False,
    "profiling.wait": 1,
    "profiling.warmup": 1,
    "profiling.active": 3,
    "profiling.repeat": None,
    "profiling.record_shapes": False,
    "profiling.profile_memory": False,
    "profiling.with_stack": False,
    "profiling.with_flops": False,
    "profiling.trace_dir": "profiles",
    "heartbeat.enabled": False,
    "heartbeat.interval_seconds": 60.0,
    "heartbeat.dir_name": "heartbeats",
}


def test_every_reference_key_has_its_documented_default():
    flat = RunnerConfig().dict(flatten=True)
    missing = sorted(set(REFERENCE_DEFAULTS) - set(flat))
    assert not missing, f"keys missing from RunnerConfig: {missing}"
    wrong = {key: (flat[key], default) for key, default in REFERENCE_DEFAULTS.items() if flat[key] != default}
    assert not wrong, f"(actual, documented) defaults differ: {wrong}"


def test_instances_do_not_share_mutable_defaults():
    first, second = RunnerConfig(), RunnerConfig()
    first.checkpoint.exclude_from_loading.append("optimizer")
    first.parallel.axes.shard = 4
    assert second.checkpoint.exclude_from_loading == []
    assert second.parallel.axes.shard == 1
    assert isinstance(second.checkpoint, CheckpointConfig)


SCRIPT = textwrap.dedent(
    """
    import json
    import sys

    from chanfig import Config

    from danling.runners.config import RunnerConfig


    class TrainConfig(RunnerConfig):
        epochs: int = 100
        batch_size: int = 32
        learning_rate: float = 0.001
        dropout: float = 0.1
        network: Config = Config()  # a free-form section: any key below it

        def __init__(self):
            super().__init__()
            self.network.type = "mlp"
            self.optim.type = "adamw"

        def post(self):
            super().post()
            self.experiment = f"{self.network.type}-bs{self.batch_size}-lr{self.learning_rate}"


    config = TrainConfig().parse(sys.argv[1:])
    print(json.dumps({
        "config": config.dict(),
        "config_id": config.config_id,
        "types": {key: type(config[key]).__name__ for key in ("epochs", "batch_size", "learning_rate", "steps")},
        "section_type": type(config.checkpoint).__name__,
    }))
    """
)


def test_parse_yaml_file_and_cli_overrides_in_a_subprocess(tmp_path):
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    config_file = tmp_path / "exp.yaml"
    config_file.write_text(
        yaml.safe_dump(
            {
                "epochs": 7,
                "batch_size": 16,
                "learning_rate": 0.5,
                "network": {"type": "resnet"},
                "checkpoint": {"interval": 2},
                "dataloader": {"num_workers": 2, "val": {"batch_size": 64}},
                "optim": {"lr": 0.1, "weight_decay": 0.01},
            }
        )
    )
    args = ["--config", str(config_file), "--batch_size", "64", "--optim.lr", "3e-4", "--steps", "100"]
    args += ["--precision", "BF16", "--wandb.tags", "a", "b", "--dataloader.train.shuffle", "false"]
    result = subprocess.run(
        [sys.executable, str(script), *args], capture_output=True, text=True, timeout=120, cwd=tmp_path
    )
    assert result.returncode == 0, result.stderr
    output = json.loads(result.stdout.strip().splitlines()[-1])
    config = output["config"]
    assert config["epochs"] == 7 and config["learning_rate"] == 0.5  # file over class defaults
    assert config["batch_size"] == 64 and config["optim"]["lr"] == 3e-4  # CLI over file
    assert config["optim"]["weight_decay"] == 0.01 and config["optim"]["type"] == "adamw"  # merged, not replaced
    assert config["dropout"] == 0.1 and config["steps"] == 100
    assert config["experiment"] == "resnet-bs64-lr0.5"  # post() saw the final values
    assert config["checkpoint"]["interval"] == 2 and config["checkpoint"]["dir_name"] == "checkpoints"
    assert config["dataloader"]["val"]["batch_size"] == 64 and config["dataloader"]["num_workers"] == 2
    assert config["dataloader"]["train"]["shuffle"] is False
    assert config["precision"] == "bf16" and config["wandb"]["tags"] == ["a", "b"]
    assert "config" not in config  # the file path is not a config key
    assert output["types"] == {"epochs": "int", "batch_size": "int", "learning_rate": "float", "steps": "int"}
    assert output["section_type"] == "CheckpointConfig"

    # the id is a content hash: the same config built in this process hashes identically
    class Same(RunnerConfig):  # the script's keys, declared here too
        batch_size: int = 32
        learning_rate: float = 0.001
        dropout: float = 0.1
        network: Config = Config()

    assert Same(config).config_id == output["config_id"]


def test_parse_json_file_equals_form_and_file_order(tmp_path):
    first, second = tmp_path / "a.json", tmp_path / "b.yml"
    first.write_text(json.dumps({"epochs": 3, "optim": {"lr": 0.1}, "seed": 5}))
    second.write_text("epochs: 4\n")
    config = RunnerConfig().parse([f"--config={first}", "--config", str(second), "--seed", "9"])
    assert (config.epochs, config.optim.lr, config.seed) == (4, 0.1, 9)


def test_parse_types_annotated_cli_values():
    config = RunnerConfig(seed=3).parse(
        ["--seed", "none", "--deterministic", "true", "--train_splits", "train", "extra", "--max_grad_norm", "1"]
        + ["--checkpoint.exclude_from_loading", "lr_scheduler", "optimizer.state", "--parallel.axes.shard", "-1"]
        + ["--compile.options", "{'max_autotune': True}"]
    )
    assert config.seed is None and config.deterministic is True
    assert config.train_splits == ["train", "extra"]
    assert config.max_grad_norm == 1.0 and isinstance(config.max_grad_norm, float)
    assert config.checkpoint.exclude_from_loading == ["scheduler", "optimizer.state"]
    assert config.parallel.axes.shard == -1
    assert dict(config.compile.options) == {"max_autotune": True}


@pytest.mark.parametrize(
    ("content", "name", "error", "match"),
    [
        (None, "missing.yaml", ValueError, "missing.yaml' does not exist"),  # one line, exit 2
        ("epochs: 1", "exp.ini", ValueError, r"must end in \.yaml, \.yml, \.json or \.toml"),
        ("- 1\n- 2\n", "list.yaml", ValueError, "must hold a mapping"),
        ("epochs: [1", "broken.yaml", ValueError, "cannot read config file"),
    ],
)
def test_parse_reports_bad_config_files(tmp_path, content, name, error, match):
    path = tmp_path / name
    if content is not None:
        path.write_text(content)
    with pytest.raises(error, match=match) as info:
        RunnerConfig().parse(["--config", str(path)])
    assert "\n" not in str(info.value)  # one line on stderr, whatever the parser said


def test_parse_names_a_directory_given_as_config_file(tmp_path, capsys):
    with pytest.raises(SystemExit) as info:
        RunnerConfig().parse(["--config", str(tmp_path)])
    assert info.value.code == 2 and f"config file '{tmp_path}' is not a file" in capsys.readouterr().err


def test_parse_says_to_repeat_config_before_a_second_file(tmp_path, capsys):
    # The usage line read "[--config FILE ...]", and a second file was then a stray argument.
    first, second = tmp_path / "a.yaml", tmp_path / "b.yaml"
    first.write_text("epochs: 2\n")
    second.write_text("seed: 3\n")
    with pytest.raises(SystemExit) as info:
        RunnerConfig().parse(["--config", str(first), str(second)])
    assert info.value.code == 2 and "repeat --config before each file" in capsys.readouterr().err
    config = RunnerConfig().parse(["--config", str(first), "--config", str(second)])
    assert config.epochs == 2 and config.seed == 3
    with pytest.raises(SystemExit):
        RunnerConfig().parse(["--help"])
    assert "usage: " in (usage := capsys.readouterr().out) and "[--config FILE]... [--KEY VALUE]..." in usage


def test_parse_requires_a_path_after_config_flag():
    with pytest.raises(ValueError, match="--config needs a file path"):
        RunnerConfig().parse(["--config", "--epochs", "3"])


def test_empty_config_file_changes_nothing(tmp_path):
    path = tmp_path / "empty.yaml"
    path.write_text("")
    assert RunnerConfig().parse(["--config", str(path)]).dict() == RunnerConfig().boot().dict()


def test_post_override_without_super_still_validates_and_normalises():
    class Quiet(RunnerConfig):
        def post(self):
            self.steps = 10

    config = Quiet().parse(["--precision", "float16", "--stack", "DDP"])
    assert (config.steps, config.precision, config.stack) == (10, "fp16", "ddp")

    class Broken(RunnerConfig):
        def post(self):
            self.accum_steps = 0

    with pytest.raises(ValueError, match="accum_steps must be an integer >= 1"):
        Broken().parse([])


def test_after_boot_missing_keys_raise_and_get_returns_default():
    config = RunnerConfig().parse([])
    with pytest.raises(AttributeError):
        config.network  # noqa: B018
    assert config.get("sched") is config.scheduler  # an alias reads the section it names
    assert "sched" not in config


@pytest.mark.parametrize(
    ("overrides", "match"),
    [
        ({"stack": "jax"}, r"config.stack='jax' is not a known stack; expected one of: auto, ddp, torch, graph"),
        ({"steps": -1}, r"config.steps must be an integer >= 0 or None, got -1"),
        ({"epochs": -2}, r"config.epochs must be an integer >= 0 or None, got -2"),
        ({"accum_steps": 0}, r"config.accum_steps must be an integer >= 1, got 0"),
        ({"precision": "fp4"}, r"config.precision='fp4' is not supported; expected None or one of: fp32"),
        ({"max_grad_norm": 0}, r"config.max_grad_norm must be a number > 0 or None, got 0"),
        ({"log_interval": -1}, r"config.log_interval must be an integer >= 0 or None"),
        ({"scheduler.interval": "batch"}, r"config.scheduler.interval='batch' is not supported"),
        ({"checkpoint.backend": "s3"}, r"config.checkpoint.backend='s3' is not supported.*dcp"),
        ({"dataloader.val.batch_size": 0}, r"config.dataloader.val.batch_size must be an integer >= 1"),
        ({"parallel.axes.shard": 0}, r"config.parallel.axes.shard must be an integer >= 1, or -1"),
        ({"parallel.axes.shard": -1, "parallel.axes.tensor": -1}, r"at most one .* -1, got -1 for: shard, tensor"),
        ({"lineage": "../escape"}, r"config.lineage must be a non-empty relative name without '..'"),
        ({"gc.generation": 3}, r"config.gc.generation=3 is not supported; expected None or one of: 0, 1, 2"),
        # A negative peak printed a negative MFU in every step log; a bad interval failed only at infer().
        ({"telemetry.peak_tflops": -1}, r"config.telemetry.peak_tflops must be a number > 0 or None, got -1"),
        ({"inference.progress_interval": 0}, r"config.inference.progress_interval must be an integer >= 1, got 0"),
    ],
)
def test_validation_errors_name_the_value_and_what_is_accepted(overrides, match):
    with pytest.raises(ValueError, match=match):
        RunnerConfig(**overrides)
    config = RunnerConfig()
    with pytest.raises(ValueError, match=match):
        config.merge(overrides).validate()


def test_training_validation_requires_a_budget():
    with pytest.raises(ValueError, match="set config.epochs or config.steps"):
        RunnerConfig().validate(training=True)
    RunnerConfig(epochs=0).validate(training=True)
    RunnerConfig(steps=10).validate(training=True)


def test_annotations_are_inherited_by_subclasses():
    class Sub(RunnerConfig):
        width: int = 8

    config = Sub(epochs="3", width="16", seed=1.0)
    assert (config.epochs, config.width, config.seed) == (3, 16, 1)
    with pytest.raises(ValueError, match=r"config\.score_name=None is not accepted: expected a string, not None"):
        Sub(score_name=None)


def test_register_stack_is_per_class():
    class Custom(RunnerConfig):
        pass

    assert Custom.register_stack(" TPU ") == "tpu"
    assert Custom(stack="tpu").stack == "tpu"
    with pytest.raises(ValueError, match="'tpu' is not a known stack"):
        RunnerConfig(stack="tpu")
    with pytest.raises(ValueError, match="non-empty string"):
        Custom.register_stack("")


def test_dataloader_kwargs_merge_split_overrides():
    loader = RunnerConfig(
        **{"dataloader.batch_size": 8, "dataloader.num_workers": 2, "dataloader.val.batch_size": 32}
    ).dataloader
    assert isinstance(loader, DataloaderConfig)
    train = loader.kwargs("train", train=True)
    assert train["batch_size"] == 8 and train["shuffle"] is True and train["drop_last"] is True
    assert "prefetch_factor" not in train and "val" not in train
    val = loader.kwargs("val", train=False)
    assert (val["batch_size"], val["num_workers"], val["shuffle"], val["drop_last"]) == (32, 2, False, False)


def test_config_id_ignores_paths_and_runtime_noise_but_not_semantics():
    base = RunnerConfig(epochs=5, **{"optim.lr": 0.1})
    noisy = RunnerConfig(
        epochs=5,
        workspace_root="/elsewhere",
        lineage="other",
        experiment="renamed",
        resume="ckpt/latest",
        auto_resume=True,
        log_interval=7,
        **{"optim.lr": 0.1, "checkpoint.interval": 3, "wandb.enabled": True, "dataloader.num_workers": 8},
        **{"watchdog.timeout_seconds": 30.0, "inference.output": "scores.jsonl", "heartbeat.interval_seconds": 5.0},
    )
    assert base.config_id == noisy.config_id
    assert base.config_id != RunnerConfig(epochs=5, **{"optim.lr": 0.2}).config_id
    assert base.config_id != RunnerConfig(epochs=5, seed=1, **{"optim.lr": 0.1}).config_id
    touched = RunnerConfig(epochs=5, **{"optim.lr": 0.1})
    touched.network  # noqa: B018 - auto-creates an empty section
    assert touched.config_id == base.config_id


@settings(max_examples=30, deadline=None)
@given(
    st.dictionaries(
        st.text("abcdefgh", min_size=1, max_size=4),
        st.one_of(st.integers(-5, 5), st.floats(allow_nan=False, width=32), st.text(max_size=5), st.booleans()),
        min_size=1,
        max_size=6,
    )
)
def test_config_id_does_not_depend_on_insertion_order(values):
    class ModelConfig(RunnerConfig):
        model: dict = {}  # a free-form section

    forward = ModelConfig(model=dict(values))
    backward = ModelConfig(model=dict(reversed(list(values.items()))))
    assert forward.config_id == backward.config_id


@pytest.mark.parametrize("suffix", ["yaml", "json"])
def test_dump_and_load_round_trip(tmp_path, suffix):
    config = RunnerConfig(
        epochs=2, precision="bf16", **{"optim.lr": 0.01, "dataloader.val.batch_size": 4, "wandb.tags": ["x"]}
    ).boot()
    path = tmp_path / f"config.{suffix}"
    config.dump(path)
    loaded = RunnerConfig.load(path)
    assert loaded.dict() == config.dict()
    assert loaded.config_id == config.config_id
    assert isinstance(loaded.checkpoint, CheckpointConfig) and isinstance(loaded.dataloader, DataloaderConfig)


def test_load_reads_a_file_as_the_command_line_does(tmp_path, monkeypatch):
    monkeypatch.setenv("DANLING_TEST_TOKEN", "s3cr3t")
    path = tmp_path / "exp.yaml"
    path.write_text("wandb:\n  entity: !env DANLING_TEST_TOKEN\noptim:\n  lr: 1e-3\n")
    loaded, parsed = RunnerConfig.load(path), RunnerConfig().parse(["--config", str(path)])
    assert loaded.optim.lr == parsed.optim.lr == 0.001  # YAML 1.1 alone reads the string "1e-3"
    assert loaded.wandb.entity == "s3cr3t"
    assert "s3cr3t" not in references_yaml(loaded, loaded.dict())  # recorded as the reference, like --config
    path.write_text("epochs: 2\naccum_steps: 1.5\n")
    with pytest.raises(ValueError, match=rf"config\.accum_steps=1\.5 \(from {re.escape(str(path))}:2\)"):
        RunnerConfig.load(path)


def test_parsed_config_pickles():
    config = RunnerConfig().parse(["--epochs", "2", "--optim.lr", "0.1"])
    restored = pickle.loads(pickle.dumps(config))
    assert restored.dict() == config.dict() and restored.config_id == config.config_id


@pytest.mark.parametrize("section", ["scheduler", "sched"])
def test_scheduler_interval_is_validated_in_both_section_names(section):
    # Regression: the `sched` alias escaped validation; it is renamed to `scheduler` on input now.
    with pytest.raises(ValueError, match=r"config\.scheduler\.interval='epcoh'"):
        RunnerConfig(**{f"{section}.interval": "epcoh"}).validate()


def test_checkpoint_backend_is_read_in_any_case(tmp_path):
    from danling.checkpoint import FileCheckpointManager

    config = RunnerConfig(**{"checkpoint.backend": "DCP"}).boot()
    assert config.checkpoint.backend == "dcp"
    built = RunnerConfig(**tiny_config(tmp_path / "a", **{"checkpoint.backend": "FILE"}))
    with TinyRunner(built) as runner:  # a config object the caller built (validated, not booted)
        assert runner.config.checkpoint.backend == "file"
        assert isinstance(runner.checkpoint_manager, FileCheckpointManager)
    with pytest.raises(ValueError, match="checkpoint.backend='tape'"):
        RunnerConfig(**{"checkpoint.backend": "tape"}).boot()
