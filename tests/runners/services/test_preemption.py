"""Slurm preemption in one process: the signal stops at a checkpoint, the job requeues, a resume ends alike.

The scheduler is faked here (`SLURM_JOB_ID` and a recorded `scontrol`); tests/slurm runs the same
path against a real Slurm.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from danling.distributed.slurm import SlurmJob
from danling.runners.services.preemption import SlurmPreemption, parse_signal
from tests.runners._torch_toy import TinyRunner, model_state, tiny_config


class FakeScontrol:
    """Records the commands the service runs; answers with `returncode`."""

    def __init__(self, returncode: int = 0) -> None:
        self.calls: list[tuple[str, ...]] = []
        self.returncode = returncode

    def __call__(self, command, **kwargs):
        self.calls.append(tuple(command))
        return SimpleNamespace(returncode=self.returncode, stdout="", stderr="Invalid job id specified")


@pytest.fixture
def in_slurm_job(monkeypatch):
    for name in [name for name in os.environ if name.startswith("SLURM_")]:
        monkeypatch.delenv(name)
    monkeypatch.setenv("SLURM_JOB_ID", "4242")
    monkeypatch.setenv("SLURM_ARRAY_JOB_ID", "4240")
    monkeypatch.setenv("SLURM_ARRAY_TASK_ID", "2")
    monkeypatch.setenv("SLURM_RESTART_COUNT", "0")


class SignalledRunner(TinyRunner):
    """Sends itself `slurm.signal` during global step 3 of the first launch."""

    def train_step(self, data):
        if self.train_state.global_step == 3 and not self.preemption.requested:
            os.kill(os.getpid(), signal.SIGUSR1)
        return super().train_step(data)


def test_signal_checkpoints_requeues_and_the_requeued_run_ends_alike(tmp_path, in_slurm_job, monkeypatch):
    with TinyRunner(tiny_config(tmp_path / "clean", deterministic=True)) as clean:
        clean.train()
        expected = model_state(clean)

    config = tiny_config(tmp_path / "run", deterministic=True, **{"slurm.requeue": True})
    scontrol = FakeScontrol()
    with pytest.raises(SystemExit) as stop, SignalledRunner(config) as runner:
        runner.preemption.run_command = scontrol
        runner.train()
    assert stop.value.code == 128 + signal.SIGUSR1
    assert scontrol.calls == [("scontrol", "requeue", "4242")]
    assert (runner.checkpoint_manager.directory / "shutdown.pointer").exists()
    assert runner.train_state.global_step == 4  # the step the signal arrived in was finished

    monkeypatch.setenv("SLURM_RESTART_COUNT", "1")  # what Slurm sets in the requeued job
    with TinyRunner({**config, "auto_resume": True}) as resumed:
        assert resumed.workspace.dir == runner.workspace.dir
        assert resumed.train_state.global_step == 4
        resumed.preemption.run_command = scontrol
        resumed.train()
        got = model_state(resumed)
    assert scontrol.calls == [("scontrol", "requeue", "4242")]  # no second requeue
    assert expected.keys() == got.keys() and all(torch.equal(expected[k], got[k]) for k in expected)
    launches = json.loads(Path(resumed.workspace.dir, "metadata.json").read_text())["launches"]
    assert [launch["slurm"] for launch in launches] == [
        {"job_id": "4242", "array_job_id": "4240", "array_task_id": 2, "restart_count": count} for count in (0, 1)
    ]


def test_signal_without_requeue_stops_at_a_checkpoint_only(tmp_path, in_slurm_job):
    scontrol = FakeScontrol()
    with pytest.raises(SystemExit) as stop, SignalledRunner(tiny_config(tmp_path)) as runner:
        runner.preemption.run_command = scontrol
        runner.train()
    assert stop.value.code == 128 + signal.SIGUSR1
    assert scontrol.calls == []
    assert (runner.checkpoint_manager.directory / "shutdown.pointer").exists()


def test_sigterm_does_not_requeue(tmp_path, in_slurm_job):
    class Terminated(TinyRunner):
        def train_step(self, data):
            if self.train_state.global_step == 2 and not self.supervisor.stop_requested:
                os.kill(os.getpid(), signal.SIGTERM)
            return super().train_step(data)

    scontrol = FakeScontrol()
    with pytest.raises(SystemExit) as stop, Terminated(tiny_config(tmp_path, **{"slurm.requeue": True})) as runner:
        runner.preemption.run_command = scontrol
        runner.train()
    assert stop.value.code == 128 + signal.SIGTERM
    assert scontrol.calls == []


def test_outside_slurm_the_signal_is_not_taken(tmp_path, monkeypatch):
    for name in [name for name in os.environ if name.startswith("SLURM_")]:
        monkeypatch.delenv(name)
    with TinyRunner(tiny_config(tmp_path, **{"slurm.requeue": True})) as runner:
        assert runner.preemption.signal is None
        assert signal.SIGUSR1 not in runner.supervisor.signals
        assert "slurm" not in runner.workspace.launch()


def test_requeue_failure_is_logged_not_raised(caplog):
    scontrol = FakeScontrol(returncode=1)
    service = SlurmPreemption("USR1", requeue=True, job=SlurmJob("7"), is_main_process=True, run_command=scontrol)
    service.requested = True
    assert service.requeue_job() is False
    assert "Invalid job id specified" in caplog.text

    def missing(command, **kwargs):
        raise FileNotFoundError("scontrol")

    service.run_command = missing
    assert service.requeue_job() is False
    assert "resubmit" in caplog.text


def test_only_the_main_process_requeues():
    scontrol = FakeScontrol()
    service = SlurmPreemption("USR1", requeue=True, job=SlurmJob("7"), is_main_process=False, run_command=scontrol)
    assert service.requeue_job() is False and scontrol.calls == []


@pytest.mark.parametrize("value", ["USR3", "SIGKILL", "nine", 9])
def test_bad_signal_is_one_clear_error(value):
    with pytest.raises(ValueError, match=r"slurm\.signal="):
        parse_signal(value)


def test_signal_spellings():
    assert parse_signal("usr1") == parse_signal("SIGUSR1") == parse_signal(int(signal.SIGUSR1)) == signal.SIGUSR1
    assert parse_signal("null") is None


def test_scontrol_timeout_is_handled(caplog):
    def slow(command, **kwargs):
        raise subprocess.TimeoutExpired(command, kwargs["timeout"])

    service = SlurmPreemption("USR1", requeue=True, job=SlurmJob("7"), is_main_process=True, run_command=slow)
    assert service.requeue_job() is False


def test_repeated_preemption_signal_is_ignored_while_stopping():
    # A torchrun agent forwards the signal its workers also got from Slurm: the second must not kill them.
    from danling.runners.services.supervisor import RunnerSupervisor

    supervisor = RunnerSupervisor()
    supervisor.add_stop_signals([signal.SIGUSR1], repeatable=True)
    assert supervisor.install_signal_handlers()
    try:
        os.kill(os.getpid(), signal.SIGUSR1)
        os.kill(os.getpid(), signal.SIGUSR1)
        assert supervisor.stop_requested and supervisor.exit_code == 128 + signal.SIGUSR1
    finally:
        supervisor.close()


def test_a_preemption_signal_that_is_sigterm_keeps_escalating():
    from danling.runners.services.supervisor import RunnerSupervisor

    supervisor = RunnerSupervisor()
    supervisor.add_stop_signals([signal.SIGTERM, signal.SIGUSR2], repeatable=True)
    assert supervisor.signals == (signal.SIGTERM, signal.SIGINT, signal.SIGUSR2)
    assert supervisor._repeatable == {signal.SIGUSR2}
