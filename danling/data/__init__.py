"""danling.data."""

__all__: list[str] = []
