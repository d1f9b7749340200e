"""The per-record pipeline (source -> map / random_map / filter), a pure function of the global record index.

It applies the transforms with the semantics of grain's `MapDataset` operations (`.map`, `.random_map`,
`.filter`), without their per-record bookkeeping (timers, output-spec recording, ~65 us per record,
as much as reading a 150 KB record): the records are identical to those of
`grain.MapDataset.source(src).map(...).random_map(..., seed=transform_seed(seed, n)).filter(...)`
(tests/test_loader_sources.py checks it against grain). Record `i`'s output depends only on the
source's record `i`, the transforms and the seed: never on which records were read before, in which
order, in which thread or process. `random_map` gets a `np.random.Generator` that is a Philox
generator keyed by the op's seed with its counter set to the element's index, as grain's does
(grain `transformations/map.py`, `_reset_rng_state`), so record `i` gets the same randomness whether
1, 2 or 4 hosts read it. This module runs on the sidecar, in worker processes; it never imports JAX.
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
    """Raised by a failing step; carries the step's name, the original error is `__cause__`."""

    def __init__(self, name: str, skippable: bool):
        super().__init__(name)
        self.name = name
        self.skippable = skippable


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


class _RngPool:
    """Generators for one random_map: Philox keyed by the op seed, counter reset to the record index.

    Exactly grain's `RngPool.acquire_rng(index)` (op_seed 0); reusing generators avoids building a
    Philox (a SeedSequence hash) per record. Thread-safe.
    """

    def __init__(self, seed: int):
        self._seed = seed
        self._free: list[np.random.Generator] = []
        self._lock = threading.Lock()

    def acquire(self, index: int) -> np.random.Generator:
        with self._lock:
            rng = self._free.pop() if self._free else np.random.Generator(np.random.Philox(self._seed))
        state: dict[str, Any] = dict(rng.bit_generator.state)
        state["state"]["counter"] = np.array([0, 0, 0, index], dtype=np.uint64)
        state["buffer"] = np.array([0, 0, 0, 0], dtype=np.uint64)
        state["buffer_pos"] = 4
        state["has_uint32"] = 0
        state["uinteger"] = 0
        rng.bit_generator.state = state
        return rng

    def release(self, rng: np.random.Generator) -> None:
        with self._lock:
            self._free.append(rng)


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
        if int(seed) < 0:
            raise ValueError(f"seed must be a non-negative integer, got {seed}")
        self.source = source
        self.seed = int(seed)
        self.skip_bad_records = skip_bad_records
        self.bad_records = 0
        self._lock = threading.Lock()
        self._n = len(source)
        self._source_name = f"source {type(source).__name__}"
        self.step_names: list[str] = []
        # (kind, fn, name, rng pool or None), applied in order
        self._steps: list[tuple[str, Callable[..., Any], str, _RngPool | None]] = []
        n_random = 0
        for position, entry in enumerate(transforms):
            if len(entry) not in (2, 3):
                raise ValueError(f"transform #{position} must be (kind, fn) or (kind, fn, name): {entry!r}")
            kind, fn = entry[0], entry[1]
            if not callable(fn):
                raise TypeError(f"transform #{position} ({kind}) is not callable: {fn!r}")
            if kind not in TRANSFORM_KINDS:
                raise ValueError(f"transform #{position}: unknown kind {kind!r}; expected {TRANSFORM_KINDS}")
            label = entry[2] if len(entry) == 3 else _fn_name(fn)
            name = f"transform #{position} {kind} {label}"
            pool = None
            if kind == "random_map":
                pool = _RngPool(transform_seed(self.seed, n_random))
                n_random += 1
            self._steps.append((kind, fn, name, pool))
            self.step_names.append(name)

    def __len__(self) -> int:
        return self._n

    def _apply(self, i: int) -> Any:
        """Record i through the steps (grain's semantics: None, a dropped record, passes through)."""
        try:
            record = self.source[i]
        except Exception as e:
            raise _StepFailure(self._source_name, skippable=False) from e
        for kind, fn, name, pool in self._steps:
            if record is None:
                return None
            try:
                if kind == "map":
                    record = fn(record)
                elif kind == "filter":
                    record = record if fn(record) else None
                else:
                    assert pool is not None
                    rng = pool.acquire(i)
                    record = fn(record, rng)
                    pool.release(rng)
            except Exception as e:
                raise _StepFailure(name, skippable=True) from e
        return record

    def __getitem__(self, index: int) -> Any:
        i = int(index)
        if i < 0 or i >= self._n:
            raise IndexError(f"record index {i} out of range for a pipeline of {self._n} records")
        try:
            return self._apply(i)
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
