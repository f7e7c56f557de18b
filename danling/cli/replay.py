"""`danling replay BUNDLE`: re-run a failing update on one process and name where it first went non-finite.

Runs [`replay_bundle`][danling.runners.diagnosis.replaying.replay_bundle] on a bundle a run wrote
under `<run dir>/replay/` (see `replay.*` in the config) and prints its report. The runner class
the bundle names must be importable here (the run's code on `PYTHONPATH`).
"""

from __future__ import annotations

from typing import TextIO

from danling.utils.io import dumps_strict

from .records import CLIError

__all__ = ["replay_command"]


def replay_command(bundle: str, as_json: bool, out: TextIO, workdir: str | None = None) -> int:
    """Replay `bundle` and print what it found; exit status 0 (a damaged bundle is a `CLIError`)."""
    from danling.runners.diagnosis.replaying import BundleError, replay_bundle

    try:
        report = replay_bundle(bundle, workdir=workdir)
    except BundleError as error:
        raise CLIError(str(error)) from None
    if as_json:
        out.write(dumps_strict(report.as_dict(), indent=2, default=repr) + "\n")
    else:
        out.write("\n".join(report.lines()) + "\n")
    return 0
