"""Checkpoint managers against the raw calls they wrap, on one state, in one process.

Question: how much does a verified, durable checkpoint cost over `torch.save` / `torch.load`
and `dcp.save` / `dcp.load` of the same state?

- file: `FileCheckpointManager.save` / `.load_into` against `torch.save` + fsync of the file and
  of its directory / `torch.load` + `load_state_dict`;
- dcp: `TorchDistributedCheckpointManager.save` / `.load_into` against `dcp.save` (which fsyncs
  its files) + fsync of the directory / `dcp.load` + `set_state_dict`;
- async: the time `save` takes to return to the caller with ``async_save=True`` against
  `dcp.async_save` of the same state, and the time until the write is durable (`save` + `wait`
  against `async_save` + `result()`).

Every candidate writes the same model + AdamW state (sized by ``--mib``, one or more sizes); runs
alternate and the table reports medians of the wall time and of the process's CPU time (all
threads) and their ratios to the raw call. A second copy of the raw call, timed like the others,
is the A/A control: its ratio is the noise floor of the run. ``--profile`` prints a cProfile of one
manager save and one load of each backend instead; ``--json`` and ``--plot`` keep the figures.
"""

from __future__ import annotations

import argparse
import itertools
import json
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
from common import fsync_file, load_line, profile_call

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


def _raw_file(model: nn.Module, optimizer: torch.optim.Optimizer, root: Path) -> dict[str, Callable]:
    """What a careful user writes: `torch.save`, fsync of the file and of its directory; `torch.load` +
    `load_state_dict`. Like the managers (keep_latest_k=1), it writes a new file while the previous
    one exists and deletes that one once the new one is written (see `Retirement`)."""
    root.mkdir()
    paths = [root / "a.pt", root / "b.pt"]
    retirement = Retirement(_remove)

    def save() -> None:
        paths.reverse()
        torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict()}, paths[0])
        fsync_file(os.fspath(paths[0]))
        fsync_file(os.fspath(root))  # the new name survives a power loss too
        retirement.retire(paths[1])

    def load() -> None:
        payload = torch.load(paths[0], weights_only=True)
        model.load_state_dict(payload["model"])
        optimizer.load_state_dict(payload["optimizer"])

    return {"save": (retirement.settle, save), "load": load}


def file_candidates(model: nn.Module, optimizer: torch.optim.Optimizer, root: Path) -> dict[str, dict]:
    raw, twin = _raw_file(model, optimizer, root / "raw"), _raw_file(model, optimizer, root / "twin")
    manager = FileCheckpointManager(root / "file", keep_latest_k=1)
    objects = {"model": model, "optimizer": optimizer}
    counter = itertools.count()
    return {
        "save": {
            "torch.save + fsync": raw["save"],
            "A/A: torch.save + fsync": twin["save"],
            "FileCheckpointManager.save": (manager.wait, lambda: manager.save(objects, f"step-{next(counter)}")),
        },
        "load": {
            "torch.load + load_state_dict": raw["load"],
            "A/A: torch.load + load_state_dict": twin["load"],
            "FileCheckpointManager.load_into": lambda: manager.load_into("latest", objects),
        },
    }


def _raw_dcp(model: nn.Module, optimizer: torch.optim.Optimizer, root: Path) -> dict[str, Callable]:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    root.mkdir()
    dirs = [root / "a", root / "b"]
    retirement = Retirement(_remove)  # as in `_raw_file`

    def save() -> None:
        dirs.reverse()
        model_state, optim_state = get_state_dict(model, optimizer)
        dcp.save({"model": model_state, "optimizer": optim_state}, checkpoint_id=dirs[0], no_dist=True)
        fsync_file(os.fspath(root))  # dcp.save fsyncs its files, not the directory that names the checkpoint
        retirement.retire(dirs[1])

    def load() -> None:
        model_state, optim_state = get_state_dict(model, optimizer)
        state = {"model": model_state, "optimizer": optim_state}
        dcp.load(state, checkpoint_id=dirs[0], no_dist=True)
        set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"])

    return {"save": (retirement.settle, save), "load": load}


def dcp_candidates(model: nn.Module, optimizer: torch.optim.Optimizer, root: Path) -> dict[str, dict]:
    raw, twin = _raw_dcp(model, optimizer, root / "raw"), _raw_dcp(model, optimizer, root / "twin")
    manager = TorchDistributedCheckpointManager(root / "dcp", keep_latest_k=1)
    counter = itertools.count()

    def objects() -> dict:
        return {"model": ModelState(model), "optimizer": OptimizerState(model, optimizer)}

    return {
        "save": {
            "dcp.save": raw["save"],
            "A/A: dcp.save": twin["save"],
            "DCP manager save": (manager.wait, lambda: manager.save(objects(), f"step-{next(counter)}")),
        },
        "load": {
            "dcp.load + set_state_dict": raw["load"],
            "A/A: dcp.load + set_state_dict": twin["load"],
            "DCP manager load_into": lambda: manager.load_into("latest", objects()),
        },
    }


