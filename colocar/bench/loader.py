"""Input pipelines: colocar's sidecar loaders against grain `mp_prefetch` in the training process.

Data: ArrayRecord files written once into a temporary directory (removed afterwards); each record
is a 224x224x3 uint8 image (random bytes) followed by an int32 label (`encode`). Every batch is 64
records: `image` uint8[64, 224, 224, 3] and `label` int32[64], sharded on the batch axis over the 8
CPU devices of the training process (`XLA_FLAGS=--xla_force_host_platform_device_count=8`).

Two pipelines, the same functions on both sides (module-level, so they pickle by reference):

* `transfer`: `decode` only (np.frombuffer + reshape): the cost is moving ~9.6 MB per batch.
* `compute`: `decode`, then `augment`, a few milliseconds of float32 numpy per record.

Three ways to feed the training process, W=2 pipeline processes in total for each:

* `grain`: `MapDataset.source(ArrayRecordDataSource).shuffle(seed).repeat().map(...).batch(64)
  .to_iter_dataset(ReadOptions(...)).mp_prefetch(MultiprocessingOptions(num_workers=2))`, then
  `jax.device_put(batch, shardings)` in the training process.
* `colocar1`: `colocar.loaders.load` with 1 sidecar x `workers_per_host=2`.
* `colocar2`: 2 sidecars x `workers_per_host=1` (4 CPU devices each).

Each measurement starts a fresh iterator, takes `warmup` batches (process start, buffers drained
to their steady state), then times `n` batches: batches/s from wall time, and the CPU seconds of
the training process per batch (`time.process_time()`, all its threads; grain's worker processes
and colocar's sidecars are not counted). Each system brings up only its own machinery (a colocar
system starts its cluster before its two measurements of a round and closes it after them), so
no system's figure includes another's idle threads. Each batch is held like a training step
would hold it (`jax.block_until_ready`) and dropped before the next is taken. Measurements are interleaved
(one of each per round, order rotating) and the figures are medians over rounds (at least 5;
2 with --quick, which also writes fewer records and times fewer batches). Ratios take the
WORSE of 1 and 2 sidecars: `transfer_ratio` / `compute_ratio` = min(colocar) / grain batches/s,
`trainer_cpu_ratio` = the largest colocar / grain training-process CPU per batch of both pipelines.
"""

from __future__ import annotations

from colocar.bench import request_cpu_devices

_DEVICES_FLAG = request_cpu_devices(8)  # before JAX starts (`colocar bench` imports this module first)

import gc  # noqa: E402
import glob  # noqa: E402
import os  # noqa: E402
import shutil  # noqa: E402
import statistics  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from collections.abc import Callable  # noqa: E402
from dataclasses import dataclass  # noqa: E402
from typing import Any  # noqa: E402

import numpy as np  # noqa: E402

IMAGE_SHAPE = (224, 224, 3)
IMAGE_BYTES = 224 * 224 * 3
BATCH = 64
WORKERS = 2  # pipeline processes in total, for every system
SEED = 3
AUGMENT_PASSES = 24  # ~3 ms per record on this machine's cores
MiB = 1 << 20
ARENA = 96 * MiB  # each sidecar's arena: the ring of prefetched batches
SYSTEMS = ("grain", "colocar1", "colocar2")
PIPELINES = ("transfer", "compute")


@dataclass(frozen=True)
class Sizes:
    """How much one run measures: records written (`files` x `per_file`), batches taken before
    (`warmup`) and during (`batches`) each timed measurement, per pipeline, and the bounds on
    the number of rounds (`repeats` clamped to them)."""

    files: int
    per_file: int
    warmup: dict[str, int]
    batches: dict[str, int]
    min_rounds: int
    max_rounds: int | None

    def rounds(self, repeats: int) -> int:
        rounds = max(self.min_rounds, repeats)
        return rounds if self.max_rounds is None else min(rounds, self.max_rounds)


# The one place for the sizes: `--quick` (QUICK) and a full run (FULL).
QUICK = Sizes(
    files=2,
    per_file=128,
    warmup={"transfer": 8, "compute": 4},
    batches={"transfer": 30, "compute": 8},
    min_rounds=1,  # each round starts grain twice and a 1- and a 2-sidecar cluster: ~20 s
    max_rounds=2,  # the default `--repeats` gives two
)
FULL = Sizes(
    files=2,
    per_file=256,
    warmup={"transfer": 10, "compute": 6},
    batches={"transfer": 200, "compute": 40},
    min_rounds=5,
    max_rounds=None,
)


# --- the record format and the per-record transforms (run in pipeline workers) --------------
def encode(image: np.ndarray, label: int) -> bytes:
    return image.tobytes() + np.int32(label).astype("<i4").tobytes()


def decode(record: bytes) -> dict[str, Any]:
    """Cheap: views over the record's bytes (the copy into the batch is the only one)."""
    buf = np.frombuffer(record, dtype=np.uint8)
    return {"image": buf[:IMAGE_BYTES].reshape(IMAGE_SHAPE), "label": buf[IMAGE_BYTES:].view("<i4")[0]}


