import json
import math
import os
import pickle
import stat
import warnings
from collections import OrderedDict
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import torch
import yaml
from hypothesis import given, settings
from hypothesis import strategies as st

from danling.utils import RoundDict, is_json_serializable, load, load_pandas, save
from danling.utils import io as dio

OBJECT = {"name": "run", "lr": 0.001, "layers": [64, 32], "nested": {"flag": True, "none": None}}


@pytest.mark.parametrize("ext", ["json", "yaml", "yml", "pt", "pth", "bin", "pkl", "pickle"])
def test_round_trip_plain_objects(tmp_path, ext):
    path = tmp_path / f"obj.{ext}"
    assert save(OBJECT, path) == path
    assert load(path) == OBJECT
    assert load(str(path)) == OBJECT


def test_extension_is_case_insensitive(tmp_path):
    path = save(OBJECT, str(tmp_path / "OBJ.JSON"))
    assert load(path) == OBJECT


def test_torch_round_trip_with_tensors(tmp_path):
    state = {"weight": torch.randn(3, 2), "step": 7, "rng": torch.get_rng_state()}
    loaded = load(save(state, tmp_path / "state.pt"))
    assert loaded["step"] == 7
    assert torch.equal(loaded["weight"], state["weight"])
    assert torch.equal(loaded["rng"], state["rng"])


class Custom:
    def __init__(self, value):
        self.value = value


def test_torch_load_is_weights_only_by_default(tmp_path):
    path = save({"custom": Custom(3)}, tmp_path / "custom.pt")
    with pytest.raises(pickle.UnpicklingError):
        load(path)
    assert load(path, weights_only=False)["custom"].value == 3


def test_torch_files_admit_what_pickle_files_and_checkpoints_admit(tmp_path):
    # Paths and NumPy values are plain data to every other loader of danling (`.pkl` files,
    # checkpoints); a `.pt` file of the same object loads too, and a refusal is danling's one
    # line naming the type and the opt-in, not torch's advice to pass weights_only=False.
    obj = {"root": Path("/data/run"), "scores": np.arange(3), "best": np.float64(0.25)}
    for ext in ("pt", "pkl"):
        loaded = load(save(obj, tmp_path / f"plain.{ext}"))
        assert loaded["root"] == Path("/data/run") and loaded["best"] == 0.25
        assert np.array_equal(loaded["scores"], np.arange(3))
    path = save({"custom": Custom(3)}, tmp_path / "refused.pt")
    with pytest.raises(pickle.UnpicklingError, match=r"tests\.utils\.test_io\.Custom.*trusted=True") as refused:
        load(path)
    assert "\n" not in str(refused.value) and "weights_only=False" not in str(refused.value)
    assert load(path, trusted=True)["custom"].value == 3
    garbage = tmp_path / "garbage.pt"
    garbage.write_bytes(b"garbage")  # no type to refuse: nothing to trust either
    with pytest.raises(pickle.UnpicklingError, match=r"garbage.pt': not a readable torch file") as unreadable:
        load(garbage)
    assert "trusted" not in str(unreadable.value)
    for seed in range(200):  # random bytes fail inside torch's reader in several other ways too
        garbage.write_bytes(np.random.RandomState(seed).bytes(300))
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # torch warns about the "protocol" the bytes spell
            with pytest.raises(pickle.UnpicklingError, match="not a readable torch file"):
                load(garbage)


def test_torch_load_forwards_map_location(tmp_path):
    path = save(torch.ones(2), tmp_path / "t.pt")
    assert load(path, map_location="cpu").device == torch.device("cpu")


def test_pickle_preserves_arbitrary_objects_when_trusted(tmp_path):
    path = save(Custom([1, 2]), tmp_path / "c.pkl")
    with pytest.raises(pickle.UnpicklingError, match=r"tests\.utils\.test_io\.Custom.*trusted=True"):
        load(path)
    assert load(path, trusted=True).value == [1, 2]


@pytest.mark.parametrize("trusted", [False, True])
def test_pickle_options_reach_the_unpickler_trusted_or_not(tmp_path, trusted):
    # A Python 2 pickle of a byte string needs `encoding=`; the restricted unpickler must honour
    # it (and refuse an unknown option) exactly as the trusted one does, not drop it silently.
    path = tmp_path / "py2.pkl"
    path.write_bytes(b"\x80\x02U\x02\xe9a.")  # protocol 2: the byte string b"\xe9a"
    assert load(path, encoding="latin1", trusted=trusted) == "\xe9a"
    assert load(path, encoding="bytes", trusted=trusted) == b"\xe9a"
    with pytest.raises(UnicodeDecodeError):
        load(path, trusted=trusted)
    with pytest.raises(TypeError, match="bogus"):
        load(path, bogus=1, trusted=trusted)


