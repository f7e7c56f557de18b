"""NestedTensor against hand-written padding and torch.nested (jagged) on a ragged batch.

Pipeline: embedding -> linear -> softmax -> mean over the sequence, ignoring padding.

- ``padded``: the usual hand-written code, a padded id tensor plus a mask;
- ``danling``: the same model called on a :class:`danling.tensors.NestedTensor`;
- ``torch.nested``: a jagged-layout ``torch.nested`` tensor (forward only: in torch 2.13 the
  backward of a mean over the ragged dim fails with "SymIntArrayRef expected to contain only
  concrete integers").

Time: all variants run in this process, alternating, median of ``--repeats`` runs. Peak
memory: each variant runs once in a fresh subprocess with glibc's mmap threshold lowered, so
large tensors are returned to the OS on free; the growth of the resident set's high-water mark
(``VmHWM``, reset just before the run) measures the pipeline's peak tensor memory.

A second table times op families one at a time (forward only, same process, alternating, median of
``--repeats`` runs) on a wide batch (32 sequences of 16..512 tokens): hand-written padded code (with
the mask or fill value each op needs), the same op on a NestedTensor, and on ``torch.nested``
(jagged) where torch supports it.

Run: ``.venv/bin/python benchmarks/bench_tensors.py`` (about a minute on 2 cores); ``--ops-only``
prints just the op-family table.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F
from common import load_line

from danling.tensors import NestedTensor

BATCH, VOCAB, EMBED, HIDDEN = 32, 1000, 64, 128
SCENARIOS = {
    # lengths spread over two orders of magnitude: most of a padded batch is padding
    "wide (16..1024)": lambda g: (16 * torch.exp(torch.rand(BATCH, generator=g) * 4.16)).long().clamp(16, 1024),
    # nearly equal lengths: padding is cheap, this measures NestedTensor's overhead
    "narrow (200..256)": lambda g: torch.randint(200, 257, (BATCH,), generator=g),
}
VARIANTS = ("padded", "danling", "torch.nested")
AA = "A/A: padded"  # the padded code timed again in the same rounds: the run's noise floor


def build(scenario: str, seed: int = 0, lengths: list[int] | None = None) -> dict:
    generator = torch.Generator().manual_seed(seed)
    if lengths is None:
        lengths = SCENARIOS[scenario](generator)
        lengths[0] = lengths.max() if scenario.startswith("narrow") else 1024  # fix the padded width
    else:
        lengths = torch.tensor(lengths)
    ids = [torch.randint(0, VOCAB, (int(n),), generator=generator) for n in lengths]
    torch.manual_seed(seed)
    model = {"embedding": torch.nn.Embedding(VOCAB, EMBED), "linear": torch.nn.Linear(EMBED, HIDDEN)}
    padded = torch.nn.utils.rnn.pad_sequence(ids, batch_first=True)
    mask = torch.arange(padded.shape[1]).view(1, -1) < lengths.view(-1, 1)
    return {
        "model": model,
        "padded": (padded, mask, lengths),
        "danling": NestedTensor(ids),
        "torch.nested": torch.nested.nested_tensor(ids, layout=torch.jagged),
        "tokens": int(lengths.sum()),
        "width": int(padded.shape[1]),
    }


def run_padded(data: dict, backward: bool) -> torch.Tensor:
    embedding, linear = data["model"]["embedding"], data["model"]["linear"]
    ids, mask, lengths = data["padded"]
    hidden = linear(embedding(ids)).softmax(dim=-1)
    pooled = (hidden * mask.unsqueeze(-1)).sum(dim=1) / lengths.unsqueeze(-1)
    if backward:
        pooled.sum().backward()
    return pooled


def run_nested(data: dict, backward: bool, key: str = "danling") -> torch.Tensor:
    embedding, linear = data["model"]["embedding"], data["model"]["linear"]
    pooled = linear(embedding(data[key])).softmax(dim=-1).mean(dim=1)
    if backward:
        pooled.sum().backward()
    return pooled


RUNNERS: dict[str, Callable] = {
    "padded": run_padded,
    "danling": run_nested,
    "torch.nested": lambda data, backward: run_nested(data, backward, "torch.nested"),
    AA: run_padded,
}


def check(data: dict) -> None:
    """All variants compute the same pooled features."""
    reference = run_padded(data, False)
    torch.testing.assert_close(run_nested(data, False), reference, rtol=1e-4, atol=1e-6)
    torch.testing.assert_close(RUNNERS["torch.nested"](data, False), reference, rtol=1e-4, atol=1e-6)


def time_all(data: dict, backward: bool, repeats: int) -> dict[str, float | None]:
    """Median seconds of each variant, and of `A/A` (the padded code again: the run's noise floor)."""
    variants = [v for v in VARIANTS if not (backward and v == "torch.nested")] + [AA]
    samples: dict[str, list[float]] = {v: [] for v in variants}
    for variant in variants:  # warm-up
        RUNNERS[variant](data, backward)
    for _ in range(repeats):
        for variant in variants:
            for module in data["model"].values():
                module.zero_grad(set_to_none=True)
            start = time.perf_counter()
            RUNNERS[variant](data, backward)
            samples[variant].append(time.perf_counter() - start)
    result: dict[str, float | None] = {v: statistics.median(s) for v, s in samples.items()}
    result.setdefault("torch.nested", None)
    return result


def measure_memory(scenario: str, variant: str, backward: bool) -> int:
    """Peak RSS growth (bytes) of one pipeline run, measured in a fresh interpreter."""
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="65536", MALLOC_TRIM_THRESHOLD_="0", OMP_NUM_THREADS="1")
    args = [sys.executable, __file__, "--child", scenario, variant, str(int(backward))]
    out = subprocess.run(args, env=env, capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])["peak"]


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"{field} missing from /proc/self/status")


