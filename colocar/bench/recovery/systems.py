"""The recovery benchmark's parts: the state, the snapshot's costs, and the three recoveries.

`costs` measures, before the kill, what snapshots and a storage save cost the training loop;
`ram`, `storage` and `orbax` each bring the state back onto the survivors' mesh after it and
run one training step (`Survivors.step`, compiled beforehand).
"""

from __future__ import annotations

import gc
import statistics
import time
from dataclasses import dataclass
from typing import Any

import numpy as np

from colocar.bench.ckpt.measure import loop_until, steps_for

LAYERS = 16
COLS = 2048
HOSTS = 4


# --- the state -------------------------------------------------------------------------------
def make_state(rows: int, devices: list[Any]) -> dict[str, Any]:
    """`LAYERS` layers of random `w` f32[rows, COLS] sharded by rows over the 8 devices and a
    replicated `b` f32[COLS] (the names `ckpt.systems.tiny` expects)."""
    import jax
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    mesh = Mesh(np.array(devices), ("data",))
    rng = np.random.default_rng(0)
    state = {}
    for i in range(LAYERS):
        state[f"layer_{i:02d}"] = {
            "w": jax.device_put(rng.random((rows, COLS), dtype=np.float32), NamedSharding(mesh, P("data"))),
            "b": jax.device_put(rng.random((COLS,), dtype=np.float32), NamedSharding(mesh, P())),
        }
    return state


def host_shards(state: dict[str, Any], devices: list[Any]) -> list[list[Any]]:
    """The shards each host holds (replica 0 of every shard, by the host of its device)."""
    import jax

    per_host = len(devices) // HOSTS
    host_of = {d: i // per_host for i, d in enumerate(devices)}
    out: list[list[Any]] = [[] for _ in range(HOSTS)]
    for leaf in jax.tree.leaves(state):
        for shard in leaf.addressable_shards:
            if shard.replica_id == 0:
                out[host_of[shard.device]].append(shard.data)
    return out


def memcpy_s(shards: list[Any], repeats: int) -> float:
    """Median time of one `np.copyto` of `shards` (a host's share) into a pre-faulted buffer."""
    views = [np.asarray(s).reshape(-1).view(np.uint8) for s in shards]
    dst = np.ones(sum(v.nbytes for v in views), np.uint8)
    times = []
    for _ in range(repeats):
        t0, offset = time.perf_counter(), 0
        for v in views:
            np.copyto(dst[offset : offset + v.nbytes], v)
            offset += v.nbytes
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


@dataclass
class Survivors:
    """The mesh of the hosts left after the kill: the restore target (rows sharded over the 6
    devices), the state resharded onto it (to check restores, untimed) and the training step
    (`x + 1` on every array) compiled for it before the kill."""

    target: Any
    expected: Any
    compiled: Any

    @classmethod
    def of(cls, state: dict[str, Any], devices: list[Any]) -> Survivors:
        import jax
        from jax.sharding import Mesh, NamedSharding
        from jax.sharding import PartitionSpec as P

        mesh = Mesh(np.array(devices), ("data",))

        def spec(a: Any) -> Any:
            sharding = NamedSharding(mesh, P("data") if a.ndim == 2 else P())
            return jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sharding)

        target = jax.tree.map(spec, state)
        expected = jax.device_put(state, jax.tree.map(lambda t: t.sharding, target))
        compiled = jax.jit(lambda s: jax.tree.map(lambda a: a + 1, s)).lower(target).compile()
        # one step before the kill, as training ran steps then: the first recovery after it
        # does not pay alone for first-touching the output's memory (expensive in this VM)
        jax.block_until_ready(compiled(expected))
        return cls(target, expected, compiled)

    def step(self, restored: Any) -> None:
        """One training step on the restored state, finished."""
        import jax

        jax.block_until_ready(self.compiled(restored))

    def check(self, restored: Any, system: str) -> None:
        """Restored == the state, on the target's shardings (untimed)."""
        import jax
        import jax.numpy as jnp

        equal = jax.jit(lambda a, b: jnp.all(a == b))
        for path, got in jax.tree_util.tree_leaves_with_path(restored):
            want = self.expected
            for key in path:
                want = want[key.key]
            if got.sharding != want.sharding or not bool(equal(got, want)):
                raise AssertionError(f"{system}: {jax.tree_util.keystr(path)} restored wrong")


