"""Child process of the run-identity tests: holds a run lock or writes an unfinished checkpoint, then waits.

It prints one line once its state is in place and then blocks reading stdin, so the parent
knows exactly when to look and decides when the child ends (stdin closed, or SIGKILL).
"""

from __future__ import annotations

import sys
from pathlib import Path

from danling.checkpoint.layout import in_flight, temp_token
from danling.runners.services.run_lock import RunLock


def main() -> None:
    mode, directory = sys.argv[1], Path(sys.argv[2])
    if mode == "lock":
        lock = RunLock(directory)
        lock.acquire()
        print("locked", flush=True)
        sys.stdin.read()
        lock.release()
    elif mode == "save":  # a save in progress: a temporary checkpoint directory being filled
        tmp = directory / f".tmp-epoch-000001-{temp_token()}"
        with in_flight(tmp):
            tmp.mkdir(parents=True)
            (tmp / "payload.part").write_bytes(b"x" * 16)
            print(tmp.name, flush=True)
            sys.stdin.read()
    else:
        raise SystemExit(f"unknown mode {mode!r}")


if __name__ == "__main__":
    main()
