"""`ConfigError` and the value checks a pipeline config is made of.

Each check takes the raw value and its key path (like ``transforms[2].fn``) and either returns the
value in its checked form or raises a `ConfigError` that names the path, what was expected, what
was found and, where a close match exists, "did you mean ...". The schema (`schema.py`) picks the
check of each option from its type; the options that need more (globs, dtypes, callables) call
these from their own parsers. No JAX here.
"""

from __future__ import annotations

import difflib
import functools
import numbers
from collections.abc import Iterable, Mapping
from typing import Any

import numpy as np


class ConfigError(ValueError):
    """A pipeline config is invalid. The message names the key path and what was expected."""

    def __init__(self, path: str, message: str):
        super().__init__(f"pipeline config: {path}: {message}")
        self.path = path
        self.detail = message


def join(path: str, key: Any) -> str:
    """The key path of `key` inside the mapping at `path` ("" is the top level)."""
    return f"{path}.{key}" if path else str(key)


def describe(value: Any) -> str:
    """A short "type repr" of a found value for error messages (null for None)."""
    if value is None:
        return "null"
    text = repr(value)
    if len(text) > 60:
        text = text[:57] + "..."
    return f"{type(value).__name__} {text}"


def choices(options: Iterable[str]) -> str:
    return ", ".join(repr(o) for o in options)


def suggest(word: str, options: Iterable[str]) -> str:
    """``"; did you mean 'x'?"`` for the closest of `options`, or "" when none is close."""
    close = difflib.get_close_matches(word, list(options), n=1, cutoff=0.6)
    return f"; did you mean {close[0]!r}?" if close else ""


def mapping(raw: Any, path: str, expected: str) -> Mapping[Any, Any]:
    if not isinstance(raw, Mapping):
        raise ConfigError(path, f"expected {expected}, got {describe(raw)}")
    return raw


def check_keys(raw: Mapping[Any, Any], valid: tuple[str, ...], path: str) -> None:
    """Reject the first key not in `valid`, suggesting the closest valid one (or listing them)."""
    for key in raw:
        if key not in valid:
            hint = suggest(str(key), valid) or f"; valid keys: {', '.join(valid)}"
            raise ConfigError(join(path, key), f"unknown key{hint}")


def int_phrase(minimum: int | None) -> str:
    """How an int with this lower bound is described: 'a positive int', 'an int >= 2', ..."""
    if minimum is None:
        return "an int"
    if minimum == 1:
        return "a positive int"
    if minimum == 0:
        return "a non-negative int"
    return f"an int >= {minimum}"


def check_int(raw: Any, path: str, *, minimum: int | None, why: str = "") -> int:
    if isinstance(raw, bool) or not isinstance(raw, numbers.Integral):
        raise ConfigError(path, f"expected an int, got {describe(raw)}")
    value = int(raw)
    if minimum is not None and value < minimum:
        raise ConfigError(path, f"expected {int_phrase(minimum)}, got {value}" + (f"; {why}" if why else ""))
    return value


def check_bool(raw: Any, path: str) -> bool:
    if not isinstance(raw, bool | np.bool_):
        raise ConfigError(path, f"expected true or false, got {describe(raw)}")
    return bool(raw)


def check_choice(raw: Any, path: str, options: tuple[str, ...]) -> str:
    if not isinstance(raw, str):
        raise ConfigError(path, f"expected one of {choices(options)}, got {describe(raw)}")
    if raw not in options:
        raise ConfigError(path, f"expected one of {choices(options)}, got {raw!r}{suggest(raw, options)}")
    return raw


def check_str(raw: Any, path: str, expected: str | None) -> str:
    """A non-empty string; `expected` (if given) says what it names, in the error message."""
    if not isinstance(raw, str) or not raw:
        raise ConfigError(path, f"expected {expected or 'a non-empty string'}, got {describe(raw)}")
    return raw


def dtype_name(raw: str, path: str) -> str:
    """The canonical name of a numpy or ml_dtypes dtype that a device array can have."""
    dtype: np.dtype[Any] | None = None
    try:
        dtype = np.dtype(raw)
    except TypeError:
        try:
            import ml_dtypes

            candidate = getattr(ml_dtypes, raw, None)
            if isinstance(candidate, type):
                dtype = np.dtype(candidate)
        except (ImportError, TypeError):
            pass
    ml_names = _ml_dtype_names()
    if dtype is None:
        raise ConfigError(
            path,
            f"unknown dtype {raw!r}; expected a numpy or ml_dtypes name like 'uint8', "
            f"'int32', 'float32' or 'bfloat16'{suggest(raw, (*_NUMPY_NAMES, *ml_names))}",
        )
    if dtype.kind not in "biufc" and dtype.name not in ml_names:
        raise ConfigError(
            path,
            f"dtype {raw!r} ({dtype.name}) cannot be a device array; expected a bool, "
            "integer, floating or complex dtype",
        )
    return dtype.name


_NUMPY_NAMES = (
    *("bool", "int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64"),
    *("float16", "float32", "float64", "complex64", "complex128"),
)


@functools.cache
def _ml_dtype_names() -> tuple[str, ...]:
    try:
        import ml_dtypes
    except ImportError:
        return ()
    names = []
    for name in dir(ml_dtypes):
        obj = getattr(ml_dtypes, name)
        if not name.startswith("_") and isinstance(obj, type):
            try:
                dtype = np.dtype(obj)
            except TypeError:
                continue
            if dtype.kind != "O":  # np.dtype(any class) is object; keep the real dtypes only
                names.append(dtype.name)
    return tuple(names)
