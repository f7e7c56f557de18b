"""Load and save files by extension, with atomic writes.

Every supported format is one [`FileFormat`][danling.utils.io.FileFormat] entry in
[`FORMATS`][danling.utils.io.FORMATS]; [`load`][danling.utils.load] and
[`save`][danling.utils.save] look the extension up there, so adding a format means adding one
entry. pandas is imported only when a table format is used.
"""

from __future__ import annotations

import json
import math
import os
import pathlib
import pickle
import secrets
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import IO, Any, TypeVar

import numpy as np
import torch
import yaml

from .imports import optional_import

__all__ = ["FORMATS", "FileFormat", "is_json_serializable", "load", "load_pandas", "save"]

PathStr = str | os.PathLike
File = TypeVar("File", str, os.PathLike)


@dataclass(frozen=True)
class FileFormat:
    """How one family of file extensions is read and written.

    Attributes:
        extensions: Lower-case extensions without the dot, e.g. `("yaml", "yml")`.
        load: `load(path, *args, **kwargs)` returning the decoded object.
        save: `save(obj, handle, *args, **kwargs)` writing to an open binary file handle.
        extension_aware: Passes the lower-case extension as `ext=` to both callables, for
            families such as pandas tables where one entry covers several encodings.
    """

    extensions: tuple[str, ...]
    load: Callable[..., Any]
    save: Callable[..., None]
    extension_aware: bool = False


# JSON / YAML ----------------------------------------------------------------------------------


def _plain(obj: Any) -> Any:
    """Best-effort conversion of tensors and NumPy values into JSON/YAML-friendly types."""
    if isinstance(obj, (torch.Tensor, np.ndarray, np.generic)):
        return obj.tolist()
    if isinstance(obj, (set, frozenset)):
        return list(obj)
    if isinstance(obj, os.PathLike):
        return os.fspath(obj)
    raise TypeError(f"object of type {type(obj).__name__} is not JSON serializable")


def _load_json(path: str, *args: Any, **kwargs: Any) -> Any:
    with open(path, encoding="utf-8") as handle:
        return json.load(handle, *args, **kwargs)


def _save_json(obj: Any, handle: IO[bytes], *args: Any, **kwargs: Any) -> None:
    kwargs.setdefault("indent", 4)
    kwargs.setdefault("ensure_ascii", False)
    kwargs.setdefault("default", _plain)
    # An explicit `allow_nan` asks for Python's own handling of NaN (write it, or raise).
    text = json.dumps(obj, *args, **kwargs) if args or "allow_nan" in kwargs else dumps_strict(obj, **kwargs)
    handle.write(text.encode("utf-8"))


def dumps_strict(obj: Any, **kwargs: Any) -> str:
    """`json.dumps(obj, **kwargs)` as strict JSON: NaN and infinite numbers are written as `null`.

    Python's `json` writes them as `NaN`, `Infinity` and `-Infinity`, which JSON does not have:
    `jq`, JavaScript's `JSON.parse` and most other readers refuse such a file or line. Reading
    the text back gives `None` where a non-finite number was. Numbers inside values that
    `default` converts (tensors, NumPy arrays) are covered too. Finite data is encoded in one
    pass; only data holding a non-finite number is converted first.

    Args:
        obj: The value to encode.
        **kwargs: Keyword arguments of `json.dumps` other than `allow_nan`.

    Examples:
        >>> dumps_strict({"loss": float("nan"), "scores": [1.5, float("inf")]})
        '{"loss": null, "scores": [1.5, null]}'
    """
    kwargs["allow_nan"] = False
    try:
        return json.dumps(obj, **kwargs)
    except ValueError as error:
        if not str(error).startswith("Out of range float"):  # a circular reference, say: not ours to mend
            raise
    return json.dumps(_finite(obj, kwargs.get("default")), **kwargs)


