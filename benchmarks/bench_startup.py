"""Start-up as a user feels it: whole Python processes, from launch to their first optimizer step.

Question: how long does a fresh process take to import danling, and to reach its first training
step, against torch alone and against Lightning? Each candidate is one `python -c ...` process:

- `python` (nothing imported), `import torch`, `import danling`, `import lightning`, timed from
  launch to exit;
- the first optimizer step of the same tiny workload (the MLP of `bench_peers.py`, batch 32,
  AdamW, one optimizer step on a `TensorDataset` through torch's `DataLoader`), written by hand
  with torch (twice: the second copy is the A/A control), with danling's `TorchRunner` as it comes
  (default config: checkpoints, log file, CSV and progress bar on, plus TensorBoard), with the
  runner stripped (`log=False`, no checkpoint writes) and with a Lightning `Trainer` (`max_steps=1`,
  no logger, checkpointing or progress bar). Timed from launch to the end of the first
  `optimizer.step()` (a global optimizer step hook records it), so what a feature does after the
  step (the checkpoint and result writes at the end of the run) is not counted.

Every child reads its bytecode from a cache this script fills in its warm-up pass (a fresh
`PYTHONPYCACHEPREFIX`, with `PYTHONDONTWRITEBYTECODE` cleared): an installed package has its
modules compiled once, so compiling danling's (or torch's) sources on every launch is not what a
user waits for. `--quick` skips the warm-up, so its first candidates compile.

Two clocks: wall time, and the CPU time (user + system) the process had used by then, which a
loaded machine disturbs less. Rounds run every candidate once, alternating the order (reversed
every other round); the table gives the median of each and the median of per-round ratios to
`import torch` (import rows) or to the hand-written first step. Candidates whose package is
missing are skipped.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import os
import pty
import resource
import statistics
import subprocess
import sys
import tempfile
import threading
import time

WORKLOAD = """
import time
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset
torch.manual_seed(0)
data = TensorDataset(torch.randn(256, 64), torch.randint(0, 10, (256,)))
def make_model():
    return nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 128), nn.ReLU(), nn.Linear(128, 10))
def first_step(optimizer, args, kwargs):
    if not stamps:
        stamps.extend((time.time(), time.process_time()))
stamps = []
from torch.optim.optimizer import register_optimizer_step_post_hook
register_optimizer_step_post_hook(first_step)
"""
# Printed at exit: wall clock (epoch seconds) and process CPU time at the end of the first step.
REPORT = """
import sys
print("STAMP", *stamps, file=sys.stderr)
"""

HAND = (
    WORKLOAD
    + """
model = make_model()
optimizer = torch.optim.AdamW(model.parameters())
inputs, target = next(iter(DataLoader(data, batch_size=32)))
nn.functional.cross_entropy(model(inputs), target).backward()
optimizer.step()
"""
    + REPORT
)

RUNNER = (
    WORKLOAD
    + """
import sys
import danling as dl
class Runner(dl.TorchRunner):
    def __init__(self, config):
        super().__init__(config)
        self.datasets.train = data
        self.model = make_model()
        self.criterion = nn.CrossEntropyLoss()
config = dl.RunnerConfig(workspace_root=sys.argv[1], steps=1, epochs=None, seed=0, evaluate_splits=["train"],
    **{"optim.type": "adamw", "dataloader.batch_size": 32}, **OPTIONS)
runner = Runner(config)
runner.train_steps(["train"], [])
runner.close()
"""
    + REPORT
)
# The runner as it comes: checkpoints, log file, CSV and the progress bar are on by default; TensorBoard is added.
RUNNER_DEFAULT = RUNNER.replace("**OPTIONS", "tensorboard=True")
RUNNER_BARE = RUNNER.replace("**OPTIONS", 'log=False, **{"checkpoint.load_only": True}')

LIGHTNING = (
    WORKLOAD
    + """
import lightning as L
class Module(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.net = make_model()
    def training_step(self, batch, batch_idx):
        return nn.functional.cross_entropy(self.net(batch[0]), batch[1])
    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters())
trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=1, logger=False, enable_checkpointing=False,
    enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0)
