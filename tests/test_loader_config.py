"""Pipeline config schema (colocar/loaders/config.py): loading YAML, TOML, JSON and dicts, and
the example transforms. No JAX, no processes.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import yaml
from loader_config_fixtures import EXAMPLES, base

from colocar.loaders.config import (
    ConfigError,
    FieldSpec,
    PipelineConfig,
    SourceConfig,
    TransformConfig,
    load_config,
    resolve_callable,
)

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


# One config written in YAML and in TOML (test_yaml_toml_json_give_equal_configs).
EQUAL_YAML = """
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

EQUAL_TOML = """
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


def test_yaml_toml_json_give_equal_configs(work: Path) -> None:
    yaml_text, toml_text = EQUAL_YAML, EQUAL_TOML
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
    cfg = load_config({"source": {"kind": "callable", "callable": "builtins:list"}, "global_batch_size": 1})
    assert cfg.source.callable == "builtins:list"


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
