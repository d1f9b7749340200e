"""The config schema, derived from the config dataclasses: each option is declared once.

An option is a dataclass field of a `@config_class`: its name, its type hint and its default say
what the key is called, what it holds and whether it is required; `option(...)` adds what the
type cannot say (a lower bound, the choices, a line of doc for error messages, a custom parser).
From that one declaration this module derives the three things a config needs:

- `parse_node`: plain data (a dict from YAML/TOML/JSON, possibly holding config objects) to a
  checked config object, with errors that name the key path and suggest the closest key;
- `to_data(node)`: the object back to plain JSON-able data (`to_dict`), and
  `to_data(node, keep=True)`: the same with Python objects kept, to check an object again.

A class may be a tagged union: its `tag` option (``kind``) picks which of the other options apply
(each names its `kinds`). No JAX here.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from collections.abc import Callable, Mapping
from dataclasses import MISSING, dataclass, field
from typing import Any, ClassVar, TypeVar, dataclass_transform

from .checks import (
    ConfigError,
    check_bool,
    check_choice,
    check_int,
    check_keys,
    check_str,
    choices,
    describe,
    int_phrase,
    join,
    mapping,
)

_META = "colocar.config"
T = TypeVar("T")
N = TypeVar("N", bound="Node")


@dataclass(frozen=True)
class Context:
    """What parsers may need besides the value: where relative globs start, and whether the config
    came from a file (files cannot hold Python objects)."""

    base_dir: str
    from_file: bool


Parser = Callable[[Any, str, Context], Any]


@dataclass(frozen=True)
class Option:
    """What an option's type hint cannot say. Give these as keywords of `option`."""

    doc: str | None = None  # what to give, for "expected ..." messages
    minimum: int | None = None  # ints (and the items of int tuples): the lower bound
    why: str = ""  # ints: why the bound, added to its error
    choices: tuple[str, ...] | None = None  # strings: the allowed values
    tag: str | None = None  # this option picks the variant of a union; names it ("source")
    kinds: tuple[str, ...] | None = None  # a variant's option: the tags that take it
    required: bool = False  # ... and whether they require it
    before: Callable[[Any], Any] | None = None  # raw -> raw, before the type check
    parse: Parser | None = None  # replaces the type check: (raw, path, context) -> value
    check: Callable[[Any, str], Any] | None = None  # after it: (value, path) -> value
    dump: Callable[[Any], Any] | None = None  # value -> JSON-able data, for `to_dict`
    opaque: bool = False  # a Python object: kept as it is, not dumped, to check a config again


def option(*, default: Any = MISSING, compare: bool = True, **about: Any) -> Any:
    """A config option: a dataclass field, required without `default`; `about` fills an `Option`."""
    return field(default=default, compare=compare, metadata={_META: Option(**about)})


