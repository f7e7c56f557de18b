from __future__ import annotations

import builtins
import json
import logging
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from danling.runners.config import RunnerConfig
from danling.runners.services.git_info import git_info, git_short_hash
from danling.runners.services.workspace import LOGGER_NAME, RunnerWorkspace
from tests.dist import run_distributed
from tests.runners._torch_toy import TinyRunner, tiny_config


def make(tmp_path, rank=0, world_size=1, code_dir=None, **overrides):
    config = RunnerConfig(workspace_root=str(tmp_path / "runs"), **overrides)
    return RunnerWorkspace(config, rank=rank, world_size=world_size, code_dir=code_dir or tmp_path)


def danling_handlers():
    return [h for h in logging.getLogger(LOGGER_NAME).handlers if getattr(h, "danling_owner", None) is not None]


@pytest.fixture
def git_repo(tmp_path):
    if shutil.which("git") is None:
        pytest.skip("git is not installed")
    repo = tmp_path / "code"
    repo.mkdir()
    (repo / "train.py").write_text("print('hi')\n")
    identity = ["-c", "user.name=t", "-c", "user.email=t@example.com", "-c", "commit.gpgsign=false"]
    for args in (["init", "-q"], ["add", "train.py"], [*identity, "commit", "-q", "-m", "init"]):
        subprocess.run(["git", *args], cwd=repo, check=True, capture_output=True)
    short = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], cwd=repo, check=True, capture_output=True, text=True
    ).stdout.strip()
    return repo, short


def test_construction_is_lazy_and_dir_is_created_on_main_only(tmp_path):
    workspace = make(tmp_path, experiment="demo")
    assert not (tmp_path / "runs").exists()
    path = workspace.path
    assert path == tmp_path / "runs" / "lin" / f"demo-{workspace.id}"
    assert workspace.checkpoint_dir == path / "checkpoints" and workspace.heartbeat_dir == path / "heartbeats"
    assert workspace.resolve("profiles") == path / "profiles" and workspace.resolve("/abs") == Path("/abs")
    assert not (tmp_path / "runs").exists()
    other = make(tmp_path, rank=1, world_size=2, experiment="demo")
    assert other.dir == path and not path.exists()
    assert workspace.dir == path and path.is_dir()


def test_code_id_comes_from_git_and_is_recorded_not_part_of_the_path(tmp_path, git_repo):
    repo, short = git_repo
    workspace = make(tmp_path, code_dir=repo, lineage="proj")
    assert workspace.code_id == short
    assert workspace.path.parent.name == "proj"  # a commit does not move the run
    info = git_info(repo)
    assert info["short"] == short and len(info["commit"]) == 40 and info["dirty"] is False
    (repo / "train.py").write_text("print('changed')\n")
    assert git_info(repo)["dirty"] is True
    workspace.write_metadata()
    workspace.lock()  # a launch that trains records itself
    metadata = json.loads(workspace.metadata_file.read_text())
    assert metadata["code_id"] == short and metadata["launches"][0]["code_id"] == short
    assert metadata["launches"][0]["git"]["dirty"] is True and metadata["launches"][0]["diff"] == "code/launch-0.diff"
    assert "+print('changed')" in (workspace.path / "code" / "launch-0.diff").read_text()
    without_git = make(tmp_path, lineage="proj")
    assert without_git.code_id is None and without_git.path == workspace.path
    assert without_git.config_id == workspace.config_id and without_git.id == workspace.id


def test_missing_git_binary_is_not_an_error(tmp_path, git_repo, monkeypatch):
    repo, _ = git_repo
    monkeypatch.setenv("PATH", str(tmp_path / "empty-bin"))
    assert git_short_hash(repo) is None and git_info(repo) is None
    assert make(tmp_path, code_dir=repo).code_id is None


def test_identity_is_stable_across_instances_ranks_and_paths(tmp_path):
    first = make(tmp_path, epochs=3)
    assert len(first.id) == 12 and first.config_id == first.config.config_id
    assert make(tmp_path, rank=1, world_size=4, epochs=3).id == first.id
    moved = RunnerWorkspace(RunnerConfig(epochs=3, workspace_root=str(tmp_path / "else")), code_dir=tmp_path)
    assert moved.id == first.id and moved.path != first.path
    assert make(tmp_path, epochs=4).id == first.id  # the budget is not part of the identity
    assert make(tmp_path, epochs=3, seed=7).id != first.id
    assert RunnerWorkspace({"epochs": 3, "workspace_root": "x"}, code_dir=tmp_path).id == first.id