def child(scenario: str, variant: str, backward: bool) -> None:
    tiny = build(scenario, lengths=[3, 5])
    RUNNERS[variant](tiny, backward)  # load kernels on a tiny batch so the real run's peak stands alone
    data = build(scenario)
    try:  # reset the high-water mark to the current RSS (Linux >= 4.0)
        with open("/proc/self/clear_refs", "w") as refs:
            refs.write("5")
    except OSError:
        pass
    before = _status_kib("VmRSS")
    RUNNERS[variant](data, backward)
    print(json.dumps({"peak": (_status_kib("VmHWM") - before) * 1024}))


def _op_data(seed: int = 0) -> dict:
    generator = torch.Generator().manual_seed(seed)
    lengths = (16 * torch.exp(torch.rand(BATCH, generator=generator) * 3.47)).long().clamp(16, 512)
    lengths[0] = 512
    seqs = [torch.randn(int(n), EMBED, generator=generator) for n in lengths]
    channels = [torch.randn(16, int(n), generator=generator) for n in lengths]
    labels = [torch.randint(0, 10, (int(n),), generator=generator) for n in lengths]
    mask = torch.arange(512).view(1, -1) < lengths.view(-1, 1)
    torch.manual_seed(seed)
    return {
        "lengths": lengths,
        "mask": mask,
        "padded": torch.nn.utils.rnn.pad_sequence(seqs, batch_first=True),
        "padded_channels": torch.nn.utils.rnn.pad_sequence([c.T for c in channels], batch_first=True).transpose(1, 2),
        "padded_labels": torch.nn.utils.rnn.pad_sequence(labels, batch_first=True, padding_value=-100),
        "danling": NestedTensor(seqs),
        "danling_channels": NestedTensor(channels),
        "danling_labels": NestedTensor(labels),
        "torch.nested": torch.nested.nested_tensor(seqs, layout=torch.jagged),
        "conv": torch.randn(32, 16, 3, generator=generator),
        "head": torch.nn.Linear(EMBED, 10),
        "lstm": torch.nn.LSTM(EMBED, EMBED, batch_first=True),
        "attention": torch.nn.MultiheadAttention(EMBED, 4, batch_first=True),  # training mode, as in a train step
        "project": torch.randn(EMBED, EMBED, generator=generator),
    }


def _padded_lstm(d: dict) -> torch.Tensor:
    packed = torch.nn.utils.rnn.pack_padded_sequence(d["padded"], d["lengths"], batch_first=True, enforce_sorted=False)
    return torch.nn.utils.rnn.pad_packed_sequence(d["lstm"](packed)[0], batch_first=True)[0]


# family: (padded, NestedTensor, torch.nested); each takes the dict of `_op_data`
OP_FAMILIES: dict[str, tuple[Callable, Callable, Callable]] = {
    "sort (ragged dim)": (
        lambda d: d["padded"].masked_fill(~d["mask"].unsqueeze(-1), float("inf")).sort(dim=1),
        lambda d: d["danling"].sort(dim=1),
        lambda d: d["torch.nested"].sort(dim=1),
    ),
    "cumsum (ragged dim)": (
        lambda d: (d["padded"] * d["mask"].unsqueeze(-1)).cumsum(1),
        lambda d: d["danling"].cumsum(1),
        lambda d: d["torch.nested"].cumsum(1),
    ),
    "topk (features)": (
        lambda d: d["padded"].topk(8, dim=-1),
        lambda d: d["danling"].topk(8, dim=-1),
        lambda d: d["torch.nested"].topk(8, dim=-1),
    ),
    "einsum bld,de->ble": (
        lambda d: torch.einsum("bld,de->ble", d["padded"], d["project"]),
        lambda d: torch.einsum("bld,de->ble", d["danling"], d["project"]),
        lambda d: torch.einsum("bld,de->ble", d["torch.nested"], d["project"]),
    ),
    "conv1d 16->32, k3": (
        lambda d: F.conv1d(d["padded_channels"], d["conv"], padding=1) * d["mask"].unsqueeze(1),
        lambda d: F.conv1d(d["danling_channels"], d["conv"], padding=1),
        None,
    ),
    "max_pool1d k2": (
        lambda d: F.max_pool1d(d["padded_channels"].masked_fill(~d["mask"].unsqueeze(1), float("-inf")), 2),
        lambda d: F.max_pool1d(d["danling_channels"], 2),
        None,
    ),
    "interpolate x2": (
        lambda d: F.interpolate(d["padded_channels"], scale_factor=2.0, mode="linear"),
        lambda d: F.interpolate(d["danling_channels"], scale_factor=2.0, mode="linear"),
        None,
    ),
    "cross_entropy": (
        lambda d: F.cross_entropy(d["head"](d["padded"]).transpose(1, 2), d["padded_labels"]),
        lambda d: F.cross_entropy(d["head"](d["danling"]), d["danling_labels"]),
        None,
    ),
    "LSTM 64": (_padded_lstm, lambda d: d["lstm"](d["danling"])[0], lambda d: d["lstm"](d["torch.nested"])[0]),
    "MultiheadAttention": (
        lambda d: d["attention"](
            d["padded"], d["padded"], d["padded"], key_padding_mask=~d["mask"], need_weights=False
        )[0],
        lambda d: d["attention"](d["danling"], d["danling"], d["danling"], need_weights=False)[0],
        lambda d: d["attention"](d["torch.nested"], d["torch.nested"], d["torch.nested"], need_weights=False)[0],
    ),
}


