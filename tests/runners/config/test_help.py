"""Every key `--help` lists, given one bad value, fails in one line with exit status 2 and no traceback."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest

from danling.runners import RunnerConfig
from danling.runners._config_utils import _CHOICES

_LINE = re.compile(r"^  --(?P<key>\S+) (?P<type>.+?) \(default: .*\)$")


def _help_keys(capsys) -> dict[str, str]:
    with pytest.raises(SystemExit):
        RunnerConfig().parse(["--help"])
    return {m["key"]: m["type"] for line in capsys.readouterr().out.splitlines() if (m := _LINE.match(line))}


def _bad_value(key: str, kind: str) -> str | None:
    """A value the key cannot take, or None when every string is a valid value of it."""
    if key in _CHOICES:
        return "bogus"
    members = {member.strip() for member in kind.split("|")}
    if members <= {"bool", "None"}:
        return "maybe"
    if members <= {"int", "None"}:
        return "2.7"
    if members <= {"int", "float", "None"} or members <= {"float", "None"}:
        return "abc"
    if "dict" in kind and "list" not in kind:
        return "[1, 2]"
    return None


def test_every_help_key_with_a_bad_value_is_one_line_and_exit_2(capsys):
    keys = _help_keys(capsys)
    assert len(keys) > 100 and "checkpoint.interval" in keys and "tensorboard" in keys
    tried = 0
    for key, kind in keys.items():
        value = _bad_value(key, kind)
        if value is None:
            continue
        tried += 1
        with pytest.raises(SystemExit) as info:
            RunnerConfig().parse([f"--{key}", value])
        err = capsys.readouterr().err
        assert info.value.code == 2, (key, value)
        assert len(err.strip().splitlines()) == 1 and "Traceback" not in err, (key, err)
        assert f"config.{key}" in err and repr(value if value != "[1, 2]" else [1, 2]) in err, (key, err)
    assert tried > 80


def test_a_bad_value_in_a_script_prints_no_traceback(tmp_path):
    script = tmp_path / "train.py"
    script.write_text("from danling.runners import RunnerConfig\nRunnerConfig().parse()\n")
    bad = (["--checkpoint.interval", "2.7"], ["--tensorboard", "maybe"], ["--optim.type", "sgd", "--optim.lrr", "1"])
    for args in bad:
        done = subprocess.run([sys.executable, str(script), *args], capture_output=True, text=True, timeout=120)
        assert done.returncode == 2 and len(done.stderr.splitlines()) == 1 and "Traceback" not in done.stderr, args