def test_unset_names_fall_back_to_defaults(tmp_path):
    workspace = make(tmp_path, lineage=None, experiment=None)
    assert workspace.path == tmp_path / "runs" / "lin" / f"exp-{workspace.id}"


def test_identity_is_fixed_at_creation(tmp_path):
    workspace = make(tmp_path)
    before = workspace.path
    workspace.config.seed = 1234  # e.g. the runner draws a seed later
    assert workspace.path == before


@pytest.mark.parametrize(("rank", "world_size"), [(-1, 1), (2, 2), (0, 0), (True, 2)])
def test_bad_rank_or_world_size(tmp_path, rank, world_size):
    with pytest.raises(ValueError, match="rank|world_size"):
        make(tmp_path, rank=rank, world_size=world_size)


def test_metadata_is_complete_atomic_and_written_once(tmp_path):
    workspace = make(tmp_path, epochs=2)
    path = workspace.write_metadata({"runner": "TorchRunner"})
    metadata = json.loads(path.read_text())
    assert metadata["runner"] == "TorchRunner"
    assert metadata["id"] == workspace.id and metadata["config_id"] == workspace.config_id
    assert metadata["config"]["epochs"] == 2 and metadata["world_size"] == 1
    assert metadata["versions"]["torch"] and metadata["versions"]["python"]
    assert metadata["start_time"] == workspace.start_time.isoformat()
    assert "git" in metadata and metadata["argv"] == sys.argv
    assert sorted(p.name for p in path.parent.iterdir()) == ["config.yaml", "metadata.json"]
    reloaded = RunnerConfig.load(path.parent / "config.yaml")
    assert reloaded.config_id == workspace.config_id

    workspace.write_metadata({"runner": "Other"})
    again = make(tmp_path, epochs=2)  # a resumed run with the same identity
    assert again.path == workspace.path
    again.write_metadata({"runner": "Other"})
    assert json.loads(path.read_text())["runner"] == "TorchRunner"


def _strict(text: str):
    """`text` parsed as strict JSON: `NaN` and `Infinity`, which Python's parser would accept, are refused."""

    def refuse(constant: str):
        raise ValueError(f"not JSON: {constant}")

    return json.loads(text, parse_constant=refuse)


def test_metadata_with_non_finite_config_values_is_strict_json(tmp_path):
    values = {"max_grad_norm": float("inf"), "optim.eps": float("nan"), "optim.weight_decay": float("-inf")}
    workspace = make(tmp_path / "written", **values)
    path = workspace.write_metadata()
    config = _strict(path.read_text())["config"]
    assert config["max_grad_norm"] is None and config["optim"]["eps"] is None
    assert config["optim"]["weight_decay"] is None
    # config.yaml keeps the values themselves (YAML has .inf and .nan)
    assert RunnerConfig.load(path.parent / "config.yaml").max_grad_norm == float("inf")
    # A launch that takes the lock first writes the file itself, with its launch record.
    launched = make(tmp_path / "launched", **values)
    launched.lock()
    try:
        metadata = _strict(launched.metadata_file.read_text())
    finally:
        launched.close()
    assert metadata["config"]["max_grad_norm"] is None and len(metadata["launches"]) == 1


def test_non_main_ranks_write_nothing(tmp_path):
    workspace = make(tmp_path, rank=1, world_size=2)
    assert workspace.write_metadata() == workspace.metadata_file
    logger = workspace.setup_logging()
    logger.info("quiet")
    workspace.close()
    assert not (tmp_path / "runs").exists()


def test_logging_main_process_file_and_console(tmp_path, capsys):
    workspace = make(tmp_path)
    logger = workspace.setup_logging()
    try:
        logger.info("hello from %s", "main")
        logging.getLogger("danling.checkpoint").warning("child logger record")
        for handler in danling_handlers():
            handler.flush()
        text = workspace.log_file.read_text()
        assert "| INFO    | rank 0 | danling | hello from main" in text
        assert "| WARNING | rank 0 | danling.checkpoint | child logger record" in text
        assert "hello from main" in capsys.readouterr().err
    finally:
        workspace.close()
    assert danling_handlers() == []


def test_logging_respects_config_log_flag(tmp_path):
    workspace = make(tmp_path, log=False)
    workspace.setup_logging().info("console only")
    workspace.close()
    assert not workspace.log_file.exists()


