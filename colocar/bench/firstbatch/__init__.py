"""Time to the first batch, from a training script's start: colocar against grain + Orbax.

Every measurement is a fresh Python process (`systems.py`), so imports, the sidecars'
start (colocar) and the worker processes' start count, as they do for a job that starts or
restarts. `fresh`: the script's start (just before the parent starts the process) to the first
batch as global jax.Arrays in hand. `resume`: the same, with a restore of the checkpoint (8 MiB
of state and the data iterator's state) before the first batch; the batch must be the one after
the saved step (checked against the labels the saving run recorded). `peak_rss_mib`: the
training process's own peak RSS (sidecars and grain workers not counted).

Data: ArrayRecord files of uint8[64, 64, 3] images + an int32 label, batches of 32 sharded over
8 CPU devices; colocar runs 2 sidecars x 1 worker, grain 2 worker processes (`mp_prefetch`).
Measurements alternate between the systems; figures are medians over the repeats, ratios
colocar / grain+Orbax (below 1: colocar is faster / smaller).

The package: `benchmark.py` writes the data, starts the measured processes and sums them up
(`run`); `systems.py` is what runs in those processes (`main`: one training script's start,
per system and mode). `run` is imported from `benchmark.py` only when asked for: a measured
process imports `systems.py` alone.
"""

from __future__ import annotations

from typing import Any


def __getattr__(name: str) -> Any:
    if name == "run":
        import importlib

        return importlib.import_module(".benchmark", __name__).run
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
