"""Suite-wide guards: a test module leaves the process as it found it.

A module that leaves a default process group, launcher variables or a running thread behind
changes what the next module in the same xdist worker sees (a one-rank group left by in-process
DeepSpeed runners made `dist.is_initialized()` true for the process-group tests that ran after
them): each module is checked when it ends, so a leak fails where it happens, not in whichever
test runs next.

Stop-signal handlers are put back instead of checked: a runner keeps its handlers until `close`,
and one that ended in a graceful stop ignores SIGTERM/SIGINT while its process leaves (by design,
see `RunnerSupervisor.restore_signal_handlers`). Tests that build runners without closing them, or
that catch that stop's `SystemExit`, would otherwise hand an ignored SIGTERM to every child process
the next tests start, whose SIGTERMs then did nothing.

Every temporary path of a run (tests, doctests, and the processes they start, which inherit
TMPDIR) lies under one directory that is removed when the run ends. Doctests and launched ranks
call `tempfile.mkdtemp()` freely; without this, each run left hundreds of directories in /tmp
(checkpoints included) and repeated runs filled the disk.
"""

from __future__ import annotations

import gc
import getpass
import multiprocessing.util
import os
import shutil
import signal
import sys
import tempfile
import threading

import pytest

_LAUNCHER_VARIABLES = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
_STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)


_RUN_TEMP: list[str] = []


def pytest_configure(config: pytest.Config) -> None:
    outer = tempfile.gettempdir()
    # multiprocessing's own temporary directory (forkserver's socket) is removed by its exit
    # handler, which runs after `pytest_unconfigure`: made now, it lies outside the run's
    # directory, and that handler does not trip over a directory already removed.
    multiprocessing.util.get_temp_dir()
    # Inductor's compile cache stays where torch puts it by default: kept between runs on purpose.
    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", os.path.join(outer, f"torchinductor_{getpass.getuser()}"))
    # A short prefix: Slurm's munge socket lives a few levels below and must fit in 108 bytes.
    root = tempfile.mkdtemp(prefix="dlt-", dir=outer)
    _RUN_TEMP.append(root)
    os.environ["TMPDIR"] = tempfile.tempdir = root


def pytest_unconfigure(config: pytest.Config) -> None:
    while _RUN_TEMP:
        shutil.rmtree(_RUN_TEMP.pop(), ignore_errors=True)


def _process_state() -> dict:
    import torch.distributed as dist

    group = dist.is_available() and dist.is_initialized()
    return {"process group": bool(group), **{name: os.environ.get(name) for name in _LAUNCHER_VARIABLES}}


# Threads made once per process by design and reused by every later user: danling's hashing and
# pointer-writing pools (`checkpoint.checksums`, `checkpoint.layout`) and tqdm's monitor.
_PROCESS_WIDE_THREADS = ("danling-hash_", "danling-pointers_", "tqdm_monitor")


def _torch_pool_threads() -> set[threading.Thread]:
    """Workers of inductor's compile pool: made at the process's first compile and kept for every later one."""
    module = sys.modules.get("torch._inductor.async_compile")
    pool = getattr(getattr(module, "AsyncCompile", None), "pool", None)
    if pool is None or not getattr(pool, "cache_info", None) or not pool.cache_info().currsize:
        return set()
    return set(getattr(pool(), "_threads", ()))


def _new_threads(before: set[threading.Thread]) -> list[str]:
    """Threads started during the module that are still running (each gets a moment to finish ending)."""
    left, kept = [], _torch_pool_threads()
    for thread in threading.enumerate():
        if thread in before or thread is threading.current_thread() or thread.name.startswith(_PROCESS_WIDE_THREADS):
            continue
        if thread in kept:
            continue
        thread.join(timeout=5.0)  # a component closed at the module's end may still be leaving
        if thread.is_alive():
            left.append(f"{thread.name} ({type(thread).__name__}{', daemon' if thread.daemon else ''})")
    return left


@pytest.fixture(scope="module", autouse=True)
def _module_leaves_no_process_state(request):
    before, handlers = _process_state(), {sig: signal.getsignal(sig) for sig in _STOP_SIGNALS}
    threads = set(threading.enumerate())
    yield
    leaked = _new_threads(threads)
    for sig, handler in handlers.items():
        signal.signal(sig, handler)
    # A runner left open keeps what was alive at its construction frozen (`gc.freeze`): give it
    # back, so later modules' runners freeze (and collect) as in a fresh process.
    gc.unfreeze()
    after = _process_state()
    changed = {key: (before[key], after[key]) for key in before if before[key] != after[key]}
    if leaked:
        changed["threads"] = ([], leaked)
    if changed:
        pytest.fail(f"{request.module.__name__} left process state behind (before, after): {changed}", pytrace=False)
