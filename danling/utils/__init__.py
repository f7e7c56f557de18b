"""danling.utils."""

__all__: list[str] = []
