"""A user error is one line on stderr; its traceback goes to the run log (`DANLING_DEBUG=1` / `--debug` print it)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

_FAILING_SCRIPT = """
import sys
from tests.runners._toy import ToyRunner, toy_config
with ToyRunner(toy_config(sys.argv[1], epochs=0, log=True)) as runner:
    print(runner.workspace.log_file, flush=True)
    runner.train()
"""


@pytest.mark.parametrize("debug", [False, True])
def test_a_user_error_is_one_line_on_stderr_and_its_traceback_goes_to_the_run_log(tmp_path, debug):
    env = {key: value for key, value in os.environ.items() if key != "DANLING_DEBUG"}
    if debug:
        env["DANLING_DEBUG"] = "1"
    repo = Path(__file__).resolve().parents[3]
    done = subprocess.run(
        [sys.executable, "-c", _FAILING_SCRIPT, str(tmp_path)], cwd=repo, env=env, capture_output=True, text=True
    )
    assert done.returncode == 1
    log = Path(done.stdout.split()[0])
    errors = [line for line in done.stderr.splitlines() if "| INFO " not in line and "| WARNING " not in line]
    if debug:
        assert errors[0] == "Traceback (most recent call last):", done.stderr
    else:
        assert errors == [
            f"-c: error: ValueError: epochs=0 trains nothing: set epochs to a positive int (or call evaluate()) "
            f"(traceback in {log}; DANLING_DEBUG=1 prints it here)"
        ]
    kept = log.read_text()
    assert "the run ended with an exception" in kept and "Traceback (most recent call last)" in kept


def test_debug_on_the_command_line_of_a_parsed_script_prints_the_traceback(tmp_path):
    # `--debug` used to reach parse() as an unknown key: the flag the one-line error offers could not be given.
    script = "import sys\nimport danling as dl\nfrom tests.runners._toy import ToyRunner, toy_config\n"
    script += "config = dl.RunnerConfig(**toy_config(sys.argv[1], epochs=0)).parse(sys.argv[2:])\n"
    script += "ToyRunner(config).train()"
    env = {key: value for key, value in os.environ.items() if key != "DANLING_DEBUG"}
    repo = Path(__file__).resolve().parents[3]
    for extra, traceback in (([], False), (["--debug"], True)):
        command = [sys.executable, "-c", script, str(tmp_path), "--seed", "1", *extra]
        done = subprocess.run(command, cwd=repo, env=env, capture_output=True, text=True)
        assert done.returncode == 1 and "epochs=0 trains nothing" in done.stderr, done.stderr
        assert ("Traceback (most recent call last):" in done.stderr) is traceback, done.stderr


def test_an_error_before_the_run_log_exists_is_one_line_too(tmp_path):
    script = "import sys\nfrom tests.runners._toy import ToyRunner, toy_config\n"
    script += "ToyRunner(toy_config(sys.argv[1], resume=sys.argv[2]))"  # fails while choosing the run directory
    missing = tmp_path / "no-such-run"
    env = {key: value for key, value in os.environ.items() if key != "DANLING_DEBUG"}
    command = [sys.executable, "-c", script, str(tmp_path), str(missing)]
    repo = Path(__file__).resolve().parents[3]
    done = subprocess.run(command, cwd=repo, env=env, capture_output=True, text=True)
    assert done.returncode == 1 and done.stderr.count("\n") == 1, done.stderr
    assert done.stderr.startswith(f"-c: error: CheckpointNotFoundError: cannot resume from '{missing}'")
