"""Pipeline errors name what is wrong (issue 19 item 7): the key, file, record and numbers.

Each scenario runs `loaders.load` on the shared two-sidecar cluster; what can be checked when
`load` is called is, and raises `ConfigError` naming the key path; data problems raise
`PipelineError` naming the file and record.
"""

from __future__ import annotations

import re
import time
from pathlib import Path

import numpy as np
import pytest
from loaders_helpers import B, config

from colocar import loaders
from colocar.loaders.config import ConfigError
from colocar.loaders.errors import PipelineError


def test_a_batch_size_the_batch_axes_do_not_divide_names_the_numbers(cluster):
    n = len(cluster.mesh(("data",)).devices.flat)
    with pytest.raises(ConfigError, match=rf"global_batch_size: {n + 2} is not a multiple of {n}") as e:
        loaders.load(config(global_batch_size=n + 2), cluster)
    assert "'data'" in str(e.value)


def test_an_unknown_batch_axis_is_named_with_the_mesh_axes(cluster):
    with pytest.raises(ConfigError, match=r"batch_axes: 'dat' is not an axis of the mesh.*'data'"):
        loaders.load(config(batch_axes="dat"), cluster)
    with pytest.raises(ConfigError, match=r"batch_axes\[1\]: 'x' is not an axis of the mesh"):
        loaders.load(config(batch_axes=["data", "x"]), cluster)


def test_a_source_callable_that_needs_arguments_names_them(cluster):
    src = {"kind": "callable", "callable": "colocar.loaders.sources:RangeSource"}
    with pytest.raises(ConfigError, match=r"source\.callable: .*RangeSource.*'n'"):
        loaders.load(config(source=src), cluster)


@pytest.mark.parametrize("spec", [None, {"index": {"shape": [], "dtype": "int64"}}], ids=["probed", "spec"])
def test_a_transform_returning_a_non_dict_names_the_transform_and_record(cluster, spec):
    def to_list(record):
        return [record["index"]]

    transforms = [{"kind": "map", "fn": to_list}]
    with pytest.raises(PipelineError) as e:
        with loaders.load(config(transforms=transforms, element_spec=spec), cluster) as it:
            next(it)
    text = str(e.value)
    assert re.search(r"record \d+: transform #0 map \S*to_list returned list, not a dict", text), text


def _write(path: Path, records: int, rot: bool = False) -> str:
    """An ArrayRecord file of random 1000-byte records; with `rot`, record 2's chunk is damaged."""
    from array_record.python.array_record_module import ArrayRecordWriter

    rng = np.random.default_rng(0)
    writer = ArrayRecordWriter(str(path), "group_size:1")
    for _ in range(records):
        writer.write(rng.bytes(1000))
    writer.close()
    if rot:  # one record per chunk; record 2's chunk is bytes 2196-3262 of the file
        data = bytearray(path.read_bytes())
        data[2700:2710] = bytes(b ^ 0xFF for b in data[2700:2710])
        path.write_bytes(bytes(data))
    return str(path)


def _decode(record):
    return {"x": np.frombuffer(record, np.uint8)[:4]}


def test_an_array_record_file_that_cannot_be_opened_is_named(cluster, tmp_path: Path):
    good = _write(tmp_path / "a.array_record", 8)
    bad = tmp_path / "b.array_record"
    bad.write_bytes(b"this is not an array record file" * 8)
    src = {"kind": "array_record", "paths": [good, str(bad)]}
    with pytest.raises(PipelineError, match=rf"cannot open file '{re.escape(str(bad))}'"):
        with loaders.load(config(source=src, transforms=[{"kind": "map", "fn": _decode}]), cluster) as it:
            next(it)


def test_a_corrupt_array_record_record_names_the_file_and_record(cluster, tmp_path: Path):
    good = _write(tmp_path / "a.array_record", 8)
    rot = _write(tmp_path / "b.array_record", 8, rot=True)
    src = {"kind": "array_record", "paths": [good, rot]}
    spec = {"x": {"shape": [4], "dtype": "uint8"}}
    cfg = config(source=src, transforms=[{"kind": "map", "fn": _decode}], shuffle=False, element_spec=spec)
    with pytest.raises(PipelineError) as e:
        with loaders.load({**cfg, "global_batch_size": 8}, cluster) as it:
            for _ in range(4):
                next(it)
    assert re.search(rf"record 10: .*cannot read record 2 of file '{re.escape(rot)}'", str(e.value)), str(
        e.value
    )


LONG_TEXT = "".join(f"<{j:05d}>" for j in range(3000))  # 21 000 characters, each part distinct


def _long_error_after_three_batches(record):
    if int(record["index"]) >= 3 * B:
        raise ValueError(LONG_TEXT)
    return {"label": np.int32(record["index"])}


def test_an_error_longer_than_the_feed_inbox_arrives_whole_after_the_batches_before_it(cluster):
    """The feed's last message (the error) is several times its 4 KiB inbox and follows
    batches read in the same receive: the inbox moves the unread bytes to its front and
    grows, and neither the batches nor the text lose a byte."""
    cfg = config(transforms=[{"kind": "map", "fn": _long_error_after_three_batches}], shuffle=False)
    got = []
    with pytest.raises(PipelineError) as e:
        with loaders.load({**cfg, "num_epochs": 1, "prefetch": 4}, cluster) as it:
            time.sleep(1.0)  # the pipeline sends all: one receive reads batches and the error's start
            for _ in range(4):
                got.append(sorted(np.asarray(next(it)["label"]).tolist()))
    assert got == [list(range(B * k, B * (k + 1))) for k in range(3)]
    assert LONG_TEXT in str(e.value)
