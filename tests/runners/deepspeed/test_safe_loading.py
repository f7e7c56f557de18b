"""A payload planted in DeepSpeed's own checkpoint files never runs on resume or pretrained (#32 items 4-5).

DeepSpeed reads `mp_rank_00_model_states.pt` and `zero_pp_rank_*_optim_states.pt` with the full
unpickler; danling's loads of a DeepSpeed tag must go through the restricted one, admitting the
classes DeepSpeed's states need by name and refusing anything else with an error that names the
global and the opt-in. The manifest is recomputed after planting, as an attacker would.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from danling.checkpoint.unpickling import UnsafePickleError
from tests.checkpoint.test_safe_loading import _rehash
from tests.runners._deepspeed_toy import Regression, ds_config, weights

pytest.importorskip("deepspeed")

FILES = ("mp_rank_00_model_states.pt", "zero_pp_rank_0_mp_rank_00_optim_states.pt")


class Planted:
    """Unpickling this runs `os.system("touch <marker>")` (the global `posix.system`)."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


@pytest.fixture(scope="module", autouse=True)
def _own_process_state():
    """A single-process DeepSpeedRunner leaves its one-rank group and launcher variables in place (documented,
    for a later runner to adopt): drop them after this module, so other tests in this worker see a clean process."""
    names = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE")
    before = {name: os.environ.get(name) for name in names}
    yield
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
    for name, value in before.items():
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    root = tmp_path_factory.mktemp("ds")
    with Regression(ds_config(root, "run", stage=2, epochs=1)) as runner:
        runner.train()
        tag = runner.checkpoint_manager.latest
        expected = weights(runner)
    return root, tag, expected


def _plant(tag: Path, name: str, marker: Path, root: Path) -> Path:
    planted = root / f"planted-{name}"
    planted.mkdir()
    copy = planted / tag.name
    copy.mkdir()
    for file in tag.iterdir():
        copy.joinpath(file.name).write_bytes(file.read_bytes())
    state = torch.load(copy / name, weights_only=False)
    state["planted"] = Planted(marker)
    torch.save(state, copy / name)
    _rehash(copy)
    return copy


@pytest.mark.parametrize("name", FILES)
@pytest.mark.parametrize("entry", ["resume", "pretrained"])
def test_a_payload_planted_in_deepspeeds_files_is_refused(trained, tmp_path, name, entry):
    root, tag, _ = trained
    marker = tmp_path / "marker"
    planted = _plant(tag, name, marker, tmp_path)
    config = ds_config(tmp_path, "victim", stage=2, epochs=1, **{entry: str(planted)})
    if entry == "pretrained" and "optim" in name:  # a module-only load never reads the optimizer states
        Regression(config).close()
        assert not marker.exists(), "the planted payload ran"
        return
    with pytest.raises(UnsafePickleError) as info:
        Regression(config).close()
    message = str(info.value)
    assert not marker.exists(), "the planted payload ran"
    assert "posix.system" in message and "checkpoint.trust_pickle" in message
    assert "weights_only" not in message  # never advice to load it with the full unpickler


def test_deepspeeds_own_states_load_through_the_restricted_unpickler(trained, tmp_path):
    _, tag, expected = trained
    with Regression(ds_config(tmp_path, "resumed", stage=2, epochs=1, resume=str(tag))) as runner:
        assert runner.train_state.epoch == 1
        assert all(torch.equal(expected[key], value) for key, value in weights(runner).items())
    with Regression(ds_config(tmp_path, "fine-tuned", stage=2, epochs=1, pretrained=str(tag))) as runner:
        assert all(torch.equal(expected[key], value) for key, value in weights(runner).items())


def test_trust_pickle_lets_deepspeed_read_a_trusted_file(trained, tmp_path):
    root, tag, _ = trained
    marker = tmp_path / "marker"
    planted = _plant(tag, FILES[1], marker, tmp_path)
    config = ds_config(tmp_path, "trusting", stage=2, epochs=1, resume=str(planted))
    config["checkpoint.trust_pickle"] = True
    Regression(config).close()
    assert marker.exists()  # the opt-in is honoured: DeepSpeed's full unpickler read it
