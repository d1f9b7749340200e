"""The processes `colocar bench firstbatch` times: one training script's start, per system and mode.

`python -c "...; main()" SYSTEM MODE DIRECTORY` (see `benchmark.child_command`) with SYSTEM
`colocar` or `grain` and MODE `save` (set up: take `SAVED_STEP` batches, checkpoint the state
and the data iterator's state, record the labels of the batch after), `fresh` (first batch of a
new iterator) or `resume` (restore the checkpoint, the iterator's state included, then take the
first batch). The last stdout line is JSON: wall-clock times (`time.time()`) of the phases, the
first batch's labels and the process's own peak RSS (`ru_maxrss`, its children not counted).

colocar: `local_cluster(HOSTS)`, `loaders.load`, `checkpoint.CheckpointManager`. grain + Orbax:
`MapDataset` over the same ArrayRecord files, `mp_prefetch` with `HOSTS` worker processes,
`jax.device_put` of the batch, an Orbax `CheckpointManager` with the state and the iterator's
state (`JsonSave`). The same state (`state`) and the same decode (`decode`) on both sides.
"""

from __future__ import annotations

import glob
import json
import os
import resource
import sys
import time
from typing import Any

import numpy as np

HOSTS = 2  # colocar: sidecars x 1 worker each; grain: worker processes
SHAPE = (64, 64, 3)
RECORD_BYTES = 64 * 64 * 3
BATCH = 32
SEED = 5
SAVED_STEP = 3
STATE_ARRAYS = 4  # float32[512, 1024] each: 8 MiB of state


def decode(record: bytes) -> dict[str, Any]:
    """A record's image and label (runs in the pipeline workers, both systems)."""
    buf = np.frombuffer(record, dtype=np.uint8)
    return {"image": buf[:RECORD_BYTES].reshape(SHAPE), "label": buf[RECORD_BYTES:].view("<i4")[0]}


def _shardings() -> tuple[Any, dict[str, Any]]:
    import jax
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    mesh = jax.sharding.Mesh(np.array(jax.devices()), ("data",))
    rows = NamedSharding(mesh, P("data"))
    return mesh, {"image": rows, "label": rows}


def state(mesh: Any) -> dict[str, Any]:
    import jax
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    sharding = NamedSharding(mesh, P("data", None))
    return {
        f"w{i}": jax.device_put(np.full((512, 1024), i, np.float32), sharding) for i in range(STATE_ARRAYS)
    }


def _files(directory: str) -> list[str]:
    return sorted(glob.glob(os.path.join(directory, "data", "*.array_record")))


def _colocar(directory: str, mode: str, marks: dict[str, float]) -> Any:
    import colocar
    from colocar import loaders
    from colocar.checkpoint import CheckpointManager, abstract

    marks["imported"] = time.time()
    cluster = colocar.local_cluster(hosts=HOSTS, arena_size=64 << 20, processes=0)
    marks["cluster"] = time.time()
    mesh = cluster.mesh(("data",))
    config = {
        "source": {"kind": "array_record", "paths": os.path.join(directory, "data", "*.array_record")},
        "global_batch_size": BATCH,
        "transforms": [{"kind": "map", "fn": decode}],
        "shuffle": True,
        "seed": SEED,
        "num_epochs": None,
        "workers_per_host": 1,
    }
    it = loaders.load(config, cluster, mesh)
    marks["loader"] = time.time()
    mngr = CheckpointManager(os.path.join(directory, "colocar-ckpt"), cluster)
    if mode == "resume":
        restored = mngr.restore(target={"state": abstract(state(mesh)), "data": None})
        marks["restored"] = time.time()
        it.set_state(restored["data"])
        marks["state_set"] = time.time()
    batch = next(it)
    if mode == "save":
        for _ in range(SAVED_STEP - 1):
            next(it)
        mngr.save(SAVED_STEP, {"state": state(mesh), "data": it.get_state()})
        mngr.wait()
        batch = next(it)
    labels = [int(x) for x in np.asarray(batch["label"])]

    def close() -> None:
        it.close()
        mngr.close()
        cluster.close()

    return labels, close


def _grain_iter(directory: str) -> Any:
    import grain

    ds = grain.MapDataset.source(grain.sources.ArrayRecordDataSource(_files(directory)))
    ds = ds.shuffle(SEED).repeat().map(decode).batch(BATCH)
    read = grain.ReadOptions(num_threads=1, prefetch_buffer_size=2)
    return iter(ds.to_iter_dataset(read).mp_prefetch(grain.MultiprocessingOptions(num_workers=HOSTS)))


def _grain(directory: str, mode: str, marks: dict[str, float]) -> Any:
    import jax
    import orbax.checkpoint as ocp
    from absl import flags

    if not flags.FLAGS.is_parsed():  # grain and orbax read absl flags; no absl.app here
        flags.FLAGS.mark_as_parsed()
    marks["imported"] = time.time()
    mesh, shardings = _shardings()
    it = _grain_iter(directory)
    marks["loader"] = time.time()
    mngr = ocp.CheckpointManager(os.path.join(directory, "orbax-ckpt"), item_names=("state", "data"))
    if mode == "resume":
        target = jax.tree.map(ocp.utils.to_shape_dtype_struct, state(mesh))
        args = ocp.args.Composite(state=ocp.args.StandardRestore(target), data=ocp.args.JsonRestore())
        restored = mngr.restore(mngr.latest_step(), args=args)
        marks["restored"] = time.time()
        it.set_state(restored["data"])
        marks["state_set"] = time.time()
    batch = jax.block_until_ready(jax.device_put(next(it), shardings))
    if mode == "save":
        for _ in range(SAVED_STEP - 1):
            next(it)
        data = it.get_state()
        args = ocp.args.Composite(state=ocp.args.StandardSave(state(mesh)), data=ocp.args.JsonSave(data))
        mngr.save(SAVED_STEP, args=args)
        mngr.wait_until_finished()
        batch = jax.device_put(next(it), shardings)
    labels = [int(x) for x in np.asarray(batch["label"])]

    def close() -> None:
        mngr.close()
        getattr(it, "close", lambda: None)()

    return labels, close


def main(argv: list[str] | None = None) -> None:
    system, mode, directory = (sys.argv[1:] if argv is None else argv)[:3]
    marks: dict[str, float] = {}
    labels, close = {"colocar": _colocar, "grain": _grain}[system](directory, mode, marks)
    marks["first_batch"] = time.time()
    rss_mib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    close()
    print(json.dumps({"marks": marks, "labels": labels, "peak_rss_mib": round(rss_mib, 1)}), flush=True)
