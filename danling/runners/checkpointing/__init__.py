"""The runner's checkpoint API (`api`) and the torch payload and exact-resume state (`torch_state`)."""

from .api import CheckpointMixin, CheckpointSource
from .torch_state import TorchCheckpointMixin

__all__ = ["CheckpointMixin", "CheckpointSource", "TorchCheckpointMixin"]
