"""What the loader tests share: a small range pipeline (its transforms run in the sidecars'
workers, which import this module), its expected batches, and ways to read batches.
"""

from __future__ import annotations

import numpy as np

from colocar.loaders.sampler import IndexSampler

N = 100
B = 16


def features(record):
    i = int(record["index"])
    return {"x": np.full((3,), i, np.float32), "label": np.int32(i)}


def noisy(record, rng):
    return {**record, "noise": np.float32(rng.random())}


def explode_on_seven(record):
    if int(record["index"]) % 10 == 7:
        raise ValueError("bad record")
    return record


def decode_int(record: bytes):
    return {"value": np.frombuffer(record, np.int64)[0]}


def config(**overrides):
    base = {
        "source": {"kind": "range", "n": N},
        "global_batch_size": B,
        "transforms": [{"kind": "map", "fn": features}, {"kind": "random_map", "fn": noisy}],
        "seed": 7,
        "num_epochs": 2,
        "prefetch": 3,
        "workers_per_host": 1,
    }
    base.update(overrides)
    return base


def labels(batch):
    return np.asarray(batch["label"]).tolist()


def expected_labels(k, **overrides):
    c = config(**overrides)
    s = IndexSampler(
        N, B, seed=c["seed"], num_epochs=c["num_epochs"], drop_remainder=c.get("drop_remainder", True)
    )
    return s.batch_indices(k).tolist()


def take(it, n, view=lambda b: b):
    """The next n batches through `view`; keep `view` small so the ring is not starved."""
    return [view(next(it)) for _ in range(n)]


def row_values(batch):
    return labels(batch), np.asarray(batch["noise"]).tolist()


def heavy_modules(record):
    """A record's bytes as `x`, and whether the process running this transform has imported
    JAX or grain (`heavy`): a pipeline over ArrayRecord files needs neither."""
    import sys

    heavy = any(name in sys.modules for name in ("jax", "grain"))
    return {"x": np.frombuffer(record, np.uint8)[:4].copy(), "heavy": np.int8(heavy)}


def source_failing_on_host1():
    """A range source of N records, except on the sidecar labelled host1 (its command line
    names it; its workers' does not), where opening it fails."""
    import sys

    from colocar.loaders.sources import RangeSource

    if "host1" in sys.argv:
        raise OSError("host1 cannot open the source")
    return RangeSource(N)
