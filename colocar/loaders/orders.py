"""The order of the record indices within an epoch: the one part of the sampler that shuffles.

Runs anywhere (pure index math). The config's `shuffle` and `shuffle_order` pick one of:

- no shuffle: ``0 .. n-1``, whatever `shuffle_order` says;
- ``colocar`` (the default): numpy's `permutation` of a Philox generator keyed by (seed, epoch),
  made once per epoch (a table of n int64);
- ``grain``: grain's order, ``grain.MapDataset.source(range(n)).seed(seed).shuffle()``, epoch e
  being grain's reshuffled epoch e of ``.repeat()`` (grain reseeds its shuffle with seed + e).
  It is read through grain's public API, one position at a time (no table: a batch costs its
  rows, a few microseconds each); grain is imported only here, on the first batch, so that a
  sidecar that never uses this order does not pay for the import.

A saved iterator state names its order (`STATE_KEY`); states from before the key read as
``colocar``, the only order they could have had.
"""

from __future__ import annotations

import functools
from typing import Any, Protocol

import numpy as np

ORDERS = ("colocar", "grain")
DEFAULT = "colocar"
STATE_KEY = "shuffle_order"


class EpochOrder(Protocol):
    def take(self, epoch: int, lo: int, hi: int) -> np.ndarray:
        """The record indices at positions [lo, hi) of `epoch` (0 <= lo <= hi <= n)."""
        ...


class InOrder:
    """No shuffle: position p holds record p in every epoch."""

    def take(self, epoch: int, lo: int, hi: int) -> np.ndarray:
        return np.arange(lo, hi, dtype=np.int64)


class ColocarOrder:
    """A Philox permutation per (seed, epoch): colocar's order since its first release."""

    def __init__(self, num_records: int, seed: int):
        self.num_records = num_records
        self.seed = seed

    @functools.lru_cache(maxsize=2)  # noqa: B019 - an order lives as long as its pipeline
    def permutation(self, epoch: int) -> np.ndarray:
        rng = np.random.Generator(np.random.Philox(key=[self.seed, epoch]))
        return rng.permutation(self.num_records).astype(np.int64)

    def take(self, epoch: int, lo: int, hi: int) -> np.ndarray:
        return self.permutation(epoch)[lo:hi]


class GrainOrder:
    """grain's `MapDataset.source(range(n)).seed(seed).shuffle()`, epochs as its `.repeat()`.

    grain's shuffle maps the global index e*n + p to epoch e's position p (reseeded per epoch),
    so asking grain's dataset for that index gives the record, with grain's own code.
    """

    def __init__(self, num_records: int, seed: int):
        self.num_records = num_records
        self.seed = seed
        self._dataset: Any = None

    def dataset(self) -> Any:
        if self._dataset is None:
            import grain  # lazily: ~1-2 s, only where this order is used

            self._dataset = grain.MapDataset.source(range(self.num_records)).seed(self.seed).shuffle()
        return self._dataset

    def take(self, epoch: int, lo: int, hi: int) -> np.ndarray:
        ds, first = self.dataset(), epoch * self.num_records
        return np.fromiter((ds[first + p] for p in range(lo, hi)), dtype=np.int64, count=hi - lo)


def epoch_order(num_records: int, seed: int, shuffle: bool, kind: str = DEFAULT) -> EpochOrder:
    """The order a pipeline with these settings reads its records in."""
    if kind not in ORDERS:
        raise ValueError(f"shuffle_order must be one of {', '.join(map(repr, ORDERS))}, got {kind!r}")
    if not shuffle:
        return InOrder()
    return GrainOrder(num_records, seed) if kind == "grain" else ColocarOrder(num_records, seed)


def saved_order(state: dict[str, Any]) -> str:
    """The order a saved iterator state was read in (states before the key: ``colocar``)."""
    return str(state.get(STATE_KEY, DEFAULT))
