"""What `DeepSpeedRunner` costs per step over a hand-written DeepSpeed loop on the same engine config.

One process (world size 1: a one-rank gloo group, `DS_ACCELERATOR=cpu`), one thread. Both sides
build their engine with `deepspeed.initialize` from the same effective config (the runner's
`deepspeed_config`: ZeRO stage 2, fp32, a client `torch.optim.AdamW`, no clipping), train the same
model on the same data and run a validation pass:

- hand-written: `loss = criterion(engine(x), y); engine.backward(loss); engine.step()`, the mean
  loss and accuracy kept on the device and read once per pass (what a careful script does);
- the runner: `DeepSpeedRunner.train()` with an accuracy metric, as a user gets it (no checkpoint
  I/O: `checkpoint.load_only`); its own loaders fetch `TensorDataset` batches whole, which the
  torch `DataLoader` of the hand-written loop does example by example, so a second runner row is
  given the loop's torch loaders: that row is the runner's own per-step overhead.

Every round builds all candidates afresh in a random order, warms each up with one untimed call,
then times one call of each (in a random order) and divides by the hand-written loop's time in
that round; the table gives the median and interquartile range of these paired ratios. A second
hand-written loop is the A/A control (the noise floor). Two workloads: a small MLP at batch 32,
where per-step bookkeeping matters most, and a wide MLP at batch 128, where the matrix
multiplications dominate.

Usage: ``python benchmarks/bench_deepspeed.py [--rounds 25] [--quick]`` (about two minutes here).
"""

from __future__ import annotations

import argparse
import logging
import os
import random
import statistics
import sys
import tempfile
import time
import warnings
from collections.abc import Callable
from typing import Any

os.environ.setdefault("DS_ACCELERATOR", "cpu")
for _key, _value in (("RANK", "0"), ("LOCAL_RANK", "0"), ("WORLD_SIZE", "1"), ("LOCAL_WORLD_SIZE", "1")):
    os.environ.setdefault(_key, _value)
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
os.environ.setdefault("TORCH_EXTENSIONS_DIR", os.path.join(ROOT, ".torch_extensions"))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch import nn  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_runner import make_model, make_splits, torch_loaders  # noqa: E402
from chanfig import Config  # noqa: E402
from common import ratio_table  # noqa: E402

import danling as dl  # noqa: E402
from danling.runners import DeepSpeedRunner  # noqa: E402

# name -> (features, hidden, classes, batch size, train samples, val samples)
WORKLOADS = {
    "small MLP, batch 32": (64, 128, 10, 32, 4096, 1024),
    "wide MLP, batch 128": (512, 1024, 10, 128, 6144, 512),
}
HANDWRITTEN = ("hand-written DeepSpeed loop", "hand-written DeepSpeed loop, second copy")
RUNNER = "DeepSpeedRunner"
RUNNER_TORCH_LOADERS = "DeepSpeedRunner, torch loaders"
RUNNERS = (RUNNER, RUNNER_TORCH_LOADERS)


class BenchConfig(dl.RunnerConfig):
    """The runner config plus `bench.*`, the workload this run measures (a free-form section)."""

    bench: Config = Config()


class BenchRunner(DeepSpeedRunner):
    """The benchmark's training problem through the runner; `config.bench.workload` names it."""

    def __init__(self, config: dl.RunnerConfig) -> None:
        super().__init__(config)
        features, hidden, classes, batch_size, n_train, n_val = WORKLOADS[config.bench.workload]
        splits = make_splits(features, classes, n_train, n_val)
        self.datasets.train, self.datasets.val = splits["train"], splits["val"]
        if config.bench.torch_loaders:
            self.dataloaders.update(torch_loaders(splits, batch_size))
        self.model = make_model(features, hidden, classes)
        self.criterion = nn.CrossEntropyLoss()
        self.metrics = dl.multiclass_metrics(num_classes=classes, metrics=["acc"])


def build_runner(root: str, workload: str, torch_loaders: bool = False) -> BenchRunner:
    config = BenchConfig(
        stack="deepspeed",
        workspace_root=root,
        epochs=1,
        seed=0,
        log=False,
        log_interval=10**9,  # one step log per pass, like the hand-written loop's one read
        score_name="acc",
        deepspeed={"zero_optimization": {"stage": 2}},
        **{"optim.type": "adamw", "optim.lr": 1e-3, "dataloader.batch_size": WORKLOADS[workload][3]},
        **{"checkpoint.load_only": True},
    )
    config.bench.workload, config.bench.torch_loaders = workload, torch_loaders
    runner = BenchRunner(config)
    runner.logger.setLevel(logging.ERROR)
    return runner


