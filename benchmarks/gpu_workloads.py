"""The checks of `benchmarks/gpu_check.py`: each one trains something real and returns what it measured.

Every check is a function `check(ctx) -> dict` run in a process of its own by the driver. It
raises `Skip` with the reason when the machine cannot run it (no CUDA, no `transformers`), and any
other exception when what it checks does not hold; the dict it returns is the row of the report.
The same code runs on a CPU in the test suite (`ctx.quick`: smaller sizes, CUDA-only parts
skipped), so a GPU session spends its minutes on what only a GPU can show.
"""

from __future__ import annotations

import gc
import json
import math
import os
import signal
import socket
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from chanfig import Config
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import danling as dl
from danling.runners.services.telemetry import peak_flops


class Skip(Exception):
    """The check cannot run on this machine; the message says why."""


@dataclass
class Context:
    device: torch.device
    quick: bool
    workdir: Path

    @property
    def cuda(self) -> bool:
        return self.device.type == "cuda"

    def need_cuda(self, what: str) -> None:
        if not self.cuda:
            raise Skip(f"needs CUDA: {what}")


# --------------------------------------------------------------------------- shared pieces
def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def classification_data(n: int, features: int, classes: int, seed: int) -> TensorDataset:
    """Labels of a fixed random teacher network: learnable, and the same for equal `seed`."""
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(n, features, generator=generator)
    teacher = torch.randn(features, classes, generator=torch.Generator().manual_seed(1234))
    y = (x @ teacher + 0.5 * torch.randn(n, classes, generator=generator)).argmax(-1)
    return TensorDataset(x, y)


def mlp(features: int, hidden: int, classes: int, dropout: float = 0.0) -> nn.Module:
    return nn.Sequential(
        nn.Linear(features, hidden),
        nn.GELU(),
        nn.Dropout(dropout),
        nn.Linear(hidden, hidden),
        nn.GELU(),
        nn.Linear(hidden, classes),
    )


class MLPRunner(dl.TorchRunner):
    """Classification of `classification_data` by `mlp`; sizes from `config.task`."""

    def __init__(self, config: dl.RunnerConfig) -> None:
        super().__init__(config)
        task = config.task
        self.model = mlp(task.features, task.hidden, task.classes, task.dropout)
        self.criterion = nn.CrossEntropyLoss()
        self.datasets.train = classification_data(task.n_train, task.features, task.classes, seed=0)
        if task.n_val:
            self.datasets.val = classification_data(task.n_val, task.features, task.classes, seed=1)
        if task.accuracy:
            self.metrics = dl.multiclass_metrics(num_classes=task.classes, metrics=["acc"])


class TaskConfig(dl.RunnerConfig):
    task: Config = Config()


def runner_config(ctx: Context, name: str, **overrides: Any) -> TaskConfig:
    """A quiet run in its own workspace: no log file, pinned host batches when there is a GPU."""
    config = TaskConfig(
        workspace_root=str(ctx.workdir / name),
        seed=0,
        log=False,
        **{"optim.type": "adamw", "optim.lr": 1e-3, "dataloader.pin_memory": ctx.cuda},
    )
    task = {"features": 32, "hidden": 128, "classes": 8, "dropout": 0.0, "n_train": 1024, "n_val": 256}
    task["accuracy"] = False
    config.task.merge(task)
    config.merge({key: value for key, value in overrides.items() if not key.startswith("task.")})
    config.task.merge({key[5:]: value for key, value in overrides.items() if key.startswith("task.")})
    return config


def quiet(runner: dl.TorchRunner) -> dl.TorchRunner:
    import logging

    runner.logger.setLevel(logging.ERROR)
    return runner


def weights(module: nn.Module) -> dict[str, torch.Tensor]:
    state = module.state_dict()
    return {
        key: (value.full_tensor() if hasattr(value, "full_tensor") else value).detach().cpu().clone()
        for key, value in state.items()
    }


def final_losses(results: Any) -> dict[str, float]:
    last = results[max(results)] if isinstance(results, dict) else results[-1]
    return {split: float(row["loss"]) for split, row in last.items() if isinstance(row, dict) and "loss" in row}


