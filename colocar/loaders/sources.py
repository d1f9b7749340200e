"""Random-access record sources for the input pipelines; they run on the sidecar, in worker processes.

Every source maps a *global record index* to a record (`__len__` / `__getitem__`), so a pipeline can
read any record in any order and the content of a batch does not depend on how many hosts or workers
read it. Sources are cheap to construct and to pickle: file handles are opened lazily, on first read,
in the process that reads, so each worker process opens its own.

array_record and pyarrow are imported inside functions (this module is imported on the
sidecar and must stay light); JAX is never imported here.
"""

from __future__ import annotations

import bisect
import glob
import importlib
import os
import threading
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol, runtime_checkable

import numpy as np

SOURCE_KINDS = ("array_record", "parquet", "range", "memory", "callable")


@runtime_checkable
class RandomAccessSource(Protocol):
    """What a pipeline reads: a length and thread-safe reads of record `i` for `0 <= i < len`."""

    def __len__(self) -> int: ...

    def __getitem__(self, index: int) -> Any: ...


def open_source(
    kind: str,
    *,
    paths: Sequence[str] = (),
    n: int | None = None,
    columns: Sequence[str] | None = None,
    callable: str | Callable[[], Any] | None = None,  # the config's key name
    data: Any = None,
) -> RandomAccessSource:
    """Returns the random-access source a pipeline config names (see module docstring).

    kind: "array_record" (records are `bytes`), "parquet" (records are dicts column -> value),
    "range" (record i is `{"index": np.int64(i)}`), "memory" (`data` is a dict of equal-length arrays,
    record i is `{k: v[i]}`), or "callable" (`callable` is "module:function" or a function; it is
    called with no arguments and must return an object with `__len__` and `__getitem__`).
    Paths may contain glob patterns; they are expanded in sorted order.
    """
    if kind == "array_record":
        return ArrayRecordSource(_expand_paths(paths, kind))
    if kind == "parquet":
        return ParquetSource(_expand_paths(paths, kind), columns=columns)
    if kind == "range":
        if n is None or int(n) < 0:
            raise ValueError(f"source kind 'range' needs a non-negative n, got {n!r}")
        return RangeSource(int(n))
    if kind == "memory":
        return MemorySource(data)
    if kind == "callable":
        if callable is None:
            raise ValueError("source kind 'callable' needs callable='module:function'")
        factory = resolve_callable(callable) if isinstance(callable, str) else callable
        source = factory()
        if not (hasattr(source, "__len__") and hasattr(source, "__getitem__")):
            raise TypeError(
                f"source callable {_callable_name(callable)} returned {type(source).__name__}, which has "
                "no __len__ and __getitem__; a source must support len(src) and src[i]"
            )
        return source
    raise ValueError(f"unknown source kind {kind!r}; expected one of {', '.join(SOURCE_KINDS)}")


def resolve_callable(spec: str) -> Callable[..., Any]:
    """Imports "module:attr.path" and returns the attribute (why: configs name user code as strings)."""
    module_name, sep, attr_path = spec.partition(":")
    if not sep or not module_name or not attr_path:
        raise ValueError(f"expected 'module:function', got {spec!r}")
    try:
        obj: Any = importlib.import_module(module_name)
    except ImportError as e:
        raise ImportError(f"cannot import module {module_name!r} named by {spec!r}: {e}") from e
    for part in attr_path.split("."):
        try:
            obj = getattr(obj, part)
        except AttributeError as e:
            raise AttributeError(f"{spec!r}: {type(obj).__name__} {obj!r} has no attribute {part!r}") from e
    if not callable(obj):
        raise TypeError(f"{spec!r} names a {type(obj).__name__}, not a callable")
    return obj


def _callable_name(fn: Any) -> str:
    if isinstance(fn, str):
        return repr(fn)
    return f"{getattr(fn, '__module__', '?')}:{getattr(fn, '__qualname__', repr(fn))}"


def _array_record_source_class() -> Any:
    """array_record's own ArrayRecordDataSource, the class grain's subclasses (grain adds only
    usage statistics): importing it takes ~0.1 s, while `grain.sources` imports JAX (seconds),
    which the sidecar and its pipeline workers must not pay just to read records."""
    from array_record.python.array_record_data_source import ArrayRecordDataSource

    return ArrayRecordDataSource


