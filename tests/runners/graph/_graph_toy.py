"""A tiny regression runner for the graph stack, and a child process that trains it once (artifacts test, benchmark).

Run as `python -m tests.runners.graph._graph_toy ROOT ARTIFACT_DIR`: one epoch through `GraphRunner`
with inductor; prints one JSON line with the seconds to the first training step, the artifacts
loaded at start and inductor's cache counters.
"""

from __future__ import annotations

import json
import sys
import time
from typing import Any

from torch import nn

from danling.runners import Events, Runner
from tests.runners._torch_toy import make_data, tiny_config


class GraphToy(Runner):
    """MLP regression without dropout (compiled and eager dropout draw different random numbers)."""

    n_train = 16

    def __init__(self, config: Any) -> None:
        super().__init__(config)
        self.model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))
        self.criterion = nn.MSELoss()
        self.datasets.train = make_data(self.n_train, seed=0)
        self.datasets.val = make_data(8, seed=1)


def graph_config(root: Any, **overrides: Any) -> dict[str, Any]:
    """`tiny_config` on the graph stack: 2 epochs of AdamW, batch size 4, synchronous checkpoints, no log file."""
    return tiny_config(root, **{"stack": "graph", **overrides})


def main(root: str, artifact_dir: str) -> None:
    from torch._dynamo.utils import counters

    started = time.perf_counter()
    first: list[float] = []
    config = graph_config(root, epochs=1, **{"compile.precompile_artifact_dir": artifact_dir})
    with GraphToy(config) as runner:
        runner.events.subscribe(Events.STEP_END, lambda _: first or first.append(time.perf_counter() - started))
        runner.train()
        loaded = runner.compile_artifacts.loaded
    print(json.dumps({"first_step_s": first[0], "loaded": loaded, "inductor": dict(counters["inductor"])}))


if __name__ == "__main__":
    main(*sys.argv[1:3])
