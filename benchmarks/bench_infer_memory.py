"""Peak resident memory of `runner.infer(split, output=...)`: a 10x larger dataset must not cost more.

Each measurement is a fresh subprocess (so peaks do not carry over) that builds a small
`TorchRunner`, points its `infer` split at a dataset generated on the fly (nothing held in
memory per example), streams the predictions into one sink and reports its peak RSS
(`ru_maxrss`). The table gives the peak for the base size and for ten times as many examples,
and the difference, for each sink. A writer that kept outputs in memory would grow by roughly
the output size (tens of MB at 10x here); a flat one stays within allocator noise.

Usage: ``python benchmarks/bench_infer_memory.py [--examples 200000] [--batch-size 2000]``
(about a minute here).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import resource
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def child(examples: int, batch_size: int, output: str) -> None:
    import torch
    from torch import nn
    from torch.utils.data import DataLoader, Dataset

    from danling.runners import TorchRunner

    class Generated(Dataset):
        """Example `i` is four copies of `i`: computed per batch, never stored."""

        def __len__(self) -> int:
            return examples

        def __getitems__(self, indices: list[int]) -> torch.Tensor:
            return torch.tensor(indices, dtype=torch.float32)[:, None].expand(-1, 4)

    class Scorer(TorchRunner):
        def __init__(self, config: dict) -> None:
            super().__init__(config)
            self.model = nn.Sequential(nn.Linear(4, 16), nn.ReLU(), nn.Linear(16, 1))

    with tempfile.TemporaryDirectory() as root:
        config = {"workspace_root": root, "log": False, "inference.progress_interval": 50, "seed": 0}
        with Scorer(config) as runner:
            runner.dataloaders["infer"] = DataLoader(Generated(), batch_size=batch_size, collate_fn=lambda x: x)
            runner.infer("infer", output=output)
    peak_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux
    print(json.dumps({"peak_mb": peak_mb, "bytes": Path(output).stat().st_size}))


def measure(examples: int, batch_size: int, suffix: str) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        output = os.path.join(tmp, f"out{suffix}")
        command = [sys.executable, __file__, "--child", str(examples), str(batch_size), output]
        env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")
        done = subprocess.run(command, env=env, capture_output=True, text=True, check=True)
        return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--examples", type=int, default=200_000)
    parser.add_argument("--batch-size", type=int, default=2000)
    args = parser.parse_args()
    suffixes = [".jsonl", ".npy"] + ([".parquet"] if importlib.util.find_spec("pyarrow") else [])
    print(
        f"| sink | peak RSS, {args.examples} examples | peak RSS, {10 * args.examples} | difference | output at 10x |"
    )
    print("| --- | --- | --- | --- | --- |")
    for suffix in suffixes:
        small = measure(args.examples, args.batch_size, suffix)
        large = measure(10 * args.examples, args.batch_size, suffix)
        print(
            f"| {suffix} | {small['peak_mb']:.1f} MB | {large['peak_mb']:.1f} MB | "
            f"{large['peak_mb'] - small['peak_mb']:+.1f} MB | {large['bytes'] / 2**20:.1f} MB |"
        )


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        child(int(sys.argv[2]), int(sys.argv[3]), sys.argv[4])
    else:
        main()
