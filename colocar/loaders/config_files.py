"""Reading a pipeline config file (YAML, TOML or JSON) into plain data, strictly.

Unlike the plain parsers, a key given twice in one mapping is an error here (YAML and JSON would
silently keep the last one), reported with the key and, for YAML, the line.
"""

from __future__ import annotations

import json
import os
import tomllib
from typing import Any

import yaml

from .checks import ConfigError

FORMATS = (".yaml", ".yml", ".toml", ".json")


def read_file(path: str) -> Any:
    """The parsed contents of the config file at (absolute) `path`; `ConfigError` if unreadable."""
    ext = os.path.splitext(path)[1].lower()
    if ext not in FORMATS:
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
