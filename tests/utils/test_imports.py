import json
import subprocess
import sys

import pytest

from danling.utils import optional_import


def test_returns_the_module():
    assert optional_import("json", "core") is json
    assert optional_import("os.path", "core").join("a", "b").endswith("b")


def test_missing_module_names_module_and_extra():
    with pytest.raises(ImportError) as info:
        optional_import("danling_missing_pkg.sub", "wandb")
    message = str(info.value)
    assert "danling_missing_pkg.sub" in message
    assert "pip install danling[wandb]" in message
    assert info.value.name == "danling_missing_pkg.sub"
    assert isinstance(info.value.__cause__, ModuleNotFoundError)


def test_broken_module_is_reported_with_hint(tmp_path, monkeypatch):
    (tmp_path / "danling_broken_mod.py").write_text("import danling_missing_dependency\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(ImportError, match=r"danling_broken_mod.*danling_missing_dependency.*danling\[deepspeed\]"):
        optional_import("danling_broken_mod", "deepspeed")
    sys.modules.pop("danling_broken_mod", None)


@pytest.mark.parametrize(("module", "extra"), [("", "x"), (None, "x"), ("json", ""), ("json", 3)])
def test_bad_arguments(module, extra):
    with pytest.raises(TypeError, match="non-empty string"):
        optional_import(module, extra)


def test_import_danling_does_not_import_optional_packages():
    code = (
        "import sys, danling\n"
        "heavy = [m for m in ('pandas', 'tensorboard', 'wandb', 'deepspeed') if m in sys.modules]\n"
        "print(','.join(heavy))\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert result.stdout.strip() == ""
