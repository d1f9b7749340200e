"""Reads the slices a host's devices need into arena blocks (runs in the sidecar).

Each request names a leaf's array and a hyper-rectangle of it; tensorstore reads it straight
into an array allocated in the arena (`colocar.shm.empty`), so returning it to the controller
copies nothing and the device array built on it may alias the block. Only the inner chunks
that overlap the slice are read (sharded zarr3 reads ranges of the shard objects); a checksum
mismatch or a missing chunk raises with the object's name.
"""

from __future__ import annotations

import json
from typing import Any

import numpy as np

from colocar.shm import empty

from ..format import layout
from ..store.storage import open_storage

BYTES_READ_METRICS = ("/tensorstore/kvstore/file/bytes_read", "/tensorstore/kvstore/gcs/bytes_read")


def bytes_read() -> int:
    """tensorstore's process-wide counter of bytes read from files and GCS."""
    import tensorstore as ts

    total = 0
    for metric in ts.experimental_collect_matching_metrics("/tensorstore/kvstore/"):
        if metric["name"] in BYTES_READ_METRICS:
            total += sum(v.get("value", 0) for v in metric["values"])
    return total


def read_slices(
    url: str, requests: list[tuple[dict[str, Any], str, list[list[int]]]], storage_timeout: float
) -> tuple[list[np.ndarray], int]:
    """[(tensorstore spec of an array, stored dtype, [[start, stop], ...])] of the checkpoint
    at `url` (its layout's `read_spec`) -> (arena arrays, bytes read)."""
    import tensorstore as ts

    storage = open_storage(url, storage_timeout)
    context = ts.Context(storage.context_spec())
    specs = {json.dumps(r[0], sort_keys=True): r[0] for r in requests}
    opened = {name: ts.open(spec, context=context, open=True) for name, spec in specs.items()}
    stores = {name: future.result() for name, future in opened.items()}
    before = bytes_read()
    outputs, pending = [], []
    try:
        for spec, dtype, bounds in requests:
            out = empty(tuple(b - a for a, b in bounds), np.dtype(dtype))
            target = ts.array(out, copy=False, write=True)
            store = stores[json.dumps(spec, sort_keys=True)]
            pending.append(target.write(store[layout.slices_of(bounds)]))
            outputs.append(out)
    except BaseException:
        _settle(pending, raise_first=False)
        raise
    _settle(pending)
    return outputs, bytes_read() - before


def _settle(pending: list[Any], raise_first: bool = True) -> None:
    """Waits for every read, then raises the first failure: no read still writes into a block
    when a failed call's blocks go back to the arena."""
    error: Exception | None = None
    for future in pending:
        try:
            future.result()
        except Exception as e:
            error = error or e
    try:
        if error is not None and raise_first:
            raise error
    finally:
        error = None  # no cycle error -> traceback -> this frame -> error: it would pin the blocks
