"""Record sources and the per-record pipeline (sidecar side of issue 3): real ArrayRecord and Parquet files.

No JAX here: these modules run inside the sidecar's pipeline workers.
"""

from __future__ import annotations

import json
import os
import pickle
import random
import shutil
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from helpers import program

from colocar.loaders.records import RecordError, RecordPipeline, transform_seed
from colocar.loaders.sources import ParquetSource, RandomAccessSource, open_source

N_AR = 300  # ArrayRecord records: 120 in the first file, 180 in the second
PARQUET_SIZES = ((70, 16), (53, 10))  # per file: (rows, row group size) -> 5 + 6 row groups

# User code the pipelines name by "module:function"; copied to a directory on sys.path so that
# another process can import it too.
USER_MODULE = "colocar_test_user_fns"


@pytest.fixture(scope="module")
def user_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("user")
    shutil.copy(program(f"user/{USER_MODULE}"), d / f"{USER_MODULE}.py")
    sys.path.insert(0, str(d))
    yield d
    sys.path.remove(str(d))
    sys.modules.pop(USER_MODULE, None)


def _ar_record(i: int) -> bytes:
    return f"record-{i:05d}-".encode() + bytes([i % 251]) * (i % 37)


@pytest.fixture(scope="module")
def ar_files(tmp_path_factory: pytest.TempPathFactory) -> list[str]:
    from array_record.python.array_record_module import ArrayRecordWriter

    d = tmp_path_factory.mktemp("ar")
    paths, start = [], 0
    for f, count in enumerate((120, 180)):
        path = str(d / f"data-{f:05d}-of-00002.array_record")
        writer = ArrayRecordWriter(path, "group_size:1")
        for i in range(start, start + count):
            writer.write(_ar_record(i))
        writer.close()
        paths.append(path)
        start += count
    return paths


def _pq_row(i: int) -> dict[str, Any]:
    return {"id": i, "score": i / 4.0, "name": f"row{i}", "vec": [i, i + 1, i + 2], "flag": i % 3 == 0}


@pytest.fixture(scope="module")
def pq_files(tmp_path_factory: pytest.TempPathFactory) -> list[str]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    d = tmp_path_factory.mktemp("pq")
    paths, start = [], 0
    for f, (rows, group) in enumerate(PARQUET_SIZES):
        recs = [_pq_row(i) for i in range(start, start + rows)]
        table = pa.Table.from_pylist(
            recs,
            schema=pa.schema(
                [
                    ("id", pa.int64()),
                    ("score", pa.float32()),
                    ("name", pa.string()),
                    ("vec", pa.list_(pa.int32())),
                    ("flag", pa.bool_()),
                ]
            ),
        )
        path = str(d / f"part-{f}.parquet")
        pq.write_table(table, path, row_group_size=group)
        paths.append(path)
        start += rows
    return paths


# ---------------------------------------------------------------- sources


def test_array_record_source_random_access(ar_files: list[str]) -> None:
    src = open_source("array_record", paths=ar_files)
    assert isinstance(src, RandomAccessSource)
    assert len(src) == N_AR
    sequential = [src[i] for i in range(N_AR)]
    assert sequential == [_ar_record(i) for i in range(N_AR)]
    order = list(range(N_AR))
    random.Random(0).shuffle(order)
    assert {i: src[i] for i in order} == dict(enumerate(sequential))
    # A glob expands in sorted order, so every process sees the same global index -> record map.
    globbed = open_source("array_record", paths=(str(Path(ar_files[0]).parent / "data-*.array_record"),))
    assert len(globbed) == N_AR and globbed[150] == _ar_record(150)
    clone = pickle.loads(pickle.dumps(src))  # shipped to a worker: readers reopen lazily there
    assert len(clone) == N_AR and clone[299] == _ar_record(299)


