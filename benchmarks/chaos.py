"""Chaos harness: SIGKILL a training run again and again, resume it, and check that nothing was lost.

A small run (a `TorchRunner` MLP, step mode, accumulation, EMA, a cosine schedule, asynchronous
checkpoints every 2 steps and an evaluation every 4) is trained once without interruption, then
again with `auto_resume` while it is SIGKILLed `--kills` times, each time either

- at a random moment of the run (`random`), or
- inside a save: at the N-th `os.replace`, `os.rename` or `os.fsync` call of the process (`inject`),
  N drawn from the calls an uninterrupted run makes, so the kill lands between the writes, renames
  and fsyncs of checkpoints, pointers and result files.

With `--world-size 2` both ranks run under DDP (gloo); a random kill ends both ranks, an injected
one ends rank 0 and the harness then ends rank 1, as a launcher would. After the kills the run is
resumed until it finishes, and the harness counts:

- `lost`: checkpoints that verified after an earlier kill and are gone or no longer verify later,
  plus checkpoints of the uninterrupted run missing at the end;
- `corrupt`: published checkpoints (not staging directories) that fail verification after a kill;
- `wrong_alias`: restarts that resumed from anything but the newest verifying checkpoint, plus
  `latest`/`best` pointers that differ from the uninterrupted run's at the end;
- `stale`: result files (`results.json`, `latest.json`, `best.json`) that disagree at the end with
  the rows of the run's own newest checkpoint (derived state that was not healed);
- `rows_differ`: result rows of the newest checkpoint that differ from the uninterrupted run's
  (a value that a resume did not reproduce exactly, e.g. a training loss averaged over the
  batches since the previous row when the resume came in between);
- `leftovers`: files or directories at the end that the uninterrupted run does not have;
- `bit_exact`: whether the final weights and EMA weights equal the uninterrupted run's bit for bit,
  in every completed run (`campaigns`: a kill that comes after the run finished completes one,
  and the next kills go to a new run).

Every launch is a `fork` of this process (torch and danling are imported once), so a kill and a
restart cost a fraction of a second. Run it as

    python benchmarks/chaos.py --kills 50 --world-size 1
    python benchmarks/chaos.py --kills 20 --world-size 2

(`PYTHONPATH` at the repository root). `run_chaos` is what the test suite calls with a few kills.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import signal
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch
from torch import nn
from torch.utils.data import TensorDataset

from danling.checkpoint.manifest import CheckpointError, verify_directory
from danling.runners import TorchRunner
from tests.dist import fork_scenario, free_ports  # the test suite's launch helpers

INJECTED_CALLS = ("replace", "rename", "fsync")
RESULT_FILES = ("results.json", "latest.json", "best.json")


class ChaosRunner(TorchRunner):
    """A small regression run whose result depends on every RNG a resume must restore (dropout, shuffling)."""

    def __init__(self, config: Any) -> None:
        super().__init__(config)
        world = int(os.environ.get("WORLD_SIZE", "1"))
        generator = torch.Generator().manual_seed(0)
        x = torch.randn(24 * world, 4, generator=generator)
        y = x @ torch.tensor([[1.0], [-2.0], [0.5], [3.0]]) + 0.1 * torch.randn(24 * world, 1, generator=generator)
        self.datasets.train = TensorDataset(x, y)
        self.datasets.val = TensorDataset(x[:8], y[:8])
        self.model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Dropout(0.1), nn.Linear(8, 1))
        self.criterion = nn.MSELoss()


def chaos_config(root: Path) -> dict[str, Any]:
    """The run every launch makes: 24 steps of windows of 2 micro-batches, a checkpoint every 2 steps."""
    return {
        "workspace_root": str(root),
        "epochs": None,
        "steps": 24,
        "seed": 0,
        "deterministic": True,
        "log": False,
        "auto_resume": True,
        "accum_steps": 2,
        "evaluate_interval": 4,
        "optim.type": "adamw",
        "optim.lr": 0.01,
        "scheduler.type": "cosine",
        "ema.enabled": True,
        "ema.decay": 0.9,
        "dataloader.batch_size": 4,
        "checkpoint.interval": 2,
        "checkpoint.async_enabled": True,
        "csv.enabled": False,
        "watchdog.timeout_seconds": 20.0,
    }


# ------------------------------------------------------------------ one launch (a forked child)


def _arm(call: str, at: int) -> None:
    """SIGKILL this process at the `at`-th call of `os.<call>` (any thread)."""
    real, calls = getattr(os, call), [0]

    def counted(*args: Any, **kwargs: Any) -> Any:
        calls[0] += 1
        if calls[0] == at:
            os.kill(os.getpid(), signal.SIGKILL)
        return real(*args, **kwargs)

    setattr(os, call, counted)


def _count_calls(counts: dict[str, int]) -> None:
    for call in INJECTED_CALLS:
        real = getattr(os, call)

        def counted(*args: Any, _real: Any = real, _call: str = call, **kwargs: Any) -> Any:
            counts[_call] += 1
            return _real(*args, **kwargs)

        setattr(os, call, counted)


def _train(root: Path, rank: int, inject: tuple[str, int] | None) -> None:
    """The body of one launch: resume when there is a checkpoint, train to the end, write the final state."""
    counts = dict.fromkeys(INJECTED_CALLS, 0)
    if inject is not None and rank == 0:
        _arm(*inject)
    elif inject is None:
        _count_calls(counts)
    with ChaosRunner(chaos_config(root)) as runner:
        start = runner.train_state.global_step
        (root / f"start-rank{rank}.json").write_text(json.dumps({"step": start}))
        runner.train()
        final = {"model": runner.unwrap(runner.model).state_dict(), "ema": runner.unwrap(runner.ema).state_dict()}
        torch.save(final, root / f"final-rank{rank}.pt")
    (root / f"calls-rank{rank}.json").write_text(json.dumps(counts))


def _fork(root: Path, rank: int, world_size: int, port: int, inject: tuple[str, int] | None) -> int:
    def body() -> None:
        if world_size > 1:
            os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size))
            os.environ.update(LOCAL_WORLD_SIZE=str(world_size), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        _train(root, rank, inject)

    return fork_scenario(str(root / f"launch-rank{rank}.log"), None, body, append=True)


def launch(
    root: Path, world_size: int, *, inject: tuple[str, int] | None = None, kill_after: float | None = None
) -> str:
    """Run one launch of the training: `"finished"`, `"killed"`, or `"failed"` (an error, see the launch logs).

    With `kill_after`, every rank is SIGKILLed after that many seconds unless it finished first;
    when a rank dies (an injected kill), the others are SIGKILLed at once.
    """
    port = free_ports(1)[0]
    pids = {_fork(root, rank, world_size, port, inject): rank for rank in range(world_size)}
    deadline = None if kill_after is None else time.monotonic() + kill_after
    statuses: dict[int, int] = {}
    while len(statuses) < len(pids):
        for pid in pids:
            if pid not in statuses:
                done, status = os.waitpid(pid, os.WNOHANG)
                if done:
                    statuses[pid] = status
        abnormal = any(os.WIFSIGNALED(s) or os.WEXITSTATUS(s) for s in statuses.values())
        if abnormal or (deadline is not None and time.monotonic() > deadline):
            for pid in pids:
                if pid not in statuses:
                    os.kill(pid, signal.SIGKILL)
                    statuses[pid] = os.waitpid(pid, 0)[1]
        time.sleep(0.005)  # polling the children: nothing to synchronise with
    if any(os.WIFSIGNALED(s) for s in statuses.values()):
        return "killed"
    return "finished" if all(os.WEXITSTATUS(s) == 0 for s in statuses.values()) else "failed"


# ------------------------------------------------------------------ what a kill left behind


@dataclass
class ChaosReport:
    """Counts of one chaos run (see the module docstring)."""

    world_size: int
    kills: int = 0
    random_kills: int = 0
    injected_kills: int = 0
    restarts: int = 0
    campaigns: int = 0
    resumed_mid_run: int = 0
    lost: int = 0
    corrupt: int = 0
    wrong_alias: int = 0
    stale: int = 0
    rows_differ: int = 0
    leftovers: int = 0
    bit_exact: bool = False
    seconds: float = 0.0
    notes: list[str] = field(default_factory=list)


def _run_dir(root: Path) -> Path | None:
    found = sorted(root.glob("*/*/checkpoints"))
    if len(found) > 1:  # a launch that did not continue the run (a new version): the harness would compare nothing
        raise RuntimeError(f"launches used different run directories: {[str(p.parent) for p in found]}")
    return found[0].parent if found else None


def _verified(checkpoints: Path) -> tuple[set[str], set[str]]:
    """Names of the published checkpoints that verify, and of those that do not."""
    good, bad = set(), set()
    for path in sorted(checkpoints.iterdir()) if checkpoints.is_dir() else ():
        if path.is_dir() and not path.name.startswith(".") and path.name.split("-")[0] in ("step", "epoch"):
            try:
                verify_directory(path)
                good.add(path.name)
            except CheckpointError:
                bad.add(path.name)
    return good, bad


def _after_kill(root: Path, report: ChaosReport, seen: set[str]) -> int | None:
    """Count corrupt and lost checkpoints after a kill; return the step a correct restart resumes from."""
    import logging

    from danling.checkpoint.layout import recover_directory
    from danling.runners.reconcile import newest_valid_checkpoint

    run_dir = _run_dir(root)
    if run_dir is None:
        return 0
    checkpoints = run_dir / "checkpoints"
    recover_directory(checkpoints, logging.getLogger("chaos"))  # what every manager does when it starts
    good, bad = _verified(checkpoints)
    report.corrupt += len(bad)
    lost = seen - good
    report.lost += len(lost)
    report.notes += [f"kill {report.kills}: corrupt {sorted(bad)}"] * bool(bad)
    report.notes += [f"kill {report.kills}: lost {sorted(lost)}"] * bool(lost)
    seen |= good
    newest = newest_valid_checkpoint(checkpoints)
    return 0 if newest is None else int(newest.name.split("-")[1])


def _check_resume(root: Path, report: ChaosReport, expected: int | None) -> None:
    start = root / "start-rank0.json"
    if expected is None or not start.exists():
        return
    resumed = json.loads(start.read_text())["step"]
    report.resumed_mid_run += resumed > 0
    if resumed != expected:
        report.wrong_alias += 1
        report.notes.append(f"restart {report.restarts}: resumed step {resumed}, newest valid checkpoint {expected}")


def _listing(run_dir: Path) -> set[str]:
    """Every path in the run directory but the log files (a rank that warned has one, the reference may not)
    and the per-launch records: `code/launch-<N>.diff` of a dirty checkout, and the heartbeats a launch
    killed after its last save leaves (what `danling runs` reads to say where a dead launch was)."""
    paths = (path.relative_to(run_dir) for path in run_dir.rglob("*") if path.suffix != ".log")
    return {str(path) for path in paths if path.parts[0] not in ("code", "heartbeats")}


def _first_difference(ref: Any, got: Any, where: str = "") -> str:
    if isinstance(ref, dict) and isinstance(got, dict):
        for key in sorted(set(ref) | set(got), key=str):
            if ref.get(key) != got.get(key):
                return _first_difference(ref.get(key), got.get(key), f"{where}.{key}")
    return f"{where or '.'}: {got!r} instead of {ref!r}"


def _compare_end(reference: Path, chaos: Path, report: ChaosReport) -> None:
    """The end state of the chaos run against the uninterrupted one."""
    from danling.checkpoint.layout import follow_pointer

    ref_dir, run_dir = _run_dir(reference), _run_dir(chaos)
    assert ref_dir is not None and run_dir is not None
    missing = _verified(ref_dir / "checkpoints")[0] - _verified(run_dir / "checkpoints")[0]
    report.lost += len(missing)
    for alias in ("latest", "best"):
        ref, got = (follow_pointer(d / "checkpoints" / f"{alias}.pointer").name for d in (ref_dir, run_dir))
        if ref != got:
            report.wrong_alias += 1
            report.notes.append(f"end: {alias} -> {got}, uninterrupted run: {ref}")
    _compare_results(ref_dir, run_dir, report)
    extra = sorted(_listing(run_dir) - _listing(ref_dir))
    # A launch killed before its first checkpoint has its files moved to failed/launch-<start>/ by design
    # (the workspace keeps them as evidence instead of mixing them into the next launch): not a leftover.
    aside = [name for name in extra if name == "failed" or name.startswith("failed/launch-")]
    extra = [name for name in extra if name not in aside]
    report.leftovers += len(extra)
    report.notes += [f"end: leftover {name}" for name in extra]
    report.notes += [f"end: moved aside (a launch killed before its first checkpoint) {name}" for name in aside[:1]]
    same = all(
        _same_state(torch.load(reference / name, weights_only=True), torch.load(chaos / name, weights_only=True))
        for name in (f"final-rank{rank}.pt" for rank in range(report.world_size))
    )
    report.bit_exact = same and (report.bit_exact or not report.campaigns)  # every completed run was exact
    report.campaigns += 1


def _compare_results(ref_dir: Path, run_dir: Path, report: ChaosReport) -> None:
    """Result files against the run's own newest checkpoint (`stale`) and rows against the reference (`rows_differ`)."""
    from danling.checkpoint import read_checkpoint

    stored = json.loads(json.dumps(dict(read_checkpoint(run_dir / "checkpoints" / "latest.pointer")["results"])))
    files = {name: _read_json(run_dir / name) for name in RESULT_FILES}
    last = max(stored, key=int)
    wanted = {"results.json": stored, "latest.json": stored[last]}
    best = files["best.json"]
    if isinstance(best, dict) and str(best.get("index")) in stored:
        wanted["best.json"] = stored[str(best["index"])]
    for name, rows in wanted.items():
        found = files[name]
        found = found.get("results") if name == "results.json" and isinstance(found, dict) else found
        if isinstance(found, dict) and name != "results.json":
            found = {k: v for k, v in found.items() if k not in ("id", "timestamp", "index")}
        if found != rows:
            report.stale += 1
            report.notes.append(f"end: {name} disagrees with the newest checkpoint at {_first_difference(rows, found)}")
    reference = (_read_json(ref_dir / "results.json") or {}).get("results", {})
    for index in sorted(set(reference) | set(stored), key=int):
        if reference.get(index) != stored.get(index):
            report.rows_differ += 1
            report.notes.append(f"end: row {index} {_first_difference(reference.get(index), stored.get(index))}")