def warm_up(cluster: Any, pool: str, directory: str, devices: list[Any], left: list[Any]) -> None:
    """Untimed: a tiny tree snapshotted and checkpointed, each restored onto the survivors'
    devices, so that no recovery pays the controller's first restore (imports, setup) alone,
    as Orbax's checkpointer was warmed up (`ckpt.systems.orbax_checkpointer`)."""
    import jax
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    from colocar.checkpoint import CheckpointManager
    from colocar.elastic.snapshots import Snapshots

    sharding = NamedSharding(Mesh(np.array(devices), ("data",)), P("data"))
    tree = {"w": jax.device_put(np.ones((48, COLS), np.float32), sharding)}
    to = NamedSharding(Mesh(np.array(left), ("data",)), P("data"))
    target = {"w": jax.ShapeDtypeStruct((48, COLS), np.float32, sharding=to)}
    with Snapshots(cluster, replicas=1, pool=pool) as snaps:
        assert snaps.take(0, tree), "the warm-up snapshot was skipped"
        snaps.wait(600)
        jax.block_until_ready(snaps.restore(0, target))
    mngr = CheckpointManager(directory, cluster)
    try:
        mngr.save(0, tree)
        mngr.wait()
        jax.block_until_ready(mngr.restore(0, target=target))
    finally:
        mngr.close()


# --- the snapshot's cost to training ---------------------------------------------------------
def slowdown(loop_s: float, n: int, step_s: float) -> float:
    """Mean step time in the loop / baseline step time - 1 (0 when the loop ran no step)."""
    return (loop_s / n) / step_s - 1 if n else 0.0


def snapshot_costs(snaps: Any, state: dict[str, Any], takes: int, baseline_s: float) -> dict[str, Any]:
    """A warm-up take (opens the peer sessions), then `takes` timed ones (blocked time each,
    replication waited for, idle caller), then one more with the training loop running from
    the moment `take` returned until its replicas are committed (the slowdown)."""
    assert snaps.take(0, state), "the warm-up snapshot was skipped (pool too small)"
    snaps.wait(600)
    blocked, replication = [], []
    for k in range(1, takes + 1):
        gc.collect()
        t0 = time.monotonic()
        assert snaps.take(k, state), f"snapshot {k} was skipped (pool too small)"
        blocked.append(time.monotonic() - t0)
        snaps.wait(600)
        replication.append(time.monotonic() - t0)
    step_s = steps_for(baseline_s)
    assert snaps.take(takes + 1, state), "the last snapshot was skipped (pool too small)"
    loop_s, n = loop_until(lambda: snaps.wait(600))
    stats = snaps.stats()["replication"]
    if stats["state"] != "committed":
        raise RuntimeError(f"snapshot {takes + 1} did not commit: {stats}")
    return {
        "snapshot_blocked_s": statistics.median(blocked),
        "snapshot_committed_s": statistics.median(replication),
        "replication_slowdown": slowdown(loop_s, n, step_s),
        "replication_training_s": loop_s,
        "step_ms": step_s * 1e3,
        "last_snapshot": takes + 1,
    }


SMALL_ROWS = 8  # the small state: LAYERS x (f32[8, COLS] by rows + f32[COLS]): 1.1 MiB, 144 shards


