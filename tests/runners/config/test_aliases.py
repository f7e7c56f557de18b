"""Aliases are renamed on input (later sources win), and keys the author's code creates are declarations."""

import pytest
from chanfig import Config

from danling.runners import RunnerConfig
from tests.runners._torch_toy import TinyRunner, tiny_config


def test_an_alias_in_a_file_does_not_beat_the_canonical_key_on_the_command_line(tmp_path):
    path = tmp_path / "exp.yaml"
    path.write_text("sched:\n  type: step\n  step_size: 3\n")
    config = RunnerConfig().parse(["--config", str(path), "--scheduler.type", "cosine"])
    assert config.scheduler.type == "cosine" and config.scheduler.step_size == 3  # the later source wins
    assert "sched" not in config and "sched" not in config.dict()  # one name per section


def test_the_canonical_key_in_a_file_loses_to_the_alias_on_the_command_line(tmp_path):
    path = tmp_path / "exp.yaml"
    path.write_text("optim:\n  type: sgd\n  lr: 0.1\n")
    config = RunnerConfig().parse(["--config", str(path), "--optimizer.lr", "0.5"])
    assert config.optim.lr == 0.5 and config.optim.type == "sgd" and "optimizer" not in config.dict()


def test_what_is_recorded_is_what_is_trained(tmp_path, capsys):
    args = ["--optim.type", "sgd", "--optimizer.lr", "0.5"]
    with pytest.raises(SystemExit):  # both spellings in one source
        RunnerConfig().parse(args)
    assert "alias of optim" in capsys.readouterr().err
    config = RunnerConfig(**tiny_config(tmp_path)).parse(["--optimizer.lr", "0.5"])
    runner = TinyRunner(config)
    try:
        assert runner.optimizer.param_groups[0]["lr"] == 0.5
        assert runner.config.dict()["optim"]["lr"] == 0.5 and "optimizer" not in runner.config.dict()
    finally:
        runner.close()


@pytest.mark.parametrize(
    "overrides",
    [{"sched.type": "step", "scheduler.type": "cosine"}, {"optimizer": {"lr": 1}, "optim.lr": 2}],
)
def test_both_spellings_in_one_source_are_an_error(tmp_path, overrides):
    with pytest.raises(ValueError, match=r"is an alias of (scheduler|optim).*set twice in one source"):
        RunnerConfig(**overrides)
    path = tmp_path / "exp.yaml"
    path.write_text("sched:\n  type: step\nscheduler:\n  type: cosine\n")
    with pytest.raises(ValueError, match="set twice in one source"):
        RunnerConfig().parse(["--config", str(path)])


def test_an_alias_assigned_in_python_is_the_section():
    config = RunnerConfig()
    config.sched.type = "cosine"
    config["optimizer.lr"] = 0.3
    assert config.scheduler.type == "cosine" and config.optim.lr == 0.3
    assert "sched" not in config.dict() and "optimizer" not in config.dict()


# ------------------------------------------------------------------ declarations by the author's code


class NetConfig(RunnerConfig):
    """The reference's idiom: nested keys auto-created in `__init__`."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.network.type = "resnet50"
        self.network.encoder.depth = 4

    def post(self):
        super().post()
        self.network.width = self.network.encoder.depth * 16  # a key `post()` derives


def test_keys_created_in_init_and_post_are_declarations():
    config = NetConfig().parse(["--network.type", "resnet18", "--network.encoder.depth", "2"])
    assert config.network.type == "resnet18" and config.network.encoder.depth == 2 and config.network.width == 32


def test_input_is_checked_against_the_declared_keys(tmp_path, capsys):
    with pytest.raises(SystemExit) as info:
        NetConfig().parse(["--network.typ", "resnet18"])
    assert info.value.code == 2 and "did you mean network.type?" in capsys.readouterr().err
    path = tmp_path / "exp.yaml"
    path.write_text("network:\n  encoder:\n    dept: 2\n")
    with pytest.raises(ValueError, match=r"config\.network\.encoder\.dept .*did you mean network\.encoder\.depth\?"):
        NetConfig().parse(["--config", str(path)])
    with pytest.raises(ValueError, match=r"config\.netwrk is not a key"):
        NetConfig(netwrk={"type": "x"})


def test_help_lists_the_declared_keys(capsys):
    with pytest.raises(SystemExit):
        NetConfig().parse(["--help"])
    out = capsys.readouterr().out
    assert "--network.type str (default: 'resnet50')" in out and "--network.encoder.depth int (default: 4)" in out
    assert "any other --network" not in out  # input is checked against them


def test_a_key_assigned_outside_the_config_class_is_still_not_a_declaration():
    config = RunnerConfig()
    config.network.type = "resnet50"  # no class declares `network`: a typo would pass silently otherwise
    with pytest.raises(ValueError, match=r"config\.network is not a key"):
        config.validate()


def test_a_free_form_section_stays_free_form():
    class FreeConfig(RunnerConfig):
        network: Config = Config()

    assert FreeConfig().parse(["--network.anything", "1"]).network.anything == 1
