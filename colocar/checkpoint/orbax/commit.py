"""The primary writer's commit of a step in Orbax's layout (runs in the sidecar; no JAX).

Once every host's part of save `attempt` is durable (each in its own OCDBT database), the
primary writes the plain values Orbax holds as scalars, merges every host's database into the
item's root database in one atomic transaction (as Orbax's `merge_ocdbt_per_process_files`
does), writes Orbax's small files (`files`), removes colocar's markers, and finishes the step
the way Orbax does on that storage: a rename of the attempt's directory to `<N>` on local disk
(fails when `<N>` exists), `commit_success.txt` written create-only on GCS. Either is the one
step that decides which save of the step wins.
"""

from __future__ import annotations

import json
from typing import Any

from . import files, names


def commit(steps: Any, step: int, attempt: str, hosts: list[int]) -> bool:
    """Finishes save `attempt` of `step` (see the module); False when the step is finished
    already (another save of it won)."""
    import tensorstore as ts

    storage = steps.storage
    body = storage.read(steps._manifest(step, attempt))
    if body is None:
        raise RuntimeError(f"the manifest of step {step} (attempt {attempt}) is missing; not committing")
    if steps.is_committed(step):
        return False
    manifest = json.loads(body)
    work = steps.work_dir(step, attempt)
    item = f"{work}/{steps.item}"
    context = ts.Context(storage.context_spec())
    _clear_root(storage, item)  # GCS: what a failed commit of this step wrote in place
    _write_scalars(storage, steps.child_db(step, attempt, min(hosts)), manifest, context)
    _merge(storage, item, [steps.child_db(step, attempt, h) for h in hosts], context)
    storage.write(f"{item}/{names.METADATA}", files.item_metadata(manifest))
    storage.write(f"{item}/{names.SHARDING}", files.shardings(manifest))
    for host in hosts:
        storage.write(f"{item}/{names.ARRAY_METADATAS}/process_{host}", files.array_metadatas(manifest))
    storage.write(f"{work}/{names.CHECKPOINT_METADATA}", files.checkpoint_metadata(manifest, steps.item))
    final = f"{storage.url}/{step}"
    storage.write(f"{item}/{names.COMMIT_SUCCESS}", names.commit_text(f"{final}/{steps.item}"))
    storage.delete_tree(f"{work}/{names.COLOCAR}/{names.ATTEMPT_PREFIX}{attempt}")
    if steps.in_place:
        return storage.write(f"{step}/{names.COMMIT_SUCCESS}", names.commit_text(final), create_only=True)
    storage.write(f"{work}/{names.COMMIT_SUCCESS}", names.commit_text(final))
    storage.delete_tree(f"{work}/{names.COLOCAR}")
    return storage.rename(work, str(step))


def _clear_root(storage: Any, item: str) -> None:
    storage.delete(f"{item}/{names.MANIFEST_OCDBT}")
    storage.delete_tree(f"{item}/d")


def _open_db(storage: Any, directory: str, context: Any) -> Any:
    import tensorstore as ts

    spec = {"driver": "ocdbt", "base": storage.kvstore(directory), "config": names.OCDBT_CONFIG}
    return ts.KvStore.open(spec, context=context).result()


def _write_scalars(storage: Any, database: str, manifest: dict[str, Any], context: Any) -> None:
    """Numbers in the state, as Orbax saves them: 0-d arrays in the database."""
    import numpy as np
    import tensorstore as ts

    codecs = [{"name": "bytes", "configuration": {"endian": "little"}}, {"name": "crc32c"}]
    writes = []
    for entry in files.scalars(manifest):
        dtype = files.scalar_dtype(entry["value"])
        spec = {
            "driver": "zarr3",
            "kvstore": {"driver": "ocdbt", "base": storage.kvstore(database), "path": entry["dir"]},
            "metadata": {
                "shape": [],
                "data_type": dtype,
                "chunk_grid": {"name": "regular", "configuration": {"chunk_shape": []}},
                "codecs": codecs,
            },
            "create": True,
            "delete_existing": True,
        }
        array = ts.open(spec, context=context).result()
        writes.append(array.write(np.asarray(entry["value"], dtype=dtype)))
    for write in writes:
        write.result()


def _merge(storage: Any, item: str, databases: list[str], context: Any) -> None:
    """Copies every host's database into the item's root database, atomically."""
    import tensorstore as ts

    root = _open_db(storage, item, context)
    transaction = ts.Transaction(atomic=True)
    for database in databases:
        child = _open_db(storage, database, context)
        child.experimental_copy_range_to(root.with_transaction(transaction)).result()
    transaction.commit_async().result()