def test_pickle_of_plain_data_loads_without_trust(tmp_path):
    obj = {"a": [1, 2.5, "x"], "s": {1, 2}, "t": (None, True), "arr": np.arange(3)}
    loaded = load(save(obj, tmp_path / "plain.pkl"))
    assert loaded["a"] == [1, 2.5, "x"] and loaded["s"] == {1, 2} and loaded["t"] == (None, True)
    assert np.array_equal(loaded["arr"], np.arange(3))


def test_json_and_yaml_convert_tensors_numpy_and_subclasses(tmp_path):
    obj = RoundDict(acc=torch.tensor(0.5), per_class=np.array([1, 2]), best=np.float64(0.25))
    obj["ordered"] = OrderedDict(a=(1, 2))
    expected = {"acc": 0.5, "per_class": [1, 2], "best": 0.25, "ordered": {"a": [1, 2]}}
    assert load(save(obj, tmp_path / "r.json")) == expected
    assert load(save(obj, tmp_path / "r.yaml")) == expected
    # YAML stays plain: no python-specific tags that SafeLoader would reject.
    assert "!!python" not in (tmp_path / "r.yaml").read_text()


def test_json_and_yaml_both_write_paths_as_strings(tmp_path):
    # A config or result holding a pathlib path: JSON wrote it as a string, YAML refused it
    # with "cannot represent an object".
    obj = {"root": Path("/data/run"), "files": [Path("a.txt")]}
    expected = {"root": "/data/run", "files": ["a.txt"]}
    assert load(save(obj, tmp_path / "p.json")) == expected
    assert load(save(obj, tmp_path / "p.yaml")) == expected


def test_json_respects_user_options(tmp_path):
    path = save({"b": 1, "a": 2}, tmp_path / "o.json", indent=None, sort_keys=True)
    assert (tmp_path / "o.json").read_text() == '{"a": 2, "b": 1}'
    assert load(path) == {"a": 2, "b": 1}


def _refuse_constant(name: str) -> None:
    raise ValueError(f"{name} is not JSON")


def test_json_writes_nan_and_infinities_as_null(tmp_path):
    # Python's json writes NaN, Infinity and -Infinity, which jq, JavaScript and strict parsers refuse.
    nan, inf = float("nan"), float("inf")
    obj = {"nan": nan, "inf": inf, "row": [-inf, 1.5], "tensor": torch.tensor([2.0, nan]), "np": np.float32(inf)}
    text = save(obj, tmp_path / "r.json").read_text()
    expected = {"nan": None, "inf": None, "row": [None, 1.5], "tensor": [2.0, None], "np": None}
    assert json.loads(text, parse_constant=_refuse_constant) == expected
    assert load(tmp_path / "r.json") == expected
    assert dio.dumps_strict({"a": [nan, 3]}) == '{"a": [null, 3]}'
    assert dio.dumps_strict({"finite": 0.5}, sort_keys=True) == json.dumps({"finite": 0.5})
    # Asked for explicitly, Python's own handling stays available.
    assert "NaN" in save({"nan": nan}, tmp_path / "python.json", allow_nan=True).read_text()
    loop: list = []
    loop.append(loop)
    with pytest.raises(ValueError, match="Circular"):  # another ValueError of json is not swallowed
        dio.dumps_strict(loop)


def test_yaml_load_is_safe(tmp_path):
    path = tmp_path / "evil.yaml"
    path.write_text("!!python/object/apply:os.system ['echo hacked']\n")
    with pytest.raises(yaml.constructor.ConstructorError):
        load(path)


def test_numpy_formats(tmp_path):
    array = np.arange(6, dtype=np.float32).reshape(2, 3)
    np.testing.assert_array_equal(load(save(array, tmp_path / "a.npy")), array)
    named = load(save({"x": array, "y": np.ones(2)}, tmp_path / "named.npz"))
    assert set(named) == {"x", "y"}
    np.testing.assert_array_equal(named["x"], array)
    positional = load(save([array, array * 2], tmp_path / "pos.npz", compressed=True))
    np.testing.assert_array_equal(positional["arr_1"], array * 2)
    single = load(save(array, tmp_path / "single.npz"))
    np.testing.assert_array_equal(single["arr_0"], array)


def test_text(tmp_path):
    assert load(save("héllo\nworld", tmp_path / "a.txt")) == "héllo\nworld"
    assert load(save(["a", 1], tmp_path / "lines.txt")) == "a\n1\n"
    with pytest.raises(TypeError, match=r"\.txt.*dict"):
        save({"a": 1}, tmp_path / "bad.txt")
    assert not (tmp_path / "bad.txt").exists()