def time_ops(repeats: int) -> None:
    """Print the op-family table: forward time of each variant and its ratio to the padded code."""
    data = _op_data()
    occupancy = float(data["lengths"].sum()) / (BATCH * 512)
    print(f"\nop families, forward, batch {BATCH} of 16..512 tokens (occupancy {occupancy:.0%}), median of {repeats}")
    header = (
        f"{'op':<22} {'padded ms':>10} {'danling ms':>11} {'vs padded':>10} {'torch.nested ms':>16} {'vs padded':>10}"
    )
    print(header)
    print("-" * len(header))
    with torch.no_grad():
        for name, variants in OP_FAMILIES.items():
            runnable = []
            for variant in variants:
                try:
                    variant(data)
                    runnable.append(variant)
                except Exception:  # torch.nested lacks the op: reported as unsupported
                    runnable.append(None)
            samples: list[list[float]] = [[] for _ in runnable]
            for _ in range(repeats):
                for i, variant in enumerate(runnable):
                    if variant is not None:
                        start = time.perf_counter()
                        variant(data)
                        samples[i].append(time.perf_counter() - start)
            ms = [statistics.median(s) * 1e3 if s else None for s in samples]
            cells = [f"{ms[0]:>10.2f}", f"{ms[1]:>11.2f}", f"{ms[1] / ms[0]:>9.2f}x"]
            cells += (
                [f"{ms[2]:>16.2f}", f"{ms[2] / ms[0]:>9.2f}x"]
                if ms[2] is not None
                else [f"{'unsupported':>16}", f"{'':>10}"]
            )
            print(f"{name:<22} " + " ".join(cells))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads (1 keeps timings stable)")
    parser.add_argument("--child", nargs=3, help=argparse.SUPPRESS)
    parser.add_argument("--ops-only", action="store_true", help="only the op-family table")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    if args.child:
        child(args.child[0], args.child[1], bool(int(args.child[2])))
        return
    if args.ops_only:
        time_ops(args.repeats)
        return
    print(f"torch {torch.__version__}, {args.threads} thread(s), batch {BATCH}, embed {EMBED}, hidden {HIDDEN}")
    columns = ("time ms", "vs padded", "peak MiB", "vs padded")
    header = f"{'scenario':<18} {'pass':<9} {'variant':<13} " + " ".join(f"{c:>9}" for c in columns)
    print(header)
    print("-" * len(header))
    print(load_line("before"))
    for scenario in SCENARIOS:
        data = build(scenario)
        check(data)
        occupancy = data["tokens"] / (BATCH * data["width"])
        for backward in (False, True):
            times = time_all(data, backward, args.repeats)
            memory = {v: measure_memory(scenario, v, backward) for v in VARIANTS if times[v] is not None}
            for variant in VARIANTS:
                label = f"{scenario}" if variant == "padded" and not backward else ""
                name = "fwd+bwd" if backward else "forward"
                if times[variant] is None:
                    print(f"{label:<18} {name:<9} {variant:<13} {'unsupported (backward fails in torch)':>39}")
                    continue
                t, m = times[variant] * 1e3, memory[variant] / 2**20
                t_ratio, m_ratio = times[variant] / times["padded"], memory[variant] / max(memory["padded"], 1)
                print(f"{label:<18} {name:<9} {variant:<13} {t:>9.2f} {t_ratio:>8.2f}x {m:>9.1f} {m_ratio:>8.2f}x")
            print(f"{'':<18} {'':<9} {AA:<13} {times[AA] * 1e3:>9.2f} {times[AA] / times['padded']:>8.2f}x")
        print(f"{'':<18} occupancy of the padded batch: {occupancy:.0%} ({data['tokens']} real tokens)")
    print(load_line("after"))
    time_ops(args.repeats)


if __name__ == "__main__":
    main()
