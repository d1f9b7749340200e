"""The elastic tests' records and pipeline config, without JAX: their record function is
pickled by reference, so the sidecars and pipeline workers import this module (not the
helpers, whose JAX import would cost each of them seconds of CPU).
"""

from __future__ import annotations

import numpy as np

DIM = 4
N = 240
B = 12
MiB = 1 << 20
W_TRUE = np.array([0.5, -1.0, 2.0, 0.25], np.float32)


def features(record):
    """Record i: its id, features and a target that depend on i alone."""
    i = int(record["index"])
    x = np.sin(np.arange(DIM, dtype=np.float32) * 0.37 + np.float32(i) * 0.11).astype(np.float32)
    y = np.float32(x @ W_TRUE + 0.01 * np.cos(i))
    return {"index": np.int32(i), "x": x, "y": y}


def config(**overrides):
    base = {
        "source": {"kind": "range", "n": N},
        "global_batch_size": B,
        "transforms": [{"kind": "map", "fn": features}],
        "seed": 3,
        "num_epochs": 1,
        "prefetch": 2,
        "workers_per_host": 1,
    }
    base.update(overrides)
    return base
