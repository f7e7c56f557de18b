"""The inference sinks on their own: suffix registry, committed states, truncation and shard merges."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import numpy as np
import pytest

from danling.runners.inference import JsonLinesSink, NumpySink, Sink, register_sink, registered_suffixes, sink_for

SINKS = [(JsonLinesSink, ".jsonl"), (NumpySink, ".npy")]
if importlib.util.find_spec("pyarrow"):
    from danling.runners.inference import ParquetSink

    SINKS.append((ParquetSink, ".parquet"))


def _read(path: Path) -> list:
    if path.suffix == ".jsonl":
        return [json.loads(line) for line in path.read_text().splitlines()]
    if path.suffix == ".npy":
        return np.load(path).tolist()
    import pyarrow.parquet as pq

    return pq.read_table(path).column("output").to_pylist()


@pytest.mark.parametrize(("sink_type", "suffix"), SINKS)
def test_truncate_to_a_committed_state_then_continue_gives_the_uninterrupted_bytes(tmp_path, sink_type, suffix):
    clean = sink_type(tmp_path / f"clean{suffix}", 7)
    clean.open()
    for batch in ([1.0, 2.0], [3.0, 4.0], [5.0, 6.0], [7.0]):
        clean.write(batch)
    clean.close()

    crashed = sink_type(tmp_path / f"crashed{suffix}", 7)
    crashed.open()
    crashed.write([1.0, 2.0])
    committed = crashed.state()
    crashed.write([30.0, 40.0])  # written after the commit, then the process "dies"
    crashed.state()
    resumed = sink_type(tmp_path / f"crashed{suffix}", 7)
    resumed.truncate(committed)
    for batch in ([3.0, 4.0], [5.0, 6.0], [7.0]):
        resumed.write(batch)
    resumed.close()
    assert _read(tmp_path / f"crashed{suffix}") == [1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0]
    assert (tmp_path / f"crashed{suffix}").read_bytes() == (tmp_path / f"clean{suffix}").read_bytes()


def _refuse_constant(name: str) -> None:
    raise ValueError(f"{name} is not JSON")


def test_json_lines_write_non_finite_values_as_null(tmp_path):
    sink = JsonLinesSink(tmp_path / "out.jsonl", 3)
    sink.open()
    sink.write([float("nan"), {"score": float("inf"), "rank": [1.0, float("-inf")]}, 0.5])
    sink.close()
    lines = (tmp_path / "out.jsonl").read_text().splitlines()
    parsed = [json.loads(line, parse_constant=_refuse_constant) for line in lines]  # strict: NaN would raise
    assert parsed == [None, {"score": None, "rank": [1.0, None]}, 0.5]


@pytest.mark.parametrize(("sink_type", "suffix"), SINKS)
def test_merge_interleaves_strided_shards_in_dataset_order(tmp_path, sink_type, suffix):
    paths, states = [], []
    for rank, rows in enumerate(([0.0, 2.0, 4.0], [1.0, 3.0])):  # 5 rows over 2 ranks
        sink = sink_type(tmp_path / f"shard{rank}{suffix}", 3)
        sink.open()
        sink.write(rows)
        states.append(sink.state())
        sink.close()
        paths.append(sink.path)
    sink_type.merge(tmp_path / f"all{suffix}", paths, states)
    assert _read(tmp_path / f"all{suffix}") == [0.0, 1.0, 2.0, 3.0, 4.0]


def test_npy_writes_one_file_per_field_and_trims_to_the_rows_written(tmp_path):
    sink = NumpySink(tmp_path / "scores.npy", 10)
    sink.open()
    sink.write([{"logits": [1, 2], "label": 0}, {"logits": [3, 4], "label": 1}])
    sink.close()
    assert np.load(tmp_path / "scores.logits.npy").tolist() == [[1, 2], [3, 4]]
    assert np.load(tmp_path / "scores.label.npy").tolist() == [0, 1]
    with pytest.raises(ValueError, match="needs a dataset with a length"):
        NumpySink(tmp_path / "x.npy", None)
    sink = NumpySink(tmp_path / "small.npy", 1)
    sink.open()
    with pytest.raises(ValueError, match="preallocated for 1"):
        sink.write([1.0, 2.0])


def test_npy_stores_bfloat16_outputs_as_float32(tmp_path):
    import torch

    values = torch.tensor([[0.5, -1.25], [3.0, 1e-3]], dtype=torch.bfloat16)  # what autocast(bf16) returns
    sink = NumpySink(tmp_path / "bf16.npy", 3)
    sink.open()
    sink.write(list(values))
    sink.write([torch.tensor([2.0, 4.0], dtype=torch.float8_e4m3fn)])
    sink.close()
    stored = np.load(tmp_path / "bf16.npy")
    assert stored.dtype == np.float32
    assert stored.tolist() == [*values.float().tolist(), [2.0, 4.0]]


def test_npy_refuses_outputs_that_its_dtype_would_change(tmp_path):
    cases = {  # first batch, later batch: every later batch would have been cut to the first one's dtype
        "floats": ([1, 2], [0.5, 2.7]),  # int64 file: 0 and 2
        "strings": (["s0", "s1"], ["s10", "long"]),  # <U2 file: 's1' and 'lo'
        "flags": ([True, False], [2, 3]),  # bool file: True and True
    }
    for name, (first, later) in cases.items():
        sink = NumpySink(tmp_path / f"{name}.npy", 4)
        sink.open()
        sink.write(first)
        with pytest.raises(ValueError, match=rf"{name}.npy: outputs of dtype .* after a first batch that made"):
            sink.write(later)
    sink = NumpySink(tmp_path / "objects.npy", 4)  # would store the addresses of the None objects
    sink.open()
    with pytest.raises(ValueError, match="a .npy output cannot hold them"):
        sink.write([None, None])
    sink = NumpySink(tmp_path / "keys.npy", 4)  # the second example's "extra" would be dropped
    sink.open()
    with pytest.raises(ValueError, match=r"keys \['score'\] \(one file per key\), got \['extra', 'score'\]"):
        sink.write([{"score": 1.0}, {"score": 2.0, "extra": 1}])
    sink = NumpySink(tmp_path / "ragged.npy", 4)  # was numpy's bare "inhomogeneous shape"
    sink.open()
    with pytest.raises(
        ValueError, match=r"ragged.npy: the examples of one batch have different shapes \[\(2,\), \(3,\)\]"
    ):
        sink.write([[1, 2], [1, 2, 3]])
    sink = NumpySink(tmp_path / "fine.npy", 6)  # conversions that keep every value still pass
    sink.open()
    for batch in ([1, 2], [3.0, 4.0], [True, False]):
        sink.write(batch)
    sink.close()
    assert np.load(tmp_path / "fine.npy").tolist() == [1, 2, 3, 4, 1, 0]


def test_suffix_registry_and_errors(tmp_path):
    assert sink_for("a/b.JSONL") is JsonLinesSink and sink_for("x.npy") is NumpySink
    with pytest.raises(ValueError, match=r"'out\.csv'.*\.jsonl, \.ndjson, \.npy, \.parquet"):
        sink_for("out.csv")

    class CsvSink(JsonLinesSink):
        pass

    register_sink(".csv", CsvSink)
    try:
        assert sink_for("out.csv") is CsvSink and ".csv" in registered_suffixes()
    finally:
        from danling.runners.inference import sinks

        sinks._SINKS.pop(".csv")
    with pytest.raises(ValueError, match="starts with a dot"):
        register_sink("csv", CsvSink)
    with pytest.raises(TypeError, match="Sink subclass"):
        register_sink(".csv", dict)
    assert issubclass(CsvSink, Sink)


def test_parquet_without_pyarrow_names_the_extra(tmp_path, monkeypatch):
    import builtins

    from danling.runners.inference import parquet

    real_import = builtins.__import__

    def no_pyarrow(name, *args, **kwargs):
        if name.startswith("pyarrow"):
            raise ImportError("No module named 'pyarrow'")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_pyarrow)
    with pytest.raises(ImportError, match=r"danling\[parquet\]"):
        parquet.ParquetSink(tmp_path / "out.parquet", 3)


@pytest.mark.skipif(not importlib.util.find_spec("pyarrow"), reason="pyarrow is not installed")
def test_parquet_mapping_outputs_become_columns(tmp_path):
    import pyarrow.parquet as pq

    sink = ParquetSink(tmp_path / "o.parquet", 2)
    sink.open()
    sink.write([{"id": 1, "score": 0.5}, {"id": 2, "score": 0.25}])
    sink.close()
    assert pq.read_table(tmp_path / "o.parquet").to_pydict() == {"id": [1, 2], "score": [0.5, 0.25]}
    assert not (tmp_path / "o.parquet.staging").exists()


def test_parquet_keeps_every_key_and_refuses_values_its_columns_would_change(tmp_path):
    pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    sink = ParquetSink(tmp_path / "keys.parquet", 6)
    sink.open()
    sink.write([{"id": 0}, {"id": 1, "note": "odd"}])  # a key of the second row only: not dropped
    sink.write([{"id": 2}])
    with pytest.raises(ValueError, match=r"column\(s\) \['extra'\] first appear after the first batch"):
        sink.write([{"id": 3, "extra": 1.0}])
    sink.close()
    assert pq.read_table(tmp_path / "keys.parquet").to_pylist() == [
        {"id": 0, "note": None},
        {"id": 1, "note": "odd"},
        {"id": 2, "note": None},
    ]
    for name, first, later in (("cut", [1, 2], [0.5, 2.7]), ("flag", [True], [2]), ("null", [None], ["text"])):
        sink = ParquetSink(tmp_path / f"{name}.parquet", 4)
        sink.open()
        sink.write(first)
        with pytest.raises(ValueError, match=rf"{name}.parquet: column 'output' has type .* from the first batch"):
            sink.write(later)  # was written as 0 and 2, as True, or failed with "Invalid null value"
    sink = ParquetSink(tmp_path / "fine.parquet", 6)  # conversions that keep every value still pass
    sink.open()
    for batch in ([1.5], [2], [None]):
        sink.write(batch)
    sink.close()
    assert pq.read_table(tmp_path / "fine.parquet").column("output").to_pylist() == [1.5, 2.0, None]


def test_shards_of_a_sink_without_merge_are_indexed_in_place(tmp_path):
    from danling.runners.inference.progress import Commit, ProgressRecord, progress_dir
    from danling.runners.inference.writer import InferencePlan, _merge

    class Unmergeable(JsonLinesSink):
        merge = Sink.merge

    output = tmp_path / "out.jsonl"
    progress_dir(output).mkdir()
    for rank, rows in enumerate(([0, 2, 4], [1, 3])):
        plan = InferencePlan(output, Unmergeable, rank, 2, True, len(rows), 5)
        sink = Unmergeable(plan.target)
        sink.open()
        sink.write(rows)
        state = sink.state()
        sink.close()
        record = ProgressRecord(
            progress_dir(output) / f"rank-{rank}.json",
            "infer",
            rank,
            2,
            rank,
            2,
            True,
            "d",
            5,
            Commit(1, len(rows), state),
        )
        record.done = True
        record.save()
    # a record left by an earlier run on 4 ranks does not count
    ProgressRecord(progress_dir(output) / "rank-3.json", "infer", 3, 4, 3, 4, True, "d", 5, Commit(0, 0, {})).save()
    assert _merge(InferencePlan(output, Unmergeable, 0, 2, True, 3, 5)) == 5
    index = json.loads((tmp_path / "out.jsonl.index.json").read_text())
    assert index["rows"] == [3, 2] and all(Path(shard).exists() for shard in index["shards"])
    assert not output.exists()
