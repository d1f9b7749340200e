"""Which records make global batch k: deterministic, and independent of the number of hosts.

Runs anywhere (pure index math). Record indices are shuffled per (seed, epoch), in the order
`orders.py` gives (colocar's or grain's); global batch k holds the records at shuffled
positions [k*B, (k+1)*B) of its epoch; each host builds only the rows its devices hold.
Positions past the end of an epoch (the last, short batch when `drop_remainder` is false) are
padding, marked -1.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from .orders import DEFAULT, epoch_order

PADDING = -1


class IndexSampler:
    def __init__(
        self,
        num_records: int,
        global_batch_size: int,
        *,
        seed: int = 0,
        shuffle: bool = True,
        num_epochs: int | None = 1,
        drop_remainder: bool = True,
        shuffle_order: str = DEFAULT,
    ):
        if num_records <= 0:
            raise ValueError("the source has no records")
        self.num_records = num_records
        self.batch_size = global_batch_size
        self.seed = seed
        self.shuffle = shuffle
        self.shuffle_order = shuffle_order
        self._order = epoch_order(num_records, seed, shuffle, shuffle_order)
        self.num_epochs = num_epochs
        self.batches_per_epoch = (
            num_records // global_batch_size if drop_remainder else math.ceil(num_records / global_batch_size)
        )
        if self.batches_per_epoch == 0:
            raise ValueError(
                f"global_batch_size {global_batch_size} exceeds the {num_records} records of the source "
                "with drop_remainder true: no batch would ever be produced"
            )

    @property
    def num_batches(self) -> int | None:
        """Total batches, or None when the epochs repeat forever."""
        return None if self.num_epochs is None else self.num_epochs * self.batches_per_epoch

    @classmethod
    def for_config(cls, config: Any, num_records: int) -> IndexSampler:
        """The sampler of a `PipelineConfig` whose source has `num_records` records."""
        return cls(
            num_records,
            config.global_batch_size,
            seed=config.seed,
            shuffle=config.shuffle,
            num_epochs=config.num_epochs,
            drop_remainder=config.drop_remainder,
            shuffle_order=config.shuffle_order,
        )

    def epoch_order(self, epoch: int) -> np.ndarray:
        """The record indices of a whole epoch in their (shuffled) order."""
        return self._order.take(epoch, 0, self.num_records)

    def batch_indices(self, k: int, rows: slice = slice(None)) -> np.ndarray:
        """Record indices of global batch k (or of its `rows`), PADDING past the epoch's end."""
        if k < 0 or (self.num_batches is not None and k >= self.num_batches):
            raise IndexError(f"batch {k} is outside the {self.num_batches} batches of this pipeline")
        epoch, position = divmod(k, self.batches_per_epoch)
        start, stop, _ = rows.indices(self.batch_size)
        first = position * self.batch_size
        out = np.full(stop - start, PADDING, dtype=np.int64)
        lo, hi = first + start, min(first + stop, self.num_records)
        if hi > lo:
            out[: hi - lo] = self._order.take(epoch, lo, hi)
        return out
