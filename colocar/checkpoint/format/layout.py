"""The on-storage format of a checkpoint: object names, marker contents, chunk shapes,
tensorstore specs.

Imported by the controller, the sidecar writer and the `colocar ckpt` command; no
JAX. One directory per step:

    ROOT/writer.json                  lease of the manager that writes ROOT (refreshed)
    ROOT/step_<N>/HEARTBEAT           rewritten while a save of the step is in flight
    ROOT/step_<N>/COMMITTED           written last, create-only: names the attempt restored
    ROOT/step_<N>/attempt_<A>/manifest.json   tree, leaves, shapes, shardings, plan, metadata
    ROOT/step_<N>/attempt_<A>/arrays/<dir>/...  one zarr3 array per array leaf (tensorstore),
                                      <dir> its escaped key path: params/dense/kernel
    ROOT/step_<N>/attempt_<A>/done/host_<h>.json    host h's part is durable
    ROOT/step_<N>/attempt_<A>/failed/host_<h>.json  host h's part failed (never committed)

Everything a save writes lies under its `attempt` (an id shared by every process of the save,
new for every save), so writers of a crashed earlier save of the step that still run can
never touch this save's objects, and COMMITTED covers exactly the objects of the attempt it
names. The manifest records each array leaf's directory (`dir`, see `keypaths`) and says so
with `"array_layout": "keypath"`. Read only: format 2 named each array's directory by the
leaf's index (`arrays/5`, the "index" layout); format 1 also kept the manifest, markers and
arrays directly in the step.
"""

from __future__ import annotations

import json
import math
import re
import time
from typing import Any

from colocar.errors import CheckpointError

FORMAT = "colocar-checkpoint/3"
FORMAT_2 = "colocar-checkpoint/2"  # arrays/<leaf index> (read only)
FORMAT_1 = "colocar-checkpoint/1"  # everything directly in the step directory (read only)
READABLE_FORMATS = (FORMAT, FORMAT_2, FORMAT_1)
KEYPATH_LAYOUT = "keypath"  # arrays/<the entry's "dir">: the leaf's escaped key path
INDEX_LAYOUT = "index"  # arrays/<the entry's "index"> (formats 1 and 2)
ORBAX_LAYOUT = "orbax"  # Orbax's layout: the entry's "dir" is its parameter name (`orbax.names`)
FORMAT_FIELDS = {"format": FORMAT, "array_layout": KEYPATH_LAYOUT}  # what a save's manifest says
WRITER_LEASE = "writer.json"
MANIFEST = "manifest.json"
HEARTBEAT = "HEARTBEAT"
COMMITTED = "COMMITTED"
DONE_DIR = "done"
FAILED_DIR = "failed"
ARRAYS_DIR = "arrays"
ATTEMPT_PREFIX = "attempt_"

MAX_INNER_CHUNK_BYTES = 16 << 20
MAX_OUTER_CHUNK_BYTES = 256 << 20
MULTI_PROCESS_CHUNK_BYTES = 64 << 20  # the default with several JAX processes (arena >= 4x this)

_STEP_RE = re.compile(r"^step_(\d+)$")


def step_dir(step: int) -> str:
    return f"step_{step:010d}"


def parse_step_dir(name: str) -> int | None:
    match = _STEP_RE.match(name.rstrip("/"))
    return int(match.group(1)) if match else None


def attempt_dir(step: int, attempt: str) -> str:
    """The directory of everything save `attempt` of `step` writes."""
    return f"{step_dir(step)}/{ATTEMPT_PREFIX}{attempt}"


def parse_attempt_dir(name: str) -> str | None:
    name = name.rstrip("/")
    return name[len(ATTEMPT_PREFIX) :] if name.startswith(ATTEMPT_PREFIX) else None


def arrays_root(step: int, manifest: dict[str, Any]) -> str:
    """Where the arrays of a step's manifest lie (relative to the checkpoint root)."""
    if manifest.get("format") == FORMAT_1:
        return f"{step_dir(step)}/{ARRAYS_DIR}"
    return f"{attempt_dir(step, manifest['attempt'])}/{ARRAYS_DIR}"


def done_marker(host: int) -> str:
    return f"{DONE_DIR}/host_{host}.json"


def failed_marker(host: int) -> str:
    return f"{FAILED_DIR}/host_{host}.json"


def failure_body(host: int, attempt: str, error: str) -> bytes:
    """A failure marker's content."""
    return json.dumps({"host": host, "attempt": attempt, "error": error, "time": time.time()}).encode()


def marker_of(storage: Any, name: str, attempt: str) -> dict[str, Any] | None:
    """The marker object `name` as a dict if it belongs to save `attempt`, else None (absent,
    unreadable, or left by another attempt of the same step)."""
    try:
        body = json.loads(storage.read(name) or b"null")
    except ValueError:
        return None
    return body if isinstance(body, dict) and body.get("attempt") == attempt else None


