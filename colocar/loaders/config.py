"""Pipeline configuration: plain, JSON-able data, validated entirely before anything starts.

A pipeline config is a YAML, TOML or JSON file, a dict, or a `PipelineConfig`. `load_config` turns
any of them into a frozen `PipelineConfig` and rejects every mistake it can see up front: unknown
keys (with the closest valid key), wrong types, missing required keys, globs that match no file,
callables that cannot be imported, contradictory settings. Every error is a `ConfigError` whose
message starts with ``pipeline config: <key.path>: `` (e.g. ``transforms[2].fn``), then says what
was expected, what was found and what to do.

Like a tensorstore spec, a loaded config is data: `PipelineConfig.to_dict()` is JSON-serializable
(log it, diff it, store it next to a checkpoint) and `load_config(cfg.to_dict())` gives back an
equal config for file-based sources. Transforms and user sources are named ``module:function``;
the controller imports them here to check them, and the sidecars, which run with the same
`sys.path`, import them again. Dict configs may also pass Python callables directly (they are
shipped with the pipeline) and in-memory arrays (source kind ``memory``).

This module runs in the controller and imports no JAX.
"""

from __future__ import annotations

import builtins
import difflib
import functools
import glob
import importlib
import inspect
import json
import numbers
import os
import tomllib
from collections.abc import Callable, Mapping
from dataclasses import dataclass, fields, is_dataclass
from typing import Any

import numpy as np
import yaml

__all__ = [
    "ConfigError",
    "FieldSpec",
    "PipelineConfig",
    "SourceConfig",
    "TransformConfig",
    "load_config",
    "resolve_callable",
]

SOURCE_KINDS = ("array_record", "parquet", "range", "memory", "callable")
TRANSFORM_KINDS = ("map", "random_map", "filter")
FOREVER = "forever"  # `num_epochs: forever` is the same as null (TOML has no null)

_TOP_KEYS = (
    "source",
    "global_batch_size",
    "transforms",
    "seed",
    "shuffle",
    "num_epochs",
    "drop_remainder",
    "eval",
    "workers_per_host",
    "prefetch",
    "batch_axes",
    "element_spec",
    "skip_bad_records",
)
# The keys each source kind takes, besides `kind`; the first ones listed are required.
_SOURCE_KEYS: dict[str, tuple[str, ...]] = {
    "array_record": ("paths",),
    "parquet": ("paths", "columns"),
    "range": ("n",),
    "memory": ("data",),
    "callable": ("callable",),
}
_SOURCE_REQUIRED = {
    "array_record": "paths",
    "parquet": "paths",
    "range": "n",
    "memory": "data",
    "callable": "callable",
}
_ALL_SOURCE_KEYS = ("kind", "paths", "n", "columns", "callable", "data")
_TRANSFORM_KEYS = ("kind", "fn")
_FIELD_KEYS = ("shape", "dtype")


class ConfigError(ValueError):
    """A pipeline config is invalid. The message names the key path and what was expected."""

    def __init__(self, path: str, message: str):
        super().__init__(f"pipeline config: {path}: {message}")
        self.path = path
        self.detail = message


