"""The parsers of the source options that plain type checks cannot cover: globs, in-memory arrays
and callables. `SourceConfig` (config.py) names them in its option declarations. No JAX here."""

from __future__ import annotations

import glob
import os
from collections.abc import Mapping
from typing import Any

import numpy as np

from .callables import check_no_arguments, resolve_callable
from .checks import ConfigError, describe
from .schema import Context


def source_paths(raw: Any, path: str, ctx: Context) -> tuple[str, ...]:
    """The sorted absolute files matched by a glob or a non-empty list of globs; each must match."""
    if isinstance(raw, str):
        patterns, paths_of = [raw], [path]
    elif isinstance(raw, list | tuple) and raw and all(isinstance(p, str) for p in raw):
        patterns, paths_of = list(raw), [f"{path}[{i}]" for i in range(len(raw))]
    else:
        if isinstance(raw, list | tuple):
            bad = next((i for i, p in enumerate(raw) if not isinstance(p, str)), None)
            if bad is not None:
                raise ConfigError(f"{path}[{bad}]", f"expected a glob string, got {describe(raw[bad])}")
        raise ConfigError(path, f"expected a glob string or a non-empty list of globs, got {describe(raw)}")
    found: set[str] = set()
    for pattern, where in zip(patterns, paths_of, strict=True):
        found.update(_glob_files(pattern, where, ctx))
    return tuple(sorted(found))


def _glob_files(pattern: str, where: str, ctx: Context) -> list[str]:
    if not pattern.strip():
        raise ConfigError(where, "expected a glob, got an empty string")
    full = os.path.join(ctx.base_dir, os.path.expanduser(pattern))
    matches = [os.path.abspath(m) for m in glob.glob(full, recursive=True)]
    files = [m for m in matches if os.path.isfile(m)]
    if not files:
        if os.path.isabs(os.path.expanduser(pattern)):
            relative = ""
        else:
            origin = "the config file's directory" if ctx.from_file else "base_dir or the cwd"
            relative = f" in directory {ctx.base_dir!r} ({origin})"
        extra = f" ({len(matches)} directories matched, but no files)" if matches else ""
        raise ConfigError(where, f"glob {pattern!r} matches no file{relative}{extra}; searched {full!r}")
    return files


def escape_globs(paths: tuple[str, ...]) -> list[str]:
    """Paths as globs that match just themselves, so that they load back as themselves."""
    return [glob.escape(p) if isinstance(p, str) and glob.has_magic(p) else p for p in paths]


def source_callable(raw: Any, path: str, ctx: Context) -> str:
    """``"module:function"`` of a user source, checked to resolve to a callable."""
    if not isinstance(raw, str):
        raise ConfigError(path, f"expected a 'module:function' string, got {describe(raw)}")
    check_no_arguments(resolve_callable(raw, path), path, raw)
    return raw


def memory_data(raw: Any, path: str, ctx: Context) -> dict[str, Any]:
    """A dict of equal-length arrays or lists (dict configs only), kept as given."""
    if ctx.from_file:
        raise ConfigError(
            path,
            "a memory source holds Python arrays and can only be given in a dict config, not in a "
            "file; use kind 'array_record', 'parquet', 'range' or 'callable' in files",
        )
    if isinstance(raw, Mapping) and "__memory_summary__" in raw:
        raise ConfigError(
            path,
            "this is the summary PipelineConfig.to_dict() writes in place of the "
            "arrays; pass the arrays themselves (a dict of equal-length arrays/lists)",
        )
    if not isinstance(raw, Mapping) or not raw:
        raise ConfigError(
            path,
            f"expected a non-empty dict of field name -> equal-length numpy array or "
            f"list, got {describe(raw)}",
        )
    length: int | None = None
    first = ""
    for name, value in raw.items():
        n = _num_records(name, value, path)
        if length is None:
            length, first = n, name
        elif n != length:
            raise ConfigError(
                f"{path}.{name}",
                f"has {n} records but field {first!r} has {length}; all fields of a "
                "memory source must have the same length",
            )
    if length == 0:
        raise ConfigError(path, "the memory source has no records")
    return dict(raw)


def _num_records(name: Any, value: Any, path: str) -> int:
    where = f"{path}.{name}"
    if not isinstance(name, str) or not name:
        raise ConfigError(f"{path}[{name!r}]", "field names must be non-empty strings")
    if isinstance(value, np.ndarray):
        if value.ndim == 0:
            raise ConfigError(where, "expected an array with a leading record dimension, got a 0-d array")
        return int(value.shape[0])
    if isinstance(value, list | tuple):
        return len(value)
    raise ConfigError(where, f"expected a numpy array or a list, got {describe(value)}")


def memory_summary(data: Any) -> dict[str, Any]:
    """What to_dict writes for in-memory arrays: enough to log, not the data."""
    summary: dict[str, Any] = {}
    if isinstance(data, Mapping):
        for name, value in data.items():
            if isinstance(value, np.ndarray):
                summary[str(name)] = {"shape": list(value.shape), "dtype": value.dtype.name}
            else:
                summary[str(name)] = {"length": len(value), "type": type(value).__name__}
    return {"__memory_summary__": summary}


def data_equal(a: Any, b: Any) -> bool:
    """Equality of memory-source data by value (arrays with `np.array_equal`)."""
    if a is b:
        return True
    if isinstance(a, Mapping) and isinstance(b, Mapping):
        if list(a) != list(b):
            return False
        return all(data_equal(a[k], b[k]) for k in a)
    if isinstance(a, np.ndarray) or isinstance(b, np.ndarray):
        try:
            return bool(np.array_equal(np.asarray(a), np.asarray(b)))
        except Exception:  # noqa: BLE001 - incomparable means unequal
            return False
    try:
        return bool(a == b)
    except Exception:  # noqa: BLE001
        return False
