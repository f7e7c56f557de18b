"""The runner's checkpointing: the component (`component`, `torch_state`), its host (`host`) and hooks (`hooks`)."""

from .component import RunnerCheckpointing
from .hooks import CheckpointHooks
from .host import CheckpointHost, CheckpointSource, TorchCheckpointHost
from .torch_state import TorchCheckpointing

__all__ = [
    "CheckpointHooks",
    "CheckpointHost",
    "CheckpointSource",
    "RunnerCheckpointing",
    "TorchCheckpointHost",
    "TorchCheckpointing",
]
