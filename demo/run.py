"""The main demo. Until the runner lands it showcases the standalone utilities."""

from __future__ import annotations

import tempfile
from pathlib import Path

import danling


def main() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        print(f"danling {danling.__version__}: workspace {tmp}")
        print("public names:", len(danling.__all__))
        print(Path(tmp).exists())


if __name__ == "__main__":
    main()
