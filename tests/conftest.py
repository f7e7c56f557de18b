"""Suite-wide guards: a test module leaves the process as it found it.

A module that leaves a default process group or launcher variables behind changes what the next
module in the same xdist worker sees (a one-rank group left by in-process DeepSpeed runners made
`dist.is_initialized()` true for the process-group tests that ran after them). Each module is
checked when it ends, so a leak fails where it happens, not in whichever test runs next.
"""

from __future__ import annotations

import os

import pytest

_LAUNCHER_VARIABLES = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def _process_state() -> dict:
    import torch.distributed as dist

    group = dist.is_available() and dist.is_initialized()
    return {"process group": bool(group), **{name: os.environ.get(name) for name in _LAUNCHER_VARIABLES}}


@pytest.fixture(scope="module", autouse=True)
def _module_leaves_no_process_state(request):
    before = _process_state()
    yield
    after = _process_state()
    changed = {key: (before[key], after[key]) for key in before if before[key] != after[key]}
    if changed:
        pytest.fail(f"{request.module.__name__} left process state behind (before, after): {changed}", pytrace=False)