def augment(record: dict[str, Any]) -> dict[str, Any]:
    """A few milliseconds of float32 numpy on the image, back to uint8."""
    x = record["image"].astype(np.float32)
    for _ in range(AUGMENT_PASSES):
        np.multiply(x, 0.97, out=x)
        np.add(x, 3.0, out=x)
        np.sqrt(x, out=x)
        np.multiply(x, 16.0, out=x)
    np.clip(x, 0.0, 255.0, out=x)
    return {"image": x.astype(np.uint8), "label": record["label"]}


TRANSFORMS: dict[str, list[Callable[..., Any]]] = {"transfer": [decode], "compute": [decode, augment]}


def write_records(directory: str, files: int, per_file: int) -> str:
    """ArrayRecord files of random images; returns their glob."""
    from array_record.python.array_record_module import ArrayRecordWriter

    rng = np.random.default_rng(0)
    for f in range(files):
        writer = ArrayRecordWriter(os.path.join(directory, f"images-{f:02d}.array_record"), "group_size:1")
        for i in range(per_file):
            image = rng.integers(0, 256, IMAGE_SHAPE, dtype=np.uint8)
            writer.write(encode(image, f * per_file + i))
        writer.close()
    return os.path.join(directory, "images-*.array_record")


# --- the three feeders: (start, next, close) -------------------------------------------------
class _Grain:
    """grain's multiprocessing prefetch in the training process, then `jax.device_put`."""

    def __init__(self, pattern: str, pipeline: str, shardings: dict[str, Any]):
        import grain
        from absl import flags

        if not flags.FLAGS.is_parsed():  # grain reads absl flags; a program without absl.app
            flags.FLAGS.mark_as_parsed()
        files = sorted(glob.glob(pattern))
        ds = grain.MapDataset.source(grain.sources.ArrayRecordDataSource(files)).shuffle(SEED).repeat()
        for fn in TRANSFORMS[pipeline]:
            ds = ds.map(fn)
        # One reader thread and a small buffer per worker: grain's defaults (16 threads, 500
        # elements) would buffer hundreds of 9.6 MB batches in each worker.
        read = grain.ReadOptions(num_threads=1, prefetch_buffer_size=2)
        it = (
            ds.batch(BATCH)
            .to_iter_dataset(read)
            .mp_prefetch(grain.MultiprocessingOptions(num_workers=WORKERS))
        )
        self._it = iter(it)
        self._shardings = shardings

    def next(self) -> Any:
        import jax

        return jax.device_put(next(self._it), self._shardings)

    def close(self) -> None:
        self._it.close()


class _Colocar:
    """colocar's loader on a cluster started before the clock runs (see `_rounds`)."""

    def __init__(self, pattern: str, pipeline: str, cluster: Any):
        from colocar import loaders

        config = {
            "source": {"kind": "array_record", "paths": pattern},
            "global_batch_size": BATCH,
            "transforms": [{"kind": "map", "fn": fn} for fn in TRANSFORMS[pipeline]],
            "shuffle": True,
            "seed": SEED,
            "num_epochs": None,
            "workers_per_host": WORKERS // len(cluster.hosts),
            "prefetch": 4,
        }
        self.it = loaders.load(config, cluster, cluster.mesh(("data",)), starve_timeout=600.0)

    def next(self) -> Any:
        return next(self.it)

    def close(self) -> None:
        self.it.close()


def _take(feeder: Any, n: int) -> None:
    """Takes `n` batches, each held like a training step would (until ready) and dropped
    before the next is taken."""
    import jax

    for _ in range(n):
        batch = feeder.next()
        jax.block_until_ready(batch)
        del batch


def _measure(make: Callable[[], Any], warmup: int, n: int) -> dict[str, float]:
    """A fresh feeder from `make`: `warmup` batches, then `n` timed ones (batches/s, training
    process CPU ms and, for colocar, ms waited on the loader per batch)."""
    feeder = make()
    try:
        _take(feeder, warmup)
        wait0 = getattr(getattr(feeder, "it", None), "wait_seconds", 0.0)
        cpu0, t0 = time.process_time(), time.perf_counter()
        _take(feeder, n)
        t1, cpu1 = time.perf_counter(), time.process_time()
        wait1 = getattr(getattr(feeder, "it", None), "wait_seconds", 0.0)
    finally:
        feeder.close()
        del feeder
        gc.collect()
    return {"bps": n / (t1 - t0), "cpu_ms": (cpu1 - cpu0) / n * 1e3, "wait_ms": (wait1 - wait0) / n * 1e3}


def _per_record_ms(pipeline: str, pattern: str) -> float:
    from grain.sources import ArrayRecordDataSource

    source = ArrayRecordDataSource(sorted(glob.glob(pattern)))
    records = [source[i] for i in range(8)]
    times = []
    for _ in range(3):
        for record in records:
            t0 = time.perf_counter()
            out: Any = record
            for fn in TRANSFORMS[pipeline]:
                out = fn(out)
            np.ascontiguousarray(out["image"])
            times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


