"""Pipeline config schema and validation (colocar/loaders/config.py): no JAX, no processes."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import yaml

from colocar.loaders.config import (
    ConfigError,
    FieldSpec,
    PipelineConfig,
    SourceConfig,
    TransformConfig,
    load_config,
    resolve_callable,
)

REPO = Path(__file__).resolve().parent.parent
EXAMPLES = REPO / "examples"


@pytest.fixture
def work(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """tmp_path holding a copy of the example YAML and two data files matching its glob."""
    monkeypatch.syspath_prepend(str(EXAMPLES))  # makes `pipeline_transforms` importable
    shutil.copy(EXAMPLES / "pipeline.yaml", tmp_path / "pipeline.yaml")
    (tmp_path / "data").mkdir()
    for name in ("train-00001.array_record", "train-00000.array_record"):
        (tmp_path / "data" / name).write_bytes(b"")
    (tmp_path / "data" / "README.txt").write_text("not matched by the glob")
    monkeypatch.chdir(tmp_path)
    return tmp_path


def base() -> dict[str, Any]:
    """A valid dict config; relative globs resolve against `work` (the cwd)."""
    return {
        "source": {"kind": "array_record", "paths": "data/*.array_record"},
        "global_batch_size": 8,
        "transforms": [
            {"kind": "map", "fn": "pipeline_transforms:decode"},
            {"kind": "random_map", "fn": "pipeline_transforms:augment"},
        ],
        "element_spec": {
            "image": {"shape": [224, 224, 3], "dtype": "uint8"},
            "label": {"shape": [], "dtype": "int32"},
        },
    }


# ---------------------------------------------------------------------------------------------
# Loading
# ---------------------------------------------------------------------------------------------


def test_example_yaml_loads(work: Path) -> None:
    cfg = load_config(work / "pipeline.yaml")
    data = work / "data"
    assert cfg.source == SourceConfig(
        kind="array_record",
        paths=(str(data / "train-00000.array_record"), str(data / "train-00001.array_record")),
    )
    assert cfg.global_batch_size == 64
    assert [t.kind for t in cfg.transforms] == ["map", "filter", "random_map"]
    assert cfg.transforms[0] == TransformConfig("map", "pipeline_transforms:decode")
    assert (cfg.seed, cfg.shuffle, cfg.num_epochs, cfg.drop_remainder, cfg.eval) == (0, True, 1, True, False)
    assert (cfg.workers_per_host, cfg.prefetch, cfg.batch_axes, cfg.skip_bad_records) == (1, 4, None, False)
    assert cfg.element_spec == {
        "image": FieldSpec((224, 224, 3), "uint8"),
        "label": FieldSpec((), "int32"),
    }


def test_example_yaml_names_every_key() -> None:
    raw = yaml.safe_load((EXAMPLES / "pipeline.yaml").read_text())
    top = {f for f in PipelineConfig.__dataclass_fields__}
    assert set(raw) == top
    text = (EXAMPLES / "pipeline.yaml").read_text()
    for key in SourceConfig.__dataclass_fields__:
        assert f"{key}:" in text, key


def test_relative_globs_resolve_against_the_file_directory(work: Path, tmp_path_factory: Any) -> None:
    elsewhere = tmp_path_factory.mktemp("elsewhere")
    os.chdir(elsewhere)
    cfg = load_config(str(work / "pipeline.yaml"))
    assert all(p.startswith(str(work / "data")) for p in cfg.source.paths)
    # a dict config resolves against base_dir, else the cwd (where there is no data)
    assert load_config(base(), base_dir=str(work)).source.paths == cfg.source.paths
    with pytest.raises(ConfigError, match=r"source\.paths: glob 'data/\*\.array_record' matches no file"):
        load_config(base())


def test_yaml_toml_json_give_equal_configs(work: Path) -> None:
    yaml_text = """
source: {kind: parquet, paths: ["data/*00000*", "data/*00001*"], columns: [a, b]}
global_batch_size: 32
transforms:
  - {kind: map, fn: "pipeline_transforms:decode"}
  - {kind: filter, fn: "pipeline_transforms:has_label"}
seed: 7
shuffle: false
num_epochs: forever
eval: false
drop_remainder: false
workers_per_host: 2
prefetch: 3
batch_axes: [data, fsdp]
element_spec:
  label: {shape: [], dtype: int32}
  x: {shape: [3, 4], dtype: bfloat16}