def test_array_record_source_thread_safe(ar_files: list[str]) -> None:
    src = open_source("array_record", paths=ar_files)
    errors: list[int] = []

    def read(seed: int) -> None:
        order = list(range(N_AR))
        random.Random(seed).shuffle(order)
        errors.extend(i for i in order if src[i] != _ar_record(i))

    threads = [threading.Thread(target=read, args=(s,)) for s in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []


def test_missing_files_rejected(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="nope.array_record"):
        open_source("array_record", paths=(str(tmp_path / "nope.array_record"),))
    with pytest.raises(FileNotFoundError, match=r"no file matches"):
        open_source("parquet", paths=(str(tmp_path / "*.parquet"),))
    with pytest.raises(ValueError, match="unknown source kind"):
        open_source("csv")


def test_parquet_source(pq_files: list[str]) -> None:
    total = sum(rows for rows, _ in PARQUET_SIZES)
    src = open_source("parquet", paths=pq_files)
    assert len(src) == total
    assert isinstance(src, ParquetSource)
    assert src.locate(0) == (0, 0, 0)
    assert src.locate(69) == (0, 4, 5)  # row groups of 16 in the first file
    assert src.locate(70) == (1, 0, 0)
    assert src.locate(total - 1) == (1, 5, 2)
    sequential = [src[i] for i in range(total)]
    assert src.row_group_decodes == 11  # one decode per row group when reading in order
    for i, rec in enumerate(sequential):
        want = _pq_row(i)
        assert set(rec) == set(want)
        assert rec["id"] == want["id"] and isinstance(rec["id"], np.int64)
        assert rec["score"] == np.float32(want["score"]) and rec["score"].dtype == np.float32
        assert rec["name"] == want["name"] and bool(rec["flag"]) == want["flag"]
        assert rec["vec"].dtype == np.int32 and rec["vec"].tolist() == want["vec"]
    order = list(range(total))
    random.Random(1).shuffle(order)
    shuffled = {i: src[i] for i in order}
    for i in range(total):
        assert shuffled[i]["id"] == sequential[i]["id"] and shuffled[i]["name"] == sequential[i]["name"]
        assert shuffled[i]["vec"].tolist() == sequential[i]["vec"].tolist()
    with pytest.raises(IndexError):
        src[total]


def test_parquet_columns_and_pickling(pq_files: list[str]) -> None:
    src = open_source("parquet", paths=pq_files, columns=("name", "id"))
    assert set(src[77]) == {"name", "id"} and src[77]["name"] == "row77"
    # Shipped to a worker, it reopens its files there (handles and cache are per process).
    clone = pickle.loads(pickle.dumps(src))
    assert len(clone) == len(src) and clone[100] == src[100] and clone.row_group_decodes == 1
    with pytest.raises(KeyError, match="nothere"):
        open_source("parquet", paths=pq_files, columns=("nothere",))


def test_range_memory_callable_sources(user_dir: Path) -> None:
    rng_src = open_source("range", n=10)
    assert len(rng_src) == 10 and rng_src[3] == {"index": np.int64(3)}
    assert isinstance(rng_src[3]["index"], np.int64)
    with pytest.raises(IndexError):
        rng_src[10]
    with pytest.raises(ValueError, match="non-negative n"):
        open_source("range")

    mem = open_source("memory", data={"a": np.arange(6) * 10, "b": ["u", "v", "w", "x", "y", "z"]})
    assert len(mem) == 6 and mem[4]["a"] == 40 and mem[4]["b"] == "y"
    with pytest.raises(ValueError, match="differ in length"):
        open_source("memory", data={"a": [1, 2], "b": [1]})

    cal = open_source("callable", callable=f"{USER_MODULE}:make_source")
    assert len(cal) == 25 and cal[5] == {"x": 25}
    assert open_source("callable", callable=f"{USER_MODULE}:Holder.Inner.make")[4] == 4
    with pytest.raises(TypeError, match="no __len__ and __getitem__"):
        open_source("callable", callable=f"{USER_MODULE}:make_bad_source")
    with pytest.raises(AttributeError, match="nothing"):
        open_source("callable", callable=f"{USER_MODULE}:nothing")
    with pytest.raises(ValueError, match="module:function"):
        open_source("callable", callable="no_colon")


# ---------------------------------------------------------------- the record pipeline


def test_pipeline_map_filter_random_map(user_dir: Path) -> None:
    fns = __import__(USER_MODULE)
    pipe = RecordPipeline(
        open_source("range", n=50),
        [("map", fns.double), ("filter", lambda r: int(r["index"]) % 4 == 0), ("random_map", fns.jitter)],
        seed=3,
    )
    assert len(pipe) == 50
    for i in range(50):
        rec = pipe[i]
        if (2 * i) % 4:
            assert rec is None
        else:
            assert int(rec["index"]) == 2 * i and rec["noise"].shape == (3,)
    with pytest.raises(IndexError):  # grain alone would wrap the index modulo the length
        pipe[50]
    # bytes records: transforms decide what a record is.
    ar_like = RecordPipeline([b"ab", b"cde"], [("map", lambda b: {"n": len(b)})], seed=0)
    assert ar_like[1] == {"n": 3}


def test_pipeline_matches_grain_dataset_ops(user_dir: Path) -> None:
    """The pipeline applies transforms itself (grain's per-record bookkeeping costs as much as a
    read), with grain's semantics: the records equal grain MapDataset's, randomness included."""
    import grain

    fns = __import__(USER_MODULE)
    steps = [
        ("random_map", fns.jitter),
        ("filter", lambda r: r["k"] % 3 != 0),
        ("map", fns.double),
        ("random_map", lambda r, g: {**r, "b": g.normal(size=2)}),
    ]
    seed = 13
    pipe = RecordPipeline(open_source("range", n=120), steps, seed=seed)
    ds = grain.MapDataset.source(open_source("range", n=120))
    n_random = 0
    for kind, fn in steps:
        if kind == "map":
            ds = ds.map(fn)
        elif kind == "filter":
            ds = ds.filter(fn)
        else:
            ds = ds.random_map(fn, seed=transform_seed(seed, n_random))
            n_random += 1
    dropped = 0
    for i in [*range(120), 77, 3, 119, 0]:  # also out of order and repeated
        ours, theirs = pipe[i], ds[i]
        if theirs is None:
            assert ours is None
            dropped += 1
            continue
        assert ours.keys() == theirs.keys()
        for key in theirs:
            assert np.array_equal(ours[key], theirs[key]), (i, key)
    assert 0 < dropped < 120


def test_random_map_determinism_in_process(user_dir: Path) -> None:
    fns = __import__(USER_MODULE)

    def build(seed: int = 7) -> RecordPipeline:
        return RecordPipeline(open_source("range", n=200), [("random_map", fns.jitter)], seed=seed)

    forward = [build()[i] for i in range(200)]
    backward_pipe = build()
    backward = {i: backward_pipe[i] for i in reversed(range(200))}
    for i in (0, 17, 199):
        alone = build()[i]  # read alone, in a fresh pipeline
        assert alone["k"] == forward[i]["k"] and np.array_equal(alone["noise"], forward[i]["noise"])
    for i in range(200):
        assert backward[i]["k"] == forward[i]["k"]
    assert len({r["k"] for r in forward}) > 190  # records do get different randomness
    assert build(seed=8)[5]["k"] != forward[5]["k"]

    # Two random_maps in one pipeline draw independent streams (per-op seeds derived from the seed).
    two = RecordPipeline(
        open_source("range", n=4),
        [
            ("random_map", lambda r, g: {**r, "a": g.random()}),
            ("random_map", lambda r, g: {**r, "b": g.random()}),
        ],
        seed=7,
    )
    assert two[2]["a"] != two[2]["b"]
    assert transform_seed(7, 0) != transform_seed(7, 1)


def test_random_map_determinism_across_processes(user_dir: Path) -> None:
    fns = __import__(USER_MODULE)
    indices = [3, 150, 42, 0, 199, 77]
    here = RecordPipeline(open_source("range", n=200), [("random_map", fns.jitter)], seed=11)
    want = {i: [here[i]["k"], here[i]["noise"].tolist()] for i in range(200)}
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(user_dir), str(Path(__file__).parents[1])])}
    run = [sys.executable, program("random_map_child"), json.dumps(indices)]
    proc = subprocess.run(run, capture_output=True, text=True, env=env, timeout=60)
    assert proc.returncode == 0, proc.stderr
    got = {int(k): v for k, v in json.loads(proc.stdout.strip().splitlines()[-1]).items()}
    assert got == {i: want[i] for i in indices}