def async_candidates(model: nn.Module, optimizer: torch.optim.Optimizer, root: Path) -> dict[str, dict]:
    """Each candidate is (settle, call): `settle` waits for the previous write (untimed).

    "returns" times `save` until control returns to training; "durable" times `save` and the wait
    for its write together, so the figure includes the last write's fsyncs, as a run's last
    checkpoint does (the manager waits for it before the process exits); "cleared" also waits
    for the deletion of the checkpoint the save replaced (`wait()` without a timeout, as `close`
    does), which the raw call, writing over its one directory in place, has no counterpart of:
    at 517 MiB that deletion took 110-140 ms after the write.
    """
    manager = TorchDistributedCheckpointManager(root / "async", keep_latest_k=1, async_save=True)
    raw, twin = _raw_async(model, optimizer, root / "raw-async"), _raw_async(model, optimizer, root / "twin-async")

    def mine_start() -> None:
        manager.save({"model": ModelState(model), "optimizer": OptimizerState(model, optimizer)}, "ckpt")

    def mine_durable() -> None:
        mine_start()
        manager.wait(timeout=3600)  # with a timeout, `wait` returns once the write is durable

    def mine_cleared() -> None:
        mine_start()
        manager.wait()  # ... without one, once the checkpoint it replaced is deleted too

    return {
        "returns": {
            "dcp.async_save (returns)": (raw["settle"], raw["start"]),
            "A/A: dcp.async_save (returns)": (twin["settle"], twin["start"]),
            "DCP manager async save (returns)": (manager.wait, mine_start),
        },
        "durable": {
            "dcp.async_save + result (durable)": (raw["settle"], raw["durable"]),
            "A/A: dcp.async_save + result (durable)": (twin["settle"], twin["durable"]),
            "DCP manager async save + wait(timeout) (durable)": (manager.wait, mine_durable),
        },
        "cleared": {
            "dcp.async_save + result (durable, overwritten in place)": (raw["settle"], raw["durable"]),
            "A/A: dcp.async_save + result (durable, overwritten in place)": (twin["settle"], twin["durable"]),
            "DCP manager async save + wait() (durable, replaced checkpoint deleted)": (manager.wait, mine_cleared),
        },
    }


