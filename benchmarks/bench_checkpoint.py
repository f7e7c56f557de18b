"""Checkpoint managers against the raw calls they wrap, on one state, in one process.

Question: how much does a verified, durable checkpoint cost over `torch.save` / `torch.load`
and `dcp.save` / `dcp.load` of the same state?

- file: `FileCheckpointManager.save` / `.load_into` against `torch.save` + fsync /
  `torch.load` + `load_state_dict`;
- dcp: `TorchDistributedCheckpointManager.save` / `.load_into` against `dcp.save` (which fsyncs
  its files) / `dcp.load` + `set_state_dict`;
- async: the time `save` takes to return to the caller with ``async_save=True`` against
  `dcp.async_save` of the same state.

Every candidate writes the same model + AdamW state (sized by ``--mib``); runs alternate and the
table reports medians and the ratio to the raw call. ``--profile`` prints a cProfile of one
manager save and one load of each backend instead.
"""

from __future__ import annotations

import argparse
import itertools
import os
import shutil
import statistics
import sys
import tempfile
import threading
import time
import warnings
from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, os.path.dirname(__file__))
from common import alternate, fsync_file, profile_call

from danling.checkpoint import FileCheckpointManager
from danling.checkpoint.dcp import ModelState, OptimizerState, TorchDistributedCheckpointManager


def build(mib: int) -> tuple[nn.Module, torch.optim.Optimizer, int]:
    """A stack of square linear layers whose weights + AdamW moments total about `mib` MiB."""
    width = 1024
    layers = max(1, round(mib * 2**20 / (3 * 4 * width * width)))
    model = nn.Sequential(*[nn.Linear(width, width) for _ in range(layers)])
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randn(2, width)).sum().backward()
    optimizer.step()
    size = sum(t.numel() * t.element_size() for t in model.state_dict().values())
    size += sum(
        value.numel() * value.element_size()
        for state in optimizer.state.values()
        for value in state.values()
        if isinstance(value, torch.Tensor)
    )
    return model, optimizer, size


class Retirement:
    """The raw side's `keep_latest_k=1`: the copy a save replaced is deleted on a helper thread
    started as the save ends, and waited for (untimed) before the next save, as the managers do.

    When the older copy goes matters on a VM that hands freed memory back to its host a moment
    later: the page cache of a save into memory freed seconds earlier faults its pages in from
    the host. Deleting the raw copy just before its next save made the same `dcp.save` of 1 GiB
    take 0.68 s against 1.6 s deleted right after the save, so both sides delete at the same point.
    """

    def __init__(self, remove: Callable[[Path], None]) -> None:
        self.remove = remove
        self.thread: threading.Thread | None = None

    def retire(self, path: Path) -> None:
        self.thread = threading.Thread(target=self.remove, args=(path,))
        self.thread.start()

    def settle(self) -> None:
        if self.thread is not None:
            self.thread.join()
            self.thread = None


def _remove(path: Path) -> None:
    if path.is_dir():
        shutil.rmtree(path, ignore_errors=True)
    elif path.exists():
        path.unlink()


def file_candidates(model: nn.Module, optimizer: torch.optim.Optimizer, root: Path) -> dict[str, Callable]:
    # Like the managers (keep_latest_k=1), the raw side writes a new file while the previous one
    # exists and deletes that one once the new one is written (see `Retirement`).
    paths = [root / "raw-a.pt", root / "raw-b.pt"]
    manager = FileCheckpointManager(root / "file", keep_latest_k=1)
    objects = {"model": model, "optimizer": optimizer}
    counter = itertools.count()
    retirement = Retirement(_remove)

    def raw_save() -> None:
        paths.reverse()
        torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict()}, paths[0])
        fsync_file(os.fspath(paths[0]))
        retirement.retire(paths[1])

    def raw_load() -> None:
        payload = torch.load(paths[0], weights_only=True)
        model.load_state_dict(payload["model"])
        optimizer.load_state_dict(payload["optimizer"])

    return {
        "torch.save + fsync": (retirement.settle, raw_save),
        "FileCheckpointManager.save": (manager.wait, lambda: manager.save(objects, f"step-{next(counter)}")),
        "torch.load + load_state_dict": raw_load,
        "FileCheckpointManager.load_into": lambda: manager.load_into("latest", objects),
    }


