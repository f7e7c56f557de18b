"""Strict keys, `--help`, `--print-config` and exit status 2 for bad command lines."""

import re
import subprocess
import sys
import textwrap

import pytest
import yaml
from chanfig import Config

from danling.runners import RunnerConfig
from danling.runners.config import recorded_config


class UserConfig(RunnerConfig):
    """A user's config.

    Attributes:
        hidden: Width of the hidden layer.
        network: Model options, any key.
    """

    hidden: int = 64
    network: Config = Config()


def _exit(capsys, config, args):
    with pytest.raises(SystemExit) as info:
        config.parse(args)
    return info.value, capsys.readouterr()


def test_unknown_top_level_key_from_python_raises_with_suggestion():
    with pytest.raises(ValueError, match=r"config\.epoch is not a key of the config; did you mean epochs\?"):
        RunnerConfig(epoch=3)
    with pytest.raises(ValueError, match=r"config\.hiden .*did you mean hidden\?"):
        UserConfig(hiden=3)
    config = UserConfig(hidden=3, **{"network.type": "mlp", "network.blocks.depth": 2})
    assert config.hidden == 3 and config.network.blocks.depth == 2  # declared keys and a free-form section


def test_unknown_key_assigned_in_python_fails_validation():
    config = RunnerConfig()
    config.batch_size = 32  # meant dataloader.batch_size, the one the loaders read
    with pytest.raises(
        ValueError, match=r"config\.batch_size is not a key of the config; did you mean dataloader\.batch_size\?"
    ):
        config.validate()


def test_yaml_typo_names_the_file_the_key_and_the_closest_key(tmp_path, capsys):
    path = tmp_path / "exp.yaml"
    path.write_text("epochs: 2\nhiden: 3\n")
    error, streams = _exit(capsys, UserConfig(), ["--config", str(path)])
    assert error.code == 2 and isinstance(error, ValueError)
    assert f"in config file {str(path)!r}" in str(error) and "config.hiden" in str(error)
    assert "did you mean hidden?" in streams.err


def test_cli_typo_exits_2_naming_the_command_line(capsys):
    error, streams = _exit(capsys, RunnerConfig(), ["--epoch", "1"])
    assert error.code == 2
    assert "--epoch on the command line" in streams.err and "did you mean epochs?" in streams.err
    error, streams = _exit(capsys, RunnerConfig(), ["--checkpoint.intervall", "2"])
    assert error.code == 2 and "did you mean checkpoint.interval?" in streams.err
    error, streams = _exit(capsys, RunnerConfig(), ["--dataloader.val.batchsize", "2"])
    assert error.code == 2 and "dataloader.val.batch_size" in streams.err
    error, streams = _exit(capsys, RunnerConfig(), ["--batch_size", "2"])
    assert error.code == 2 and "did you mean dataloader.batch_size?" in streams.err


def test_free_form_keys_parse_without_typo_warnings(recwarn):
    config = UserConfig().parse(["--network.depth", "3", "--dataloader.val.batch_size", "4"])
    assert config.network.depth == 3 and config.dataloader.val.batch_size == 4
    assert not [warning for warning in recwarn if "Unrecognized argument" in str(warning.message)]


def test_free_form_boolean_words_read_on_the_command_line_as_in_a_yaml_file(tmp_path):
    path = tmp_path / "exp.yaml"
    path.write_text("network:\n  a: yes\n  b: off\n  c: On\n  d: NO\n")
    from_file = UserConfig().parse(["--config", str(path)]).network.dict()
    args = ["--network.a", "yes", "--network.b", "off", "--network.c", "On", "--network.d", "NO"]
    assert UserConfig().parse(args).network.dict() == from_file == {"a": True, "b": False, "c": True, "d": False}
    # the string "off" is true: it switched amsgrad on
    assert RunnerConfig().parse(["--optim.type", "adamw", "--optim.amsgrad", "off"]).optim.amsgrad is False


