import os
from pathlib import Path

import pytest

from danling.utils import ensure_dir


class Workspace:
    def __init__(self, root):
        self.root = root
        self._custom = None

    @ensure_dir
    def logs(self):
        """Where logs go."""
        return os.path.join(self.root, "nested", "logs")

    @ensure_dir
    def path_obj(self):
        return Path(self.root) / "pathlike"

    @ensure_dir
    def custom(self):
        return self._custom

    @custom.setter
    def custom(self, value):
        self._custom = value

    @ensure_dir
    def broken(self):
        return 42


def test_creates_directory_on_access(tmp_path):
    ws = Workspace(str(tmp_path))
    assert not (tmp_path / "nested").exists()
    assert ws.logs == os.path.join(str(tmp_path), "nested", "logs")
    assert (tmp_path / "nested" / "logs").is_dir()
    assert ws.logs == ws.logs  # idempotent
    assert ws.path_obj == tmp_path / "pathlike" and (tmp_path / "pathlike").is_dir()


def test_is_a_property(tmp_path):
    assert isinstance(Workspace.logs, property)
    assert Workspace.logs.__doc__ == "Where logs go."


def test_setter_and_none(tmp_path):
    ws = Workspace(str(tmp_path))
    assert ws.custom is None
    ws.custom = str(tmp_path / "custom")
    assert ws.custom == str(tmp_path / "custom")
    assert (tmp_path / "custom").is_dir()


def test_bad_return_value(tmp_path):
    with pytest.raises(TypeError, match=r"Workspace.broken must return a path.*42"):
        _ = Workspace(str(tmp_path)).broken


def test_existing_file_in_the_way(tmp_path):
    (tmp_path / "nested").mkdir()
    (tmp_path / "nested" / "logs").write_text("not a directory")
    with pytest.raises(FileExistsError):
        _ = Workspace(str(tmp_path)).logs


def test_file_in_place_of_a_parent(tmp_path):
    (tmp_path / "nested").write_text("not a directory")
    with pytest.raises(NotADirectoryError):
        _ = Workspace(str(tmp_path)).logs
