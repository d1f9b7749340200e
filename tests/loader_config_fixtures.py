"""What the pipeline config tests share (a pytest plugin that tests/conftest.py loads): `work`,
a directory holding the example YAML and data files matching its glob, and a valid config.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import pytest

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
