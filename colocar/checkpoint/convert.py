"""`colocar ckpt convert SRC DST`: committed steps of one layout rewritten in the other
(runs in the `colocar` command; tensorstore, no sidecar).

Each array is copied chunk by chunk by tensorstore (memory bounded by its chunks, not the
checkpoint) into an attempt of the destination, which is then committed as a save is: Orbax's
layout by merging the database and renaming the attempt (or `commit_success.txt` on GCS),
colocar's by its `COMMITTED` marker. A destination step that exists is refused; nothing else
under DST is touched, so do not convert into a directory a running job writes.
"""

from __future__ import annotations

import json
import time
import uuid
from typing import Any

from colocar.errors import CheckpointError

from .format import layout
from .orbax import files as orbax_files
from .orbax.names import KEY_SEQUENCE
from .store.catalog import Catalog, steps_of
from .store.steps import StepDirs
from .store.storage import open_storage


def convert(
    source: str, destination: str, to: str | None = None, steps: list[int] | None = None
) -> list[str]:
    """Converts `steps` (default: every committed one) of `source` into `destination`, each into
    `to` (default: the layout it is not in); returns one line per step."""
    catalog = Catalog(open_storage(source))
    target = open_storage(destination)
    done = []
    for step in steps if steps is not None else catalog.committed():
        step, manifest, held = catalog.committed_manifest(step)
        layout_name = to or ("colocar" if held.layout == "orbax" else "orbax")
        out = steps_of(target, layout_name)
        if Catalog(target).holder(step) is not None:
            raise CheckpointError(f"step {step} exists in {target.url} already; delete it first")
        _write_step(held, step, manifest, out)
        done.append(
            f"step {step}: {held.layout} -> {layout_name} ({len(orbax_files.array_entries(manifest))} arrays)"
        )
    return done


def _write_step(held: StepDirs, step: int, manifest: dict[str, Any], out: StepDirs) -> None:
    import tensorstore as ts

    attempt = uuid.uuid4().hex
    converted = _manifest_for(manifest, out.layout, step, attempt)
    out.write_manifest(step, attempt, json.dumps(converted).encode())
    reads = ts.Context(held.storage.context_spec())
    writes = ts.Context(out.storage.context_spec())
    for entry in orbax_files.array_entries(converted):
        original = manifest["leaves"][entry["key"]]
        source = ts.open(held.read_spec(step, manifest, original), context=reads, open=True).result()
        spec = out.write_spec(step, attempt, 0, entry)
        ts.open(spec, context=writes, create=True, open=True).result().write(source).result()
    if not out.commit(step, attempt, [0]):
        raise CheckpointError(f"step {step} was written to {out.storage.url} by someone else meanwhile")


def _manifest_for(manifest: dict[str, Any], layout_name: str, step: int, attempt: str) -> dict[str, Any]:
    """The manifest a save of `manifest`'s tree in `layout_name` would have written."""
    leaves = {k: dict(e) for k, e in manifest["leaves"].items()}
    converted = {
        **{k: v for k, v in manifest.items() if k not in ("orbax", "leaves")},
        **layout.FORMAT_FIELDS,
        "step": step,
        "attempt": attempt,
        "time": manifest.get("time") or time.time(),
        "hosts": [0],
        "leaves": leaves,
        "metadata": manifest.get("metadata") or {},
    }
    for entry in leaves.values():
        entry.setdefault("inner_chunks", entry.get("chunks"))
    if layout_name == "orbax":
        orbax_files.annotate(converted)
        for entry in orbax_files.array_entries(converted):
            entry.setdefault("orbax_sharding", orbax_files.sharding_of(entry.get("sharding")))
        return converted
    from jax.tree_util import DictKey, SequenceKey  # (only a conversion to colocar's format needs JAX)

    from .format import keypaths

    entries = orbax_files.array_entries(converted)
    paths = [
        (
            e["key"],
            tuple(SequenceKey(int(k)) if t == KEY_SEQUENCE else DictKey(k) for k, t in e.get("path") or []),
        )
        for e in entries
    ]
    dirs = keypaths.leaf_dirs(paths)  # as a save names them (and refusing the same clashes)
    for entry in entries:
        entry["dir"] = dirs[entry["key"]]
        entry["array_dir"] = layout.array_dir(converted, entry)
    return converted
