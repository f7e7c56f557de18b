"""The one launcher distributed tests use: N real processes, gloo backend, CPU.

Rendezvous goes through a ``FileStore`` in a fresh temporary file, so concurrent tests never
race for a TCP port. The worker must be a module-level function (it is pickled by ``spawn``);
it receives ``(rank, world_size, *args)`` and runs with the default process group initialised.
Whatever each rank returns is sent back, so tests compare results across ranks in the parent.

With ``init_process_group=False`` the worker starts without a group, as under torchrun: the
environment holds ``RANK``/``WORLD_SIZE``/``LOCAL_RANK`` and ``MASTER_ADDR``/``MASTER_PORT``, so a
runner starts (and destroys) the group itself. Every group rendezvouses on a port of its own
(see `rendezvous_ports`), so a worker may build one runner after another. Workers that also
need a group outside their runners open one with `process_group()`.
"""

from __future__ import annotations

import os
import pickle
import queue as queue_module
import random
import signal
import socket
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch.distributed as dist
import torch.multiprocessing as mp


def _entry(
    rank: int, world_size: int, store_path: str, fn: Callable, args: tuple, queue, ports: list[int] | None
) -> None:
    os.environ.update(
        RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world_size)
    )
    if ports is None:
        store = dist.FileStore(store_path, world_size)
        dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size)
    else:
        rendezvous_ports(ports)
    try:
        # Pickle by value here: torch's queue would otherwise share tensors through handles that
        # die with this process, and the parent reads after the worker has exited.
        queue.put((rank, True, pickle.dumps(fn(rank, world_size, *args))))
    except BaseException:  # report every failure to the parent, including assertion errors
        queue.put((rank, False, traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def rendezvous_ports(ports: list[int]) -> None:
    """Give each default group this process starts through ``env://`` the next of `ports`.

    Sets ``MASTER_ADDR``/``MASTER_PORT`` to the first port and moves ``MASTER_PORT`` on each time
    the default group is destroyed: a new rendezvous on the port of a group just destroyed can
    hang (a rank may reach the old store). Every rank gets the same list and destroys as many
    groups, so they stay on the same port.
    """
    remaining = iter(ports)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(next(remaining)))
    destroy = dist.destroy_process_group

    def destroy_then_move_on(group: Any = None) -> None:
        destroy(group)
        if group is None:
            os.environ["MASTER_PORT"] = str(next(remaining))

    dist.destroy_process_group = destroy_then_move_on


def free_ports(count: int) -> list[int]:
    """`count` distinct TCP ports, free a moment ago, that no other test process hands out.

    Ports come from below the kernel's ephemeral range (which every gloo connection draws from),
    from a block of its own for each pytest-xdist worker, in turn from a random start: two test
    processes never pick the same port, and one process moves on instead of reusing a port it
    handed out a moment ago. (Ports from `bind(0)`, or picked at random by both workers, were
    taken by the other process before the rendezvous bound them: EADDRINUSE on CI.)
    """
    global _next_port
    worker = os.environ.get("PYTEST_XDIST_WORKER", "gw0")[2:]
    blocks = max(1, (_ephemeral_low() - 10000) // _PORT_BLOCK)
    first = 10000 + (int(worker) % blocks if worker.isdigit() else 0) * _PORT_BLOCK
    if _next_port is None:
        _next_port = random.randrange(_PORT_BLOCK)
    chosen: list[int] = []
    sockets: list[socket.socket] = []
    try:
        for _ in range(_PORT_BLOCK):
            port, _next_port = first + _next_port, (_next_port + 1) % _PORT_BLOCK
            sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                sock.close()
                continue
            sockets.append(sock)  # held open together, so the ports differ
            chosen.append(port)
            if len(chosen) == count:
                return chosen
        raise RuntimeError(f"no {count} free TCP ports in {first}-{first + _PORT_BLOCK - 1}")
    finally:
        for sock in sockets:
            sock.close()


_PORT_BLOCK = 5000
_next_port: int | None = None  # offset of the next port to hand out in this process's block


def _ephemeral_low() -> int:
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as handle:
            return max(10001, int(handle.read().split()[0]))
    except (OSError, ValueError, IndexError):
        return 32768


@contextmanager
def process_group() -> Iterator[None]:
    """The default gloo group, from the environment, for the duration of the block (then destroyed).

    For workers launched with ``init_process_group=False`` that also run collectives outside a
    runner (which owns, and destroys, the group it starts).
    """
    dist.init_process_group("gloo", init_method="env://")
    try:
        yield
    finally:
        dist.destroy_process_group()


def run_distributed(
    fn: Callable, *args: Any, world_size: int = 2, timeout: float = 240, init_process_group: bool = True
) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` gloo ranks; return results by rank.

    Args:
        init_process_group: Start the default group before calling ``fn``. Set it to ``False``
            for workers whose runners start the group themselves (a runner refuses to adopt one).
    """
    ctx = mp.get_context("spawn")
    ports = None if init_process_group else free_ports(32)
    queue = ctx.Queue()
    results: dict[int, Any] = {}
    with tempfile.TemporaryDirectory() as tmp:
        store_path = os.path.join(tmp, "store")
        procs = [
            ctx.Process(target=_entry, args=(rank, world_size, store_path, fn, args, queue, ports))
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


def fork_scenario(log_path: str, ports: list[int] | None, body: Callable[[], Any], *, append: bool = False) -> int:
    """Run `body()` in a forked child whose output goes to `log_path`; return the child's pid.

    For the exact-resume children: the slow imports are paid once, before forking. With `ports`,
    every default group a runner in the child starts gets the next of them (see
    `rendezvous_ports`). The child exits 0 when `body` returns, 1 on an exception (its traceback
    in the log), or dies of whatever signal kills it; `scenario_status` reads which. With `append`
    the log keeps what earlier children wrote to it (one log across restarts).
    """
    pid = os.fork()
    if pid:
        return pid
    code = 1
    try:
        log = os.open(log_path, os.O_WRONLY | os.O_CREAT | (os.O_APPEND if append else os.O_TRUNC))
        os.dup2(log, 1)
        os.dup2(log, 2)
        if ports:
            rendezvous_ports(ports)
        body()
        code = 0
    except BaseException:
        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def scenario_status(pid: int) -> str:
    """Wait for a forked scenario: ``"exit <code>"`` or the name of the signal that killed it."""
    _, status = os.waitpid(pid, 0)
    if os.WIFSIGNALED(status):
        return signal.Signals(os.WTERMSIG(status)).name
    return f"exit {os.WEXITSTATUS(status)}"
