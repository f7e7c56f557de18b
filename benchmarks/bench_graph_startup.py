"""GraphRunner start-up: how much of the first step's compilation a second launch skips with saved artifacts.

Question: with `compile.precompile_artifact_dir`, how long does a fresh process take from launch
to the end of its first training step when it loads the artifacts a previous launch saved,
against one that compiles from nothing? Every launch gets its own empty inductor cache
(`TORCHINDUCTOR_CACHE_DIR`), so only the artifacts carry compiled kernels over.

Workload: the MLP of `bench_startup.py` (64-128-128-10, batch 32, AdamW, cross-entropy) on the
`graph` stack with inductor, `steps=1`, no logging. A warm-up launch writes the artifacts once;
then each round runs a cold launch (no artifacts) and a warm launch (the saved artifacts), in
alternating order. The table gives the medians and the median of the per-round ratios.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

CHILD = """
import json, sys, time
import torch
from torch import nn
from torch.utils.data import TensorDataset
import danling as dl
torch.manual_seed(0)
data = TensorDataset(torch.randn(256, 64), torch.randint(0, 10, (256,)))
class Runner(dl.GraphRunner):
    def __init__(self, config):
        super().__init__(config)
        self.datasets.train = data
        self.model = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 128), nn.ReLU(), nn.Linear(128, 10))
        self.criterion = nn.CrossEntropyLoss()
config = {"stack": "graph", "workspace_root": sys.argv[1], "steps": 1, "seed": 0, "log": False, "log_interval": 0,
          "optim.type": "adamw", "dataloader.batch_size": 32,
          "compile.precompile_artifact_dir": sys.argv[2] or None}
first = []
with Runner(config) as runner:
    runner.events.subscribe(dl.Events.STEP_END, lambda _: first or first.append(time.time()))
    runner.train()
    loaded = runner.compile_artifacts.loaded if runner.compile_artifacts else {}
print(json.dumps({"first_step_at": first[0], "loaded": loaded}))
"""


def launch(root: Path, artifacts: str, *, loads: bool | None = None) -> float:
    """Seconds from launching a fresh process to the end of its first training step."""
    cache = tempfile.mkdtemp(dir=root, prefix="inductor-")
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": cache}
    started = time.time()
    done = subprocess.run(
        [sys.executable, "-c", CHILD, tempfile.mkdtemp(dir=root, prefix="run-"), artifacts],
        env=env,
        capture_output=True,
        text=True,
        check=False,
    )
    if done.returncode:
        raise RuntimeError(f"the launch failed:\n{done.stderr[-3000:]}")
    report = json.loads(done.stdout.strip().splitlines()[-1])
    loads = bool(artifacts) if loads is None else loads
    if bool(report["loaded"]) != loads or (loads and "inductor" not in report["loaded"]):
        raise RuntimeError(f"expected the artifacts {'loaded' if loads else 'absent'}, got {report['loaded']}")
    return report["first_step_at"] - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="bench-graph-") as name:
        root = Path(name)
        artifacts = str(root / "artifacts")
        launch(root, artifacts, loads=False)  # warm-up: compiles and writes the artifacts the warm launches load
        cold, warm, ratios = [], [], []
        for index in range(args.rounds):
            order = ("cold", "warm") if index % 2 == 0 else ("warm", "cold")
            seconds = {kind: launch(root, artifacts if kind == "warm" else "") for kind in order}
            cold.append(seconds["cold"])
            warm.append(seconds["warm"])
            ratios.append(seconds["warm"] / seconds["cold"])
            print(f"round {index + 1}: cold {seconds['cold']:.2f} s, warm {seconds['warm']:.2f} s", file=sys.stderr)
    print("| launch | launch to end of first step | ratio |")
    print("| --- | ---: | ---: |")
    print(f"| first launch (compiles; empty inductor cache) | {statistics.median(cold):.2f} s | 1.00 |")
    print(
        f"| second launch (loads the artifacts; empty inductor cache) | {statistics.median(warm):.2f} s "
        f"| {statistics.median(ratios):.2f} |"
    )


if __name__ == "__main__":
    main()