"""
    toml_text = """
global_batch_size = 32
seed = 7
shuffle = false
num_epochs = "forever"
eval = false
drop_remainder = false
workers_per_host = 2
prefetch = 3
batch_axes = ["data", "fsdp"]

[source]
kind = "parquet"
paths = ["data/*00000*", "data/*00001*"]
columns = ["a", "b"]

[[transforms]]
kind = "map"
fn = "pipeline_transforms:decode"

[[transforms]]
kind = "filter"
fn = "pipeline_transforms:has_label"

[element_spec.label]
shape = []
dtype = "int32"

[element_spec.x]
shape = [3, 4]
dtype = "bfloat16"
"""
    (work / "p.yaml").write_text(yaml_text)
    (work / "p.toml").write_text(toml_text)
    as_dict = yaml.safe_load(yaml_text)
    as_dict["num_epochs"] = None
    (work / "p.json").write_text(json.dumps(as_dict))
    configs = [load_config(work / name) for name in ("p.yaml", "p.toml", "p.json")]
    configs.append(load_config(as_dict))
    assert all(c == configs[0] for c in configs)
    cfg = configs[0]
    assert cfg.num_epochs is None and not cfg.eval and not cfg.drop_remainder
    assert cfg.source.columns == ("a", "b") and len(cfg.source.paths) == 2
    assert cfg.batch_axes == ("data", "fsdp")
    assert cfg.element_spec is not None and cfg.element_spec["x"] == FieldSpec((3, 4), "bfloat16")


def test_dict_config_with_python_callables(work: Path) -> None:
    def double(record: dict[str, Any]) -> dict[str, Any]:
        return {"index": record["index"] * 2}

    cfg = load_config(
        {
            "source": {"kind": "range", "n": 100},
            "global_batch_size": 10,
            "transforms": [
                {"kind": "map", "fn": double},
                {"kind": "filter", "fn": lambda r: r["index"] % 3 != 0},
                {"kind": "random_map", "fn": "pipeline_transforms:augment"},
            ],
            "batch_axes": "data",
        }
    )
    assert cfg.transforms[0].fn is double
    assert resolve_callable(cfg.transforms[0].fn, "x")({"index": 4}) == {"index": 8}
    assert cfg.batch_axes == ("data",)
    assert cfg.source.num_records == 100
    d = cfg.to_dict()
    json.dumps(d)
    assert d["transforms"][0]["fn"].startswith("<python callable ")
    assert d["transforms"][2]["fn"] == "pipeline_transforms:augment"


def test_dataclass_parts_inside_a_dict_config(work: Path) -> None:
    cfg = load_config(
        {
            "source": SourceConfig(kind="range", n=5),
            "global_batch_size": 5,
            "transforms": (TransformConfig("map", "pipeline_transforms:decode"),),
            "element_spec": {"image": FieldSpec((224, 224, 3), "uint8")},
        }
    )
    assert cfg.source.n == 5 and cfg.transforms[0].kind == "map"


def test_module_level_callable_is_named_in_to_dict(work: Path) -> None:
    import pipeline_transforms

    cfg = load_config({**base(), "transforms": [{"kind": "map", "fn": pipeline_transforms.decode}]})
    assert cfg.to_dict()["transforms"][0]["fn"] == "pipeline_transforms:decode"


def test_to_dict_is_json_and_round_trips(work: Path) -> None:
    cfg = load_config(work / "pipeline.yaml")
    text = json.dumps(cfg.to_dict(), sort_keys=True)
    back = load_config(json.loads(text), base_dir="/")
    assert back == cfg
    assert json.dumps(back.to_dict(), sort_keys=True) == text
    # every key is written, so a stored config is complete and diffable
    assert set(cfg.to_dict()) == set(PipelineConfig.__dataclass_fields__)


def test_round_trip_of_paths_that_look_like_globs(work: Path) -> None:
    odd = work / "data" / "shard[1].array_record"
    odd.write_bytes(b"")
    cfg = load_config(work / "pipeline.yaml")
    assert str(odd) in cfg.source.paths
    assert load_config(cfg.to_dict()) == cfg


def test_pipeline_config_is_validated_again(work: Path) -> None:
    cfg = load_config(work / "pipeline.yaml")
    assert load_config(cfg) == cfg
    with pytest.raises(ConfigError, match=r"^pipeline config: global_batch_size: expected a positive int"):
        load_config(PipelineConfig(source=SourceConfig("range", n=4), global_batch_size=0))
    with pytest.raises(ConfigError, match=r"source\.paths: not a setting of source kind 'range'"):
        load_config(PipelineConfig(source=SourceConfig("range", n=4, paths=("x",)), global_batch_size=2))
    with pytest.raises(ConfigError, match=r"prefetch: expected an int >= 2, got 1"):
        load_config(PipelineConfig(source=SourceConfig("range", n=4), global_batch_size=2, prefetch=1))


def test_memory_source(work: Path) -> None:
    data = {"x": np.arange(12).reshape(6, 2), "y": list(range(6))}
    cfg = load_config({"source": {"kind": "memory", "data": data}, "global_batch_size": 3})
    assert cfg.source.data["x"] is data["x"] and cfg.source.num_records == 6
    same = load_config(
        {
            "source": {"kind": "memory", "data": {"x": data["x"].copy(), "y": list(range(6))}},
            "global_batch_size": 3,
        }
    )
    assert same == cfg
    other = load_config(
        {
            "source": {"kind": "memory", "data": {"x": data["x"] + 1, "y": list(range(6))}},
            "global_batch_size": 3,
        }
    )
    assert other != cfg
    assert load_config(cfg) == cfg
    d = cfg.to_dict()
    assert d["source"]["data"] == {
        "__memory_summary__": {"x": {"shape": [6, 2], "dtype": "int64"}, "y": {"length": 6, "type": "list"}}
    }
    json.dumps(d)
    with pytest.raises(ConfigError, match=r"source\.data: this is the summary"):
        load_config(d)


def test_memory_source_is_rejected_in_files(work: Path) -> None:
    (work / "m.yaml").write_text("source: {kind: memory, data: {x: [1, 2]}}\nglobal_batch_size: 1\n")
    with pytest.raises(ConfigError, match=r"source\.data: a memory source .* only be given in a dict config"):
        load_config(work / "m.yaml")


def test_callable_source(work: Path) -> None:
    cfg = load_config(
        {"source": {"kind": "callable", "callable": "pipeline_transforms:decode"}, "global_batch_size": 1}
    )
    assert cfg.source.callable == "pipeline_transforms:decode"


def test_dtype_names_are_normalized(work: Path) -> None:
    cfg = load_config(
        {
            **base(),
            "element_spec": {
                "a": {"shape": [1], "dtype": "f4"},
                "b": {"shape": [2], "dtype": "float8_e4m3fn"},
                "c": {"shape": [], "dtype": "bool"},
            },
        }
    )
    assert cfg.element_spec is not None
    assert [s.dtype for s in cfg.element_spec.values()] == ["float32", "float8_e4m3fn", "bool"]


# ---------------------------------------------------------------------------------------------
# Errors
# ---------------------------------------------------------------------------------------------

DELETE = object()


def _apply(cfg: dict[str, Any], path: str, value: Any) -> None:
    """Set (or delete, with DELETE) the value at a key path like 'transforms[1].fn'."""
    parts: list[Any] = []
    for piece in path.split("."):
        name, _, rest = piece.partition("[")
        if name:
            parts.append(name)
        if rest:
            parts.extend(int(i) for i in rest.rstrip("]").split("]["))
    node: Any = cfg
    for p in parts[:-1]:
        node = node[p]
    if value is DELETE:
        del node[parts[-1]]
    else:
        node[parts[-1]] = value


BAD: list[tuple[str, Any, str, str]] = [
    # (key path to change, new value, key path in the message, text in the message)
    ("global_batch", 8, "global_batch", "unknown key; did you mean 'global_batch_size'?"),
    ("shufle", True, "shufle", "did you mean 'shuffle'?"),
    ("source.pths", "x", "source.pths", "did you mean 'paths'?"),
    ("transforms[0].func", "m:f", "transforms[0].func", "did you mean 'fn'?"),
    ("element_spec.image.dtyp", "uint8", "element_spec.image.dtyp", "did you mean 'dtype'?"),
    ("global_batch_size", "64", "global_batch_size", "expected an int, got str '64'"),
    ("global_batch_size", True, "global_batch_size", "expected an int, got bool True"),
    ("global_batch_size", 8.0, "global_batch_size", "expected an int, got float 8.0"),
    ("seed", 1.5, "seed", "expected an int, got float"),
    ("seed", -1, "seed", "expected a non-negative int, got -1"),
    ("shuffle", "yes", "shuffle", "expected true or false, got str 'yes'"),
    ("shuffle", 1, "shuffle", "expected true or false, got int 1"),
    ("skip_bad_records", None, "skip_bad_records", "expected true or false, got null"),
    ("source", DELETE, "source", "required key is missing"),
    ("global_batch_size", DELETE, "global_batch_size", "required key is missing; expected a positive int"),
    ("source", "data/*.array_record", "source", "expected a mapping with a 'kind'"),
    ("source.kind", DELETE, "source.kind", "required key is missing"),
    ("source.kind", "arrayrecord", "source.kind", "did you mean 'array_record'?"),
    ("source.paths", DELETE, "source.paths", "source kind 'array_record' requires 'paths'"),
    (
        "source.paths",
        "nope/*.array_record",
        "source.paths",
        "glob 'nope/*.array_record' matches no file in directory",
    ),
    (
        "source.paths",
        ["data/*.array_record", "data/*.parquet"],
        "source.paths[1]",
        "glob 'data/*.parquet' matches no file",
    ),
    ("source.paths", [], "source.paths", "expected a glob string or a non-empty list of globs"),
    ("source.paths", ["data/*", 3], "source.paths[1]", "expected a glob string, got int"),
    ("source.paths", "data", "source.paths", "1 directories matched, but no files"),
    ("source.n", 5, "source.n", "not a setting of source kind 'array_record'"),
    ("source", {"kind": "range"}, "source.n", "source kind 'range' requires 'n'"),
    ("source", {"kind": "range", "n": 0}, "source.n", "expected a positive int, got 0"),
    ("source", {"kind": "range", "n": "10"}, "source.n", "expected an int, got str"),
    ("source", {"kind": "callable"}, "source.callable", "source kind 'callable' requires 'callable'"),
    (
        "source",
        {"kind": "callable", "callable": "nosuchmod_xyz:make"},
        "source.callable",
        "cannot import module 'nosuchmod_xyz'",
    ),
    (
        "source",
        {"kind": "callable", "callable": print},
        "source.callable",
        "expected a 'module:function' string",
    ),
    (
        "source",
        {"kind": "memory", "data": {"x": np.zeros((4, 2)), "label": [1, 2, 3]}},
        "source.data.label",
        "has 3 records but field 'x' has 4",
    ),
    (
        "source",
        {"kind": "memory", "data": {"x": np.float32(1)}},
        "source.data.x",
        "expected a numpy array or a list",
    ),
    ("source", {"kind": "memory", "data": {}}, "source.data", "expected a non-empty dict"),
    ("source", {"kind": "parquet", "paths": "data/*", "columns": "a"}, "source.columns", "expected a list"),
    ("transforms", {"kind": "map"}, "transforms", "expected a list of {kind, fn} mappings"),
    ("transforms[1]", "pipeline_transforms:augment", "transforms[1]", "expected a mapping with 'kind'"),
    ("transforms[1].fn", DELETE, "transforms[1].fn", "required key is missing"),
    ("transforms[1].kind", "randommap", "transforms[1].kind", "did you mean 'random_map'?"),
    ("transforms[1].fn", "no_such_module_abc:f", "transforms[1].fn", "no module named 'no_such_module_abc'"),
    ("transforms[1].fn", "pipeline_transforms:augmnet", "transforms[1].fn", "did you mean 'augment'?"),
    ("transforms[1].fn", "pipeline_transforms:np.nosuch", "transforms[1].fn", "has no attribute 'nosuch'"),
    ("transforms[1].fn", "pipeline_transforms:IMAGE_BYTES", "transforms[1].fn", "is not callable"),
    ("transforms[1].fn", "pipeline_transforms.augment", "transforms[1].fn", "expected 'module:function'"),
    ("transforms[1].fn", 42, "transforms[1].fn", "expected a 'module:function' string or a Python callable"),
    ("transforms[1].kind", "map", "transforms[1].fn", "kind 'map' calls it as fn(record)"),
    ("transforms[0].kind", "random_map", "transforms[0].fn", "kind 'random_map' calls it as fn(record, rng)"),
    ("global_batch_size", 0, "global_batch_size", "expected a positive int, got 0"),
    ("global_batch_size", -4, "global_batch_size", "expected a positive int, got -4"),
    ("prefetch", 1, "prefetch", "expected an int >= 2, got 1"),
    ("workers_per_host", 0, "workers_per_host", "expected a positive int, got 0"),
    ("eval", True, "eval", "set drop_remainder: false"),
    ("num_epochs", 0, "num_epochs", "expected a positive int, got 0; use null or 'forever'"),
    ("num_epochs", -1, "num_epochs", "expected a positive int, got -1"),
    ("num_epochs", "twice", "num_epochs", "expected a positive int, null or 'forever', got 'twice'"),
    ("batch_axes", [], "batch_axes", "expected at least one mesh axis"),
    ("batch_axes", ["data", 1], "batch_axes[1]", "expected a non-empty string, got int 1"),
    ("batch_axes", ["data", "data"], "batch_axes", "an axis is named twice"),
    ("element_spec", [], "element_spec", "expected a mapping of field name"),
    ("element_spec.image.dtype", "float33", "element_spec.image.dtype", "unknown dtype 'float33'"),
    ("element_spec.image.dtype", "bfloat61", "element_spec.image.dtype", "did you mean 'bfloat16'?"),
    ("element_spec.image.dtype", "object", "element_spec.image.dtype", "cannot be a device array"),
    ("element_spec.image.dtype", "str", "element_spec.image.dtype", "cannot be a device array"),
    ("element_spec.image.shape", "224,224,3", "element_spec.image.shape", "expected a list of ints"),
    ("element_spec.image.shape", [224, -1, 3], "element_spec.image.shape[1]", "expected a non-negative int"),
    ("element_spec.image.shape", [224, 2.5, 3], "element_spec.image.shape[1]", "expected an int, got float"),
    ("element_spec.label.shape", DELETE, "element_spec.label.shape", "required key is missing"),
]


@pytest.mark.parametrize(("key", "value", "path", "text"), BAD, ids=[f"{b[0]}={b[1]!r}"[:60] for b in BAD])
def test_bad_config(work: Path, key: str, value: Any, path: str, text: str) -> None:
    cfg = base()
    _apply(cfg, key, value)
    with pytest.raises(ConfigError) as info:
        load_config(cfg)
    message = str(info.value)
    assert message.startswith(f"pipeline config: {path}: "), message
    assert text in message, message
    assert info.value.path == path


def test_eval_with_explicit_drop_remainder_names_it(work: Path) -> None:
    with pytest.raises(ConfigError, match=r"^pipeline config: drop_remainder: eval: true .* contradicts"):
        load_config({**base(), "eval": True, "drop_remainder": True})
    with pytest.raises(ConfigError, match=r"^pipeline config: eval: .* no last batch"):
        load_config({**base(), "eval": True, "drop_remainder": False, "num_epochs": None})
    cfg = load_config({**base(), "eval": True, "drop_remainder": False})
    assert cfg.eval and not cfg.drop_remainder


def test_glob_error_names_the_directory_of_the_file(work: Path) -> None:
    (work / "sub").mkdir()
    shutil.copy(work / "pipeline.yaml", work / "sub" / "pipeline.yaml")
    with pytest.raises(ConfigError) as info:
        load_config(work / "sub" / "pipeline.yaml")
    msg = str(info.value)
    assert msg.startswith("pipeline config: source.paths: glob 'data/*.array_record' matches no file")
    assert repr(str(work / "sub")) in msg and "the config file's directory" in msg
    assert msg.endswith(f"(in {work / 'sub' / 'pipeline.yaml'})")


def test_import_error_inside_a_user_module_is_reported(work: Path) -> None:
    (work / "broken_transforms.py").write_text("import no_such_dependency_q\ndef f(r):\n    return r\n")
    sys.path.insert(0, str(work))
    try:
        with pytest.raises(
            ConfigError,
            match=r"transforms\[0\]\.fn: importing module 'broken_transforms'.*"
            r"no_such_dependency_q",
        ):
            load_config({**base(), "transforms": [{"kind": "map", "fn": "broken_transforms:f"}]})
    finally:
        sys.path.remove(str(work))
        sys.modules.pop("broken_transforms", None)


@pytest.mark.parametrize(
    ("name", "text", "match"),
    [
        (
            "p.yaml",
            "source: {kind: range, n: 4}\nglobal_batch_size: 2\nseed: 1\nseed: 2\n",
            r"^pipeline config: seed: the key appears twice .*line 4",
        ),
        (
            "p.json",
            '{"source": {"kind": "range", "n": 4}, "global_batch_size": 2, "global_batch_size": 3}',
            r"^pipeline config: global_batch_size: the key appears twice",
        ),
        (
            "p.yaml",
            "",
            r"^pipeline config: \(top level\): expected a mapping of pipeline settings .*got null",
        ),
        ("p.yaml", "- 1\n- 2\n", r"^pipeline config: \(top level\): expected a mapping"),
        ("p.yaml", "source: [\n", r"^pipeline config: \(top level\): cannot parse"),
        ("p.toml", "source = \n", r"^pipeline config: \(top level\): cannot parse"),
        ("p.json", "{", r"^pipeline config: \(top level\): cannot parse"),
        ("p.ini", "x=1", r"^pipeline config: \(top level\): cannot tell the format"),
        (
            "p.toml",
            'global_batch_size = 2\n[source]\nkind = "range"\nn = 4\nfoo = 1\n',
            r"^pipeline config: source\.foo: unknown key",
        ),
        (
            "p.yaml",
            "source: {kind: range, n: 4}\nglobal_batch_size: 1e3\n",
            r"^pipeline config: global_batch_size: expected an int, got str '1e3'",
        ),
    ],
)
def test_bad_files(work: Path, name: str, text: str, match: str) -> None:
    (work / name).write_text(text)
    with pytest.raises(ConfigError, match=match):
        load_config(work / name)


def test_missing_file_and_wrong_argument(work: Path) -> None:
    with pytest.raises(ConfigError, match=r"config file .*nope\.yaml' does not exist"):
        load_config("nope.yaml")
    with pytest.raises(ConfigError, match=r"expected a file path, a dict or a PipelineConfig, got list"):
        load_config([1, 2])  # type: ignore[arg-type]


def test_resolve_callable() -> None:
    assert resolve_callable("os.path:join", "k") is os.path.join
    assert resolve_callable("json:JSONDecoder.decode", "k") is json.JSONDecoder.decode
    assert resolve_callable(len, "k") is len
    with pytest.raises(
        ConfigError,
        match=r"^pipeline config: a\.b\[3\]: 'os\.path' has no attribute 'jion'.*"
        r"did you mean 'join'",
    ):
        resolve_callable("os.path:jion", "a.b[3]")
    with pytest.raises(ConfigError, match=r"^pipeline config: k: 'os:sep' is not callable"):
        resolve_callable("os:sep", "k")
    with pytest.raises(
        ConfigError, match=r"^pipeline config: k: expected 'module:function' or a Python callable"
    ):
        resolve_callable(3, "k")  # type: ignore[arg-type]


def test_config_error_is_a_value_error() -> None:
    assert issubclass(ConfigError, ValueError)
    e = ConfigError("transforms[2].fn", "boom")
    assert str(e) == "pipeline config: transforms[2].fn: boom" and e.path == "transforms[2].fn"


def test_config_module_imports_no_jax() -> None:
    code = "import sys, colocar.loaders.config; assert 'jax' not in sys.modules, 'jax imported'"
    subprocess.run([sys.executable, "-c", code], check=True, cwd=REPO)


# ---------------------------------------------------------------------------------------------
# The example transforms
# ---------------------------------------------------------------------------------------------


def test_example_transforms(work: Path) -> None:
    import pipeline_transforms as pt

    image = np.random.default_rng(0).integers(0, 256, (224, 224, 3), dtype=np.uint8)
    record = pt.decode(pt.encode(image, 7))
    assert record["image"].dtype == np.uint8 and record["image"].shape == (224, 224, 3)
    np.testing.assert_array_equal(record["image"], image)
    assert record["label"].dtype == np.int32 and record["label"] == 7
    assert pt.has_label(record) and not pt.has_label(pt.decode(pt.encode(image, -1)))
    flips = []
    for seed in range(16):
        out = pt.augment(record, np.random.default_rng(seed))
        again = pt.augment(record, np.random.default_rng(seed))
        np.testing.assert_array_equal(out["image"], again["image"])  # a function of the rng alone
        flipped = np.array_equal(out["image"], image[:, ::-1])
        assert flipped or np.array_equal(out["image"], image)
        flips.append(flipped)
    assert any(flips) and not all(flips)
    with pytest.raises(ValueError, match="expected a record of"):
        pt.decode(b"short")
