"""One value converter for every source: YAML and JSON files, `!include`, the command line, Python assignment."""

from __future__ import annotations

import json
import math
import tempfile
import warnings
from pathlib import Path

import pytest
import yaml
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from danling.runners import RunnerConfig
from danling.runners._config_base import _TypedConfig
from danling.runners._config_refs import _FLOAT_SPELLINGS, references_yaml


class SubConfig(_TypedConfig):
    """A typed section of a user's config."""

    flag: bool = True
    count: int = 0
    rate: float = 0.1


class UserConfig(RunnerConfig):
    """A user's config with one key of each kind."""

    flag: bool = False
    count: int = 0
    ratio: float = 0.0
    name: str = "x"
    maybe: int | None = None
    names: list[str] = []
    channels: int = 8
    sub: SubConfig = SubConfig()


def _parse(tmp_path, text: str, suffix: str = ".yaml", config=None):
    path = tmp_path / f"exp{suffix}"
    path.write_text(text)
    return (config or UserConfig()).parse(["--config", str(path)]), path


@pytest.mark.parametrize("word", ["false", "False", "off", "OFF", "0", "no"])
def test_false_words_in_a_yaml_file_are_false(tmp_path, word):
    config, _ = _parse(tmp_path, f'tensorboard: "{word}"\nlog: "{word}"\n')
    assert config.tensorboard is False and config.log is False


@pytest.mark.parametrize("word", ["false", "False", "off", "0"])
def test_false_words_in_a_json_file_and_in_python_are_false(tmp_path, word):
    config, _ = _parse(tmp_path, json.dumps({"tensorboard": word, "flag": word}), ".json")
    assert config.tensorboard is False and config.flag is False
    config = RunnerConfig()
    config.tensorboard = word
    assert config.tensorboard is False


def test_a_non_integral_float_for_an_integer_key_names_key_value_file_line_and_what_is_accepted(tmp_path, capsys):
    with pytest.raises(ValueError) as info:
        _parse(tmp_path, "experiment: demo\nepochs: 2.7\n")
    message = str(info.value)
    path = tmp_path / "exp.yaml"
    assert f"config.epochs=2.7 (from {path}:2)" in message and "expected an integer" in message
    assert "never rounded" in message and len(capsys.readouterr().err.strip().splitlines()) == 1
    with pytest.raises(ValueError, match=r"config\.channels=8\.9 .*exp\.yaml:1\).*expected an integer"):
        _parse(tmp_path, "channels: 8.9\n")
    with pytest.raises(ValueError, match=r"config\.channels=8\.9 .*exp\.json:1\).*expected an integer"):
        _parse(tmp_path, json.dumps({"channels": 8.9}), ".json")
    config = UserConfig()
    with pytest.raises(ValueError, match=r"config\.channels=8\.9 is not accepted: expected an integer"):
        config.channels = 8.9
    assert config.channels == 8  # nothing was stored


def test_a_bad_value_in_a_new_per_split_loader_section_names_its_full_key_and_line(tmp_path):
    # The split section is created by the file itself: its error must still name dataloader.train.*, not a bare key.
    with pytest.raises(ValueError) as info:
        _parse(tmp_path, "epochs: 2\ndataloader:\n  train:\n    batch_size: x\n")
    assert f"config.dataloader.train.batch_size='x' (from {tmp_path / 'exp.yaml'}:4)" in str(info.value)
    with pytest.raises(ValueError, match=r"^config\.dataloader\.val\.shuffle='maybe' is not accepted"):
        RunnerConfig(dataloader={"val": {"shuffle": "maybe"}})


class ModelConfig(RunnerConfig):
    """A config whose `__init__` builds a `model` section."""

    def __init__(self):
        super().__init__()
        self.model.depth = 4