class TimedLoader:
    """A loader that times the steps it feeds: from the fetch of batch `warmup` to its exhaustion.

    The device is synchronised only at those two points, so the steps in between run as they
    would; the same wrapper times the hand-written loop and the runner alike. `on_batch(index)` is
    called before each batch is handed over (the sync-debug check switches modes there).
    """

    def __init__(
        self, loader: Any, device: torch.device, warmup: int, on_batch: Callable[[int], None] | None = None
    ) -> None:
        self.loader, self.device, self.warmup, self.on_batch = loader, device, warmup, on_batch
        self.seconds: float | None = None
        self.steps = 0

    def __iter__(self) -> Iterator[Any]:
        start, count = None, 0
        try:
            for index, batch in enumerate(self.loader):
                if index == self.warmup:
                    synchronize(self.device)
                    start = time.perf_counter()
                if self.on_batch is not None:
                    self.on_batch(index)
                count = index + 1
                yield batch
        finally:
            if self.on_batch is not None:
                self.on_batch(-1)
        synchronize(self.device)
        if start is not None:
            self.seconds, self.steps = time.perf_counter() - start, count - self.warmup

    def __len__(self) -> int:
        return len(self.loader)

    def __getattr__(self, name: str) -> Any:  # sampler, state_dict, ... of the real loader
        return getattr(self.loader, name)


def time_runner_epoch(runner: dl.TorchRunner, warmup: int) -> float:
    """Seconds per step of one more training epoch of `runner`, timed as `TimedLoader` does."""
    loader = runner.dataloaders["train"]
    timed = TimedLoader(loader, runner.device, warmup)
    runner.dataloaders["train"] = timed
    try:
        runner.train_state.epoch = 0
        runner.train(["train"], [])
    finally:
        runner.dataloaders["train"] = loader
    if timed.seconds is None:
        raise RuntimeError(f"the runner's epoch had fewer than {warmup + 1} batches")
    return timed.seconds / timed.steps


def hand_loop(
    model: nn.Module, criterion: Callable, dataset: TensorDataset, ctx: Context, *, batch_size: int, dtype: Any
) -> Callable[[int], float]:
    """The loop a user would write: pinned batches, `non_blocking` copies, AdamW, one loss read per epoch.

    Returns `epoch(warmup) -> seconds per step`.
    """
    device = ctx.device
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    loader = DataLoader(dataset, batch_size=batch_size, shuffle=True, drop_last=True, pin_memory=ctx.cuda)

    def epoch(warmup: int) -> float:
        timed = TimedLoader(loader, device, warmup)
        total = torch.zeros((), device=device)
        for input, target in timed:
            input, target = input.to(device, non_blocking=True), target.to(device, non_blocking=True)
            with torch.autocast(device.type, dtype=dtype, enabled=dtype is not None):
                loss = criterion(model(input), target)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            total += loss.detach()
        total.item()
        return timed.seconds / timed.steps

    return epoch


def begin_memory(ctx: Context) -> int:
    """Collect garbage, drop cached blocks and reset the peak: returns the bytes resident now (0 on CPU)."""
    gc.collect()
    if not ctx.cuda:
        return 0
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(ctx.device)
    return torch.cuda.memory_allocated(ctx.device)


def peak_since(ctx: Context, start: int) -> float | None:
    """MiB allocated at the peak above `start` (what `begin_memory` returned); None on CPU."""
    return (torch.cuda.max_memory_allocated(ctx.device) - start) / 2**20 if ctx.cuda else None


def measure_pair(
    build_hand: Callable[[], Callable[[int], float]],
    build_runner: Callable[[], dl.TorchRunner],
    ctx: Context,
    *,
    warmup: int,
    rounds: int,
) -> dict[str, Any]:
    """Per-step seconds of the hand loop and the runner, alternating, and each one's peak memory.

    Peak memory is what a side allocated above what was resident when it started (on CUDA;
    None on CPU), measured in the first round, before the other side's state could be counted.
    """
    start = begin_memory(ctx)
    hand = build_hand()
    hand_times = [hand(warmup)]
    hand_peak = peak_since(ctx, start)
    start = begin_memory(ctx)
    runner = build_runner()
    runner_times = [time_runner_epoch(runner, warmup)]
    runner_peak = peak_since(ctx, start)
    for _ in range(rounds - 1):
        hand_times.append(hand(warmup))
        runner_times.append(time_runner_epoch(runner, warmup))
    runner.close()
    hand_s, runner_s = statistics.median(hand_times), statistics.median(runner_times)
    return {
        "hand_ms": hand_s * 1e3,
        "runner_ms": runner_s * 1e3,
        "ratio": runner_s / hand_s,
        "hand_peak_mib": hand_peak,
        "runner_peak_mib": runner_peak,
        "rounds": rounds,
    }