def dcp_candidates(model: nn.Module, optimizer: torch.optim.Optimizer, root: Path) -> dict[str, Callable]:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    dirs = [root / "raw-a", root / "raw-b"]
    manager = TorchDistributedCheckpointManager(root / "dcp", keep_latest_k=1)
    counter = itertools.count()
    retirement = Retirement(_remove)  # as in `file_candidates`

    def raw_save() -> None:
        dirs.reverse()
        model_state, optim_state = get_state_dict(model, optimizer)
        dcp.save({"model": model_state, "optimizer": optim_state}, checkpoint_id=dirs[0], no_dist=True)
        retirement.retire(dirs[1])

    def raw_load() -> None:
        model_state, optim_state = get_state_dict(model, optimizer)
        state = {"model": model_state, "optimizer": optim_state}
        dcp.load(state, checkpoint_id=dirs[0], no_dist=True)
        set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"])

    def objects() -> dict:
        return {"model": ModelState(model), "optimizer": OptimizerState(model, optimizer)}

    return {
        "dcp.save": (retirement.settle, raw_save),
        "DCP manager save": (manager.wait, lambda: manager.save(objects(), f"step-{next(counter)}")),
        "dcp.load + set_state_dict": raw_load,
        "DCP manager load_into": lambda: manager.load_into("latest", objects()),
    }


