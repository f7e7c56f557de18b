"""Child process for the SIGKILL test: stalls an async checkpoint write half-way through.

Run as `python _stalling_writer.py <directory>`. It saves `step-000001` completely, then starts
an asynchronous save of a large tensor; the writer thread writes half of the tensor bytes,
fsyncs them, reports `writing` on stdout and blocks reading stdin (the parent never writes),
so the parent's SIGKILL is guaranteed to land in the middle of the write.
"""

from __future__ import annotations

import os
import sys

STALL_AT_BYTES = 1 << 20


def main(directory: str) -> None:
    import torch

    from danling.checkpoint import FileCheckpointManager
    from danling.checkpoint.manifest import HashingWriter

    class StallingWriter(HashingWriter):
        def write(self, data):
            view = memoryview(data)
            if view.nbytes >= STALL_AT_BYTES:
                super().write(view[: view.nbytes // 2])
                self.raw.flush()
                os.fsync(self.raw.fileno())
                os.write(sys.stdout.fileno(), b"writing\n")
                os.read(sys.stdin.fileno(), 1)  # blocks until the parent kills us
            return super().write(data)

    class StallingManager(FileCheckpointManager):
        def _payload_stream(self, raw):
            return StallingWriter(raw)

    manager = StallingManager(directory, async_save=True)
    manager.save({"step": 1, "weight": torch.full((16,), 1.0)}, "step-000001")
    manager.wait()
    weight = torch.randn(4 << 20)  # 16 MiB: one large write inside torch.save
    manager.save({"step": 2, "weight": weight}, "step-000002")
    weight.add_(1.0)  # training goes on while the snapshot is written
    manager.wait()


if __name__ == "__main__":
    main(sys.argv[1])
