"""danling.distributed."""

__all__: list[str] = []
