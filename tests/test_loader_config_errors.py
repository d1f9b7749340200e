"""Pipeline config validation (colocar/loaders/config.py): every mistake is named by its key
path. No JAX; one process checks that the module imports none.
"""

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
from helpers import program
from loader_config_fixtures import REPO, base

from colocar.loaders.config import (
    ConfigError,
    load_config,
    resolve_callable,
)

# ---------------------------------------------------------------------------------------------
# Errors
# ---------------------------------------------------------------------------------------------

class _Delete:
    """A key to delete from the config (its repr names the test id the same in every process)."""

    def __repr__(self) -> str:
        return "DELETE"


DELETE = _Delete()


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
    env = dict(os.environ, PYTHONPATH=str(REPO))  # colocar from this checkout, as `-c` in REPO did
    run = [sys.executable, program("imports_without_jax"), "assert", "colocar.loaders.config"]
    subprocess.run(run, check=True, cwd=REPO, env=env)