@pytest.mark.parametrize("ext", ["csv", "tsv", "parquet", "feather"])
def test_tables(tmp_path, ext):
    frame = pd.DataFrame({"a": [1, 2, 3], "b": ["x", "y", "z"], "c": [0.5, 1.5, 2.5]})
    path = save(frame, tmp_path / f"table.{ext}")
    pd.testing.assert_frame_equal(load(path), frame)
    pd.testing.assert_frame_equal(load_pandas(path), frame)


def test_tables_accept_dicts_series_and_reject_others(tmp_path):
    pd.testing.assert_frame_equal(load(save({"a": [1, 2]}, tmp_path / "d.csv")), pd.DataFrame({"a": [1, 2]}))
    series = pd.Series([1, 2], name="s")
    pd.testing.assert_frame_equal(load(save(series, tmp_path / "s.csv")), series.to_frame())
    with pytest.raises(TypeError, match=r"cannot save a int as a \.csv table"):
        save(3, tmp_path / "bad.csv")
    assert not (tmp_path / "bad.csv").exists()
    with open(tmp_path / "tab.tsv", "w") as handle:
        handle.write("a\tb\n1\t2\n")
    assert load(tmp_path / "tab.tsv").to_dict("list") == {"a": [1], "b": [2]}


def test_load_pandas_rejects_non_table_extensions(tmp_path):
    path = save(OBJECT, tmp_path / "o.json")
    with pytest.raises(ValueError, match=r"supported extensions are \.csv, \.tsv, \.parquet, \.feather$"):
        load_pandas(path)
    with pytest.raises(FileNotFoundError, match="missing.csv"):
        load_pandas(tmp_path / "missing.csv")


def test_unknown_extension_lists_supported(tmp_path):
    for call in (lambda: load(tmp_path / "x.h5"), lambda: save(1, tmp_path / "x.h5")):
        with pytest.raises(ValueError) as info:
            call()
        message = str(info.value)
        assert "'.h5'" in message
        for ext in (".json", ".yaml", ".pt", ".pkl", ".npy", ".npz", ".txt", ".csv", ".parquet"):
            assert ext in message
    with pytest.raises(ValueError, match=r"extension '\(none\)'"):
        load(tmp_path / "noext")
    assert not (tmp_path / "x.h5").exists()


def test_missing_file_names_path(tmp_path):
    path = tmp_path / "missing.json"
    with pytest.raises(FileNotFoundError, match="missing.json"):
        load(path)


@pytest.mark.parametrize("bad", [None, 3, ["a.json"]])
def test_bad_path_type(bad):
    with pytest.raises(TypeError, match="expects a path"):
        load(bad)
    with pytest.raises(TypeError, match="expects a path"):
        save({}, bad)


def test_save_creates_parent_directories(tmp_path):
    path = tmp_path / "a" / "b" / "c.json"
    save([1], path)
    assert load(path) == [1]


def test_save_failure_keeps_previous_file_and_leaves_no_temp(tmp_path):
    path = tmp_path / "result.json"
    save({"good": 1}, path)
    with pytest.raises(TypeError):
        save({"bad": object()}, path)
    assert load(path) == {"good": 1}
    assert os.listdir(tmp_path) == ["result.json"]


def test_save_interrupted_mid_write_keeps_previous_file(tmp_path, monkeypatch):
    path = tmp_path / "state.pt"
    save({"version": 1}, path)

    def crash(obj, handle, *args, **kwargs):
        handle.write(b"partial bytes")
        raise KeyboardInterrupt

    fmt = dio.FORMATS["pt"]
    monkeypatch.setitem(dio.FORMATS, "pt", dio.FileFormat(fmt.extensions, fmt.load, crash))
    with pytest.raises(KeyboardInterrupt):
        save({"version": 2}, path)
    monkeypatch.undo()
    assert load(path) == {"version": 1}
    assert os.listdir(tmp_path) == ["state.pt"]


def test_save_fsyncs_before_replace(tmp_path, monkeypatch):
    events = []
    real_fsync, real_replace = os.fsync, os.replace
    monkeypatch.setattr(os, "fsync", lambda fd: (events.append("fsync"), real_fsync(fd))[1])
    monkeypatch.setattr(os, "replace", lambda a, b: (events.append("replace"), real_replace(a, b))[1])
    save({"a": 1}, tmp_path / "a.json")
    assert events[:2] == ["fsync", "replace"]