def test_record_error_names_index_and_transform(user_dir: Path) -> None:
    fns = __import__(USER_MODULE)
    steps = [("filter", lambda r: int(r["index"]) % 5 != 0), ("map", fns.explode_on_7)]
    pipe = RecordPipeline(open_source("range", n=30), steps, seed=0)
    assert pipe[6]["index"] == 6 and pipe[5] is None
    with pytest.raises(RecordError) as info:
        pipe[17]
    err = info.value
    assert "record 17" in str(err) and "explode_on_7" in str(err) and "transform #1 map" in str(err)
    assert isinstance(err.__cause__, ValueError) and "bad record 17" in str(err.__cause__)
    assert err.index == 17 and "explode_on_7" in err.transform
    assert "bad record 17" in err.cause_traceback
    again = pickle.loads(pickle.dumps(err))  # crosses the worker -> sidecar boundary intact
    assert str(again) == str(err) and again.index == 17 and again.cause_traceback == err.cause_traceback
    assert pipe.bad_records == 0


def test_skip_bad_records(user_dir: Path) -> None:
    fns = __import__(USER_MODULE)
    steps = [("map", fns.explode_on_7), ("random_map", fns.jitter)]
    pipe = RecordPipeline(open_source("range", n=30), steps, seed=5, skip_bad_records=True)
    out = [pipe[i] for i in range(30)]
    assert [i for i, r in enumerate(out) if r is None] == [7, 17, 27]
    assert pipe.bad_records == 3
    # Determinism holds: the good records are identical to a pipeline that never met a bad one.
    clean_steps = [("map", lambda r: r), ("random_map", fns.jitter)]
    clean = RecordPipeline(open_source("range", n=30), clean_steps, seed=5)
    assert all(out[i]["k"] == clean[i]["k"] for i in range(30) if out[i] is not None)


def test_source_failures_are_record_errors_not_skipped() -> None:
    class Broken:
        def __len__(self) -> int:
            return 5

        def __getitem__(self, i: int) -> Any:
            raise OSError("disk gone")

    pipe = RecordPipeline(Broken(), [], seed=0, skip_bad_records=True)
    with pytest.raises(RecordError, match=r"record 2: source Broken raised OSError: disk gone"):
        pipe[2]
