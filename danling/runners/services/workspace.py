"""Run identity, run directory, metadata, logging and print routing for one runner process.

Layout: `<workspace_root>/<lineage>/<experiment>-<id>[-v<N>]/`, holding `metadata.json`,
`config.yaml`, `run.log`, the checkpoint directory and whatever trackers write. `id` hashes what
is trained, never the budget or the code version; a new run never shares a directory holding
another run's checkpoints, it gets the next version (see `danling.runners.services.run_dirs`).
Only the main process (rank 0) creates directories or files, and only when they are first needed.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import platform
import sys
from collections.abc import Mapping
from datetime import datetime, timezone
from functools import cached_property
from importlib import metadata as importlib_metadata
from pathlib import Path
from typing import Any

from danling.checkpoint.manifest import CheckpointError
from danling.utils.io import dumps_strict

from .._config_refs import references_yaml, with_references
from ..config import RunnerConfig, recorded_config
from .git_info import git_info, git_short_hash
from .run_dirs import atomic_write as _atomic_write
from .run_dirs import choose_run_dir, launch_record, record_launch, set_aside_failed_launch
from .run_lock import RunLock

__all__ = ["RunnerWorkspace"]

LOGGER_NAME = "danling"
LOG_FORMAT = "%(asctime)s | %(levelname)-7s | rank %(rank)s | %(name)s | %(message)s"
LOG_DATE_FORMAT = "%Y-%m-%d %H:%M:%S"

_pristine_level: int | None = None  # level of the "danling" logger before any workspace touched it


def _or(value: Any, default: Any) -> Any:
    """`value`, or `default` when it is unset (None)."""
    return default if value is None else value


# -------------------------------------------------------------------------------------- logging


class _RankFilter(logging.Filter):
    def __init__(self, rank: int) -> None:
        super().__init__()
        self.rank = rank

    def filter(self, record: logging.LogRecord) -> bool:
        if not hasattr(record, "rank"):
            record.rank = self.rank
        return True


class _LineFormatter(logging.Formatter):
    """Puts the record's header (time, level, rank, logger) in front of every line of a multi-line message,
    so each line of a block (an epoch summary, the run summary) can be found with grep."""

    def format(self, record: logging.LogRecord) -> str:
        text = super().format(record)
        message = record.getMessage()
        if "\n" not in message or not text.endswith(message) or record.exc_text or record.stack_info:
            return text
        header = text[: len(text) - len(message)]
        return "\n".join(header + line for line in message.split("\n"))


class _StderrHandler(logging.StreamHandler):
    """Console handler that looks `sys.stderr` up on every record, so swapped streams are followed.

    Records go through `tqdm.write`, which clears an open progress bar, prints the line and draws
    the bar again below it, so log lines and bars never tear each other.
    """

    def emit(self, record: logging.LogRecord) -> None:
        try:
            from tqdm import tqdm

            tqdm.write(self.format(record), file=self.stream)
        except Exception:  # a broken stream must not take the run down
            self.handleError(record)

    @property  # type: ignore[override]
    def stream(self) -> Any:
        return sys.stderr

    @stream.setter
    def stream(self, value: Any) -> None:
        pass


class _LazyFileHandler(logging.FileHandler):
    """File handler that creates its directory and opens the file only when the first record arrives."""

    def __init__(self, filename: str | os.PathLike) -> None:
        super().__init__(filename, encoding="utf-8", delay=True)

    def _open(self) -> Any:
        os.makedirs(os.path.dirname(self.baseFilename), exist_ok=True)
        return super()._open()


def _root_logs_to_console() -> bool:
    consoles = (sys.stdout, sys.stderr, sys.__stdout__, sys.__stderr__)
    return any(
        isinstance(handler, logging.StreamHandler)
        and not isinstance(handler, logging.FileHandler)
        and handler.stream in consoles
        for handler in logging.getLogger().handlers
    )


# ------------------------------------------------------------------------------------ workspace


class RunnerWorkspace:
    """Where a run lives and how it reports: identity, directories, metadata, logs and stdout.

    Identity is fixed when the workspace is created: `config_id` is computed from the config at
    that moment (later edits, such as a seed drawn by the runner, do not move the run directory),
    and so is the version of the directory the run writes into. `code_id` is read from git once;
    it is recorded in the metadata of every launch, not in the directory name.

    Args:
        config: A `RunnerConfig` or a mapping of its keys.
        rank: Global rank of this process; only rank 0 writes files or logs to the console.
        world_size: Number of processes in the job.
        start_time: When the run started (defaults to now, UTC).
        code_dir: Directory whose git checkout identifies the code (defaults to the script's
            directory, then the working directory).

    Examples:
        >>> import tempfile
        >>> from danling.runners.config import RunnerConfig
        >>> root = tempfile.mkdtemp()
        >>> workspace = RunnerWorkspace(RunnerConfig(workspace_root=root, experiment="demo"), code_dir=root)
        >>> workspace.code_id is None, workspace.path.exists()
        (True, False)
        >>> workspace.dir.relative_to(root).as_posix() == f"lin/demo-{workspace.id}"
        True
        >>> workspace.write_metadata().name
        'metadata.json'
        >>> workspace.close()
    """

    def __init__(
        self,
        config: Any,
        *,
        rank: int = 0,
        world_size: int = 1,
        start_time: datetime | None = None,
        code_dir: str | os.PathLike | None = None,
    ) -> None:
        if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
            raise ValueError(f"world_size must be a positive integer, got {world_size!r}")
        if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < world_size:
            raise ValueError(f"rank must be an integer in [0, {world_size}), got {rank!r}")
        if not isinstance(config, RunnerConfig):
            if not isinstance(config, Mapping):
                raise TypeError(f"config must be a RunnerConfig or a mapping, got {type(config).__name__}")
            config = recorded_config(config)  # a plain mapping is read through the same typed sections
        self.config: RunnerConfig = config
        self.rank = rank
        self.world_size = world_size
        self.start_time = start_time or datetime.now(timezone.utc)
        self._code_dir = code_dir
        self._config_id = config.config_id
        self._token = object()  # marks the log handlers this workspace installed
        self._handlers: list[logging.Handler] = []
        self._stdout: Any = None
        self._devnull: Any = None
        self._metadata_written = False
        self.previous_launch: dict[str, Any] | None = None  # the launch before this one, when continuing
        self._lock: RunLock | None = None
        # {run dir: {checkpoint: reason}} of a version auto_resume refused: none of its checkpoints verifies
        self.refused: dict[Path, dict[str, str]] = {}
        self._path = self._choose_path()
        # A launch that died before its first checkpoint left its files here: they go to `failed/`
        # before this run opens its log or records, so the two runs' rows never mix.
        self.failed_launch: Path | None = None
        if self.is_main_process and not self.config.dry_run:
            self.failed_launch = set_aside_failed_launch(
                self._path, str(_or(self.config.checkpoint.dir_name, "checkpoints"))
            )

    # -------------------------------------------------------------------------------- identity
    @property
    def is_main_process(self) -> bool:
        """Whether this process is rank 0, the only one that writes files."""
        return self.rank == 0

    @property
    def root(self) -> Path:
        """`config.workspace_root` (user home expanded)."""
        return Path(os.path.expanduser(os.fspath(_or(self.config.workspace_root, "experiments"))))

    @property
    def lineage(self) -> str:
        """`config.lineage`, `"lin"` when unset."""
        return str(_or(self.config.lineage, "lin"))

    @property
    def experiment(self) -> str:
        """`config.experiment`, `"exp"` when unset."""
        return str(_or(self.config.experiment, "exp"))

    @cached_property
    def code_id(self) -> str | None:
        """Short git hash of the code's checkout, or None outside a repository or without git."""
        return git_short_hash(self._code_dir)

    @cached_property
    def _git_state(self) -> dict[str, Any] | None:
        # One launch, one code state: `metadata.json` and the launch record share one read (two git
        # subprocesses less before the first step).
        return git_info(self._code_dir)

    @property
    def config_id(self) -> str:
        """Hash of the semantic config, taken when the workspace was created."""
        return self._config_id

    @cached_property
    def id(self) -> str:
        """Experiment id: 12 hex digits derived from `config_id` alone (not the code); equal on every rank."""
        return hashlib.sha256(self.config_id.encode()).hexdigest()[:12]

    # ----------------------------------------------------------------------------------- paths
    @property
    def base_path(self) -> Path:
        """`<root>/<lineage>/<experiment>-<id>`: the first version of this experiment's run directory."""
        suffix = "-dry-run" if self.config.dry_run else ""  # never the real run's history
        return self.root / self.lineage / f"{self.experiment}-{self.id}{suffix}"

    def _choose_path(self) -> Path:
        base = self.base_path
        if self.config.dry_run:
            return base  # a dry run replaces the previous dry run
        dir_name = str(_or(self.config.checkpoint.dir_name, "checkpoints"))
        path = choose_run_dir(
            base,
            dir_name=dir_name,
            auto_resume=bool(self.config.auto_resume),
            resume=self.config.resume,
            refused=self.refused,
        )
        if self.refused and self.config.checkpoint.unverifiable == "stop":  # before anything is written
            run_dir, reasons = next(iter(self.refused.items()))
            raise CheckpointError(
                f"auto_resume: no checkpoint in {Path(run_dir) / dir_name} verifies (refused: "
                + "; ".join(f"{name}: {reason}" for name, reason in reasons.items())
                + "), and checkpoint.unverifiable is 'stop': repair or move them, or set checkpoint.unverifiable "
                f"to 'new-version' to start from scratch in {path}"
            )
        return path

    @property
    def path(self) -> Path:
        """The run directory's path (`base_path`, or its version `-v<N>`), without creating it."""
        return self._path

    @property
    def version(self) -> int:
        """Version of the run directory: 1 for `base_path`, N for `<base_path>-v<N>`."""
        suffix = self._path.name.rsplit("-", 1)[-1]
        return int(suffix[1:]) if suffix[:1] == "v" and suffix[1:].isdigit() else 1

    @property
    def dir(self) -> Path:
        """The run directory; the main process creates it on first access."""
        path = self.path
        if self.is_main_process:
            try:
                path.mkdir(parents=True, exist_ok=True)
            except OSError as err:  # the root is a file, read-only, on a full disk, ...
                root = self.config.workspace_root
                raise OSError(
                    err.errno,
                    f"cannot create the run directory {path} ({os.strerror(err.errno) if err.errno else err}): "
                    f"set workspace_root (now {root!r}) to a directory this process can write",
                ) from err
        return path

    @property
    def checkpoint_dir(self) -> Path:
        """`<run dir>/<checkpoint.dir_name>` (not created here)."""
        return self.path / str(_or(self.config.checkpoint.dir_name, "checkpoints"))

    @property
    def heartbeat_dir(self) -> Path:
        """`<run dir>/<heartbeat.dir_name>` (not created here)."""
        return self.path / str(_or(self.config.heartbeat.dir_name, "heartbeats"))

    @property
    def log_file(self) -> Path:
        """`run.log` on the main process; `rank<N>.log` (warnings and errors only) elsewhere."""
        return self.path / ("run.log" if self.is_main_process else f"rank{self.rank}.log")

    @property
    def metadata_file(self) -> Path:
        """`<run dir>/metadata.json`."""
        return self.path / "metadata.json"

    def resolve(self, path: str | os.PathLike) -> Path:
        """`path` itself when absolute, otherwise relative to the run directory (not created)."""
        path = Path(os.path.expanduser(os.fspath(path)))
        return path if path.is_absolute() else self.path / path

    # -------------------------------------------------------------------------------- metadata
    def metadata(self) -> dict[str, Any]:
        """What `write_metadata` records: identity, config, versions, git state and start time."""
        return {
            "id": self.id,
            "config_id": self.config_id,
            "code_id": self.code_id,
            "lineage": self.lineage,
            "experiment": self.experiment,
            "dir": os.fspath(self.path),
            "version": self.version,
            "start_time": self.start_time.isoformat(),
            "world_size": self.world_size,
            "argv": list(sys.argv),
            "cwd": os.getcwd(),
            "hostname": platform.node(),
            "versions": _versions(),
            "git": self._git_state,
            "config": with_references(self.config, _plain(self.config)),  # !env values as references
        }

    def launch(self) -> dict[str, Any]:
        """What one launch of the run records in `metadata.json["launches"]`: time, code, budget, seed."""
        return launch_record(self.config, self.start_time, self.code_id, self._git_state, self.world_size)

    def write_metadata(self, extra: Mapping[str, Any] | None = None) -> Path:
        """Write `metadata.json` and `config.yaml` into the run directory, once per run.

        Only the main process writes. Existing files (a resumed run) are kept as they are, so
        the recorded start time and config are those of the first launch; each launch that
        trains appends its own record to `launches` when it takes the lock (see `lock`). Each
        file is written to a temporary name, flushed to disk and renamed into place.

        Args:
            extra: Additional top-level entries (for example the runner class and timestamp).

        Returns:
            Path of `metadata.json`.
        """
        path = self.metadata_file
        if not self.is_main_process or self._metadata_written:
            return path
        self.dir  # noqa: B018 - creates the run directory
        if not path.exists():
            payload = self.metadata()
            payload.update(extra or {})
            # strict JSON (a non-finite config value is written as null): config.yaml keeps the value itself
            _atomic_write(path, dumps_strict(payload, indent=2, default=str) + "\n")
        config_file = path.with_name("config.yaml")
        if not config_file.exists():
            _atomic_write(config_file, _config_yaml(self.config))
        self._metadata_written = True
        return path

    # --------------------------------------------------------------------------------- logging
    def setup_logging(self, level: int = logging.INFO) -> logging.Logger:
        """Attach this run's handlers to the `"danling"` logger and return it.

        Main process: console (stderr) at `level`, unless the root logger already prints to the
        console, and `run.log` at `level` when `config.log` is true. Other ranks: no console;
        warnings and errors go to `rank<N>.log`, which is only created if one is emitted.
        Handlers installed by another workspace in this process are removed first, so creating
        several runners never duplicates lines. Calling it again is a no-op.

        Examples:
            >>> import tempfile
            >>> from danling.runners.config import RunnerConfig
            >>> workspace = RunnerWorkspace(RunnerConfig(workspace_root=tempfile.mkdtemp()))
            >>> logger = workspace.setup_logging()
            >>> logger.name, len(workspace.setup_logging().handlers) == len(logger.handlers)
            ('danling', True)
            >>> workspace.close()
        """
        global _pristine_level
        logger = logging.getLogger(LOGGER_NAME)
        if self._handlers:
            return logger
        owned = [h for h in logger.handlers if getattr(h, "danling_owner", None) is not None]
        if not owned:
            _pristine_level = logger.level
        for handler in owned:
            logger.removeHandler(handler)
            handler.close()
        formatter = _LineFormatter(LOG_FORMAT, datefmt=LOG_DATE_FORMAT)
        handlers: list[tuple[logging.Handler, int]] = []
        if self.is_main_process:
            if not _root_logs_to_console():
                handlers.append((_StderrHandler(), level))
            if _or(self.config.log, True):
                handlers.append((_LazyFileHandler(self.log_file), level))
        else:
            handlers.append((_LazyFileHandler(self.log_file), max(level, logging.WARNING)))
        for handler, handler_level in handlers:
            handler.setLevel(handler_level)
            handler.setFormatter(formatter)
            handler.addFilter(_RankFilter(self.rank))
            handler.danling_owner = self._token  # type: ignore[attr-defined]
            logger.addHandler(handler)
            self._handlers.append(handler)
        if logger.level == logging.NOTSET or logger.level > level:
            logger.setLevel(level)
        if self.failed_launch is not None:
            logger.warning(
                "run directory %s held a launch that ended before its first checkpoint: its files are in %s; "
                "this run starts afresh",
                self.path,
                self.failed_launch,
            )
        return logger

    # ---------------------------------------------------------------------------- print routing
    def route_print(self) -> None:
        """Silence `print` on non-main ranks by pointing `sys.stdout` at the null device.

        `builtins.print` is left untouched; `print(..., file=sys.stderr)` still shows. No-op on
        the main process and when already routed.
        """
        if self.is_main_process or self._devnull is not None:
            return
        self._stdout = sys.stdout
        self._devnull = open(os.devnull, "w", encoding="utf-8")  # noqa: SIM115 - closed in restore_print
        sys.stdout = self._devnull

    def restore_print(self) -> None:
        """Undo `route_print`. If something else replaced `sys.stdout` since, it is left in place."""
        if self._devnull is None:
            return
        if sys.stdout is self._devnull:
            sys.stdout = self._stdout
            self._devnull.close()
        self._devnull = None
        self._stdout = None

    # ------------------------------------------------------------------------------------ lock
    def lock(self, logger: logging.Logger | None = None) -> None:
        """Hold the run directory's lock (main process only) until `close`, and record this launch.

        Once the lock is held, the launch (time, code, budget, seed; the diff of a dirty checkout
        in `code/launch-<N>.diff`) is appended to `metadata.json["launches"]`. See `RunLock`.

        Raises:
            RunDirectoryLockedError: Another live process trains in this directory.
        """
        if not self.is_main_process or self._lock is not None:
            return
        lock = RunLock(self.path)
        lock.acquire(logger)
        self._lock = lock
        self.previous_launch = record_launch(self.metadata_file, self.launch(), self.metadata)

    def close(self) -> None:
        """Release the run lock, restore stdout, detach and close the log handlers this workspace added; idempotent."""
        if self._lock is not None:
            self._lock.release()
            self._lock = None
        self.restore_print()
        logger = logging.getLogger(LOGGER_NAME)
        for handler in self._handlers:
            logger.removeHandler(handler)
            handler.close()
        if self._handlers and not any(getattr(h, "danling_owner", None) for h in logger.handlers):
            logger.setLevel(_pristine_level if _pristine_level is not None else logging.NOTSET)
        self._handlers = []

    def __enter__(self) -> RunnerWorkspace:
        return self

    def __exit__(self, *exc_info: Any) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"{type(self).__name__}(path={os.fspath(self.path)!r}, rank={self.rank}, world_size={self.world_size})"