def _expand_paths(paths: Sequence[str] | str, kind: str) -> list[str]:
    """Expands globs (sorted, so every process sees the same file order) and checks that files exist."""
    if isinstance(paths, (str, os.PathLike)):
        paths = [paths]
    files: list[str] = []
    for p in paths:
        p = os.fspath(p)
        if glob.has_magic(p):
            matched = sorted(glob.glob(p))
            if not matched:
                raise FileNotFoundError(f"{kind} source: no file matches {p!r}")
            files.extend(matched)
        elif not os.path.exists(p):
            raise FileNotFoundError(f"{kind} source: no such file {p!r}")
        else:
            files.append(p)
    if not files:
        raise ValueError(f"{kind} source needs at least one path")
    return files


class ArrayRecordSource:
    """array_record's ArrayRecordDataSource (grain's, without JAX), whose errors name the file
    (and the record in it) at fault.

    The source opens one reader per file lazily, with readahead disabled (it is made for
    random access), and reads are thread-safe. A file that cannot be opened or a record that cannot
    be read raises `PipelineError` naming the file and the record's position in it.
    """

    def __init__(self, files: list[str]):
        self.files = files
        try:
            self._source = _array_record_source_class()(files)
        except Exception as e:
            raise _pipeline_error(f"array_record source: cannot open {_unreadable(files)}: {e}") from e

    def __len__(self) -> int:
        return len(self._source)

    def __getitem__(self, index: int) -> bytes:
        try:
            return self._source[index]  # type: ignore[no-any-return]
        except IndexError:
            raise
        except Exception as e:
            try:
                f, position = self._source._reader_idx_and_position(index)
                where = f"record {position} of file {self._source._read_instructions[f].filename!r}"
            except Exception:  # noqa: BLE001 - array_record internals; fall back to the global index
                where = f"record {index} of files {self.files}"
            raise _pipeline_error(f"array_record source: cannot read {where}: {e}") from e

    def __repr__(self) -> str:
        return f"ArrayRecordSource({len(self.files)} files)"


def _pipeline_error(message: str) -> Exception:
    from .errors import PipelineError

    return PipelineError(message)


def _unreadable(files: list[str]) -> str:
    """The first of `files` that cannot be opened alone (files are opened together first)."""
    for path in files:
        try:
            _array_record_source_class()([path])
        except Exception:  # noqa: BLE001 - any failure names this file
            return f"file {path!r}"
    return f"one of the files {files}"


class RangeSource:
    """Record i is `{"index": np.int64(i)}`: a synthetic source for tests and benchmarks."""

    def __init__(self, n: int):
        self._n = n

    def __len__(self) -> int:
        return self._n

    def __getitem__(self, index: int) -> dict[str, np.int64]:
        i = _check_index(index, self._n)
        return {"index": np.int64(i)}

    def __repr__(self) -> str:
        return f"RangeSource(n={self._n})"


class MemorySource:
    """Record i is `{k: v[i]}` over a dict of equal-length arrays (small data shipped with the config)."""

    def __init__(self, data: Mapping[str, Any]):
        if not isinstance(data, Mapping) or not data:
            raise TypeError(f"memory source needs a non-empty dict of equal-length arrays, got {type(data)}")
        lengths = {k: len(v) for k, v in data.items()}
        if len(set(lengths.values())) != 1:
            raise ValueError(f"memory source arrays differ in length: {lengths}")
        self._data = {k: (v if isinstance(v, np.ndarray) else np.asarray(v)) for k, v in data.items()}
        self._n = next(iter(lengths.values()))

    def __len__(self) -> int:
        return self._n

    def __getitem__(self, index: int) -> dict[str, Any]:
        i = _check_index(index, self._n)
        return {k: v[i] for k, v in self._data.items()}

    def __repr__(self) -> str:
        return f"MemorySource(n={self._n}, keys={sorted(self._data)})"


def _check_index(index: Any, n: int) -> int:
    i = int(index)
    if i < 0 or i >= n:
        raise IndexError(f"record index {i} out of range for a source of {n} records")
    return i


