import pytest

from tests.runners._toy import ToyRunner, toy_config


@pytest.fixture
def make_runner(tmp_path):
    """Build toy runners from `toy_config` overrides; every runner made is closed afterwards."""
    runners = []

    def make(cls=ToyRunner, **overrides):
        runner = cls(toy_config(tmp_path, **overrides))
        runners.append(runner)
        return runner

    yield make
    for runner in runners:
        runner.close()
