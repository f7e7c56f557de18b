"""Package-level guarantees: a light import, and every advertised public name resolves."""

import json
import subprocess
import sys
from importlib.metadata import version

import danling

OPTIONAL = ("tensorboard", "wandb", "deepspeed", "pandas", "torch.utils.tensorboard", "torch.distributed.checkpoint")


def test_import_pulls_no_optional_extra():
    code = f"import json, sys; import danling; print(json.dumps([m for m in {OPTIONAL!r} if m in sys.modules]))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert json.loads(out.stdout.strip().splitlines()[-1]) == []


def test_every_public_name_resolves_and_is_unique():
    assert len(danling.__all__) == len(set(danling.__all__)), "two subpackages export the same name"
    missing = [name for name in danling.__all__ if not hasattr(danling, name)]
    assert missing == []


def test_version_matches_installed_metadata():
    assert danling.__version__ == version("danling")