def async_candidates(model: nn.Module, optimizer: torch.optim.Optimizer, root: Path) -> dict[str, Callable]:
    """Each candidate returns (settle, start): `settle` waits for the previous write (untimed),
    `start` is timed until control returns to training."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    manager = TorchDistributedCheckpointManager(root / "async", keep_latest_k=1, async_save=True)
    pending: list = []

    def raw_settle() -> None:
        while pending:
            pending.pop().result()

    def raw_start() -> None:
        model_state, optim_state = get_state_dict(model, optimizer)
        state = {"model": model_state, "optimizer": optim_state}
        pending.append(dcp.async_save(state, checkpoint_id=root / "raw-async", no_dist=True))

    def mine_start() -> None:
        manager.save({"model": ModelState(model), "optimizer": OptimizerState(model, optimizer)}, "ckpt")

    return {
        "dcp.async_save (returns)": (raw_settle, raw_start),
        "DCP manager async save (returns)": (manager.wait, mine_start),
    }


def alternate_settled(
    candidates: dict[str, tuple[Callable, Callable]], repeats: int, isolated: bool = False
) -> dict[str, float]:
    """Like `alternate`, but each candidate's previous background work (an async write, deleting
    the copy a save replaced) finishes before its timed call.

    With `isolated` (the saves), every candidate's background work has finished before any timed
    call starts, and the candidate going first alternates from round to round: on this VM the
    second of two 1 GiB saves in a row was often the slow one, whichever it was. The async rows
    keep the plain order: `dcp.async_save` copies into fresh buffers each call, and how long ago
    its previous ones were freed moved its time to return between 16 and 67 ms.
    """
    samples: dict[str, list[float]] = {name: [] for name in candidates}
    names = list(candidates)
    for round_ in range(repeats + 1):
        for name in names[::-1] if isolated and round_ % 2 == 0 else names:
            for settle in [pair[0] for pair in candidates.values()] if isolated else [candidates[name][0]]:
                settle()
            began = time.perf_counter()
            candidates[name][1]()
            if round_:  # the first round warms up
                samples[name].append(time.perf_counter() - began)
    for settle, _ in candidates.values():
        settle()
    return {name: statistics.median(values) for name, values in samples.items()}


def settled(candidate: Callable | tuple[Callable, Callable], *more: Callable) -> tuple[Callable, Callable]:
    """`(settle, call)` of a candidate given as a call or as `(settle, call)`, `more` run after its settle."""
    settle, call = candidate if isinstance(candidate, tuple) else (None, candidate)
    steps = ([settle] if settle is not None else []) + list(more)

    def run() -> None:
        for step in steps:
            step()

    return run, call


def evict(root: Path) -> Callable[[], None]:
    """Drop the (clean, fsynced) page-cache pages of every file under `root`: the next read comes from disk."""

    def run() -> None:
        for path in root.rglob("*"):
            if path.is_file():
                fd = os.open(path, os.O_RDONLY)
                try:
                    os.fsync(fd)
                    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
                finally:
                    os.close(fd)

    return run


def report(title: str, medians: dict[str, float], size: int) -> str:
    names = list(medians)
    rows = [f"### {title}: {size / 2**20:.0f} MiB of model + AdamW state", ""]
    rows += ["| operation | raw (ms) | danling (ms) | ratio |", "| --- | ---: | ---: | ---: |"]
    for raw, mine in zip(names[::2], names[1::2]):
        rows.append(
            f"| {mine} vs {raw} | {medians[raw] * 1e3:.0f} | {medians[mine] * 1e3:.0f} | "
            f"{medians[mine] / medians[raw]:.2f} |"
        )
    return "\n".join(rows)


def profile(candidates: dict[str, Callable], names: list[str], lines: int) -> str:
    out = []
    for name in names:
        settle, call = settled(candidates[name])
        settle()
        call()  # warm up
        settle()
        out.append(profile_call(call, name, lines))
    return "".join(out)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mib", type=int, default=170, help="size of model + optimizer state")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--quick", action="store_true", help="48 MiB, 3 repeats")
    parser.add_argument("--only", choices=("file", "dcp", "async"), action="append")
    parser.add_argument("--cold", action="store_true", help="evict the files from the page cache before each load")
    parser.add_argument("--profile", action="store_true", help="cProfile one manager save and load instead")
    args = parser.parse_args(argv)
    mib, repeats = (48, 3) if args.quick else (args.mib, args.repeats)
    torch.manual_seed(0)
    model, optimizer, size = build(mib)
    parts = args.only or ["file", "dcp", "async"]
    warnings.simplefilter("ignore")  # DCP warns that it runs without a process group: intended
    with tempfile.TemporaryDirectory(dir=os.environ.get("BENCH_DIR")) as tmp:
        for part in parts:
            root = Path(tmp) / part
            root.mkdir()
            candidates = {"file": file_candidates, "dcp": dcp_candidates, "async": async_candidates}[part](
                model, optimizer, root
            )
            if args.profile and part != "async":
                print(profile(candidates, [n for n in candidates if "manager" in n.lower() or "Manager" in n], 25))
                continue
            names = list(candidates)
            medians: dict[str, float] = {}
            for pair in zip(names[::2], names[1::2]):
                chosen = {name: candidates[name] for name in pair}
                if args.cold and part != "async" and "load" in pair[0]:
                    chosen = {name: (evict(root), fn) for name, fn in chosen.items()}
                elif part != "async" and "save" in pair[0]:  # no candidate pays for the other's writeback
                    chosen = {name: settled(fn, os.sync) for name, fn in chosen.items()}
                if isinstance(chosen[pair[0]], tuple):
                    medians.update(alternate_settled(chosen, repeats, isolated=part != "async"))
                else:
                    medians.update(alternate(chosen, repeats))
            title = f"Checkpoint, {part}" + (", loads from a cold page cache" if args.cold else "")
            print(report(title, medians, size), "\n", flush=True)


if __name__ == "__main__":
    main()