# --------------------------------------------------------------------------------------------
# The dataclasses
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True, eq=False)
class SourceConfig:
    """Where records come from. Only the fields of `kind` are set; the others keep their default.

    - ``array_record`` / ``parquet``: `paths`, the resolved, sorted, absolute paths matched by the
      glob(s) of the config; parquet also `columns` (None: all columns).
    - ``range``: `n` records; record ``i`` is ``{"index": i}``.
    - ``memory``: `data`, a dict of equal-length numpy arrays or lists (dict configs only); record
      ``i`` is ``{k: v[i]}``. `to_dict` replaces it with a summary.
    - ``callable``: `callable`, ``"module:function"`` returning a random-access source (an object
      with ``len()`` and ``__getitem__``).

    Equality compares `data` by value (arrays with `np.array_equal`); hashing ignores `data`.
    """

    kind: str
    paths: tuple[str, ...] = ()
    n: int | None = None
    columns: tuple[str, ...] | None = None
    callable: str | None = None
    data: Any = None

    def _key(self) -> tuple[Any, ...]:
        return (self.kind, self.paths, self.n, self.columns, self.callable)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, SourceConfig):
            return NotImplemented
        return self._key() == other._key() and _data_equal(self.data, other.data)

    def __hash__(self) -> int:
        return hash(self._key())

    @property
    def num_records(self) -> int | None:
        """The number of records where the config alone knows it (range, memory), else None."""
        if self.kind == "range":
            return self.n
        if self.kind == "memory" and isinstance(self.data, Mapping) and self.data:
            return len(next(iter(self.data.values())))
        return None

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"kind": self.kind}
        if self.kind in ("array_record", "parquet"):
            # Escape paths that glob would read as patterns, so that they load back as themselves.
            out["paths"] = [glob.escape(p) if glob.has_magic(p) else p for p in self.paths]
        if self.kind == "parquet":
            out["columns"] = None if self.columns is None else list(self.columns)
        if self.kind == "range":
            out["n"] = self.n
        if self.kind == "callable":
            out["callable"] = self.callable
        if self.kind == "memory":
            out["data"] = _memory_summary(self.data)
        return out


@dataclass(frozen=True)
class TransformConfig:
    """One per-record transform, applied in order.

    kind ``map``: ``fn(record) -> record``; ``random_map``: ``fn(record, rng) -> record`` where
    ``rng`` is a `np.random.Generator` seeded from (seed, record index); ``filter``:
    ``fn(record) -> bool`` (False drops the record). `fn` is ``"module:function"`` or, in dict
    configs, a Python callable.
    """

    kind: str
    fn: str | Callable[..., Any]

    def to_dict(self) -> dict[str, Any]:
        return {"kind": self.kind, "fn": callable_name(self.fn)}


@dataclass(frozen=True)
class FieldSpec:
    """Shape and dtype of one field of a record (without the batch dimension)."""

    shape: tuple[int, ...]
    dtype: str

    def to_dict(self) -> dict[str, Any]:
        return {"shape": list(self.shape), "dtype": self.dtype}


