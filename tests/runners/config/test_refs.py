"""`!env` / `!include` values reach the runner but are recorded as references, never resolved."""

from __future__ import annotations

import json
import re

import yaml
from chanfig import Config

from danling.runners import RunnerConfig
from danling.runners._config_refs import references_yaml
from tests.runners._toy import ToyRunner, toy_config

SECRET = "s3cr3t-token-value"


class SecretConfig(RunnerConfig):
    """The keys of the test's config file, declared (unknown top-level keys are errors)."""

    api_token: str | None = None
    extra: Config = Config()


def _write_config(tmp_path):
    (tmp_path / "extra.yaml").write_text(f"password: {SECRET}-2\nlayers: 3\n")
    path = tmp_path / "run.yaml"
    path.write_text("api_token: !env DANLING_TEST_SECRET\nextra: !include extra.yaml\nepochs: 1\n")
    return path


def test_env_and_include_values_are_recorded_as_references(tmp_path, monkeypatch):
    monkeypatch.setenv("DANLING_TEST_SECRET", SECRET)
    config = SecretConfig().parse(["--config", str(_write_config(tmp_path))], boot=False)
    config.merge(toy_config(tmp_path / "ws", epochs=1))
    assert config.api_token == SECRET and config.extra.layers == 3  # the run sees the values
    with ToyRunner(config) as runner:
        run_dir = runner.workspace.path
    config_text = (run_dir / "config.yaml").read_text()
    metadata_text = (run_dir / "metadata.json").read_text()
    for text in (config_text, metadata_text):
        assert SECRET not in text
    assert json.loads(metadata_text)["config"]["api_token"] == "!env DANLING_TEST_SECRET"
    assert json.loads(metadata_text)["config"]["extra"] == f"!include {tmp_path / 'extra.yaml'}"
    assert re.search(r"^api_token: !env '?DANLING_TEST_SECRET'?$", config_text, re.MULTILINE)
    # config.yaml stays a loadable config: reading it back resolves the references again
    assert SecretConfig(str(run_dir / "config.yaml")).api_token == SECRET


def test_overridden_reference_is_recorded_as_its_value(tmp_path, monkeypatch):
    monkeypatch.setenv("DANLING_TEST_SECRET", SECRET)
    path = _write_config(tmp_path)
    config = SecretConfig().parse(["--config", str(path), "--api_token", "plain"], boot=False)
    config.merge(toy_config(tmp_path / "ws", epochs=1))
    with ToyRunner(config) as runner:
        run_dir = runner.workspace.path
    assert yaml.safe_load((run_dir / "metadata.json").read_text())["config"]["api_token"] == "plain"


def test_references_to_typed_keys_and_sections_are_recorded_as_references(tmp_path, monkeypatch):
    # the stored value is converted (epochs 3, not "3") or completed with defaults (the checkpoint section):
    # still the file's value, so still recorded as the reference, not as what it resolved to
    monkeypatch.setenv("DANLING_TEST_EPOCHS", "3")
    (tmp_path / "mlflow.yaml").write_text(f"tracking_uri: https://user:{SECRET}@example.org\n")
    path = tmp_path / "run.yaml"
    path.write_text("epochs: !env DANLING_TEST_EPOCHS\nmlflow: !include mlflow.yaml\n")
    config = RunnerConfig().parse(["--config", str(path)])
    assert config.epochs == 3 and config.mlflow.tracking_uri.endswith("@example.org")
    recorded = yaml.safe_load(re.sub(r"!(env|include) ", "", references_yaml(config, config.dict())))
    assert recorded["epochs"] == "DANLING_TEST_EPOCHS"
    assert recorded["mlflow"] == str(tmp_path / "mlflow.yaml")
