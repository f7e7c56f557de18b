"""`common.count_region`: instructions of one region of a child under callgrind (the `--instructions` figures)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "benchmarks"))

from common import callgrind_helper, count_region  # noqa: E402

CHILD = textwrap.dedent(
    """
    import sys
    sys.path.insert(0, {benchmarks!r})
    from common import counted_region
    total = 0
    for _ in range(1000):  # outside the region: never counted
        total += 1
    with counted_region():
        for value in range(int(sys.argv[1])):
            total += value
    print(total)
    """
)


def _valgrind_usable(tmp_path) -> bool:
    if shutil.which("valgrind") is None or shutil.which("cc") is None:
        return False
    try:
        callgrind_helper(str(tmp_path))
    except RuntimeError:
        return False
    return True


def test_only_the_region_is_counted_and_the_count_follows_the_work(tmp_path):
    if not _valgrind_usable(tmp_path):
        pytest.skip("needs valgrind, its headers and a C compiler")
    helper = callgrind_helper(str(tmp_path))
    script = tmp_path / "child.py"
    script.write_text(CHILD.format(benchmarks=str(REPO / "benchmarks")))
    counts = {}
    for n in (10, 20_000):
        counts[n], out = count_region([sys.executable, str(script), str(n)], helper, dict(os.environ))
        assert int(out.strip()) == 1000 + n * (n - 1) // 2  # the child's stdout comes back
    # Neither the loop before the region (about 50,000 instructions) nor the lookup of the stop
    # function (about 15,000: a first attribute access on a ctypes library) is in the count; the
    # region's own exit, a first call through ctypes, costs about 17,000 here (32,000 with the lookup).
    assert 0 < counts[10] < 25_000
    assert counts[20_000] > 50 * counts[10]


def test_outside_callgrind_the_region_does_nothing(tmp_path):
    script = tmp_path / "child.py"
    script.write_text(CHILD.format(benchmarks=str(REPO / "benchmarks")))
    env = {key: value for key, value in os.environ.items() if key != "DANLING_BENCH_CALLGRIND"}
    done = subprocess.run([sys.executable, str(script), "5"], capture_output=True, text=True, env=env, check=True)
    assert int(done.stdout.strip()) == 1010
