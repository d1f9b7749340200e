"""The data position, in records, and where a loader resumes from it (runs in the controller).

A loader's own state counts global batches; the elastic manager keeps the position in records
(batches done x global batch size), so that a job resumed with another global batch size (the
"keep the per-device batch" rule after a loss) still loses and repeats no record. The sampler
numbers records globally, whatever the number of hosts, so the records a batch holds do not
depend on the hosts either. A new global batch size must fall on the position (records a
multiple of it) and cut the epochs in the same place (the same records per epoch), else the
resume is refused: it would repeat or skip records.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from colocar.loaders.orders import STATE_KEY, saved_order

from .survivors import ElasticError


def is_data_iterator(value: Any) -> bool:
    """A colocar data iterator (or anything with `get_state`, `set_state` and a `config`)."""
    return all(hasattr(value, name) for name in ("get_state", "set_state", "config"))


def position(iterator: Any) -> dict[str, Any]:
    """Where `iterator` stands: records consumed, its global batch size and its own state."""
    state = iterator.get_state()
    B = int(state["global_batch_size"])
    return {"records": int(state["next_batch"]) * B, "global_batch_size": B, "loader": state}


def _records_per_epoch(config: Any, batch: int) -> int | None:
    n = config.source.num_records
    if n is None:
        return None
    return (n // batch) * batch if config.drop_remainder else -(-n // batch) * batch


def start_batch(saved: dict[str, Any] | None, config: Any, name: str) -> int:
    """The batch number at which a loader of `config` continues the saved position `saved`
    (None: from the start). Raises `ElasticError` where it cannot be exact."""
    if saved is None:
        return 0
    loader, records, old_B = saved["loader"], int(saved["records"]), int(saved["global_batch_size"])
    loader = {**loader, STATE_KEY: saved_order(loader)}  # states before the key: colocar's order
    for key in ("seed", "shuffle", STATE_KEY):
        if loader[key] != getattr(config, key):
            raise ElasticError(
                f"data {name!r} was saved with {key}={loader[key]!r} but the pipeline has "
                f"{getattr(config, key)!r}: its records would not continue the saved stream"
            )
    B = config.global_batch_size
    if B == old_B:
        return records // B
    if records % B:
        raise ElasticError(
            f"data {name!r} stopped after {records} records, which is not a whole number of "
            f"global batches of {B}: keep the global batch size ({old_B}) or pick one that divides "
            f"{records} (see docs/elastic.md, 'Batch size after a loss')"
        )
    old_epoch, new_epoch = _records_per_epoch(config, old_B), _records_per_epoch(config, B)
    if records and (old_epoch is None or old_epoch != new_epoch):
        raise ElasticError(
            f"data {name!r}: a global batch of {B} instead of {old_B} cuts the epochs elsewhere "
            f"({new_epoch} instead of {old_epoch} records per epoch, None: unknown), so records "
            "would be repeated or skipped; keep the global batch size"
        )
    return records // B


def devices_for_batch(devices: Sequence[Any], global_batch_size: int) -> list[Any]:
    """The longest prefix of `devices` (host-major, as the run function gets them) whose
    number divides `global_batch_size`: the mesh that keeps the global batch after a loss
    when it no longer divides every surviving device (the others sit idle)."""
    for n in range(len(devices), 0, -1):
        if global_batch_size % n == 0:
            return list(devices[:n])
    raise ElasticError("no devices to build a mesh on")