class Node:
    """Base of the config classes: `to_dict`, and the hook for checks across options."""

    EXPECTED: ClassVar[str] = "a mapping"  # what a value of this class looks like, for errors

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON-able data: `json.dumps` works, and `load_config` reads it back."""
        return to_data(self)

    def _check(self, given: Mapping[str, Any], path: str) -> None:
        """Checks across options, after each was checked alone; `given` is the raw mapping."""


@dataclass_transform(frozen_default=True, field_specifiers=(option,))
def config_class(cls: type[T]) -> type[T]:
    """A frozen dataclass whose fields are config options (see `option`); checks its schema."""
    out = dataclass(frozen=True)(cls)
    schema_of(out)
    return out


# --------------------------------------------------------------------------------------------
# The schema of a class
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Field:
    name: str
    hint: Any
    opt: Option
    default: Any  # MISSING: required

    def expected(self) -> str:
        """What to give for this option, for "required key is missing; expected ..."."""
        hint, _ = _strip_none(self.hint)
        if self.opt.doc is not None:
            return self.opt.doc
        if self.opt.choices is not None:
            return f"one of {choices(self.opt.choices)}"
        if hint is int:
            return int_phrase(self.opt.minimum)
        if isinstance(hint, type) and issubclass(hint, Node):
            return hint.EXPECTED
        raise TypeError(f"config option {self.name!r} needs a doc")


@dataclass(frozen=True)
class Schema:
    fields: tuple[Field, ...]
    tag: Field | None

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(f.name for f in self.fields)

    def applies(self, f: Field, kind: str | None) -> bool:
        return f.opt.kinds is None or kind in f.opt.kinds


def schema_of(cls: type) -> Schema:
    """The options of a config class, from its dataclass fields and type hints (made once)."""
    if cls not in _SCHEMAS:
        _SCHEMAS[cls] = _make_schema(cls)
    return _SCHEMAS[cls]


_SCHEMAS: dict[type, Schema] = {}


def _make_schema(cls: type) -> Schema:
    hints = typing.get_type_hints(cls)
    out = tuple(
        Field(f.name, hints[f.name], f.metadata.get(_META, Option()), f.default)
        for f in dataclasses.fields(cls)
    )
    tags = [f for f in out if f.opt.tag is not None]
    tag = tags[0] if tags else None
    if len(tags) > 1 or (tag is not None and (tag.default is not MISSING or tag.opt.choices is None)):
        raise TypeError(f"{cls.__name__}: one tag option at most, required and with choices")
    tag_choices = set(tag.opt.choices or ()) if tag is not None else set()
    for f in out:
        if f.default is MISSING:
            f.expected()  # a required option must be able to say what it expects
        if f.opt.kinds is not None and not set(f.opt.kinds) <= tag_choices:
            raise TypeError(f"{cls.__name__}.{f.name}: its kinds must be choices of the tag option")
        if f.opt.required and (f.opt.kinds is None or f.opt.doc is None):
            raise TypeError(f"{cls.__name__}.{f.name}: required for kinds: give its kinds and a doc")
    return Schema(out, tag)


def _strip_none(hint: Any) -> tuple[Any, bool]:
    """``X | None`` -> (X, True); anything else -> (hint, False)."""
    args = typing.get_args(hint)
    if typing.get_origin(hint) in (typing.Union, types.UnionType) and type(None) in args:
        rest = [a for a in args if a is not type(None)]
        if len(rest) == 1:
            return rest[0], True
    return hint, False


# --------------------------------------------------------------------------------------------
# Parsing
# --------------------------------------------------------------------------------------------


def parse_node(cls: type[N], raw: Any, path: str, ctx: Context) -> N:
    """Check `raw` (a mapping, or a config object to check again) against `cls`; build one."""
    schema = schema_of(cls)
    if isinstance(raw, Node):
        given: Mapping[Any, Any] = to_data(raw, keep=True)
    else:
        given = mapping(raw, path or "(top level)", cls.EXPECTED)
    check_keys(given, schema.names, path)
    for f in schema.fields:
        if f.default is MISSING and f.name not in given:
            raise ConfigError(join(path, f.name), f"required key is missing; expected {f.expected()}")
    values: dict[str, Any] = {}
    kind = None
    if schema.tag is not None:
        kind = values[schema.tag.name] = parse_value(schema.tag, given[schema.tag.name], path, ctx)
        _check_variant(schema, given, kind, path)
    for f in schema.fields:
        if f is schema.tag or not schema.applies(f, kind):
            continue
        values[f.name] = parse_value(f, given[f.name], path, ctx) if f.name in given else f.default
    node = cls(**values)
    node._check(given, path)
    return node


def _check_variant(schema: Schema, given: Mapping[str, Any], kind: str, path: str) -> None:
    """Reject the options that the chosen kind does not take; require those it requires."""
    assert schema.tag is not None
    noun = schema.tag.opt.tag
    takes = [f.name for f in schema.fields if schema.applies(f, kind)]
    for key in given:
        if key not in takes:
            raise ConfigError(
                join(path, key), f"not a setting of {noun} kind {kind!r}, which takes {choices(takes)}"
            )
    for f in schema.fields:
        if f.opt.required and schema.applies(f, kind) and given.get(f.name) is None:
            raise ConfigError(
                join(path, f.name), f"{noun} kind {kind!r} requires {f.name!r}; give {f.opt.doc}"
            )


def parse_value(f: Field, raw: Any, path: str, ctx: Context) -> Any:
    """One option's value: `before`, then its parser or the check its type hint calls for, then
    `check`. `path` is the path of the mapping that holds it."""
    where = join(path, f.name)
    if f.opt.before is not None:
        raw = f.opt.before(raw)
    if f.opt.parse is not None:
        value = f.opt.parse(raw, where, ctx)
    else:
        value = _typed(f.hint, raw, where, f.opt, ctx)
    return f.opt.check(value, where) if f.opt.check is not None else value


def _typed(hint: Any, raw: Any, path: str, opt: Option, ctx: Context) -> Any:
    """Check `raw` as the type `hint` says: bool, int, str, a config class, ``tuple[X, ...]``,
    ``dict[str, X]``, or ``X | None``. The items of tuples and dicts take `opt` less its doc."""
    hint, optional = _strip_none(hint)
    if raw is None and optional:
        return None
    if hint is bool:
        return check_bool(raw, path)
    if hint is int:
        return check_int(raw, path, minimum=opt.minimum, why=opt.why)
    if hint is str:
        return check_choice(raw, path, opt.choices) if opt.choices else check_str(raw, path, opt.doc)
    if isinstance(hint, type) and issubclass(hint, Node):
        return parse_node(hint, raw, path, ctx)
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    item = dataclasses.replace(opt, doc=None)  # what the items are is their type's business
    if origin is tuple and len(args) == 2 and args[1] is Ellipsis:
        if not isinstance(raw, list | tuple):
            raise ConfigError(path, f"expected {opt.doc}, got {describe(raw)}")
        return tuple(_typed(args[0], v, f"{path}[{i}]", item, ctx) for i, v in enumerate(raw))
    if origin is dict and args[0] is str:
        out = {}
        for name, v in mapping(raw, path, opt.doc or "a mapping").items():
            if not isinstance(name, str) or not name:
                raise ConfigError(join(path, name), "field names must be non-empty strings")
            out[name] = _typed(args[1], v, join(path, name), item, ctx)
        return out
    raise TypeError(f"no config check for type {hint!r} (at {path}); give the option a parser")


# --------------------------------------------------------------------------------------------
# Back to data
# --------------------------------------------------------------------------------------------


def to_data(node: Node, *, keep: bool = False) -> dict[str, Any]:
    """The options of `node` as plain data.

    keep=False (`to_dict`): JSON-able, with each option's `dump`; a union writes only the options
    of its kind. keep=True: what `parse_node` reads back to check `node` again: options are kept
    as they are (opaque ones too; others go through `dump`), and a union also writes the options of
    other kinds that are set, so that they are reported.
    """
    schema = schema_of(type(node))
    kind = getattr(node, schema.tag.name) if schema.tag is not None else None
    out: dict[str, Any] = {}
    for f in schema.fields:
        value = getattr(node, f.name)
        if not schema.applies(f, kind) and (not keep or _is_default(value, f.default)):
            continue
        if f.opt.dump is not None and not (keep and f.opt.opaque):
            out[f.name] = f.opt.dump(value)
        else:
            out[f.name] = value if keep else plain(value)
    return out


def plain(value: Any) -> Any:
    """Config objects to dicts, tuples to lists, recursively; other values as they are."""
    if isinstance(value, Node):
        return value.to_dict()
    if isinstance(value, Mapping):
        return {k: plain(v) for k, v in value.items()}
    if isinstance(value, tuple | list):
        return [plain(v) for v in value]
    return value


def _is_default(value: Any, default: Any) -> bool:
    return value is default or (type(value) is type(default) and value == default)
