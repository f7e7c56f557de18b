"""The git commit a run's code comes from: short hash and details, recorded in the metadata of every launch."""

from __future__ import annotations

import os
import subprocess
import sys
from typing import Any

__all__ = ["git_diff", "git_info", "git_short_hash"]


def _git(cwd: str, *args: str) -> str | None:
    """Output of `git <args>` in `cwd`, or None when git is missing, fails or is not a repository."""
    env = {**os.environ, "GIT_OPTIONAL_LOCKS": "0", "LC_ALL": "C"}
    try:
        result = subprocess.run(
            ["git", *args],
            cwd=cwd,
            env=env,
            stdin=subprocess.DEVNULL,
            capture_output=True,
            text=True,
            timeout=10,
            check=False,
        )
    except (OSError, subprocess.SubprocessError, ValueError):
        return None
    output = result.stdout.strip()
    return output if result.returncode == 0 and output else None


def _code_dirs(path: str | os.PathLike | None) -> list[str]:
    if path is not None:
        return [os.fspath(path)]
    dirs = []
    script = getattr(sys.modules.get("__main__"), "__file__", None)
    if script:
        dirs.append(os.path.dirname(os.path.abspath(script)))
    dirs.append(os.getcwd())
    return [d for d in dict.fromkeys(dirs) if os.path.isdir(d)]


# Short hashes by (directory, git's search path): HEAD is read once per process per directory.
_SHORT_HASHES: dict[tuple[str, str], str | None] = {}


def git_short_hash(path: str | os.PathLike | None = None) -> str | None:
    """`git rev-parse --short HEAD` of `path`, else of the running script's directory, else of the cwd.

    Returns None when git is not installed, the directory is not in a repository or the
    repository has no commit yet; it never raises. The answer for a directory is remembered
    for the rest of the process (a code id names the code a process started with), so only
    the first runner of a process pays for the `git` subprocess.
    """
    for directory in _code_dirs(path):
        key = (os.path.realpath(directory), os.environ.get("PATH", ""))
        if key not in _SHORT_HASHES:
            _SHORT_HASHES[key] = _git(directory, "rev-parse", "--short", "HEAD")
        if _SHORT_HASHES[key] is not None:
            return _SHORT_HASHES[key]
    return None


def git_info(path: str | os.PathLike | None = None) -> dict[str, Any] | None:
    """Commit, short hash, branch, dirty flag and root of the repository holding the code, or None.

    `dirty` ignores untracked files and is read afresh on every call. Like `git_short_hash`
    it never raises.
    """
    for directory in _code_dirs(path):
        head = _git(directory, "rev-parse", "HEAD", "--abbrev-ref", "HEAD", "--show-toplevel")
        lines = [] if head is None else head.splitlines()
        if len(lines) != 3:
            continue
        commit, branch, root = lines
        status = _git(directory, "status", "--porcelain", "--untracked-files=no")
        short = git_short_hash(directory)
        if short is None or not commit.startswith(short):  # HEAD moved since the code id was read
            short = _git(directory, "rev-parse", "--short", "HEAD")
        return {
            "commit": commit,
            "short": short,
            "branch": branch,
            "dirty": status is not None,
            "root": root,
        }
    return None


def git_diff(root: str | os.PathLike) -> str | None:
    """`git diff HEAD` of the repository at `root`: the uncommitted changes to tracked files, or None.

    Never raises; returns None when git is missing or there is nothing to show.
    """
    output = _git(os.fspath(root), "diff", "HEAD", "--no-color", "--no-ext-diff")
    return output + "\n" if output else None
