"""The DeepSpeed backend: the runner, its update strategy and its config.

- [`DeepSpeedRunner`][danling.runners.deepspeed.runner.DeepSpeedRunner] (`runner.py`): registered for
  the stacks `deepspeed` and `ds`;
- [`DeepSpeedUpdateStrategy`][danling.runners.deepspeed.update.DeepSpeedUpdateStrategy] (`update.py`):
  danling's accumulation windows over an engine that owns backward and the optimizer step;
- [`build_deepspeed_config`][danling.runners.deepspeed.config.build_deepspeed_config] (`config.py`): the
  effective DeepSpeed config from the user's section and the runner's settings, as explicit values;
- [`DeepSpeedCheckpointing`][danling.runners.deepspeed.checkpoint.DeepSpeedCheckpointing],
  [`load_tag`][danling.runners.deepspeed.checkpoint.load_tag] and
  [`export_fp32`][danling.runners.deepspeed.checkpoint.export_fp32] (`checkpoint.py`): the runner's
  checkpointing component, loading exactly one tag into an engine (on any data-parallel size) and
  writing its merged fp32 weights.

Nothing here imports DeepSpeed itself: the runner imports it when it builds the engine.
"""

from .config import build_deepspeed_config
from .runner import DeepSpeedRunner
from .update import DeepSpeedUpdateStrategy, gathered_parameters

__all__ = ["DeepSpeedRunner", "DeepSpeedUpdateStrategy", "build_deepspeed_config", "gathered_parameters"]