def test_a_scalar_for_a_section_is_refused_naming_the_key_source_and_what_is_accepted(tmp_path):
    accepted = r"is not accepted: expected a mapping"
    with pytest.raises(ValueError, match=rf"^config\.checkpoint=5 \(from .*exp\.yaml:1\) {accepted}"):
        _parse(tmp_path, "checkpoint: 5\n")
    with pytest.raises(ValueError, match=rf"^config\.sub=None \(from .*exp\.yaml:1\) {accepted}"):
        _parse(tmp_path, "sub: null\n")
    with pytest.raises(ValueError, match=rf"^config\.optim=3 \(from --optim on the command line\) {accepted}"):
        UserConfig().parse(["--optim", "3"])
    # the section the class's own code built is not swapped for a scalar, losing model.depth
    with pytest.raises(ValueError, match=rf"^config\.model='x' \(from --model on the command line\) {accepted}"):
        ModelConfig().parse(["--model", "x"])
    with pytest.raises(ValueError, match=rf"^config\.model=None \(from .*exp\.yaml:1\) {accepted}"):
        _parse(tmp_path, "model: null\n", config=ModelConfig())
    assert ModelConfig().parse(["--model.depth", "none"]).model.depth is None  # its keys stay optional


def test_whole_floats_and_spelled_numbers_are_accepted_for_integer_keys(tmp_path):
    config, _ = _parse(tmp_path, "epochs: 3.0\nchannels: '16'\nsub:\n  count: 1e3\n")
    assert (config.epochs, config.channels, config.sub.count) == (3, 16, 1000)
    assert all(isinstance(value, int) for value in (config.epochs, config.channels, config.sub.count))


def test_yaml_1_1_exponent_floats_are_numbers(tmp_path):
    config, _ = _parse(tmp_path, "max_grad_norm: 1e-3\nratio: 5E-1\noptim:\n  lr: 1e-3\n  eps: 1e-8\n")
    assert config.max_grad_norm == 0.001 and config.ratio == 0.5
    assert config.optim.lr == 0.001 and config.optim.eps == 1e-8  # free-form keys too: as on the command line
    assert UserConfig().parse(["--optim.lr", "1e-3"]).optim.lr == config.optim.lr


def test_a_quoted_number_for_an_optimizer_argument_is_the_number_the_optimizer_gets(tmp_path, monkeypatch):
    import torch

    from danling.optim import build_optimizer

    monkeypatch.setenv("DANLING_TEST_LR", "0.5")
    config, _ = _parse(tmp_path, 'optim:\n  type: sgd\n  lr: !env DANLING_TEST_LR\n  momentum: "0.9"\n')
    assert (config.optim.lr, config.optim.momentum) == (0.5, 0.9)
    assert "lr: !env" in references_yaml(config, config.dict())  # still recorded as the reference
    config = RunnerConfig(**{"optim.type": "adamw", "optim.lr": "1e-3", "optim.weight_decay": "0"})
    optimizer = build_optimizer(torch.nn.Linear(2, 2), config.optim)  # it compared the string "1e-3" with 0
    assert optimizer.param_groups[0]["lr"] == 0.001 and optimizer.param_groups[0]["weight_decay"] == 0
    # a boolean argument spelled as a string ("false" from JSON or !env) is that boolean, not a true string
    path = tmp_path / "exp.json"
    path.write_text(json.dumps({"optim": {"type": "adamw", "amsgrad": "false", "maximize": "off"}}))
    config = UserConfig().parse(["--config", str(path)])
    assert config.optim.amsgrad is False and config.optim.maximize is False
    with pytest.raises(ValueError, match=r"config\.optim\.amsgrad='maybe' is not accepted: expected a boolean"):
        RunnerConfig(**{"optim.type": "adamw", "optim.amsgrad": "maybe"})


def test_bad_boolean_names_what_is_accepted(tmp_path):
    with pytest.raises(ValueError, match=r"config\.flag='maybe' .*exp\.yaml:1\).*true/false, yes/no, on/off or 1/0"):
        _parse(tmp_path, "flag: maybe\n")
    with pytest.raises(ValueError, match=r"config\.flag=2 .*expected a boolean"):
        _parse(tmp_path, "flag: 2\n")


