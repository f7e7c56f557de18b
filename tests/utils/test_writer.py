import os
import threading

import pytest

from danling.utils import BackgroundWriter, load, save


def test_newest_submission_of_a_path_is_what_lands(tmp_path):
    writer = BackgroundWriter()
    path = tmp_path / "status.json"
    for step in range(50):
        writer.submit({"step": step}, path, durable=False)
    writer.flush()
    assert load(path) == {"step": 49}
    assert writer.pending == 0
    writer.close()


def test_several_paths_and_reuse_after_flush(tmp_path):
    writer = BackgroundWriter()
    writer.submit([1, 2], tmp_path / "a.json")
    writer.submit("text", tmp_path / "b.txt")
    writer.flush()
    writer.submit([3], tmp_path / "a.json")
    writer.flush()
    assert load(tmp_path / "a.json") == [3]
    assert load(tmp_path / "b.txt") == "text"
    writer.close()


def test_a_failed_write_is_raised_once_and_later_writes_still_go_through(tmp_path):
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("x")
    writer = BackgroundWriter()
    writer.submit({"a": 1}, blocker / "inside.json")
    with pytest.raises(OSError):
        writer.flush()
    writer.flush()  # reported once
    writer.submit({"b": 2}, tmp_path / "ok.json")
    writer.close()
    assert load(tmp_path / "ok.json") == {"b": 2}


def test_encoding_errors_name_the_path(tmp_path):
    writer = BackgroundWriter()
    writer.submit({"value": object()}, tmp_path / "bad.json")
    with pytest.raises(OSError, match="bad.json"):
        writer.flush()
    assert not any(name.endswith(".tmp") for name in os.listdir(tmp_path))  # no half-written leftovers
    writer.close()


def test_unknown_extension_fails_in_the_callers_thread(tmp_path):
    writer = BackgroundWriter()
    with pytest.raises(ValueError, match=r"\.weird"):
        writer.submit({}, tmp_path / "x.weird")
    assert writer.pending == 0


def test_close_stops_the_thread_and_refuses_new_work(tmp_path):
    writer = BackgroundWriter(name="test-writer")
    writer.submit(1, tmp_path / "one.json")
    writer.close()
    writer.close()
    assert load(tmp_path / "one.json") == 1
    assert "test-writer" not in {thread.name for thread in threading.enumerate()}
    with pytest.raises(RuntimeError, match="closed"):
        writer.submit(2, tmp_path / "two.json")


def test_objects_are_written_by_save(tmp_path):
    # The writer adds no format of its own: what it writes reads back like a direct save.
    writer = BackgroundWriter()
    writer.submit({"x": [1.5]}, tmp_path / "w.yaml")
    writer.close()
    save({"x": [1.5]}, tmp_path / "d.yaml")
    assert (tmp_path / "w.yaml").read_text() == (tmp_path / "d.yaml").read_text()


def _recording_save(monkeypatch):
    """Record which thread writes each file (the real `save` still does the writing)."""
    import danling.utils.writer as writer_module

    calls, written = [], threading.Event()

    def recording(obj, path, **kwargs):
        save(obj, path, **kwargs)
        calls.append((os.path.basename(path), threading.current_thread().name))
        written.set()

    monkeypatch.setattr(writer_module, "save", recording)
    return calls, written


def test_linger_coalesces_and_flush_writes_at_once_in_the_caller(tmp_path, monkeypatch):
    calls, _ = _recording_save(monkeypatch)
    writer = BackgroundWriter(name="lingering", linger=600.0)
    for step in range(50):
        writer.submit({"step": step}, tmp_path / "status.json", durable=False)
    assert writer.pending == 1 and not (tmp_path / "status.json").exists()  # due in ten minutes
    writer.flush()
    assert load(tmp_path / "status.json") == {"step": 49}
    assert calls == [("status.json", threading.current_thread().name)]  # one write, by the flushing thread
    writer.close()
    assert len(calls) == 1


def test_linger_bounds_how_long_a_file_lags(tmp_path, monkeypatch):
    import time

    calls, written = _recording_save(monkeypatch)
    writer = BackgroundWriter(name="lagging", linger=0.05)
    started = time.monotonic()
    writer.submit([1], tmp_path / "a.json")
    assert written.wait(30), "the helper never wrote the lingering file"
    assert time.monotonic() - started >= 0.05
    assert calls == [("a.json", "lagging")] and load(tmp_path / "a.json") == [1]
    writer.close()


def test_linger_must_not_be_negative():
    with pytest.raises(ValueError, match="linger must be a non-negative number of seconds, got -1"):
        BackgroundWriter(linger=-1)


def test_paths_submitted_while_others_linger_are_written_by_the_helper(tmp_path, monkeypatch):
    # Only the first pending path wakes the helper (the others are due no sooner); each of them
    # must still be written in time, by the helper, without a flush.
    import danling.utils.writer as writer_module

    calls, everything = [], threading.Event()

    def recording(obj, path, **kwargs):
        save(obj, path, **kwargs)
        calls.append((os.path.basename(path), threading.current_thread().name))
        if len(calls) == 3:
            everything.set()

    monkeypatch.setattr(writer_module, "save", recording)
    writer = BackgroundWriter(name="batched", linger=0.05)
    for name in ("a.json", "b.json", "c.json"):
        writer.submit([name], tmp_path / name)
    assert everything.wait(30), f"the helper wrote only {calls}"
    assert sorted(calls) == [("a.json", "batched"), ("b.json", "batched"), ("c.json", "batched")]
    writer.close()
