import pdb

import pytest

from danling.utils import debug


@pytest.fixture
def post_mortem(monkeypatch):
    calls = []
    monkeypatch.setattr(pdb, "post_mortem", lambda tb: calls.append(tb))
    return calls


def test_enters_debugger_then_reraises(post_mortem, capsys):
    with pytest.raises(ValueError, match="boom"), debug():
        raise ValueError("boom")
    assert len(post_mortem) == 1
    # The traceback given to pdb points at the frame that raised.
    assert post_mortem[0].tb_frame.f_code.co_name in {"test_enters_debugger_then_reraises", "debug"}
    assert "ValueError: boom" in capsys.readouterr().err


def test_no_error_no_debugger(post_mortem):
    with debug():
        value = 1
    assert value == 1 and post_mortem == []


def test_disabled(post_mortem):
    with pytest.raises(ValueError), debug(enable=False):
        raise ValueError
    assert post_mortem == []


def test_error_filter_and_exclude(post_mortem):
    with pytest.raises(KeyError), debug(error=ValueError):
        raise KeyError
    with pytest.raises(FileNotFoundError), debug(error=OSError, exclude=FileNotFoundError):
        raise FileNotFoundError
    assert post_mortem == []
    with pytest.raises(PermissionError), debug(error=OSError, exclude=FileNotFoundError):
        raise PermissionError
    assert len(post_mortem) == 1


def test_as_decorator(post_mortem):
    @debug()
    def fail():
        raise RuntimeError

    with pytest.raises(RuntimeError):
        fail()
    assert len(post_mortem) == 1


@pytest.mark.parametrize("kwargs", [{"error": "ValueError"}, {"exclude": 3}])
def test_bad_arguments(kwargs):
    with pytest.raises(TypeError, match=r"debug\(\) expects .* exception class"), debug(**kwargs):
        pass
