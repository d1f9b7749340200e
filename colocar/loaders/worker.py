"""A pipeline worker process on the sidecar: builds this host's rows of global batches in slots.

Started by `host_backend.LoaderHost` (forkserver, never fork). It maps the arena itself, opens
the source, runs the record pipeline (grain's dataset semantics, `records.py`) on the records of
each task's batch, and writes every row straight into the slot's segments: no batch crosses a pipe, only
the small messages of `protocol.messages` (`Build` in, `Built` or `BuildFailed` out), over a
pipe (no named semaphores, so a killed sidecar leaves nothing in /dev/shm).
"""

from __future__ import annotations

import os
import traceback
from collections.abc import Mapping
from typing import Any

import numpy as np

from colocar.protocol.messages import Build, BuildFailed, Built, receive_pickled, send_pickled


def _record_pipeline(config: Any) -> Any:
    from .config import resolve_callable
    from .records import RecordPipeline
    from .sources import open_source

    s = config.source
    source = open_source(s.kind, paths=s.paths, n=s.n, columns=s.columns, callable=s.callable, data=s.data)
    transforms = [
        (t.kind, resolve_callable(t.fn, f"transforms[{i}].fn")) for i, t in enumerate(config.transforms)
    ]
    return RecordPipeline(source, transforms, config.seed, config.skip_bad_records)


def sampler_for(config: Any, num_records: int) -> Any:
    from .sampler import IndexSampler

    return IndexSampler.for_config(config, num_records)


def check_dict(record: Any, index: int, pipeline: Any, fields: list[str] | None = None) -> None:
    """Raise naming the record and the step that made it when a record is not a dict of fields."""
    if not isinstance(record, Mapping):
        step = pipeline.step_names[-1] if pipeline.step_names else f"source {type(pipeline.source).__name__}"
        want = f"the fields {fields}" if fields else "fields"
        raise TypeError(
            f"record {index}: {step} returned {type(record).__name__}, not a dict; the pipeline's last "
            f"step must return a dict of {want}"
        )


def _write_row(
    views: dict, fields: list[str], segment: int, j: int, record: Any, index: int, pipeline: Any
) -> None:
    """Row j of `segment` from `record` (zeros when it is None); raises naming the record and the
    step that made it when it is not a dict of the element spec's fields."""
    if record is not None:
        check_dict(record, index, pipeline, fields)
    for name in fields:
        target = views[name][segment]
        if record is None:
            target[j] = 0
            continue
        if name not in record:
            raise KeyError(f"record {index} has no field {name!r} (it has {sorted(map(str, record))})")
        value = np.asarray(record[name])
        if value.shape != target.shape[1:] or not np.can_cast(value.dtype, target.dtype, "same_kind"):
            raise ValueError(
                f"record {index}: field {name!r} is {value.dtype}{list(value.shape)}, "
                f"the element spec says {target.dtype}{list(target.shape[1:])}"
            )
        target[j] = value


def main(
    conn: Any, arena_info: tuple, config_bytes: bytes, layout: Any, slots: list, sidecar_pid: int
) -> None:
    """Entry point of a worker process; it ends with its sidecar, however that ends."""
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    import cloudpickle

    from colocar.shm import Arena, ndarray_view
    from colocar.sidecar.lifeline import end_with

    end_with(sidecar_pid)

    arena = Arena.attach(*arena_info)
    config = cloudpickle.loads(config_bytes)
    pipeline = _record_pipeline(config)
    sampler = sampler_for(config, len(pipeline))
    fields = [name for name in layout.fields if name != "mask"]
    # per slot: field -> segment -> array view over the slot
    views = []
    for offset, nbytes in slots:
        whole = ndarray_view(arena, offset, (nbytes,), np.uint8)
        views.append(layout.slot_views(whole, list(range(len(layout.segments)))))
    r0, r1 = layout.rows
    while True:
        try:
            task: Build | None = receive_pickled(conn)
        except (EOFError, OSError):
            return
        if task is None:
            return
        k, slot = task
        bad_before = pipeline.bad_records
        try:
            indices = sampler.batch_indices(k, slice(r0, r1))
            for row, index in enumerate(indices):
                segment, j = layout.segment_of_row(r0 + row)
                record = pipeline[int(index)] if index >= 0 else None
                _write_row(views[slot], fields, segment, j, record, int(index), pipeline)
                if "mask" in views[slot]:
                    views[slot]["mask"][segment][j] = record is not None
            send_pickled(conn, Built(k, slot, pipeline.bad_records - bad_before))
        except Exception as e:  # noqa: BLE001 - reported with the batch and record to the controller
            send_pickled(conn, BuildFailed(k, slot, f"{type(e).__name__}: {e}", traceback.format_exc()))
