"""The names of Orbax's layout (orbax-checkpoint 0.12): files, directories, parameters, tree keys.

No JAX; imported by the controller, the sidecar writer and `colocar ckpt`. One step:

    ROOT/<N>/_CHECKPOINT_METADATA         the step: item handlers, user metadata, timestamps
    ROOT/<N>/commit_success.txt           the step is finished (what Orbax checks on GCS)
    ROOT/<N>/default/_METADATA            the item's tree: key paths, value types, OCDBT/zarr3
    ROOT/<N>/default/_sharding            each array's sharding (base64url of its name -> JSON)
    ROOT/<N>/default/array_metadatas/process_<h>
    ROOT/<N>/default/manifest.ocdbt, d/   the root OCDBT database readers open
    ROOT/<N>/default/ocdbt.process_<h>/   host h's own database, which the root references

colocar writes a save into an attempt of its own: on local disk under
`<N>.orbax-checkpoint-tmp-<attempt>/` (Orbax's temporary name), renamed to `<N>` at commit; on
GCS in place, each host's database under `default/attempt_<attempt>/`, the step finished by
`commit_success.txt` (written create-only). colocar's own markers of a save in progress lie in
`colocar/attempt_<attempt>/` of the step's directory and go at commit.
"""

from __future__ import annotations

import re
from typing import Any

ITEM = "default"  # the item of a one-item ocp.CheckpointManager
V1_ITEM = "state"  # the item orbax.checkpoint.v1.training.Checkpointer writes
CHECKPOINT_METADATA = "_CHECKPOINT_METADATA"
METADATA = "_METADATA"
SHARDING = "_sharding"
ARRAY_METADATAS = "array_metadatas"
COMMIT_SUCCESS = "commit_success.txt"
MANIFEST_OCDBT = "manifest.ocdbt"
PROCESS_PREFIX = "ocdbt.process_"
TMP_SUFFIX = ".orbax-checkpoint-tmp"
HANDLER = "orbax.checkpoint._src.handlers.standard_checkpoint_handler.StandardCheckpointHandler"
COLOCAR = "colocar"  # colocar's markers of a save in progress, in the step's directory
ATTEMPT_PREFIX = "attempt_"
KEY_SEQUENCE, KEY_DICT = 1, 2  # Orbax's key_type of a list index and of a dict key
# Orbax's OCDBT configuration (serialization/tensorstore_utils.py): databases it writes itself
OCDBT_CONFIG = {
    "max_inline_value_bytes": 1024,
    "max_decoded_node_bytes": 100000000,
    "manifest_kind": "single",
}

_ITEM = re.compile(r"^[A-Za-z_][A-Za-z0-9_.-]*$")
_COLOCAR_STEP = re.compile(r"^step_\d{10}/?$")  # colocar's format (`checkpoint.format.layout.step_dir`)
_STEP = re.compile(r"^(?:(?P<prefix>.*)_)?(?P<step>\d+)(?P<tmp>\.orbax-checkpoint-tmp.*)?$")


def check_item(item: str, layout: str) -> str:
    """`item` when it can name the one item of a step in Orbax's layout, else ValueError."""
    if item != ITEM and layout != "orbax":
        raise ValueError(f"item={item!r} names an item of Orbax's layout; give it with layout='orbax'")
    if not _ITEM.match(item) or item == COLOCAR or parse_step_name(item) is not None:
        raise ValueError(
            f"item must be a plain directory name other than {COLOCAR!r} and a step number "
            f"(Orbax's are {ITEM!r} and {V1_ITEM!r}), got {item!r}"
        )
    return item


def parse_step_name(name: str) -> tuple[int, bool] | None:
    """(step, unfinished) of a step directory's name (`3`, `ckpt_3`, `3.orbax-checkpoint-tmp-…`),
    or None for any other name."""
    match = _STEP.match(name.rstrip("/"))
    if match is None or name.startswith(PROCESS_PREFIX) or _COLOCAR_STEP.match(name):
        return None  # an item's database, or a step of colocar's own format
    return int(match.group("step")), match.group("tmp") is not None


def tmp_name(step: int, attempt: str) -> str:
    """The directory a save attempt writes on local disk; Orbax reads it as unfinished."""
    return f"{step}{TMP_SUFFIX}-{attempt}"


def attempt_of_tmp(name: str) -> str | None:
    """The attempt of a `tmp_name`, None for another name (Orbax's own temporary ones too)."""
    head, sep, attempt = name.partition(f"{TMP_SUFFIX}-")
    return attempt if sep and head.isdigit() and attempt else None


def param_name(keys: list[Any]) -> str:
    """The name of a leaf's array in the OCDBT database: its keys joined by dots."""
    return ".".join(str(k) for k, _ in keys)


def tree_key(keys: list[Any]) -> str:
    """A leaf's key in `_METADATA`'s `tree_metadata`: `str` of the tuple of its keys."""
    return str(tuple(str(k) for k, _ in keys))


def key_metadata(keys: list[Any]) -> list[dict[str, Any]]:
    return [{"key": str(k), "key_type": int(t)} for k, t in keys]


def commit_text(path: str) -> bytes:
    return f"Checkpoint commit was successful to {path}".encode()