def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def _same_state(a: dict[str, Any], b: dict[str, Any]) -> bool:
    return all(
        a[part].keys() == b[part].keys() and all(torch.equal(a[part][k], b[part][k]) for k in a[part]) for part in a
    )


# ------------------------------------------------------------------ the campaign


def reference_run(root: Path, world_size: int) -> tuple[float, dict[str, int]]:
    """The uninterrupted run; returns its duration and how many of each injected call it makes (rank 0)."""
    start = time.monotonic()
    status = launch(root, world_size)
    if status != "finished":
        raise RuntimeError(f"the uninterrupted run {status}; see {root}/launch-rank*.log")
    return time.monotonic() - start, json.loads((root / "calls-rank0.json").read_text())


def run_chaos(root: str | os.PathLike, *, kills: int, world_size: int = 1, seed: int = 0) -> ChaosReport:
    """Kill a run `kills` times (half at random moments, half inside saves), resume it, and compare.

    Args:
        root: Empty directory for the uninterrupted run (`root/reference`) and the chaos run (`root/chaos`).
        kills: Number of SIGKILLs.
        world_size: 1 (one process) or 2 (DDP, gloo).
        seed: Seed of the kill plan.
    """
    root = Path(root)
    reference, chaos = root / "reference", root / "chaos"
    reference.mkdir(parents=True)
    chaos.mkdir(parents=True)
    began = time.monotonic()
    duration, calls = reference_run(reference, world_size)
    report, rng, seen, expected = ChaosReport(world_size), random.Random(seed), set(), None
    while report.kills < kills and report.restarts < 4 * kills + 4:
        (chaos / "start-rank0.json").unlink(missing_ok=True)
        if rng.random() < 0.5:
            call = rng.choice([c for c in INJECTED_CALLS if calls[c]])
            status = launch(chaos, world_size, inject=(call, rng.randint(1, calls[call])))
            kind = "injected_kills"
        else:
            status = launch(chaos, world_size, kill_after=rng.uniform(0.0, duration))
            kind = "random_kills"
        report.restarts += 1
        _check_resume(chaos, report, expected)
        if status == "failed":
            raise RuntimeError(f"a launch failed; see {chaos}/launch-rank*.log")
        if status == "finished":  # the kill came too late: check the complete run, then start a new one
            _compare_end(reference, chaos, report)
            report.notes.append(f"restart {report.restarts}: finished before its kill; starting over")
            shutil.rmtree(chaos)
            chaos.mkdir()
            seen, expected = set(), None
            continue
        report.kills += 1
        setattr(report, kind, getattr(report, kind) + 1)
        expected = _after_kill(chaos, report, seen)
    (chaos / "start-rank0.json").unlink(missing_ok=True)
    if launch(chaos, world_size) != "finished":
        raise RuntimeError(f"the final launch did not finish; see {chaos}/launch-rank*.log")
    _check_resume(chaos, report, expected)
    _compare_end(reference, chaos, report)
    report.seconds = round(time.monotonic() - began, 1)
    return report


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--kills", type=int, default=50)
    parser.add_argument("--world-size", type=int, choices=(1, 2), default=1)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--root", default=None, help="working directory (default: a fresh temporary one)")
    args = parser.parse_args(argv)
    import tempfile

    root = Path(args.root) if args.root else Path(tempfile.mkdtemp(prefix="danling-chaos-"))
    report = run_chaos(root, kills=args.kills, world_size=args.world_size, seed=args.seed)
    print(json.dumps(asdict(report), indent=2))
    if not args.root:  # kept when the run fails: its logs say why (the error names the directory)
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