# --------------------------------------------------------------------------- checks
def check_environment(ctx: Context) -> dict[str, Any]:
    info: dict[str, Any] = {
        "torch": torch.__version__,
        "danling": dl.__version__,
        "python": sys.version.split()[0],
        "device": str(ctx.device),
    }
    if ctx.cuda:
        props = torch.cuda.get_device_properties(ctx.device)
        info.update(
            name=props.name,
            capability=f"{props.major}.{props.minor}",
            memory_gib=round(props.total_memory / 2**30, 1),
            cuda=torch.version.cuda,
            bf16=torch.cuda.is_bf16_supported(),
            peak_bf16_tflops=(peak_flops(props.name, "bf16") or 0) / 1e12 or None,
        )
    return info


def check_precision(ctx: Context) -> dict[str, Any]:
    """bf16 autocast and fp16 (with a GradScaler on CUDA) end within 10% of fp32's validation loss."""
    epochs = 2 if ctx.quick else 4
    out: dict[str, Any] = {}
    start_loss = None
    for precision in ("fp32", "bf16", "fp16"):
        runner = quiet(MLPRunner(runner_config(ctx, f"precision-{precision}", epochs=epochs, precision=precision)))
        if start_loss is None:
            start_loss = float(runner.evaluate(["val"])["val"]["loss"])
        if precision == "fp16" and ctx.cuda and runner.precision_policy.scaler is None:
            raise AssertionError("fp16 on CUDA trained without a GradScaler")
        losses = final_losses(runner.train())
        if precision == "fp16" and runner.precision_policy.scaler is not None:
            out["fp16_scale"] = float(runner.precision_policy.scaler.get_scale())
        runner.close()
        out[f"{precision}_val_loss"] = losses["val"]
    out["initial_val_loss"] = start_loss
    reference = out["fp32_val_loss"]
    if not reference < 0.8 * start_loss:
        raise AssertionError(f"fp32 did not train: validation loss {start_loss:.4f} -> {reference:.4f}")
    for precision in ("bf16", "fp16"):
        value = out[f"{precision}_val_loss"]
        if not math.isfinite(value) or abs(value - reference) > 0.1 * reference:
            raise AssertionError(
                f"{precision} ended at validation loss {value:.4f}, fp32 at {reference:.4f} (>10% apart)"
            )
    return out


# The resume check runs three processes of this module (see `resume_child`).
RESUME = {"steps": 24, "kill_at": 14, "interval": 4}


def resume_child(root: str, device: str, kill_at: int) -> None:
    """One run of the resume check, in a process of its own; writes `final.pt` and `start.json`."""
    ctx = Context(torch.device(device), quick=True, workdir=Path(root))

    class Killed(MLPRunner):
        def optimizer_step(self) -> bool:
            applied = super().optimizer_step()
            if applied and self.train_state.global_step == kill_at:
                os.kill(os.getpid(), signal.SIGKILL)  # a real kill: nothing after this line runs
            return applied

    config = runner_config(
        ctx,
        "run",
        steps=RESUME["steps"],
        deterministic=True,
        auto_resume=True,
        evaluate_interval=8,
        **{"checkpoint.interval": RESUME["interval"], "dataloader.batch_size": 32},
        **{"task.dropout": 0.2, "task.n_train": 320, "task.n_val": 64},  # 10 batches per epoch; dropout uses the RNG
    )
    runner = quiet(Killed(config))
    Path(root, "start.json").write_text(json.dumps({"global_step": runner.train_state.global_step}))
    runner.train()
    torch.save(weights(runner.model), Path(root, "final.pt"))
    runner.close()


