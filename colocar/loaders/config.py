"""Pipeline configuration: plain, JSON-able data, validated entirely before anything starts.

A pipeline config is a YAML, TOML or JSON file, a dict, or a `PipelineConfig`. `load_config` turns
any of them into a frozen `PipelineConfig` and rejects every mistake it can see up front: unknown
keys (with the closest valid key), wrong types, missing required keys, globs that match no file,
callables that cannot be imported, contradictory settings. Every error is a `ConfigError` whose
message starts with ``pipeline config: <key.path>: `` (e.g. ``transforms[2].fn``), then says what
was expected, what was found and what to do.

Each option is declared once, as a field of the dataclasses below (name, type, default and an
`option(...)` for what the type cannot say); `schema.py` derives the parser and `to_dict` from
them. Like a tensorstore spec, a loaded config is data: `PipelineConfig.to_dict()` is
JSON-serializable (log it, diff it, store it next to a checkpoint) and `load_config(cfg.to_dict())`
gives back an equal config for file-based sources. Transforms and user sources are named
``module:function``; the controller imports them here to check them, and the sidecars, which run
with the same `sys.path`, import them again. Dict configs may also pass Python callables directly
(they are shipped with the pipeline) and in-memory arrays (source kind ``memory``).

This module runs in the controller and imports no JAX.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from dataclasses import fields
from typing import Any

from .callables import callable_name, check_arity, resolve_callable
from .checks import ConfigError, check_int, choices, describe, dtype_name
from .config_files import read_file
from .orders import DEFAULT as DEFAULT_ORDER
from .orders import ORDERS
from .schema import Context, Node, config_class, option, parse_node
from .source_options import (
    data_equal,
    escape_globs,
    memory_data,
    memory_summary,
    source_callable,
    source_paths,
)

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


@config_class
class SourceConfig(Node):
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

    EXPECTED = f"a mapping with a 'kind' (one of {choices(SOURCE_KINDS)})"

    kind: str = option(choices=SOURCE_KINDS, tag="source")
    paths: tuple[str, ...] = option(
        default=(),
        kinds=("array_record", "parquet"),
        required=True,
        doc="a glob string or a list of globs",
        parse=source_paths,
        dump=escape_globs,
    )
    n: int | None = option(
        default=None,
        kinds=("range",),
        required=True,
        minimum=1,
        doc="the number of records as a positive int",
    )
    columns: tuple[str, ...] | None = option(
        default=None, kinds=("parquet",), doc="a list of column names or null"
    )
    callable: str | None = option(
        default=None,
        kinds=("callable",),
        required=True,
        doc="'module:function' returning a random-access source (len() and __getitem__)",
        parse=source_callable,
    )
    data: Any = option(
        default=None,
        compare=False,
        kinds=("memory",),
        required=True,
        doc="a dict of equal-length arrays",
        parse=memory_data,
        dump=memory_summary,
        opaque=True,
    )

    def _key(self) -> tuple[Any, ...]:
        return tuple(getattr(self, f.name) for f in fields(self) if f.compare)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, SourceConfig):
            return NotImplemented
        return self._key() == other._key() and data_equal(self.data, other.data)

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


def _transform_fn(raw: Any, path: str, ctx: Context) -> str | Callable[..., Any]:
    """A transform's ``"module:function"`` (or, in dict configs, a Python callable); resolved and
    checked against its kind by `TransformConfig._check`."""
    if not isinstance(raw, str) and (ctx.from_file or not callable(raw)):
        raise ConfigError(
            path,
            f"expected a 'module:function' string{'' if ctx.from_file else ' or a Python callable'}, "
            f"got {describe(raw)}",
        )
    return raw  # type: ignore[no-any-return]


@config_class
class TransformConfig(Node):
    """One per-record transform, applied in order.

    kind ``map``: ``fn(record) -> record``; ``random_map``: ``fn(record, rng) -> record`` where
    ``rng`` is a `np.random.Generator` seeded from (seed, record index); ``filter``:
    ``fn(record) -> bool`` (False drops the record). `fn` is ``"module:function"`` or, in dict
    configs, a Python callable.
    """

    EXPECTED = f"a mapping with 'kind' (one of {choices(TRANSFORM_KINDS)}) and 'fn'"

    kind: str = option(choices=TRANSFORM_KINDS)
    fn: str | Callable[..., Any] = option(
        doc="'module:function'", parse=_transform_fn, dump=callable_name, opaque=True
    )

    def _check(self, given: Mapping[str, Any], path: str) -> None:
        """The function must resolve, and take the arguments its kind passes."""
        where = f"{path}.fn"
        check_arity(resolve_callable(self.fn, where), self.kind, where, self.fn)


@config_class
class FieldSpec(Node):
    """Shape and dtype of one field of a record (without the batch dimension)."""

    EXPECTED = "a mapping with 'shape' (a list of ints) and 'dtype' (e.g. 'float32')"

    shape: tuple[int, ...] = option(minimum=0, doc="a list of ints ([] for a scalar)")
    dtype: str = option(doc="a dtype name like 'float32'", check=dtype_name)


def _num_epochs(raw: Any, path: str, ctx: Context) -> int | None:
    if raw is None or raw == FOREVER:
        return None
    if isinstance(raw, str):
        raise ConfigError(path, f"expected a positive int, null or {FOREVER!r}, got {raw!r}")
    return check_int(raw, path, minimum=1, why=f"use null or {FOREVER!r} to repeat forever")


def _batch_axes(axes: tuple[str, ...] | None, path: str) -> tuple[str, ...] | None:
    if axes is not None and not axes:
        raise ConfigError(path, "expected at least one mesh axis; use null to shard over all axes")
    if axes is not None and len(set(axes)) != len(axes):
        raise ConfigError(path, f"an axis is named twice in {list(axes)}")
    return axes


def _element_spec(spec: dict[str, FieldSpec] | None, path: str) -> dict[str, FieldSpec] | None:
    if spec is not None and not spec:
        raise ConfigError(path, "expected at least one field; leave it out (or null) to not check")
    return spec


@config_class
class PipelineConfig(Node):
    """A validated pipeline config. Build it with `load_config`; see docs/pipelines.md for the schema."""

    EXPECTED = "a mapping of pipeline settings (source, global_batch_size, ...)"

    source: SourceConfig = option()
    global_batch_size: int = option(minimum=1)
    transforms: tuple[TransformConfig, ...] = option(
        default=(), doc="a list of {kind, fn} mappings", before=lambda raw: () if raw is None else raw
    )
    seed: int = option(default=0, minimum=0)
    shuffle: bool = True
    shuffle_order: str = option(default=DEFAULT_ORDER, choices=ORDERS)
    num_epochs: int | None = option(default=1, parse=_num_epochs)
    drop_remainder: bool = True
    eval: bool = False
    workers_per_host: int = option(default=1, minimum=1)
    prefetch: int = option(
        default=4, minimum=2, why="the ring needs one slot being filled while another is read"
    )
    batch_axes: tuple[str, ...] | None = option(
        default=None,
        doc="a mesh axis name, a list of mesh axis names, or null (all axes)",
        before=lambda raw: [raw] if isinstance(raw, str) else raw,
        check=_batch_axes,
    )
    element_spec: dict[str, FieldSpec] | None = option(
        default=None, doc="a mapping of field name -> {shape, dtype}", check=_element_spec
    )
    skip_bad_records: bool = False

    def _check(self, given: Mapping[str, Any], path: str) -> None:
        """eval pads the last batch: it needs drop_remainder off and a last batch to pad."""
        if self.eval and self.drop_remainder:
            raise ConfigError(
                "drop_remainder" if "drop_remainder" in given else "eval",
                "eval: true pads the last batch and returns a 'mask' field, which contradicts "
                "drop_remainder: true (the default); set drop_remainder: false",
            )
        if self.eval and self.num_epochs is None:
            raise ConfigError(
                "eval",
                "eval: true pads the last batch, but num_epochs is null/forever so there is no last "
                "batch; set num_epochs to a number (usually 1)",
            )


def load_config(
    config: str | os.PathLike[str] | Mapping[str, Any] | PipelineConfig, *, base_dir: str | None = None
) -> PipelineConfig:
    """Read and validate a pipeline config.

    `config` is a path to a ``.yaml`` / ``.yml``, ``.toml`` or ``.json`` file (relative globs are
    resolved against the file's directory), a dict (relative globs against `base_dir`, default
    the current directory), or a `PipelineConfig` (validated again and returned as a new one).
    Raises `ConfigError` naming the key path of the first problem found.
    """
    if isinstance(config, PipelineConfig | Mapping):
        base = os.path.abspath(base_dir if base_dir is not None else os.getcwd())
        return parse_node(PipelineConfig, config, "", Context(base, from_file=False))
    if isinstance(config, str | os.PathLike):
        path = os.path.abspath(os.fspath(config))
        raw = read_file(path)
        try:
            return parse_node(PipelineConfig, raw, "", Context(os.path.dirname(path), from_file=True))
        except ConfigError as e:
            raise ConfigError(e.path, f"{e.detail} (in {path})") from None
    raise ConfigError(
        "(top level)",
        f"expected a file path, a dict or a PipelineConfig, got {describe(config)}",
    )