def holder_of(storage: Any) -> dict[str, Any]:
    """The writer lease's content ({} when there is none, or it is unreadable)."""
    try:
        holder = json.loads(storage.read(WRITER_LEASE) or b"{}")
    except ValueError:
        return {}
    return holder if isinstance(holder, dict) else {}


def array_layout(manifest: dict[str, Any]) -> str:
    """How the manifest's arrays are named: KEYPATH_LAYOUT or INDEX_LAYOUT (formats 1 and 2,
    which say nothing); CheckpointError for any other."""
    name = manifest.get("array_layout")
    if name is None and manifest.get("format") in (FORMAT_1, FORMAT_2):
        name = INDEX_LAYOUT
    if name not in (KEYPATH_LAYOUT, INDEX_LAYOUT, ORBAX_LAYOUT):
        raise CheckpointError(
            f"step {manifest.get('step')}: unknown array layout {name!r} (format "
            f"{manifest.get('format')!r}); this colocar reads {KEYPATH_LAYOUT!r}, {INDEX_LAYOUT!r} "
            f"and {ORBAX_LAYOUT!r}"
        )
    return name


def array_name(manifest: dict[str, Any], entry: dict[str, Any]) -> str:
    """The directory of an array leaf's entry, under `arrays_root`: its key path or its index."""
    if array_layout(manifest) == INDEX_LAYOUT:
        return str(entry["index"])
    if not entry.get("dir"):
        raise CheckpointError(f"step {manifest.get('step')}: {entry.get('key')} has no array directory")
    return str(entry["dir"])


def array_dir(manifest: dict[str, Any], entry: dict[str, Any]) -> str:
    """`arrays/<array_name>`: relative to the save's attempt (format 1: to the step)."""
    return f"{ARRAYS_DIR}/{array_name(manifest, entry)}"


def _smallest_factor(n: int) -> int:
    for f in range(2, math.isqrt(n) + 1):
        if n % f == 0:
            return f
    return n


def split_shape(shape: tuple[int, ...], itemsize: int, max_bytes: int) -> tuple[int, ...]:
    """A chunk shape that divides `shape` exactly and holds at most `max_bytes` where possible.

    Leading dimensions are split first (their chunks stay contiguous in C order), each by its
    smallest prime factor, so every chunk boundary stays aligned with `shape`'s own boundaries.
    """
    chunk = [max(1, n) for n in shape]  # zarr chunks are never empty, even for a (0,) array
    while math.prod(chunk) * itemsize > max_bytes:
        for d, n in enumerate(chunk):
            if n > 1:
                chunk[d] = n // _smallest_factor(n)
                break
        else:
            break
    return tuple(chunk)


def chunk_shapes(shard_shape: tuple[int, ...], itemsize: int, max_outer: int) -> tuple[tuple, tuple]:
    """(outer, inner): outer chunks tile each saved shard (one storage object each, at most
    `max_outer` bytes, the unit a host writes from one arena block); inner chunks of at most
    16 MiB tile the outer chunk (the unit a restore reads and the checksum covers)."""
    outer = split_shape(shard_shape, itemsize, max_outer)
    inner = split_shape(outer, itemsize, MAX_INNER_CHUNK_BYTES)
    return outer, inner


def array_spec(
    kvstore: dict[str, Any], shape: tuple[int, ...], dtype_name: str, outer: tuple, inner: tuple
) -> dict[str, Any]:
    """The tensorstore spec that creates one leaf's zarr3 array (sharding_indexed + crc32c)."""
    chunk_codecs = [{"name": "bytes", "configuration": {"endian": "little"}}, {"name": "crc32c"}]
    return {
        "driver": "zarr3",
        "kvstore": kvstore,
        "store_data_equal_to_fill_value": True,  # every chunk is stored, so a missing one is an error
        "metadata": {
            "shape": list(shape),
            "data_type": dtype_name,  # numpy / ml_dtypes names are zarr3's
            "chunk_grid": {"name": "regular", "configuration": {"chunk_shape": list(outer)}},
            "codecs": [
                {
                    "name": "sharding_indexed",
                    "configuration": {
                        "chunk_shape": list(inner),
                        "codecs": chunk_codecs,
                        "index_codecs": chunk_codecs,
                        "index_location": "end",
                    },
                }
            ],
        },
    }


def entry_spec(kvstore: dict[str, Any], entry: dict[str, Any]) -> dict[str, Any]:
    """`array_spec` of a manifest's array entry (its stored shape, dtype and chunks) at `kvstore`."""
    outer, inner = tuple(entry["chunks"]), tuple(entry["inner_chunks"])
    return array_spec(kvstore, tuple(entry["stored_shape"]), entry["stored_dtype"], outer, inner)


def read_spec(kvstore: dict[str, Any]) -> dict[str, Any]:
    """Opens a saved array for reading; a missing chunk is an error, not zeros."""
    return {"driver": "zarr3", "kvstore": kvstore, "fill_missing_data_reads": False}


def slices_of(bounds: list[list[int]] | tuple) -> tuple[slice, ...]:
    """[[start, stop], ...] -> a tuple of slices."""
    return tuple(slice(int(a), int(b)) for a, b in bounds)
