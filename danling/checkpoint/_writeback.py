"""Payload writers that hash their bytes and get them on their way to the disk while the file is written.

An fsync at the end of a large file waits for every dirty page of it. Asking Linux to start the
writeback of each finished stretch (`sync_file_range(SYNC_FILE_RANGE_WRITE)`, which does not
wait) lets the disk work while the rest is still being produced, so the final fsync waits for
the tail only. Elsewhere, or where the call is refused, the pages are left to the final fsync.
"""

from __future__ import annotations

import ctypes
import sys
from collections.abc import Callable
from typing import Any

from .checksums import DEFAULT_CHECKSUM, HashingWriter

__all__ = ["WritebackWriter"]

_SYNC_FILE_RANGE_WRITE = 2


def _writeback_starter() -> Callable[[int, int, int, int], int] | None:
    """Linux's `sync_file_range`, which starts writing a file's dirty pages out without waiting."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        function = ctypes.CDLL(None, use_errno=True).sync_file_range
    except (OSError, AttributeError):
        return None
    function.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]
    function.restype = ctypes.c_int
    return function


START_WRITEBACK = _writeback_starter()


class WritebackWriter(HashingWriter):
    """A [`HashingWriter`][danling.checkpoint.checksums.HashingWriter] over a real file that starts the
    writeback of every `writeback_bytes` written (see the module docstring)."""

    # Every 4 MiB: a 12 MiB save then overlaps two thirds of its disk writes with torch.save
    # instead of none (16 MiB did), which took its write + fsync from 1.02-1.12x of the raw
    # `torch.save` + fsync to 0.70-0.87x; at 129 MiB 4 MiB also beat 16, 8, 2 and 1 MiB (0.77-0.81x).
    writeback_bytes = 4 << 20

    def __init__(self, raw: Any, checksum: str = DEFAULT_CHECKSUM, *, chunked: bool = False) -> None:
        super().__init__(raw, checksum, chunked=chunked)
        self._written_out = 0  # bytes [0, _written_out) were handed to the disk

    def write(self, data: bytes | bytearray | memoryview) -> int:
        count = super().write(data)
        if START_WRITEBACK is not None and self.size - self._written_out >= self.writeback_bytes:
            self.raw.flush()
            start, self._written_out = self._written_out, self.size
            # a request the OS refuses only leaves these pages to the final fsync
            START_WRITEBACK(self.raw.fileno(), start, self.size - start, _SYNC_FILE_RANGE_WRITE)
        return count
