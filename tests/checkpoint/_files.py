"""Reading a checkpoint's manifest and damaging one byte of a file, for the integrity tests."""

from __future__ import annotations

import json

from danling.checkpoint.manifest import MANIFEST_NAME


def manifest_of(path) -> dict:
    """The parsed `manifest.json` of the checkpoint directory `path`."""
    return json.loads((path / MANIFEST_NAME).read_text())


def flip_byte(path, offset: int) -> None:
    """Invert the byte at `offset` of the file `path` in place."""
    data = bytearray(path.read_bytes())
    data[offset] ^= 0xFF
    path.write_bytes(bytes(data))