def handwritten_loop(workload: str, deepspeed_config: dict[str, Any]) -> Callable[[], None]:
    """A DeepSpeed engine on the runner's effective config and a plain loop over it: one call is one epoch."""
    import deepspeed

    features, hidden, classes, batch_size, n_train, n_val = WORKLOADS[workload]
    torch.manual_seed(0)
    model = make_model(features, hidden, classes)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, config=dict(deepspeed_config))
    loaders = torch_loaders(make_splits(features, classes, n_train, n_val), batch_size)
    criterion = nn.CrossEntropyLoss()

    def epoch() -> None:
        for split in ("train", "val"):
            training = split == "train"
            engine.train(training)
            loss_sum, correct, seen = torch.zeros(()), torch.zeros((), dtype=torch.long), 0
            with torch.inference_mode(not training):
                for x, y in loaders[split]:
                    logits = engine(x)
                    loss = criterion(logits, y)
                    if training:
                        engine.backward(loss)
                        engine.step()
                    loss_sum += loss.detach()
                    correct += (logits.argmax(-1) == y).sum()
                    seen += len(y)
            _ = loss_sum.item(), correct.item() / seen

    return epoch


def run_epoch(runner: BenchRunner) -> None:
    runner.train_state.epoch = 0
    runner.train()


def rounds_of(workload: str, rounds: int, root: str) -> dict[str, tuple[float, float, float, float]]:
    """`rounds` paired rounds; returns `{name: (median seconds, q1, median, q3 of the ratio)}`."""
    rng = random.Random(0)
    seconds: dict[str, list[float]] = {}
    ratios: dict[str, list[float]] = {}
    for index in range(rounds):
        loops: dict[str, Callable[[], None]] = {}
        runners = []
        names = [*HANDWRITTEN, *RUNNERS]
        for name in rng.sample(names, len(names)):
            if name in RUNNERS:
                directory = os.path.join(root, f"{index}-{len(runners)}")
                runners.append(build_runner(directory, workload, torch_loaders=name == RUNNER_TORCH_LOADERS))
                loops[name] = lambda r=runners[-1]: run_epoch(r)
            else:  # the runner's effective config: built once, below, from a throwaway runner
                loops[name] = handwritten_loop(workload, CONFIGS[workload])
        for loop in loops.values():
            loop()  # warm-up: first-touch allocations, the optimizer's lazily built state
        timed = {}
        for name in rng.sample(list(loops), len(loops)):
            started = time.perf_counter()
            loops[name]()
            timed[name] = time.perf_counter() - started
        for runner in runners:
            runner.close()
        for name, value in timed.items():
            seconds.setdefault(name, []).append(value)
            ratios.setdefault(name, []).append(value / timed[HANDWRITTEN[0]])
    summary = {}
    for name in names:
        q1, median, q3 = statistics.quantiles(ratios[name], n=4) if rounds > 1 else [ratios[name][0]] * 3
        summary[name] = (statistics.median(seconds[name]), q1, median, q3)
    return summary


CONFIGS: dict[str, dict[str, Any]] = {}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=25, help="rounds of the small MLP (the wide one: a third)")
    parser.add_argument("--quick", action="store_true", help="3 rounds each, for a smoke run")
    args = parser.parse_args()
    torch.set_num_threads(1)
    warnings.filterwarnings("ignore")
    logging.getLogger("DeepSpeed").setLevel(logging.ERROR)
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    out = []
    with tempfile.TemporaryDirectory() as root:
        for workload in WORKLOADS:
            probe = build_runner(os.path.join(root, "probe"), workload)
            CONFIGS[workload] = dict(probe.deepspeed_config)
            probe.close()
            rounds = 3 if args.quick else (args.rounds if workload.startswith("small") else max(5, args.rounds // 3))
            summary = rounds_of(workload, rounds, os.path.join(root, workload.replace(" ", "-")))
            _, _, _, batch_size, n_train, n_val = WORKLOADS[workload]
            steps = n_train // batch_size
            batches = f"{steps} train + {-(-n_val // batch_size)} val batches"
            title = f"DeepSpeed ZeRO-2, {workload}: one epoch of {batches}, {rounds} rounds"
            base = summary[HANDWRITTEN[0]][0]
            extra = "; ".join(f"{name} {(summary[name][0] - base) / steps * 1e6:+.0f} us" for name in RUNNERS)
            out.append(ratio_table(title, summary, "hand-written DeepSpeed loop"))
            out.append(f"\nextra time per train step (medians): {extra}\n")
    dist.destroy_process_group()
    print("\n".join(out))


if __name__ == "__main__":
    main()
