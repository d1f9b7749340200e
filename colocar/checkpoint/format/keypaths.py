"""Leaf directory names from `jax.tree_util` key paths (runs in the controller).

Each array leaf of a checkpoint lies in `arrays/<dir>`, where `dir` has one path segment per
key of the leaf's key path: `{'params': {'dense': {'kernel': w}}}` -> `params/dense/kernel`,
`[a, b]` -> `0`, `1`, a NamedTuple or dataclass field by its name. So a person, or tensorstore
alone, finds a leaf by its path; the manifest records every leaf's `dir`, so a restore never
recomputes it from a target.

A segment is the key percent-encoded (`urllib.parse.quote(safe='')`: `/` -> `%2F`, `%` -> `%25`,
non-ASCII as its UTF-8 bytes), with three spellings for keys a directory cannot have: `.` ->
`%2E`, `..` -> `%2E%2E` and the empty key -> `@` (quote never writes `@` or a `%2E`, so these
clash with no key). A segment longer than MAX_SEGMENT keeps a prefix and a hash, after `@`.
`decode_segment` reverses a segment; `leaf_dirs` refuses two leaves at one directory.
"""

from __future__ import annotations

import hashlib
from typing import Any
from urllib.parse import quote, unquote

from jax.tree_util import DictKey, FlattenedIndexKey, GetAttrKey, SequenceKey

from colocar.errors import CheckpointError

EMPTY = "@"  # the empty string key
ROOT = "@root"  # a tree that is a single leaf
MAX_SEGMENT = 200  # bytes; file systems allow 255 per name
_KEEP = 160  # of a longer segment, before `@` and the hash


def escape(name: str) -> str:
    """A key string as one safe, reversible directory name."""
    segment = quote(name, safe="")
    if segment in ("", ".", ".."):
        return {"": EMPTY, ".": "%2E", "..": "%2E%2E"}[segment]
    if len(segment) > MAX_SEGMENT:
        digest = hashlib.sha256(segment.encode()).hexdigest()[:16]
        return f"{segment[:_KEEP]}@{digest}"
    return segment


def decode_segment(segment: str) -> str | None:
    """The key string `escape` made `segment` from; None for a shortened (hashed) one and for
    ROOT (the manifest's `key` of that leaf says what it was)."""
    if segment == EMPTY:
        return ""
    if "@" in segment:
        return None
    return unquote(segment)


def segment(key: Any) -> str:
    """One entry of a key path as a directory name: dict keys (their `str` when not strings),
    sequence indices, attribute names (NamedTuple and dataclass fields), flattened indices."""
    if isinstance(key, DictKey):
        return escape(key.key if isinstance(key.key, str) else str(key.key))
    if isinstance(key, SequenceKey):
        return str(key.idx)
    if isinstance(key, GetAttrKey):
        return escape(key.name)
    if isinstance(key, FlattenedIndexKey):
        return str(key.key)
    return escape(str(key))


def leaf_dir(path: tuple[Any, ...]) -> str:
    """The directory (under `arrays/`) of the leaf at key path `path`."""
    return "/".join(segment(k) for k in path) if path else ROOT


def leaf_dirs(paths: list[tuple[str, tuple[Any, ...]]]) -> dict[str, str]:
    """[(keystr, key path)] -> {keystr: directory}; CheckpointError when two leaves would share
    a directory, or one leaf's directory would lie inside another's (keys whose `str` is equal,
    e.g. two distinct objects used as dict keys)."""
    dirs: dict[str, str] = {}
    owner: dict[str, str] = {}
    for key, path in paths:
        directory = dirs[key] = leaf_dir(path)
        if directory in owner:
            raise CheckpointError(
                f"{owner[directory]} and {key} would both be saved in arrays/{directory}; "
                "give the tree keys whose str() differs"
            )
        owner[directory] = key
    for directory, key in owner.items():
        parts = directory.split("/")
        for n in range(1, len(parts)):
            inside = owner.get("/".join(parts[:n]))
            if inside is not None:
                raise CheckpointError(
                    f"{key} would be saved inside the array of {inside} (arrays/{'/'.join(parts[:n])}); "
                    "give the tree keys whose str() differs"
                )
    return dirs
