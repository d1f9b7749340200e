"""The order of the record indices within an epoch: the one part of the sampler that shuffles.

Runs anywhere (pure index math). The config's `shuffle` and `shuffle_order` pick one of:

- no shuffle: ``0 .. n-1``, whatever `shuffle_order` says;
- ``colocar`` (the default): numpy's `permutation` of a Philox generator keyed by (seed, epoch),
  made once per epoch (a table of n int64);
- ``grain``: grain's order, ``grain.MapDataset.source(range(n)).seed(seed).shuffle()``, epoch e
  being grain's reshuffled epoch e of ``.repeat()`` (grain reseeds its shuffle with seed + e).
  It is computed one position at a time (no table: a batch costs its rows) by grain's own
  `index_shuffle` with the seed grain's shuffle holds, once both are checked against grain's
  public API on a sample of positions; where this grain version lacks them or differs, by the
  public API itself (several times slower: grain's per-element bookkeeping). grain is imported
  only here, on the first batch, so that a sidecar that never uses this order does not pay for it.

A saved iterator state names its order (`STATE_KEY`); states from before the key read as
``colocar``, the only order they could have had.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
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
    so grain's dataset, asked for that index, gives the record. `fast=False` always asks it.
    """

    def __init__(self, num_records: int, seed: int, fast: bool = True):
        self.num_records = num_records
        self.seed = seed
        self.fast = fast
        self._index: Callable[[int], int] | None = None

    def index(self) -> Callable[[int], int]:
        """Global index -> record: grain's own functions, checked, else its public API."""
        if self._index is None:
            import grain  # lazily: ~1-2 s, only where this order is used

            ds = grain.MapDataset.source(range(self.num_records)).seed(self.seed).shuffle()
            self._index = (_grain_internals(ds, self.num_records) if self.fast else None) or ds.__getitem__
        return self._index

    def take(self, epoch: int, lo: int, hi: int) -> np.ndarray:
        index, first = self.index(), epoch * self.num_records
        return np.fromiter((index(first + p) for p in range(lo, hi)), dtype=np.int64, count=hi - lo)


def _grain_internals(ds: Any, n: int) -> Callable[[int], int] | None:
    """`ds`'s order from grain's `index_shuffle` and the seed its shuffle holds (what its
    `_shuffled_index` does, without the per-element bookkeeping), if they give what `ds` gives
    on a sample of positions over three epochs; None where this grain version differs."""
    try:
        from grain._src.python.experimental.index_shuffle.python import index_shuffle_module

        shuffle, seed = index_shuffle_module.index_shuffle, int(ds._seed)

        def index(i: int) -> int:
            epoch, p = divmod(i, n)
            return int(shuffle(p, max_index=n - 1, seed=(seed + epoch) % 2**32, rounds=4))

        sample = [e * n + p for e in (0, 1, 9) for p in range(min(n, 48))]
        if all(index(i) == ds[i] for i in sample):
            return index
    except Exception:  # noqa: BLE001 - another grain version: its public API instead
        pass
    return None


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