def test_a_dataloader_split_named_with_a_dash_keeps_its_name_on_the_command_line(tmp_path):
    # option names read dashes as underscores (--max-grad-norm); a split's name is the dataset's, as in a file
    args = ["--dataloader.val-hard.batch_size", "3", "--dataloader.val-hard.pin-memory=true", "--max-grad-norm", "1"]
    config = RunnerConfig().parse([*args, "--evaluate-splits", "val-hard"])
    assert config.dataloader.kwargs("val-hard", train=False)["batch_size"] == 3
    assert config.dataloader.kwargs("val-hard", train=False)["pin_memory"] is True
    assert "val_hard" not in config.dataloader and config.max_grad_norm == 1.0
    path = tmp_path / "exp.yaml"
    path.write_text("dataloader:\n  val-hard:\n    batch_size: 3\n")
    assert RunnerConfig().parse(["--config", str(path)]).dataloader.dict() == config.dataloader.dict() | {
        "val-hard": {"batch_size": 3}
    }


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        (
            ["--epochs", "x"],
            "config.epochs='x' (from --epochs on the command line) is not accepted: expected an integer",
        ),
        (
            ["--deterministic", "maybe"],
            "config.deterministic='maybe' (from --deterministic on the command line) is not accepted: "
            "expected a boolean: true/false, yes/no, on/off or 1/0",
        ),
        (["--score_mode", "best"], "config.score_mode='best' is not supported; expected None or one of: min, max"),
        (["--accum_steps", "0"], "config.accum_steps must be an integer >= 1, got 0"),
    ],
)
def test_bad_cli_value_exits_2_with_one_message(capsys, args, expected):
    error, streams = _exit(capsys, RunnerConfig(), args)
    assert error.code == 2
    assert expected in streams.err and "usage:" not in streams.err and len(streams.err.strip().splitlines()) == 1


def test_free_form_sections_and_declared_keys_parse():
    config = UserConfig().parse(["--network.depth", "3", "--hidden", "5", "--optim.betas", "0.9", "0.99"])
    assert config.network.depth == 3 and config.hidden == 5 and config.optim.betas == [0.9, 0.99]


def test_python_construction_still_raises_value_error_not_exit():
    with pytest.raises(ValueError) as info:
        RunnerConfig(score_mode="best")
    assert not isinstance(info.value, SystemExit)


def test_help_lists_every_key_with_type_default_and_description(capsys):
    with pytest.raises(SystemExit) as info:
        UserConfig().parse(["--help"])
    assert info.value.code == 0
    out = capsys.readouterr().out
    assert "--config FILE" in out and "--print-config" in out
    assert "--epochs int | None (default: None)\n      Epoch budget" in out
    assert "--hidden int (default: 64)\n      Width of the hidden layer." in out
    assert "--network Config (default: {}) [free-form: any key below it]" in out
    assert "\ncheckpoint:\n" in out and "--checkpoint.keep_latest_k int (default: 0)\n      Keep only" in out
    assert "--parallel.axes.shard int (default: 1)\n      Data-parallel shards" in out
    assert "OPTIM [OPTIM ...]" not in out and "--optim " not in out  # sections are groups, not list options
    listed = [line for line in out.splitlines() if line.startswith("  --") and "." in line.split()[0]]
    flat = UserConfig().dict(flatten=True)
    assert {line.split()[0][2:] for line in listed} >= {key for key in flat if key.startswith("checkpoint.")}
    for index, line in enumerate(out.splitlines()):  # every key has a description under it
        if line.startswith("  --") and "(default:" in line:
            assert out.splitlines()[index + 1].startswith("      "), line


def test_print_config_prints_merged_yaml_and_exits_0(tmp_path, capsys):
    path = tmp_path / "exp.yaml"
    path.write_text("epochs: 2\ndataloader:\n  batch_size: 16\n")
    with pytest.raises(SystemExit) as info:
        UserConfig().parse(["--config", str(path), "--hidden", "8", "--network.type", "mlp", "--print-config"])
    assert info.value.code == 0
    printed = yaml.safe_load(capsys.readouterr().out)
    assert printed["epochs"] == 2 and printed["dataloader"]["batch_size"] == 16
    assert printed["hidden"] == 8 and printed["network"] == {"type": "mlp"} and printed["stack"] == "auto"


class DerivedConfig(RunnerConfig):
    """A config whose `post()` creates keys."""

    hidden: int = 4

    def post(self):
        super().post()
        self.derived.width = self.hidden * 2
        self.tag = f"h{self.hidden}"