def check_resume(ctx: Context) -> dict[str, Any]:
    """A run SIGKILLed mid-epoch, resumed by `auto_resume`, ends with the uninterrupted run's weights, bit for bit."""

    def launch(root: Path, kill_at: int) -> int:
        command = [sys.executable, __file__, "resume-child", str(root), str(ctx.device), str(kill_at)]
        done = subprocess.run(command, capture_output=True, text=True, timeout=240)
        if done.returncode not in (0, -signal.SIGKILL):
            raise RuntimeError(f"resume child exited {done.returncode}: {done.stderr[-2000:]}")
        return done.returncode

    clean, killed = ctx.workdir / "clean", ctx.workdir / "killed"
    launch(clean, kill_at=-1)
    code = launch(killed, kill_at=RESUME["kill_at"])
    if code != -signal.SIGKILL or (killed / "final.pt").exists():
        raise AssertionError(f"the run to be killed was not killed (exit {code})")
    launch(killed, kill_at=-1)
    resumed_from = json.loads((killed / "start.json").read_text())["global_step"]
    if not 0 < resumed_from < RESUME["kill_at"]:
        raise AssertionError(f"the restart began at step {resumed_from}, not from a checkpoint before the kill")
    a, b = torch.load(clean / "final.pt"), torch.load(killed / "final.pt")
    differ = [key for key in a if not torch.equal(a[key], b[key])]
    if differ:
        raise AssertionError(f"resumed weights differ from the uninterrupted run's in {differ}")
    return {
        "killed_at": RESUME["kill_at"],
        "resumed_from": resumed_from,
        "steps": RESUME["steps"],
        "bit_identical": True,
    }


def check_dcp(ctx: Context) -> dict[str, Any]:
    """A run checkpointed with the DCP backend resumes on the device with the same weights and optimizer state."""
    config = runner_config(ctx, "dcp", epochs=1, **{"checkpoint.backend": "dcp", "checkpoint.async_enabled": False})
    first = quiet(MLPRunner(config))
    first.train()
    saved, moments = weights(first.model), first.optimizer.state_dict()["state"]
    checkpoint = first.checkpoint_manager.latest
    first.close()
    second = quiet(MLPRunner(runner_config(ctx, "dcp-resume", epochs=1, resume=str(checkpoint))))
    loaded = weights(second.model)
    devices = {p.device.type for p in second.model.parameters()}
    restored = second.optimizer.state_dict()["state"]
    second.close()
    if devices != {ctx.device.type}:
        raise AssertionError(f"loaded parameters live on {devices}, not {ctx.device}")
    differ = [key for key in saved if not torch.equal(saved[key], loaded[key])]
    differ += [
        f"optimizer {k}" for k in moments if not torch.equal(moments[k]["exp_avg"].cpu(), restored[k]["exp_avg"].cpu())
    ]
    if differ:
        raise AssertionError(f"DCP round trip changed {differ}")
    return {"checkpoint": checkpoint.name, "tensors": len(saved), "device": sorted(devices)[0]}


