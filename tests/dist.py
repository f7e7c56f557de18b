"""The one launcher distributed tests use: N real processes, gloo backend, CPU.

Rendezvous goes through a ``FileStore`` in a fresh temporary file, so concurrent tests never
race for a TCP port. The worker must be a module-level function (it is pickled by ``spawn``);
it receives ``(rank, world_size, *args)`` and runs with the default process group initialised.
Whatever each rank returns is sent back, so tests compare results across ranks in the parent.
"""

from __future__ import annotations

import os
import pickle
import queue as queue_module
import tempfile
import time
import traceback
from collections.abc import Callable
from typing import Any

import torch.distributed as dist
import torch.multiprocessing as mp


def _entry(rank: int, world_size: int, store_path: str, fn: Callable, args: tuple, queue) -> None:
    os.environ.update(
        RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world_size)
    )
    store = dist.FileStore(store_path, world_size)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size)
    try:
        # Pickle by value here: torch's queue would otherwise share tensors through handles that
        # die with this process, and the parent reads after the worker has exited.
        queue.put((rank, True, pickle.dumps(fn(rank, world_size, *args))))
    except BaseException:  # report every failure to the parent, including assertion errors
        queue.put((rank, False, traceback.format_exc()))
    finally:
        dist.destroy_process_group()


def run_distributed(fn: Callable, *args: Any, world_size: int = 2, timeout: float = 240) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` gloo ranks; return results by rank."""
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    results: dict[int, Any] = {}
    with tempfile.TemporaryDirectory() as tmp:
        store_path = os.path.join(tmp, "store")
        procs = [
            ctx.Process(target=_entry, args=(rank, world_size, store_path, fn, args, queue))
            for rank in range(world_size)
        ]
        for p in procs:
            p.start()
        deadline = time.monotonic() + timeout
        try:
            # Drain results while the workers run: a large result would otherwise block its
            # sender on a full pipe. A worker that dies without reporting ends the wait early.
            while len(results) < world_size:
                try:
                    rank, ok, value = queue.get(timeout=0.5)
                except queue_module.Empty:
                    if time.monotonic() > deadline:
                        raise TimeoutError(f"distributed test did not finish within {timeout}s") from None
                    dead = [p.exitcode for p in procs if p.exitcode not in (None, 0)]
                    if dead:
                        raise AssertionError(f"a rank died without reporting; exit codes {dead}") from None
                    continue
                if not ok:
                    raise AssertionError(f"rank {rank} failed:\n{value}")
                results[rank] = pickle.loads(value)
        finally:
            # On failure the surviving ranks may wait forever in a collective: kill them now.
            grace = max(1.0, deadline - time.monotonic()) if len(results) == world_size else 0.0
            for p in procs:
                p.join(grace)
                if p.is_alive():
                    p.kill()
                    p.join()
    return [results[r] for r in range(world_size)]