@dataclass(frozen=True)
class PipelineConfig:
    """A validated pipeline config. Build it with `load_config`; see the README for the schema."""

    source: SourceConfig
    global_batch_size: int
    transforms: tuple[TransformConfig, ...] = ()
    seed: int = 0
    shuffle: bool = True
    num_epochs: int | None = 1
    drop_remainder: bool = True
    eval: bool = False
    workers_per_host: int = 1
    prefetch: int = 4
    batch_axes: tuple[str, ...] | None = None
    element_spec: dict[str, FieldSpec] | None = None
    skip_bad_records: bool = False

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON-able data: `json.dumps` works, and `load_config` reads it back."""
        return {
            "source": self.source.to_dict(),
            "global_batch_size": self.global_batch_size,
            "transforms": [t.to_dict() for t in self.transforms],
            "seed": self.seed,
            "shuffle": self.shuffle,
            "num_epochs": self.num_epochs,
            "drop_remainder": self.drop_remainder,
            "eval": self.eval,
            "workers_per_host": self.workers_per_host,
            "prefetch": self.prefetch,
            "batch_axes": None if self.batch_axes is None else list(self.batch_axes),
            "element_spec": None
            if self.element_spec is None
            else {name: spec.to_dict() for name, spec in self.element_spec.items()},
            "skip_bad_records": self.skip_bad_records,
        }


# --------------------------------------------------------------------------------------------
# Public functions
# --------------------------------------------------------------------------------------------


def load_config(
    config: str | os.PathLike[str] | Mapping[str, Any] | PipelineConfig, *, base_dir: str | None = None
) -> PipelineConfig:
    """Read and validate a pipeline config.

    `config` is a path to a ``.yaml`` / ``.yml``, ``.toml`` or ``.json`` file (relative globs are
    resolved against the file's directory), a dict (relative globs against `base_dir`, default
    the current directory), or a `PipelineConfig` (validated again and returned as a new one).
    Raises `ConfigError` naming the key path of the first problem found.
    """
    if isinstance(config, PipelineConfig):
        raw = _raw(config)
        return _Parser(_base(base_dir), from_file=False).pipeline(raw)
    if isinstance(config, str | os.PathLike):
        path = os.path.abspath(os.fspath(config))
        raw = _read_file(path)
        where = f" (in {path})"
        try:
            return _Parser(os.path.dirname(path), from_file=True).pipeline(raw)
        except ConfigError as e:
            raise ConfigError(e.path, e.detail + where) from None
    if isinstance(config, Mapping):
        return _Parser(_base(base_dir), from_file=False).pipeline(_raw(config))
    raise ConfigError(
        "(top level)",
        f"expected a file path, a dict or a PipelineConfig, got {_describe(config)}",
    )


def resolve_callable(spec: str | Callable[..., Any], where: str) -> Callable[..., Any]:
    """Resolve ``"module:function"`` (a dotted attribute path may follow the colon) to the object.

    A Python callable is returned as it is. Raises `ConfigError` naming `where` (the key path) if
    the module cannot be imported, the attribute is missing or the object is not callable.
    """
    if not isinstance(spec, str):
        if builtins.callable(spec):
            return spec
        raise ConfigError(where, f"expected 'module:function' or a Python callable, got {_describe(spec)}")
    module_name, sep, attr_path = spec.partition(":")
    module_name, attr_path = module_name.strip(), attr_path.strip()
    if not sep or not module_name or not attr_path:
        raise ConfigError(
            where,
            f"expected 'module:function' (e.g. 'my_transforms:decode'), got {spec!r}",
        )
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as e:
        if e.name is not None and (module_name == e.name or module_name.startswith(e.name + ".")):
            raise ConfigError(
                where,
                f"cannot import module {module_name!r} of {spec!r}: no module named {e.name!r}; the "
                "module must be importable by the controller (installed, or its directory on sys.path "
                "/ PYTHONPATH); the sidecars get the same sys.path",
            ) from None
        raise ConfigError(where, f"importing module {module_name!r} of {spec!r} failed: {e!r}") from None
    except Exception as e:  # noqa: BLE001 - any import-time failure of user code is a config error
        raise ConfigError(where, f"importing module {module_name!r} of {spec!r} failed: {e!r}") from None
    obj: Any = module
    done = module_name
    for part in attr_path.split("."):
        if not hasattr(obj, part):
            names = [n for n in dir(obj) if not n.startswith("_")]
            raise ConfigError(
                where,
                f"{done!r} has no attribute {part!r} (resolving {spec!r}){_suggest(part, names)}",
            )
        obj = getattr(obj, part)
        done = f"{done}:{part}" if done == module_name else f"{done}.{part}"
    if not builtins.callable(obj):
        raise ConfigError(where, f"{spec!r} is not callable (it is {_describe(obj)})")
    return obj  # type: ignore[no-any-return]


def callable_name(fn: str | Callable[..., Any]) -> str:
    """``"module:qualname"`` of `fn` if importing that name gives `fn` back, else a description.

    The description (``"<python callable ...>"``) is for logs; it does not load back.
    """
    if isinstance(fn, str):
        return fn
    module = getattr(fn, "__module__", None)
    qualname = getattr(fn, "__qualname__", None)
    if isinstance(module, str) and isinstance(qualname, str) and "<" not in qualname:
        name = f"{module}:{qualname}"
        try:
            if resolve_callable(name, "") is fn:
                return name
        except ConfigError:
            pass
    return f"<python callable {module}.{qualname if qualname is not None else repr(fn)}>"


# --------------------------------------------------------------------------------------------
# Parsing
# --------------------------------------------------------------------------------------------


def _base(base_dir: str | None) -> str:
    return os.path.abspath(base_dir if base_dir is not None else os.getcwd())


def _read_file(path: str) -> Any:
    ext = os.path.splitext(path)[1].lower()
    if ext not in (".yaml", ".yml", ".toml", ".json"):
        raise ConfigError(
            "(top level)",
            f"cannot tell the format of {path!r}: expected a .yaml, .yml, .toml or .json file",
        )
    try:
        with open(path, "rb") as f:
            data = f.read()
    except FileNotFoundError:
        raise ConfigError("(top level)", f"config file {path!r} does not exist") from None
    except OSError as e:
        raise ConfigError("(top level)", f"cannot read config file {path!r}: {e}") from None
    try:
        if ext == ".toml":
            return tomllib.loads(data.decode("utf-8"))
        if ext == ".json":
            return json.loads(data, object_pairs_hook=_no_duplicate_pairs)
        return yaml.load(data, Loader=_StrictLoader)  # noqa: S506 - a SafeLoader subclass
    except ConfigError as e:
        raise ConfigError(e.path, f"{e.detail} (in {path})") from None
    except (ValueError, yaml.YAMLError, UnicodeDecodeError) as e:
        raise ConfigError("(top level)", f"cannot parse {path!r}: {e}") from None


def _no_duplicate_pairs(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in pairs:
        if k in out:
            raise ConfigError(str(k), "the key appears twice in the same object; keep one")
        out[k] = v
    return out


class _StrictLoader(yaml.SafeLoader):
    """A SafeLoader that rejects a key given twice in one mapping (plain YAML keeps the last)."""


def _construct_mapping(loader: yaml.SafeLoader, node: yaml.MappingNode, deep: bool = False) -> Any:
    loader.flatten_mapping(node)
    seen: set[Any] = set()
    for key_node, _ in node.value:
        key = loader.construct_object(key_node, deep=True)  # type: ignore[no-untyped-call]
        if not isinstance(key, str | int | float | bool):
            continue  # unhashable keys: the config check rejects them with a path
        if key in seen:
            raise ConfigError(
                str(key),
                f"the key appears twice in the same mapping (line {key_node.start_mark.line + 1}); keep one",
            )
        seen.add(key)
    return loader.construct_mapping(node, deep=deep)


_StrictLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _construct_mapping)


def _raw(obj: Any) -> Any:
    """Config dataclasses (anywhere in a config) to plain dicts and tuples to lists, leaving the
    arrays of a memory source and Python callables as they are."""
    if isinstance(obj, SourceConfig):
        # Only the fields that are set, so that a stray field of another kind is still reported.
        out: dict[str, Any] = {"kind": obj.kind}
        required = _SOURCE_REQUIRED.get(obj.kind)
        for f in fields(obj):
            value = getattr(obj, f.name)
            if f.name == "kind" or (f.name != required and (value is None or value == ())):
                continue
            if f.name == "paths" and isinstance(value, tuple | list):
                value = [glob.escape(p) if isinstance(p, str) and glob.has_magic(p) else p for p in value]
            out[f.name] = value if f.name == "data" else _raw(value)
        return out
    if is_dataclass(obj) and not isinstance(obj, type):
        return {f.name: _raw(getattr(obj, f.name)) for f in fields(obj)}
    if isinstance(obj, Mapping):
        is_source = "kind" in obj and "data" in obj
        return {k: (v if is_source and k == "data" else _raw(v)) for k, v in obj.items()}
    if isinstance(obj, tuple | list):
        return [_raw(v) for v in obj]
    return obj


class _Parser:
    def __init__(self, base_dir: str, *, from_file: bool):
        self.base_dir = base_dir
        self.from_file = from_file

    # ---- the top level ----

    def pipeline(self, raw: Any) -> PipelineConfig:
        top = _mapping(raw, "(top level)", "a mapping of pipeline settings (source, global_batch_size, ...)")
        _check_keys(top, _TOP_KEYS, "")
        for key in ("source", "global_batch_size"):
            if key not in top:
                what = "a mapping with a 'kind'" if key == "source" else "a positive int"
                raise ConfigError(key, f"required key is missing; expected {what}")

        source = self.source(top["source"], "source")
        batch = _int(top["global_batch_size"], "global_batch_size", minimum=1)
        transforms = self.transforms(top.get("transforms", []), "transforms")
        seed = _int(top.get("seed", 0), "seed", minimum=0)
        shuffle = _bool(top.get("shuffle", True), "shuffle")
        num_epochs = self.num_epochs(top.get("num_epochs", 1))
        drop_remainder = _bool(top.get("drop_remainder", True), "drop_remainder")
        is_eval = _bool(top.get("eval", False), "eval")
        workers = _int(top.get("workers_per_host", 1), "workers_per_host", minimum=1)
        prefetch = _int(
            top.get("prefetch", 4),
            "prefetch",
            minimum=2,
            why="the ring needs one slot being filled while another is read",
        )
        batch_axes = self.batch_axes(top.get("batch_axes"))
        element_spec = self.element_spec(top.get("element_spec"))
        skip_bad = _bool(top.get("skip_bad_records", False), "skip_bad_records")

        if is_eval and drop_remainder:
            where = "drop_remainder" if "drop_remainder" in top else "eval"
            raise ConfigError(
                where,
                "eval: true pads the last batch and returns a 'mask' field, which contradicts "
                "drop_remainder: true (the default); set drop_remainder: false",
            )
        if is_eval and num_epochs is None:
            raise ConfigError(
                "eval",
                "eval: true pads the last batch, but num_epochs is null/forever so there is no last "
                "batch; set num_epochs to a number (usually 1)",
            )
        return PipelineConfig(
            source=source,
            global_batch_size=batch,
            transforms=transforms,
            seed=seed,
            shuffle=shuffle,
            num_epochs=num_epochs,
            drop_remainder=drop_remainder,
            eval=is_eval,
            workers_per_host=workers,
            prefetch=prefetch,
            batch_axes=batch_axes,
            element_spec=element_spec,
            skip_bad_records=skip_bad,
        )

    # ---- source ----

    def source(self, raw: Any, path: str) -> SourceConfig:
        src = _mapping(raw, path, f"a mapping with a 'kind' (one of {_choices(SOURCE_KINDS)})")
        _check_keys(src, _ALL_SOURCE_KEYS, path)
        if "kind" not in src:
            raise ConfigError(
                f"{path}.kind", f"required key is missing; expected one of {_choices(SOURCE_KINDS)}"
            )
        kind = _choice(src["kind"], f"{path}.kind", SOURCE_KINDS)
        allowed = _SOURCE_KEYS[kind]
        for key in src:
            if key != "kind" and key not in allowed:
                raise ConfigError(
                    f"{path}.{key}",
                    f"not a setting of source kind {kind!r}, which takes "
                    f"{', '.join(repr(k) for k in ('kind', *allowed))}",
                )
        required = _SOURCE_REQUIRED[kind]
        if required not in src or (src[required] is None and required != "data"):
            raise ConfigError(
                f"{path}.{required}", f"source kind {kind!r} requires {required!r}; {_SOURCE_HELP[required]}"
            )
        if kind in ("array_record", "parquet"):
            paths = self.paths(src["paths"], f"{path}.paths")
            columns = None
            if kind == "parquet" and src.get("columns") is not None:
                columns = _str_list(src["columns"], f"{path}.columns", "a list of column names or null")
            return SourceConfig(kind=kind, paths=paths, columns=columns)
        if kind == "range":
            return SourceConfig(kind=kind, n=_int(src["n"], f"{path}.n", minimum=1))
        if kind == "callable":
            spec = src["callable"]
            if not isinstance(spec, str):
                raise ConfigError(
                    f"{path}.callable", f"expected a 'module:function' string, got {_describe(spec)}"
                )
            resolve_callable(spec, f"{path}.callable")
            return SourceConfig(kind=kind, callable=spec)
        return SourceConfig(kind=kind, data=self.memory_data(src["data"], f"{path}.data"))

    def paths(self, raw: Any, path: str) -> tuple[str, ...]:
        if isinstance(raw, str):
            patterns, paths_of = [raw], [path]
        elif isinstance(raw, list) and raw and all(isinstance(p, str) for p in raw):
            patterns, paths_of = list(raw), [f"{path}[{i}]" for i in range(len(raw))]
        else:
            bad = (
                next((i for i, p in enumerate(raw) if not isinstance(p, str)), None)
                if isinstance(raw, list)
                else None
            )
            if bad is not None:
                raise ConfigError(f"{path}[{bad}]", f"expected a glob string, got {_describe(raw[bad])}")
            raise ConfigError(
                path, f"expected a glob string or a non-empty list of globs, got {_describe(raw)}"
            )
        found: set[str] = set()
        for pattern, where in zip(patterns, paths_of, strict=True):
            if not pattern.strip():
                raise ConfigError(where, "expected a glob, got an empty string")
            full = os.path.join(self.base_dir, os.path.expanduser(pattern))
            matches = [os.path.abspath(m) for m in glob.glob(full, recursive=True)]
            files = [m for m in matches if os.path.isfile(m)]
            if not files:
                if os.path.isabs(os.path.expanduser(pattern)):
                    relative = ""
                else:
                    origin = "the config file's directory" if self.from_file else "base_dir or the cwd"
                    relative = f" in directory {self.base_dir!r} ({origin})"
                extra = f" ({len(matches)} directories matched, but no files)" if matches else ""
                raise ConfigError(
                    where, f"glob {pattern!r} matches no file{relative}{extra}; searched {full!r}"
                )
            found.update(files)
        return tuple(sorted(found))

    def memory_data(self, raw: Any, path: str) -> dict[str, Any]:
        if self.from_file:
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
                f"list, got {_describe(raw)}",
            )
        length: int | None = None
        first = ""
        for name, value in raw.items():
            where = f"{path}.{name}"
            if not isinstance(name, str) or not name:
                raise ConfigError(f"{path}[{name!r}]", "field names must be non-empty strings")
            if isinstance(value, np.ndarray):
                if value.ndim == 0:
                    raise ConfigError(
                        where, "expected an array with a leading record dimension, got a 0-d array"
                    )
                n = value.shape[0]
            elif isinstance(value, list | tuple):
                n = len(value)
            else:
                raise ConfigError(where, f"expected a numpy array or a list, got {_describe(value)}")
            if length is None:
                length, first = n, name
            elif n != length:
                raise ConfigError(
                    where,
                    f"has {n} records but field {first!r} has {length}; all fields of a "
                    "memory source must have the same length",
                )
        if length == 0:
            raise ConfigError(path, "the memory source has no records")
        return dict(raw)

    # ---- transforms ----

    def transforms(self, raw: Any, path: str) -> tuple[TransformConfig, ...]:
        if raw is None:
            return ()
        if not isinstance(raw, list):
            raise ConfigError(path, f"expected a list of {{kind, fn}} mappings, got {_describe(raw)}")
        out = []
        for i, item in enumerate(raw):
            where = f"{path}[{i}]"
            t = _mapping(item, where, f"a mapping with 'kind' (one of {_choices(TRANSFORM_KINDS)}) and 'fn'")
            _check_keys(t, _TRANSFORM_KEYS, where)
            for key in _TRANSFORM_KEYS:
                if key not in t:
                    expected = _choices(TRANSFORM_KINDS) if key == "kind" else "'module:function'"
                    raise ConfigError(f"{where}.{key}", f"required key is missing; expected {expected}")
            kind = _choice(t["kind"], f"{where}.kind", TRANSFORM_KINDS)
            fn = t["fn"]
            if not isinstance(fn, str):
                if self.from_file or not builtins.callable(fn):
                    raise ConfigError(
                        f"{where}.fn",
                        f"expected a 'module:function' string"
                        f"{'' if self.from_file else ' or a Python callable'}, got {_describe(fn)}",
                    )
            obj = resolve_callable(fn, f"{where}.fn")
            _check_arity(obj, kind, f"{where}.fn", fn)
            out.append(TransformConfig(kind=kind, fn=fn))
        return tuple(out)

    # ---- the rest ----

    def num_epochs(self, raw: Any) -> int | None:
        if raw is None or raw == FOREVER:
            return None
        if isinstance(raw, str):
            raise ConfigError("num_epochs", f"expected a positive int, null or {FOREVER!r}, got {raw!r}")
        return _int(raw, "num_epochs", minimum=1, why=f"use null or {FOREVER!r} to repeat forever")

    def batch_axes(self, raw: Any) -> tuple[str, ...] | None:
        if raw is None:
            return None
        if isinstance(raw, str):
            raw = [raw]
        axes = _str_list(raw, "batch_axes", "a mesh axis name, a list of mesh axis names, or null (all axes)")
        if not axes:
            raise ConfigError(
                "batch_axes", "expected at least one mesh axis; use null to shard over all axes"
            )
        if len(set(axes)) != len(axes):
            raise ConfigError("batch_axes", f"an axis is named twice in {list(axes)}")
        return axes

    def element_spec(self, raw: Any) -> dict[str, FieldSpec] | None:
        if raw is None:
            return None
        spec = _mapping(raw, "element_spec", "a mapping of field name -> {shape, dtype}")
        if not spec:
            raise ConfigError(
                "element_spec", "expected at least one field; leave it out (or null) to not check"
            )
        out: dict[str, FieldSpec] = {}
        for name, value in spec.items():
            where = f"element_spec.{name}"
            if not isinstance(name, str) or not name:
                raise ConfigError(where, "field names must be non-empty strings")
            field = _mapping(
                value, where, "a mapping with 'shape' (a list of ints) and 'dtype' (e.g. 'float32')"
            )
            _check_keys(field, _FIELD_KEYS, where)
            for key in _FIELD_KEYS:
                if key not in field:
                    expected = (
                        "a list of ints, [] for a scalar" if key == "shape" else "a dtype name like 'int32'"
                    )
                    raise ConfigError(f"{where}.{key}", f"required key is missing; expected {expected}")
            shape_raw = field["shape"]
            if not isinstance(shape_raw, list):
                raise ConfigError(
                    f"{where}.shape", f"expected a list of ints ([] for a scalar), got {_describe(shape_raw)}"
                )
            shape = tuple(_int(d, f"{where}.shape[{i}]", minimum=0) for i, d in enumerate(shape_raw))
            out[name] = FieldSpec(shape=shape, dtype=_dtype_name(field["dtype"], f"{where}.dtype"))
        return out


_SOURCE_HELP = {
    "paths": "give a glob string or a list of globs",
    "n": "give the number of records as a positive int",
    "data": "give a dict of equal-length arrays",
    "callable": "give 'module:function' returning a random-access source (len() and __getitem__)",
}


# --------------------------------------------------------------------------------------------
# Small checks
# --------------------------------------------------------------------------------------------


def _describe(value: Any) -> str:
    if value is None:
        return "null"
    text = repr(value)
    if len(text) > 60:
        text = text[:57] + "..."
    return f"{type(value).__name__} {text}"


def _choices(options: tuple[str, ...]) -> str:
    return ", ".join(repr(o) for o in options)


def _suggest(word: str, options: Any) -> str:
    close = difflib.get_close_matches(word, list(options), n=1, cutoff=0.6)
    return f"; did you mean {close[0]!r}?" if close else ""


def _mapping(raw: Any, path: str, expected: str) -> Mapping[str, Any]:
    if not isinstance(raw, Mapping):
        raise ConfigError(path, f"expected {expected}, got {_describe(raw)}")
    return raw


def _check_keys(raw: Mapping[str, Any], valid: tuple[str, ...], path: str) -> None:
    for key in raw:
        if key not in valid:
            where = f"{path}.{key}" if path else str(key)
            hint = _suggest(str(key), valid) or f"; valid keys: {', '.join(valid)}"
            raise ConfigError(where, f"unknown key{hint}")


def _int(raw: Any, path: str, *, minimum: int, why: str = "") -> int:
    if isinstance(raw, bool) or not isinstance(raw, numbers.Integral):
        raise ConfigError(path, f"expected an int, got {_describe(raw)}")
    value = int(raw)
    if value < minimum:
        what = (
            "a positive int"
            if minimum == 1
            else "a non-negative int"
            if minimum == 0
            else f"an int >= {minimum}"
        )
        raise ConfigError(path, f"expected {what}, got {value}" + (f"; {why}" if why else ""))
    return value


def _bool(raw: Any, path: str) -> bool:
    if not isinstance(raw, bool | np.bool_):
        raise ConfigError(path, f"expected true or false, got {_describe(raw)}")
    return bool(raw)


def _choice(raw: Any, path: str, options: tuple[str, ...]) -> str:
    if not isinstance(raw, str):
        raise ConfigError(path, f"expected one of {_choices(options)}, got {_describe(raw)}")
    if raw not in options:
        hint = _suggest(raw, options)
        raise ConfigError(path, f"expected one of {_choices(options)}, got {raw!r}{hint}")
    return raw


def _str_list(raw: Any, path: str, expected: str) -> tuple[str, ...]:
    if not isinstance(raw, list):
        raise ConfigError(path, f"expected {expected}, got {_describe(raw)}")
    for i, item in enumerate(raw):
        if not isinstance(item, str) or not item:
            raise ConfigError(f"{path}[{i}]", f"expected a non-empty string, got {_describe(item)}")
    return tuple(raw)


def _dtype_name(raw: Any, path: str) -> str:
    if not isinstance(raw, str):
        raise ConfigError(path, f"expected a dtype name like 'float32', got {_describe(raw)}")
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
        hint = _suggest(raw, (*_NUMPY_NAMES, *ml_names))
        raise ConfigError(
            path,
            f"unknown dtype {raw!r}; expected a numpy or ml_dtypes name like 'uint8', "
            f"'int32', 'float32' or 'bfloat16'{hint}",
        )
    if dtype.kind not in "biufc" and dtype.name not in ml_names:
        raise ConfigError(
            path,
            f"dtype {raw!r} ({dtype.name}) cannot be a device array; expected a bool, "
            "integer, floating or complex dtype",
        )
    return dtype.name


_NUMPY_NAMES = (
    "bool",
    "int8",
    "int16",
    "int32",
    "int64",
    "uint8",
    "uint16",
    "uint32",
    "uint64",
    "float16",
    "float32",
    "float64",
    "complex64",
    "complex128",
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


def _check_arity(fn: Callable[..., Any], kind: str, path: str, spec: Any) -> None:
    """Catch a map given where a random_map is expected (and back) while we can still say so."""
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):
        return  # some builtins have no signature; the sidecar will find out
    args: tuple[None, ...] = (None, None) if kind == "random_map" else (None,)
    try:
        sig.bind(*args)
    except TypeError:
        call = "fn(record, rng)" if kind == "random_map" else "fn(record)"
        other = "'map' or 'filter'" if kind == "random_map" else "'random_map'"
        raise ConfigError(
            path,
            f"{callable_name(spec)} has signature {sig}, but kind {kind!r} calls it as {call}; "
            f"fix the signature or use kind {other}",
        ) from None


def _data_equal(a: Any, b: Any) -> bool:
    if a is b:
        return True
    if isinstance(a, Mapping) and isinstance(b, Mapping):
        if list(a) != list(b):
            return False
        return all(_data_equal(a[k], b[k]) for k in a)
    if isinstance(a, np.ndarray) or isinstance(b, np.ndarray):
        try:
            return bool(np.array_equal(np.asarray(a), np.asarray(b)))
        except Exception:  # noqa: BLE001 - incomparable means unequal
            return False
    try:
        return bool(a == b)
    except Exception:  # noqa: BLE001
        return False


def _memory_summary(data: Any) -> dict[str, Any]:
    """What to_dict writes for in-memory arrays: enough to log, not the data."""
    summary: dict[str, Any] = {}
    if isinstance(data, Mapping):
        for name, value in data.items():
            if isinstance(value, np.ndarray):
                summary[str(name)] = {"shape": list(value.shape), "dtype": value.dtype.name}
            else:
                summary[str(name)] = {"length": len(value), "type": type(value).__name__}
    return {"__memory_summary__": summary}