class Blocks(nn.Module):
    def __init__(self, width: int = 64, depth: int = 3) -> None:
        super().__init__()
        self.inp = nn.Linear(32, width)
        self.layers = nn.ModuleList(nn.Sequential(nn.Linear(width, width), nn.GELU()) for _ in range(depth))
        self.head = nn.Linear(width, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.inp(x)
        for layer in self.layers:
            x = x + layer(x)
        return self.head(x)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def check_fsdp2(ctx: Context) -> dict[str, Any]:
    """FSDP2 over a one-device mesh (danling's `apply_fsdp`) trains like the plain model, and its DTensors
    round-trip through danling's DCP manager."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from danling.checkpoint.dcp import ModelState, OptimizerState, TorchDistributedCheckpointManager
    from danling.distributed.fsdp import apply_fsdp

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
    dist.init_process_group("nccl" if ctx.cuda else "gloo", rank=0, world_size=1)
    try:
        mesh = init_device_mesh(ctx.device.type, (1,), mesh_dim_names=("shard",))
        torch.manual_seed(0)
        plain = Blocks().to(ctx.device)
        sharded = Blocks().to(ctx.device)
        sharded.load_state_dict(plain.state_dict())
        apply_fsdp(sharded, mesh, units=list(sharded.layers))
        optimizers = [torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (plain, sharded)]
        data = classification_data(256, 32, 8, seed=0)
        worst = 0.0
        for step in range(8):
            x, y = (t[step * 32 : (step + 1) * 32].to(ctx.device) for t in data.tensors)
            losses = []
            for model, optimizer in zip((plain, sharded), optimizers):
                loss = nn.functional.cross_entropy(model(x), y)
                loss.backward()
                optimizer.step()
                optimizer.zero_grad()
                losses.append(float(loss))
            worst = max(worst, abs(losses[0] - losses[1]))
        if worst > 1e-4:
            raise AssertionError(f"FSDP2 losses differ from the plain model's by up to {worst:.2e}")
        kinds = {type(p).__name__ for p in sharded.parameters()}
        manager = TorchDistributedCheckpointManager(ctx.workdir / "fsdp-ckpt")
        state = {"model": ModelState(sharded), "optimizer": OptimizerState(sharded, optimizers[1])}
        manager.save(state, "step-8")
        manager.wait()
        expected = weights(sharded)
        with torch.no_grad():
            for p in sharded.parameters():
                p.zero_()
        manager.load_into("latest", {"model": ModelState(sharded), "optimizer": OptimizerState(sharded, optimizers[1])})
        after = weights(sharded)
        differ = [key for key in expected if not torch.equal(expected[key], after[key])]
        manager.close()
        if differ:
            raise AssertionError(f"DCP round trip of the FSDP2 model changed {differ}")
        return {"max_loss_diff": worst, "parameter_types": sorted(kinds), "dcp_tensors": len(expected)}
    finally:
        dist.destroy_process_group()


def check_compile(ctx: Context) -> dict[str, Any]:
    """`compile.enable` trains through the runner to eager's losses (inductor on CUDA)."""
    out: dict[str, Any] = {}
    for mode in ("eager", "compiled"):
        overrides: dict[str, Any] = {"epochs": 2, "compile.enable": mode == "compiled"}
        if mode == "compiled" and not ctx.cuda:
            overrides["compile.backend"] = "aot_eager"  # inductor's C++ build on a 2-core CPU is minutes
        runner = quiet(MLPRunner(runner_config(ctx, f"compile-{mode}", **overrides)))
        started = time.perf_counter()
        losses = final_losses(runner.train())
        out[f"{mode}_seconds"] = time.perf_counter() - started
        out[f"{mode}_val_loss"] = losses["val"]
        runner.close()
    out["backend"] = "inductor" if ctx.cuda else "aot_eager"
    gap = abs(out["compiled_val_loss"] - out["eager_val_loss"])
    if gap > 0.02 * out["eager_val_loss"]:
        raise AssertionError(f"compiled run ended {gap:.4f} away from eager's validation loss")
    return out


def check_sync(ctx: Context) -> dict[str, Any]:
    """No host sync between two step logs: the steps in between run under `set_sync_debug_mode("error")`."""
    ctx.need_cuda("torch.cuda.set_sync_debug_mode exists for CUDA only")
    interval, batches = 8, 64
    variants = {
        "fp32, loss only (fused pass)": {},
        "bf16, clipping, accuracy (hooked pass)": {"precision": "bf16", "max_grad_norm": 1.0, "task.accuracy": True},
    }
    out: dict[str, Any] = {}
    failures = []
    for name, overrides in variants.items():
        config = runner_config(
            ctx, f"sync-{len(out)}", epochs=1, log_interval=interval, **{"checkpoint.load_only": True}, **overrides
        )
        config.task.n_train = batches * 32
        config.dataloader.batch_size = 32
        runner = quiet(MLPRunner(config))

        def toggle(index: int) -> None:
            # batch i ends with global step i + 1; a step log follows the steps that are multiples of `interval`
            watched = index >= interval and (index + 1) % interval != 0
            torch.cuda.set_sync_debug_mode("error" if watched else "default")

        runner.dataloaders["train"] = TimedLoader(runner.dataloaders["train"], ctx.device, 0, on_batch=toggle)
        try:
            runner.train(["train"], [])
            out[name] = "no sync"
        except RuntimeError as err:
            torch.cuda.set_sync_debug_mode("default")
            out[name] = f"sync: {str(err).splitlines()[0][:200]}"
            failures.append(name)
        finally:
            runner.close()
    if failures:
        raise AssertionError(f"host syncs between step logs in: {failures}; {out}")
    return out


def check_speed_small(ctx: Context) -> dict[str, Any]:
    """Per-step time of the runner against a hand loop where launch overhead dominates (small MLP, fp32)."""
    batch, n = 64, (64 * 40 if ctx.quick else 64 * 400)
    dataset = classification_data(n, 32, 8, seed=0)

    def build_hand() -> Callable[[int], float]:
        torch.manual_seed(0)
        return hand_loop(
            mlp(32, 128, 8).to(ctx.device), nn.CrossEntropyLoss(), dataset, ctx, batch_size=batch, dtype=None
        )

    def build_runner() -> dl.TorchRunner:
        config = runner_config(
            ctx,
            "speed-small",
            epochs=1,
            log_interval=10**9,
            **{"checkpoint.load_only": True, "dataloader.batch_size": batch},
        )
        config.task.n_train, config.task.n_val = n, 0
        return quiet(MLPRunner(config))

    return measure_pair(build_hand, build_runner, ctx, warmup=10, rounds=2 if ctx.quick else 3)


class TokenLM(nn.Module):
    """A GPT-2 language model (random init) as `tokens -> logits`, so the runner's default step fits it."""

    def __init__(self, config: Any) -> None:
        super().__init__()
        from transformers import GPT2LMHeadModel

        self.model = GPT2LMHeadModel(config)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids=tokens).logits


