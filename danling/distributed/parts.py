"""One module over several local model parts, for the components that expect a single model."""

from __future__ import annotations

from collections.abc import Sequence

from torch import nn

__all__ = ["merge_parts"]


class _Merged(nn.Module):
    """A plain container; its `forward` is never called (it only names parameters)."""

    def forward(self, *args, **kwargs):  # pragma: no cover - a naming view only
        raise RuntimeError("the merged view of model parts is for state dicts and optimizers, not for forward")


def merge_parts(parts: Sequence[nn.Module]) -> nn.Module:
    """A module whose parameters and buffers are those of `parts`, under the same names.

    Pipeline stages keep their modules at their original paths (`layers.0` on one stage,
    `layers.2` on another), so several local stages can be laid over one tree: a path both
    parts reach through plain containers is merged into one container, anything else is shared as
    is. Nothing is copied: the view's tensors are the parts' tensors.

    Raises:
        ValueError: Two parts put different modules or tensors at the same name.
    """
    if len(parts) == 1:
        return parts[0]
    root = _Merged()
    for part in parts:
        _overlay(root, part, "")
    return root


def _overlay(target: nn.Module, source: nn.Module, prefix: str) -> None:
    for name, tensor in [*source.named_parameters(recurse=False), *source.named_buffers(recurse=False)]:
        existing = getattr(target, name, None)
        if existing is not None and existing is not tensor:
            raise ValueError(f"model parts disagree on {prefix}{name}: each name must belong to one part")
        if isinstance(tensor, nn.Parameter):
            target.register_parameter(name, tensor)
        else:
            target.register_buffer(name, tensor)
    for name, child in source.named_children():
        existing = target._modules.get(name)
        if existing is None:
            target.add_module(name, child)
        elif existing is not child:
            if type(existing) is not _Merged:  # the first part's container: replace it by a merged one
                merged = _Merged()
                _overlay(merged, existing, f"{prefix}{name}.")
                target._modules[name] = existing = merged
            _overlay(existing, child, f"{prefix}{name}.")