def test_save_not_durable_skips_fsync_but_still_replaces_atomically(tmp_path, monkeypatch):
    path = tmp_path / "latest.json"
    save({"epoch": 0}, path, durable=False)
    events = []
    real_replace = os.replace
    monkeypatch.setattr(os, "fsync", lambda fd: events.append("fsync"))
    monkeypatch.setattr(
        os, "replace", lambda a, b: (events.append(("replace", os.path.basename(a))), real_replace(a, b))[1]
    )
    save({"epoch": 1}, path, durable=False)
    assert [e for e in events if e == "fsync"] == []
    (replaced,) = [name for kind, name in (e for e in events if e != "fsync")]
    assert replaced.startswith(".latest.json.") and replaced.endswith(".tmp")  # written beside, then renamed
    assert load(path) == {"epoch": 1}
    with pytest.raises(TypeError):
        save({"bad": object()}, path, durable=False)
    assert load(path) == {"epoch": 1}
    assert os.listdir(tmp_path) == ["latest.json"]


def test_save_uses_umask_permissions(tmp_path):
    path = save("x", tmp_path / "p.txt")
    umask = os.umask(0)
    os.umask(umask)
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o666 & ~umask


def test_registry_is_extensible(tmp_path, monkeypatch):
    upper = dio.FileFormat(
        ("up",),
        lambda path: Path(path).read_text().lower(),
        lambda obj, handle: handle.write(obj.upper().encode()),
    )
    monkeypatch.setitem(dio.FORMATS, "up", upper)
    path = save("shout", tmp_path / "x.up")
    assert (tmp_path / "x.up").read_text() == "SHOUT"
    assert load(path) == "shout"


def test_is_json_serializable():
    assert is_json_serializable(OBJECT)
    assert is_json_serializable(float("nan"))  # json writes NaN by default
    assert not is_json_serializable(torch.ones(1))
    assert not is_json_serializable({1, 2})
    assert not is_json_serializable({("tuple", "key"): 1})
    loop = []
    loop.append(loop)
    assert not is_json_serializable(loop)


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(),
    lambda children: st.lists(children, max_size=4) | st.dictionaries(st.text(), children, max_size=4),
    max_leaves=10,
)


@settings(max_examples=40, deadline=None)
@given(json_values)
def test_json_and_yaml_round_trip_property(tmp_path_factory, value):
    directory = tmp_path_factory.mktemp("prop")
    assert is_json_serializable(value)
    # JSON files are strict JSON: an infinity (the strategy draws them) is written as null.
    assert load(save(value, directory / "v.json")) == json.loads(dio.dumps_strict(value))
    assert load(save(value, directory / "v.yaml")) == value


@pytest.mark.parametrize("value", [math.inf, [1.5, -math.inf], {"a": {"b": math.inf}}])
def test_json_round_trip_reads_an_infinity_back_as_null(tmp_path, value):
    # What the property above draws only sometimes: it compared with the non-strict `json.dumps`.
    loaded = load(save(value, tmp_path / "v.json"))
    assert loaded == json.loads(json.dumps(value).replace("-Infinity", "null").replace("Infinity", "null"))


@pytest.mark.parametrize("text", ["\x85", "a\u2028b", "\u2029", "línea"])
def test_yaml_keeps_unicode_line_breaks(tmp_path, text):
    # PyYAML writes NEL / LS / PS raw when allow_unicode is on and reads them back as spaces.
    assert load(save({text: text}, tmp_path / "v.yaml")) == {text: text}


def test_failed_write_names_the_file(tmp_path, monkeypatch):
    """A full disk during `save` raises an OSError that keeps the errno and names the target file."""
    import errno

    def full_disk(descriptor):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "fsync", full_disk)  # where a full disk shows up for buffered writes
    with pytest.raises(OSError, match="results.json") as info:
        save({"a": 1}, tmp_path / "results.json")
    assert info.value.errno == errno.ENOSPC and info.value.filename == str(tmp_path / "results.json")
    assert list(tmp_path.iterdir()) == []  # no temp file left behind


def test_a_saved_nested_tensor_loads_without_trusting_the_file(tmp_path):
    # danling's own ragged batch was refused by danling.load unless the file was trusted.
    from danling.tensors import NestedTensor

    nested = NestedTensor([torch.ones(2), torch.zeros(3)], padding_value=-1.0)
    loaded = load(save({"batch": nested}, tmp_path / "batch.pt"))["batch"]
    assert isinstance(loaded, NestedTensor) and loaded.padding_value == -1.0
    assert loaded.tensor.tolist() == [[1.0, 1.0, -1.0], [0.0, 0.0, 0.0]]