def lm_loss(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(logits.flatten(0, 1).float(), target.flatten())


def markov_tokens(sequences: int, length: int, vocab: int, seed: int = 0) -> TensorDataset:
    """Sequences of a fixed random Markov chain (4 successors per token): a language a model learns fast."""
    generator = torch.Generator().manual_seed(seed)
    successors = torch.randint(0, vocab, (vocab, 4), generator=generator)
    tokens = torch.empty(sequences, length + 1, dtype=torch.long)
    tokens[:, 0] = torch.randint(0, vocab, (sequences,), generator=generator)
    for i in range(length):
        choice = torch.randint(0, 4, (sequences,), generator=generator)
        tokens[:, i + 1] = successors[tokens[:, i], choice]
    return TensorDataset(tokens[:, :-1].clone(), tokens[:, 1:].clone())


class LMRunner(dl.TorchRunner):
    def __init__(self, config: dl.RunnerConfig, gpt_config: Any, dataset: TensorDataset) -> None:
        super().__init__(config)
        torch.manual_seed(0)
        self.model = TokenLM(gpt_config)
        self.criterion = lm_loss
        self.datasets.train = dataset


class LossOnlyLMRunner(LMRunner):
    """`train_step` as a user who returns no prediction writes it: the logits die before `backward`.

    Measured beside the default step, whose returned prediction stays alive through `backward`.
    """

    def train_step(self, data: Any) -> tuple[Any, torch.Tensor]:
        input, target = (t.to(self.device, non_blocking=True) for t in data)
        with self.train_context():
            loss = self.criterion(self.model(input), target)
        self.backward(loss)
        self.step()
        return None, loss.detach()


def check_gpt2(ctx: Context) -> dict[str, Any]:
    """A GPT-2-small-sized model (random init, bf16) trains through the runner; its per-step time, peak
    memory, tokens/s and MFU against the same hand-written loop."""
    try:
        from transformers import GPT2Config
    except ImportError as err:
        raise Skip(f"needs transformers ({err})") from err
    if ctx.quick:
        gpt, batch, length, steps = (
            GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=512, n_positions=64, bos_token_id=0, eos_token_id=0),
            4,
            64,
            24,
        )
    else:
        gpt, batch, length, steps = GPT2Config(n_positions=1024), 8, 1024, 40
    warmup = 4
    dataset = markov_tokens(batch * steps, length, min(gpt.vocab_size, 4096))

    def build_hand() -> Callable[[int], float]:
        torch.manual_seed(0)
        return hand_loop(TokenLM(gpt).to(ctx.device), lm_loss, dataset, ctx, batch_size=batch, dtype=torch.bfloat16)

    runners: list[LMRunner] = []
    probes: list[float] = []

    def probe_loss(runner: dl.TorchRunner) -> float:
        tokens, target = (t[:batch].to(ctx.device) for t in dataset.tensors)
        with torch.no_grad(), torch.autocast(ctx.device.type, dtype=torch.bfloat16):
            return float(lm_loss(runner.model(tokens), target))

    def lm_config(name: str) -> dl.RunnerConfig:
        return dl.RunnerConfig(
            workspace_root=str(ctx.workdir / name),
            seed=0,
            log=False,
            epochs=1,
            precision="bf16",
            log_interval=10**9,
            **{"optim.type": "adamw", "optim.lr": 1e-3, "dataloader.batch_size": batch},
            **{"dataloader.pin_memory": ctx.cuda, "checkpoint.load_only": True},
            # A CPU has no peak in the table: a nominal one lets the quick run exercise the telemetry.
            **({} if ctx.cuda else {"telemetry.peak_tflops": 1.0}),
        )

    def build_runner() -> dl.TorchRunner:
        runners.append(quiet(LMRunner(lm_config("gpt2"), gpt, dataset)))
        probes.append(probe_loss(runners[-1]))  # before any training
        return runners[-1]

    out = measure_pair(build_hand, build_runner, ctx, warmup=warmup, rounds=2)
    start = begin_memory(ctx)  # the same run with a step that returns no prediction (see LossOnlyLMRunner)
    loss_only = quiet(LossOnlyLMRunner(lm_config("gpt2-loss-only"), gpt, dataset))
    out["loss_only_runner_ms"] = time_runner_epoch(loss_only, warmup) * 1e3
    out["loss_only_runner_peak_mib"] = peak_since(ctx, start)
    loss_only.close()
    probes.append(probe_loss(runners[0]))
    out["loss_before"], out["loss_after"] = probes
    if not probes[1] < probes[0] - 0.5:
        raise AssertionError(f"GPT-2 did not train: loss on a fixed batch {probes[0]:.3f} -> {probes[1]:.3f}")
    tokens = batch * length
    out["tokens_per_step"] = tokens
    out["runner_tokens_per_s"] = tokens / (out["runner_ms"] / 1e3)
    out["hand_tokens_per_s"] = tokens / (out["hand_ms"] / 1e3)
    out["parameters_m"] = sum(p.numel() for p in runners[0].model.parameters()) / 1e6
    out["flops_per_step"] = step_flops(runners[0].model, dataset, batch, ctx)
    out["runner_tflops"] = out["flops_per_step"] / (out["runner_ms"] / 1e3) / 1e12
    peak = peak_flops(torch.cuda.get_device_name(ctx.device), "bf16") if ctx.cuda else None
    out["runner_mfu"] = out["runner_tflops"] * 1e12 / peak if peak else None
    out.update(logged_telemetry(runners[0]))
    return out


