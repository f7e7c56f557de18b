"""The main demo (`make demo`): digit classification end to end with a `TorchRunner`.

1. Train `demo/digits.py` from scratch with `demo/digits.yaml`; every epoch is evaluated on
   the validation split and checkpointed.
2. Start a *new* runner that resumes from the checkpoint written halfway through, finish the
   run, and compare it with the uninterrupted one: an exact resume gives the same numbers.
3. Predict labels for held-out test images with `infer()`.

The demo exits with status 1 when the final validation accuracy is below `--min-accuracy`
(0.95). Anything else on the command line is passed to the digits config, e.g.
`python demo/run.py --epochs 30 --optim.lr 0.01`. Runs are written under `runs/demo`
(git-ignored); that directory is emptied first so every demo starts from scratch.
"""

from __future__ import annotations

import argparse
import shutil
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import digits  # demo/digits.py, next to this file

DEMO_DIR = Path(__file__).resolve().parent


def _banner(text: str) -> None:
    print(f"\n=== {text} ===", flush=True)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workdir", default="runs/demo", help="workspace root of the demo runs (emptied first)")
    parser.add_argument("--min-accuracy", type=float, default=0.95, help="fail below this validation accuracy")
    args, overrides = parser.parse_known_args(argv)
    workdir = Path(args.workdir)
    if workdir.exists():
        shutil.rmtree(workdir)
    base = ["--config", str(DEMO_DIR / "digits.yaml"), "--workspace_root", str(workdir), *overrides]
    started = time.perf_counter()

    _banner("1. train from scratch (train -> evaluate -> checkpoint every epoch -> infer)")
    first = digits.main(base)
    if first["epochs"] < 2:
        print(f"error: resuming halfway needs epochs >= 2, got {first['epochs']}")
        return 2
    halfway = first["epochs"] // 2
    checkpoint = Path(first["checkpoint_dir"]) / f"epoch-{halfway - 1:06d}"

    _banner(f"2. resume from {checkpoint.name} (end of epoch {halfway}) in a new runner and finish the run")
    second = digits.main([*base, "--resume", str(checkpoint)])
    if second["start_epoch"] != halfway:
        print(f"error: the resumed runner started at epoch {second['start_epoch']}, expected {halfway}")
        return 1
    same_accuracy = second["val"]["acc"] == first["val"]["acc"]
    same_predictions = second["predictions"] == first["predictions"]
    print(
        f"uninterrupted run: val acc {first['val']['acc']:.4f}; resumed run: val acc {second['val']['acc']:.4f} "
        f"({'identical' if same_accuracy else 'different'} accuracy, "
        f"{'identical' if same_predictions else 'different'} test predictions)"
    )

    _banner("3. summary")
    accuracy = second["val"]["acc"]
    elapsed = time.perf_counter() - started
    print(f"validation accuracy {accuracy:.4f} (required >= {args.min_accuracy}), demo took {elapsed:.1f} s")
    print(f"everything is under {second['dir']}")
    if accuracy < args.min_accuracy:
        print(f"FAILED: validation accuracy {accuracy:.4f} is below {args.min_accuracy}")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