def _raw_async(model: nn.Module, optimizer: torch.optim.Optimizer, path: Path) -> dict[str, Callable]:
    """`dcp.async_save` into `path`: start it, wait for its write, or both plus the directory's fsync."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    pending: list = []

    def settle() -> None:
        while pending:
            pending.pop().result()

    def start() -> None:
        model_state, optim_state = get_state_dict(model, optimizer)
        state = {"model": model_state, "optimizer": optim_state}
        pending.append(dcp.async_save(state, checkpoint_id=path, no_dist=True))

    def durable() -> None:
        start()
        settle()
        fsync_file(os.fspath(path.parent))

    return {"settle": settle, "start": start, "durable": durable}


def alternate_settled(candidates: dict[str, tuple[Callable, Callable]], repeats: int) -> dict[str, tuple[float, float]]:
    """Median (wall, CPU) seconds of each candidate's timed call; its previous background work (an
    async write, deleting the copy a save replaced) finishes, untimed, before each call.

    The CPU time is the process's (every thread: the helper threads that hash and fsync count),
    which a busy shared machine disturbs far less than the wall clock.

    Every candidate's background work has finished before any timed call starts, and the order
    is reversed every other round: on this VM the second of two 1 GiB saves in a row was often
    the slow one, whichever it was. The async rows once used a plain order, each candidate
    settling only its own work, until their A/A control showed that the last candidate of a
    round, danling's, ran while the others' deletions and writeback were still going: at 517 MiB
    its durable time read 1.5-1.8x that way and 1.00x settled. (`dcp.async_save` copies into
    fresh buffers each call, so its time to return still swings with how long ago its previous
    ones were freed: see the A/A column.)
    """
    walls: dict[str, list[float]] = {name: [] for name in candidates}
    cpus: dict[str, list[float]] = {name: [] for name in candidates}
    names = list(candidates)
    for round_ in range(repeats + 1):
        for name in names[::-1] if round_ % 2 == 0 else names:
            for settle, _ in candidates.values():
                settle()
            began, cpu = time.perf_counter(), time.process_time()
            candidates[name][1]()
            if round_:  # the first round warms up
                walls[name].append(time.perf_counter() - began)
                cpus[name].append(time.process_time() - cpu)
    for settle, _ in candidates.values():
        settle()
    return {name: (statistics.median(walls[name]), statistics.median(cpus[name])) for name in candidates}


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


def report(title: str, groups: dict[str, dict[str, tuple[float, float]]], size: int) -> str:
    """One row per operation: the raw call's time, then each other candidate's ratio to it (wall and CPU)."""
    rows = [f"### {title}: {size / 2**20:.0f} MiB of model + AdamW state", ""]
    rows += [
        "| operation | raw (ms) | A/A wall | danling (ms) | wall ratio | raw CPU (ms) | A/A CPU | danling CPU ratio |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for medians in groups.values():
        names = list(medians)
        raw, mine = medians[names[0]], medians[names[-1]]
        twin = medians[names[1]] if len(names) == 3 else None
        aa_wall = f"{twin[0] / raw[0]:.2f}" if twin else ""
        aa_cpu = f"{twin[1] / raw[1]:.2f}" if twin else ""
        rows.append(
            f"| {names[-1]} vs {names[0]} | {raw[0] * 1e3:.1f} | {aa_wall} | {mine[0] * 1e3:.1f} | "
            f"{mine[0] / raw[0]:.2f} | {raw[1] * 1e3:.1f} | {aa_cpu} | {mine[1] / raw[1]:.2f} |"
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


def measure(part: str, mib: int, repeats: int, tmp: str, cold: bool, profile_lines: int = 0) -> dict | str:
    """Time (or profile) one backend at one size: `{"size": bytes, "groups": {group: {name: (wall, cpu)}}}`."""
    torch.manual_seed(0)
    model, optimizer, size = build(mib)
    root = Path(tmp) / f"{part}-{mib}"
    root.mkdir()
    build_candidates = {"file": file_candidates, "dcp": dcp_candidates, "async": async_candidates}[part]
    groups = build_candidates(model, optimizer, root)
    try:
        if profile_lines:
            mine = {name: fn for group in groups.values() for name, fn in group.items()}
            return profile(mine, [name for name in mine if "manager" in name.lower()], profile_lines)
        results: dict[str, dict[str, tuple[float, float]]] = {}
        for group, candidates in groups.items():
            if cold and group == "load":
                candidates = {name: (evict(root), fn) for name, fn in candidates.items()}
            elif group == "save":  # no candidate pays for the other's writeback
                candidates = {name: settled(fn, os.sync) for name, fn in candidates.items()}
            else:
                candidates = {name: fn if isinstance(fn, tuple) else settled(fn) for name, fn in candidates.items()}
            results[group] = alternate_settled(candidates, repeats)
        return {"size": size, "groups": results}
    finally:
        shutil.rmtree(root, ignore_errors=True)


def plot(results: list[dict], path: Path) -> None:
    """Checkpoint time against state size, raw call (dashed) and danling (solid), per backend and operation."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import NullFormatter

    measured = sorted({round(r["size"] / 2**20) for r in results})
    figure, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    for axis, operation in zip(axes, ("save", "load")):
        for part, marker in (("file", "o"), ("dcp", "s")):
            chosen = sorted(
                (r for r in results if r["part"] == part and operation in r["groups"]), key=lambda r: r["size"]
            )
            if not chosen:
                continue
            sizes = [r["size"] / 2**20 for r in chosen]
            names = list(chosen[0]["groups"][operation])
            for name, line in ((names[0], "--"), (names[-1], "-")):
                times = [r["groups"][operation][name][0] * 1e3 for r in chosen]
                axis.loglog(sizes, times, line, marker=marker, label=name)
        axis.set(xlabel="model + AdamW state (MiB)", ylabel="median wall time (ms)", title=f"Checkpoint {operation}")
        # Ticks at the measured sizes, as plain numbers (log-axis labels like 3x10^1 overlapped).
        axis.set_xticks(measured, [str(mib) for mib in measured])
        axis.xaxis.set_minor_formatter(NullFormatter())
        axis.grid(True, which="both", alpha=0.3)
        axis.legend(fontsize=7)
    figure.tight_layout()
    figure.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mib", type=int, nargs="+", default=[170], help="sizes of model + optimizer state")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--quick", action="store_true", help="48 MiB, 3 repeats")
    parser.add_argument("--only", choices=("file", "dcp", "async"), action="append")
    parser.add_argument("--cold", action="store_true", help="evict the files from the page cache before each load")
    parser.add_argument("--profile", action="store_true", help="cProfile one manager save and load instead")
    parser.add_argument("--json", type=Path, help="write the medians here")
    parser.add_argument("--plot", type=Path, help="draw save and load time against size here (PNG)")
    args = parser.parse_args(argv)
    sizes, repeats = ([48], 3) if args.quick else (args.mib, args.repeats)
    parts = args.only or ["file", "dcp", "async"]
    warnings.simplefilter("ignore")  # DCP warns that it runs without a process group: intended
    print(load_line("before") + "\n", flush=True)
    results = []
    with tempfile.TemporaryDirectory(dir=os.environ.get("BENCH_DIR")) as tmp:
        for mib in sizes:
            for part in parts:
                if args.profile:
                    if part != "async":
                        print(measure(part, mib, repeats, tmp, args.cold, profile_lines=25))
                    continue
                result = measure(part, mib, repeats, tmp, args.cold)
                results.append({"part": part, "mib": mib, **result})
                title = f"Checkpoint, {part}" + (", loads from a cold page cache" if args.cold else "")
                print(report(title, result["groups"], result["size"]), "\n", flush=True)
    print(load_line("after"), flush=True)
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))
    if args.plot:
        plot(results, args.plot)


if __name__ == "__main__":
    main()
