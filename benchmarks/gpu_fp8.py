"""The `fp8` check of `benchmarks/gpu_check.py`: a small model trains in fp8 (torchao float8) and in bf16.

Kept beside `gpu_workloads.py` (whose shared pieces it uses) so that neither file grows past its
size. On a device that cannot run float8 (a CPU, compute capability below 8.9, no torchao) the
check is skipped with the runner's own refusal; on a CPU it first runs the same comparison with
float8 emulated, so every line of it has run before a GPU's minutes are spent on it.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from gpu_workloads import Context, MLPRunner, Skip, final_losses, quiet, runner_config, time_runner_epoch

from danling.runners.update.fp8 import fp8_refusal

# Every size is divisible by 16 (the 16 classes too), so all three linears of the MLP convert.
SIZES = {"task.features": 256, "task.hidden": 1024, "task.classes": 16, "task.n_train": 8192, "task.n_val": 1024}
QUICK_SIZES = {"task.features": 32, "task.hidden": 64, "task.classes": 16, "task.n_train": 1024, "task.n_val": 128}


def check_fp8(ctx: Context) -> dict[str, Any]:
    """fp8 (torchao float8 linears under bf16 autocast) ends within 10% of bf16's validation loss."""
    refusal = fp8_refusal(ctx.device)
    emulate = refusal is not None and not ctx.cuda and "torchao" not in refusal
    if refusal is not None and not emulate:
        raise Skip(refusal)
    sizes = QUICK_SIZES if ctx.quick else SIZES
    epochs, batch = (3, 32) if ctx.quick else (3, 256)
    out: dict[str, Any] = {}
    # fp8 pays with compiled kernels (the float8 casts fuse into them), so it also runs compiled:
    # the conversion comes before `torch.compile` in `materialize_model`, and both must train.
    for name in ("bf16", "fp8", "fp8_compiled"):
        precision = "bf16" if name == "bf16" else "fp8"
        overrides = {
            "epochs": epochs,
            "precision": precision,
            "dataloader.batch_size": batch,
            "optim.lr": 3e-3,
            **sizes,
        }
        if precision == "fp8" and emulate:
            overrides["fp8.emulate"] = True
        if name == "fp8_compiled":
            overrides["compile.enable"] = True
            if not ctx.cuda:
                overrides["compile.backend"] = "aot_eager"  # inductor's C++ build on a 2-core CPU is minutes
        runner = quiet(MLPRunner(runner_config(ctx, f"fp8-{name}", **overrides)))
        if name == "fp8":
            conversion = runner.fp8.conversions[0]
            out["fp8_converted"], out["fp8_skipped"] = len(conversion.converted), len(conversion.skipped)
            if not conversion.converted:
                raise AssertionError("precision: fp8 converted no linear")
        out[f"{name}_initial_val_loss"] = float(runner.evaluate(["val"])["val"]["loss"])
        out[f"{name}_val_loss"] = final_losses(runner.train())["val"]
        out[f"{name}_ms_per_step"] = time_runner_epoch(runner, warmup=4) * 1e3
        runner.close()
    start, reference = out["bf16_initial_val_loss"], out["bf16_val_loss"]
    if not reference < 0.9 * start:
        raise AssertionError(f"bf16 did not train: validation loss {start:.4f} -> {reference:.4f}")
    for name in ("fp8", "fp8_compiled"):
        value = out[f"{name}_val_loss"]
        if not math.isfinite(value) or abs(value - reference) > 0.1 * reference:
            raise AssertionError(f"{name} ended at validation loss {value:.4f}, bf16 at {reference:.4f} (>10% apart)")
    if emulate:
        value = out["fp8_val_loss"]
        summary = f"bf16 {reference:.4f}, fp8 {value:.4f} (compiled {out['fp8_compiled_val_loss']:.4f}), "
        summary += f"{out['fp8_converted']} linears converted"
        raise Skip(f"{refusal} (float8 emulated on the CPU instead: validation loss {summary})")
    out["device_capability"] = ".".join(map(str, torch.cuda.get_device_capability(ctx.device)))
    return out