def logged_telemetry(runner: dl.TorchRunner) -> dict[str, Any]:
    """The runner's own `tflops` and `mfu` (its telemetry) from the last step log of its `metrics.csv`.

    Its rate spans the whole last epoch (warm-up included), so it sits a little below the
    benchmark's, which times the steps after the warm-up only.
    """
    import csv

    with open(runner.workspace.path / "metrics.csv", newline="") as file:
        rows = [row for row in csv.DictReader(file) if row.get("tflops")]
    if not rows:
        raise AssertionError("the runner logged no tflops: its telemetry did not run")
    return {
        "runner_counted_flops": runner.telemetry.flops_per_step,
        "runner_logged_tflops": float(rows[-1]["tflops"]),
        "runner_logged_mfu": float(rows[-1]["mfu"]),
    }


def step_flops(model: nn.Module, dataset: TensorDataset, batch: int, ctx: Context) -> float:
    """FLOPs of one training step (forward and backward), counted once by `torch.utils.flop_counter`."""
    from torch.utils.flop_counter import FlopCounterMode

    tokens, target = (t[:batch].to(ctx.device) for t in dataset.tensors)
    counter = FlopCounterMode(display=False)
    with counter, torch.autocast(ctx.device.type, dtype=torch.bfloat16):
        lm_loss(model(tokens), target).backward()
    model.zero_grad(set_to_none=True)
    return float(counter.get_total_flops())