def test_values_of_an_included_file_go_through_the_same_converter(tmp_path):
    (tmp_path / "sub.yaml").write_text('flag: "off"\nrate: 1e-3\ncount: "4"\n')
    config, _ = _parse(tmp_path, "sub: !include sub.yaml\n")
    assert config.sub.flag is False and config.sub.rate == 0.001 and config.sub.count == 4
    (tmp_path / "sub.yaml").write_text("count: 2.7\n")
    included = r"config\.sub\.count=2\.7 \(from .*sub\.yaml:1, included at .*exp\.yaml:1\).*an integer"
    with pytest.raises(ValueError, match=included):
        _parse(tmp_path, "sub: !include sub.yaml\n")


def test_a_single_value_for_a_list_key_is_a_one_element_list(tmp_path):
    config, _ = _parse(tmp_path, "names: train\ntrain_splits: train\n")
    assert config.names == ["train"] and config.train_splits == ["train"]


# ------------------------------------------------------------------ one result or one error, from every source

_KEYS = ("flag", "count", "ratio", "name", "maybe", "names")
_WORDS = ["true", "False", "off", "ON", "yes", "no", "0", "1", "2", "2.7", "3.0", "1e-3", "1e3", "none", "Null", "x"]
_STRINGS = st.one_of(st.sampled_from(_WORDS), st.text(alphabet="abn019.eE+_ ", max_size=6))
_SCALARS = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(2**53), max_value=2**53),
    st.floats(allow_nan=False, allow_infinity=False),
    _STRINGS,
)


class _Dumper(yaml.SafeDumper):
    """Quotes every string the config loader would read as something else (`1e-3`)."""


_Dumper.add_implicit_resolver("tag:yaml.org,2002:float", _FLOAT_SPELLINGS, list("-+0123456789."))


def _token(value) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    return value if isinstance(value, str) else repr(value)


def _outcome(build):
    try:
        config = build()
    except ValueError:
        return "error"
    value = config[_KEY[0]]
    if isinstance(value, list):
        return [(type(item), item) for item in value]
    if isinstance(value, float) and math.isnan(value):
        return (float, "nan")
    return (type(value), value)


_KEY = [""]


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(key=st.sampled_from(_KEYS), value=st.one_of(_SCALARS, st.lists(_STRINGS, max_size=3)))
def test_the_same_value_gives_one_result_or_one_error_from_every_source(key, value):
    if key != "names" and isinstance(value, list):
        value = value[0] if value else None
    # The command line spells None `null`, which is a string for a key that cannot be unset.
    assume(not (value is None and key in ("name", "names")))
    _KEY[0] = key
    with tempfile.TemporaryDirectory() as directory:
        yaml_path, json_path = Path(directory, "a.yaml"), Path(directory, "a.json")
        yaml_path.write_text(yaml.dump({key: value}, Dumper=_Dumper))
        json_path.write_text(json.dumps({key: value}))
        tokens = [_token(item) for item in value] if isinstance(value, list) else [_token(value)]

        def python():
            config = UserConfig()
            config[key] = value
            return config

        outcomes = {
            "yaml": _outcome(lambda: UserConfig().parse(["--config", str(yaml_path)])),
            "json": _outcome(lambda: UserConfig().parse(["--config", str(json_path)])),
            "cli": _outcome(lambda: UserConfig().parse([f"--{key}", *tokens])),
            "python": _outcome(python),
        }
    assert len({repr(outcome) for outcome in outcomes.values()}) == 1, outcomes


def test_numbers_in_files_included_by_a_list_are_read_like_the_command_line(tmp_path):
    (tmp_path / "a.yaml").write_text("rate: 1e-3\n")
    (tmp_path / "b.yaml").write_text("rate: 2e-3\n")
    config, _ = _parse(tmp_path, "network: !includes [a.yaml, b.yaml]\n", config=FreeConfig())
    assert [part["rate"] for part in config.network] == [0.001, 0.002]


class FreeConfig(RunnerConfig):
    network: list = []


def test_list_valued_cli_keys_arrive_typed_without_warnings():
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # an "Unrecognized argument" warning fails the test
        config = RunnerConfig().parse(
            [
                "--optim.type",
                "adamw",
                "--optim.betas",
                "0.9",
                "0.99",
                "--scheduler.type",
                "cosine",
                "--optim.lr",
                "1e-3",
            ]
        )
    assert config.optim.betas == [0.9, 0.99] and config.scheduler.type == "cosine" and config.optim.lr == 0.001
