"""Which records make global batch k: deterministic, and independent of the number of hosts.

Runs anywhere (pure index math). Record indices are shuffled per (seed, epoch); global batch k
holds the records at shuffled positions [k*B, (k+1)*B) of its epoch; each host builds only
the rows its devices hold. Positions past the end of an epoch (the last, short batch when
`drop_remainder` is false) are padding, marked -1.
"""

from __future__ import annotations

import functools
import math

import numpy as np

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
    ):
        if num_records <= 0:
            raise ValueError("the source has no records")
        self.num_records = num_records
        self.batch_size = global_batch_size
        self.seed = seed
        self.shuffle = shuffle
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

    @functools.lru_cache(maxsize=2)  # noqa: B019 - a sampler lives as long as its pipeline
    def epoch_order(self, epoch: int) -> np.ndarray:
        """The record indices of an epoch in their (shuffled) order."""
        if not self.shuffle:
            return np.arange(self.num_records, dtype=np.int64)
        rng = np.random.Generator(np.random.Philox(key=[self.seed, epoch]))
        return rng.permutation(self.num_records).astype(np.int64)

    def batch_indices(self, k: int, rows: slice = slice(None)) -> np.ndarray:
        """Record indices of global batch k (or of its `rows`), PADDING past the epoch's end."""
        if k < 0 or (self.num_batches is not None and k >= self.num_batches):
            raise IndexError(f"batch {k} is outside the {self.num_batches} batches of this pipeline")
        epoch, position = divmod(k, self.batches_per_epoch)
        start, stop, _ = rows.indices(self.batch_size)
        first = position * self.batch_size
        out = np.full(stop - start, PADDING, dtype=np.int64)
        order = self.epoch_order(epoch)
        lo, hi = first + start, min(first + stop, self.num_records)
        if hi > lo:
            out[: hi - lo] = order[lo:hi]
        return out
