"""danling.runners."""

__all__: list[str] = []
