"""danling.metrics."""

__all__: list[str] = []
