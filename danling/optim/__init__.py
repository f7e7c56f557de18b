"""danling.optim."""

__all__: list[str] = []
