"""Paths in checkpoints load under every supported Python version, whichever version wrote them.

Python 3.13 moved the `pathlib` classes into `pathlib._local`, the module its pickles name (DCP's
`.metadata` holds the checkpoint's path, so every DCP checkpoint written under 3.13 names it);
3.10-3.12 name `pathlib` and cannot import `pathlib._local`. The pickles here are written under
either spelling, whatever Python runs the test.
"""

import io
import pathlib
import pickle
import re

import pytest
import torch

from danling.checkpoint.unpickling import UnsafePickleError, restricted_load, torch_load

MODULES = ["pathlib", "pathlib._local"]
_GLOBAL = re.compile(rb"c(pathlib(?:\._local)?)\n(PosixPath)\n")


def _pickled(value, module: str) -> bytes:
    """`value` pickled (protocol 2, as torch.save writes) with its path class named under `module`."""
    data, count = _GLOBAL.subn(b"c" + module.encode() + rb"\n\2\n", pickle.dumps(value, protocol=2))
    assert count == 1
    return data


class _Written:
    """A `pickle_module` for `torch.save` whose pickler writes bytes pickled beforehand as `data.pkl`."""

    class Pickler:
        def __init__(self, file, protocol=None):
            self.file = file

        def dump(self, data):
            self.file.write(data)


@pytest.mark.parametrize("module", MODULES)
def test_the_restricted_unpickler_reads_a_path_pickled_by_any_python(module):
    value = restricted_load(io.BytesIO(_pickled({"dir": pathlib.PosixPath("/runs/a")}, module)))
    assert value == {"dir": pathlib.PosixPath("/runs/a")} and type(value["dir"]) is pathlib.PosixPath


@pytest.mark.parametrize("module", MODULES)
def test_weights_only_loads_read_a_path_pickled_by_any_python(module):
    buffer = io.BytesIO()
    torch.save(_pickled({"dir": pathlib.PosixPath("/runs/a")}, module), buffer, pickle_module=_Written)
    buffer.seek(0)
    value = torch_load(buffer)
    assert value == {"dir": pathlib.PosixPath("/runs/a")} and type(value["dir"]) is pathlib.PosixPath


def test_other_names_in_the_path_modules_stay_refused():
    # only the path classes are admitted from either module, not everything `pathlib` holds
    data = pickle.dumps(pathlib.PosixPath("/x"), protocol=2).replace(b"PosixPath", b"os")
    with pytest.raises(UnsafePickleError, match=r"pathlib(\._local)?\.os"):
        restricted_load(io.BytesIO(data))
