"""Package-level guarantees: a light import, and every advertised public name resolves."""

import json
import subprocess
import sys
from importlib.metadata import metadata, version

import pytest

import danling

OPTIONAL = ("tensorboard", "wandb", "deepspeed", "pandas", "torch.utils.tensorboard", "torch.distributed.checkpoint")
# Parts of torch and of the extras that a default run never needs before its first step; each costs
# 0.05-1 s of start-up when imported (`python -X importtime -c "import danling"` shows the tree).
HEAVY = (
    "torch._dynamo",
    "torch._inductor",
    "torch.distributed.fsdp",
    "torch.distributed.tensor",
    "torch.distributed.pipelining",
    "torch.distributed.elastic",
    "torch.onnx",
    "sympy",
    "matplotlib",
    "mlflow",
    "pyarrow",
    "scipy",
    "sklearn",
    "torchmetrics",
)


@pytest.mark.parametrize("modules", [OPTIONAL, HEAVY], ids=["optional extras", "heavy modules"])
def test_import_pulls_no_optional_extra_or_heavy_module(modules):
    code = f"import json, sys; import danling; print(json.dumps([m for m in {modules!r} if m in sys.modules]))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert json.loads(out.stdout.strip().splitlines()[-1]) == []


def test_every_public_name_resolves_and_is_unique():
    assert len(danling.__all__) == len(set(danling.__all__)), "two subpackages export the same name"
    missing = [name for name in danling.__all__ if not hasattr(danling, name)]
    assert missing == []


def test_version_matches_installed_metadata():
    assert danling.__version__ == version("danling")


def test_installed_metadata_declares_the_license_as_an_spdx_expression():
    # pyproject gives `license` as an SPDX string (setuptools 77+): the table form it replaced
    # is deprecated, and setuptools may refuse to build it from 2027-02-18.
    assert metadata("danling")["License-Expression"] == "Apache-2.0"