def check_metrics(ctx: Context) -> dict[str, Any]:
    """Exact metrics kept on the device give the CPU's values (the counting and ranking paths differ by device)."""
    import bench_device_ranking as bench

    from danling.metrics import binary_metrics, multiclass_metrics, multilabel_metrics

    n, batch, columns = (20_000, 5_000, bench.COLUMNS) if ctx.quick else (400_000, 50_000, bench.COLUMNS)
    names = ["acc", "f1", "mcc", "auroc", "auprc"]
    builders = {
        "binary": lambda device, bins: binary_metrics(names, bins=bins, device=device),
        "multiclass": lambda device, bins: multiclass_metrics(columns, names, bins=bins, device=device),
        "multilabel": lambda device, bins: multilabel_metrics(columns, names, bins=bins, device=device),
    }
    generator = torch.Generator().manual_seed(0)
    out: dict[str, Any] = {"samples": n}
    worst = 0.0
    for task, build in builders.items():
        scores, target = bench.sample(task, n, generator)  # 5% of rows ignored, on both sides
        # the first pass warms the device (kernels loaded, allocator primed); the second pass is timed
        for bins in (None, None, 1000, 1000):
            values = {}
            for device in ("cpu", ctx.device):
                start_bytes = begin_memory(ctx)
                metrics = build(device, bins)
                for start in range(0, n, batch):
                    metrics.update(scores[start : start + batch].to(device), target[start : start + batch].to(device))
                synchronize(ctx.device)
                started = time.perf_counter()
                values[str(device)] = dict(metrics.compute())
                synchronize(ctx.device)
                out[f"{task}{'' if bins is None else '_binned'}_{torch.device(device).type}_compute_ms"] = round(
                    (time.perf_counter() - started) * 1e3, 2
                )
                peak = peak_since(ctx, start_bytes)
                if peak is not None and torch.device(device).type == "cuda":
                    # device memory at the peak of updates and compute, as a multiple of the float32 scores
                    key = f"{task}{'' if bins is None else '_binned'}_cuda_peak_x_scores"
                    out[key] = round(peak * 2**20 / (scores.numel() * 4), 2)
                del metrics
            cpu, dev = values["cpu"], values[str(ctx.device)]
            for name in names:
                gap = abs(float(cpu[name]) - float(dev[name]))
                worst = max(worst, gap)
                if gap > 1e-5:
                    raise AssertionError(
                        f"{task} {name} (bins={bins}): cpu {cpu[name]} against {ctx.device} {dev[name]}"
                    )
        if ctx.cuda:
            # the device ranking behind exact AUROC/AUPRC reads nothing on the host
            from danling.metrics.functional._ranking import tensor_ranking

            chunks = [
                (scores[i : i + batch].to(ctx.device), target[i : i + batch].to(ctx.device)) for i in range(0, n, batch)
            ]
            synchronize(ctx.device)
            torch.cuda.set_sync_debug_mode("error")
            try:
                tensor_ranking(task, chunks, columns, -100, False)
                out[f"{task}_ranking_syncs"] = "none"
            finally:
                torch.cuda.set_sync_debug_mode("default")
        # The device ranking against the curves it replaced, on the same kept data: time ratio and
        # peaks above that data (CUDA only), as `bench_device_ranking.py` measures them.
        kept = bench.data(task, n, ctx.device)
        curves_s, curves_peak, _ = bench.measure(bench.curves_path, task, kept, ctx.device, 3)
        ranking_s, ranking_peak, _ = bench.measure(bench.ranking_path, task, kept, ctx.device, 3)
        out[f"{task}_ranking_time_vs_curves"] = round(ranking_s / curves_s, 2)
        if ranking_peak is not None and curves_peak is not None:
            out[f"{task}_ranking_peak_vs_curves"] = f"{ranking_peak:.2f}x / {curves_peak:.2f}x"
        del kept
    out["max_difference"] = worst
    return out


CHECKS: dict[str, Callable[[Context], dict[str, Any]]] = {
    "environment": check_environment,
    "precision": check_precision,
    "resume": check_resume,
    "dcp": check_dcp,
    "fsdp2": check_fsdp2,
    "compile": check_compile,
    "sync": check_sync,
    "speed-small": check_speed_small,
    "gpt2": check_gpt2,
    "metrics": check_metrics,
    "fp8": lambda ctx: __import__("gpu_fp8").check_fp8(ctx),  # in its own module (gpu_fp8.py): it imports this one
}


if __name__ == "__main__" and sys.argv[1:2] == ["resume-child"]:
    resume_child(sys.argv[2], sys.argv[3], int(sys.argv[4]))