def test_several_workspaces_never_duplicate_handlers(tmp_path, capsys):
    first, second = make(tmp_path, epochs=1), make(tmp_path, epochs=2)
    first.setup_logging()
    count = len(danling_handlers())
    first.setup_logging()
    second.setup_logging()
    assert len(danling_handlers()) == count
    logging.getLogger(LOGGER_NAME).info("once")
    assert capsys.readouterr().err.count("once") == 1
    first.close()  # closing the replaced workspace leaves the active one alone
    assert len(danling_handlers()) == count
    second.close()
    second.close()
    assert danling_handlers() == []
    assert logging.getLogger(LOGGER_NAME).level == logging.NOTSET


def test_non_main_rank_logs_warnings_to_its_own_file_only(tmp_path, capsys):
    make(tmp_path).dir  # noqa: B018 - the main process made the run directory
    workspace = make(tmp_path, rank=1, world_size=2)
    logger = workspace.setup_logging()
    try:
        logger.info("not recorded")
        assert not workspace.log_file.exists()
        logger.warning("recorded")
        for handler in danling_handlers():
            handler.flush()
        assert workspace.log_file.name == "rank1.log"
        text = workspace.log_file.read_text()
        assert "rank 1" in text and "recorded" in text and "not recorded" not in text
        assert capsys.readouterr().err == ""
    finally:
        workspace.close()


def test_route_print_silences_non_main_ranks_without_replacing_print(tmp_path, capsys):
    original_print = builtins.print
    workspace = make(tmp_path, rank=1, world_size=2)
    workspace.route_print()
    workspace.route_print()
    print("hidden")
    assert builtins.print is original_print
    workspace.restore_print()
    print("visible")
    assert capsys.readouterr().out == "visible\n"
    main = make(tmp_path)
    main.route_print()
    print("main prints")
    main.close()
    assert capsys.readouterr().out == "main prints\n"


def _distributed_worker(rank, world_size, root):
    import torch.distributed as dist

    config = RunnerConfig(workspace_root=root, experiment="dist")
    workspace = RunnerWorkspace(config, rank=dist.get_rank(), world_size=dist.get_world_size(), code_dir=root)
    workspace.route_print()
    print(f"rank {rank} says hi")
    sys.stdout.flush()
    logger = workspace.setup_logging()
    logger.info("info from rank %d", rank)
    workspace.write_metadata()
    dist.barrier()
    workspace.close()
    return workspace.id, os.fspath(workspace.path)


@pytest.mark.distributed
def test_two_ranks_share_identity_and_only_rank0_writes(tmp_path):
    root = str(tmp_path / "runs")
    results = run_distributed(_distributed_worker, root, world_size=2)
    assert results[0] == results[1]
    run_dir = results[0][1]
    assert sorted(os.listdir(run_dir)) == ["config.yaml", "metadata.json", "run.log"]
    log = Path(run_dir, "run.log").read_text()
    assert "info from rank 0" in log and "rank 1" not in log


def test_short_hash_is_read_once_per_process_and_directory(tmp_path, git_repo, monkeypatch):
    from danling.runners.services import git_info as ws

    repo, short = git_repo
    calls = []
    real_git = ws._git
    monkeypatch.setattr(ws, "_git", lambda cwd, *args: (calls.append(args), real_git(cwd, *args))[1])
    assert git_short_hash(repo) == short
    assert git_short_hash(repo) == short
    assert make(tmp_path, code_dir=repo).code_id == short
    assert calls == [("rev-parse", "--short", "HEAD")]
    info = git_info(repo)  # the dirty flag is never cached
    assert info["short"] == short and info["commit"].startswith(short) and info["root"] == os.path.realpath(repo)
    assert info["branch"] and info["dirty"] is False


def test_one_launch_reads_the_git_state_once(tmp_path, git_repo, monkeypatch):
    from danling.runners.services import git_info as ws

    repo, short = git_repo
    calls = []
    real_git = ws._git
    monkeypatch.setattr(ws, "_git", lambda cwd, *args: (calls.append(args[0]), real_git(cwd, *args))[1])
    workspace = make(tmp_path, code_dir=repo)
    assert workspace.metadata()["git"] == workspace.launch()["git"]
    assert workspace.launch()["git"]["short"] == short
    assert calls.count("status") == 1 and calls.count("rev-parse") == 2  # the code id's short hash, then HEAD


@pytest.mark.parametrize("root", ["file", "read-only"])
def test_a_workspace_root_that_cannot_hold_runs_names_it(tmp_path, root):
    if root == "file":
        path = tmp_path / "not-a-directory"
        path.write_text("")
    else:
        if os.geteuid() == 0:
            pytest.skip("root writes into read-only directories")
        path = tmp_path / "read-only"
        path.mkdir(mode=0o500)
    with pytest.raises(OSError, match=rf"cannot create the run directory .*workspace_root \(now '{path}'\)"):
        TinyRunner(tiny_config(path))
