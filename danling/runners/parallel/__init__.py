"""The runner-level part of [`ParallelRunner`][danling.runners.parallel_runner.ParallelRunner]'s pipeline:
[`PipelineSteps`][danling.runners.parallel.pipeline.PipelineSteps], the train/evaluate/infer steps through the
schedule, over the explicit [`PipelineHost`][danling.runners.parallel.pipeline.PipelineHost] protocol, and
[`ParallelCheckpointing`][danling.runners.parallel.checkpoint.ParallelCheckpointing], its checkpointing component.

The mechanics (FSDP2, tensor parallelism, stages and schedules) are functions in
[`danling.distributed`][danling.distributed]: `fsdp`, `tensor_parallel`, `parts`, `pipeline`,
`pipeline_parts`, `pipeline_runtime`, `pipeline_loader`."""

from .checkpoint import ParallelCheckpointHost, ParallelCheckpointing
from .pipeline import PipelineHost, PipelineSteps

__all__ = ["ParallelCheckpointHost", "ParallelCheckpointing", "PipelineHost", "PipelineSteps"]