class ParquetSource:
    """Random access over the rows of one or more Parquet files (records: dicts column -> value).

    Global row i maps to (file, row group, offset) through cumulative row counts read from the file
    footers. Reading a row decodes its whole row group; the last decoded row group is cached (one per
    process, shared by threads), so sequential reads cost one decode per row group, but a read that
    jumps to another row group pays a full row-group decode. Parquet is therefore the streaming-friendly
    source: reading it in shuffled order is much slower than ArrayRecord (prefer small row groups, or
    convert to ArrayRecord, if a pipeline shuffles globally).

    Values: numeric / bool / timestamp columns without nulls come back as numpy scalars, lists of
    numbers as numpy arrays, everything else (strings, bytes, nested, nullable) as Python values.
    """

    def __init__(self, paths: Sequence[str], columns: Sequence[str] | None = None):
        self._paths = list(paths)
        self._columns = list(columns) if columns is not None else None
        self._init_process_state()
        # File footers are read once here (cheap, and it fails early on a missing column).
        self._row_group_starts: list[list[int]] = []  # per file: cumulative row starts of its row groups
        self._file_starts: list[int] = []  # global index of each file's first row
        total = 0
        for path in self._paths:
            meta = self._metadata(path)
            if self._columns is not None:
                names = set(meta.schema.to_arrow_schema().names)
                missing = [c for c in self._columns if c not in names]
                if missing:
                    raise KeyError(f"parquet file {path!r} lacks column(s) {missing}; it has {sorted(names)}")
            starts, acc = [], 0
            for rg in range(meta.num_row_groups):
                starts.append(acc)
                acc += meta.row_group(rg).num_rows
            starts.append(acc)
            self._file_starts.append(total)
            self._row_group_starts.append(starts)
            total += acc
        self._n = total

    @staticmethod
    def _metadata(path: str) -> Any:
        import pyarrow.parquet as pq  # type: ignore[import-not-found]

        return pq.read_metadata(path)

    def _init_process_state(self) -> None:
        """Per-process state (handles, cache, locks); rebuilt after unpickling in a worker."""
        self._lock = threading.Lock()
        self._files: dict[int, Any] = {}
        self._file_locks: dict[int, threading.Lock] = {}
        self._cached_key: tuple[int, int] | None = None
        self._cached_columns: dict[str, Any] | None = None
        self.row_group_decodes = 0  # how many row groups this process decoded (for tests and stats)

    def __getstate__(self) -> dict[str, Any]:
        keep = ("_paths", "_columns", "_row_group_starts", "_file_starts", "_n")
        return {k: self.__dict__[k] for k in keep}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._init_process_state()

    def __len__(self) -> int:
        return self._n

    def __repr__(self) -> str:
        return f"ParquetSource(files={len(self._paths)}, rows={self._n}, columns={self._columns})"

    def locate(self, index: int) -> tuple[int, int, int]:
        """(file number, row group, row within the row group) of global row `index`."""
        i = _check_index(index, self._n)
        f = bisect.bisect_right(self._file_starts, i) - 1
        local = i - self._file_starts[f]
        starts = self._row_group_starts[f]
        rg = bisect.bisect_right(starts, local) - 1
        return f, rg, local - starts[rg]

    def __getitem__(self, index: int) -> dict[str, Any]:
        f, rg, offset = self.locate(index)
        columns = self._row_group(f, rg)
        return {name: col[offset] for name, col in columns.items()}

    def _row_group(self, f: int, rg: int) -> dict[str, Any]:
        key = (f, rg)
        with self._lock:
            if self._cached_key == key and self._cached_columns is not None:
                return self._cached_columns
            handle, file_lock = self._open(f)
        with file_lock:  # pyarrow does not promise that concurrent reads of one ParquetFile are safe
            table = handle.read_row_group(rg, columns=self._columns)
        decoded = {name: _decode_column(table.column(name)) for name in table.column_names}
        with self._lock:
            self._cached_key, self._cached_columns = key, decoded
            self.row_group_decodes += 1
        return decoded

    def _open(self, f: int) -> tuple[Any, threading.Lock]:
        """The ParquetFile for file `f`, opened on first use in this process (caller holds self._lock)."""
        if f not in self._files:
            import pyarrow.parquet as pq  # type: ignore[import-not-found]

            self._files[f] = pq.ParquetFile(self._paths[f])
            self._file_locks[f] = threading.Lock()
        return self._files[f], self._file_locks[f]


def _decode_column(column: Any) -> Any:
    """A decoded row-group column: a numpy array where the type allows it, else a list of Python values."""
    import pyarrow as pa  # type: ignore[import-not-found]

    t = column.type
    if column.null_count == 0:
        if (
            pa.types.is_integer(t)
            or pa.types.is_floating(t)
            or pa.types.is_boolean(t)
            or (pa.types.is_timestamp(t) or pa.types.is_date(t) or pa.types.is_duration(t))
        ):
            return column.to_numpy()
        if (pa.types.is_list(t) or pa.types.is_large_list(t) or pa.types.is_fixed_size_list(t)) and (
            pa.types.is_integer(t.value_type) or pa.types.is_floating(t.value_type)
        ):
            dtype = t.value_type.to_pandas_dtype()
            return _NumericLists(column.to_pylist(), dtype)
    return column.to_pylist()


class _NumericLists:
    """A list column of numbers; row access yields a numpy array of the column's value type."""

    def __init__(self, rows: list[Any], dtype: Any):
        self._rows = rows
        self._dtype = dtype

    def __getitem__(self, i: int) -> np.ndarray:
        return np.asarray(self._rows[i], dtype=self._dtype)
