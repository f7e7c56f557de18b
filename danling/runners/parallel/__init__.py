"""Building blocks of [`ParallelRunner`][danling.runners.parallel_runner.ParallelRunner]: FSDP2 units and
policies, tensor-parallel plans, activation checkpointing, pipeline stages and schedules, and the merged
view of local model parts."""

from .fsdp import apply_fsdp, block_modules, fsdp_mixed_precision, fsdp_offload
from .parts import merge_parts
from .pipeline import PipelineMixin
from .pipeline_loader import StepProxyLoader
from .pipeline_parts import PipelineModelPart
from .tensor import TENSOR_PARALLEL_STYLES, apply_tensor_plan, checkpoint_blocks

__all__ = [
    "PipelineMixin",
    "PipelineModelPart",
    "StepProxyLoader",
    "TENSOR_PARALLEL_STYLES",
    "apply_fsdp",
    "apply_tensor_plan",
    "block_modules",
    "checkpoint_blocks",
    "fsdp_mixed_precision",
    "fsdp_offload",
    "merge_parts",
]