# ------------------------------------------------------------------------------------- helpers


def _plain(config: Any) -> Any:
    """JSON-friendly copy of a config (chanfig configs export themselves with `dict()`)."""
    to_dict = getattr(config, "dict", None)
    return to_dict() if callable(to_dict) else dict(config)


def _config_yaml(config: Any) -> str:
    yamls = getattr(config, "yamls", None)
    text = references_yaml(config, _plain(config))  # None unless !env/!include values were read
    if text is not None or callable(yamls):
        return text if text is not None else yamls()
    import yaml

    return yaml.safe_dump(json.loads(json.dumps(_plain(config), default=str)), sort_keys=False)


def _versions() -> dict[str, str | None]:
    versions: dict[str, str | None] = {"python": platform.python_version(), "platform": platform.platform()}
    for package in ("danling", "torch", "numpy", "chanfig"):
        # The version of the module this process runs, when it says; the installed metadata (a scan
        # of every distribution on the path, about 8 ms before the first step) only otherwise.
        version = getattr(sys.modules.get(package), "__version__", None)
        if not isinstance(version, str):
            try:
                version = importlib_metadata.version(package)
            except importlib_metadata.PackageNotFoundError:
                version = None
        versions[package] = version
    torch = sys.modules.get("torch")
    versions["cuda"] = getattr(getattr(torch, "version", None), "cuda", None)
    return versions
