"""The ckpt benchmark's state and its two systems: colocar's `CheckpointManager` and Orbax's
`StandardCheckpointer`, each wrapped as a `System` and measured in one round (`*_round`).

Also the small-tree probe `rpcs_per_small_save`: the calls the sidecars serve for one
steady-state save of a small tree (`small`).
"""

from __future__ import annotations

import gc
import os
import shutil
from typing import Any, cast

import numpy as np

from colocar.bench.ckpt.measure import System, measure
from colocar.bench.ckpt.memory import Memory

LAYERS = 16
HOSTS = 2


# --- the state -------------------------------------------------------------------------------
def make_state(n: int, mesh: Any) -> dict[str, Any]:
    """`LAYERS` layers of random `w` f32[n, n] sharded P(data, model) and `b` f32[n] P(model)."""
    import jax
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    w_sharding, b_sharding = NamedSharding(mesh, P("data", "model")), NamedSharding(mesh, P("model"))
    rng = np.random.default_rng(0)
    state = {}
    for i in range(LAYERS):
        state[f"layer_{i:02d}"] = {
            "w": jax.device_put(rng.random((n, n), dtype=np.float32), w_sharding),
            "b": jax.device_put(rng.random((n,), dtype=np.float32), b_sharding),
        }
    return state


def host_bytes(state: dict[str, Any], devices: list[Any]) -> list[int]:
    """The bytes each host writes (replica 0 of every shard, by the host of its device)."""
    import jax

    per_host = len(devices) // HOSTS
    host_of = {d: i // per_host for i, d in enumerate(devices)}
    out = [0] * HOSTS
    for leaf in jax.tree.leaves(state):
        for shard in leaf.addressable_shards:
            if shard.replica_id == 0:
                out[host_of[shard.device]] += shard.data.nbytes
    return out


def abstract(state: dict[str, Any]) -> Any:
    """The restore target of `state`: shapes, dtypes and shardings."""
    import jax

    return jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=a.sharding), state)


def tiny(state: dict[str, Any]) -> dict[str, Any]:
    """A warm-up tree: zeros shaped and sharded like a layer's `b`."""
    import jax

    b = state["layer_00"]["b"]
    return {"b": jax.device_put(np.zeros(b.shape, np.float32), b.sharding)}


def small(state: dict[str, Any]) -> dict[str, Any]:
    """A small tree whose shards lie on both hosts: f32[64, 64] sharded like a layer's `w`."""
    import jax

    w = state["layer_00"]["w"]
    return {"w": jax.device_put(np.ones((64, 64), np.float32), w.sharding)}


def _devices(state: dict[str, Any]) -> list[Any]:
    """The state's devices in mesh order (host-major, as `local_cluster` splits them)."""
    return list(np.asarray(state["layer_00"]["w"].sharding.mesh.devices).flat)


def rpcs_per_small_save(state: dict[str, Any], directory: str) -> int:
    """Calls both sidecars served for one steady-state save + wait of `small(state)`."""
    import colocar
    from colocar.checkpoint import CheckpointManager

    tree = small(state)
    with colocar.local_cluster(hosts=HOSTS, devices=_devices(state), processes=0) as cluster:
        mngr = CheckpointManager(directory, cluster)
        try:
            mngr.save(0, tree)  # warm-up: writers, lease, pool sizes
            mngr.wait()
            before = sum(h.stats()["calls"] for h in cluster.hosts)
            mngr.save(1, tree)
            mngr.wait()
            return sum(h.stats()["calls"] for h in cluster.hosts) - before
        finally:
            mngr.close()


# --- the two systems -------------------------------------------------------------------------
class ColocarSystem(System):
    """colocar's `CheckpointManager` (in its layout); keeps the save stats of save 1 (`first`)."""

    def __init__(self, mngr: Any, state: dict[str, Any]):
        self.mngr, self.state, self.target = mngr, state, abstract(state)
        self.first: dict[str, Any] = {}  # the stats of save 1

    def save(self, k: int) -> None:
        self.mngr.save(k, self.state)

    def wait(self) -> None:
        self.mngr.wait()

    def path(self, k: int) -> str:
        name = str(k) if self.mngr.layout == "orbax" else f"step_{k:010d}"
        return os.path.join(self.mngr.directory, name)

    def restore(self, k: int) -> Any:
        return self.mngr.restore(k, target=self.target)

    def delete(self, k: int) -> None:
        if k == 1:
            self.first = self.mngr.stats()["save"]
        self.mngr.delete(k)


class OrbaxSystem(System):
    """Orbax's async `StandardCheckpointer`, one folder per save under `directory`."""

    def __init__(self, ckptr: Any, directory: str, state: dict[str, Any]):
        self.ckptr, self.directory, self.state, self.target = ckptr, directory, state, abstract(state)

    def save(self, k: int) -> None:
        self.ckptr.save(self.path(k), self.state)

    def wait(self) -> None:
        self.ckptr.wait_until_finished()

    def path(self, k: int) -> str:
        return os.path.join(self.directory, f"state_{k}")

    def restore(self, k: int) -> Any:
        return self.ckptr.restore(self.path(k), target=self.target)

    def delete(self, k: int) -> None:
        shutil.rmtree(self.path(k))


