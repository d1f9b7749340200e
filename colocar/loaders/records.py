"""The per-record pipeline (source -> map / random_map / filter), a pure function of the global record index.

Built with grain's `MapDataset` operations. Record `i`'s output depends only on the source's record
`i`, the transforms and the seed: never on which records were read before, in which order, in which
thread or process. grain's `random_map` gives the transform a `np.random.Generator` that is a Philox
generator keyed by the op's seed with its counter set to the element's index (grain
`transformations/map.py`, `_reset_rng_state`), so record `i` gets the same randomness whether 1, 2 or 4
hosts read it. This module runs on the sidecar, in worker processes; it imports grain lazily and never
JAX.
"""

from __future__ import annotations

import threading
import traceback
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

TRANSFORM_KINDS = ("map", "random_map", "filter")


class RecordError(Exception):
    """A transform (or the source) failed on one record; the message names the record index and the step.

    The original exception is the `__cause__`; its formatted traceback is also kept in
    `cause_traceback`, because `__cause__` does not survive pickling to another process.
    """

    def __init__(
        self, message: str, index: int | None = None, transform: str | None = None, cause_traceback: str = ""
    ):
        super().__init__(message)
        self.index = index
        self.transform = transform
        self.cause_traceback = cause_traceback

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), (str(self), self.index, self.transform, self.cause_traceback))


class _StepFailure(Exception):
    """Raised through grain by a wrapped step; carries the step's name, the original error is `__cause__`."""

    def __init__(self, name: str, skippable: bool):
        super().__init__(name)
        self.name = name
        self.skippable = skippable


class _Step:
    """A transform wrapped so that its failure is attributed to it (a class, not a closure: picklable)."""

    def __init__(self, name: str, fn: Callable[..., Any]):
        self.name = name
        self.fn = fn

    def __call__(self, *args: Any) -> Any:
        try:
            return self.fn(*args)
        except Exception as e:
            raise _StepFailure(self.name, skippable=True) from e


class _GuardedSource:
    """The source, with read failures attributed to it (they are not skippable: usually I/O, not data)."""

    def __init__(self, source: Any):
        self._source = source
        self._n = len(source)

    def __len__(self) -> int:
        return self._n

    def __getitem__(self, index: int) -> Any:
        try:
            return self._source[index]
        except Exception as e:
            raise _StepFailure(f"source {type(self._source).__name__}", skippable=False) from e


def transform_seed(seed: int, ordinal: int) -> int:
    """The seed of the `ordinal`-th random_map (0-based) of a pipeline seeded with `seed`.

    Why: grain's rng depends only on (op seed, index), so two random_maps given the same seed would draw
    identical streams for a record. Deriving one seed per random_map keeps them independent, and counting
    only random_maps means adding a plain map or filter does not change any record's randomness.
    """
    state = np.random.SeedSequence([int(seed), int(ordinal)]).generate_state(1, dtype=np.uint32)
    return int(state[0])


def _fn_name(fn: Any) -> str:
    module = getattr(fn, "__module__", None)
    qualname = getattr(fn, "__qualname__", None) or getattr(type(fn), "__qualname__", repr(fn))
    return f"{module}:{qualname}" if module else str(qualname)


class RecordPipeline:
    """Source plus per-record transforms; `pipeline[i]` is the transformed record of global index `i`.

    transforms: `(kind, fn)` or `(kind, fn, name)` with kind in "map" (fn(record) -> record),
    "random_map" (fn(record, rng: np.random.Generator) -> record) or "filter" (fn(record) -> bool);
    `name` (default: the function's module:qualname) is what error messages call the step.
    `pipeline[i]` is None when a filter dropped the record (or a map returned None).

    A transform that raises makes `pipeline[i]` raise RecordError naming `i` and the transform; with
    `skip_bad_records=True` the record becomes None instead and `bad_records` counts it. Skipping is
    deterministic too: the same records fail wherever they are read. `bad_records` counts failed reads
    in this process (a bad record read twice counts twice); it is thread-safe.
    """

    def __init__(
        self, source: Any, transforms: Sequence[tuple[Any, ...]], seed: int, skip_bad_records: bool = False
    ):
        import grain  # type: ignore[import-not-found]

        if int(seed) < 0:
            raise ValueError(f"seed must be a non-negative integer, got {seed}")
        self.source = source
        self.seed = int(seed)
        self.skip_bad_records = skip_bad_records
        self.bad_records = 0
        self._lock = threading.Lock()
        self._n = len(source)
        ds = grain.MapDataset.source(_GuardedSource(source))
        self.step_names: list[str] = []
        n_random = 0
        for position, entry in enumerate(transforms):
            if len(entry) not in (2, 3):
                raise ValueError(f"transform #{position} must be (kind, fn) or (kind, fn, name): {entry!r}")
            kind, fn = entry[0], entry[1]
            if not callable(fn):
                raise TypeError(f"transform #{position} ({kind}) is not callable: {fn!r}")
            label = entry[2] if len(entry) == 3 else _fn_name(fn)
            step = _Step(f"transform #{position} {kind} {label}", fn)
            if kind == "map":
                ds = ds.map(step)
            elif kind == "random_map":
                ds = ds.random_map(step, seed=transform_seed(self.seed, n_random))
                n_random += 1
            elif kind == "filter":
                ds = ds.filter(step)
            else:
                raise ValueError(f"transform #{position}: unknown kind {kind!r}; expected {TRANSFORM_KINDS}")
            self.step_names.append(step.name)
        self._dataset = ds

    def __len__(self) -> int:
        return self._n

    def __getitem__(self, index: int) -> Any:
        i = int(index)
        if i < 0 or i >= self._n:  # grain's source would wrap the index modulo the length
            raise IndexError(f"record index {i} out of range for a pipeline of {self._n} records")
        try:
            return self._dataset[i]
        except _StepFailure as failure:
            cause = failure.__cause__
            if self.skip_bad_records and failure.skippable:
                with self._lock:
                    self.bad_records += 1
                return None
            assert cause is not None
            tb = "".join(traceback.format_exception(cause))
            raise RecordError(
                f"record {i}: {failure.name} raised {type(cause).__name__}: {cause}",
                index=i,
                transform=failure.name,
                cause_traceback=tb,
            ) from cause

    def __repr__(self) -> str:
        return f"RecordPipeline(n={self._n}, steps={self.step_names}, seed={self.seed})"
