"""The last checkpoint of a run is on disk, verified and `latest`, however the script ends (#32).

Each case runs a real script in a child process: the default config writes checkpoints in the
background, and every write is slowed down so the final one is still in flight when `train()`
returns. Whatever follows (a return, the end of the script, `sys.exit`, an exception, the runner
garbage-collected, interpreter shutdown), the process must not exit before that save is durable.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from danling.checkpoint import FileCheckpointManager
from tests.runners._ending_child import ENDINGS

REPO = Path(__file__).resolve().parents[3]


@pytest.mark.parametrize("ending", sorted(ENDINGS))
def test_the_last_checkpoint_is_durable_before_the_process_exits(tmp_path, ending):
    code, expected = ENDINGS[ending]
    proc = subprocess.run(
        [sys.executable, "-m", "tests.runners._ending_child", str(tmp_path), ending],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert proc.returncode == code, proc.stderr
    directory = Path(proc.stdout.split("checkpoints", 1)[1].split()[0])
    manager = FileCheckpointManager(directory, load_only=True)
    listing = sorted(path.name for path in directory.iterdir())
    assert manager.latest is not None and manager.latest.name == expected, (listing, proc.stderr)
    manager.verify("latest")  # raises when torn or unsealed
    assert f"saved checkpoint {directory / expected}" in proc.stderr
    if ending == "manual-failure":  # the save that failed during shutdown is an ERROR line, and the exit is 1
        assert "step-000015 was not saved before the process exited" in proc.stderr
        assert "(OSError: No space left on device)" in proc.stderr