def small_snapshot_costs(cluster: Any, devices: list[Any], pool: str, takes: int) -> dict[str, Any]:
    """The fixed cost of a take: a 1 MiB state (its own `Snapshots`) taken `takes` times, each
    committed before the next (idle caller, as the full state's timed takes), against one
    memcpy of that state. Each take is of new arrays (a copy made before the timer starts), as
    a training step makes them: JAX builds an array's per-device arrays at their first use."""
    import jax

    from colocar.elastic.snapshots import Snapshots

    state = make_state(SMALL_ROWS, devices)
    memcpy = memcpy_s([s for host in host_shards(state, devices) for s in host], 7)
    renew = jax.jit(lambda tree: jax.tree.map(lambda x: x + 0, tree))
    blocked = []
    with Snapshots(cluster, replicas=1, pool=pool, name="bench-small") as snaps:
        assert snaps.take(0, state), "the small snapshot was skipped (pool too small)"
        snaps.wait(600)
        for k in range(1, takes + 1):
            state = jax.block_until_ready(renew(state))
            t0 = time.perf_counter()
            assert snaps.take(k, state), f"small snapshot {k} was skipped (pool too small)"
            blocked.append(time.perf_counter() - t0)
            snaps.wait(600)  # committed before the next, as the timed takes of the full state
        committed = snaps.stats()["committed"]
    if committed[-1] != takes:
        raise RuntimeError(f"the last small snapshot ({takes}) did not commit: committed {committed}")
    return {
        "small_snapshot_blocked_s": statistics.median(blocked),
        "small_memcpy_state_s": memcpy,
        "small_state_bytes": sum(leaf.nbytes for leaf in jax.tree.leaves(state)),
    }


def storage_saves(cluster: Any, paths: dict[str, str], state: dict[str, Any], baseline_s: float) -> dict:
    """The storage save on local disk with the training loop (`storage_save`), then one to the
    GCS emulator (idle caller: its durable time)."""
    from colocar.checkpoint import CheckpointManager

    mngr = CheckpointManager(paths["colocar"], cluster)
    try:
        out = storage_save(mngr, state, baseline_s)
    finally:
        mngr.close()
    mngr = CheckpointManager(paths["colocar_gcs"], cluster)
    try:
        t0 = time.monotonic()
        mngr.save(1, state)
        mngr.wait()
        out["gcs_save_durable_s"] = time.monotonic() - t0
    finally:
        mngr.close()
    return out


def storage_save(mngr: Any, state: dict[str, Any], baseline_s: float) -> dict[str, Any]:
    """A save with the training loop running from the moment `save` returned until durable."""
    step_s = steps_for(baseline_s)
    t0 = time.monotonic()
    mngr.save(1, state)
    blocked = time.monotonic() - t0
    loop_s, n = loop_until(mngr.wait)
    return {
        "save_blocked_s": blocked,
        "save_durable_s": time.monotonic() - t0,
        "save_slowdown": slowdown(loop_s, n, step_s),
        "save_training_s": loop_s,
    }


# --- the three recoveries (each timed from its start to the step finished) -------------------
def ram(snaps: Any, survivors: Survivors, expected_step: int) -> tuple[float, float]:
    """(a) the newest snapshot the survivors hold, restored onto their mesh, and a step; the
    seconds with the step and without it."""
    import jax

    t0 = time.monotonic()
    step_found = snaps.latest()
    if step_found != expected_step:
        raise AssertionError(f"snapshots: latest() gave {step_found}, expected {expected_step}")
    restored = jax.block_until_ready(snaps.restore(step_found, survivors.target))
    read = time.monotonic() - t0
    survivors.step(restored)
    took = time.monotonic() - t0
    survivors.check(restored, "snapshots")
    return took, read


def storage(cluster: Any, directory: str, survivors: Survivors) -> float:
    """(b) a `CheckpointManager` over the survivors (as the elastic manager reopens it), the
    newest committed step restored onto their mesh, and a step."""
    from colocar.checkpoint import CheckpointManager
    from colocar.elastic.policy.survivors import ClusterView, alive_hosts

    t0 = time.monotonic()
    view = ClusterView(cluster, alive_hosts(cluster))
    try:
        mngr = CheckpointManager(directory, view)
        try:
            restored = mngr.restore(mngr.latest_step(), target=survivors.target)
            survivors.step(restored)
            took = time.monotonic() - t0
            survivors.check(restored, "storage")
            del restored
        finally:
            mngr.close()
    finally:
        view.close()
    return took


def orbax(ckptr: Any, path: str, survivors: Survivors) -> float:
    """(c) Orbax restoring its save of the state onto the survivors' mesh, and a step."""
    t0 = time.monotonic()
    restored = ckptr.restore(path, target=survivors.target)
    survivors.step(restored)
    took = time.monotonic() - t0
    survivors.check(restored, "orbax")
    return took