trainer.fit(Module(), DataLoader(data, batch_size=32))
"""
    + REPORT
)

IMPORTS = {
    "import torch": ("import torch", None),
    "python (no import)": ("pass", None),
    "import danling": ("import danling", None),
    "import lightning": ("import lightning", "lightning"),
}
FIRST_STEP = {
    "hand-written (torch)": (HAND, None),
    "hand-written, second copy (A/A control)": (HAND, None),
    "danling TorchRunner, default config + TensorBoard": (RUNNER_DEFAULT, None),
    "danling TorchRunner, log and checkpoints off": (RUNNER_BARE, None),
    "Lightning Trainer": (LIGHTNING, "lightning"),
}


CHILD_ENV = dict(os.environ)


def run(code: str, workspace: str) -> tuple[float, float]:
    """Wall and CPU seconds from launch to the child's first optimizer step (to its exit if it takes none).

    The child's stdout is a terminal (a pseudo-terminal drained here), as it is for a user at a
    shell, so the runner draws its progress bar; the first-step stamp comes back on stderr.
    """
    main, child_end = pty.openpty()
    drained = threading.Thread(target=drain, args=(main,))
    launched = time.time()
    # A fresh workspace root per launch: runs left by earlier launches would make the runner look
    # through more run directories each time (and write versioned ones), which a first run never does.
    command = [sys.executable, "-c", code, tempfile.mkdtemp(dir=workspace)]
    child = subprocess.Popen(command, stdout=child_end, stderr=subprocess.PIPE, env=CHILD_ENV)
    os.close(child_end)
    drained.start()
    stderr = child.communicate()[1].decode()
    exited = time.time()
    drained.join()
    os.close(main)
    if child.returncode:
        raise RuntimeError(f"candidate exited with {child.returncode}:\n{stderr[-2000:]}")
    stamp = [line.split()[1:] for line in stderr.splitlines() if line.startswith("STAMP")]
    if stamp:
        wall, cpu = map(float, stamp[-1])
        return wall - launched, cpu
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)  # cumulative over every child; differenced below
    return exited - launched, usage.ru_utime + usage.ru_stime


def drain(descriptor: int) -> None:
    """Read a pseudo-terminal until its child side closes, so a child never blocks on a full terminal."""
    with contextlib.suppress(OSError):  # EIO once the child has exited
        while os.read(descriptor, 65536):
            pass


def table(title: str, candidates: dict[str, str], baseline: str, rounds: int, workspace: str, warm: bool) -> str:
    names = list(candidates)
    for name in names if warm else ():  # warm the page cache with every module the candidates read
        run(candidates[name], workspace)
    walls: dict[str, list[float]] = {name: [] for name in names}
    cpus: dict[str, list[float]] = {name: [] for name in names}
    loads = [os.getloadavg()[0]]
    for round_ in range(rounds):
        for name in names if round_ % 2 == 0 else names[::-1]:
            before = resource.getrusage(resource.RUSAGE_CHILDREN)
            wall, cpu = run(candidates[name], workspace)
            if "STAMP" not in candidates[name]:  # an import row: its CPU time is the change of the children's total
                cpu -= before.ru_utime + before.ru_stime
            walls[name].append(wall)
            cpus[name].append(cpu)
        loads.append(os.getloadavg()[0])
    header = f"| process | wall (ms) | ratio to {baseline} (IQR) | fastest / fastest | CPU (ms) | CPU ratio (IQR) |"
    lines = [f"### {title}\n", header, "| --- | ---: | ---: | ---: | ---: | ---: |"]
    for name in names:
        wall = spread([mine / base for mine, base in zip(walls[name], walls[baseline])])
        cpu = spread([mine / base for mine, base in zip(cpus[name], cpus[baseline])])
        fastest = min(walls[name]) / min(walls[baseline])  # noise only adds time: the floors compare cleanly
        row = f"| {name} | {statistics.median(walls[name]) * 1e3:.0f} | {wall} | {fastest:.3f} "
        lines.append(row + f"| {statistics.median(cpus[name]) * 1e3:.0f} | {cpu} |")
    lines.append(f"\n{rounds} rounds; 1-minute load average {min(loads):.2f}-{max(loads):.2f} during the run.")
    return "\n".join(lines)


def spread(ratios: list[float]) -> str:
    """`median (first quartile-third quartile)` of per-round ratios."""
    if len(ratios) < 2:
        return f"{ratios[0]:.3f}"
    low, _, high = statistics.quantiles(ratios, n=4, method="inclusive")
    return f"{statistics.median(ratios):.3f} ({low:.3f}-{high:.3f})"


def available(
    candidates: dict[str, tuple[str, str | None]], notes: list[str], select: list[str] | None
) -> dict[str, str]:
    kept = {}
    for index, (name, (code, package)) in enumerate(candidates.items()):
        if index and select and not any(text in name for text in select):  # the first is the baseline
            continue
        if package is not None and importlib.util.find_spec(package) is None:
            notes.append(f"{name} skipped: `{package}` is not installed (pip install -e '.[bench]')")
        else:
            kept[name] = code
    return kept


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--quick", action="store_true", help="one round, no warm-up pass (a smoke run)")
    parser.add_argument("--only", choices=["imports", "first-step"], help="one of the two tables")
    parser.add_argument("--select", nargs="+", metavar="TEXT", help="only candidates whose name holds one of these")
    parser.add_argument("--before", metavar="DIR", help="also the default-config runner from this source tree")
    args = parser.parse_args(argv)
    rounds, warm = (1, False) if args.quick else (args.rounds, True)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    notes: list[str] = []
    with tempfile.TemporaryDirectory() as workspace:
        CHILD_ENV.pop("PYTHONDONTWRITEBYTECODE", None)
        CHILD_ENV["PYTHONPYCACHEPREFIX"] = os.path.join(workspace, "pycache")
        if args.only != "first-step":
            imports = available(IMPORTS, notes, args.select)
            print(table("Import time, whole process", imports, "import torch", rounds, workspace, warm) + "\n")
        if args.only != "imports":
            first = available(FIRST_STEP, notes, args.select)
            if args.before:  # the same runner from another tree: its directory goes first on sys.path
                tree = os.path.abspath(args.before)
                first[f"danling TorchRunner, default config + TensorBoard, {tree}"] = (
                    f"import sys\nsys.path.insert(0, {tree!r})\n" + RUNNER_DEFAULT
                )
            title = "Launch to the end of the first optimizer step, whole process"
            print(table(title, first, "hand-written (torch)", rounds, workspace, warm) + "\n")
    for note in notes:
        print(note)


if __name__ == "__main__":
    main()