def _shardings(devices: list[Any]) -> dict[str, Any]:
    """A batch's shardings: both leaves split on the batch axis over all `devices`."""
    import jax
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    mesh = jax.sharding.Mesh(np.array(devices), ("data",))
    return {
        "image": NamedSharding(mesh, P("data", None, None, None)),
        "label": NamedSharding(mesh, P("data")),
    }


def _rounds(
    pattern: str, devices: list[Any], sizes: Sizes, rounds: int
) -> dict[tuple[str, str], list[dict[str, float]]]:
    """Every (pipeline, system)'s measurements, one per round; the systems' order rotates.

    A colocar system's cluster is started before its two measurements of the round and closed
    after them, so the training process's CPU of one system never includes another's idle
    threads (grain brings up nothing but its own workers)."""
    import colocar

    shardings = _shardings(devices)
    results: dict[tuple[str, str], list[dict[str, float]]] = {(p, s): [] for p in PIPELINES for s in SYSTEMS}
    for r in range(rounds):
        for system in SYSTEMS[r % 3 :] + SYSTEMS[: r % 3]:
            hosts = {"colocar1": 1, "colocar2": 2}.get(system)
            cluster = None
            if hosts is not None:
                cluster = colocar.local_cluster(hosts=hosts, devices=devices, arena_size=ARENA, processes=0)
            try:
                for pipeline in PIPELINES:
                    if cluster is None:
                        make: Callable[[], Any] = lambda: _Grain(pattern, pipeline, shardings)  # noqa: B023
                    else:
                        make = lambda: _Colocar(pattern, pipeline, cluster)  # noqa: B023
                    m = _measure(make, sizes.warmup[pipeline], sizes.batches[pipeline])
                    results[(pipeline, system)].append(m)
            finally:
                if cluster is not None:
                    cluster.close()
    return results


def _summary(
    head: dict[str, Any],
    sizes: Sizes,
    per_record: dict[str, float],
    results: dict[tuple[str, str], list[dict[str, float]]],
) -> dict[str, Any]:
    """The result: `head`, then per pipeline the medians over rounds and the ratios to grain."""

    def med(pipeline: str, system: str, key: str) -> float:
        return statistics.median(m[key] for m in results[(pipeline, system)])

    out = dict(head)
    for pipeline in PIPELINES:
        out[f"{pipeline}_record_ms"] = round(per_record[pipeline], 3)
        out[f"{pipeline}_warmup_batches"] = sizes.warmup[pipeline]
        out[f"{pipeline}_timed_batches"] = sizes.batches[pipeline]
        for system in SYSTEMS:
            out[f"{pipeline}_{system}_bps"] = round(med(pipeline, system, "bps"), 1)
        for system in SYSTEMS:
            out[f"{pipeline}_{system}_cpu_ms"] = round(med(pipeline, system, "cpu_ms"), 2)
        for system in SYSTEMS[1:]:
            out[f"{pipeline}_{system}_wait_ms"] = round(med(pipeline, system, "wait_ms"), 2)
        worst_bps = min(med(pipeline, s, "bps") for s in SYSTEMS[1:])
        worst_cpu = max(med(pipeline, s, "cpu_ms") for s in SYSTEMS[1:])
        out[f"{pipeline}_ratio"] = round(worst_bps / med(pipeline, "grain", "bps"), 3)
        out[f"{pipeline}_cpu_ratio"] = round(worst_cpu / med(pipeline, "grain", "cpu_ms"), 3)
    out["trainer_cpu_ratio"] = max(out["transfer_cpu_ratio"], out["compute_cpu_ratio"])
    for pipeline in PIPELINES:
        for system in SYSTEMS:
            out[f"{pipeline}_{system}_bps_per_round"] = [
                round(m["bps"], 1) for m in results[(pipeline, system)]
            ]
    return out


def run(quick: bool, repeats: int) -> dict:
    """Writes the records, times each transform alone, then runs the rounds (`_rounds`)."""
    import jax

    devices = jax.devices("cpu")
    if len(devices) < 2 or BATCH % len(devices) or len(devices) % 2:
        raise RuntimeError(
            f"the loader benchmark needs an even number of CPU devices dividing {BATCH}, got "
            f"{len(devices)}: set XLA_FLAGS={_DEVICES_FLAG} before JAX is imported"
        )
    sizes = QUICK if quick else FULL
    rounds = sizes.rounds(repeats)
    directory = tempfile.mkdtemp(prefix="colocar-bench-loader-")
    try:
        pattern = write_records(directory, sizes.files, sizes.per_file)
        per_record = {p: _per_record_ms(p, pattern) for p in PIPELINES}
        results = _rounds(pattern, devices, sizes, rounds)
    finally:
        shutil.rmtree(directory, ignore_errors=True)
    head: dict[str, Any] = {
        "benchmark": "loader",
        "quick": quick,
        "rounds": rounds,
        "records": sizes.files * sizes.per_file,
        "batch": f"{BATCH} x uint8[224,224,3] + int32 label, {len(devices)} CPU devices",
        "workers_total": WORKERS,
    }
    return _summary(head, sizes, per_record, results)
