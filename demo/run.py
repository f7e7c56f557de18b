"""Main demo: a tour of danling's standalone pieces on a small, self-made problem.

It trains a logistic-regression model on synthetic data with a plain loop,
and uses danling for everything around the loop: moving batches (`to_device`), saving and
re-loading results atomically (`save` / `load`) and rounding them for display (`RoundDict`).
Later issues replace this with the full runner demo.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import torch

import danling
from danling import RoundDict, load, save, to_device


def make_data(n: int = 2048, dim: int = 16, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(n, dim, generator=generator)
    weight = torch.randn(dim, generator=generator)
    y = (x @ weight > 0).long()
    return x, y


def main() -> None:
    torch.manual_seed(0)
    x, y = make_data()
    model = torch.nn.Linear(x.shape[1], 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    for _epoch in range(20):
        for start in range(0, len(x), 128):
            batch = to_device({"input": x[start : start + 128], "target": y[start : start + 128]}, "cpu")
            loss = torch.nn.functional.cross_entropy(model(batch["input"]), batch["target"])
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
    with torch.no_grad():
        accuracy = (model(x).argmax(-1) == y).float().mean().item()
    results = RoundDict(train={"loss": loss.item(), "accuracy": accuracy})
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "results.json"
        save(results.dict(), path)
        reloaded = RoundDict(load(path))
        print(f"danling {danling.__version__}: results written to and read back from {path}")
        print(f"{reloaded.round(4):.4f}")
    if accuracy < 0.9:
        raise SystemExit(f"demo accuracy {accuracy:.3f} is below 0.9: something is broken")


if __name__ == "__main__":
    main()
