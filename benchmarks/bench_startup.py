"""Start-up as a user feels it: whole Python processes, from launch to exit.

Question: how long does a fresh process take to import danling, and to reach its first training
step, against torch alone and against Lightning? Each candidate is one `python -c ...` process:

- `python` (nothing imported), `import torch`, `import danling`, `import lightning`;
- time to first step of the same tiny workload (the MLP of `bench_peers.py`, batch 32, AdamW,
  one optimizer step on a `TensorDataset` through torch's `DataLoader`), written three ways: by
  hand with torch, with danling's `TorchRunner` (`steps=1`, no logging, no checkpoint writes),
  and with a Lightning `Trainer` (`max_steps=1`, no logger, checkpointing or progress bar).

Rounds run every candidate once, alternating the order (reversed every other round); the table
gives the median wall time of each and the median of per-round ratios to `import torch` (import
rows) or to the hand-written first step. Candidates whose package is missing are skipped.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import statistics
import subprocess
import sys
import tempfile
import time

WORKLOAD = """
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset
torch.manual_seed(0)
data = TensorDataset(torch.randn(256, 64), torch.randint(0, 10, (256,)))
def make_model():
    return nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 128), nn.ReLU(), nn.Linear(128, 10))
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
config = dl.RunnerConfig(workspace_root=sys.argv[1], steps=1, epochs=None, seed=0, log=False,
    evaluate_splits=["train"], **{"optim.type": "adamw", "dataloader.batch_size": 32, "checkpoint.load_only": True})
runner = Runner(config)
runner.train_steps(["train"], [])
runner.close()
"""
)

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
)

IMPORTS = {
    "python (no import)": ("pass", None),
    "import torch": ("import torch", None),
    "import danling": ("import danling", None),
    "import lightning": ("import lightning", "lightning"),
}
FIRST_STEP = {
    "first step, hand-written (torch)": (HAND, None),
    "first step, danling TorchRunner": (RUNNER, None),
    "first step, Lightning Trainer": (LIGHTNING, "lightning"),
}


def run(code: str, workspace: str) -> float:
    start = time.perf_counter()
    subprocess.run([sys.executable, "-c", code, workspace], check=True, capture_output=True)
    return time.perf_counter() - start


def table(title: str, candidates: dict[str, str], baseline: str, rounds: int, workspace: str, warm: bool) -> str:
    names = list(candidates)
    for name in names if warm else ():  # warm the page cache with every module the candidates read
        run(candidates[name], workspace)
    samples: dict[str, list[float]] = {name: [] for name in names}
    for round_ in range(rounds):
        for name in names if round_ % 2 == 0 else names[::-1]:
            samples[name].append(run(candidates[name], workspace))
    lines = [f"### {title}\n", f"| process | wall time (ms) | ratio to {baseline} |", "| --- | ---: | ---: |"]
    for name in names:
        ratio = statistics.median(mine / base for mine, base in zip(samples[name], samples[baseline]))
        lines.append(f"| {name} | {statistics.median(samples[name]) * 1e3:.0f} | {ratio:.2f} |")
    return "\n".join(lines)


def available(candidates: dict[str, tuple[str, str | None]], notes: list[str]) -> dict[str, str]:
    kept = {}
    for name, (code, package) in candidates.items():
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
    args = parser.parse_args(argv)
    rounds, warm = (1, False) if args.quick else (args.rounds, True)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    notes: list[str] = []
    with tempfile.TemporaryDirectory() as workspace:
        if args.only != "first-step":
            imports = available(IMPORTS, notes)
            print(table("Import time, whole process", imports, "import torch", rounds, workspace, warm) + "\n")
        if args.only != "imports":
            first = available(FIRST_STEP, notes)
            title = "Time to first training step, whole process"
            print(table(title, first, "first step, hand-written (torch)", rounds, workspace, warm) + "\n")
    for note in notes:
        print(note)


if __name__ == "__main__":
    main()