def _finite(value: Any, default: Callable[[Any], Any] | None) -> Any:
    """`value` with every NaN or infinite float replaced by `None`, converting what `default` converts."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, (str, int, type(None))):
        return value
    if isinstance(value, Mapping):
        return {key: _finite(item, default) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(item, default) for item in value]
    return value if default is None else _finite(default(value), default)


class _YamlDumper(yaml.SafeDumper):
    """Safe dumper that also writes mapping/sequence subclasses, tensors and NumPy values."""


_YamlDumper.add_multi_representer(dict, lambda dumper, data: dumper.represent_dict(dict(data)))
_YamlDumper.add_multi_representer(tuple, lambda dumper, data: dumper.represent_list(list(data)))
_YamlDumper.add_multi_representer(list, lambda dumper, data: dumper.represent_list(list(data)))
_YamlDumper.add_multi_representer(str, lambda dumper, data: dumper.represent_str(str(data)))
for _kind in (torch.Tensor, np.ndarray, np.generic):
    _YamlDumper.add_multi_representer(_kind, lambda dumper, data: dumper.represent_data(data.tolist()))
# Paths as strings, as JSON writes them (`_plain`); PyYAML matches classes by their MRO, where
# the `os.PathLike` protocol never appears.
_YamlDumper.add_multi_representer(pathlib.PurePath, lambda dumper, data: dumper.represent_str(os.fspath(data)))


def _load_yaml(path: str, *args: Any, **kwargs: Any) -> Any:
    with open(path, encoding="utf-8") as handle:
        return yaml.load(handle, *args, Loader=kwargs.pop("Loader", yaml.SafeLoader), **kwargs)


_YAML_UNSAFE_BREAKS = ("\x85", "\u2028", "\u2029")


def _save_yaml(obj: Any, handle: IO[bytes], *args: Any, **kwargs: Any) -> None:
    kwargs.setdefault("Dumper", _YamlDumper)
    kwargs.setdefault("sort_keys", False)
    kwargs.setdefault("allow_unicode", True)
    text = yaml.dump(obj, None, *args, **kwargs)
    if kwargs["allow_unicode"] and any(char in text for char in _YAML_UNSAFE_BREAKS):
        # PyYAML writes these line breaks raw under allow_unicode and reads them back as spaces.
        text = yaml.dump(obj, None, *args, **{**kwargs, "allow_unicode": False})
    handle.write(text.encode("utf-8"))


# torch / pickle / NumPy -----------------------------------------------------------------------


def _load_torch(path: str, *args: Any, trusted: bool = False, **kwargs: Any) -> Any:
    # Safe by default: only tensors, primitive containers and allow-listed types are unpickled.
    kwargs.setdefault("weights_only", not trusted)
    if not kwargs["weights_only"]:
        return torch.load(path, *args, **kwargs)
    # The checkpoint package imports this module, so its allow-list is imported here.
    from danling.checkpoint.unpickling import (
        DAMAGED_READ_ERRORS,
        SAFE_GLOBALS,
        _weights_only_reason,
        weights_only_refusal,
    )

    # The allow-list every other loader of danling uses (paths, NumPy values: `.pkl` files and
    # checkpoints admit them), and its one-line refusal instead of torch's advice to turn safety off.
    try:
        with torch.serialization.safe_globals(list(SAFE_GLOBALS)):
            return torch.load(path, *args, **kwargs)
    except pickle.UnpicklingError as err:
        refusal = weights_only_refusal(err, path)
        if refusal is not None:
            raise refusal from None
        # No type was refused: a file torch cannot read at all, and no reason to advise trusting it.
        raise pickle.UnpicklingError(
            f"cannot load {path!r}: not a readable torch file ({_weights_only_reason(err)})"
        ) from None
    except DAMAGED_READ_ERRORS as err:
        if isinstance(err, FileNotFoundError):
            raise
        raise pickle.UnpicklingError(f"cannot load {path!r}: not a readable torch file ({err!r})") from None


def _save_torch(obj: Any, handle: IO[bytes], *args: Any, **kwargs: Any) -> None:
    torch.save(obj, handle, *args, **kwargs)


def _load_pickle(path: str, *args: Any, trusted: bool = False, **kwargs: Any) -> Any:
    if trusted:
        with open(path, "rb") as handle:
            return pickle.load(handle, *args, **kwargs)
    from danling.checkpoint.unpickling import restricted_load  # the checkpoint package imports this module

    if args:  # what pickle.load says of them: its options are keyword-only
        raise TypeError(f"loading a pickle takes keyword options only, got positional {args!r}")
    return restricted_load(path, trusted=False, **kwargs)  # `encoding=` and the like, as trusted


def _save_pickle(obj: Any, handle: IO[bytes], *args: Any, **kwargs: Any) -> None:
    pickle.dump(obj, handle, *args, **kwargs)


def _load_numpy(path: str, *args: Any, ext: str, **kwargs: Any) -> Any:
    if ext == "npy":
        return np.load(path, *args, **kwargs)
    # An NpzFile keeps the archive open; copy the arrays out so the handle is released.
    with np.load(path, *args, **kwargs) as archive:
        return {name: archive[name] for name in archive.files}


def _save_numpy(obj: Any, handle: IO[bytes], *args: Any, ext: str, **kwargs: Any) -> None:
    if ext == "npy":
        np.save(handle, obj, *args, **kwargs)
        return
    writer = np.savez_compressed if kwargs.pop("compressed", False) else np.savez
    if isinstance(obj, Mapping):
        writer(handle, *args, **obj, **kwargs)
    elif isinstance(obj, (list, tuple)):
        writer(handle, *obj, *args, **kwargs)
    else:
        writer(handle, obj, *args, **kwargs)


# Text -----------------------------------------------------------------------------------------


def _load_text(path: str, *args: Any, **kwargs: Any) -> str:
    kwargs.setdefault("encoding", "utf-8")
    with open(path, *args, **kwargs) as handle:
        return handle.read()


def _save_text(obj: Any, handle: IO[bytes], encoding: str = "utf-8") -> None:
    if isinstance(obj, (list, tuple)):
        obj = "".join(f"{line}\n" for line in obj)
    if not isinstance(obj, str):
        raise TypeError(f"saving a .txt file expects a str or a list/tuple of lines, got {type(obj).__name__}")
    handle.write(obj.encode(encoding))


# pandas tables --------------------------------------------------------------------------------

_PANDAS_EXTENSIONS = ("csv", "tsv", "parquet", "feather")


def _read_table(path: str, *args: Any, ext: str, **kwargs: Any) -> Any:
    pandas = optional_import("pandas", "pandas")
    if ext == "tsv":
        kwargs.setdefault("sep", "\t")
    reader = {"csv": pandas.read_csv, "tsv": pandas.read_csv, "parquet": pandas.read_parquet}.get(
        ext, pandas.read_feather
    )
    return reader(path, *args, **kwargs)


def _write_table(obj: Any, handle: IO[bytes], *args: Any, ext: str, **kwargs: Any) -> None:
    pandas = optional_import("pandas", "pandas")
    if isinstance(obj, pandas.Series):
        obj = obj.to_frame()
    elif not isinstance(obj, pandas.DataFrame):
        try:
            obj = pandas.DataFrame(obj)
        except (TypeError, ValueError) as err:
            raise TypeError(f"cannot save a {type(obj).__name__} as a .{ext} table: {err}") from err
    if ext in ("csv", "tsv"):
        # The index is dropped by default so that load(save(df)) gives back the same columns.
        kwargs.setdefault("index", False)
        if ext == "tsv":
            kwargs.setdefault("sep", "\t")
        obj.to_csv(handle, *args, **kwargs)
    elif ext == "parquet":
        obj.to_parquet(handle, *args, **kwargs)
    else:
        obj.to_feather(handle, *args, **kwargs)


FORMATS: dict[str, FileFormat] = {}
"""Registry mapping a lower-case extension (no dot) to its [`FileFormat`][danling.utils.io.FileFormat]."""

for _format in (
    FileFormat(("json",), _load_json, _save_json),
    FileFormat(("yaml", "yml"), _load_yaml, _save_yaml),
    FileFormat(("pt", "pth", "bin"), _load_torch, _save_torch),
    FileFormat(("pkl", "pickle"), _load_pickle, _save_pickle),
    FileFormat(("npy", "npz"), _load_numpy, _save_numpy, extension_aware=True),
    FileFormat(("txt",), _load_text, _save_text),
    FileFormat(_PANDAS_EXTENSIONS, _read_table, _write_table, extension_aware=True),
):
    FORMATS.update(dict.fromkeys(_format.extensions, _format))


def _resolve(file: PathStr, action: str, formats: Mapping[str, FileFormat] = FORMATS) -> tuple[str, str, FileFormat]:
    """Return `(path, extension, format)` for `file`, or raise naming the accepted extensions."""
    if not isinstance(file, (str, os.PathLike)):
        raise TypeError(f"{action}() expects a path (str or os.PathLike), got {type(file).__name__}: {file!r}")
    path = os.fspath(file)
    ext = os.path.splitext(path)[1].lstrip(".").lower()
    if ext not in formats:
        supported = ", ".join(f".{name}" for name in formats)
        raise ValueError(
            f"cannot {action} {path!r}: extension {('.' + ext) if ext else '(none)'!r} is not supported; "
            f"supported extensions are {supported}"
        )
    return path, ext, formats[ext]


def load(file: PathStr, *args: Any, **kwargs: Any) -> Any:
    """Read a file, choosing the decoder from its extension.

    | extension | returns | backend |
    | --- | --- | --- |
    | `.json` | decoded JSON | `json.load` |
    | `.yaml`, `.yml` | decoded YAML | `yaml.load` with `SafeLoader` |
    | `.pt`, `.pth`, `.bin` | the saved object | `torch.load(weights_only=True)` |
    | `.pkl`, `.pickle` | the saved object | `pickle.load`, restricted unless `trusted=True` |
    | `.npy` / `.npz` | an array / a `dict` of arrays | `numpy.load` |
    | `.txt` | the text as one `str` | `open().read()` |
    | `.csv`, `.tsv`, `.parquet`, `.feather` | a `DataFrame` | pandas, see [`load_pandas`][danling.utils.load_pandas] |

    Torch files are read with `weights_only=True`, which only rebuilds tensors, plain
    containers and allow-listed types (torch's, plus the paths and NumPy values of
    [`SAFE_GLOBALS`][danling.checkpoint.unpickling.SAFE_GLOBALS]), so an untrusted checkpoint
    cannot run code; another type raises an `UnpicklingError` naming it. Pickle files
    are read with the restricted unpickler of [`danling.checkpoint.unpickling`][] (containers,
    plain values, NumPy arrays); a file needing more raises an `UnpicklingError` naming the type.
    Pass `trusted=True` for a file you trust that stores arbitrary Python objects.

    Args:
        file: Path to read. The extension is matched case-insensitively.
        *args: Forwarded to the backend reader.
        **kwargs: Forwarded to the backend reader (e.g. `map_location` for torch files);
            `trusted=True` lifts the restricted unpickling of torch and pickle files.

    Returns:
        The decoded object.

    Raises:
        ValueError: If the extension is not supported; the message lists the supported ones.
        FileNotFoundError: If `file` does not exist.
        TypeError: If `file` is not a path.
        ImportError: For table formats when pandas is not installed.

    Examples:
        >>> import os, tempfile
        >>> path = os.path.join(tempfile.mkdtemp(), "config.yaml")
        >>> save({"lr": 0.1, "layers": [64, 64]}, path)  # doctest: +ELLIPSIS
        '...config.yaml'
        >>> load(path)
        {'lr': 0.1, 'layers': [64, 64]}
        >>> load("weights.h5")
        Traceback (most recent call last):
        ValueError: cannot load 'weights.h5': extension '.h5' is not supported; supported extensions are .json, ...
    """
    path, ext, fmt = _resolve(file, "load")
    if not os.path.exists(path):
        raise FileNotFoundError(f"cannot load {path!r}: no such file")
    if fmt.extension_aware:
        kwargs["ext"] = ext
    if kwargs.get("trusted") is not None and fmt.load not in (_load_torch, _load_pickle):
        kwargs.pop("trusted")  # nothing to trust in formats that cannot run code
    return fmt.load(path, *args, **kwargs)


def load_pandas(file: PathStr, *args: Any, **kwargs: Any) -> Any:
    """Read a table with pandas, choosing the reader from the extension.

    `.csv` uses `pandas.read_csv`, `.tsv` the same with a tab separator, `.parquet`
    `pandas.read_parquet` and `.feather` `pandas.read_feather` (the last two need `pyarrow`).

    Args:
        file: Path to a `.csv`, `.tsv`, `.parquet` or `.feather` file.
        *args: Forwarded to the pandas reader.
        **kwargs: Forwarded to the pandas reader.

    Returns:
        A `pandas.DataFrame`.

    Raises:
        ValueError: If the extension is not a table format.
        FileNotFoundError: If `file` does not exist.
        ImportError: If pandas is not installed (`pip install danling[pandas]`).
    """
    table_formats = {ext: FORMATS[ext] for ext in _PANDAS_EXTENSIONS}
    path, ext, _ = _resolve(file, "load_pandas", table_formats)
    if not os.path.exists(path):
        raise FileNotFoundError(f"cannot load {path!r}: no such file")
    return _read_table(path, *args, ext=ext, **kwargs)


def save(obj: Any, file: File, *args: Any, durable: bool = True, **kwargs: Any) -> File:
    """Write `obj` to `file` atomically, choosing the encoder from the extension.

    The data first goes to a temporary file in the destination directory, which is flushed and
    fsync'ed before `os.replace` moves it over `file`. A crash or an encoding error therefore
    leaves either the previous file or the new one, never a truncated mix; the temporary file
    is removed when writing fails. Missing parent directories are created.

    With `durable=False` the two fsyncs (file and directory) are skipped: the replacement is
    still atomic for every reader and survives a crash of the process, but a power failure or
    kernel crash soon after may lose the new contents (the old file or the new one remains,
    depending on the filesystem). Use it for files that are rewritten often and can be rebuilt,
    such as per-epoch result summaries.

    JSON is written with `indent=4`, and JSON and YAML convert tensors and NumPy values to lists
    and paths to strings. JSON is strict: NaN and infinite numbers are written as `null` (see
    [`dumps_strict`][danling.utils.io.dumps_strict]) unless `allow_nan` is passed.
    YAML uses a safe dumper that writes mapping and sequence subclasses (for example chanfig
    configs or [`RoundDict`][danling.utils.RoundDict]) as plain ones. CSV/TSV files are written
    without the index; `.npz` accepts a mapping (named arrays), a list/tuple or a single array,
    and `compressed=True` selects `numpy.savez_compressed`. See [`load`][danling.utils.load]
    for the full table of formats.

    Args:
        obj: Object to write.
        file: Destination path.
        *args: Forwarded to the backend writer.
        durable: Flush the file and its directory entry to disk before returning.
        **kwargs: Forwarded to the backend writer.

    Returns:
        `file`, unchanged.

    Raises:
        ValueError: If the extension is not supported; the message lists the supported ones.
        TypeError: If `file` is not a path or `obj` cannot be encoded in that format.

    Examples:
        >>> import os, tempfile, torch
        >>> path = os.path.join(tempfile.mkdtemp(), "nested", "state.pt")
        >>> state = {"step": 3, "weight": torch.ones(2)}
        >>> load(save(state, path))
        {'step': 3, 'weight': tensor([1., 1.])}
    """
    path, ext, fmt = _resolve(file, "save")
    if fmt.extension_aware:
        kwargs["ext"] = ext
    directory = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(directory):  # a stat, cheaper than a failing mkdir on every save
        os.makedirs(directory, exist_ok=True)
    temp = os.path.join(directory, f".{os.path.basename(path)}.{secrets.token_hex(4)}.tmp")
    # os.open with 0o666 lets the umask decide permissions, as a plain open() would.
    descriptor = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_BINARY", 0), 0o666)
    try:
        with os.fdopen(descriptor, "wb") as handle:
            fmt.save(obj, handle, *args, **kwargs)
            if durable:
                handle.flush()
                os.fsync(handle.fileno())
        os.replace(temp, path)
    except BaseException as error:
        if os.path.exists(temp):
            os.remove(temp)
        if isinstance(error, OSError) and error.errno and not error.filename:  # a write: name the file
            raise OSError(error.errno, f"cannot write {path}: {error.strerror or error}", path) from error
        raise
    if durable:
        _fsync_directory(directory)
    return file


def _fsync_directory(directory: str) -> None:
    """Persist the rename itself; directories cannot be opened for fsync on some platforms."""
    try:
        descriptor = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(descriptor)
    except OSError:
        pass
    finally:
        os.close(descriptor)


def is_json_serializable(obj: Any) -> bool:
    """Tell whether `json.dumps` accepts `obj` as it is, without a custom encoder.

    Args:
        obj: Any object.

    Returns:
        `True` if `json.dumps(obj)` succeeds, `False` for unsupported types, circular
        references or values nested too deeply.

    Examples:
        >>> is_json_serializable({"lr": 1e-3, "layers": [64, 64], "name": None})
        True
        >>> is_json_serializable({"weights": {1, 2}})
        False
    """
    try:
        json.dumps(obj)
    except (TypeError, ValueError, OverflowError, RecursionError):
        return False
    return True