def test_the_printed_config_of_a_post_that_creates_keys_reads_back_with_config(tmp_path, capsys):
    # post() runs after files and flags are merged, yet the keys it creates are declarations, and the
    # printed config (like the run's config.yaml) holds them
    with pytest.raises(SystemExit):
        DerivedConfig().parse(["--hidden", "8", "--print-config"])
    path = tmp_path / "printed.yaml"
    path.write_text(capsys.readouterr().out)
    config = DerivedConfig().parse(["--config", str(path)])
    assert (config.hidden, config.derived.width, config.tag) == (8, 16, "h8")
    error, streams = _exit(capsys, DerivedConfig(), ["--derived.widht", "3"])
    assert error.code == 2 and "did you mean derived.width?" in streams.err


def test_recorded_config_keeps_a_subclass_keys_but_checks_sections():
    assert recorded_config({"hidden": 3, "epochs": 1}).hidden == 3
    with pytest.raises(ValueError, match=r"did you mean checkpoint\.interval"):
        recorded_config({"checkpoint": {"intervall": 3}})


SCRIPT = textwrap.dedent(
    """
    from danling.runners import RunnerConfig

    RunnerConfig().parse()
    print("parsed")
    """
)


def test_script_with_bad_value_exits_2_without_traceback(tmp_path):
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    done = subprocess.run(
        [sys.executable, str(script), "--epochs", "x"], capture_output=True, text=True, timeout=120, cwd=tmp_path
    )
    assert done.returncode == 2 and "parsed" not in done.stdout
    assert done.stderr == (
        "train.py: error: config.epochs='x' (from --epochs on the command line) is not accepted: "
        "expected an integer, or none/null to unset it\n"
    )


def test_print_config_keeps_env_references_unresolved(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("DANLING_STRICT_SECRET", "s3cr3t")
    path = tmp_path / "exp.yaml"
    path.write_text("wandb:\n  entity: !env DANLING_STRICT_SECRET\n")
    with pytest.raises(SystemExit) as info:
        RunnerConfig().parse(["--config", str(path), "--print-config"])
    out = capsys.readouterr().out
    assert info.value.code == 0 and "s3cr3t" not in out
    assert re.search(r"^  entity: !env '?DANLING_STRICT_SECRET'?$", out, re.MULTILINE)


def test_a_missing_config_file_is_one_line_and_exit_2(tmp_path):
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    done = subprocess.run(
        [sys.executable, str(script), "--config", "missing.yaml"],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=tmp_path,
    )
    assert done.returncode == 2 and done.stderr == "train.py: error: config file 'missing.yaml' does not exist\n"


def test_an_optim_key_the_optimizer_does_not_take_fails_at_parse_time_naming_the_closest(capsys):
    error, streams = _exit(capsys, RunnerConfig(), ["--optim.type", "adamw", "--optim.lrr", "0.1"])
    assert error.code == 2 and len(streams.err.strip().splitlines()) == 1
    assert "config.optim.lrr is not an argument of optimizer 'adamw'; did you mean optim.lr?" in streams.err
    with pytest.raises(ValueError, match=r"config\.optim\.type='adamm' is not an optimizer.*registered: .*adamw"):
        RunnerConfig(**{"optim.type": "adamm"})
    config = RunnerConfig().parse(["--optim.type", "sgd", "--optim.lr", "0.1", "--optim.momentum", "0.9"])
    assert config.optim.momentum == 0.9


def test_an_optim_value_that_is_not_a_number_fails_at_parse_time_naming_it(capsys):
    # `--optim.lr abc` used to pass parsing and fail at the optimizer's first comparison ('<' between str and int).
    error, streams = _exit(capsys, RunnerConfig(), ["--optim.type", "adamw", "--optim.lr", "abc"])
    assert error.code == 2 and len(streams.err.strip().splitlines()) == 1
    assert (
        "config.optim.lr='abc' is not a number: optimizer 'adamw' takes a number for lr (default 0.001)" in streams.err
    )
    with pytest.raises(ValueError, match=r"config\.optim\.weight_decay=True is not a number"):
        RunnerConfig(**{"optim.type": "adamw", "optim.weight_decay": True})
    assert RunnerConfig().parse(["--optim.type", "adamw", "--optim.lr", "3e-4"]).optim.lr == 3e-4


def test_help_lists_the_configured_optimizers_arguments_with_defaults(capsys):
    class SgdConfig(RunnerConfig):
        def __init__(self):
            super().__init__()
            self.optim.type = "sgd"

    with pytest.raises(SystemExit):
        SgdConfig().parse(["--help"])
    out = capsys.readouterr().out
    assert "arguments of optimizer 'sgd'" in out and "--optim.momentum (default: 0)" in out
    assert "--optim.nesterov (default: False)" in out
