"""The runner's checkpointing: the component (`component`, `torch_state`) and the runner's hooks over it (`hooks`)."""

from .component import CheckpointHost, CheckpointSource, RunnerCheckpointing
from .hooks import CheckpointHooks
from .torch_state import TorchCheckpointHost, TorchCheckpointing

__all__ = [
    "CheckpointHooks",
    "CheckpointHost",
    "CheckpointSource",
    "RunnerCheckpointing",
    "TorchCheckpointHost",
    "TorchCheckpointing",
]
