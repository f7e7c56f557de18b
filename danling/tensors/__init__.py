"""danling.tensors."""

__all__: list[str] = []