def colocar_round(
    memory: Memory, state: dict[str, Any], directory: str, arena: int, baseline_s: float, layout: str
) -> dict[str, Any]:
    """One colocar measurement in `layout`: a cluster of `HOSTS` sidecars started for it (after
    the memory baseline, so the sidecars count in full) and a manager warmed up with a tiny step."""
    import jax

    import colocar
    from colocar.checkpoint import CheckpointManager

    baseline = memory.baseline()
    devices = _devices(state)
    with colocar.local_cluster(hosts=HOSTS, devices=devices, arena_size=arena, processes=0) as cluster:
        mngr = CheckpointManager(directory, cluster, max_to_keep=None, layout=layout)
        try:
            warm = tiny(state)
            mngr.save(0, warm)
            mngr.wait()
            jax.block_until_ready(mngr.restore(0, target=abstract(warm)))
            gc.collect()
            system = ColocarSystem(mngr, state)
            m = measure(system, memory, baseline, state, baseline_s)
            m["arena_wait_s"] = system.first["arena_wait_seconds"]
            m["writer_durable_s"] = system.first["durable_seconds"] or 0.0
        finally:
            mngr.close()
    return m


def orbax_round(
    memory: Memory, ckptr: Any, state: dict[str, Any], directory: str, baseline_s: float
) -> dict[str, Any]:
    """One Orbax measurement with the run's (warm) checkpointer."""
    baseline = memory.baseline()
    return measure(OrbaxSystem(ckptr, directory, state), memory, baseline, state, baseline_s)


def orbax_checkpointer(state: dict[str, Any], directory: str) -> Any:
    """One `StandardCheckpointer` for the whole run, warmed up with a tiny save and restore."""
    import jax
    import orbax.checkpoint as ocp
    from absl import flags

    if not flags.FLAGS.is_parsed():  # orbax reads absl flags; a program without absl.app
        flags.FLAGS.mark_as_parsed()
    ckptr = ocp.StandardCheckpointer()
    warm = tiny(state)
    path = os.path.join(directory, "warmup")
    ckptr.save(path, warm)
    ckptr.wait_until_finished()
    jax.block_until_ready(ckptr.restore(path, target=abstract(warm)))
    shutil.rmtree(path)
    return ckptr


def _cpu_seconds(pids: list[int]) -> list[float]:
    """User + system CPU seconds each process has used (its threads included)."""
    import psutil

    return [sum(psutil.Process(pid).cpu_times()[:2]) for pid in pids]


def _timed_restore(restore: Any, pids: list[int]) -> tuple[float, list[float], Any]:
    """(wall seconds, CPU seconds of each of `pids` meanwhile, the restored tree)."""
    import time

    import jax

    cpu, started = _cpu_seconds(pids), time.perf_counter()
    restored = jax.block_until_ready(restore())
    wall = time.perf_counter() - started
    return wall, [b - a for a, b in zip(cpu, _cpu_seconds(pids), strict=True)], restored


def orbax_written_restores(
    ckptr: Any, state: dict[str, Any], root: str, arena: int, rounds: int
) -> dict[str, Any]:
    """A checkpoint Orbax wrote (`ckptr.save`, its default: OCDBT, zarr v2, zstd) restored by
    colocar through the sidecars and by Orbax itself, `rounds` times each (order alternating,
    warm page cache). Wall times, and CPU times: colocar's critical path were each host on its
    own cores is the busiest sidecar's CPU plus the controller's (`*_cpu_ratio`)."""
    import statistics

    import jax

    import colocar
    from colocar.bench.ckpt.measure import check
    from colocar.checkpoint import CheckpointManager

    path = os.path.join(root, "orbax-written")
    ckptr.save(path, state)
    ckptr.wait_until_finished()
    target, me = abstract(state), os.getpid()
    wall: dict[str, list[float]] = {"colocar": [], "orbax": []}
    cpu: dict[str, list[float]] = {"colocar": [], "orbax": []}
    with colocar.local_cluster(
        hosts=HOSTS, devices=_devices(state), arena_size=arena, processes=0
    ) as cluster:
        sidecars = [p.pid for p in cast(Any, cluster).processes]  # a LocalCluster's sidecar processes
        mngr = CheckpointManager(path, cluster)
        jax.block_until_ready(mngr.restore(None, target))  # warm-up: readers' imports, page cache
        for r in range(rounds):
            for system in ("colocar", "orbax") if r % 2 == 0 else ("orbax", "colocar"):
                if system == "colocar":
                    seconds, used, restored = _timed_restore(
                        lambda: mngr.restore(None, target), [me, *sidecars]
                    )
                    cpu[system].append(used[0] + max(used[1:]))
                else:
                    seconds, used, restored = _timed_restore(lambda: ckptr.restore(path, target=target), [me])
                    cpu[system].append(used[0])
                wall[system].append(seconds)
                check(restored, state)
                del restored
                gc.collect()
        mngr.close()
    shutil.rmtree(path)
    med = {k: statistics.median(v) for k, v in wall.items()}
    med_cpu = {k: statistics.median(v) for k, v in cpu.items()}
    return {
        "orbax_written_colocar_restore_s": round(med["colocar"], 3),
        "orbax_written_orbax_restore_s": round(med["orbax"], 3),
        "orbax_written_restore_ratio": round(med["colocar"] / med["orbax"], 3),
        "orbax_written_colocar_critical_cpu_s": round(med_cpu["colocar"], 3),
        "orbax_written_orbax_cpu_s": round(med_cpu["orbax"], 3),
        "orbax_written_restore_cpu_ratio": round(med_cpu["colocar"] / med_cpu["orbax"], 3),
        "orbax_written_colocar_restore_s_per_round": [round(t, 3) for t in wall["colocar"]],
        "orbax_written_orbax_restore_s_per_round": [round(t, 3) for t in wall["orbax"]],
    }
